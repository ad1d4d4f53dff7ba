//! `kv_transfer_params` on the wire, as vLLM's NixlConnector and its proxies speak it (pull
//! mode), plus our lease fields.
//!
//! Request side: a proxy asks a prefill node for `{"do_remote_decode": true, ...}` and copies
//! the object it gets back into the request to a decode node (`{"do_remote_prefill": true,
//! "remote_block_ids": [...], "remote_engine_id", "remote_request_id", "remote_host",
//! "remote_port", "tp_size", ...}`). A decode node also accepts a *list* of such objects, one per
//! child (seed PR #38900). A field of the wrong type is a 400 naming it; a pull request missing
//! a field is served without a pull, as vLLM does, and counted by the caller.
//!
//! Response side: a prefill node answers with the object above, plus `remote_num_tokens`,
//! `remote_lease_id`, `remote_lease_generation`, `remote_blocks_expiry_time` (Unix seconds) and
//! `remote_prompt_hash` (32 hex digits: the prompt's token ids bound under the cluster's key,
//! [`pd_kv_pool::prompt_binding`], checked by the decode node).
//!
//! The wire form is [`pd_wire::KvTransferParams`]; what a pull needs of it is parsed here into
//! the consumer's [`Remote`] (`pd_kv_transfer::consumer`), which checks and pulls it.

use pd_engine::KvHandoff;
use pd_kv_pool::{BindingKey, BlockId, LeaseId};
pub(crate) use pd_kv_transfer::consumer::Remote;
use pd_wire::{Hex64, Hex128, KvTransferParams};
use serde_json::Value;

use crate::error::ApiError;

/// The request field.
pub(crate) const FIELD: &str = "kv_transfer_params";

/// Most decode nodes one prefill may hand its KV to (`num_consumers`): each holds a lease, so
/// the bound caps what one request can make a producer hold.
pub(crate) const MAX_CONSUMERS: u64 = 16;

/// Largest `remote_block_size` accepted (tokens per block).
pub(crate) const MAX_BLOCK_SIZE: usize = 4096;

/// Debug builds only: `PD_INSECURE_BINDING_BITS=N` makes this node's prompt binding unkeyed and
/// N bits wide ([`BindingKey::insecure_unkeyed`]), so a test can find colliding prompts offline
/// and show what a weak binding lets through. Release builds ignore it.
pub(crate) const INSECURE_BINDING_BITS_ENV: &str = "PD_INSECURE_BINDING_BITS";

/// The node's prompt binding key, read once at start from the cluster token it was started
/// with (`--cluster-token`; empty: none, and a token the gateway mints later does not change
/// it, so every node of such a cluster holds the empty token's key). In a debug build
/// [`INSECURE_BINDING_BITS_ENV`] weakens it; a release build ignores the variable and says so.
pub(crate) fn binding_key(cluster_token: &str) -> BindingKey {
    let key = BindingKey::from_cluster_token(cluster_token);
    if cluster_token.is_empty() {
        tracing::debug!(
            "no cluster token: prompt bindings are only as strong as an unkeyed 128-bit hash"
        );
    }
    let Some(value) = std::env::var_os(INSECURE_BINDING_BITS_ENV) else {
        return key;
    };
    #[cfg(debug_assertions)]
    {
        let weak = value
            .to_str()
            .and_then(|v| v.parse().ok())
            .and_then(BindingKey::insecure_unkeyed);
        match weak {
            Some(weak) => {
                tracing::error!(
                    bits = weak.bits(),
                    "{INSECURE_BINDING_BITS_ENV} is set: prompt bindings are UNKEYED and this                      narrow, so clients can forge them (a test build's weakening; never serve so)"
                );
                weak
            }
            None => {
                tracing::warn!(
                    value = ?value,
                    "{INSECURE_BINDING_BITS_ENV} must be 1 to 128; ignored, bindings stay keyed"
                );
                key
            }
        }
    }
    #[cfg(not(debug_assertions))]
    {
        tracing::warn!(
            value = ?value,
            "{INSECURE_BINDING_BITS_ENV} is ignored: a release build's prompt bindings are always keyed"
        );
        key
    }
}

