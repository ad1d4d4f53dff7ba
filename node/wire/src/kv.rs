//! `kv_transfer_params`, as vLLM's NixlConnector and its proxies speak it (pull mode), plus
//! the lease fields our nodes add.
//!
//! A proxy asks a prefill node for `{"do_remote_decode": true, ...}` and copies the object it
//! gets back (`{"do_remote_prefill": true, "remote_block_ids": [...], "remote_engine_id", ...}`)
//! into the request to a decode node. With `n > 1` the answer may carry a *list* of such
//! objects, one per decode node. A node that keeps a finished turn's blocks
//! (`--kv-retain-after-decode`) answers with `do_remote_decode: true` and the blocks: the next
//! turn's request to a prefill node carries that object as it is (reverse pull).
//!
//! The six fields vLLM always writes are always written (`null` when unset), so a vLLM node
//! sees its own protocol; ours are written only when set. Fields this crate does not know
//! are kept in [`KvTransferParams::extra`] and written back as they came.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

/// The request and answer field.
pub const FIELD: &str = "kv_transfer_params";

/// A 64-bit value written as 16 hex digits (`remote_engine_epoch`, `remote_last_block_hash`);
/// read from any number of hex digits up to 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Hex64(pub u64);

impl Serialize for Hex64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:016x}", self.0))
    }
}

impl<'de> Deserialize<'de> for Hex64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        u64::from_str_radix(&s, 16)
            .map(Hex64)
            .map_err(|_| D::Error::custom(format!("must be hex, got {s:?}")))
    }
}

/// A 128-bit value written as exactly 32 hex digits (`remote_prompt_hash`, the prompt's
/// binding). Read only from 32 digits: a shorter value (a producer of the 64-bit binding) is
/// refused, not widened, so no narrower binding is ever taken for this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Hex128(pub u128);

impl Serialize for Hex128 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:032x}", self.0))
    }
}

impl<'de> Deserialize<'de> for Hex128 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        if s.len() != 32 {
            return Err(D::Error::custom(format!(
                "must be 32 hex digits (a 128-bit digest), got {} characters",
                s.len()
            )));
        }
        u128::from_str_radix(&s, 16)
            .map(Hex128)
            .map_err(|_| D::Error::custom(format!("must be hex, got {s:?}")))
    }
}

/// `remote_request_id`: vLLM writes a string; a number is read as its decimal text.
fn request_id<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(v) => return Err(D::Error::custom(format!("must be a string, got {v}"))),
    })
}

/// A flag that may be `null` (read as `false`).
fn flag<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// One `kv_transfer_params` object.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// Asked of a prefill node: compute the prompt and hold its KV for decode nodes. In an
    /// answer: a retained turn's blocks, to pull before computing the next turn.
    #[serde(default, deserialize_with = "flag")]
    pub do_remote_decode: bool,
    /// Asked of a decode node: pull the prompt's KV from the blocks named here.
    #[serde(default, deserialize_with = "flag")]
    pub do_remote_prefill: bool,
    /// The node holding the blocks.
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    /// The blocks, in prompt order.
    #[serde(default)]
    pub remote_block_ids: Option<Vec<u32>>,
    /// Host of the holder's KV side channel.
    #[serde(default)]
    pub remote_host: Option<String>,
    /// Port of the holder's KV side channel.
    #[serde(default)]
    pub remote_port: Option<u16>,
    /// The request that computed the blocks.
    #[serde(
        default,
        deserialize_with = "request_id",
        skip_serializing_if = "Option::is_none"
    )]
    pub remote_request_id: Option<String>,
    /// Tensor-parallel size of the holder (nodes run with 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    /// Tokens the blocks hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_num_tokens: Option<u32>,
    /// The lease the blocks are held under (32 hex digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_lease_id: Option<String>,
    /// The lease grant's generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_lease_generation: Option<u64>,
    /// When the lease ends unless renewed (Unix seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_blocks_expiry_time: Option<f64>,
    /// The holder's incarnation: a restarted holder refuses what names another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_epoch: Option<Hex64>,
    /// The 128-bit binding of the prompt's token ids under the cluster's key
    /// (`pd_kv_pool::prompt_binding`), checked by the decode node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_prompt_hash: Option<Hex128>,
    /// A retained turn's last block's chain hash (the gateway's conversation key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_last_block_hash: Option<Hex64>,
    /// The lease's slot on the holder's lease board.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_lease_slot: Option<u32>,
    /// Tokens per block of the holder's pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_size: Option<u32>,
    /// Asked of a prefill node: how many decode nodes pull (each under a lease of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_consumers: Option<u32>,
    /// Fields this crate does not know, written back as they came.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A field of `kv_transfer_params` that is not what it must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamsError {
    /// The field, e.g. `kv_transfer_params.remote_port` (`kv_transfer_params.1.remote_port`
    /// in a list), or `kv_transfer_params` itself.
    pub param: String,
    /// What is wrong, naming the field.
    pub message: String,
}

impl std::fmt::Display for ParamsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ParamsError {}

impl KvTransferParams {
    /// What a proxy asks a prefill node for: hold the prompt's KV for `consumers` decode nodes
    /// (`num_consumers` written only when more than one, so a vLLM node sees its protocol).
    pub fn produce(consumers: u32) -> Self {
        Self {
            do_remote_decode: true,
            num_consumers: (consumers > 1).then_some(consumers),
            ..Self::default()
        }
    }

    /// The same blocks, as a request to pull them (`do_remote_prefill: true`).
    pub fn to_pull(&self) -> Self {
        Self {
            do_remote_prefill: true,
            do_remote_decode: false,
            ..self.clone()
        }
    }

