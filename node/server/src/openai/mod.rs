//! Wire types of the OpenAI API, as this node reads and writes them.
//!
//! Request structs accept and ignore fields they do not name (no `deny_unknown_fields`), so
//! clients that send newer or vendor fields keep working; a new field is one more `Option`.
//! Numbers a client may get wrong (`n`, `max_tokens`, `top_k`...) are read as `i64` and range
//! checked here, so the 400 names the field instead of failing inside serde.

pub(crate) mod chat;
pub(crate) mod completions;
pub(crate) mod responses;
pub(crate) mod structured;
pub(crate) mod tool_parser;
pub(crate) mod tools;
pub(crate) mod unsupported;

use std::collections::BTreeMap;

use pd_engine::SamplingParams;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub(crate) struct StreamOptions {
    /// Send a last chunk with `usage` (and `choices: []`) before `[DONE]`.
    #[serde(default)]
    pub(crate) include_usage: Option<bool>,
    /// vLLM extension: with `include_usage`, every chunk also carries the usage so far.
    #[serde(default)]
    pub(crate) continuous_usage_stats: Option<bool>,
}

/// Sampling fields shared by `/v1/completions` and `/v1/chat/completions` (flattened into both).
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct SamplingFields {
    #[serde(default)]
    pub(crate) n: Option<i64>,
    #[serde(default)]
    pub(crate) temperature: Option<f32>,
    #[serde(default)]
    pub(crate) top_p: Option<f32>,
    /// vLLM extension; 0 or -1 disable it.
    #[serde(default)]
    pub(crate) top_k: Option<i64>,
    #[serde(default)]
    pub(crate) seed: Option<i64>,
    #[serde(default)]
    pub(crate) stop: Option<Stop>,
    /// vLLM extension.
    #[serde(default)]
    pub(crate) stop_token_ids: Option<Vec<u32>>,
    /// vLLM extension.
    #[serde(default)]
    pub(crate) ignore_eos: Option<bool>,
    #[serde(default)]
    pub(crate) stream: Option<bool>,
    #[serde(default)]
    pub(crate) stream_options: Option<StreamOptions>,
    /// vLLM extension: add `token_ids` (and the prompt's) to the response.
    #[serde(default)]
    pub(crate) return_token_ids: Option<bool>,
    /// vLLM extension: prefix-cache hits only among requests with the same salt (tenant
    /// isolation); see [`cache_salt`].
    #[serde(default)]
    pub(crate) cache_salt: Option<String>,
    #[serde(default)]
    pub(crate) presence_penalty: Option<f32>,
    #[serde(default)]
    pub(crate) frequency_penalty: Option<f32>,
    /// vLLM extension.
    #[serde(default)]
    pub(crate) repetition_penalty: Option<f32>,
    /// vLLM extension.
    #[serde(default)]
    pub(crate) min_p: Option<f32>,
    /// Token id (as a string, OpenAI's form) → bias added to its logit.
    #[serde(default)]
    pub(crate) logit_bias: Option<BTreeMap<String, f32>>,
    /// vLLM extension (default true).
    #[serde(default)]
    pub(crate) skip_special_tokens: Option<bool>,
    /// vLLM extension: see `SamplingParams::min_tokens`.
    #[serde(default)]
    pub(crate) min_tokens: Option<i64>,
    /// vLLM extension: the logprob of every prompt token, with this many alternatives
    /// ([`PromptLogprobs`]). Not with `stream` (as in vLLM).
    #[serde(default)]
    pub(crate) prompt_logprobs: Option<i64>,
}

