//! The fields of an OpenAI request that routing reads, read once, with OpenAI's precedence
//! rules written once. Everything else in a body is the node's to validate and passes through
//! the gateway untouched.

use serde_json::{Map, Value};

/// The three generation APIs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `/v1/chat/completions`.
    ChatCompletions,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses`.
    Responses,
}

impl Api {
    /// Every API.
    pub const ALL: [Api; 3] = [Api::ChatCompletions, Api::Completions, Api::Responses];

    /// The API served at `path`.
    pub fn of_path(path: &str) -> Option<Api> {
        Api::ALL.into_iter().find(|a| a.path() == path)
    }

    /// Its path.
    pub fn path(self) -> &'static str {
        match self {
            Api::ChatCompletions => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Responses => "/v1/responses",
        }
    }

    /// Its label in metrics.
    pub fn label(self) -> &'static str {
        match self {
            Api::ChatCompletions => "chat",
            Api::Completions => "completions",
            Api::Responses => "responses",
        }
    }

    /// The field that holds its prompt.
    pub fn prompt_field(self) -> &'static str {
        match self {
            Api::ChatCompletions => "messages",
            Api::Completions => "prompt",
            Api::Responses => "input",
        }
    }

    /// The fields that limit the answer's length, the one that wins first (chat:
    /// `max_completion_tokens`, then the deprecated `max_tokens`).
    pub fn max_tokens_fields(self) -> &'static [&'static str] {
        match self {
            Api::ChatCompletions => &["max_completion_tokens", "max_tokens"],
            Api::Completions => &["max_tokens"],
            Api::Responses => &["max_output_tokens"],
        }
    }

    /// Which length limit of a request wins: the first of [`Api::max_tokens_fields`] that
    /// `value_of` (a field's value, by name) finds set, and that field. With none set, `None`
    /// and the last field (chat: the deprecated `max_tokens`), the one an error about the
    /// unset limit names. Fields after the winner are not looked at.
    pub fn pick_max_tokens<T>(
        self,
        mut value_of: impl FnMut(&'static str) -> Option<T>,
    ) -> (Option<T>, &'static str) {
        let fields = self.max_tokens_fields();
        for &field in fields {
            if let Some(value) = value_of(field) {
                return (Some(value), field);
            }
        }
        (None, fields[fields.len() - 1])
    }
}

/// Completions asked for when a request does not set `n` (always, on `/v1/responses`, which
/// has no `n`).
pub const DEFAULT_N: u32 = 1;

/// A routing field that is not what it must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field.
    pub param: &'static str,
    /// What is wrong, for a person.
    pub message: String,
}

/// The fields routing reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingFields {
    /// `model`.
    pub model: String,
    /// `stream`.
    pub stream: bool,
    /// Completions asked for (`n`, [`DEFAULT_N`] when absent and on `/v1/responses`).
    pub n: u32,
    /// The client's output limit ([`Api::max_tokens_fields`]), when set.
    pub max_tokens: Option<u32>,
    /// vLLM's `cache_salt`: prefix-cache hashes start from it.
    pub cache_salt: Option<String>,
}

fn bad(param: &'static str, message: String) -> FieldError {
    FieldError { param, message }
}

fn set<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn opt_u32(body: &Map<String, Value>, key: &'static str) -> Result<Option<u32>, FieldError> {
    match set(body, key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                bad(
                    key,
                    format!("{key} must be a non-negative integer, got {v}"),
                )
            }),
    }
}

impl RoutingFields {
    /// Reads them from a request body on `api`.
    ///
    /// # Errors
    /// The first field that is missing or of the wrong type.
    pub fn read(api: Api, body: &Map<String, Value>) -> Result<Self, FieldError> {
        let model = match body.get("model") {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            Some(_) => return Err(bad("model", "model must be a non-empty string".into())),
            None => return Err(bad("model", "you must provide a model parameter".into())),
        };
        let stream = match set(body, "stream") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(bad("stream", format!("stream must be a boolean, got {v}"))),
        };
        let n = match api {
            Api::Responses => DEFAULT_N,
            _ => opt_u32(body, "n")?.unwrap_or(DEFAULT_N),
        };
        if n == 0 {
            return Err(bad("n", "n must be at least 1".into()));
        }
        // A malformed field is an error only where it would win.
        let max_tokens = api
            .pick_max_tokens(|key| opt_u32(body, key).transpose())
            .0
            .transpose()?;
        let cache_salt = match set(body, "cache_salt") {
            None => None,
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(v) => {
                return Err(bad(
                    "cache_salt",
                    format!("cache_salt must be a non-empty string, got {v}"),
                ));
            }
        };
        Ok(Self {
            model,
            stream,
            n,
            max_tokens,
            cache_salt,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(api: Api, v: Value) -> Result<RoutingFields, FieldError> {
        RoutingFields::read(api, v.as_object().unwrap())
    }

    #[test]
    fn precedence_and_defaults_follow_openai() {
        let r = read(
            Api::ChatCompletions,
            json!({"model": "m", "max_tokens": 9, "max_completion_tokens": 5, "n": 2}),
        )
        .unwrap();
        assert_eq!((r.max_tokens, r.n, r.stream), (Some(5), 2, false));
        let r = read(Api::ChatCompletions, json!({"model": "m", "max_tokens": 9})).unwrap();
        assert_eq!(r.max_tokens, Some(9));
        let r = read(
            Api::Responses,
            json!({"model": "m", "n": 4, "max_output_tokens": 3}),
        )
        .unwrap();
        assert_eq!((r.n, r.max_tokens), (1, Some(3)));
        let r = read(Api::Completions, json!({"model": "m", "stream": null})).unwrap();
        assert!(!r.stream);
        assert_eq!(Api::of_path("/v1/responses"), Some(Api::Responses));
    }

    #[test]
    fn the_first_length_limit_set_wins_and_is_named() {
        let chat = |mct: Option<i64>, mt: Option<i64>| {
            Api::ChatCompletions.pick_max_tokens(|f| match f {
                "max_completion_tokens" => mct,
                "max_tokens" => mt,
                _ => panic!("not a chat field: {f}"),
            })
        };
        assert_eq!(chat(Some(5), Some(9)), (Some(5), "max_completion_tokens"));
        assert_eq!(chat(None, Some(9)), (Some(9), "max_tokens"));
        assert_eq!(chat(None, None), (None, "max_tokens"));
        assert_eq!(
            Api::Completions.pick_max_tokens(|_| None::<i64>),
            (None, "max_tokens")
        );
        assert_eq!(
            Api::Responses.pick_max_tokens(|f| (f == "max_output_tokens").then_some(3)),
            (Some(3), "max_output_tokens")
        );
        // Nothing after the winner is read.
        let mut asked = Vec::new();
        Api::ChatCompletions.pick_max_tokens(|f| {
            asked.push(f);
            Some(1)
        });
        assert_eq!(asked, ["max_completion_tokens"]);
        // Through the routing reader: a malformed loser is not looked at, a malformed winner is
        // named.
        let r = read(
            Api::ChatCompletions,
            json!({"model": "m", "max_completion_tokens": 5, "max_tokens": "x"}),
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(5));
        let e = read(
            Api::ChatCompletions,
            json!({"model": "m", "max_completion_tokens": null, "max_tokens": "x"}),
        )
        .unwrap_err();
        assert_eq!(e.param, "max_tokens");
    }

    #[test]
    fn a_wrong_field_is_named() {
        assert_eq!(
            read(Api::Completions, json!({})).unwrap_err().param,
            "model"
        );
        assert_eq!(
            read(Api::Completions, json!({"model": "m", "n": 0}))
                .unwrap_err()
                .param,
            "n"
        );
        assert_eq!(
            read(
                Api::ChatCompletions,
                json!({"model": "m", "max_completion_tokens": -1})
            )
            .unwrap_err()
            .param,
            "max_completion_tokens"
        );
        assert_eq!(
            read(Api::Completions, json!({"model": "m", "cache_salt": ""}))
                .unwrap_err()
                .param,
            "cache_salt"
        );
    }
}
