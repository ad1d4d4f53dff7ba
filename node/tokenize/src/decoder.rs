//! [`IncrementalDecoder`]: streaming detokenization of generated tokens.
//!
//! Decoding tokens one at a time is wrong in two ways: a multi-byte character may be split
//! across tokens (the first half decodes to U+FFFD), and decoders such as SentencePiece's
//! `Metaspace` treat the start of a string specially. The prefix/read offset algorithm of
//! TGI and vLLM (`detokenize_incrementally`) avoids both: it decodes a short window
//! `ids[prefix..]` and compares it with `ids[prefix..read]`, emitting the difference once it
//! no longer ends in U+FFFD.

use crate::error::TokenizeError;
use crate::tokenizer::Tokenizer;

/// How many prompt tokens [`IncrementalDecoder::with_context`] keeps as context (vLLM's 5).
const PROMPT_CONTEXT: usize = 5;

/// Streaming detokenizer for one sequence; created by [`Tokenizer::decoder`].
///
/// Holds no reference to the tokenizer, so it can live inside a sequence; pass the same
/// tokenizer to every call. Memory stays bounded: ids before the prefix offset are dropped.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    /// `ids[..read]` has been emitted; `ids[..prefix]` was dropped from the window.
    /// Invariant: `prefix <= read <= ids.len()`.
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    pub(crate) fn new(skip_special_tokens: bool) -> Self {
        Self {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            skip_special_tokens,
        }
    }

    /// Starts with the last few prompt ids as already-emitted context.
    pub(crate) fn with_context(skip_special_tokens: bool, prompt_ids: &[u32]) -> Self {
        let tail = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..];
        Self {
            ids: tail.to_vec(),
            prefix: 0,
            read: tail.len(),
            skip_special_tokens,
        }
    }

    /// Feeds one generated token; returns the newly complete text (may be "" while a
    /// multi-byte UTF-8 char is incomplete, or for a skipped special token).
    ///
    /// # Errors
    /// [`TokenizeError::Decode`] if the tokenizer's decoder fails.
    pub fn step(&mut self, tokenizer: &Tokenizer, token_id: u32) -> Result<String, TokenizeError> {
        self.ids.push(token_id);
        let (prefix_text, new_text) = self.window(tokenizer)?;
        if new_text.len() <= prefix_text.len() || new_text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let text = suffix_after(&new_text, &prefix_text).to_owned();
        self.advance();
        Ok(text)
    }

    /// Text still held back (e.g. an incomplete char at the end of generation), decoded
    /// lossily (incomplete bytes become U+FFFD). Afterwards nothing is pending.
    ///
    /// # Errors
    /// [`TokenizeError::Decode`] if the tokenizer's decoder fails.
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String, TokenizeError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let (prefix_text, new_text) = self.window(tokenizer)?;
        let text = if new_text.len() > prefix_text.len() {
            suffix_after(&new_text, &prefix_text).to_owned()
        } else {
            String::new()
        };
        self.advance();
        Ok(text)
    }

    /// Decodes `ids[prefix..read]` and `ids[prefix..]`.
    fn window(&self, tokenizer: &Tokenizer) -> Result<(String, String), TokenizeError> {
        let prefix_ids = self.ids.get(self.prefix..self.read).unwrap_or_default();
        let all_ids = self.ids.get(self.prefix..).unwrap_or_default();
        let prefix_text = tokenizer.decode(prefix_ids, self.skip_special_tokens)?;
        let new_text = tokenizer.decode(all_ids, self.skip_special_tokens)?;
        Ok((prefix_text, new_text))
    }

    /// Marks everything fed so far as emitted, and drops ids that left the window.
    fn advance(&mut self) {
        let drop = self.read;
        self.ids.drain(..drop);
        self.prefix = 0;
        self.read = self.ids.len();
    }
}

/// `new` without its first `prefix.len()` bytes, moved forward to a char boundary in case the
/// decoder changed earlier text.
fn suffix_after<'a>(new: &'a str, prefix: &str) -> &'a str {
    let mut start = prefix.len();
    while start < new.len() && !new.is_char_boundary(start) {
        start += 1;
    }
    new.get(start..).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::byte_level_tokenizer;

    #[test]
    fn multibyte_char_split_across_tokens() {
        let (_dir, tok) = byte_level_tokenizer();
        let mut dec = tok.decoder(false);
        // "é" is 0xC3 0xA9; with the byte-level tokenizer each byte is one token.
        assert_eq!(dec.step(&tok, 0xC3).ok().as_deref(), Some(""));
        assert_eq!(dec.step(&tok, 0xA9).ok().as_deref(), Some("é"));
        assert_eq!(dec.step(&tok, u32::from(b'!')).ok().as_deref(), Some("!"));
        assert_eq!(dec.flush(&tok).ok().as_deref(), Some(""));
    }

    #[test]
    fn streamed_text_equals_full_decode() {
        let (_dir, tok) = byte_level_tokenizer();
        let text = "héllo 👋 wörld, 日本語!";
        let ids = tok.encode(text, false).expect("encode");
        let mut dec = tok.decoder(false);
        let mut out = String::new();
        let mut empties = 0;
        for &id in &ids {
            let piece = dec.step(&tok, id).expect("step");
            empties += usize::from(piece.is_empty());
            out.push_str(&piece);
        }
        out.push_str(&dec.flush(&tok).expect("flush"));
        assert_eq!(out, text);
        // Each continuation byte of a multi-byte char yields "" once.
        assert_eq!(empties, text.len() - text.chars().count());
        // The window stays small.
        assert!(dec.ids.len() <= 1);
    }

    #[test]
    fn flush_emits_incomplete_char_lossily() {
        let (_dir, tok) = byte_level_tokenizer();
        let mut dec = tok.decoder(false);
        assert_eq!(dec.step(&tok, u32::from(b'a')).ok().as_deref(), Some("a"));
        // First two bytes of the 4-byte "👋" (F0 9F 91 8B).
        assert_eq!(dec.step(&tok, 0xF0).ok().as_deref(), Some(""));
        assert_eq!(dec.step(&tok, 0x9F).ok().as_deref(), Some(""));
        let rest = dec.flush(&tok).expect("flush");
        assert!(
            !rest.is_empty() && rest.chars().all(|c| c == '\u{FFFD}'),
            "{rest:?}"
        );
        assert_eq!(dec.flush(&tok).ok().as_deref(), Some(""));
    }

    #[test]
    fn special_tokens_skipped_or_kept() {
        let (_dir, tok) = byte_level_tokenizer();
        let im_end = crate::BYTE_LEVEL_IM_END_ID;
        let mut skip = tok.decoder(true);
        assert_eq!(skip.step(&tok, u32::from(b'x')).ok().as_deref(), Some("x"));
        assert_eq!(skip.step(&tok, im_end).ok().as_deref(), Some(""));
        assert_eq!(skip.step(&tok, u32::from(b'y')).ok().as_deref(), Some("y"));
        let mut keep = tok.decoder(false);
        assert_eq!(keep.step(&tok, im_end).ok().as_deref(), Some("<|im_end|>"));
    }

    #[test]
    fn prompt_context_is_not_emitted() {
        let (_dir, tok) = byte_level_tokenizer();
        let prompt = tok.encode("a prompt", false).expect("encode");
        let mut dec = tok.decoder_with_prompt(false, &prompt);
        assert_eq!(dec.step(&tok, u32::from(b'!')).ok().as_deref(), Some("!"));
    }

    #[test]
    fn decoder_is_send_clone() {
        fn assert_send_clone<T: Send + Clone>() {}
        assert_send_clone::<IncrementalDecoder>();
    }
}
