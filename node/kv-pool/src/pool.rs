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
//!
//! # Element types
//!
//! The pool holds `f32`, `f16` or `bf16` elements ([`KvDtype`]); tiles and blocks are typed
//! views ([`KvElem`]) checked against the layout's dtype, so a kernel cannot read f16 bytes as
//! f32. Kernels compute in f32: [`KvElem::load_f32`] widens a tile and
//! [`KvElem::store_f32`] narrows on write (round to nearest even).

use crate::allocator::{AllocatorError, BlockId};
use crate::layout::{KvDtype, KvLayout};

/// An element type a pool can hold.
pub trait KvElem: Copy + Send + Sync + 'static {
    /// The layout dtype of this element type.
    const DTYPE: KvDtype;

    /// Widens `src` into `dst` (same length).
    fn load_f32(src: &[Self], dst: &mut [f32]);

    /// Writes `src` into `dst` (same length), narrowing to this type.
    fn store_f32(src: &[f32], dst: &mut [Self]);
}

impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;

    #[inline(always)]
    fn load_f32(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn store_f32(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

macro_rules! half_elem {
    ($t:ty, $dtype:expr, $widen:ident) => {
        impl KvElem for $t {
            const DTYPE: KvDtype = $dtype;

            #[inline(always)]
            fn load_f32(src: &[$t], dst: &mut [f32]) {
                assert_eq!(src.len(), dst.len(), "load_f32: lengths differ");
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
                {
                    // SAFETY: the CPU has AVX2 and F16C; the lengths are equal.
                    unsafe { widen::$widen(src, dst) };
                    return;
                }
                use half::slice::HalfFloatSliceExt;
                src.convert_to_f32_slice(dst);
            }

            #[inline(always)]
            fn store_f32(src: &[f32], dst: &mut [$t]) {
                use half::slice::HalfFloatSliceExt;
                dst.convert_from_f32_slice(src);
            }
        }
    };
}

half_elem!(half::f16, KvDtype::F16, f16);
half_elem!(half::bf16, KvDtype::BF16, bf16);

/// Half-precision rows to f32, 8 at a time and inlined: attention widens every K/V tile it
/// reads, and `half`'s slice conversion calls a function per 8 values. Both conversions are
/// exact, so the bits equal `half`'s.
#[cfg(target_arch = "x86_64")]
mod widen {
    use std::arch::x86_64::*;

    /// f16 → f32 with F16C. Requires AVX2, F16C and `src.len() == dst.len()`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        let (s, d) = (src.as_ptr().cast::<__m128i>(), dst.as_mut_ptr());
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ both lengths; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(s.byte_add(i * 2));
                _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(h));
            }
        }
        for (x, y) in src[n..].iter().zip(&mut dst[n..]) {
            *y = x.to_f32();
        }
    }

    /// bf16 → f32: the 16 bits become the high half of the f32. Requires AVX2 and
    /// `src.len() == dst.len()`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn bf16(src: &[half::bf16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        let (s, d) = (src.as_ptr().cast::<__m128i>(), dst.as_mut_ptr());
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ both lengths; unaligned loads and stores.
            unsafe {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(s.byte_add(i * 2)));
                _mm256_storeu_ps(d.add(i), _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h)));
            }
        }
        for (x, y) in src[n..].iter().zip(&mut dst[n..]) {
            *y = x.to_f32();
        }
    }
}

/// The byte a poisoned block is filled with: all-ones is a NaN in f32, f16 and bf16 alike.
const POISON: u8 = 0xff;

