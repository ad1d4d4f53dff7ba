//! What two nodes must agree on before one reads the other's blocks, and what they may differ
//! in.
//!
//! Must match ([`CompatInfo`]): the project and protocol version, the model (name and weights'
//! fingerprint), and the KV's element type and shape (layers, KV heads, head dim) — otherwise
//! the bytes mean something else. May differ: the block size and the order inside a block
//! (`KvLayout::block_size`, `KvLayout::order`, carried by the handshake's layout) — the consumer
//! then converts what it pulls ([`needs_rechunk`], `pd_kv_pool::rechunk`).

use pd_kv_pool::KvLayout;

/// Version of the block-transfer protocol (layout of a block, meaning of the handshake fields).
pub const TRANSFER_PROTOCOL_VERSION: u32 = 3;

/// Identity of a node's KV cache. Two nodes may exchange blocks only if every field is equal
/// (the block size and order are negotiated instead: [`needs_rechunk`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompatInfo {
    /// Version of this project (`CARGO_PKG_VERSION`).
    pub project_version: String,
    /// [`TRANSFER_PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// The served model name.
    pub model: String,
    /// Fingerprint of the weights and tokenizer (`pd_model::ModelSource::fingerprint`); empty
    /// when the node does not say (it then matches only another node that does not say).
    pub fingerprint: String,
    /// Element type of the pool (`f32`, `f16`, `bf16`).
    pub dtype: String,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Layers.
    pub num_layers: u32,
    /// Elements per head.
    pub head_dim: u32,
}

/// Whether blocks pulled from a pool laid out as `remote` must be converted to fit `local`:
/// they differ in block size or order (what [`CompatInfo`] leaves free). Both must have passed
/// [`CompatInfo::check`].
pub fn needs_rechunk(local: &KvLayout, remote: &KvLayout) -> bool {
    local.block_size != remote.block_size || local.order != remote.order
}

/// The first field two nodes disagree on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KV compatibility mismatch on {field}: local {local}, remote {remote}")]
pub struct CompatError {
    /// Name of the differing field.
    pub field: &'static str,
    /// Our value.
    pub local: String,
    /// The peer's value.
    pub remote: String,
}

impl CompatInfo {
    /// The compatibility info of a pool holding `model`'s KV (no fingerprint: see
    /// [`CompatInfo::with_fingerprint`]).
    pub fn new(model: impl Into<String>, layout: &KvLayout) -> Self {
        Self {
            project_version: env!("CARGO_PKG_VERSION").to_string(),
            protocol_version: TRANSFER_PROTOCOL_VERSION,
            model: model.into(),
            fingerprint: String::new(),
            dtype: layout.dtype.as_str().to_string(),
            num_kv_heads: layout.num_kv_heads as u32,
            num_layers: layout.num_layers as u32,
            head_dim: layout.head_dim as u32,
        }
    }

    /// The same, for the weights and tokenizer that `fingerprint` identifies.
    #[must_use]
    pub fn with_fingerprint(mut self, fingerprint: impl Into<String>) -> Self {
        self.fingerprint = fingerprint.into();
        self
    }

    /// xxh3-64 over every field, in order (sent in the handshake so a mismatch is cheap to see).
    pub fn hash(&self) -> u64 {
        let s = format!(
            "{}\0{}\0{}\0{}\0{}\0{}\0{}\0{}",
            self.project_version,
            self.protocol_version,
            self.model,
            self.fingerprint,
            self.dtype,
            self.num_kv_heads,
            self.num_layers,
            self.head_dim,
        );
        xxhash_rust::xxh3::xxh3_64(s.as_bytes())
    }

    /// Checks `remote` against `self`, naming the first differing field.
    ///
    /// # Errors
    /// [`CompatError`] with the field, our value and theirs.
    pub fn check(&self, remote: &CompatInfo) -> Result<(), CompatError> {
        let fields: [(&'static str, String, String); 8] = [
            (
                "project_version",
                self.project_version.clone(),
                remote.project_version.clone(),
            ),
            (
                "protocol_version",
                self.protocol_version.to_string(),
                remote.protocol_version.to_string(),
            ),
            ("model", self.model.clone(), remote.model.clone()),
            (
                "model_fingerprint",
                self.fingerprint.clone(),
                remote.fingerprint.clone(),
            ),
            ("kv_cache_dtype", self.dtype.clone(), remote.dtype.clone()),
            (
                "num_kv_heads",
                self.num_kv_heads.to_string(),
                remote.num_kv_heads.to_string(),
            ),
            (
                "num_layers",
                self.num_layers.to_string(),
                remote.num_layers.to_string(),
            ),
            (
                "head_dim",
                self.head_dim.to_string(),
                remote.head_dim.to_string(),
            ),
        ];
        match fields.into_iter().find(|(_, l, r)| l != r) {
            Some((field, local, remote)) => Err(CompatError {
                field,
                local,
                remote,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_kv_pool::KvDtype;

    fn layout() -> KvLayout {
        KvLayout {
            num_blocks: 8,
            block_size: 16,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 32,
            dtype: KvDtype::F32,
            order: pd_kv_pool::KvOrder::Hnd,
        }
    }

    #[test]
    fn equal_infos_pass_and_hash_equal() {
        let a = CompatInfo::new("tiny", &layout());
        assert_eq!(a.check(&a.clone()), Ok(()));
        assert_eq!(a.hash(), a.clone().hash());
    }

    #[test]
    fn mismatch_names_the_field() {
        let a = CompatInfo::new("tiny", &layout());
        let mut b = a.clone();
        b.num_kv_heads = 4;
        let e = a.check(&b).unwrap_err();
        assert_eq!(e.field, "num_kv_heads");
        assert_eq!((e.local.as_str(), e.remote.as_str()), ("2", "4"));
        assert_ne!(a.hash(), b.hash());
        let mut c = a.clone();
        c.model = "other".into();
        assert_eq!(a.check(&c).unwrap_err().field, "model");
        // Same name and shapes, other weights.
        let d = a.clone().with_fingerprint("00000000deadbeef");
        let e = a.clone().with_fingerprint("0000000000c0ffee");
        assert_eq!(d.check(&e).unwrap_err().field, "model_fingerprint");
        assert_eq!(a.check(&d).unwrap_err().field, "model_fingerprint");
        assert_ne!(d.hash(), e.hash());
    }

    #[test]
    fn block_size_and_order_are_negotiated_not_matched() {
        let l = layout();
        for other in [
            KvLayout {
                block_size: 32,
                ..l
            },
            KvLayout {
                order: pd_kv_pool::KvOrder::Nhd,
                ..l
            },
        ] {
            let (a, b) = (CompatInfo::new("tiny", &l), CompatInfo::new("tiny", &other));
            assert_eq!(a.check(&b), Ok(()));
            assert_eq!(a.hash(), b.hash());
            assert!(needs_rechunk(&l, &other));
        }
        assert!(!needs_rechunk(
            &l,
            &KvLayout {
                num_blocks: 99,
                ..l
            }
        ));
    }
}