/// What a request's `kv_transfer_params` asks of this node.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum KvDirective {
    /// Absent, `null`, or neither flag set: an ordinary request.
    None,
    /// `do_remote_decode: true`: prefill here, hand the KV to `consumers` decode nodes
    /// (`num_consumers`, 1 when absent), each under a lease of its own. With the fields of a
    /// retained turn (`remote_block_ids`, `remote_engine_id`, `remote_host`, `remote_port`,
    /// `remote_lease_id`, `remote_lease_generation`: what a node with
    /// `--kv-retain-after-decode` answered the previous turn with), that prefix of the prompt
    /// is pulled first and only the rest computed (reverse pull).
    Produce {
        /// Decode nodes that will pull the prompt's KV, `1..=MAX_CONSUMERS`.
        consumers: usize,
        /// The earlier turn's KV to pull first (at most one).
        held: Vec<Remote>,
    },
    /// `do_remote_prefill: true` with everything needed: pull the prompt's KV. More than one
    /// object (one per child) may name the same blocks; the first drives the pull.
    Consume(Vec<Remote>),
    /// `do_remote_prefill: true` but `missing` is absent: served without a pull.
    Incomplete {
        /// The first missing field.
        missing: &'static str,
    },
}

/// A 400 naming `field` of the object at `at` (`kv_transfer_params`, or `kv_transfer_params.1`
/// in a list).
fn bad(at: &str, field: &str, message: &str) -> ApiError {
    ApiError::InvalidRequest {
        message: format!("{at}.{field} {message}"),
        param: Some(format!("{at}.{field}")),
    }
}

/// `0x…` hex digits as a lease id.
fn lease_id(at: &str, s: &str) -> Result<LeaseId, ApiError> {
    s.parse::<LeaseId>().map_err(|_| {
        bad(
            at,
            "remote_lease_id",
            &format!("must be 32 hex digits, got {s:?}"),
        )
    })
}

/// What one params object (read at `at`) asks of this node.
fn directive(at: &str, o: KvTransferParams) -> Result<KvDirective, ApiError> {
    if let Some(tp) = o.tp_size
        && tp != 1
    {
        return Err(bad(
            at,
            "tp_size",
            &format!("{tp} is not supported: nodes run with tp_size 1"),
        ));
    }
    let block_size = match o.remote_block_size {
        Some(0) => return Err(bad(at, "remote_block_size", "must be positive")),
        Some(n) if n as usize > MAX_BLOCK_SIZE => {
            return Err(bad(
                at,
                "remote_block_size",
                &format!("must be at most {MAX_BLOCK_SIZE}, got {n}"),
            ));
        }
        n => n.map(|n| n as usize),
    };
    let expiry = match o.remote_blocks_expiry_time {
        None => None,
        Some(secs) if secs.is_finite() && secs >= 0.0 => {
            std::time::Duration::try_from_secs_f64(secs)
                .ok()
                .and_then(|d| std::time::UNIX_EPOCH.checked_add(d))
        }
        Some(secs) => {
            return Err(bad(
                at,
                "remote_blocks_expiry_time",
                &format!("must be Unix seconds, got {secs}"),
            ));
        }
    };
    let lease = o
        .remote_lease_id
        .as_deref()
        .map(|s| lease_id(at, s))
        .transpose()?;
    if o.do_remote_decode && o.do_remote_prefill {
        return Err(ApiError::InvalidRequest {
            message: format!("{at} cannot ask for both do_remote_decode and do_remote_prefill"),
            param: Some(at.into()),
        });
    }
    // Where the KV is and how to claim it, or the first field missing.
    let remote = (|| {
        Ok(Remote {
            block_ids: o
                .remote_block_ids
                .clone()
                .ok_or("remote_block_ids")?
                .into_iter()
                .map(BlockId)
                .collect(),
            engine_id: o.remote_engine_id.clone().ok_or("remote_engine_id")?,
            request_id: o.remote_request_id.clone().ok_or("remote_request_id")?,
            host: o.remote_host.clone().ok_or("remote_host")?,
            port: o.remote_port.ok_or("remote_port")?,
            lease: lease.ok_or("remote_lease_id")?,
            generation: o.remote_lease_generation.ok_or("remote_lease_generation")?,
            num_tokens: o.remote_num_tokens.map(|n| n as usize),
            prompt_hash: o.remote_prompt_hash.map(|h| h.0),
            expiry,
            epoch: o.remote_engine_epoch.map(|e| e.0),
            board_slot: o.remote_lease_slot,
            block_size,
        })
    })();
    if o.do_remote_decode {
        let consumers = match o.num_consumers {
            None => 1,
            Some(n) if (1..=MAX_CONSUMERS).contains(&u64::from(n)) => n as usize,
            Some(n) => {
                return Err(bad(
                    at,
                    "num_consumers",
                    &format!("must be between 1 and {MAX_CONSUMERS}, got {n}"),
                ));
            }
        };
        // A retained turn to pull first: all of its fields, or none of it.
        let held = remote.ok().into_iter().collect();
        return Ok(KvDirective::Produce { consumers, held });
    }
    if !o.do_remote_prefill {
        return Ok(KvDirective::None);
    }
    Ok(match remote {
        Ok(r) => KvDirective::Consume(vec![r]),
        Err(missing) => KvDirective::Incomplete { missing },
    })
}