/// The KV memory of a node, laid out as [`KvLayout`] says.
///
/// The backing buffer is allocated once in [`KvPool::new`] and never resized, so its address is
/// stable for the pool's whole life (it will be registered for remote reads).
pub struct KvPool {
    layout: KvLayout,
    /// Start of (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim), elements of
    /// `layout.dtype`, aligned to the element size.
    ptr: std::ptr::NonNull<u8>,
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

/// Alignment of a pool [`KvPool::new`] allocates: a page, as UCX's allocations (the transfer
/// pool) are. Block `b` then sits at the same page offset in every pool of one layout, and
/// copies between pools run at full speed: a `memcpy` whose destination lies a few bytes past
/// its source modulo 4 KiB runs ~10× slower on AMD EPYC (measured on this project's VMs: 2 MiB
/// in 0.71 ms instead of 0.07 ms), which is where glibc's `malloc` put a large pool (16 bytes
/// into a page) against UCX's page-aligned transfer pool.
pub const POOL_ALIGN: usize = 4096;

/// Memory [`KvPool::new`] allocated: [`POOL_ALIGN`]-aligned, freed on drop.
struct PoolMemory {
    ptr: std::ptr::NonNull<u8>,
    /// `None` for an empty pool (nothing allocated).
    layout: Option<std::alloc::Layout>,
}

impl PoolMemory {
    /// `bytes` zeroed bytes, every page written once; `None` when the allocation fails.
    fn zeroed(bytes: usize) -> Option<Self> {
        if bytes == 0 {
            return Some(Self {
                ptr: std::ptr::NonNull::<u64>::dangling().cast(),
                layout: None,
            });
        }
        let layout = std::alloc::Layout::from_size_align(bytes, POOL_ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc(layout) })?;
        // SAFETY: `ptr` is valid for writes of `bytes` bytes (just allocated). Writing (rather
        // than `alloc_zeroed`'s lazily mapped zero pages) faults every page in now.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        Some(Self {
            ptr,
            layout: Some(layout),
        })
    }
}

impl Drop for PoolMemory {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated in `zeroed` with this layout, freed once.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

// SAFETY: the memory is a plain heap allocation owned by this value alone.
unsafe impl Send for PoolMemory {}

// SAFETY: the pool exclusively owns its memory (heap) or holds the owner of external memory whose
// contract (`from_raw`) gives the pool exclusive use; access goes through `&self`/`&mut self`.
unsafe impl Send for KvPool {}
// SAFETY: `&KvPool` only hands out shared slices of single blocks (see the module docs).
unsafe impl Sync for KvPool {}

impl KvPool {
    /// Allocates a zeroed pool, page-aligned ([`POOL_ALIGN`]) and touched once, so no request
    /// pays for its page faults.
    ///
    /// # Errors
    /// [`AllocatorError::TooLarge`] when the layout's size overflows,
    /// [`AllocatorError::OutOfMemory`] when the allocation fails.
    pub fn new(layout: KvLayout) -> Result<Self, AllocatorError> {
        let bytes = layout
            .checked_pool_bytes()
            .ok_or(AllocatorError::TooLarge(layout))?;
        let elems = layout.num_blocks * layout.block_elems();
        let memory = PoolMemory::zeroed(bytes).ok_or(AllocatorError::OutOfMemory { bytes })?;
        Ok(Self {
            layout,
            ptr: memory.ptr,
            len: elems,
            _owner: Box::new(memory),
        })
    }

