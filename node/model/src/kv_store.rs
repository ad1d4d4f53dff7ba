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
//!   reads them;
//! - copy-on-write copies run on the compute pool.
//!
//! [`HostStaged`] is that path on the CPU: a second host pool and block copies, so the engine's
//! staging (`pd-node --kv-staged`) is tested token for token between real processes without a
//! GPU. The GPU's pool is `device_pool::DevicePool` (`cuda` feature).

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
    pool: KvPool,
}

impl HostStaged {
    /// A zeroed compute pool of `layout`.
    ///
    /// # Errors
    /// [`ModelError::InvalidBatch`] naming the size when it cannot be allocated.
    pub fn new(layout: KvLayout) -> Result<Self, ModelError> {
        let pool = KvPool::new(layout)
            .map_err(|e| ModelError::InvalidBatch(format!("compute pool: {e}")))?;
        Ok(Self { pool })
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
}
