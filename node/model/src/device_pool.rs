//! The compute pool in GPU memory (`cuda` feature): the KV the model computes on, laid out
//! exactly as the transfer pool ([`KvLayout`], `kernels/cuda/pool.cuh`) with the same block
//! ids, allocated once on candle's CUDA device; our kernels (`pd-kernels`) write each step's
//! K/V into it and attend over it on candle's stream, so they run in order with candle's ops.
//!
//! **Never run on a GPU so far.** It type-checks (`scripts/cuda-check.sh`), and the staging it
//! plugs into is tested on CPU through [`crate::HostStaged`] (`pd-node --kv-staged`), but it
//! has not run on a GPU yet: `docs/gpu.md` lists what is unverified.
//!
//! Blocks move between this pool and the host transfer pool one block per copy, all enqueued
//! on the stream and then waited for once. The transfer pool is page-locked for the driver at
//! the first copy (`cuMemHostRegister`, [`Pinned`]), so each copy is a DMA straight from or to
//! the memory UCX serves; if the driver refuses (the log says so) the copies still work,
//! through the driver's own bounce buffer. A block is a contiguous range of both pools (every
//! layer's K and V), so no gather is needed. A pull uploads its blocks as they land, from its
//! own thread, on a copy stream of their own ([`DeviceUpload`]): the DMA of one part overlaps
//! the host's copy of the next, and the engine's stream is not held up.

use std::sync::{Arc, RwLock};

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, ValidAsZeroBits, result, sys,
};
use pd_kernels::cuda::{Kernels, PoolElem};
use pd_kv_pool::{BlockId, KvDtype, KvElem, KvLayout, KvPool};

use crate::batch::BatchInput;
use crate::error::ModelError;
use crate::kv_store::{
    BlockUpload, LayerQkv, PagedKv, StagedKv, blocks_inside, same_layout, upload_offset,
};

/// The pool's memory, typed by its dtype.
enum Slab {
    F32(CudaSlice<f32>),
    F16(CudaSlice<half::f16>),
    Bf16(CudaSlice<half::bf16>),
}

/// Runs `$body` with `$s` bound to the slab's typed `CudaSlice` (`$t` its element type).
macro_rules! with_slab {
    ($slab:expr, $s:ident, $t:ident => $body:expr) => {
        match $slab {
            Slab::F32($s) => {
                type $t = f32;
                $body
            }
            Slab::F16($s) => {
                type $t = half::f16;
                $body
            }
            Slab::Bf16($s) => {
                type $t = half::bf16;
                $body
            }
        }
    };
}

/// One step's addressing on the device, uploaded once for all layers.
struct Step {
    /// (t,) pool slot of each token.
    slots: CudaSlice<i64>,
    /// (num_seqs, max_blocks) block tables, rows padded with block 0.
    tables: CudaSlice<i32>,
    max_blocks: usize,
    /// (t,) the sequence (row of `tables`) of each query token.
    token_seq: CudaSlice<i32>,
    /// (t,) the position of each query token.
    token_pos: CudaSlice<i32>,
    /// The largest position in `token_pos`.
    max_pos: usize,
}

/// The host transfer pool's memory, page-locked for the driver while this pool lives (the
/// engine drops its compute pool before its transfer pool: `Engine`'s field order).
struct Pinned {
    /// The transfer pool's first byte and length.
    base: usize,
    len: usize,
    /// Whether `cuMemHostRegister` took it (else copies go through the driver's bounce buffer).
    registered: bool,
    /// The context that registered it, kept to unregister on drop.
    stream: Arc<CudaStream>,
}

impl Pinned {
    /// Page-locks `pool`'s memory for the driver; a refusal is logged and copies stay correct.
    fn new(stream: &Arc<CudaStream>, pool: &KvPool) -> Self {
        let (base, len) = (pool.base_ptr() as usize, pool.len_bytes());
        let registered = stream.context().bind_to_thread().is_ok()
            && {
                // SAFETY: the range is the transfer pool's live allocation, which outlives this
                // registration (unregistered in `drop`, before the pool is freed).
                let r = unsafe {
                    cudarc::driver::sys::cuMemHostRegister_v2(
                        base as *mut std::ffi::c_void,
                        len,
                        cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
                    )
                };
                match r.result() {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(error = %e, bytes = len, "cannot page-lock the KV transfer pool: block copies go through the driver's bounce buffer (slower)");
                        false
                    }
                }
            };
        if registered {
            tracing::info!(
                bytes = len,
                "KV transfer pool page-locked for device copies"
            );
        }
        Self {
            base,
            len,
            registered,
            stream: stream.clone(),
        }
    }

    fn covers(&self, pool: &KvPool) -> bool {
        self.base == pool.base_ptr() as usize && self.len == pool.len_bytes()
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.registered && self.stream.context().bind_to_thread().is_ok() {
            // SAFETY: registered by `Pinned::new` on this range, which is still allocated.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.base as *mut _) };
        }
    }
}

