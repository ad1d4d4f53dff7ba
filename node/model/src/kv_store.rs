//! Where the model's keys and values live while it computes.
//!
//! A CPU node computes on its transfer pool itself: the [`KvPool`] peers read over UCX is the
//! memory attention reads ([`PagedKv`] for `KvPool`). A GPU node cannot: its KV lives in device
//! memory, which UCX here cannot register, so it keeps a second pool, laid out exactly as the
//! transfer pool with the same block ids, and the engine copies blocks between the two at the
//! only moments a peer's view matters ([`StagedKv`]):
//! - **download** (compute pool → transfer pool) right before a lease is granted on blocks, so
//!   a peer that reads them finds the KV the model computed;
//! - **upload** (transfer pool → compute pool) right after a pull wrote blocks, before any step
//!   reads them — by the engine, or block by block as they land by the thread that pulled them
//!   ([`BlockUpload`]), so the copies overlap the rest of the pull and the engine keeps stepping;
//! - copy-on-write copies run on the compute pool.
//!
//! [`HostStaged`] is that path on the CPU: a second host pool and block copies, so the engine's
//! staging (`pd-node --kv-staged`) is tested token for token between real processes without a
//! GPU. The GPU's pool is `device_pool::DevicePool` (`cuda` feature).

use std::sync::{Arc, RwLock};

use candle_core::Tensor;
use pd_kv_pool::{BlockId, KvLayout, KvPool};

use crate::batch::BatchInput;
use crate::error::ModelError;
use crate::paged_attention;

/// One layer's projected, rotated queries, keys and values for a step, all f32 on the model's
/// device.
#[derive(Debug, Clone, Copy)]
pub struct LayerQkv<'a> {
    /// (1, t, num_heads, head_dim)
    pub q: &'a Tensor,
    /// (1, t, num_kv_heads, head_dim)
    pub k: &'a Tensor,
    /// (t · num_kv_heads · head_dim,)
    pub v: &'a Tensor,
    /// Query heads.
    pub num_heads: usize,
    /// Softmax scale, 1/√head_dim.
    pub scale: f32,
}

/// A pool the model writes a step's K/V into and attends over, through block tables.
pub trait PagedKv {
    /// The pool's layout (its block size, order and dtype are the kernels').
    fn layout(&self) -> &KvLayout;

    /// Writes this step's K and V of `layer` at `batch.slots`, then attends every query row
    /// over its sequence's blocks: (t, num_heads · head_dim) f32 on the model's device.
    ///
    /// # Errors
    /// Candle or device errors.
    fn attention(
        &mut self,
        layer: usize,
        qkv: LayerQkv<'_>,
        batch: &BatchInput,
    ) -> Result<Tensor, ModelError>;

    /// Called once per step before the first layer (a device pool uploads the step's slots and
    /// block tables here, once for all layers).
    ///
    /// # Errors
    /// Device errors.
    fn begin_step(&mut self, _batch: &BatchInput) -> Result<(), ModelError> {
        Ok(())
    }
}

impl PagedKv for KvPool {
    fn layout(&self) -> &KvLayout {
        KvPool::layout(self)
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
        let t = batch.num_tokens();
        let hd = KvPool::layout(self).head_dim;
        // Host copies, (t, heads, hd) row-major, for the paged kernels.
        let q_host = q.flatten_all()?.to_vec1::<f32>()?;
        let k_host = k.flatten_all()?.to_vec1::<f32>()?;
        let v_host = v.to_vec1::<f32>()?;
        paged_attention::write_kv(self, layer, &k_host, &v_host, &batch.slots);
        let out = paged_attention::attend(self, layer, &q_host, num_heads, &batch.seqs, scale);
        // (t, nh·hd)
        Ok(Tensor::from_vec(out, (t, num_heads * hd), q.device())?)
    }
}

/// A compute pool kept apart from the transfer pool (see the module's doc). Both have the same
/// layout and block ids; the engine calls these at the moments the module's doc names.
pub trait StagedKv: PagedKv + Send + std::fmt::Debug {
    /// Copies `blocks` from the transfer pool `from` into this pool (after a pull wrote them).
    ///
    /// # Errors
    /// A layout mismatch, a block outside the pool, or a device error.
    fn upload(&mut self, from: &KvPool, blocks: &[BlockId]) -> Result<(), ModelError>;

