//! A decision's inputs and output as JSON, with the WIT's own names: the one format of the
//! gateway's decision log (`GET /admin/decisions`, `--decision-log`), of `pd-gateway policy
//! test` cases and of `pd-gateway policy replay`.
//!
//! One record is one JSON object (one line in a JSONL log):
//!
//! ```json
//! {"wit": "pd:policy@1.0.0", "policy": "prefix-aware", "policy-sha256": "9f…", "time-ms": 1763880000000,
//!  "latency-ns": 8100, "fallback": false, "node-names": ["p0", "d0"],
//!  "request": {"seq": 7, "api": "chat-completions", "prompt-tokens": 40, "block-size": 16,
//!              "block-hashes": [123, 456], "prefix-blocks": [2, 0], "n": 1, "max-tokens": 16,
//!              "stream": false, "conversation-key": null},
//!  "view": {"nodes": [{"role": "prefill", "free-blocks": 900, "total-blocks": 1024, "leased-blocks": 0,
//!                      "waiting": 0, "running": 1, "waiting-remote-kv": 0, "draining": false,
//!                      "conversation-tokens": 0, "conversation-expiry-ms": 0}, …]},
//!  "decision": {"route": {"split": {"prefill": [0], "decode": [{"node": 1, "children": 1}]}},
//!               "reverse-pull": null}}
//! ```
//!
//! Field names are the WIT's (kebab-case), enum cases their WIT names, a variant an object with
//! one key (`split`, `whole`, `reject`), an `option` a value or `null`, node references view
//! indices. A test case is a record whose `decision` is the expected one; only `request`,
//! `view` and `decision` are required, and a missing `u32`/`bool` field of a node or request
//! reads as 0/false, so hand-written cases stay short.
//!
//! The view and the decision are the gateway's shapes ([`View`], a list of node objects;
//! [`Decision`], a split's decode targets as `{node, children}` objects): the host converts
//! them to and from the contract's columns for each call. What the nodes measure sits beside
//! the view in the contract's names, each left out when unknown (and read as 0, unknown, when
//! missing): the rates the nodes measured, one entry per node,
//! `"rates": [{"prefill-tokens-per-s": 2400, "pull-mb-per-s": 0}, …]`, and the model's
//! `"kv-bytes-per-token": 23040`.
//!
//! `time-ms` is also the guest's clock: the host's `now-ns` answers `time-ms × 10⁶` for the
//! whole call ([`crate::Installed::decide_at`]), so a replay that passes a record's `time-ms`
//! gives the guest the `now-ns` it read live; a record without one replays at 0.

use serde_json::{Map, Value, json};

use crate::{
    Api, Decision, DecodeTarget, Measured, Node, Rates, Rejection, Request, ReversePull, Role,
    Route,
};
use crate::{Split, View};

/// The package version of the contract records are written against.
pub const WIT_VERSION: &str = "pd:policy@1.0.0";

/// What a record's `wit` may say: [`WIT_VERSION`], or `pd:policy@0.1.0`, which gateways wrote
/// before the contract's 1.0.0 (a record's shape did not change, so their logs still replay).
const READABLE_WITS: [&str; 2] = [WIT_VERSION, "pd:policy@0.1.0"];

/// A record that does not read as the contract's types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct RecordError {
    /// Where in the record: `request.prompt-tokens`, `view.nodes[3].role`, …
    pub path: String,
    /// What is wrong there.
    pub message: String,
}

/// One decision: what the policy saw, what it answered, and who answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The request as the policy saw it.
    pub request: Request,
    /// The view as the policy saw it.
    pub view: View,
    /// What the nodes reported beside the view.
    pub measured: Measured,
    /// The decision (a case: the expected one).
    pub decision: Decision,
    /// Engine ids of the view's nodes (`node_names[i]` names `view.nodes[i]`); may be empty.
    pub node_names: Vec<String>,
    /// The policy that decided, as the gateway names it.
    pub policy: Option<String>,
    /// Hex sha256 of its component (none for a native policy).
    pub policy_sha256: Option<String>,
    /// When the gateway took the request, in milliseconds since the Unix epoch: what the
    /// policy's `now-ns` read (in ns), so a replay passes it again
    /// ([`crate::Installed::decide_at`]).
    pub time_ms: Option<u64>,
    /// How long the call took, host path included, in nanoseconds.
    pub latency_ns: Option<u64>,
    /// The policy failed and the built-in prefix-aware decided instead.
    pub fallback: bool,
}