/// The KV pool in device memory (see the module's doc).
pub struct DevicePool {
    layout: KvLayout,
    device: CudaDevice,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    slab: Slab,
    step: Option<Step>,
    /// The transfer pool, page-locked at the first copy.
    pinned: Option<Pinned>,
    /// The pulls' uploader, once asked for; stopped and drained before the slab is freed.
    uploader: Option<Arc<DeviceUpload>>,
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        if let Some(u) = &self.uploader {
            // No upload starts once this is taken; those under way finish before the slab goes.
            *u.alive.write().unwrap_or_else(|e| e.into_inner()) = false;
            if let Err(e) = u.settle() {
                tracing::error!(error = %e, "waiting for the pulls' uploads before freeing the compute pool");
            }
        }
    }
}

/// [`BlockUpload`] into a [`DevicePool`]: asynchronous copies from the page-locked transfer
/// pool, on a stream of their own that each pull first orders after the engine's work queued
/// before it reserved the pull's blocks (an event the engine records at `mark`, on its thread).
/// The stream is made with the driver's API, not `CudaContext::new_stream`, so candle's context
/// does not switch to cudarc's multi-stream event tracking (an event per slice per use).
struct DeviceUpload {
    /// False once the pool is being dropped; copies start only while it is held true.
    alive: RwLock<bool>,
    /// The slab's first byte on the device.
    base: sys::CUdeviceptr,
    block_bytes: usize,
    num_blocks: usize,
    /// Candle's stream, which the model's kernels run on. Candle's device uses the per-thread
    /// default stream (`CU_STREAM_PER_THREAD`): this handle means the engine thread's stream
    /// only on the engine thread, so only `mark` (called there) records on it.
    compute: Arc<CudaStream>,
    /// The copies' stream (ours: destroyed on drop).
    copies: sys::CUstream,
    /// The engine's stream as of its latest `mark`, which each pull's copies wait for; an
    /// error once a mark failed.
    fence: std::sync::Mutex<Result<Option<sys::CUevent>, String>>,
}

// SAFETY: CUDA streams and device addresses may be used from any thread once the context is
// bound there (each method binds it); the driver serialises work queued on one stream.
unsafe impl Send for DeviceUpload {}
// SAFETY: as for `Send`: every method takes `&self` and only queues work or waits.
unsafe impl Sync for DeviceUpload {}

impl std::fmt::Debug for DeviceUpload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceUpload")
            .field("block_bytes", &self.block_bytes)
            .field("num_blocks", &self.num_blocks)
            .finish_non_exhaustive()
    }
}

impl Drop for DeviceUpload {
    fn drop(&mut self) {
        if self.compute.context().bind_to_thread().is_ok() {
            // SAFETY: our stream, created in `DevicePool::uploader`, destroyed once; the
            // fence's event is ours too, and nothing waits on it once the stream is synced.
            unsafe {
                let _ = result::stream::synchronize(self.copies);
                let _ = result::stream::destroy(self.copies);
                if let Ok(Some(ev)) = *self.fence.lock().unwrap_or_else(|e| e.into_inner()) {
                    let _ = result::event::destroy(ev);
                }
            }
        }
    }
}

impl DeviceUpload {
    /// An event recorded on the calling thread's stream of candle's device.
    fn record_compute(&self) -> Result<sys::CUevent, ModelError> {
        self.compute.context().bind_to_thread().map_err(gpu)?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(gpu)?;
        // SAFETY: a fresh event, recorded on candle's live stream.
        match unsafe { result::event::record(ev, self.compute.cu_stream()) } {
            Ok(()) => Ok(ev),
            Err(e) => {
                // SAFETY: ours, never recorded.
                let _ = unsafe { result::event::destroy(ev) };
                Err(gpu(e))
            }
        }
    }
}

