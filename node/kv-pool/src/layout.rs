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

/// Order of one (block, layer, K/V) slab's elements: which of heads and positions is outer.
///
/// Only the inside of a slab differs: in both orders a block is one contiguous range of the pool
/// holding every layer's K and V, so moving a block is one descriptor either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvOrder {
    /// `(num_kv_heads, block_size, head_dim)`: one head's keys are contiguous, so attention walks
    /// them with unit stride. The CPU kernels' order (`hnd`).
    #[default]
    Hnd,
    /// `(block_size, num_kv_heads, head_dim)`: one position's heads are contiguous — the order of
    /// a FlashAttention / vLLM CUDA KV cache block (`[num_blocks, block_size, num_kv_heads,
    /// head_dim]` per layer and K/V), so a reshape-and-cache kernel writes one position's heads
    /// as one row. The GPU layout (`nhd`); CPU nodes run it with `--kv-layout nhd`.
    Nhd,
}

impl KvOrder {
    /// Lower-case name (`hnd`, `nhd`), as in `--kv-layout` and the handshake.
    pub fn as_str(self) -> &'static str {
        match self {
            KvOrder::Hnd => "hnd",
            KvOrder::Nhd => "nhd",
        }
    }

    /// The pool's element order, outermost first, as the handshake's `dim_order` says it.
    pub fn dim_order(self) -> &'static str {
        match self {
            KvOrder::Hnd => "block,layer,kv,head,slot,dim",
            KvOrder::Nhd => "block,layer,kv,slot,head,dim",
        }
    }

    /// The order whose [`KvOrder::dim_order`] is `s`.
    pub fn from_dim_order(s: &str) -> Option<Self> {
        [KvOrder::Hnd, KvOrder::Nhd]
            .into_iter()
            .find(|o| o.dim_order() == s)
    }

    /// The order named `s` ([`KvOrder::as_str`]).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "hnd" => Some(KvOrder::Hnd),
            "nhd" => Some(KvOrder::Nhd),
            _ => None,
        }
    }
}

/// Shape of the pool. One block holds K and V of **all layers** for `block_size` consecutive
/// token positions, contiguously, so moving a block is one descriptor.
///
/// Element order inside the pool (row-major, outermost first):
/// `(num_blocks, num_layers, 2 /* 0 = K, 1 = V */, slab)`, where a slab is
/// `(num_kv_heads, block_size, head_dim)` in [`KvOrder::Hnd`] and
/// `(block_size, num_kv_heads, head_dim)` in [`KvOrder::Nhd`]. One (head, position) row of
/// `head_dim` elements is contiguous in both.
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
    /// Order inside a slab.
    pub order: KvOrder,
}

impl KvLayout {
    /// Elements of one head over one block's positions (`block_size · head_dim`).
    pub fn tile_elems(&self) -> usize {
        self.block_size * self.head_dim
    }

    /// Elements in one (block, layer, K/V) slab: every head at every position of the block.
    pub fn slab_elems(&self) -> usize {
        self.num_kv_heads * self.tile_elems()
    }

    /// Elements in one block (all layers, K and V).
    pub fn block_elems(&self) -> usize {
        self.num_layers * 2 * self.slab_elems()
    }

    /// Bytes in one block.
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * self.dtype.size()
    }

    /// Bytes in the whole pool.
    pub fn pool_bytes(&self) -> usize {
        self.block_bytes() * self.num_blocks
    }

    /// [`KvLayout::block_bytes`], or `None` when the product overflows or exceeds what one
    /// allocation may hold (`isize::MAX` bytes). The sizes come from a model file: check them
    /// before anything else multiplies them.
    pub fn checked_block_bytes(&self) -> Option<usize> {
        [
            self.num_kv_heads,
            self.block_size,
            self.head_dim,
            self.dtype.size(),
        ]
        .into_iter()
        .try_fold(self.num_layers.checked_mul(2)?, usize::checked_mul)
        .filter(|&b| b <= isize::MAX as usize)
    }

    /// [`KvLayout::pool_bytes`], checked as [`KvLayout::checked_block_bytes`]. Every offset
    /// inside the pool is then below it, so the unchecked offset arithmetic cannot overflow.
    pub fn checked_pool_bytes(&self) -> Option<usize> {
        self.checked_block_bytes()?
            .checked_mul(self.num_blocks)
            .filter(|&b| b <= isize::MAX as usize)
    }

    /// Element offset of the slab of (`block`, `layer`, `kv` 0=K/1=V) in the pool.
    #[inline]
    pub fn slab_offset(&self, block: usize, layer: usize, kv: usize) -> usize {
        ((block * self.num_layers + layer) * 2 + kv) * self.slab_elems()
    }

    /// Element offset, inside a slab, of the `head_dim` row of (`head`, `pos`).
    #[inline]
    pub fn row(&self, head: usize, pos: usize) -> usize {
        match self.order {
            KvOrder::Hnd => (head * self.block_size + pos) * self.head_dim,
            KvOrder::Nhd => (pos * self.num_kv_heads + head) * self.head_dim,
        }
    }

    /// Elements between the rows of one head at consecutive positions.
    #[inline]
    pub fn pos_stride(&self) -> usize {
        match self.order {
            KvOrder::Hnd => self.head_dim,
            KvOrder::Nhd => self.num_kv_heads * self.head_dim,
        }
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
    fn rows_cover_the_pool_without_overlap_in_both_orders() {
        for order in [KvOrder::Hnd, KvOrder::Nhd] {
            let l = KvLayout {
                num_blocks: 3,
                block_size: 4,
                num_layers: 2,
                num_kv_heads: 2,
                head_dim: 8,
                dtype: KvDtype::F32,
                order,
            };
            let mut seen = vec![false; l.num_blocks * l.block_elems()];
            for b in 0..3 {
                for layer in 0..2 {
                    for kv in 0..2 {
                        for h in 0..2 {
                            for pos in 0..4 {
                                let o = l.slab_offset(b, layer, kv) + l.row(h, pos);
                                // Rows of one head are `pos_stride` apart.
                                assert_eq!(l.row(h, pos), l.row(h, 0) + pos * l.pos_stride());
                                for s in seen.iter_mut().skip(o).take(l.head_dim) {
                                    assert!(!*s, "{order:?}");
                                    *s = true;
                                }
                            }
                        }
                    }
                }
            }
            assert!(seen.iter().all(|s| *s));
            // Block b starts at b * block_elems: one descriptor per block.
            assert_eq!(l.slab_offset(2, 0, 0), 2 * l.block_elems());
            assert_eq!(l.block_bytes(), 2 * 2 * 2 * 4 * 8 * 4);
        }
        assert_eq!(KvOrder::parse("nhd"), Some(KvOrder::Nhd));
        assert_eq!(KvOrder::parse(KvOrder::Hnd.as_str()), Some(KvOrder::Hnd));
        assert_eq!(KvOrder::parse("NHD"), None);
        assert_eq!(
            KvOrder::from_dim_order(KvOrder::Nhd.dim_order()),
            Some(KvOrder::Nhd)
        );
        assert_eq!(
            KvOrder::from_dim_order("block,layer,head,kv,slot,dim"),
            None
        );
    }
}
