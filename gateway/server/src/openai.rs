//! What the gateway reads from an OpenAI request and how it rewrites it for P and D.
//!
//! The body stays a JSON object end to end: the gateway forwards what the client sent (so
//! fields it does not know reach the node untouched) and changes only what the P/D protocol
//! needs (`kv_transfer_params`, and for P `max_tokens = 1`, `stream = false`, `n = 1`). The
//! prompt is rendered and tokenized with `pd_tokenize::prompt`, the same code the nodes run.

use pd_policy::Api;
use pd_tokenize::prompt::{self, ChatMessageIn, PromptKind};
use pd_wire::{KvTransferParams, RoutingFields, handoff};
use serde_json::{Map, Value};

use crate::error::GatewayError;

/// The request field of the P/D protocol.
pub use pd_wire::handoff::KV_FIELD;

/// The wire's name for an API (the policy contract has its own).
pub fn wire_api(api: Api) -> pd_wire::Api {
    match api {
        Api::ChatCompletions => pd_wire::Api::ChatCompletions,
        Api::Completions => pd_wire::Api::Completions,
        Api::Responses => pd_wire::Api::Responses,
    }
}

/// The three generation APIs and their paths.
pub fn api_of(path: &str) -> Option<Api> {
    pd_wire::Api::of_path(path).map(|a| match a {
        pd_wire::Api::ChatCompletions => Api::ChatCompletions,
        pd_wire::Api::Completions => Api::Completions,
        pd_wire::Api::Responses => Api::Responses,
    })
}

/// The label of an API in metrics.
pub fn api_label(api: Api) -> &'static str {
    wire_api(api).label()
}

/// The path of an API on a node.
pub fn api_path(api: Api) -> &'static str {
    wire_api(api).path()
}

/// The request field that holds an API's prompt, named in errors about it.
pub fn prompt_param(api: Api) -> &'static str {
    wire_api(api).prompt_field()
}

/// What routing needs from a request, read once.
#[derive(Debug)]
pub struct Analyzed {
    /// The API it came in on.
    pub api: Api,
    /// The `model` field.
    pub model: String,
    /// Completions asked for (`n`, 1 when absent; always 1 on `/v1/responses`).
    pub n: u32,
    /// The client's output limit, when set.
    pub max_tokens: Option<u32>,
    /// SSE asked for.
    pub stream: bool,
    /// `previous_response_id`, else `user`, else the `x-session-id` header.
    pub conversation_key: Option<String>,
    /// The prompt, to render and tokenize.
    pub prompt: PromptKind,
    /// vLLM's `cache_salt`: the prompt's block hashes start from it, as on the nodes.
    pub cache_salt: Option<String>,
    /// The answer scores the prompt itself (`echo` with `logprobs` on completions, vLLM's
    /// `prompt_logprobs`): only the node that computes the prompt can, so one node serves it.
    pub scores_prompt: bool,
    /// Prompts listed (a completions batch, answered by one node; `prompt` is the first, what
    /// routing looks at). 1 otherwise.
    pub prompts: usize,
}

/// How many prompts a `/v1/completions` body lists: its `prompt`'s length when that is a list
/// of strings or of id lists, else 1 (also for a body that does not parse: it fails later).
pub fn prompts_listed(raw: &[u8]) -> usize {
    #[derive(serde::Deserialize)]
    struct Prompt {
        #[serde(default)]
        prompt: Value,
    }
    match serde_json::from_slice::<Prompt>(raw).map(|p| p.prompt) {
        Ok(Value::Array(items)) if items.iter().all(|i| i.is_string() || i.is_array()) => {
            items.len().max(1)
        }
        _ => 1,
    }
}

fn bad(param: &'static str, message: impl Into<String>) -> GatewayError {
    GatewayError::invalid(param, message)
}

