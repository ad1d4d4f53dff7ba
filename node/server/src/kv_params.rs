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
//! `remote_prompt_hash` (hex xxh3 of the prompt's token ids, checked by the decode node).

use pd_engine::KvHandoff;
use pd_kv_pool::{BlockId, LeaseId, block_hash};
use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// The request field.
pub(crate) const FIELD: &str = "kv_transfer_params";

/// Most decode nodes one prefill may hand its KV to (`num_consumers`): each holds a lease, so
/// the bound caps what one request can make a producer hold.
pub(crate) const MAX_CONSUMERS: u64 = 16;

/// Largest `remote_block_size` accepted (tokens per block).
pub(crate) const MAX_BLOCK_SIZE: usize = 4096;

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
        held: Vec<RemotePrefill>,
    },
    /// `do_remote_prefill: true` with everything needed: pull the prompt's KV. More than one
    /// object (one per child) may name the same blocks; the first drives the pull.
    Consume(Vec<RemotePrefill>),
    /// `do_remote_prefill: true` but `missing` is absent: served without a pull.
    Incomplete {
        /// The first missing field.
        missing: &'static str,
    },
}

/// Where a prompt's KV is and how to claim it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RemotePrefill {
    pub(crate) block_ids: Vec<BlockId>,
    pub(crate) engine_id: String,
    pub(crate) request_id: String,
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) lease: LeaseId,
    pub(crate) generation: u64,
    /// Prompt tokens the blocks hold, when the producer said.
    pub(crate) num_tokens: Option<usize>,
    /// xxh3 of the producer's prompt token ids, when it said.
    pub(crate) prompt_hash: Option<u64>,
    /// When the lease ends unless renewed (`remote_blocks_expiry_time`), when the producer said.
    pub(crate) expiry: Option<std::time::SystemTime>,
    /// The producer's incarnation (`remote_engine_epoch`, 16 hex digits), when it said: a
    /// cached handshake with another epoch is redone before any read.
    pub(crate) epoch: Option<u64>,
    /// The lease's record on the producer's lease board (`remote_lease_slot`), when it said:
    /// the lease is confirmed by reading it right after the blocks, without a round trip.
    pub(crate) board_slot: Option<u32>,
    /// Tokens per block of the producer's pool (`remote_block_size`), when it said; absent: the
    /// same as ours. The handshake's word decides: a pull from a producer whose blocks are of
    /// another size than this says fails as a mismatch.
    pub(crate) block_size: Option<usize>,
}

impl RemotePrefill {
    /// The producer's side channel, as a tonic endpoint URI.
    pub(crate) fn side_channel(&self) -> String {
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("http://[{}]:{}", self.host, self.port)
        } else {
            format!("http://{}:{}", self.host, self.port)
        }
    }
}

/// Hash of a prompt's token ids as carried in `remote_prompt_hash`.
pub(crate) fn prompt_hash(tokens: &[u32]) -> u64 {
    block_hash(None, tokens).0
}

fn bad(field: &str, message: String) -> ApiError {
    ApiError::InvalidRequest {
        message,
        param: Some(format!("{FIELD}.{field}")),
    }
}

fn get<'a>(o: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
}

fn boolean(o: &Map<String, Value>, k: &str) -> Result<bool, ApiError> {
    match get(o, k) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(bad(k, format!("{FIELD}.{k} must be a boolean, got {v}"))),
    }
}

fn string(o: &Map<String, Value>, k: &str) -> Result<Option<String>, ApiError> {
    match get(o, k) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(bad(k, format!("{FIELD}.{k} must be a string, got {v}"))),
    }
}

fn unsigned(o: &Map<String, Value>, k: &str, max: u64) -> Result<Option<u64>, ApiError> {
    match get(o, k) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= max => Ok(Some(n)),
            _ => Err(bad(
                k,
                format!("{FIELD}.{k} must be an integer between 0 and {max}, got {v}"),
            )),
        },
    }
}

