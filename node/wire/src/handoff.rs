//! The prefill → decode hand-off as a proxy drives it over HTTP, written once for every proxy
//! that does: the gateway, and a decode node that runs the prefill named in
//! `x-prefiller-host-port` itself (behind an Endpoint Picker, as llm-d's sidecar does).
//!
//! 1. P gets the client's body answering with one token, not streamed, one completion, asking
//!    to hold the prompt's KV for `consumers` decode nodes ([`prefill_bytes`]);
//! 2. P's answer carries the `kv_transfer_params` naming its leased blocks
//!    ([`prefill_params`]);
//! 3. D gets the client's body with those params ([`decode_bytes`]), and pulls.

use serde_json::{Map, Value, json};

use crate::kv::{self, KvTransferParams, ParamsError};
use crate::request::Api;

/// The request field that carries the params.
pub const KV_FIELD: &str = "kv_transfer_params";

/// The header naming the prefill node (`host:port` of its OpenAI API) a decode node runs the
/// prompt on first: llm-d's routing sidecar protocol, set by an Endpoint Picker.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// What the prefill body changes: fields set (replacing the client's) and fields removed.
fn prefill_patch(
    api: Api,
    consumers: u32,
    held: Option<KvTransferParams>,
) -> (Vec<(&'static str, Value)>, &'static [&'static str]) {
    // One token, whichever length field the node reads (every one the API has), and one
    // completion (the Responses API has no `n`).
    let mut set: Vec<(&'static str, Value)> = api
        .max_tokens_fields()
        .iter()
        .map(|&field| (field, json!(1)))
        .collect();
    if api != Api::Responses {
        set.push(("n", json!(1)));
    }
    set.push(("stream", json!(false)));
    let kv = held.unwrap_or_else(|| KvTransferParams::produce(consumers));
    set.push((KV_FIELD, kv.to_value()));
    (set, &["stream_options"])
}

/// The body for a prefill node: the client's, answering with one token, not streamed, one
/// completion, and asking P to hold the prompt's KV for `consumers` decode nodes (each under a
/// lease of its own; `num_consumers` is sent only when more than one, so a vLLM prefill node
/// sees its own protocol).
pub fn prefill_body(api: Api, body: &Map<String, Value>, consumers: u32) -> Map<String, Value> {
    let (set, drop) = prefill_patch(api, consumers, None);
    let mut p = body.clone();
    for key in drop {
        p.remove(*key);
    }
    for (key, value) in set {
        p.insert(key.to_owned(), value);
    }
    p
}

/// [`prefill_body`], serialized straight from the client's body (no copy of its map). With
/// `held` (a retained turn's params), P is asked to pull that earlier turn's KV first (reverse
/// pull), then hand the whole prompt off as usual.
///
/// # Errors
/// Serializing failed (a number serde_json cannot write).
pub fn prefill_bytes(
    api: Api,
    body: &Map<String, Value>,
    consumers: u32,
    held: Option<KvTransferParams>,
) -> Result<Vec<u8>, serde_json::Error> {
    let (set, drop) = prefill_patch(api, consumers, held);
    serde_json::to_vec(&Patched {
        body,
        set: &set,
        drop,
    })
}

/// The body for a decode node: the client's, with P's params.
pub fn decode_body(body: &Map<String, Value>, params: &KvTransferParams) -> Map<String, Value> {
    let mut d = body.clone();
    d.insert(KV_FIELD.into(), params.to_value());
    d
}

/// [`decode_body`], serialized straight from the client's body (no copy of its map).
///
/// # Errors
/// Serializing failed (a number serde_json cannot write).
pub fn decode_bytes(
    body: &Map<String, Value>,
    params: &KvTransferParams,
) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(&Patched {
        body,
        set: &[(KV_FIELD, params.to_value())],
        drop: &[],
    })
}

/// A client body as serialized with some fields replaced or removed, written without copying
/// the client's map: its fields first (minus the changed ones), then the replacements.
struct Patched<'a> {
    body: &'a Map<String, Value>,
    set: &'a [(&'static str, Value)],
    drop: &'a [&'static str],
}

impl serde::Serialize for Patched<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        for (k, v) in self.body {
            if self.drop.contains(&k.as_str()) || self.set.iter().any(|(sk, _)| sk == k) {
                continue;
            }
            m.serialize_entry(k, v)?;
        }
        for (k, v) in self.set {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// Why a prefill node's answer cannot be decoded from.
#[derive(Debug, thiserror::Error)]
pub enum PrefillAnswerError {
    /// The body is not JSON.
    #[error("P's body: {0}")]
    NotJson(serde_json::Error),
    /// Its `kv_transfer_params` do not read.
    #[error("P's {0}")]
    Params(ParamsError),
    /// It carries none.
    #[error("P answered without kv_transfer_params")]
    NoParams,
    /// An object does not ask for a pull.
    #[error("P's kv_transfer_params do not ask for a pull: {0}")]
    NotAPull(Value),
}

/// The `kv_transfer_params` a prefill node answered with: one object per lease it granted (an
/// object is a list of one).
///
/// # Errors
/// P's body is not JSON, carries no params, or an object does not ask for a pull.
pub fn prefill_params(p_body: &[u8]) -> Result<Vec<KvTransferParams>, PrefillAnswerError> {
    /// P's answer as far as a proxy reads it: the rest (choices, usage) is skipped unparsed.
    #[derive(serde::Deserialize)]
    struct PrefillAnswer {
        kv_transfer_params: Option<Value>,
    }
    let v: PrefillAnswer = serde_json::from_slice(p_body).map_err(PrefillAnswerError::NotJson)?;
    let params = kv::read(v.kv_transfer_params.as_ref()).map_err(PrefillAnswerError::Params)?;
    if params.is_empty() {
        return Err(PrefillAnswerError::NoParams);
    }
    if let Some(p) = params.iter().find(|p| !p.do_remote_prefill) {
        return Err(PrefillAnswerError::NotAPull(p.to_value()));
    }
    Ok(params)
}