    /// A pool over memory someone else allocated (e.g. UCX, so peers read it one-sidedly).
    ///
    /// # Errors
    /// [`AllocatorError::TooLarge`] when the layout's size overflows,
    /// [`AllocatorError::OutOfMemory`] when `bytes` is smaller than the layout needs or `ptr`
    /// is not aligned to the element size.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `bytes` bytes for as long as `owner` lives;
    /// nothing else may write it while the pool exists (peers may read it).
    pub unsafe fn from_raw(
        layout: KvLayout,
        ptr: *mut u8,
        bytes: usize,
        owner: Box<dyn std::any::Any + Send>,
    ) -> Result<Self, AllocatorError> {
        let needed = layout
            .checked_pool_bytes()
            .ok_or(AllocatorError::TooLarge(layout))?;
        let elems = layout.num_blocks * layout.block_elems();
        if bytes < needed || !(ptr as usize).is_multiple_of(layout.dtype.size()) {
            return Err(AllocatorError::OutOfMemory { bytes: needed });
        }
        let ptr = std::ptr::NonNull::new(ptr).ok_or(AllocatorError::OutOfMemory { bytes })?;
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

    /// Panics unless the pool holds `T`.
    #[inline]
    fn check_type<T: KvElem>(&self) {
        assert!(
            T::DTYPE == self.layout.dtype,
            "a {} pool read as {}",
            self.layout.dtype.as_str(),
            T::DTYPE.as_str()
        );
    }

    /// `len` elements from element `start` (checked by the caller to lie inside the pool).
    fn slice<T: KvElem>(&self, start: usize, len: usize) -> &[T] {
        self.check_type::<T>();
        // SAFETY: `start..start+len` lies inside the pool's `self.len` elements (checked by
        // callers), which are `T` (checked above) and aligned for it (constructors); the
        // constructors' contracts make it valid memory of this pool; the module docs say why no
        // one else writes it while this shared reference lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<T>().add(start), len) }
    }

    /// `len` elements from element `start`, writable.
    fn slice_mut<T: KvElem>(&mut self, start: usize, len: usize) -> &mut [T] {
        self.check_type::<T>();
        // SAFETY: as in `slice`; `&mut self` makes this the only reference the pool hands out
        // now, and it covers one block at most.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<T>().add(start), len) }
    }

    /// One block's bytes, writable.
    ///
    /// # Panics
    /// When `block` lies outside the pool.
    pub fn block_bytes_mut(&mut self, block: BlockId) -> &mut [u8] {
        let r = self.block_range(block);
        let size = self.layout.dtype.size();
        // SAFETY: the block's byte range lies inside the pool (`block_range`); `&mut self`
        // makes this the only reference the pool hands out now.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(r.start * size), r.len() * size)
        }
    }

    /// One block's bytes.
    ///
    /// # Panics
    /// When `block` lies outside the pool.
    pub fn block_bytes(&self, block: BlockId) -> &[u8] {
        let r = self.block_range(block);
        let size = self.layout.dtype.size();
        // SAFETY: as in `block_bytes_mut`, shared (see `slice`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(r.start * size), r.len() * size) }
    }

    /// The slab of (`block`, `layer`, `kv` 0=K/1=V): every head at every position of the block,
    /// `(num_kv_heads · block_size · head_dim)` elements in the layout's order; the row of
    /// (head, pos) starts at [`KvLayout::row`].
    ///
    /// # Panics
    /// When an index lies outside the layout, or the pool does not hold `T`.
    #[inline]
    pub fn slab<T: KvElem>(&self, block: BlockId, layer: usize, kv: usize) -> &[T] {
        let (start, n) = self.slab_range(block, layer, kv);
        self.slice(start, n)
    }

    /// The slab of [`KvPool::slab`], writable.
    ///
    /// # Panics
    /// When an index lies outside the layout, or the pool does not hold `T`.
    #[inline]
    pub fn slab_mut<T: KvElem>(&mut self, block: BlockId, layer: usize, kv: usize) -> &mut [T] {
        let (start, n) = self.slab_range(block, layer, kv);
        self.slice_mut(start, n)
    }

    #[inline]
    fn slab_range(&self, block: BlockId, layer: usize, kv: usize) -> (usize, usize) {
        let l = &self.layout;
        assert!(
            block.index() < l.num_blocks && layer < l.num_layers && kv < 2,
            "slab ({}, {layer}, {kv}) outside the pool's layout",
            block.index()
        );
        (l.slab_offset(block.index(), layer, kv), l.slab_elems())
    }

    /// Address of the first byte (stable for the pool's life).
    pub fn base_ptr(&self) -> *const u8 {
        self.ptr.as_ptr().cast()
    }

    /// Size of the pool in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len * self.layout.dtype.size()
    }

    /// One block's elements (all layers, K and V).
    ///
    /// # Panics
    /// When `block` lies outside the pool, or the pool does not hold `T`.
    pub fn block<T: KvElem>(&self, block: BlockId) -> &[T] {
        let r = self.block_range(block);
        self.slice(r.start, r.len())
    }

