//! [`ByteLevelIds`]: the ids of a byte-level BPE tokenizer (GPT-2's family: SmolLM2, the test
//! models' byte tokenizer) without the library's per-character bookkeeping.
//!
//! `tokenizers`' `encode_fast` carries every piece of the text as a `NormalizedString` (an
//! alignment pair per byte), splits it three times and builds an `Encoding` (a `String` per
//! token, offsets, masks); the gateway and the nodes only want the ids. For the tokenizers
//! whose pipeline is exactly
//!
//! - no normalizer, no truncation, no padding;
//! - added tokens that all match literally (not `single_word`, `lstrip`, `rstrip` or
//!   `normalized`), split out first, leftmost-longest (the library's `AddedVocabulary`);
//! - the pre-tokenizer `ByteLevel { add_prefix_space: false, use_regex: true }`, alone or after
//!   `Digits { individual_digits: true }`;
//! - a BPE model without dropout;
//!
//! this module runs the same steps on plain `&str`s: the added tokens with `aho-corasick`
//! (leftmost-longest), each numeric character on its own, GPT-2's split pattern with the same
//! `fancy-regex`, bytes mapped to GPT-2's characters, and the library's own BPE model for each
//! word (its merges and its cache). About 3× faster (BENCHMARKS.md, "Tokenizing without the
//! bookkeeping"); every other tokenizer takes the library's path. `tests/ids_only.rs` and the
//! real model's test compare both paths on random text.

use aho_corasick::{AhoCorasick, MatchKind};
use fancy_regex::Regex;
use serde_json::{Value as Json, json};
use tokenizers::{Model, ModelWrapper};

use crate::byte_level::bytes_to_unicode;

/// GPT-2's split pattern, as `tokenizers`' `ByteLevel` pre-tokenizer compiles it.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// How to tokenize one eligible tokenizer to ids (see the module docs).
pub(crate) struct ByteLevelIds {
    /// The added tokens' contents, matched leftmost-longest.
    added: Option<AhoCorasick>,
    /// The id of each pattern of `added`.
    added_ids: Vec<u32>,
    /// `Digits { individual_digits: true }` runs first.
    digits: bool,
    split: Regex,
    /// GPT-2's `bytes_to_unicode`: the character standing for each byte.
    byte_char: [char; 256],
    /// The post-processor adds nothing to the ids (none, or `ByteLevel`): the fast path serves
    /// `add_special_tokens = true` too.
    post_adds_nothing: bool,
}

impl std::fmt::Debug for ByteLevelIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteLevelIds")
            .field("added_tokens", &self.added_ids.len())
            .field("digits", &self.digits)
            .field("post_adds_nothing", &self.post_adds_nothing)
            .finish()
    }
}