/// Parses a request's `kv_transfer_params` (absent, `null`, an object, or a list of objects).
///
/// # Errors
/// A 400 naming the field whose type is wrong, or a list that mixes directions.
pub(crate) fn parse(v: Option<&Value>) -> Result<KvDirective, ApiError> {
    let objects = pd_wire::kv::read(v).map_err(|e| ApiError::InvalidRequest {
        message: e.message,
        param: Some(e.param),
    })?;
    let listed = matches!(v, Some(Value::Array(_)));
    let parsed = objects
        .into_iter()
        .enumerate()
        .map(|(i, o)| {
            let at = if listed {
                format!("{FIELD}.{i}")
            } else {
                FIELD.to_owned()
            };
            directive(&at, o)
        })
        .collect::<Result<Vec<_>, _>>()?;
    match parsed.len() {
        0 => Ok(KvDirective::None),
        1 => Ok(parsed.into_iter().next().unwrap_or(KvDirective::None)),
        _ => {
            let mut out = parsed[0].clone();
            for p in &parsed[1..] {
                out = match (out, p) {
                    (KvDirective::Consume(mut a), KvDirective::Consume(b)) => {
                        a.extend(b.iter().cloned());
                        KvDirective::Consume(a)
                    }
                    (
                        i @ KvDirective::Incomplete { .. },
                        KvDirective::Consume(_) | KvDirective::Incomplete { .. },
                    ) => i,
                    (KvDirective::Consume(_), i @ KvDirective::Incomplete { .. }) => i.clone(),
                    (a, b) if a == *b => a,
                    _ => {
                        return Err(ApiError::InvalidRequest {
                            message: format!("the objects of a {FIELD} list disagree"),
                            param: Some(FIELD.into()),
                        });
                    }
                };
            }
            Ok(out)
        }
    }
}

/// What a prefill node tells proxies about itself.
#[derive(Debug, Clone)]
pub(crate) struct Advert {
    pub(crate) engine_id: String,
    /// This process's incarnation (`remote_engine_epoch`).
    pub(crate) epoch: u64,
    /// Host peers reach the KV side channel at (it may change once: when the gateway says
    /// where it saw a node bound to a wildcard address).
    pub(crate) host: tokio::sync::watch::Receiver<String>,
    /// KV side channel port.
    pub(crate) port: u16,
    /// Tokens per block of this node's pool (`remote_block_size`).
    pub(crate) block_size: usize,
    /// Where retained turns are reported to the gateways (`--gateway` with
    /// `--kv-retain-after-decode`), besides riding on the answer.
    pub(crate) turns: Option<std::sync::Arc<pd_report::RetainedTurns>>,
}

/// The response's `kv_transfer_params` for a prefill whose KV was handed off.
pub(crate) fn handoff(
    advert: &Advert,
    request_id: &str,
    h: &KvHandoff,
    prompt_hash: u128,
) -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: true,
        remote_prompt_hash: Some(Hex128(prompt_hash)),
        ..held(advert, request_id, h)
    }
}

/// The final response's `kv_transfer_params` for a finished turn whose blocks this node keeps
/// (`--kv-retain-after-decode`): `do_remote_decode: true`, so a proxy can copy the object as
/// it is into the next turn's request to a prefill node, which then pulls this prefix first.
/// (`remote_num_tokens` is the tokens held: prompt and generated, whole blocks only.)
pub(crate) fn retained(advert: &Advert, request_id: &str, h: &KvHandoff) -> KvTransferParams {
    KvTransferParams {
        do_remote_decode: true,
        // The gateway's conversation index keys the turn by it (the next turn's prompt, when
        // it repeats this one and its answer, hashes to the same chain).
        remote_last_block_hash: h.last_block_hash.map(Hex64),
        ..held(advert, request_id, h)
    }
}