impl SamplingFields {
    /// Engine parameters for these fields; `max_tokens` and `logprobs` come from the endpoint.
    pub(crate) fn to_params(
        &self,
        max_tokens: (Option<i64>, &'static str),
        logprobs: Option<usize>,
    ) -> Result<SamplingParams, ApiError> {
        let defaults = SamplingParams::default();
        let n = match self.n {
            None => pd_wire::request::DEFAULT_N as usize,
            Some(n) => non_negative(n, "n")?,
        };
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) if k < 0 => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be -1, 0 or positive, got {k}"),
                ));
            }
            Some(k) => non_negative(k, "top_k")?,
        };
        let max_tokens = match max_tokens.0 {
            None => None,
            Some(m) => Some(non_negative(m, max_tokens.1)?),
        };
        Ok(SamplingParams {
            n,
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            top_k,
            // Any 64-bit pattern is a fine seed; negative seeds are as valid as positive ones.
            seed: self.seed.map(|s| s as u64),
            max_tokens,
            stop: self.stop.clone().map(Stop::into_vec).unwrap_or_default(),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            presence_penalty: self.presence_penalty.unwrap_or(defaults.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(defaults.frequency_penalty),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            logit_bias: logit_bias(self.logit_bias.as_ref())?,
            structured: None,
            skip_special_tokens: self
                .skip_special_tokens
                .unwrap_or(defaults.skip_special_tokens),
            min_tokens: match self.min_tokens {
                None => defaults.min_tokens,
                Some(m) => non_negative(m, "min_tokens")?,
            },
            prompt_logprobs: self.prompt_logprobs()?,
        })
    }

    /// `prompt_logprobs`, checked: not negative (vLLM's −1, the whole vocabulary, is not
    /// served), not with `stream`.
    fn prompt_logprobs(&self) -> Result<Option<usize>, ApiError> {
        let Some(k) = self.prompt_logprobs else {
            return Ok(None);
        };
        if self.stream() {
            return Err(ApiError::invalid(
                "prompt_logprobs",
                "prompt_logprobs are not available when stream is true",
            ));
        }
        if k < 0 {
            return Err(ApiError::invalid(
                "prompt_logprobs",
                format!(
                    "prompt_logprobs must be between 0 and {}, got {k}",
                    pd_engine::MAX_LOGPROBS
                ),
            ));
        }
        Ok(Some(non_negative(k, "prompt_logprobs")?))
    }

    pub(crate) fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub(crate) fn include_usage(&self) -> bool {
        self.stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// vLLM's `continuous_usage_stats` (only with `include_usage`, as in vLLM).
    pub(crate) fn continuous_usage(&self) -> bool {
        self.include_usage()
            && self
                .stream_options
                .and_then(|o| o.continuous_usage_stats)
                .unwrap_or(false)
    }

    pub(crate) fn return_token_ids(&self) -> bool {
        self.return_token_ids.unwrap_or(false)
    }
}

/// `logit_bias` as the engine takes it: token ids parsed from the keys, sorted, each once. The
/// engine checks the count, the values and the ids against the vocabulary.
fn logit_bias(map: Option<&BTreeMap<String, f32>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = map else {
        return Ok(Vec::new());
    };
    if map.len() > pd_engine::MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "at most {} logit_bias entries, got {}",
                pd_engine::MAX_LOGIT_BIAS,
                map.len()
            ),
        ));
    }
    let mut bias = map
        .iter()
        .map(|(key, &value)| match key.parse::<u32>() {
            Ok(token) => Ok((token, value)),
            Err(_) => Err(ApiError::invalid(
                "logit_bias",
                format!("logit_bias keys must be token ids, got {key:?}"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    bias.sort_by_key(|&(token, _)| token);
    if let Some(w) = bias.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("logit_bias names token {} twice", w[0].0),
        ));
    }
    Ok(bias)
}

/// Longest `cache_salt` accepted, in bytes.
pub(crate) const MAX_CACHE_SALT: usize = 1024;

/// A request's `cache_salt`, checked: absent, or a non-empty string of at most
/// [`MAX_CACHE_SALT`] bytes (a 400 naming the field otherwise).
pub(crate) fn cache_salt(salt: Option<&String>) -> Result<Option<String>, ApiError> {
    match salt {
        None => Ok(None),
        Some(s) if s.is_empty() => Err(ApiError::invalid(
            "cache_salt",
            "cache_salt must be a non-empty string",
        )),
        Some(s) if s.len() > MAX_CACHE_SALT => Err(ApiError::invalid(
            "cache_salt",
            format!("cache_salt is longer than {MAX_CACHE_SALT} bytes"),
        )),
        Some(s) => Ok(Some(s.clone())),
    }
}

/// `value` as a `usize`, or a 400 naming `param`.
pub(crate) fn non_negative(value: i64, param: &'static str) -> Result<usize, ApiError> {
    usize::try_from(value)
        .map_err(|_| ApiError::invalid(param, format!("{param} must be non-negative, got {value}")))
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then for each one an object
/// keyed by token id (as a string) holding the prompt token and its top alternatives, each
/// `{"logprob", "rank", "decoded_token"}`.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(transparent)]
pub(crate) struct PromptLogprobs(pub(crate) Vec<Option<PromptLogprobEntry>>);

/// One prompt position of [`PromptLogprobs`]: the prompt token first, then the alternatives
/// not already named, most likely first.
#[derive(Debug, Clone)]
pub(crate) struct PromptLogprobEntry(pub(crate) Vec<(u32, PromptLogprob)>);

/// A token's place in one prompt position's distribution.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PromptLogprob {
    pub(crate) logprob: f32,
    /// 1 for the most likely token.
    pub(crate) rank: u32,
    pub(crate) decoded_token: String,
}

impl Serialize for PromptLogprobEntry {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(id, lp)| (id.to_string(), lp)))
    }
}