impl ByteLevelIds {
    /// The plan for `tok`, or `None` when its pipeline is not exactly one this module runs.
    pub(crate) fn for_tokenizer(tok: &tokenizers::Tokenizer) -> Option<Self> {
        if tok.get_normalizer().is_some()
            || tok.get_truncation().is_some()
            || tok.get_padding().is_some()
        {
            return None;
        }
        let ModelWrapper::BPE(bpe) = tok.get_model() else {
            return None;
        };
        if bpe.dropout.is_some() {
            return None;
        }
        let byte_level = |v: &Json| {
            v.get("type") == Some(&json!("ByteLevel"))
                && v.get("add_prefix_space") == Some(&json!(false))
                && v.get("use_regex") == Some(&json!(true))
        };
        let pre = serde_json::to_value(tok.get_pre_tokenizer()?).ok()?;
        let digits = if byte_level(&pre) {
            false
        } else {
            let seq = pre
                .get("type")
                .filter(|t| *t == "Sequence")
                .and(pre.get("pretokenizers"))?
                .as_array()?;
            match seq.as_slice() {
                [d, b]
                    if d == &json!({"type": "Digits", "individual_digits": true})
                        && byte_level(b) =>
                {
                    true
                }
                _ => return None,
            }
        };
        let post_adds_nothing = match tok.get_post_processor() {
            None => true,
            Some(p) => serde_json::to_value(p)
                .ok()?
                .get("type")
                .is_some_and(|t| t == "ByteLevel"),
        };
        let vocab = tok.get_added_vocabulary();
        if vocab.get_encode_special_tokens() {
            return None;
        }
        let mut patterns = Vec::new();
        let mut added_ids = Vec::new();
        for (id, t) in tok.get_added_tokens_decoder() {
            if t.single_word || t.lstrip || t.rstrip || t.normalized || t.content.is_empty() {
                return None;
            }
            patterns.push(t.content);
            added_ids.push(id);
        }
        let added = if patterns.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&patterns)
                    .ok()?,
            )
        };
        Some(Self {
            added,
            added_ids,
            digits,
            split: Regex::new(GPT2_PATTERN).ok()?,
            byte_char: bytes_to_unicode(),
            post_adds_nothing,
        })
    }

    /// Whether [`ByteLevelIds::encode`] gives what the library's `encode_fast(text,
    /// add_special_tokens)` gives.
    pub(crate) fn serves(&self, add_special_tokens: bool) -> bool {
        !add_special_tokens || self.post_adds_nothing
    }

    /// The ids of `text` with `model` (the tokenizer's own BPE model).
    pub(crate) fn encode(&self, model: &ModelWrapper, text: &str) -> tokenizers::Result<Vec<u32>> {
        let mut out = Words {
            model,
            byte_char: &self.byte_char,
            word: String::new(),
            ids: Vec::with_capacity(text.len() / 3 + 1),
        };
        match &self.added {
            None => self.pre_tokenized(&mut out, text)?,
            Some(added) => {
                let mut at = 0;
                for m in added.find_iter(text) {
                    self.pre_tokenized(&mut out, &text[at..m.start()])?;
                    out.ids.push(self.added_ids[m.pattern().as_usize()]);
                    at = m.end();
                }
                self.pre_tokenized(&mut out, &text[at..])?;
            }
        }
        Ok(out.ids)
    }

    /// A stretch without added tokens: digits apart, then GPT-2's split.
    fn pre_tokenized(&self, out: &mut Words<'_>, text: &str) -> tokenizers::Result<()> {
        if !self.digits {
            return self.split_words(out, text);
        }
        let mut at = 0;
        for (i, c) in text.char_indices() {
            if c.is_numeric() {
                self.split_words(out, &text[at..i])?;
                let end = i + c.len_utf8();
                self.split_words(out, &text[i..end])?;
                at = end;
            }
        }
        self.split_words(out, &text[at..])
    }

    /// GPT-2's split: each match a word, and what lies between matches too (the library splits
    /// with `Isolated`).
    fn split_words(&self, out: &mut Words<'_>, text: &str) -> tokenizers::Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let mut at = 0;
        for m in self.split.find_iter(text) {
            let m = m?;
            out.push(&text[at..m.start()])?;
            out.push(m.as_str())?;
            at = m.end();
        }
        out.push(&text[at..])
    }
}

/// The ids so far, and what turns one more word into ids.
struct Words<'a> {
    model: &'a ModelWrapper,
    byte_char: &'a [char; 256],
    /// The word being tokenized, as GPT-2's characters (reused).
    word: String,
    ids: Vec<u32>,
}

impl Words<'_> {
    /// `piece`'s bytes as GPT-2's characters, through the BPE model.
    fn push(&mut self, piece: &str) -> tokenizers::Result<()> {
        if piece.is_empty() {
            return Ok(());
        }
        self.word.clear();
        self.word
            .extend(piece.bytes().map(|b| self.byte_char[b as usize]));
        self.ids
            .extend(self.model.tokenize(&self.word)?.into_iter().map(|t| t.id));
        Ok(())
    }
}