/// A retained turn as the gateways are told of it: the answer's params, as they are.
pub(crate) fn reported(params: &KvTransferParams, h: &KvHandoff) -> pd_report::RetainedTurn {
    let (hash, tokens) = h.prompt_key.unwrap_or((0, 0));
    pd_report::RetainedTurn {
        lease_id: h.lease.to_string(),
        last_block_hash: h.last_block_hash.unwrap_or(0),
        params: params.to_value().to_string(),
        prompt_key: (hash, u32::try_from(tokens).unwrap_or(0)),
    }
}

fn held(advert: &Advert, request_id: &str, h: &KvHandoff) -> KvTransferParams {
    let expiry = h
        .deadline
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    KvTransferParams {
        remote_block_ids: Some(h.block_ids.iter().map(|b| b.0).collect()),
        remote_engine_id: Some(advert.engine_id.clone()),
        remote_engine_epoch: Some(Hex64(advert.epoch)),
        remote_request_id: Some(request_id.to_owned()),
        remote_host: Some(advert.host.borrow().clone()),
        remote_port: Some(advert.port),
        remote_block_size: u32::try_from(advert.block_size).ok(),
        tp_size: Some(1),
        remote_num_tokens: u32::try_from(h.num_tokens).ok(),
        remote_lease_id: Some(h.lease.to_string()),
        remote_lease_generation: Some(h.generation),
        remote_blocks_expiry_time: Some(expiry),
        remote_lease_slot: h.board_slot,
        ..KvTransferParams::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(v: Value) -> Result<KvDirective, ApiError> {
        parse(Some(&v))
    }

    fn full() -> Value {
        json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [3, 4, 9], "remote_engine_id": "p1", "remote_request_id": "cmpl-1",
            "remote_host": "127.0.0.1", "remote_port": 7000, "tp_size": 1,
            "remote_num_tokens": 40, "remote_lease_id": "000000000000000000000000000000ff",
            "remote_lease_generation": 2,
            "remote_prompt_hash": "000000000000000000000000000000ff"
        })
    }

    #[test]
    fn vllm_prefill_request_and_empty_forms() {
        let proxy_to_p = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
        assert_eq!(
            p(proxy_to_p).unwrap(),
            KvDirective::Produce {
                consumers: 1,
                held: Vec::new()
            }
        );
        let two = json!({"do_remote_decode": true, "num_consumers": 2});
        assert_eq!(
            p(two).unwrap(),
            KvDirective::Produce {
                consumers: 2,
                held: Vec::new()
            }
        );
        for bad in [json!(0), json!(17), json!("2"), json!(-1)] {
            let e = p(json!({"do_remote_decode": true, "num_consumers": bad})).unwrap_err();
            assert!(
                matches!(&e, ApiError::InvalidRequest { param: Some(f), .. } if f == "kv_transfer_params.num_consumers"),
                "{e:?}"
            );
        }
        assert_eq!(parse(None).unwrap(), KvDirective::None);
        assert_eq!(p(Value::Null).unwrap(), KvDirective::None);
        assert_eq!(p(json!({})).unwrap(), KvDirective::None);
    }

    #[test]
    fn complete_decode_params_and_the_list_form() {
        let KvDirective::Consume(r) = p(full()).unwrap() else {
            panic!()
        };
        assert_eq!(r[0].block_ids, vec![BlockId(3), BlockId(4), BlockId(9)]);
        assert_eq!(
            (r[0].port, r[0].generation, r[0].prompt_hash),
            (7000, 2, Some(255))
        );
        assert_eq!(r[0].side_channel(), "http://127.0.0.1:7000");
        let KvDirective::Consume(r) = p(json!([full(), full(), full()])).unwrap() else {
            panic!()
        };
        assert_eq!(r.len(), 3);
    }

    #[test]
    fn missing_fields_mean_no_pull_and_name_the_field() {
        for f in [
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "remote_lease_id",
        ] {
            let mut v = full();
            v.as_object_mut().unwrap().remove(f);
            assert_eq!(p(v).unwrap(), KvDirective::Incomplete { missing: f });
        }
    }

    #[test]
    fn wrong_types_are_400_naming_the_field() {
        for (f, bad) in [
            ("remote_block_ids", json!("1,2")),
            ("remote_block_ids", json!([1, -2])),
            ("remote_port", json!(70000)),
            ("remote_port", json!("80")),
            ("do_remote_prefill", json!("yes")),
            ("remote_lease_id", json!("not-hex")),
            ("tp_size", json!(2)),
        ] {
            let mut v = full();
            v[f] = bad;
            let e = p(v).unwrap_err();
            assert_eq!(e.param(), Some(format!("{FIELD}.{f}").as_str()), "{f}");
        }
        assert_eq!(p(json!(3)).unwrap_err().param(), Some(FIELD));
        let both = json!({"do_remote_decode": true, "do_remote_prefill": true});
        assert_eq!(p(both).unwrap_err().param(), Some(FIELD));
    }

    #[test]
    fn handoff_round_trips_through_a_proxy() {
        let advert = Advert {
            engine_id: "p1".into(),
            epoch: u64::MAX - 1,
            host: tokio::sync::watch::channel("127.0.0.1".to_owned()).1,
            port: 7000,
            block_size: 16,
            turns: None,
        };
        let h = KvHandoff {
            lease: LeaseId(0xabc),
            generation: 5,
            deadline: std::time::SystemTime::now(),
            block_ids: vec![BlockId(1), BlockId(2)],
            num_tokens: 7,
            last_block_hash: None,
            prompt_key: None,
            board_slot: Some(3),
        };
        let prompt = [1, 2, 3, 4, 5, 6, 7];
        let binding = pd_kv_pool::prompt_binding(&BindingKey::from_cluster_token("t"), &prompt);
        let v = handoff(&advert, "cmpl-9", &h, binding).to_value();
        let KvDirective::Consume(r) = p(v).unwrap() else {
            panic!()
        };
        assert_eq!(r[0].lease, LeaseId(0xabc));
        assert_eq!(r[0].block_ids, h.block_ids);
        assert_eq!(r[0].num_tokens, Some(7));
        assert_eq!(r[0].prompt_hash, Some(binding));
        assert_eq!(r[0].epoch, Some(u64::MAX - 1));
        assert_eq!(r[0].board_slot, Some(3));
    }
}