/// Reads the fields routing needs. Validation of everything else is the node's job (its 400s
/// pass through unchanged).
///
/// # Errors
/// A 400 naming the field: no `model`, a prompt of the wrong shape. (`previous_response_id` is
/// resolved before this, by the proxy: here it is only the conversation key.)
pub fn analyze(
    api: Api,
    body: &Map<String, Value>,
    session_header: Option<&str>,
) -> Result<Analyzed, GatewayError> {
    let RoutingFields {
        model,
        stream,
        n,
        max_tokens,
        cache_salt,
    } = RoutingFields::read(wire_api(api), body).map_err(|e| bad(e.param, e.message))?;
    let conversation_key = ["previous_response_id", "user"]
        .iter()
        .find_map(|k| body.get(*k).and_then(Value::as_str))
        .map(str::to_owned)
        .or_else(|| session_header.map(str::to_owned));
    let mut prompts = 1;
    let prompt = match api {
        Api::ChatCompletions => {
            let raw = body
                .get("messages")
                .ok_or_else(|| bad("messages", "messages is required"))?;
            let messages: Vec<ChatMessageIn> = serde_json::from_value(raw.clone())
                .map_err(|e| bad("messages", format!("messages: {e}")))?;
            let messages = prompt::chat_messages(&messages)?;
            // The tools go to the template too, read as the node reads them.
            match prompt::chat_tools(body.get("tools").filter(|t| !t.is_null())) {
                Some(tools) => PromptKind::ChatWithTools(messages, tools, "messages"),
                None => PromptKind::Chat(messages, "messages"),
            }
        }
        Api::Completions => {
            let raw = body
                .get("prompt")
                .ok_or_else(|| bad("prompt", "prompt is required"))?;
            let mut listed = prompt::completion_prompts(raw.clone())?;
            prompts = listed.len();
            PromptKind::Completion(listed.swap_remove(0))
        }
        Api::Responses => {
            let input = body
                .get("input")
                .ok_or_else(|| bad("input", "input is required"))?;
            let instructions = match body.get("instructions") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.as_str()),
                Some(v) => {
                    return Err(bad(
                        "instructions",
                        format!("instructions must be a string, got {v}"),
                    ));
                }
            };
            let messages = prompt::responses_messages(instructions, input)?;
            match prompt::responses_tools(body.get("tools").filter(|t| !t.is_null())) {
                Some(tools) => PromptKind::ChatWithTools(messages, tools, "input"),
                None => PromptKind::Chat(messages, "input"),
            }
        }
    };
    let set = |key: &str| body.get(key).is_some_and(|v| !v.is_null());
    let scores_prompt = match api {
        Api::Completions => {
            set("prompt_logprobs")
                || (body.get("echo") == Some(&Value::Bool(true)) && set("logprobs"))
        }
        Api::ChatCompletions => set("prompt_logprobs"),
        Api::Responses => false,
    };
    Ok(Analyzed {
        api,
        model,
        n,
        max_tokens,
        stream,
        conversation_key,
        prompt,
        cache_salt,
        scores_prompt,
        prompts,
    })
}

impl From<prompt::PromptError> for GatewayError {
    fn from(e: prompt::PromptError) -> Self {
        if e.source.is_some() {
            return GatewayError::Internal(crate::error::InternalError::Prompt(e.message));
        }
        GatewayError::InvalidRequest {
            message: e.message,
            param: Some(e.param.to_owned()),
        }
    }
}

/// The body for a prefill node ([`pd_wire::handoff::prefill_body`]).
pub fn prefill_body(api: Api, body: &Map<String, Value>, consumers: u32) -> Map<String, Value> {
    handoff::prefill_body(wire_api(api), body, consumers)
}

/// [`prefill_body`], serialized straight from the client's body
/// ([`pd_wire::handoff::prefill_bytes`]); with `held` (a retained turn's params,
/// `Holding::for_prefill`), P pulls that earlier turn's KV first.
///
/// # Errors
/// Serializing failed (a number serde_json cannot write).
pub fn prefill_bytes(
    api: Api,
    body: &Map<String, Value>,
    consumers: u32,
    held: Option<KvTransferParams>,
) -> Result<Vec<u8>, serde_json::Error> {
    handoff::prefill_bytes(wire_api(api), body, consumers, held)
}

/// Where to release P's lease if nobody pulls: the side channel and the lease in P's params.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseRef {
    /// `http://host:port` of P's KV side channel.
    pub side_channel: String,
    /// 32 hex digits.
    pub lease_id: String,
    /// The grant's generation.
    pub generation: u64,
    /// P's incarnation (`remote_engine_epoch`), 0 when P did not name it: a restarted P refuses
    /// a release naming its previous one.
    pub epoch: u64,
}

/// The lease P's params name, if they name one.
pub fn lease_of(params: &KvTransferParams) -> Option<LeaseRef> {
    Some(LeaseRef {
        side_channel: params.side_channel()?,
        lease_id: params.remote_lease_id.clone()?,
        generation: params.remote_lease_generation?,
        epoch: params.remote_engine_epoch.map_or(0, |e| e.0),
    })
}