    /// The same blocks, as a request to a prefill node to pull them first and hand the whole
    /// prompt on (`do_remote_decode: true`).
    pub fn to_produce(&self) -> Self {
        Self {
            do_remote_prefill: false,
            do_remote_decode: true,
            ..self.clone()
        }
    }

    /// The holder's KV side channel as a URI (`http://host:port`, IPv6 in brackets), when the
    /// params name one.
    pub fn side_channel(&self) -> Option<String> {
        let host = self.remote_host.as_deref()?;
        let port = self.remote_port?;
        Some(side_channel_uri(host, port))
    }

    /// Reads one object.
    ///
    /// # Errors
    /// A field of the wrong type, named.
    pub fn from_value(v: &Value) -> Result<Self, ParamsError> {
        if !v.is_object() {
            return Err(ParamsError {
                param: FIELD.into(),
                message: format!("{FIELD} must be an object or a list of objects, got {v}"),
            });
        }
        serde_path_to_error::deserialize(v).map_err(|e| {
            // The param names the field (`remote_block_ids`), the message the place in it
            // (`remote_block_ids[1]`).
            let field = match e.path().iter().next() {
                Some(serde_path_to_error::Segment::Map { key }) => format!("{FIELD}.{key}"),
                _ => FIELD.to_owned(),
            };
            ParamsError {
                message: format!("{FIELD}.{}: {}", e.path(), e.inner()),
                param: field,
            }
        })
    }

    /// This object as JSON.
    pub fn to_value(&self) -> Value {
        // A struct of strings, numbers and a string-keyed map: serializing cannot fail.
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// `http://host:port` for a side channel (IPv6 hosts in brackets).
pub fn side_channel_uri(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("http://[{host}]:{port}")
    } else {
        format!("http://{host}:{port}")
    }
}

/// The field as a request or answer carries it: absent, one object, or a list (one per
/// decode node).
///
/// # Errors
/// An item that is not an object, or a field of the wrong type (named, with its index in a
/// list).
pub fn read(v: Option<&Value>) -> Result<Vec<KvTransferParams>, ParamsError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                KvTransferParams::from_value(item).map_err(|mut e| {
                    let at = format!("{FIELD}.{i}");
                    e.param = e.param.replacen(FIELD, &at, 1);
                    e.message = e.message.replacen(FIELD, &at, 1);
                    e
                })
            })
            .collect(),
        Some(v) => Ok(vec![KvTransferParams::from_value(v)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_prompt_digest_is_read_only_at_its_full_width() {
        let v = |h: &str| json!({"do_remote_prefill": true, "remote_prompt_hash": h});
        let full = "0123456789abcdef0123456789abcdef";
        let p: KvTransferParams = serde_json::from_value(v(full)).unwrap();
        assert_eq!(
            p.remote_prompt_hash,
            Some(Hex128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef))
        );
        assert_eq!(p.to_value()["remote_prompt_hash"], full);
        // A 64-bit binding (an older producer's), or any other width, is refused.
        for short in [
            "0123456789abcdef",
            "ff",
            "0123456789abcdef0123456789abcdef0",
        ] {
            let e = serde_json::from_value::<KvTransferParams>(v(short)).unwrap_err();
            assert!(e.to_string().contains("32 hex digits"), "{short}: {e}");
        }
    }

    #[test]
    fn a_vllm_request_to_p_round_trips_with_its_nulls() {
        let v = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
        let p = KvTransferParams::from_value(&v).unwrap();
        assert_eq!(p, KvTransferParams::produce(1));
        assert_eq!(p.to_value(), v);
        assert_eq!(KvTransferParams::produce(3).to_value()["num_consumers"], 3);
    }

    #[test]
    fn an_answer_keeps_fields_it_does_not_know() {
        let v = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [3, 4], "remote_engine_id": "p1", "remote_request_id": 7,
            "remote_host": "::1", "remote_port": 7000, "remote_engine_epoch": "00000000000000ab",
            "remote_blocks_expiry_time": 1.5, "vendor_field": {"x": 1}});
        let p = KvTransferParams::from_value(&v).unwrap();
        assert_eq!(p.remote_request_id.as_deref(), Some("7"));
        assert_eq!(p.remote_engine_epoch, Some(Hex64(0xab)));
        assert_eq!(p.side_channel().as_deref(), Some("http://[::1]:7000"));
        let back = p.to_value();
        assert_eq!(back["vendor_field"], json!({"x": 1}));
        assert_eq!(back["remote_engine_epoch"], "00000000000000ab");
        assert!(p.to_produce().do_remote_decode && !p.to_produce().do_remote_prefill);
        assert!(p.to_produce().to_pull().do_remote_prefill);
    }

    #[test]
    fn a_wrong_field_is_named_with_its_place_in_a_list() {
        let e = KvTransferParams::from_value(&json!({"remote_port": 70000})).unwrap_err();
        assert_eq!(e.param, "kv_transfer_params.remote_port");
        assert!(
            e.message.starts_with("kv_transfer_params.remote_port: "),
            "{e}"
        );
        let e = KvTransferParams::from_value(&json!({"remote_block_ids": [1, -2]})).unwrap_err();
        assert_eq!(e.param, "kv_transfer_params.remote_block_ids");
        assert!(e.message.contains("remote_block_ids[1]"), "{e}");
        let e = read(Some(&json!([{}, {"remote_engine_epoch": "xyz"}]))).unwrap_err();
        assert_eq!(e.param, "kv_transfer_params.1.remote_engine_epoch");
        assert!(e.message.contains("must be hex"), "{e}");
        let e = read(Some(&json!(3))).unwrap_err();
        assert_eq!(e.param, FIELD);
        assert_eq!(read(Some(&Value::Null)).unwrap(), Vec::new());
        assert_eq!(read(Some(&json!({}))).unwrap().len(), 1);
    }
}