impl BlockUpload for DeviceUpload {
    fn mark(&self) {
        let recorded = self.record_compute().map_err(|e| e.to_string());
        let mut fence = self.fence.lock().unwrap_or_else(|e| e.into_inner());
        if let Ok(Some(old)) = *fence {
            // SAFETY: ours; a pull's wait on it was enqueued under this lock, and an event may
            // be destroyed while waited on (the driver releases it once complete).
            let _ = unsafe { result::event::destroy(old) };
        }
        if let Err(e) = &recorded {
            tracing::error!(error = %e, "cannot mark the engine's stream: pulls into the compute pool fail from now on");
        }
        *fence = recorded.map(Some);
    }

    fn begin(&self) -> Result<(), ModelError> {
        self.compute.context().bind_to_thread().map_err(gpu)?;
        let fence = self.fence.lock().unwrap_or_else(|e| e.into_inner());
        match &*fence {
            // SAFETY: the event is live while the lock is held; our live stream waits on it.
            Ok(Some(ev)) => unsafe {
                result::stream::wait_event(
                    self.copies,
                    *ev,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(gpu),
            Ok(None) => Err(gpu("the engine never marked its stream before a pull")),
            Err(e) => Err(gpu(format!("the engine's stream could not be marked: {e}"))),
        }
    }

    unsafe fn upload(&self, first: BlockId, bytes: &[u8]) -> Result<(), ModelError> {
        let alive = self.alive.read().unwrap_or_else(|e| e.into_inner());
        if !*alive {
            return Err(gpu("the compute pool is gone"));
        }
        let offset = upload_offset(first, bytes.len(), self.num_blocks, self.block_bytes)?;
        self.compute.context().bind_to_thread().map_err(gpu)?;
        let dst = self.base + offset as sys::CUdeviceptr;
        // SAFETY: the blocks lie inside the slab, alive while `alive` is held true (the pool's
        // drop waits for these copies); the caller owns them and keeps `bytes` as it is until
        // `settle`.
        unsafe { result::memcpy_htod_async(dst, bytes, self.copies) }.map_err(gpu)
    }

    fn settle(&self) -> Result<(), ModelError> {
        self.compute.context().bind_to_thread().map_err(gpu)?;
        // SAFETY: our live stream.
        unsafe { result::stream::synchronize(self.copies) }.map_err(gpu)
    }
}

impl std::fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePool")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

/// A device error as a [`ModelError`].
fn gpu(e: impl std::fmt::Display) -> ModelError {
    ModelError::Device(e.to_string())
}

impl DevicePool {
    /// Allocates a zeroed pool of `layout` on `device` (a CUDA device) and loads the kernels on
    /// its stream.
    ///
    /// # Errors
    /// [`ModelError::Device`]: not a CUDA device, out of device memory, PTX refused.
    pub fn new(layout: KvLayout, device: &Device) -> Result<Self, ModelError> {
        let device = device.as_cuda_device()?.clone();
        let stream = device.cuda_stream();
        let kernels = Kernels::on_stream(stream.clone()).map_err(gpu)?;
        let elems = layout.num_blocks * layout.block_elems();
        let slab = match layout.dtype {
            KvDtype::F32 => Slab::F32(stream.alloc_zeros(elems).map_err(gpu)?),
            KvDtype::F16 => Slab::F16(stream.alloc_zeros(elems).map_err(gpu)?),
            KvDtype::BF16 => Slab::Bf16(stream.alloc_zeros(elems).map_err(gpu)?),
        };
        Ok(Self {
            layout,
            device,
            stream,
            kernels,
            slab,
            step: None,
            pinned: None,
            uploader: None,
        })
    }

    /// Page-locks the transfer pool `host` at the first copy from or to it.
    fn pin(&mut self, host: &KvPool) {
        if !self.pinned.as_ref().is_some_and(|p| p.covers(host)) {
            self.pinned = None;
            self.pinned = Some(Pinned::new(&self.stream, host));
        }
    }

    /// Element range of `block`.
    fn range(&self, block: BlockId) -> std::ops::Range<usize> {
        let n = self.layout.block_elems();
        block.index() * n..(block.index() + 1) * n
    }
}

/// The contiguous f32 elements of `t` on the device, as a view (the read guard must outlive
/// it; the caller holds it).
fn f32_view<'a>(
    storage: &'a Storage,
    layout: &candle_core::Layout,
    elems: usize,
) -> Result<CudaView<'a, f32>, ModelError> {
    let Storage::Cuda(cs) = storage else {
        return Err(gpu("a tensor of the GPU path is not on the GPU"));
    };
    if !layout.is_contiguous() {
        return Err(gpu("a tensor of the GPU path is not contiguous"));
    }
    let start = layout.start_offset();
    Ok(cs.as_cuda_slice::<f32>()?.slice(start..start + elems))
}

