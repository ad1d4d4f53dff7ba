//! Deterministic output: the words a simulated node answers, a function of the prompt alone.
//!
//! Token `k` of completion `child` is one word picked by hashing the prompt's digest with `child`
//! and `k`, so a prefill node's first token, a decode node's continuation and a standalone node's
//! whole answer agree token for token: a router that splits a request must return exactly what
//! one node returns.

use serde_json::{Map, Value};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The vocabulary of the answers (each entry one token).
const WORDS: [&str; 32] = [
    " the",
    " a",
    " node",
    " cache",
    " block",
    " prefill",
    " decode",
    " pull",
    " lease",
    " token",
    " gateway",
    " route",
    " fast",
    " slow",
    " KV",
    " model",
    " answer",
    " is",
    " and",
    " of",
    " to",
    " in",
    " every",
    " one",
    " two",
    " three",
    " simulated",
    " request",
    " stream",
    " policy",
    " view",
    ".",
];

/// What a request's prompt is, as far as the simulator reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// Prompt length in tokens: the ids' count when the request carries `prompt_token_ids`, else
    /// an estimate (4 bytes of text per token).
    pub tokens: usize,
    /// The token ids when given (the gateway sends them to nodes that take them).
    pub ids: Option<Vec<u32>>,
    /// What the answer is derived from: the ids, or the prompt's JSON text.
    pub digest: u64,
}

impl Prompt {
    /// Reads the prompt of a request body: `prompt_token_ids`, else `prompt` (completions),
    /// `messages` (chat) or `input` (responses).
    pub fn of(body: &Map<String, Value>) -> Prompt {
        if let Some(ids) = body.get("prompt_token_ids").and_then(ids_of) {
            let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
            return Prompt {
                tokens: ids.len(),
                digest: xxh3_64(&bytes),
                ids: Some(ids),
            };
        }
        let text = ["prompt", "messages", "input"]
            .iter()
            .find_map(|f| body.get(*f))
            .map(Value::to_string)
            .unwrap_or_default();
        Prompt {
            tokens: text.len().div_ceil(4).max(1),
            ids: None,
            digest: xxh3_64(text.as_bytes()),
        }
    }
}

fn ids_of(v: &Value) -> Option<Vec<u32>> {
    let list = v.as_array()?;
    // A list of prompts' ids (completions): the first one.
    if let Some(first) = list.first().and_then(Value::as_array) {
        return first.iter().map(|t| t.as_u64().map(|t| t as u32)).collect();
    }
    list.iter().map(|t| t.as_u64().map(|t| t as u32)).collect()
}

/// Output token `k` of completion `child` for a prompt with this digest.
pub fn word(digest: u64, child: u32, k: usize) -> &'static str {
    let h = xxh3_64_with_seed(
        &(k as u64).to_le_bytes(),
        digest ^ u64::from(child).rotate_left(32),
    );
    WORDS[(h % WORDS.len() as u64) as usize]
}

/// Output tokens `0..count` of completion `child`, joined.
pub fn completion(digest: u64, child: u32, count: usize) -> String {
    (0..count).map(|k| word(digest, child, k)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn ids_decide_the_answer_when_given() {
        let a = Prompt::of(&map(json!({"prompt": "x", "prompt_token_ids": [1, 2, 3]})));
        let b = Prompt::of(&map(
            json!({"prompt": "other text", "prompt_token_ids": [1, 2, 3]}),
        ));
        assert_eq!(a, b);
        assert_eq!(a.tokens, 3);
        let c = Prompt::of(&map(json!({"prompt_token_ids": [[1, 2, 3, 4]]})));
        assert_eq!(c.tokens, 4);
    }

    #[test]
    fn text_is_estimated_and_hashed() {
        let p = Prompt::of(&map(
            json!({"messages": [{"role": "user", "content": "hello there"}]}),
        ));
        assert!(p.tokens > 5 && p.ids.is_none());
        let q = Prompt::of(&map(
            json!({"messages": [{"role": "user", "content": "hello there!"}]}),
        ));
        assert_ne!(p.digest, q.digest);
    }

    #[test]
    fn a_split_answer_equals_a_whole_one() {
        let whole = completion(42, 0, 8);
        let first = word(42, 0, 0);
        let rest: String = (1..8).map(|k| word(42, 0, k)).collect();
        assert_eq!(whole, format!("{first}{rest}"));
        assert_ne!(
            completion(42, 0, 8),
            completion(42, 1, 8),
            "children differ"
        );
        assert_ne!(completion(42, 0, 8), completion(43, 0, 8), "prompts differ");
    }
}
