//! How K and V are laid out inside the pool. Peers read this to address blocks remotely.

/// Element type of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 32-bit float (the CPU path).
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::BF16 => 2,
        }
    }

    /// Lower-case name (`f32`, `f16`, `bf16`).
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
        }
    }
}

/// Shape of the pool. One block holds K and V of **all layers** for `block_size` consecutive
/// token positions, contiguously, so moving a block is one descriptor.
///
/// Element order inside the pool (row-major, outermost first):
/// `(num_blocks, num_layers, 2 /* 0 = K, 1 = V */, num_kv_heads, block_size, head_dim)`.
///
/// Within one block, the `(block_size, head_dim)` tile of one (layer, K/V, head) is contiguous, so
/// attention walks a head's keys with unit stride.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Token positions per block.
    pub block_size: usize,
    /// Transformer layers.
    pub num_layers: usize,
    /// Key/value heads per layer.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Element type.
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Elements in one `(block_size, head_dim)` tile.
    pub fn tile_elems(&self) -> usize {
        self.block_size * self.head_dim
    }

    /// Elements in one block (all layers, K and V).
    pub fn block_elems(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.tile_elems()
    }

    /// Bytes in one block.
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.dtype.size()
    }

    /// Bytes in the whole pool.
    pub fn pool_bytes(&self) -> usize {
        self.block_bytes() * self.num_blocks
    }

    /// Element offset of the tile of (`block`, `layer`, `kv` 0=K/1=V, `head`).
    #[inline]
    pub fn tile_offset(&self, block: usize, layer: usize, kv: usize, head: usize) -> usize {
        (((block * self.num_layers + layer) * 2 + kv) * self.num_kv_heads + head)
            * self.tile_elems()
    }

    /// How many blocks fit in `bytes` (at least zero).
    pub fn blocks_for_bytes(bytes: usize, block_bytes: usize) -> usize {
        bytes.checked_div(block_bytes).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_cover_the_pool_without_overlap() {
        let l = KvLayout {
            num_blocks: 3,
            block_size: 4,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F32,
        };
        let mut seen = vec![false; l.num_blocks * l.block_elems()];
        for b in 0..3 {
            for layer in 0..2 {
                for kv in 0..2 {
                    for h in 0..2 {
                        let o = l.tile_offset(b, layer, kv, h);
                        for s in seen.iter_mut().skip(o).take(l.tile_elems()) {
                            assert!(!*s);
                            *s = true;
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|s| *s));
        // Block b starts at b * block_elems: one descriptor per block.
        assert_eq!(l.tile_offset(2, 0, 0, 0), 2 * l.block_elems());
        assert_eq!(l.block_bytes(), 2 * 2 * 2 * 4 * 8 * 4);
    }
}
