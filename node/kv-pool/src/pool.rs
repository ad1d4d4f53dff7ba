//! The pool's memory: one allocation, made once, never moved.

use crate::allocator::{AllocatorError, BlockId};
use crate::layout::{KvDtype, KvLayout};

/// The KV memory of a node, laid out as [`KvLayout`] says.
///
/// The backing buffer is allocated once in [`KvPool::new`] and never resized, so its address is
/// stable for the pool's whole life (it will be registered for remote reads).
pub struct KvPool {
    layout: KvLayout,
    /// Start of (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim), f32.
    ptr: std::ptr::NonNull<f32>,
    /// Elements at `ptr`.
    len: usize,
    /// Keeps the memory alive: a heap buffer, or whatever owns external memory (e.g. a UCX
    /// registration). Dropped after the pool's last use.
    _owner: Box<dyn std::any::Any + Send>,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("layout", &self.layout)
            .field("base", &self.ptr)
            .finish()
    }
}

// SAFETY: the pool exclusively owns its memory (heap) or holds the owner of external memory whose
// contract (`from_raw`) gives the pool exclusive use; access goes through `&self`/`&mut self`.
unsafe impl Send for KvPool {}
// SAFETY: `&KvPool` only hands out shared slices.
unsafe impl Sync for KvPool {}

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
        let mut data = v.into_boxed_slice();
        let ptr =
            std::ptr::NonNull::new(data.as_mut_ptr()).unwrap_or(std::ptr::NonNull::dangling());
        Ok(Self {
            layout,
            ptr,
            len: elems,
            _owner: Box::new(data),
        })
    }

    /// A pool over memory someone else allocated (e.g. UCX, so peers read it one-sidedly).
    ///
    /// # Errors
    /// [`AllocatorError::UnsupportedDtype`] for non-f32, [`AllocatorError::OutOfMemory`] when
    /// `bytes` is smaller than the layout needs.
    ///
    /// # Safety
    /// `ptr` must be 4-byte aligned and valid for reads and writes of `bytes` bytes for as long
    /// as `owner` lives; nothing else may write it while the pool exists (peers may read it).
    pub unsafe fn from_raw(
        layout: KvLayout,
        ptr: *mut u8,
        bytes: usize,
        owner: Box<dyn std::any::Any + Send>,
    ) -> Result<Self, AllocatorError> {
        if layout.dtype != KvDtype::F32 {
            return Err(AllocatorError::UnsupportedDtype(layout.dtype.as_str()));
        }
        let elems = layout.num_blocks * layout.block_elems();
        if bytes < elems * 4 || !(ptr as usize).is_multiple_of(4) {
            return Err(AllocatorError::OutOfMemory {
                bytes: layout.pool_bytes(),
            });
        }
        let ptr = std::ptr::NonNull::new(ptr.cast::<f32>())
            .ok_or(AllocatorError::OutOfMemory { bytes })?;
        Ok(Self {
            layout,
            ptr,
            len: elems,
            _owner: owner,
        })
    }

    /// The layout of this pool.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The whole pool.
    pub fn data(&self) -> &[f32] {
        // SAFETY: `ptr..ptr+len` is valid and owned by the pool (constructors' contracts).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole pool, writable.
    pub fn data_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `data`, and `&mut self` makes this the only live slice.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Address of the first byte (stable for the pool's life).
    pub fn base_ptr(&self) -> *const u8 {
        self.ptr.as_ptr().cast()
    }

    /// Size of the pool in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len * std::mem::size_of::<f32>()
    }

    /// One block's elements (all layers, K and V).
    pub fn block(&self, block: BlockId) -> &[f32] {
        let n = self.layout.block_elems();
        &self.data()[block.index() * n..(block.index() + 1) * n]
    }

    /// One block's elements, writable.
    pub fn block_mut(&mut self, block: BlockId) -> &mut [f32] {
        let n = self.layout.block_elems();
        &mut self.data_mut()[block.index() * n..(block.index() + 1) * n]
    }

    /// Copies block `src` over block `dst` (copy-on-write of a shared partial block).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        let n = self.layout.block_elems();
        self.data_mut()
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