impl Record {
    /// A record of `decision` for `request` and `view`, nothing else filled in.
    pub fn new(request: Request, view: View, decision: Decision) -> Self {
        Record {
            request,
            view,
            measured: Measured::default(),
            decision,
            node_names: Vec::new(),
            policy: None,
            policy_sha256: None,
            time_ms: None,
            latency_ns: None,
            fallback: false,
        }
    }

    /// The record as a JSON object (see the module docs).
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "wit": WIT_VERSION,
            "policy": self.policy,
            "policy-sha256": self.policy_sha256,
            "time-ms": self.time_ms,
            "latency-ns": self.latency_ns,
            "fallback": self.fallback,
            "node-names": self.node_names,
            "request": request_json(&self.request),
            "view": view_json(&self.view),
            "decision": decision_json(&self.decision),
        });
        if self.measured.rates.iter().any(|r| *r != Rates::default()) {
            v["rates"] = rates_json(&self.measured.rates);
        }
        if self.measured.kv_bytes_per_token > 0 {
            v["kv-bytes-per-token"] = json!(self.measured.kv_bytes_per_token);
        }
        v
    }

    /// Reads a record.
    ///
    /// # Errors
    ///
    /// [`RecordError`] naming the first field that is missing, of the wrong type or out of
    /// range, or a `wit` other than [`WIT_VERSION`].
    pub fn from_json(v: &Value) -> Result<Self, RecordError> {
        let o = object(v, "")?;
        if let Some(w) = o.get("wit").filter(|w| !w.is_null())
            && !w.as_str().is_some_and(|w| READABLE_WITS.contains(&w))
        {
            return Err(err("wit", format!("{w} is not {WIT_VERSION}")));
        }
        let opt_str = |key: &str| -> Result<Option<String>, RecordError> {
            match o.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(err(key, "not a string")),
            }
        };
        let opt_u64 = |key: &str| -> Result<Option<u64>, RecordError> {
            match o.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_u64().map(Some).ok_or_else(|| err(key, "not a u64")),
            }
        };
        let node_names = match o.get("node-names") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    n.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| err(&format!("node-names[{i}]"), "not a string"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(err("node-names", "not a list")),
        };
        Ok(Record {
            request: request_from(field(o, "", "request")?)?,
            view: view_from(field(o, "", "view")?)?,
            measured: Measured {
                rates: match o.get("rates") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(v) => rates_from(v)?,
                },
                kv_bytes_per_token: u32_or_zero(o, "", "kv-bytes-per-token")?,
            },
            decision: decision_from(field(o, "", "decision")?, "decision")?,
            node_names,
            policy: opt_str("policy")?,
            policy_sha256: opt_str("policy-sha256")?,
            time_ms: opt_u64("time-ms")?,
            latency_ns: opt_u64("latency-ns")?,
            fallback: o.get("fallback").and_then(Value::as_bool).unwrap_or(false),
        })
    }
}

fn err(path: &str, message: impl Into<String>) -> RecordError {
    RecordError {
        path: path.to_string(),
        message: message.into(),
    }
}

fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_string()
    } else {
        format!("{at}.{key}")
    }
}

fn object<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>, RecordError> {
    v.as_object()
        .ok_or_else(|| err(if at.is_empty() { "record" } else { at }, "not an object"))
}

fn field<'a>(o: &'a Map<String, Value>, at: &str, key: &str) -> Result<&'a Value, RecordError> {
    o.get(key).ok_or_else(|| err(&join(at, key), "missing"))
}

/// A `u32` field; missing or null reads as 0.
fn u32_or_zero(o: &Map<String, Value>, at: &str, key: &str) -> Result<u32, RecordError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(0),
        Some(v) => as_u32(v, &join(at, key)),
    }
}

fn as_u32(v: &Value, path: &str) -> Result<u32, RecordError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| err(path, format!("{v} is not a u32")))
}

fn bool_or_false(o: &Map<String, Value>, at: &str, key: &str) -> Result<bool, RecordError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(err(&join(at, key), format!("{v} is not a bool"))),
    }
}

fn u32_list(v: &Value, path: &str) -> Result<Vec<u32>, RecordError> {
    v.as_array()
        .ok_or_else(|| err(path, "not a list"))?
        .iter()
        .enumerate()
        .map(|(i, x)| as_u32(x, &format!("{path}[{i}]")))
        .collect()
}

