//! The pool's memory: one allocation, made once, never moved.

use crate::allocator::{AllocatorError, BlockId};
use crate::layout::{KvDtype, KvLayout};

/// The KV memory of a node, laid out as [`KvLayout`] says.
///
/// The backing buffer is allocated once in [`KvPool::new`] and never resized, so its address is
/// stable for the pool's whole life (it will be registered for remote reads).
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    /// (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim), f32.
    data: Box<[f32]>,
}

impl KvPool {
    /// Allocates a zeroed pool.
    ///
    /// # Errors
    /// [`AllocatorError::UnsupportedDtype`] for a non-f32 host pool; [`AllocatorError::OutOfMemory`]
    /// when the allocation fails.
    pub fn new(layout: KvLayout) -> Result<Self, AllocatorError> {
        if layout.dtype != KvDtype::F32 {
            return Err(AllocatorError::UnsupportedDtype(layout.dtype.as_str()));
        }
        let elems = layout.num_blocks * layout.block_elems();
        let mut v: Vec<f32> = Vec::new();
        v.try_reserve_exact(elems)
            .map_err(|_| AllocatorError::OutOfMemory {
                bytes: layout.pool_bytes(),
            })?;
        v.resize(elems, 0.0);
        Ok(Self {
            layout,
            data: v.into_boxed_slice(),
        })
    }

    /// The layout of this pool.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The whole pool.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The whole pool, writable.
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// Address of the first byte (stable for the pool's life).
    pub fn base_ptr(&self) -> *const u8 {
        self.data.as_ptr().cast()
    }

    /// Size of the pool in bytes.
    pub fn len_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.data)
    }

    /// One block's elements (all layers, K and V).
    pub fn block(&self, block: BlockId) -> &[f32] {
        let n = self.layout.block_elems();
        &self.data[block.index() * n..(block.index() + 1) * n]
    }

    /// One block's elements, writable.
    pub fn block_mut(&mut self, block: BlockId) -> &mut [f32] {
        let n = self.layout.block_elems();
        &mut self.data[block.index() * n..(block.index() + 1) * n]
    }

    /// Copies block `src` over block `dst` (copy-on-write of a shared partial block).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        let n = self.layout.block_elems();
        self.data
            .copy_within(src.index() * n..(src.index() + 1) * n, dst.index() * n);
    }

    /// Fills a block with NaN so any read of a block nobody owns shows up in the output.
    pub fn poison_block(&mut self, block: BlockId) {
        self.block_mut(block).fill(f32::NAN);
    }

    /// True when every element of `block` is NaN (it was poisoned and not written since).
    pub fn is_poisoned(&self, block: BlockId) -> bool {
        self.block(block).iter().all(|x| x.is_nan())
    }
}
