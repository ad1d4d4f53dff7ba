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
//! - the pre-tokenizer `ByteLevel { add_prefix_space: false, use_regex: true }` (GPT-2's split
//!   pattern), alone or after `Digits { individual_digits: true }` (SmolLM2), or
//!   `Split { pattern: Regex(R), behavior: Isolated, invert: false }` then
//!   `ByteLevel { add_prefix_space: false, use_regex: false }` (Llama 3, Qwen2: their own
//!   pattern `R`, the byte mapping alone after it);
//! - a BPE model without dropout;
//!
//! this module runs the same steps on plain `&str`s: the added tokens with `aho-corasick`
//! (leftmost-longest), each numeric character on its own, the split pattern with the same
//! `fancy-regex`, bytes mapped to GPT-2's characters, and the library's own BPE model for each word
//! (its merges, `ignore_merges` and its cache). About 3× faster (BENCHMARKS.md, "Tokenizer";
//! docs/bench-log/gateway.md, "Tokenizing without the bookkeeping"); every other tokenizer takes
//! the library's path. `tests/ids_only.rs` and the real model's test compare both paths on random
//! text.

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
    /// The split pattern: GPT-2's, or the `Split` pre-tokenizer's.
    split: Regex,
    /// GPT-2's `bytes_to_unicode`: the character standing for each byte.
    byte_char: [char; 256],
    /// The ids the post-processor puts before and after a single sequence when
    /// `add_special_tokens` is set (none, or `ByteLevel`: nothing; `TemplateProcessing`: its
    /// `single` template's special tokens, e.g. Llama 3's BOS). `None`: a post-processor this
    /// module does not run; such a tokenizer takes the fast path only without special tokens.
    post: Option<(Vec<u32>, Vec<u32>)>,
}

impl std::fmt::Debug for ByteLevelIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteLevelIds")
            .field("added_tokens", &self.added_ids.len())
            .field("digits", &self.digits)
            .field("post", &self.post)
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
        let byte_level = |v: &Json, use_regex: bool| {
            v.get("type") == Some(&json!("ByteLevel"))
                && v.get("add_prefix_space") == Some(&json!(false))
                && v.get("use_regex") == Some(&json!(use_regex))
        };
        // The pattern of an isolating regex split, as the library compiles it.
        let isolated_regex = |v: &Json| -> Option<String> {
            (v.get("type") == Some(&json!("Split"))
                && v.get("behavior") == Some(&json!("Isolated"))
                && v.get("invert") == Some(&json!(false)))
            .then(|| v.get("pattern")?.get("Regex")?.as_str().map(str::to_owned))
            .flatten()
        };
        let pre = serde_json::to_value(tok.get_pre_tokenizer()?).ok()?;
        let (digits, pattern) = if byte_level(&pre, true) {
            (false, GPT2_PATTERN.to_owned())
        } else {
            let seq = pre
                .get("type")
                .filter(|t| *t == "Sequence")
                .and(pre.get("pretokenizers"))?
                .as_array()?;
            match seq.as_slice() {
                [d, b]
                    if d == &json!({"type": "Digits", "individual_digits": true})
                        && byte_level(b, true) =>
                {
                    (true, GPT2_PATTERN.to_owned())
                }
                [s, b] if byte_level(b, false) => (false, isolated_regex(s)?),
                _ => return None,
            }
        };
        let post = match tok.get_post_processor() {
            None => Some((Vec::new(), Vec::new())),
            Some(p) => serde_json::to_value(p).ok().and_then(|p| post_ids(&p)),
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
            split: Regex::new(&pattern).ok()?,
            byte_char: bytes_to_unicode(),
            post,
        })
    }

    /// Whether [`ByteLevelIds::encode`] gives what the library's `encode_fast(text,
    /// add_special_tokens)` gives.
    pub(crate) fn serves(&self, add_special_tokens: bool) -> bool {
        !add_special_tokens || self.post.is_some()
    }

    /// The ids of `text` with `model` (the tokenizer's own BPE model), the post-processor's
    /// special tokens around them when `add_special_tokens` (see [`ByteLevelIds::serves`]).
    pub(crate) fn encode(
        &self,
        model: &ModelWrapper,
        text: &str,
        add_special_tokens: bool,
    ) -> tokenizers::Result<Vec<u32>> {
        let (before, after) = match (&self.post, add_special_tokens) {
            (Some((before, after)), true) => (before.as_slice(), after.as_slice()),
            _ => (&[][..], &[][..]),
        };
        let mut ids = Vec::with_capacity(before.len() + text.len() / 3 + 1 + after.len());
        ids.extend_from_slice(before);
        let mut out = Words {
            model,
            byte_char: &self.byte_char,
            word: String::new(),
            ids,
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
        out.ids.extend_from_slice(after);
        Ok(out.ids)
    }

    /// A stretch without added tokens: digits apart, then the split pattern.
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

    /// The split: each match a word, and what lies between matches too (`Isolated`, as the
    /// library splits with the pattern of `ByteLevel` and of `Split`).
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

/// What post-processor `p` (as the library serializes it) puts around a single sequence's
/// ids: nothing for `ByteLevel`; for `TemplateProcessing`, the ids of the special tokens of its
/// `single` template before and after its one sequence. `None` for anything else.
fn post_ids(p: &Json) -> Option<(Vec<u32>, Vec<u32>)> {
    match p.get("type")?.as_str()? {
        "ByteLevel" => Some((Vec::new(), Vec::new())),
        "TemplateProcessing" => {
            let specials = p.get("special_tokens")?;
            let (mut before, mut after) = (Vec::new(), Vec::new());
            let mut seen_sequence = false;
            for piece in p.get("single")?.as_array()? {
                if let Some(seq) = piece.get("Sequence") {
                    if seen_sequence || seq.get("id")? != "A" {
                        return None;
                    }
                    seen_sequence = true;
                    continue;
                }
                let name = piece.get("SpecialToken")?.get("id")?.as_str()?;
                let ids = specials.get(name)?.get("ids")?.as_array()?;
                let side = if seen_sequence {
                    &mut after
                } else {
                    &mut before
                };
                for id in ids {
                    side.push(u32::try_from(id.as_u64()?).ok()?);
                }
            }
            seen_sequence.then_some((before, after))
        }
        _ => None,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn post_processors_run_here_or_not_at_all() {
        let template = json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "pair": [],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                               "</s>": {"id": "</s>", "ids": [2, 3], "tokens": ["</s>", "x"]}}});
        assert_eq!(post_ids(&template), Some((vec![1], vec![2, 3])));
        assert_eq!(
            post_ids(&json!({"type": "ByteLevel", "trim_offsets": true})),
            Some((vec![], vec![]))
        );
        // Another post-processor, a template without its sequence or with an unknown token.
        assert_eq!(post_ids(&json!({"type": "RobertaProcessing"})), None);
        let mut no_seq = template.clone();
        no_seq["single"] = json!([{"SpecialToken": {"id": "<s>", "type_id": 0}}]);
        assert_eq!(post_ids(&no_seq), None);
        let mut unknown = template;
        unknown["single"][0]["SpecialToken"]["id"] = json!("<unk>");
        assert_eq!(post_ids(&unknown), None);
    }
}