/// Rates as JSON, in the contract's field names.
pub fn rates_json(rates: &[Rates]) -> Value {
    rates
        .iter()
        .map(|r| {
            json!({
                "prefill-tokens-per-s": r.prefill_tokens_per_s,
                "pull-mb-per-s": r.pull_mb_per_s,
            })
        })
        .collect()
}

fn rates_from(v: &Value) -> Result<Vec<Rates>, RecordError> {
    v.as_array()
        .ok_or_else(|| err("rates", "not a list"))?
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let at = format!("rates[{i}]");
            let o = object(r, &at)?;
            Ok(Rates {
                prefill_tokens_per_s: u32_or_zero(o, &at, "prefill-tokens-per-s")?,
                pull_mb_per_s: u32_or_zero(o, &at, "pull-mb-per-s")?,
            })
        })
        .collect()
}

/// The WIT name of an API.
pub fn api_name(api: Api) -> &'static str {
    match api {
        Api::ChatCompletions => "chat-completions",
        Api::Completions => "completions",
        Api::Responses => "responses",
    }
}

/// The WIT name of a role.
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Standalone => "standalone",
    }
}

/// `request` as JSON.
pub fn request_json(r: &Request) -> Value {
    json!({
        "seq": r.seq,
        "api": api_name(r.api),
        "prompt-tokens": r.prompt_tokens,
        "block-size": r.block_size,
        "block-hashes": r.block_hashes,
        "prefix-blocks": r.prefix_blocks,
        "n": r.n,
        "max-tokens": r.max_tokens,
        "stream": r.stream,
        "conversation-key": r.conversation_key,
    })
}

fn request_from(v: &Value) -> Result<Request, RecordError> {
    let at = "request";
    let o = object(v, at)?;
    let api = match o.get("api").and_then(Value::as_str) {
        None | Some("chat-completions") => Api::ChatCompletions,
        Some("completions") => Api::Completions,
        Some("responses") => Api::Responses,
        Some(other) => return Err(err("request.api", format!("unknown api `{other}`"))),
    };
    let block_hashes = match o.get("block-hashes") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => v
            .as_array()
            .ok_or_else(|| err("request.block-hashes", "not a list"))?
            .iter()
            .enumerate()
            .map(|(i, h)| {
                h.as_u64()
                    .ok_or_else(|| err(&format!("request.block-hashes[{i}]"), "not a u64"))
            })
            .collect::<Result<_, _>>()?,
    };
    let prefix_blocks = match o.get("prefix-blocks") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => u32_list(v, "request.prefix-blocks")?,
    };
    let max_tokens = match o.get("max-tokens") {
        None | Some(Value::Null) => None,
        Some(v) => Some(as_u32(v, "request.max-tokens")?),
    };
    let conversation_key = match o.get("conversation-key") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(err("request.conversation-key", "not a string")),
    };
    Ok(Request {
        seq: match o.get("seq") {
            None | Some(Value::Null) => 0,
            Some(v) => v.as_u64().ok_or_else(|| err("request.seq", "not a u64"))?,
        },
        api,
        prompt_tokens: u32_or_zero(o, at, "prompt-tokens")?,
        block_size: match o.get("block-size") {
            None | Some(Value::Null) => 16,
            Some(v) => as_u32(v, "request.block-size")?,
        },
        block_hashes,
        prefix_blocks,
        n: u32_or_zero(o, at, "n")?.max(1),
        max_tokens,
        stream: bool_or_false(o, at, "stream")?,
        conversation_key,
    })
}

/// `view` as JSON.
pub fn view_json(v: &View) -> Value {
    let nodes: Vec<Value> = v
        .nodes
        .iter()
        .map(|n| {
            json!({
                "role": role_name(n.role),
                "free-blocks": n.free_blocks,
                "total-blocks": n.total_blocks,
                "leased-blocks": n.leased_blocks,
                "waiting": n.waiting,
                "running": n.running,
                "waiting-remote-kv": n.waiting_remote_kv,
                "draining": n.draining,
                "conversation-tokens": n.conversation_tokens,
                "conversation-expiry-ms": n.conversation_expiry_ms,
            })
        })
        .collect();
    json!({ "nodes": nodes })
}