    /// Copies `blocks` from this pool into the transfer pool `to` (before a peer may read
    /// them); returns once the bytes are there.
    ///
    /// # Errors
    /// As [`StagedKv::upload`].
    fn download(&mut self, to: &mut KvPool, blocks: &[BlockId]) -> Result<(), ModelError>;

    /// Copies block `src` over block `dst` (copy-on-write of a shared partial block).
    ///
    /// # Errors
    /// A block outside the pool, or a device error.
    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<(), ModelError>;

    /// The path's name, for the log and the handshake: `host-staged` (CPU) or
    /// `cuda-host-staged`.
    fn path(&self) -> &'static str;

    /// A handle that uploads blocks from the transfer pool `transfer` into this pool from
    /// another thread while the engine steps ([`BlockUpload`]); `None` where this pool has none.
    /// Copies through it stop (with an error) once this pool is dropped.
    ///
    /// # Errors
    /// A layout mismatch, or a device error.
    fn uploader(&mut self, transfer: &KvPool) -> Result<Option<Arc<dyn BlockUpload>>, ModelError> {
        let _ = transfer;
        Ok(None)
    }
}

/// Uploads pulled blocks into a staged compute pool from the thread that pulled them, as they
/// land: the copies overlap the rest of the pull (a GPU's copies run on their own stream while
/// the host copies the next blocks) and never hold up the engine's steps.
///
/// The engine calls [`BlockUpload::mark`] on its own thread each time it has reserved blocks
/// for pulls, before it tells them. One pull: [`BlockUpload::begin`], then
/// [`BlockUpload::upload`] for each landed block, then [`BlockUpload::settle`] on every way out
/// — before the engine hears of the blocks, and before they are freed after a failure.
pub trait BlockUpload: Send + Sync + std::fmt::Debug {
    /// On the engine's thread, after it reserved blocks for pulls and before it tells them:
    /// notes how far the engine's work on the compute pool has been asked for (on a GPU: an
    /// event on the engine's stream, which may still be writing a block freed since), for the
    /// next pulls' [`BlockUpload::begin`]. A failure here makes later `begin`s fail.
    fn mark(&self) {}

    /// Orders the copies that follow after the engine's work asked for before its latest
    /// [`BlockUpload::mark`]. Once per pull, before its first upload.
    ///
    /// # Errors
    /// The pool is gone, the mark failed, or a device error.
    fn begin(&self) -> Result<(), ModelError>;

    /// Starts copying `bytes` — blocks `first`, `first + 1`, … of the transfer pool, a whole
    /// number of consecutive blocks — into the same blocks of the compute pool, as one copy;
    /// may return before the copy is done (a GPU's copy stream).
    ///
    /// # Errors
    /// The pool is gone, the blocks lie outside it or `bytes` is not a whole number of blocks,
    /// or a device error.
    ///
    /// # Safety
    /// The blocks are reserved for the caller's pull: the engine neither reads nor writes them,
    /// in either pool, until this pull's [`BlockUpload::settle`] has returned; and `bytes` stays
    /// valid and unchanged until then.
    unsafe fn upload(&self, first: BlockId, bytes: &[u8]) -> Result<(), ModelError>;

    /// Returns once every copy started through this handle has finished (including other
    /// pulls' copies started meanwhile). On a GPU this waits for the copy stream (the DMA of
    /// the last parts: well under a millisecond for a pull's last MiB).
    ///
    /// # Errors
    /// A device error.
    fn settle(&self) -> Result<(), ModelError>;
}

/// Checks that `a` and `b` hold the same blocks in the same bytes.
pub(crate) fn same_layout(a: &KvLayout, b: &KvLayout) -> Result<(), ModelError> {
    if a == b {
        Ok(())
    } else {
        Err(ModelError::InvalidBatch(format!(
            "the compute pool's layout {a:?} differs from the transfer pool's {b:?}"
        )))
    }
}

/// The byte offset of block `first` in a pool of `num_blocks` blocks of `block_bytes`
/// (contiguous, block-major: `KvPool::block_bytes`), checked to take an upload of `len` bytes
/// from there: one or more whole blocks, all inside the pool.
pub(crate) fn upload_offset(
    first: BlockId,
    len: usize,
    num_blocks: usize,
    block_bytes: usize,
) -> Result<usize, ModelError> {
    let bb = block_bytes.max(1);
    if len == 0 || !len.is_multiple_of(bb) || first.index() + len / bb > num_blocks {
        return Err(ModelError::InvalidBatch(format!(
            "upload of {len} bytes from block {} of a pool of {num_blocks} blocks of {block_bytes} bytes",
            first.index()
        )));
    }
    Ok(first.index() * block_bytes)
}