    /// One block's elements, writable.
    ///
    /// # Panics
    /// When `block` lies outside the pool, or the pool does not hold `T`.
    pub fn block_mut<T: KvElem>(&mut self, block: BlockId) -> &mut [T] {
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
        let size = self.layout.dtype.size();
        // SAFETY: both ranges lie inside the pool and are distinct blocks, so they do not
        // overlap; no reference into either is live (`&mut self`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(s.start * size),
                self.ptr.as_ptr().add(d.start * size),
                s.len() * size,
            );
        }
    }

    /// Fills a block with NaN (all-ones bytes, a NaN in every dtype) so any read of a block
    /// nobody owns shows up in the output.
    pub fn poison_block(&mut self, block: BlockId) {
        self.block_bytes_mut(block).fill(POISON);
    }

    /// True when the whole of `block` still holds the poison (it was poisoned and not written
    /// since).
    pub fn is_poisoned(&self, block: BlockId) -> bool {
        self.block_bytes(block).iter().all(|&b| b == POISON)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvOrder;

    /// Sizes from a model file that overflow when multiplied are an error, not a wrapped size
    /// (a small allocation that unchecked offsets would then run past) or a panic.
    #[test]
    fn a_layout_whose_size_overflows_is_refused() {
        let fits = KvLayout {
            num_blocks: 4,
            block_size: 16,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: crate::layout::KvDtype::F16,
            order: KvOrder::Hnd,
        };
        assert!(KvPool::new(fits).is_ok());
        for huge in [
            KvLayout {
                head_dim: usize::MAX / 3,
                ..fits
            },
            KvLayout {
                num_layers: 1 << 40,
                num_kv_heads: 1 << 30,
                ..fits
            },
            KvLayout {
                num_blocks: usize::MAX / 64,
                ..fits
            },
        ] {
            match KvPool::new(huge) {
                Err(AllocatorError::TooLarge(l)) => assert_eq!(l, huge),
                other => panic!("{huge:?}: {other:?}"),
            }
        }
    }

    /// A pool this type allocates starts on a page, as UCX's do (see [`POOL_ALIGN`]), holds
    /// zeros, and an empty one allocates nothing.
    #[test]
    fn a_pool_starts_on_a_page_and_holds_zeros() {
        for num_blocks in [1, 3, 64] {
            let l = KvLayout {
                num_blocks,
                block_size: 3,
                num_layers: 2,
                num_kv_heads: 1,
                head_dim: 5,
                dtype: crate::layout::KvDtype::F16,
                order: KvOrder::Hnd,
            };
            let pool = KvPool::new(l).unwrap();
            assert_eq!(
                pool.base_ptr() as usize % POOL_ALIGN,
                0,
                "{num_blocks} blocks"
            );
            assert_eq!(pool.len_bytes(), l.pool_bytes());
            for b in 0..num_blocks {
                assert!(pool.block_bytes(BlockId(b as u32)).iter().all(|&x| x == 0));
            }
            let empty = KvPool::new(KvLayout { num_blocks: 0, ..l }).unwrap();
            assert_eq!(empty.len_bytes(), 0);
        }
    }

    /// The inlined widening gives `half`'s bits for every f16 and bf16 value (NaNs stay NaN),
    /// at every length (the 8-wide loop and the tail).
    #[test]
    fn widening_equals_half_for_every_value() {
        fn check<T: KvElem>(all: Vec<T>, reference: impl Fn(&T) -> f32) {
            for len in [all.len(), 13, 7, 0] {
                let src = &all[all.len() - len..];
                let mut dst = vec![0f32; len];
                T::load_f32(src, &mut dst);
                for (x, y) in src.iter().zip(&dst) {
                    let want = reference(x);
                    assert!(
                        y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan()),
                        "{y} vs {want}"
                    );
                }
            }
        }
        check((0..=u16::MAX).map(half::f16::from_bits).collect(), |x| {
            x.to_f32()
        });
        check((0..=u16::MAX).map(half::bf16::from_bits).collect(), |x| {
            x.to_f32()
        });
    }

    fn layout() -> KvLayout {
        KvLayout {
            num_blocks: 3,
            block_size: 4,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F32,
            order: KvOrder::Hnd,
        }
    }

    #[test]
    fn slabs_and_blocks_address_the_layout_and_nothing_else() {
        for order in [KvOrder::Hnd, KvOrder::Nhd] {
            let l = KvLayout { order, ..layout() };
            let mut pool = KvPool::new(l).unwrap();
            // Each slab written through `slab_mut` lands where the layout says, in its block only.
            for b in 0..l.num_blocks {
                for layer in 0..l.num_layers {
                    for kv in 0..2 {
                        let t = pool.slab_mut::<f32>(BlockId(b as u32), layer, kv);
                        assert_eq!(t.len(), l.slab_elems());
                        t.fill(l.slab_offset(b, layer, kv) as f32);
                    }
                }
            }
            for b in 0..l.num_blocks {
                let block = pool.block::<f32>(BlockId(b as u32));
                assert_eq!(block.len(), l.block_elems());
                for (i, x) in block.iter().enumerate() {
                    let offset = b * l.block_elems() + i;
                    assert_eq!(*x as usize, offset - offset % l.slab_elems());
                }
            }
            pool.copy_block(BlockId(2), BlockId(0));
            assert_eq!(pool.block::<f32>(BlockId(0)), pool.block::<f32>(BlockId(2)));
            pool.poison_block(BlockId(1));
            assert!(pool.is_poisoned(BlockId(1)) && !pool.is_poisoned(BlockId(2)));
        }
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_block_outside_the_pool_is_refused() {
        let pool = KvPool::new(layout()).unwrap();
        let _ = pool.block::<f32>(BlockId(3));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_slab_outside_the_layout_is_refused() {
        let pool = KvPool::new(layout()).unwrap();
        let _ = pool.slab::<f32>(BlockId(0), 2, 0);
    }

    #[test]
    fn half_pools_are_half_the_size_and_keep_their_type() {
        for dtype in [KvDtype::F16, KvDtype::BF16] {
            let l = KvLayout { dtype, ..layout() };
            let mut pool = KvPool::new(l).unwrap();
            assert_eq!(
                pool.len_bytes(),
                KvPool::new(layout()).unwrap().len_bytes() / 2
            );
            let src: Vec<f32> = (0..l.slab_elems()).map(|i| i as f32 * 0.5 - 3.0).collect();
            let mut back = vec![0f32; src.len()];
            match dtype {
                KvDtype::F16 => {
                    KvElem::store_f32(&src, pool.slab_mut::<half::f16>(BlockId(1), 1, 1));
                    let t = pool.slab::<half::f16>(BlockId(1), 1, 1);
                    // Small multiples of 0.5 are exact in both half types.
                    KvElem::load_f32(t, &mut back);
                    assert_eq!(back, src);
                }
                _ => {
                    KvElem::store_f32(&src, pool.slab_mut::<half::bf16>(BlockId(1), 1, 1));
                    let t = pool.slab::<half::bf16>(BlockId(1), 1, 1);
                    KvElem::load_f32(t, &mut back);
                    assert_eq!(back, src);
                }
            }
            pool.copy_block(BlockId(1), BlockId(2));
            assert!(!pool.is_poisoned(BlockId(2)));
            pool.poison_block(BlockId(2));
            assert!(pool.is_poisoned(BlockId(2)) && !pool.is_poisoned(BlockId(1)));
        }
    }

    #[test]
    #[should_panic(expected = "a f16 pool read as f32")]
    fn a_pool_is_read_only_as_its_own_type() {
        let pool = KvPool::new(KvLayout {
            dtype: KvDtype::F16,
            ..layout()
        })
        .unwrap();
        let _ = pool.slab::<f32>(BlockId(0), 0, 0);
    }
}