/// Builds a prefill's response `kv_transfer_params` from the request's events.
#[derive(Debug, Clone)]
pub(crate) struct KvReply {
    advert: Option<Advert>,
    request_id: String,
    prompt_hash: u128,
    /// One object per lease granted, in grant order.
    params: Vec<KvTransferParams>,
    /// The finished turn's retained blocks, when kept.
    retained: Option<KvTransferParams>,
}

impl KvReply {
    /// For request `request_id` of `prompt`, bound under `key`; `advert` is set on a node that
    /// produces.
    pub(crate) fn new(
        advert: Option<Advert>,
        request_id: &str,
        prompt: &[u32],
        key: &BindingKey,
    ) -> Self {
        // Only a producer's handoff names it.
        let prompt_hash = match advert {
            Some(_) => pd_kv_pool::prompt_binding(key, prompt),
            None => 0,
        };
        Self {
            advert,
            request_id: request_id.to_string(),
            prompt_hash,
            params: Vec::new(),
            retained: None,
        }
    }

    /// Notes a handoff when `event` is one.
    pub(crate) fn observe(&mut self, event: &pd_engine::RequestEvent) {
        match (event, &self.advert) {
            (pd_engine::RequestEvent::KvReady(h), Some(advert)) => {
                self.params
                    .push(handoff(advert, &self.request_id, h, self.prompt_hash));
            }
            (pd_engine::RequestEvent::Retained(h), Some(advert)) => {
                let params = retained(advert, &self.request_id, h);
                if let Some(turns) = &advert.turns {
                    turns.add(reported(&params, h));
                }
                self.retained = Some(params);
            }
            _ => {}
        }
    }

    /// The response's `kv_transfer_params`, once the handoff happened: one object (vLLM's
    /// shape) for one consumer, a list of one object per consumer for more; on a node that
    /// retained the finished turn, the retained blocks' object.
    pub(crate) fn params(&self) -> Option<Value> {
        match self.params.as_slice() {
            [] => self.retained.as_ref().map(KvTransferParams::to_value),
            [one] => Some(one.to_value()),
            many => Some(Value::Array(
                many.iter().map(KvTransferParams::to_value).collect(),
            )),
        }
    }
}
