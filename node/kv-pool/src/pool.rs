//! The pool's memory: one allocation, made once, never moved.
//!
//! # Who may touch which bytes
//!
//! The pool's memory is shared with parties Rust cannot see: a consumer's puller thread has UCX
//! write pulled blocks into it, and peers read leased blocks through shared memory. So the pool
//! never hands out a reference spanning more than one block, and never one to a block someone
//! else may be writing:
//! - The engine (through `&mut KvPool`) forms references only to blocks of the sequences it is
//!   running or copying: [`KvPool::tile`] / [`KvPool::tile_mut`] (one `(block_size, head_dim)`
//!   tile of one layer and head), [`KvPool::block`] / [`KvPool::block_mut`].
//! - Blocks reserved for a pull belong to the puller until the pull has ended (completed, or
//!   cancelled with its endpoint closed): the engine leaves them out of every step meanwhile, and
//!   the puller writes them through the registered region's raw pointer, never through this type.
//! - Blocks under a lease are only read, by peers, and never written (copy-on-write makes any
//!   writer take a copy first).

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
// SAFETY: `&KvPool` only hands out shared slices of single blocks (see the module docs).
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

    /// Element range of `block`, checked against the pool.
    fn block_range(&self, block: BlockId) -> std::ops::Range<usize> {
        let n = self.layout.block_elems();
        let start = block.index() * n;
        assert!(
            start + n <= self.len,
            "block {} outside a pool of {} blocks",
            block.index(),
            self.layout.num_blocks
        );
        start..start + n
    }

    /// `len` elements from element `start` (checked by the caller to lie inside the pool).
    fn slice(&self, start: usize, len: usize) -> &[f32] {
        // SAFETY: `start..start+len` lies inside `ptr..ptr+len` (checked by callers); the
        // constructors' contracts make it valid memory of this pool; the module docs say why no
        // one else writes it while this shared reference lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len) }
    }

    /// `len` elements from element `start`, writable.
    fn slice_mut(&mut self, start: usize, len: usize) -> &mut [f32] {
        // SAFETY: as in `slice`; `&mut self` makes this the only reference the pool hands out
        // now, and it covers one block at most.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(start), len) }
    }

    /// The `(block_size, head_dim)` tile of (`block`, `layer`, `kv` 0=K/1=V, `head`).
    ///
    /// # Panics
    /// When an index lies outside the layout.
    #[inline]
    pub fn tile(&self, block: BlockId, layer: usize, kv: usize, head: usize) -> &[f32] {
        let (start, n) = self.tile_range(block, layer, kv, head);
        self.slice(start, n)
    }

    /// The tile of [`KvPool::tile`], writable.
    ///
    /// # Panics
    /// When an index lies outside the layout.
    #[inline]
    pub fn tile_mut(&mut self, block: BlockId, layer: usize, kv: usize, head: usize) -> &mut [f32] {
        let (start, n) = self.tile_range(block, layer, kv, head);
        self.slice_mut(start, n)
    }

    #[inline]
    fn tile_range(&self, block: BlockId, layer: usize, kv: usize, head: usize) -> (usize, usize) {
        let l = &self.layout;
        assert!(
            block.index() < l.num_blocks && layer < l.num_layers && kv < 2 && head < l.num_kv_heads,
            "tile ({}, {layer}, {kv}, {head}) outside the pool's layout",
            block.index()
        );
        (
            l.tile_offset(block.index(), layer, kv, head),
            l.tile_elems(),
        )
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
    ///
    /// # Panics
    /// When `block` lies outside the pool.
    pub fn block(&self, block: BlockId) -> &[f32] {
        let r = self.block_range(block);
        self.slice(r.start, r.len())
    }

    /// One block's elements, writable.
    ///
    /// # Panics
    /// When `block` lies outside the pool.
    pub fn block_mut(&mut self, block: BlockId) -> &mut [f32] {
        let r = self.block_range(block);
        self.slice_mut(r.start, r.len())
    }

    /// Copies block `src` over block `dst` (copy-on-write of a shared partial block).
    ///
    /// # Panics
    /// When a block lies outside the pool.
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        let (s, d) = (self.block_range(src), self.block_range(dst));
        if s == d {
            return;
        }
        // SAFETY: both ranges lie inside the pool and are distinct blocks, so they do not
        // overlap; no reference into either is live (`&mut self`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(s.start),
                self.ptr.as_ptr().add(d.start),
                s.len(),
            );
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_blocks: 3,
            block_size: 4,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn tiles_and_blocks_address_the_layout_and_nothing_else() {
        let l = layout();
        let mut pool = KvPool::new(l).unwrap();
        // Each tile written through `tile_mut` lands where the layout says, in its block only.
        for b in 0..l.num_blocks {
            for layer in 0..l.num_layers {
                for kv in 0..2 {
                    for h in 0..l.num_kv_heads {
                        let t = pool.tile_mut(BlockId(b as u32), layer, kv, h);
                        assert_eq!(t.len(), l.tile_elems());
                        t.fill(l.tile_offset(b, layer, kv, h) as f32);
                    }
                }
            }
        }
        for b in 0..l.num_blocks {
            let block = pool.block(BlockId(b as u32));
            assert_eq!(block.len(), l.block_elems());
            for (i, x) in block.iter().enumerate() {
                let offset = b * l.block_elems() + i;
                assert_eq!(*x as usize, offset - offset % l.tile_elems());
            }
        }
        pool.copy_block(BlockId(2), BlockId(0));
        assert_eq!(pool.block(BlockId(0)), pool.block(BlockId(2)));
        pool.poison_block(BlockId(1));
        assert!(pool.is_poisoned(BlockId(1)) && !pool.is_poisoned(BlockId(2)));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_block_outside_the_pool_is_refused() {
        let pool = KvPool::new(layout()).unwrap();
        let _ = pool.block(BlockId(3));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_tile_outside_the_layout_is_refused() {
        let pool = KvPool::new(layout()).unwrap();
        let _ = pool.tile(BlockId(0), 2, 0, 0);
    }
}