impl PagedKv for DevicePool {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn begin_step(&mut self, batch: &BatchInput) -> Result<(), ModelError> {
        let slots: Vec<i64> = batch.slots.iter().map(|&s| s as i64).collect();
        let max_blocks = batch
            .seqs
            .iter()
            .map(|s| s.block_table.len())
            .max()
            .unwrap_or(1)
            .max(1);
        let mut tables = vec![0i32; batch.seqs.len() * max_blocks];
        let (mut token_seq, mut token_pos) = (Vec::new(), Vec::new());
        for (i, s) in batch.seqs.iter().enumerate() {
            for (j, b) in s.block_table.iter().enumerate() {
                tables[i * max_blocks + j] = b.0 as i32;
            }
            for r in 0..s.query_len {
                token_seq.push(i as i32);
                token_pos.push((s.context_len - s.query_len + r) as i32);
            }
        }
        let max_pos = token_pos.iter().copied().max().unwrap_or(0) as usize;
        let s = &self.stream;
        self.step = Some(Step {
            slots: s.clone_htod(&slots).map_err(gpu)?,
            tables: s.clone_htod(&tables).map_err(gpu)?,
            max_blocks,
            token_seq: s.clone_htod(&token_seq).map_err(gpu)?,
            token_pos: s.clone_htod(&token_pos).map_err(gpu)?,
            max_pos,
        });
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        qkv: LayerQkv<'_>,
        batch: &BatchInput,
    ) -> Result<Tensor, ModelError> {
        let LayerQkv {
            q,
            k,
            v,
            num_heads,
            scale,
        } = qkv;
        let step = self
            .step
            .as_ref()
            .ok_or_else(|| gpu("attention before the step's addressing was uploaded"))?;
        let l = self.layout;
        let t = batch.num_tokens();
        let kv_elems = t * l.num_kv_heads * l.head_dim;
        let q_elems = t * num_heads * l.head_dim;
        // (1, t, nh, hd), (1, t, nkv, hd), (t·nkv·hd,): contiguous f32 on the device.
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let qv = f32_view(&qs, ql, q_elems)?;
        let kv = f32_view(&ks, kl, kv_elems)?;
        let vv = f32_view(&vs, vl, kv_elems)?;
        let mut out = self.stream.alloc_zeros::<f32>(q_elems).map_err(gpu)?;
        let kern = &self.kernels;
        with_slab!(&mut self.slab, slab, T => {
            // SAFETY: the slots and tables come from a batch `Model::forward` checked against
            // this layout (every slot and block inside the pool); positions are at most
            // `max_pos` and covered by their tables (`SeqView`'s invariant).
            unsafe {
                kern.reshape_and_cache::<T>(&kv, &vv, &step.slots, slab, layer, &l)
                    .map_err(gpu)?;
                kern.paged_attention::<T>(
                    &mut out,
                    &qv,
                    slab,
                    &step.tables,
                    step.max_blocks,
                    &step.token_seq,
                    &step.token_pos,
                    step.max_pos,
                    num_heads,
                    layer,
                    scale,
                    &l,
                )
                .map_err(gpu)?;
            }
        });
        let storage = CudaStorage::wrap_cuda_slice(out, self.device.clone());
        // (t, nh·hd)
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            (t, num_heads * l.head_dim),
            BackpropOp::none(),
            false,
        ))
    }
}

/// Copies `blocks` of `host` into `slab` (element ranges of `n` per block).
fn upload_as<T: KvElem + DeviceRepr>(
    stream: &Arc<CudaStream>,
    slab: &mut CudaSlice<T>,
    host: &KvPool,
    blocks: &[BlockId],
    n: usize,
) -> Result<(), ModelError> {
    for &b in blocks {
        let r = b.index() * n..(b.index() + 1) * n;
        stream
            .memcpy_htod(host.block::<T>(b), &mut slab.slice_mut(r))
            .map_err(gpu)?;
    }
    Ok(())
}

