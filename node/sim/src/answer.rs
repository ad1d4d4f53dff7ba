//! The OpenAI bodies a simulated node answers: whole answers and stream chunks for
//! `/v1/chat/completions` and `/v1/completions`, in the shapes a real node writes.

use pd_wire::request::Api;
use serde_json::{Value, json};

/// What every part of one answer shares.
#[derive(Debug, Clone)]
pub(crate) struct Frame<'a> {
    /// The API the request came in on (chat or completions).
    pub(crate) api: Api,
    /// The answer's id (`chatcmpl-…`, `cmpl-…`).
    pub(crate) id: &'a str,
    /// The model named in the request.
    pub(crate) model: &'a str,
    /// Unix seconds.
    pub(crate) created: u64,
}

impl Frame<'_> {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::ChatCompletions, false) => "chat.completion",
            (Api::ChatCompletions, true) => "chat.completion.chunk",
            _ => "text_completion",
        }
    }

    /// A choice carrying `text` (a delta in a chunk).
    fn choice(&self, index: u32, text: &str, finish: Option<&str>, chunk: bool) -> Value {
        match (self.api, chunk) {
            (Api::ChatCompletions, false) => json!({
                "index": index, "finish_reason": finish, "logprobs": null,
                "message": {"role": "assistant", "content": text},
            }),
            (Api::ChatCompletions, true) => {
                let delta = if finish.is_some() {
                    json!({})
                } else {
                    json!({"role": "assistant", "content": text})
                };
                json!({"index": index, "delta": delta, "finish_reason": finish, "logprobs": null})
            }
            _ => json!({"index": index, "text": text, "finish_reason": finish, "logprobs": null}),
        }
    }

    /// A whole answer: one text per choice, each `completion_tokens / n` tokens long.
    pub(crate) fn whole(&self, texts: &[String], usage: Usage, kv: Option<Value>) -> Value {
        let choices: Vec<Value> = texts
            .iter()
            .zip(0u32..)
            .map(|(t, i)| self.choice(i, t, Some("length"), false))
            .collect();
        let mut body = json!({
            "id": self.id, "object": self.object(false), "created": self.created,
            "model": self.model, "choices": choices, "usage": usage.json(),
        });
        if let Some(kv) = kv {
            body["kv_transfer_params"] = kv;
        }
        body
    }

    /// A chunk carrying one token of choice `index`.
    pub(crate) fn token(&self, index: u32, text: &str) -> Value {
        self.chunk(vec![self.choice(index, text, None, true)])
    }

    /// The chunk that finishes choice `index`.
    pub(crate) fn finish(&self, index: u32) -> Value {
        self.chunk(vec![self.choice(index, "", Some("length"), true)])
    }

    /// The last chunk when the client asked for usage (`stream_options.include_usage`).
    pub(crate) fn usage(&self, usage: Usage) -> Value {
        let mut c = self.chunk(vec![]);
        c["usage"] = usage.json();
        c
    }

    fn chunk(&self, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "choices": choices,
        })
    }
}

/// Token counts of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Usage {
    /// Prompt tokens.
    pub(crate) prompt: usize,
    /// Generated tokens, every choice together.
    pub(crate) completion: usize,
}

impl Usage {
    fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt, "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
        })
    }
}

/// An OpenAI error object.
pub(crate) fn error(kind: &str, message: &str, param: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": null}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_follow_the_api() {
        let f = Frame {
            api: Api::ChatCompletions,
            id: "chatcmpl-1",
            model: "m",
            created: 1,
        };
        let w = f.whole(
            &["hi".into()],
            Usage {
                prompt: 3,
                completion: 1,
            },
            None,
        );
        assert_eq!(w["choices"][0]["message"]["content"], "hi");
        assert_eq!(w["usage"]["total_tokens"], 4);
        assert_eq!(f.token(0, " x")["choices"][0]["delta"]["content"], " x");
        assert_eq!(f.finish(0)["choices"][0]["finish_reason"], "length");
        let c = Frame {
            api: Api::Completions,
            ..f
        };
        let w = c.whole(
            &["a".into(), "b".into()],
            Usage {
                prompt: 1,
                completion: 2,
            },
            Some(json!({"k": 1})),
        );
        assert_eq!(w["object"], "text_completion");
        assert_eq!(w["choices"][1]["text"], "b");
        assert_eq!(w["kv_transfer_params"]["k"], 1);
        assert!(
            c.usage(Usage {
                prompt: 1,
                completion: 1
            })["choices"]
                .as_array()
                .unwrap()
                .is_empty()
        );
    }
}