fn view_from(v: &Value) -> Result<View, RecordError> {
    let o = object(v, "view")?;
    let nodes = field(o, "view", "nodes")?
        .as_array()
        .ok_or_else(|| err("view.nodes", "not a list"))?
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let at = format!("view.nodes[{i}]");
            let o = object(n, &at)?;
            let role = match field(o, &at, "role")?.as_str() {
                Some("prefill") => Role::Prefill,
                Some("decode") => Role::Decode,
                Some("standalone") => Role::Standalone,
                _ => {
                    return Err(err(
                        &join(&at, "role"),
                        "not one of prefill, decode, standalone",
                    ));
                }
            };
            Ok(Node {
                role,
                free_blocks: u32_or_zero(o, &at, "free-blocks")?,
                total_blocks: u32_or_zero(o, &at, "total-blocks")?,
                leased_blocks: u32_or_zero(o, &at, "leased-blocks")?,
                waiting: u32_or_zero(o, &at, "waiting")?,
                running: u32_or_zero(o, &at, "running")?,
                waiting_remote_kv: u32_or_zero(o, &at, "waiting-remote-kv")?,
                draining: bool_or_false(o, &at, "draining")?,
                conversation_tokens: u32_or_zero(o, &at, "conversation-tokens")?,
                conversation_expiry_ms: u32_or_zero(o, &at, "conversation-expiry-ms")?,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(View { nodes })
}

/// `decision` as JSON (node references stay view indices).
pub fn decision_json(d: &Decision) -> Value {
    let route = match &d.route {
        Route::Split(s) => json!({"split": {
            "prefill": s.prefill,
            "decode": s.decode.iter().map(|t| json!({"node": t.node, "children": t.children})).collect::<Vec<_>>(),
        }}),
        Route::Whole(c) => json!({ "whole": c }),
        Route::Reject(r) => json!({"reject": {"status": r.status, "message": r.message}}),
    };
    json!({
        "route": route,
        "reverse-pull": d.reverse_pull.as_ref().map(|r| json!({"from": r.from, "min-tokens": r.min_tokens})),
    })
}

/// Reads a decision (`at` names it in errors).
///
/// # Errors
///
/// [`RecordError`] naming the first field that does not read.
pub fn decision_from(v: &Value, at: &str) -> Result<Decision, RecordError> {
    let o = object(v, at)?;
    let route_at = join(at, "route");
    let route = object(field(o, at, "route")?, &route_at)?;
    let (kind, body) = match route.iter().next() {
        Some(kv) if route.len() == 1 => kv,
        _ => {
            return Err(err(
                &route_at,
                "must have exactly one key: split, whole or reject",
            ));
        }
    };
    let here = join(&route_at, kind);
    let route = match kind.as_str() {
        "split" => {
            let s = object(body, &here)?;
            let prefill = u32_list(field(s, &here, "prefill")?, &join(&here, "prefill"))?;
            let decode_at = join(&here, "decode");
            let decode = field(s, &here, "decode")?
                .as_array()
                .ok_or_else(|| err(&decode_at, "not a list"))?
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let at = format!("{decode_at}[{i}]");
                    let t = object(t, &at)?;
                    Ok(DecodeTarget {
                        node: as_u32(field(t, &at, "node")?, &join(&at, "node"))?,
                        children: as_u32(field(t, &at, "children")?, &join(&at, "children"))?,
                    })
                })
                .collect::<Result<_, RecordError>>()?;
            Route::Split(Split { prefill, decode })
        }
        "whole" => Route::Whole(u32_list(body, &here)?),
        "reject" => {
            let r = object(body, &here)?;
            let status = field(r, &here, "status")?
                .as_u64()
                .and_then(|s| u16::try_from(s).ok())
                .ok_or_else(|| err(&join(&here, "status"), "not a u16"))?;
            let message = match r.get("message") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(m)) => m.clone(),
                Some(_) => return Err(err(&join(&here, "message"), "not a string")),
            };
            Route::Reject(Rejection { status, message })
        }
        other => {
            return Err(err(
                &route_at,
                format!("unknown route `{other}` (split, whole or reject)"),
            ));
        }
    };
    let rp_at = join(at, "reverse-pull");
    let reverse_pull = match o.get("reverse-pull") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let r = object(v, &rp_at)?;
            Some(ReversePull {
                from: as_u32(field(r, &rp_at, "from")?, &join(&rp_at, "from"))?,
                min_tokens: u32_or_zero(r, &rp_at, "min-tokens")?,
            })
        }
    };
    Ok(Decision {
        route,
        reverse_pull,
    })
}

#[cfg(test)]
mod tests;