impl PromptLogprobs {
    /// From the engine's logprobs of prompt tokens 1.. (`token_text` decodes one token).
    pub(crate) fn new(
        scored: &[pd_engine::TokenLogprob],
        token_text: impl Fn(u32) -> String,
    ) -> Self {
        let mut out = Vec::with_capacity(scored.len() + 1);
        out.push(None);
        for lp in scored {
            let mut entry = vec![(
                lp.token_id,
                PromptLogprob {
                    logprob: lp.logprob,
                    rank: lp.rank,
                    decoded_token: token_text(lp.token_id),
                },
            )];
            for (i, &(id, logprob)) in lp.top.iter().enumerate() {
                if id != lp.token_id {
                    entry.push((
                        id,
                        PromptLogprob {
                            logprob,
                            rank: i as u32 + 1,
                            decoded_token: token_text(id),
                        },
                    ));
                }
            }
            out.push(Some(PromptLogprobEntry(entry)));
        }
        Self(out)
    }
}

/// `usage` of completions and chat completions.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: usize,
    pub(crate) completion_tokens: usize,
    pub(crate) total_tokens: usize,
    pub(crate) prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    pub(crate) fn new(
        prompt_tokens: usize,
        cached_tokens: usize,
        pulled_tokens: usize,
        completion_tokens: usize,
    ) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens,
                kv_pulled_tokens: (pulled_tokens > 0).then_some(pulled_tokens),
            },
        }
    }
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct PromptTokensDetails {
    /// Prompt tokens not computed for this request: found in the prefix cache or pulled.
    pub(crate) cached_tokens: usize,
    /// Extension: of `cached_tokens`, those pulled from a prefill node (absent when none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) kv_pulled_tokens: Option<usize>,
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Serialize)]
pub(crate) struct ModelCard {
    pub(crate) id: String,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) owned_by: &'static str,
    pub(crate) root: String,
    pub(crate) parent: Option<String>,
    pub(crate) max_model_len: usize,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub(crate) struct ModelList {
    pub(crate) object: &'static str,
    pub(crate) data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_defaults_and_ranges() {
        let f: SamplingFields =
            serde_json::from_str(r#"{"stop": "x", "top_k": -1, "seed": -3}"#).unwrap();
        let p = f.to_params((Some(16), "max_tokens"), None).unwrap();
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert_eq!(p.top_k, 0);
        assert_eq!(p.n, 1);
        assert_eq!(p.max_tokens, Some(16));
        assert_eq!(p.seed, Some(-3i64 as u64));

        let f: SamplingFields = serde_json::from_str(r#"{"n": -2}"#).unwrap();
        let e = f.to_params((None, "max_tokens"), None).unwrap_err();
        assert_eq!(e.param(), Some("n"));

        let f: SamplingFields = serde_json::from_str(r#"{"stop": ["a", "b"]}"#).unwrap();
        let e = f
            .to_params((Some(-1), "max_completion_tokens"), None)
            .unwrap_err();
        assert_eq!(e.param(), Some("max_completion_tokens"));
    }

    /// Each request type reads every length field `pd_wire` names for its API, and the one
    /// `pd_wire` says wins does.
    #[test]
    fn length_limits_are_read_as_pd_wire_names_them() {
        use pd_wire::Api;
        use serde_json::{Value, json};

        fn read(api: Api, mut body: Value, set: &[(&str, i64)]) -> (Option<i64>, &'static str) {
            for (field, value) in set {
                body[*field] = json!(value);
            }
            match api {
                Api::ChatCompletions => serde_json::from_value::<chat::ChatCompletionRequest>(body)
                    .unwrap()
                    .max_tokens(),
                Api::Completions => serde_json::from_value::<completions::CompletionRequest>(body)
                    .unwrap()
                    .max_tokens(),
                Api::Responses => serde_json::from_value::<responses::ResponsesRequest>(body)
                    .unwrap()
                    .max_tokens(),
            }
        }
        for api in Api::ALL {
            let body = json!({"model": "m", (api.prompt_field()): []});
            for &field in api.max_tokens_fields() {
                assert_eq!(read(api, body.clone(), &[(field, 7)]), (Some(7), field));
            }
            let all: Vec<_> = api.max_tokens_fields().iter().map(|&f| (f, 7)).collect();
            assert_eq!(read(api, body, &all).1, api.max_tokens_fields()[0]);
        }
        let chat = json!({"messages": []});
        assert_eq!(
            read(
                Api::ChatCompletions,
                chat.clone(),
                &[("max_tokens", 9), ("max_completion_tokens", 5)]
            ),
            (Some(5), "max_completion_tokens")
        );
        assert_eq!(read(Api::ChatCompletions, chat, &[]), (None, "max_tokens"));
        // Completions' OpenAI default.
        assert_eq!(
            read(Api::Completions, json!({"prompt": "p"}), &[]),
            (Some(16), "max_tokens")
        );
        assert_eq!(
            read(Api::Responses, json!({"input": "x"}), &[]),
            (None, "max_output_tokens")
        );
    }
}