pub use pd_wire::handoff::{PrefillAnswerError, decode_body, decode_bytes, prefill_params};

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_batch_weighs_its_prompts() {
        for (body, n) in [
            (r#"{"prompt": "one"}"#, 1),
            (r#"{"prompt": [1, 2, 3]}"#, 1),
            (r#"{"prompt": [[1, 2], [3]]}"#, 2),
            (r#"{"prompt": ["a", "b", "c"]}"#, 3),
            (r#"{"prompt": []}"#, 1),
            (r#"not json"#, 1),
        ] {
            assert_eq!(prompts_listed(body.as_bytes()), n, "{body}");
        }
    }

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn reads_the_routing_fields() {
        let body = obj(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "n": 3, "max_tokens": 9, "stream": true, "user": "u1"}),
        );
        let a = analyze(Api::ChatCompletions, &body, Some("s")).unwrap();
        assert_eq!((a.n, a.max_tokens, a.stream), (3, Some(9), true));
        assert_eq!(a.conversation_key.as_deref(), Some("u1"));
        let body = obj(json!({"model": "m", "prompt": "x", "stream": "yes"}));
        let e = analyze(Api::Completions, &body, None).unwrap_err();
        assert_eq!(e.status(), 400);
        // `previous_response_id` names the conversation before `user` and the header.
        let body =
            obj(json!({"model": "m", "input": "x", "previous_response_id": "r1", "user": "u"}));
        let a = analyze(Api::Responses, &body, Some("s")).unwrap();
        assert_eq!(a.conversation_key.as_deref(), Some("r1"));
        let e = analyze(Api::Completions, &obj(json!({"prompt": "x"})), None).unwrap_err();
        assert!(matches!(e, GatewayError::InvalidRequest { param: Some(p), .. } if p == "model"));
        // `cache_salt` is kept for hashing; anything but a non-empty string is a 400.
        let body = obj(json!({"model": "m", "prompt": "x", "cache_salt": "tenant"}));
        let a = analyze(Api::Completions, &body, None).unwrap();
        assert_eq!(a.cache_salt.as_deref(), Some("tenant"));
        for bad in [json!(""), json!(7)] {
            let body = obj(json!({"model": "m", "prompt": "x", "cache_salt": bad}));
            let e = analyze(Api::Completions, &body, None).unwrap_err();
            assert!(
                matches!(e, GatewayError::InvalidRequest { param: Some(p), .. } if p == "cache_salt")
            );
        }
    }

    #[test]
    fn prefill_asks_for_one_token_and_a_handoff() {
        let body =
            obj(json!({"model": "m", "input": "x", "stream": true, "max_output_tokens": 50}));
        let p = prefill_body(Api::Responses, &body, 1);
        assert_eq!(p["max_output_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert_eq!(p[KV_FIELD]["do_remote_decode"], true);
        assert!(p[KV_FIELD].get("num_consumers").is_none());
        let p = prefill_body(Api::Completions, &body, 3);
        assert_eq!(p[KV_FIELD]["num_consumers"], 3);
    }

    #[test]
    fn bytes_match_the_bodies() {
        let body = obj(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "n": 3, "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 9,
            "kv_transfer_params": {"x": 1}, "seed": 4}),
        );
        for api in [Api::ChatCompletions, Api::Completions, Api::Responses] {
            for consumers in [1, 2] {
                let bytes = prefill_bytes(api, &body, consumers, None).unwrap();
                let parsed: Map<String, Value> = serde_json::from_slice(&bytes).unwrap();
                assert_eq!(
                    parsed,
                    prefill_body(api, &body, consumers),
                    "{api:?} {consumers}"
                );
            }
        }
        let params =
            KvTransferParams::from_value(&json!({"do_remote_prefill": true, "remote_port": 9}))
                .unwrap();
        let parsed: Map<String, Value> =
            serde_json::from_slice(&decode_bytes(&body, &params).unwrap()).unwrap();
        assert_eq!(parsed, decode_body(&body, &params));
    }

    #[test]
    fn lease_from_params() {
        let params = json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": 9,
            "remote_lease_id": "ab", "remote_lease_generation": 2, "remote_engine_epoch": "00ff"});
        let l = lease_of(&KvTransferParams::from_value(&params).unwrap()).unwrap();
        assert_eq!(l.side_channel, "http://127.0.0.1:9");
        assert_eq!((l.generation, l.epoch), (2, 255));
        let body = serde_json::to_vec(&json!({"kv_transfer_params": [params]})).unwrap();
        assert_eq!(prefill_params(&body).unwrap()[0].remote_port, Some(9));
        assert!(prefill_params(b"{}").is_err());
        let bad = serde_json::to_vec(&json!({"kv_transfer_params": {"remote_port": "x"}})).unwrap();
        assert!(
            prefill_params(&bad)
                .unwrap_err()
                .to_string()
                .contains("remote_port")
        );
    }
}