/// Checks that every block lies inside a pool of `l`.
pub(crate) fn blocks_inside(l: &KvLayout, blocks: &[BlockId]) -> Result<(), ModelError> {
    match blocks.iter().find(|b| b.index() >= l.num_blocks) {
        None => Ok(()),
        Some(b) => Err(ModelError::InvalidBatch(format!(
            "block {} outside a pool of {} blocks",
            b.index(),
            l.num_blocks
        ))),
    }
}

/// The staged path on the CPU: the model computes on a second host pool, and blocks are
/// copied to and from the transfer pool as a GPU node copies them to and from device memory.
#[derive(Debug)]
pub struct HostStaged {
    /// False once this pool is being dropped: [`HostUpload`]s copy only while they hold it
    /// true, for reading.
    alive: Arc<RwLock<bool>>,
    pool: KvPool,
}

impl Drop for HostStaged {
    fn drop(&mut self) {
        // No upload is copying once this is taken, and none starts after.
        *self.alive.write().unwrap_or_else(|e| e.into_inner()) = false;
    }
}

/// [`BlockUpload`] into a [`HostStaged`] pool: a plain copy on the caller's thread.
#[derive(Debug)]
struct HostUpload {
    alive: Arc<RwLock<bool>>,
    /// The compute pool's first byte (an address: the pool is written only through it, block
    /// by block, by callers that own those blocks).
    base: usize,
    block_bytes: usize,
    num_blocks: usize,
}

impl BlockUpload for HostUpload {
    fn begin(&self) -> Result<(), ModelError> {
        Ok(())
    }

    unsafe fn upload(&self, first: BlockId, bytes: &[u8]) -> Result<(), ModelError> {
        let alive = self.alive.read().unwrap_or_else(|e| e.into_inner());
        if !*alive {
            return Err(ModelError::Device("the compute pool is gone".into()));
        }
        let offset = upload_offset(first, bytes.len(), self.num_blocks, self.block_bytes)?;
        // SAFETY: the blocks lie inside the pool (checked), which stays allocated while `alive`
        // is held true; the caller owns them (nothing else touches them) and `bytes` is another
        // pool's memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                (self.base as *mut u8).add(offset),
                bytes.len(),
            );
        }
        Ok(())
    }

    fn settle(&self) -> Result<(), ModelError> {
        Ok(())
    }
}

impl HostStaged {
    /// A zeroed compute pool of `layout`.
    ///
    /// # Errors
    /// [`ModelError::InvalidBatch`] naming the size when it cannot be allocated.
    pub fn new(layout: KvLayout) -> Result<Self, ModelError> {
        let pool = KvPool::new(layout)
            .map_err(|e| ModelError::InvalidBatch(format!("compute pool: {e}")))?;
        Ok(Self {
            alive: Arc::new(RwLock::new(true)),
            pool,
        })
    }

    /// The compute pool (for tests).
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }
}

impl PagedKv for HostStaged {
    fn layout(&self) -> &KvLayout {
        self.pool.layout()
    }

    fn attention(
        &mut self,
        layer: usize,
        qkv: LayerQkv<'_>,
        batch: &BatchInput,
    ) -> Result<Tensor, ModelError> {
        self.pool.attention(layer, qkv, batch)
    }
}

impl StagedKv for HostStaged {
    fn upload(&mut self, from: &KvPool, blocks: &[BlockId]) -> Result<(), ModelError> {
        same_layout(self.pool.layout(), from.layout())?;
        blocks_inside(from.layout(), blocks)?;
        for &b in blocks {
            self.pool
                .block_bytes_mut(b)
                .copy_from_slice(from.block_bytes(b));
        }
        Ok(())
    }

    fn download(&mut self, to: &mut KvPool, blocks: &[BlockId]) -> Result<(), ModelError> {
        same_layout(self.pool.layout(), to.layout())?;
        blocks_inside(to.layout(), blocks)?;
        for &b in blocks {
            to.block_bytes_mut(b)
                .copy_from_slice(self.pool.block_bytes(b));
        }
        Ok(())
    }

    fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<(), ModelError> {
        blocks_inside(self.pool.layout(), &[src, dst])?;
        self.pool.copy_block(src, dst);
        Ok(())
    }

