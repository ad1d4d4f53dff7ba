//! [`Vocabulary`]: the model's tokens as bytes, in llguidance's trie, and the compiler of
//! [`OutputSpec`]s into [`TokenMatcher`]s.

use std::collections::VecDeque;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use pd_tokenize::Tokenizer;
use serde_json::{Value, json};

use crate::{GrammarError, OutputSpec, TokenMatcher};

/// Every token of one model's vocabulary as the bytes it writes, built once at load and shared
/// (read-only) by every request's matcher.
pub struct Vocabulary {
    factory: ParserFactory,
    /// The model's EOS ids, sorted: any of them ends a constrained output where the
    /// constraint allows it to end.
    eos: Arc<[u32]>,
    /// Token ids the trie knows (the tokenizer's vocabulary); a model's padded rows beyond it
    /// are never allowed.
    size: usize,
    /// The last [`COMPILED_KEPT`] constraints compiled, at their start: a request repeating
    /// one (clients send the same schema over and over) clones it, sharing the lexer states
    /// its predecessors built instead of compiling and warming up anew.
    compiled: Mutex<VecDeque<(OutputSpec, TokenMatcher)>>,
}

/// Compiled constraints a [`Vocabulary`] keeps.
pub const COMPILED_KEPT: usize = 64;

impl fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vocabulary")
            .field("size", &self.size)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// The tokenizer as llguidance sees it: the trie, and the real tokenizer for the text
/// llguidance tokenizes itself (bytes the constraint forces, such as a JSON key).
struct TokenizerBytes {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TokenizerBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The real tokenizer's ids for `s` when they spell exactly `s`, else the trie's greedy
    /// ones. The real tokenizer may not: a Llama-2 style normalizer prepends a space (`{` →
    /// `▁{`), text naming a special token (`<|im_end|>` in a schema's `const`) encodes to that
    /// token, and bytes cut inside a character are not text. Forcing any of those would force
    /// other bytes than the constraint's.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        if let Ok(text) = std::str::from_utf8(s)
            && let Ok(ids) = self.tokenizer.encode(text, false)
            && self.trie.decode_raw(&ids) == s
        {
            return ids;
        }
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        true
    }
}

impl Vocabulary {
    /// Builds the trie of `tokenizer`'s vocabulary (its `tokenizer.json`: byte-level or
    /// byte-fallback BPE). `eos` are the ids that end generation; the first is the one the
    /// matcher allows where the constraint may end (the others are allowed with it).
    ///
    /// # Errors
    /// [`GrammarError::Unavailable`] for another kind of tokenizer, or without an EOS id.
    pub fn new(tokenizer: Arc<Tokenizer>, eos: &[u32]) -> Result<Self, GrammarError> {
        let unavailable = |m: String| GrammarError::Unavailable(m);
        let &tok_eos = eos
            .first()
            .ok_or_else(|| unavailable("the model has no EOS token".into()))?;
        let text = tokenizer
            .files()
            .get("tokenizer.json")
            .ok_or_else(|| unavailable("no tokenizer.json".into()))?;
        let json: Value =
            serde_json::from_str(text).map_err(|e| unavailable(format!("tokenizer.json: {e}")))?;
        let size = tokenizer.vocab_size();
        // llguidance's reader asserts on vocabularies it does not expect: a load-time check,
        // kept from taking the node down.
        let built = catch_unwind(AssertUnwindSafe(|| {
            let mut words =
                llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
            words.resize(size.max(words.len()), Vec::new());
            let info = TokRxInfo::new(words.len() as u32, tok_eos);
            let trie = TokTrie::from(&info, &words);
            let env: TokEnv = Arc::new(TokenizerBytes {
                trie,
                tokenizer: tokenizer.clone(),
            });
            let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            factory.quiet();
            // llguidance's default limits bound a compile and each mask; its verbose errors
            // would copy grammar and parser state into a client's 400.
            factory.limits_mut().verbose_errors = false;
            Ok::<_, String>((factory, words.len()))
        }));
        let (factory, size) = match built {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => return Err(unavailable(e)),
            Err(_) => return Err(unavailable("its vocabulary could not be read".into())),
        };
        let mut eos: Vec<u32> = eos.to_vec();
        eos.sort_unstable();
        eos.dedup();
        Ok(Self {
            factory,
            eos: eos.into(),
            size,
            compiled: Mutex::new(VecDeque::with_capacity(COMPILED_KEPT)),
        })
    }

    /// Compiles `spec` into a matcher at the start of the output.
    ///
    /// JSON is compiled compact: `,` and `:` as separators and no whitespace between tokens
    /// (`{"a":1,"b":[true]}`). llguidance's flexible whitespace is an unbounded run at every
    /// gap, and a small model left free to write it can write nothing else until `max_tokens`
    /// (vLLM's `disable_any_whitespace`, on by default here). A schema may set llguidance's own
    /// options under `x-guidance` instead.
    ///
    /// # Errors
    /// [`GrammarError::Invalid`] naming what is wrong with the schema, regex or grammar.
    pub fn compile(&self, spec: &OutputSpec) -> Result<TokenMatcher, GrammarError> {
        if let Some((_, m)) = self.kept().iter().find(|(s, _)| s == spec) {
            return Ok(m.clone());
        }
        let matcher = self.compile_new(spec)?;
        let mut compiled = self.kept();
        if compiled.len() == COMPILED_KEPT {
            compiled.pop_front();
        }
        compiled.push_back((spec.clone(), matcher.clone()));
        Ok(matcher)
    }

    /// The kept compiled constraints. A poisoned lock only means a panic elsewhere while the
    /// list was held; the list itself is still whole.
    fn kept(&self) -> std::sync::MutexGuard<'_, VecDeque<(OutputSpec, TokenMatcher)>> {
        self.compiled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// [`Vocabulary::compile`] without the kept ones.
    fn compile_new(&self, spec: &OutputSpec) -> Result<TokenMatcher, GrammarError> {
        let grammar = match spec {
            OutputSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)?),
            OutputSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&json!({"type": "object"}))?)
            }
            OutputSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            OutputSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError::Invalid("the list of choices is empty".into()));
                }
                // One string literal per choice (JSON string syntax is Lark's).
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| Value::from(c.as_str()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            OutputSpec::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(grammar)))
            .map_err(|_| GrammarError::Invalid("the constraint could not be compiled".into()))?
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(TokenMatcher::new(matcher, self.eos.clone(), self.size))
    }

    /// Token ids the trie knows.
    pub fn size(&self) -> usize {
        self.size
    }
}

/// `schema` with llguidance's compile options set to compact JSON, unless it sets its own
/// (`x-guidance`).
fn compact(schema: &Value) -> Result<Value, GrammarError> {
    let Value::Object(map) = schema else {
        if let Value::Bool(_) = schema {
            return Ok(schema.clone());
        }
        return Err(GrammarError::Invalid(
            "a JSON schema must be an object or a boolean".into(),
        ));
    };
    let mut map = map.clone();
    if !map.contains_key("x-guidance") {
        let options = JsonCompileOptions {
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        };
        let options = serde_json::to_value(options)
            .map_err(|e| GrammarError::Invalid(format!("JSON options: {e}")))?;
        map.insert("x-guidance".into(), options);
    }
    Ok(Value::Object(map))
}
