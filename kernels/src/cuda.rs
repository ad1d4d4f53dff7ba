//! The kernels on a GPU (`cuda` feature): their PTX (built by `build.rs`) loaded through
//! cudarc, and one typed launch per kernel that checks every size against the layout before
//! launching, so a wrong argument is an error here, never an out-of-bounds access there.
//!
//! **Unverified on hardware in this repository's history so far**: it type-checks in CI and the
//! PTX assembles, but no GPU was lent to the sessions that wrote it. `examples/gpu_check.rs`
//! runs every kernel against its CPU reference; run it on a GPU before relying on this.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DeviceRepr, DriverError,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use pd_kv_pool::{KvLayout, KvOrder};

/// Why a launch was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// An argument's size does not fit the layout or the other arguments, or there is no
    /// driver.
    #[error("{0}")]
    Shape(String),
    /// The CUDA driver failed.
    #[error("CUDA: {0}")]
    Driver(#[from] DriverError),
}

/// A pool element type the kernels are instantiated for, and its entry point suffix.
pub trait PoolElem: DeviceRepr {
    /// `f32`, `f16` or `bf16`.
    const SUFFIX: &'static str;
}

impl PoolElem for f32 {
    const SUFFIX: &'static str = "f32";
}
impl PoolElem for half::f16 {
    const SUFFIX: &'static str = "f16";
}
impl PoolElem for half::bf16 {
    const SUFFIX: &'static str = "bf16";
}

/// A word `rechunk` moves: the bits of one element (`u16` for f16/bf16 pools, `u32` for f32).
pub trait Word: DeviceRepr {
    /// `b16` or `b32`.
    const SUFFIX: &'static str;
}

impl Word for u16 {
    const SUFFIX: &'static str = "b16";
}
impl Word for u32 {
    const SUFFIX: &'static str = "b32";
}

/// The loaded kernels of one device, launched on its default stream.
#[derive(Debug)]
pub struct Kernels {
    stream: Arc<CudaStream>,
    functions: Vec<(&'static str, CudaFunction)>,
}

const PTX: [(&str, &str); 4] = [
    (
        "reshape_and_cache.cu",
        include_str!(concat!(env!("OUT_DIR"), "/reshape_and_cache.ptx")),
    ),
    (
        "paged_attention.cu",
        include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx")),
    ),
    (
        "block_copy.cu",
        include_str!(concat!(env!("OUT_DIR"), "/block_copy.ptx")),
    ),
    (
        "rechunk.cu",
        include_str!(concat!(env!("OUT_DIR"), "/rechunk.ptx")),
    ),
];

/// Threads per block of every launch (a power of two: `paged_attention` reduces over it).
const THREADS: u32 = 128;

/// The most positions one `paged_attention` launch attends over: its scores live in the 48 KiB
/// of shared memory a launch gets without opting in, beside two reduction arrays.
pub const MAX_ATTENTION_POSITIONS: usize = 48 * 1024 / 4 - 2 * THREADS as usize;

/// A launch of `grid` thread blocks of [`THREADS`] threads with `shared_mem_bytes`.
fn launch(grid: (u32, u32), shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes,
    }
}

/// The pool's layout as the kernels take it, in `pool.cuh`'s order: num_layers, num_kv_heads,
/// block_size, head_dim, order (0 = hnd, 1 = nhd).
fn layout_args(l: &KvLayout) -> [i32; 5] {
    [
        l.num_layers as i32,
        l.num_kv_heads as i32,
        l.block_size as i32,
        l.head_dim as i32,
        order(l),
    ]
}

/// A pool of `len` elements is the whole pool `l` describes, and `layer` one of its layers.
fn pool_fits(len: usize, layer: usize, l: &KvLayout) -> Result<(), KernelError> {
    shape(
        len == l.num_blocks * l.block_elems() && layer < l.num_layers,
        || format!("a pool of {len} elements or layer {layer} outside {l:?}"),
    )
}

fn shape(ok: bool, what: impl FnOnce() -> String) -> Result<(), KernelError> {
    if ok {
        Ok(())
    } else {
        Err(KernelError::Shape(what()))
    }
}