/// Copies `blocks` of `slab` into `host`.
fn download_as<T: KvElem + DeviceRepr>(
    stream: &Arc<CudaStream>,
    slab: &CudaSlice<T>,
    host: &mut KvPool,
    blocks: &[BlockId],
    n: usize,
) -> Result<(), ModelError> {
    for &b in blocks {
        let r = b.index() * n..(b.index() + 1) * n;
        stream
            .memcpy_dtoh(&slab.slice(r), host.block_mut::<T>(b))
            .map_err(gpu)?;
    }
    Ok(())
}

/// Copies block range `src` over `dst` inside `slab`, through a one-block device buffer.
fn copy_as<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slab: &mut CudaSlice<T>,
    src: std::ops::Range<usize>,
    dst: std::ops::Range<usize>,
) -> Result<(), ModelError> {
    let mut tmp = stream.alloc_zeros::<T>(src.len()).map_err(gpu)?;
    stream
        .memcpy_dtod(&slab.slice(src), &mut tmp)
        .map_err(gpu)?;
    stream
        .memcpy_dtod(&tmp, &mut slab.slice_mut(dst))
        .map_err(gpu)?;
    Ok(())
}

impl StagedKv for DevicePool {
    fn upload(&mut self, from: &KvPool, blocks: &[BlockId]) -> Result<(), ModelError> {
        same_layout(&self.layout, from.layout())?;
        blocks_inside(&self.layout, blocks)?;
        self.pin(from);
        let n = self.layout.block_elems();
        let stream = &self.stream;
        with_slab!(&mut self.slab, slab, T => upload_as::<T>(stream, slab, from, blocks, n))?;
        // From page-locked memory the copies are asynchronous: the pulled blocks must stay as
        // they are until they are read, so wait (the step after this one reads them anyway).
        self.stream.synchronize().map_err(gpu)
    }

    fn download(&mut self, to: &mut KvPool, blocks: &[BlockId]) -> Result<(), ModelError> {
        same_layout(&self.layout, to.layout())?;
        blocks_inside(&self.layout, blocks)?;
        self.pin(to);
        let n = self.layout.block_elems();
        let stream = &self.stream;
        with_slab!(&self.slab, slab, T => download_as::<T>(stream, slab, to, blocks, n))?;
        // The bytes must be in host memory before a peer may read them.
        self.stream.synchronize().map_err(gpu)
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<(), ModelError> {
        blocks_inside(&self.layout, &[src, dst])?;
        if src == dst {
            return Ok(());
        }
        let (rs, rd) = (self.range(src), self.range(dst));
        let stream = &self.stream;
        with_slab!(&mut self.slab, slab, T => copy_as::<T>(stream, slab, rs, rd))
    }

    fn path(&self) -> &'static str {
        "cuda-host-staged"
    }

    fn uploader(&mut self, transfer: &KvPool) -> Result<Option<Arc<dyn BlockUpload>>, ModelError> {
        same_layout(&self.layout, transfer.layout())?;
        if self.uploader.is_none() {
            // The copies are asynchronous only from page-locked memory.
            self.pin(transfer);
            self.stream.context().bind_to_thread().map_err(gpu)?;
            let copies =
                result::stream::create(result::stream::StreamKind::NonBlocking).map_err(gpu)?;
            let stream = self.stream.clone();
            let base = with_slab!(&self.slab, slab, _T => slab.device_ptr(&stream).0);
            self.uploader = Some(Arc::new(DeviceUpload {
                alive: RwLock::new(true),
                base,
                block_bytes: self.layout.block_bytes(),
                num_blocks: self.layout.num_blocks,
                compute: stream,
                copies,
                fence: std::sync::Mutex::new(Ok(None)),
            }));
        }
        Ok(self.uploader.clone().map(|u| u as Arc<dyn BlockUpload>))
    }
}

// A `PoolElem` is what the kernels are instantiated for; every pool dtype has one.
const _: fn() = || {
    fn is_pool_elem<T: PoolElem + KvElem>() {}
    is_pool_elem::<f32>();
    is_pool_elem::<half::f16>();
    is_pool_elem::<half::bf16>();
};