/// Parses one params object.
fn parse_one(v: &Value) -> Result<KvDirective, ApiError> {
    let Value::Object(o) = v else {
        return Err(ApiError::InvalidRequest {
            message: format!("{FIELD} must be an object or a list of objects, got {v}"),
            param: Some(FIELD.into()),
        });
    };
    let decode = boolean(o, "do_remote_decode")?;
    let prefill = boolean(o, "do_remote_prefill")?;
    let block_ids = match get(o, "remote_block_ids") {
        None => None,
        Some(Value::Array(ids)) => Some(
            ids.iter()
                .map(|id| {
                    id.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .map(BlockId)
                        .ok_or_else(|| {
                            bad(
                                "remote_block_ids",
                                format!(
                                    "{FIELD}.remote_block_ids must hold block numbers, got {id}"
                                ),
                            )
                        })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(v) => {
            return Err(bad(
                "remote_block_ids",
                format!("{FIELD}.remote_block_ids must be a list, got {v}"),
            ));
        }
    };
    let engine_id = string(o, "remote_engine_id")?;
    let request_id = match get(o, "remote_request_id") {
        // vLLM sends a string; accept a number too.
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => string(o, "remote_request_id")?,
    };
    let host = string(o, "remote_host")?;
    let port = unsigned(o, "remote_port", u16::MAX.into())?.map(|p| p as u16);
    if let Some(tp) = unsigned(o, "tp_size", u32::MAX.into())?
        && tp != 1
    {
        return Err(bad(
            "tp_size",
            format!("{FIELD}.tp_size {tp} is not supported: nodes run with tp_size 1"),
        ));
    }
    let num_tokens = unsigned(o, "remote_num_tokens", u32::MAX.into())?.map(|n| n as usize);
    let lease = match string(o, "remote_lease_id")? {
        None => None,
        Some(s) => Some(s.parse::<LeaseId>().map_err(|_| {
            bad(
                "remote_lease_id",
                format!("{FIELD}.remote_lease_id must be 32 hex digits, got {s:?}"),
            )
        })?),
    };
    let generation = unsigned(o, "remote_lease_generation", u64::MAX)?;
    let board_slot = unsigned(o, "remote_lease_slot", u64::from(u32::MAX))?.map(|s| s as u32);
    let block_size = match unsigned(o, "remote_block_size", MAX_BLOCK_SIZE as u64)? {
        Some(0) => {
            return Err(bad(
                "remote_block_size",
                format!("{FIELD}.remote_block_size must be positive"),
            ));
        }
        n => n.map(|n| n as usize),
    };
    let epoch = match string(o, "remote_engine_epoch")? {
        None => None,
        Some(s) => Some(u64::from_str_radix(&s, 16).map_err(|_| {
            bad(
                "remote_engine_epoch",
                format!("{FIELD}.remote_engine_epoch must be hex, got {s:?}"),
            )
        })?),
    };
    let prompt_hash = match string(o, "remote_prompt_hash")? {
        None => None,
        Some(s) => Some(u64::from_str_radix(&s, 16).map_err(|_| {
            bad(
                "remote_prompt_hash",
                format!("{FIELD}.remote_prompt_hash must be hex, got {s:?}"),
            )
        })?),
    };
    let expiry = match get(o, "remote_blocks_expiry_time") {
        None => None,
        Some(v) => {
            let secs = v
                .as_f64()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .ok_or_else(|| {
                    bad(
                        "remote_blocks_expiry_time",
                        format!("{FIELD}.remote_blocks_expiry_time must be Unix seconds, got {v}"),
                    )
                })?;
            std::time::Duration::try_from_secs_f64(secs)
                .ok()
                .and_then(|d| std::time::UNIX_EPOCH.checked_add(d))
        }
    };
    // Where the KV is and how to claim it, or the first field missing.
    let remote = (|| {
        Ok(RemotePrefill {
            block_ids: block_ids.ok_or("remote_block_ids")?,
            engine_id: engine_id.ok_or("remote_engine_id")?,
            request_id: request_id.ok_or("remote_request_id")?,
            host: host.ok_or("remote_host")?,
            port: port.ok_or("remote_port")?,
            lease: lease.ok_or("remote_lease_id")?,
            generation: generation.ok_or("remote_lease_generation")?,
            num_tokens,
            prompt_hash,
            expiry,
            epoch,
            board_slot,
            block_size,
        })
    })();
    if decode && prefill {
        return Err(ApiError::InvalidRequest {
            message: format!("{FIELD} cannot ask for both do_remote_decode and do_remote_prefill"),
            param: Some(FIELD.into()),
        });
    }
    if decode {
        let consumers = match get(o, "num_consumers") {
            None => 1,
            Some(v) => match v.as_u64() {
                Some(n @ 1..=MAX_CONSUMERS) => n as usize,
                _ => {
                    return Err(bad(
                        "num_consumers",
                        format!(
                            "{FIELD}.num_consumers must be an integer between 1 and {MAX_CONSUMERS}, got {v}"
                        ),
                    ));
                }
            },
        };
        // A retained turn to pull first: all of its fields, or none of it.
        let held = remote.ok().into_iter().collect();
        return Ok(KvDirective::Produce { consumers, held });
    }
    if !prefill {
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
    match v {
        None | Some(Value::Null) => Ok(KvDirective::None),
        Some(Value::Array(items)) if items.is_empty() => Ok(KvDirective::None),
        Some(Value::Array(items)) => {
            let parsed = items.iter().map(parse_one).collect::<Result<Vec<_>, _>>()?;
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
        Some(v) => parse_one(v),
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
}

/// The response's `kv_transfer_params` for a prefill whose KV was handed off.
pub(crate) fn handoff(advert: &Advert, request_id: &str, h: &KvHandoff, prompt_hash: u64) -> Value {
    let mut v = held(advert, request_id, h);
    v["do_remote_prefill"] = json!(true);
    v["do_remote_decode"] = json!(false);
    v["remote_prompt_hash"] = json!(format!("{prompt_hash:016x}"));
    v
}

/// The final response's `kv_transfer_params` for a finished turn whose blocks this node keeps
/// (`--kv-retain-after-decode`): `do_remote_decode: true`, so a proxy can copy the object as
/// it is into the next turn's request to a prefill node, which then pulls this prefix first.
/// (`remote_num_tokens` is the tokens held: prompt and generated, whole blocks only.)
pub(crate) fn retained(advert: &Advert, request_id: &str, h: &KvHandoff) -> Value {
    let mut v = held(advert, request_id, h);
    v["do_remote_prefill"] = json!(false);
    v["do_remote_decode"] = json!(true);
    if let Some(hash) = h.last_block_hash {
        // The gateway's conversation index keys the turn by it (the next turn's prompt, when
        // it repeats this one and its answer, hashes to the same chain).
        v["remote_last_block_hash"] = json!(format!("{hash:016x}"));
    }
    v
}

fn held(advert: &Advert, request_id: &str, h: &KvHandoff) -> Value {
    let expiry = h
        .deadline
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut v = json!({
        "remote_block_ids": h.block_ids.iter().map(|b| b.0).collect::<Vec<_>>(),
        "remote_engine_id": advert.engine_id,
        "remote_engine_epoch": format!("{:016x}", advert.epoch),
        "remote_request_id": request_id,
        "remote_host": *advert.host.borrow(),
        "remote_port": advert.port,
        "remote_block_size": advert.block_size,
        "tp_size": 1,
        "remote_num_tokens": h.num_tokens,
        "remote_lease_id": h.lease.to_string(),
        "remote_lease_generation": h.generation,
        "remote_blocks_expiry_time": expiry,
    });
    if let Some(slot) = h.board_slot {
        v["remote_lease_slot"] = json!(slot);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(v: Value) -> Result<KvDirective, ApiError> {
        parse(Some(&v))
    }

    fn full() -> Value {
        json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [3, 4, 9], "remote_engine_id": "p1", "remote_request_id": "cmpl-1",
            "remote_host": "127.0.0.1", "remote_port": 7000, "tp_size": 1,
            "remote_num_tokens": 40, "remote_lease_id": "000000000000000000000000000000ff",
            "remote_lease_generation": 2, "remote_prompt_hash": "00ff"
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
        };
        let h = KvHandoff {
            lease: LeaseId(0xabc),
            generation: 5,
            deadline: std::time::SystemTime::now(),
            block_ids: vec![BlockId(1), BlockId(2)],
            num_tokens: 7,
            last_block_hash: None,
            board_slot: Some(3),
        };
        let prompt = [1, 2, 3, 4, 5, 6, 7];
        let v = handoff(&advert, "cmpl-9", &h, prompt_hash(&prompt));
        let KvDirective::Consume(r) = p(v).unwrap() else {
            panic!()
        };
        assert_eq!(r[0].lease, LeaseId(0xabc));
        assert_eq!(r[0].block_ids, h.block_ids);
        assert_eq!(r[0].num_tokens, Some(7));
        assert_eq!(r[0].prompt_hash, Some(prompt_hash(&prompt)));
        assert_eq!(r[0].epoch, Some(u64::MAX - 1));
        assert_eq!(r[0].board_slot, Some(3));
    }
}

/// Builds a prefill's response `kv_transfer_params` from the request's events.
#[derive(Debug, Clone)]
pub(crate) struct KvReply {
    advert: Option<Advert>,
    request_id: String,
    prompt_hash: u64,
    /// One object per lease granted, in grant order.
    params: Vec<Value>,
    /// The finished turn's retained blocks, when kept.
    retained: Option<Value>,
}

impl KvReply {
    /// For request `request_id` of `prompt`; `advert` is set on a node that produces.
    pub(crate) fn new(advert: Option<Advert>, request_id: &str, prompt: &[u32]) -> Self {
        Self {
            advert,
            request_id: request_id.to_string(),
            prompt_hash: prompt_hash(prompt),
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
                self.retained = Some(retained(advert, &self.request_id, h));
            }
            _ => {}
        }
    }

    /// The response's `kv_transfer_params`, once the handoff happened: one object (vLLM's
    /// shape) for one consumer, a list of one object per consumer for more; on a node that
    /// retained the finished turn, the retained blocks' object.
    pub(crate) fn params(&self) -> Option<Value> {
        match self.params.as_slice() {
            [] => self.retained.clone(),
            [one] => Some(one.clone()),
            many => Some(Value::Array(many.to_vec())),
        }
    }
}