fn int(x: usize, what: &str) -> Result<i32, KernelError> {
    i32::try_from(x).map_err(|_| KernelError::Shape(format!("{what} = {x} does not fit an int")))
}

fn order(l: &KvLayout) -> i32 {
    match l.order {
        KvOrder::Hnd => 0,
        KvOrder::Nhd => 1,
    }
}

impl Kernels {
    /// Loads every kernel on device `ordinal`.
    ///
    /// # Errors
    /// No driver library, no such device, or PTX the driver does not accept.
    pub fn load(ordinal: usize) -> Result<Self, KernelError> {
        // Loaded at run time (this crate built alone): say so rather than panic inside cudarc.
        // A build that links the driver (`linked`, the node's candle build) fails at start instead.
        #[cfg(not(feature = "linked"))]
        // SAFETY: loads (and unloads) the driver library by name; no symbol is called.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(KernelError::Shape(
                "no CUDA driver library (libcuda) on this machine".into(),
            ));
        }
        Self::on_stream(CudaContext::new(ordinal)?.default_stream())
    }

    /// Loads every kernel in `stream`'s context; launches go to `stream` (the node passes
    /// candle's, so its kernels and candle's run in one order).
    ///
    /// # Errors
    /// PTX the driver does not accept.
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Self, KernelError> {
        let ctx = stream.context().clone();
        let mut functions = Vec::new();
        for (file, ptx) in PTX {
            let module = ctx.load_module(Ptx::from_src(ptx))?;
            let names = crate::ENTRY_POINTS
                .iter()
                .find(|(f, _)| *f == file)
                .map_or(&[][..], |(_, n)| *n);
            for &name in names {
                functions.push((name, module.load_function(name)?));
            }
        }
        Ok(Self { stream, functions })
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn function(&self, name: &str) -> Result<&CudaFunction, KernelError> {
        self.functions
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| f)
            .ok_or_else(|| KernelError::Shape(format!("no kernel {name}")))
    }

    /// `reshape_and_cache.cu`: writes `k`, `v` (`(num_tokens, num_kv_heads, head_dim)`) of
    /// `layer` into `pool` at `slots` (`(num_tokens,)`; negative: skipped).
    ///
    /// # Errors
    /// [`KernelError`].
    ///
    /// # Safety
    /// Every non-negative slot must lie inside the pool (`< num_blocks · block_size`): slots are
    /// device data, which this cannot check.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reshape_and_cache<T: PoolElem>(
        &self,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        slots: &CudaSlice<i64>,
        pool: &mut CudaSlice<T>,
        layer: usize,
        l: &KvLayout,
    ) -> Result<(), KernelError> {
        let n = l.num_kv_heads * l.head_dim;
        let tokens = slots.len();
        shape(k.len() == tokens * n && v.len() == k.len(), || {
            format!(
                "k/v hold {} elements, {tokens} tokens need {}",
                k.len(),
                tokens * n
            )
        })?;
        pool_fits(pool.len(), layer, l)?;
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(&format!("reshape_and_cache_{}", T::SUFFIX))?;
        let pool_args = layout_args(l);
        let layer = int(layer, "layer")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(k).arg(v).arg(slots).arg(pool).arg(&layer);
        for a in &pool_args {
            b.arg(a);
        }
        let cfg = launch((tokens as u32, 1), 0);
        // SAFETY: the arguments are the kernel's, in its order and types; sizes were checked.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `paged_attention.cu`: `out` (`(num_tokens, num_heads, head_dim)`) for each query token
    /// `t` of sequence `token_seq[t]` at position `token_pos[t]` (at most `max_pos`), over
    /// `block_tables` (`(num_seqs, max_blocks)`).
    ///
    /// # Errors
    /// [`KernelError`]; a `max_pos` whose scores do not fit the 48 KiB of shared memory a
    /// launch gets without opting in (about 12 000 positions) is refused.
    ///
    /// # Safety
    /// Device data this cannot check: every `token_seq[t]` names a row of `block_tables`,
    /// every `token_pos[t]` is at most `max_pos`, and the table entries for positions
    /// `0..=token_pos[t]` are blocks inside the pool.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn paged_attention<T: PoolElem>(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaView<'_, f32>,
        pool: &CudaSlice<T>,
        block_tables: &CudaSlice<i32>,
        max_blocks: usize,
        token_seq: &CudaSlice<i32>,
        token_pos: &CudaSlice<i32>,
        max_pos: usize,
        num_heads: usize,
        layer: usize,
        scale: f32,
        l: &KvLayout,
    ) -> Result<(), KernelError> {
        let tokens = token_seq.len();
        shape(token_pos.len() == tokens, || {
            "token_seq and token_pos differ in length".into()
        })?;
        shape(
            q.len() == tokens * num_heads * l.head_dim && out.len() == q.len(),
            || {
                format!(
                    "q/out hold {}/{} elements for {tokens} tokens",
                    q.len(),
                    out.len()
                )
            },
        )?;
        shape(
            num_heads > 0 && num_heads.is_multiple_of(l.num_kv_heads.max(1)),
            || format!("{num_heads} query heads over {} KV heads", l.num_kv_heads),
        )?;
        pool_fits(pool.len(), layer, l)?;
        shape(
            max_blocks > 0 && block_tables.len().is_multiple_of(max_blocks),
            || {
                format!(
                    "block tables of {} entries, {max_blocks} per sequence",
                    block_tables.len()
                )
            },
        )?;
        shape(max_pos < max_blocks * l.block_size, || {
            format!(
                "position {max_pos} beyond {max_blocks} blocks of {}",
                l.block_size
            )
        })?;
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(&format!("paged_attention_{}", T::SUFFIX))?;
        let smem = (max_pos + 1 + 2 * THREADS as usize) * 4;
        shape(smem <= 48 * 1024, || {
            format!(
                "{} positions do not fit the kernel's shared memory",
                max_pos + 1
            )
        })?;
        let pool_args = layout_args(l);
        let (mb, heads, layer) = (
            int(max_blocks, "max_blocks")?,
            int(num_heads, "num_heads")?,
            int(layer, "layer")?,
        );
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(q).arg(pool).arg(block_tables).arg(&mb);
        b.arg(token_seq)
            .arg(token_pos)
            .arg(&heads)
            .arg(&layer)
            .arg(&scale);
        for a in &pool_args {
            b.arg(a);
        }
        let smem = u32::try_from(smem)
            .map_err(|_| KernelError::Shape(format!("{smem} bytes of shared memory")))?;
        let cfg = launch((tokens as u32, num_heads as u32), smem);
        // SAFETY: as in `reshape_and_cache`; the shared memory covers max_pos + 1 scores.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `block_copy.cu`, `gather_blocks`: `staging[i] = pool[ids[i]]`, blocks of `block_words`.
    ///
    /// # Errors
    /// [`KernelError`].
    ///
    /// # Safety
    /// Every id must name a block inside the pool (device data, which this cannot check).
    pub unsafe fn gather_blocks(
        &self,
        staging: &mut CudaSlice<u32>,
        pool: &CudaSlice<u32>,
        ids: &CudaSlice<i32>,
        block_words: usize,
    ) -> Result<(), KernelError> {
        shape(staging.len() >= ids.len() * block_words, || {
            format!(
                "staging of {} words for {} blocks",
                staging.len(),
                ids.len()
            )
        })?;
        self.block_copy("gather_blocks", staging, pool, ids, block_words, pool.len())
    }

    /// `block_copy.cu`, `scatter_blocks`: `pool[ids[i]] = staging[i]`.
    ///
    /// # Errors
    /// [`KernelError`].
    ///
    /// # Safety
    /// As [`Kernels::gather_blocks`].
    pub unsafe fn scatter_blocks(
        &self,
        pool: &mut CudaSlice<u32>,
        staging: &CudaSlice<u32>,
        ids: &CudaSlice<i32>,
        block_words: usize,
    ) -> Result<(), KernelError> {
        let pool_len = pool.len();
        shape(staging.len() >= ids.len() * block_words, || {
            format!(
                "staging of {} words for {} blocks",
                staging.len(),
                ids.len()
            )
        })?;
        self.block_copy("scatter_blocks", pool, staging, ids, block_words, pool_len)
    }

    fn block_copy(
        &self,
        name: &str,
        dst: &mut CudaSlice<u32>,
        src: &CudaSlice<u32>,
        ids: &CudaSlice<i32>,
        block_words: usize,
        pool_len: usize,
    ) -> Result<(), KernelError> {
        shape(
            block_words > 0 && pool_len.is_multiple_of(block_words),
            || format!("a pool of {pool_len} words is not whole blocks of {block_words}"),
        )?;
        if ids.is_empty() {
            return Ok(());
        }
        let f = self.function(name)?;
        let words = block_words as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(dst).arg(src).arg(ids).arg(&words);
        let cfg = launch((ids.len() as u32, 1), 0);
        // SAFETY: the kernel's arguments in order; sizes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `rechunk.cu`: copies tokens `tokens` from `src`'s blocks `src_blocks` (laid out as
    /// `from`) into `dst`'s blocks `dst_blocks` (laid out as `to`); see
    /// [`pd_kv_pool::rechunk`] for the block lists' meaning.
    ///
    /// # Errors
    /// [`KernelError`].
    ///
    /// # Safety
    /// Every block id in the lists must name a block inside its pool (device data, which this
    /// cannot check).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rechunk<E: Word>(
        &self,
        dst: &mut CudaSlice<E>,
        src: &CudaSlice<E>,
        src_blocks: &CudaSlice<i32>,
        dst_blocks: &CudaSlice<i32>,
        tokens: std::ops::Range<usize>,
        from: &KvLayout,
        to: &KvLayout,
    ) -> Result<(), KernelError> {
        shape(
            (from.num_layers, from.num_kv_heads, from.head_dim)
                == (to.num_layers, to.num_kv_heads, to.head_dim)
                && from.dtype == to.dtype
                && from.dtype.size() == std::mem::size_of::<E>(),
            || format!("cannot rechunk {from:?} into {to:?} as {}", E::SUFFIX),
        )?;
        shape(from.block_size > 0 && to.block_size > 0, || {
            "a block size of 0".into()
        })?;
        shape(
            src.len() == from.num_blocks * from.block_elems()
                && dst.len() == to.num_blocks * to.block_elems(),
            || {
                format!(
                    "pools of {} and {} elements for {from:?} and {to:?}",
                    src.len(),
                    dst.len()
                )
            },
        )?;
        let covers = |l: &KvLayout, n: usize| {
            tokens.is_empty()
                || n >= tokens.end.div_ceil(l.block_size) - tokens.start / l.block_size
        };
        shape(
            covers(from, src_blocks.len()) && covers(to, dst_blocks.len()),
            || format!("block lists do not cover tokens {tokens:?}"),
        )?;
        if tokens.is_empty() {
            return Ok(());
        }
        let f = self.function(&format!("rechunk_{}", E::SUFFIX))?;
        let total = tokens.len() * from.num_layers * 2 * from.num_kv_heads * from.head_dim;
        let (start, n) = (
            int(tokens.start, "token start")?,
            int(tokens.len(), "tokens")?,
        );
        let dims = [from.num_layers, from.num_kv_heads, from.head_dim];
        let [nl, nkv, hd] = dims.map(|x| x as i32);
        let (fbs, tbs) = (from.block_size as i32, to.block_size as i32);
        let (fo, tord) = (order(from), order(to));
        let mut b = self.stream.launch_builder(f);
        b.arg(dst)
            .arg(src)
            .arg(src_blocks)
            .arg(dst_blocks)
            .arg(&start)
            .arg(&n);
        b.arg(&nl)
            .arg(&nkv)
            .arg(&hd)
            .arg(&fbs)
            .arg(&fo)
            .arg(&tbs)
            .arg(&tord);
        let blocks = total.div_ceil(THREADS as usize).min(65_535) as u32;
        let cfg = launch((blocks, 1), 0);
        // SAFETY: the kernel's arguments in order; it strides over `total` elements.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
