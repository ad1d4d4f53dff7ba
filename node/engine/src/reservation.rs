//! A consumer request's KV reservation: the blocks the engine set aside for the prompt's KV
//! that another node computed, handed to whoever pulls it ([`crate::RequestEvent::AwaitingKv`])
//! and given back, by value, with what arrived ([`crate::EngineHandle::remote_kv_ready`],
//! [`crate::EngineHandle::remote_kv_landed`]).
//!
//! The reservation is the one way to the blocks: its [`KvReservation::blocks`] are the pull's
//! to write until it is given back, and on a staged node its [`KvReservation::upload`] is the
//! compute pool's uploader, valid for exactly those blocks. The engine touches neither pool's
//! copy of them meanwhile. A reservation dropped without being given back leaves the request
//! waiting until its stream is dropped (which aborts it and frees the blocks).

use std::sync::Arc;

use pd_kv_pool::BlockId;

use crate::RequestId;

/// Blocks reserved for a consumer request's prompt KV (see the module's doc).
pub struct KvReservation {
    pub(crate) id: RequestId,
    blocks: Vec<BlockId>,
    first_block: usize,
    cached_tokens: usize,
    upload: Option<Arc<dyn pd_model::BlockUpload>>,
}

impl KvReservation {
    pub(crate) fn new(
        id: RequestId,
        blocks: Vec<BlockId>,
        (first_block, cached_tokens): (usize, usize),
        upload: Option<Arc<dyn pd_model::BlockUpload>>,
    ) -> Self {
        KvReservation {
            id,
            blocks,
            first_block,
            cached_tokens,
            upload,
        }
    }

    /// The request the blocks are for.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Local blocks to write, one per prompt block from [`KvReservation::first_block`] on.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// The index in the prompt's blocks of `blocks()[0]`: the blocks before it were found in
    /// the local prefix cache.
    pub fn first_block(&self) -> usize {
        self.first_block
    }

    /// Prompt tokens already held locally (the prefix-cache hits).
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    /// Where the model computes on a staged pool (`EngineInfo::kv_path` not `in-place`): the
    /// uploader a pull puts these blocks into the compute pool with as they land, from its own
    /// thread, instead of the engine copying them afterwards; then give the reservation back
    /// with [`crate::EngineHandle::remote_kv_landed`]. `None` on a node that computes in place.
    pub fn upload(&self) -> Option<&Arc<dyn pd_model::BlockUpload>> {
        self.upload.as_ref()
    }
}

impl std::fmt::Debug for KvReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvReservation")
            .field("id", &self.id)
            .field("blocks", &self.blocks)
            .field("first_block", &self.first_block)
            .field("cached_tokens", &self.cached_tokens)
            .field("staged", &self.upload.is_some())
            .finish()
    }
}

/// Two reservations are equal when they reserve the same blocks for the same request (events
/// compare in tests).
impl PartialEq for KvReservation {
    fn eq(&self, other: &Self) -> bool {
        (self.id, &self.blocks, self.first_block, self.cached_tokens)
            == (
                other.id,
                &other.blocks,
                other.first_block,
                other.cached_tokens,
            )
    }
}