    fn path(&self) -> &'static str {
        "host-staged"
    }

    fn uploader(&mut self, transfer: &KvPool) -> Result<Option<Arc<dyn BlockUpload>>, ModelError> {
        same_layout(self.pool.layout(), transfer.layout())?;
        let l = self.pool.layout();
        Ok(Some(Arc::new(HostUpload {
            alive: self.alive.clone(),
            base: self.pool.base_ptr() as usize,
            block_bytes: l.block_bytes(),
            num_blocks: l.num_blocks,
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_kv_pool::{KvDtype, KvOrder};

    fn layout() -> KvLayout {
        KvLayout {
            num_blocks: 4,
            block_size: 2,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 2,
            dtype: KvDtype::F32,
            order: KvOrder::Hnd,
        }
    }

    /// Blocks go up and down whole and only the named ones move.
    #[test]
    fn upload_and_download_move_only_the_named_blocks() {
        let l = layout();
        let mut transfer = KvPool::new(l).unwrap();
        let mut staged = HostStaged::new(l).unwrap();
        for b in 0..4 {
            transfer
                .block_mut::<f32>(BlockId(b as u32))
                .fill(b as f32 + 1.0);
        }
        staged.upload(&transfer, &[BlockId(1), BlockId(3)]).unwrap();
        let got: Vec<f32> = (0..4)
            .map(|b| staged.pool().block::<f32>(BlockId(b as u32))[0])
            .collect();
        assert_eq!(got, [0.0, 2.0, 0.0, 4.0]);
        staged.copy_block(BlockId(3), BlockId(0)).unwrap();
        staged.download(&mut transfer, &[BlockId(0)]).unwrap();
        assert_eq!(transfer.block::<f32>(BlockId(0)), &[4.0; 8]);
        assert_eq!(transfer.block::<f32>(BlockId(2)), &[3.0; 8]);
        assert!(staged.upload(&transfer, &[BlockId(4)]).is_err());
        let other = KvPool::new(KvLayout { num_blocks: 5, ..l }).unwrap();
        assert!(staged.upload(&other, &[BlockId(0)]).is_err());
    }

    /// The uploader writes a run of blocks, byte for byte, from another thread, refuses what is
    /// not whole blocks inside the pool, and stops once the pool is dropped.
    #[test]
    fn the_uploader_writes_one_block_from_another_thread_until_the_pool_is_gone() {
        let l = layout();
        let mut transfer = KvPool::new(l).unwrap();
        let mut staged = HostStaged::new(l).unwrap();
        let up = staged.uploader(&transfer).unwrap().unwrap();
        for b in 0..4 {
            transfer
                .block_mut::<f32>(BlockId(b as u32))
                .fill(b as f32 + 1.0);
        }
        let (two, three) = (
            transfer.block_bytes(BlockId(2)).to_vec(),
            transfer.block_bytes(BlockId(3)).to_vec(),
        );
        let u = up.clone();
        std::thread::spawn(move || {
            u.begin().unwrap();
            // SAFETY: nothing else touches blocks 2 and 3 of the compute pool here.
            unsafe { u.upload(BlockId(2), &[two, three].concat()).unwrap() };
            u.settle().unwrap();
        })
        .join()
        .unwrap();
        let got: Vec<f32> = (0..4)
            .map(|b| staged.pool().block::<f32>(BlockId(b as u32))[7])
            .collect();
        assert_eq!(got, [0.0, 0.0, 3.0, 4.0]);
        let one = transfer.block_bytes(BlockId(1)).to_vec();
        // SAFETY: as above; these fail before writing.
        unsafe {
            assert!(up.upload(BlockId(4), &one).is_err());
            assert!(
                up.upload(BlockId(3), &[&one[..], &one[..]].concat())
                    .is_err()
            );
            assert!(up.upload(BlockId(1), &one[..4]).is_err());
            assert!(up.upload(BlockId(1), &[]).is_err());
        }
        drop(staged);
        // SAFETY: the pool is gone: the upload refuses without writing.
        let gone = unsafe { up.upload(BlockId(1), &one) };
        assert!(gone.unwrap_err().to_string().contains("gone"));
        assert!(
            HostStaged::new(l)
                .unwrap()
                .uploader(&KvPool::new(KvLayout { num_blocks: 5, ..l }).unwrap())
                .is_err()
        );
    }
}
