//! The paged KV block pool of one node: a single fixed allocation cut into equal blocks, the
//! allocator that hands blocks to sequences (reference-counted, so forks share copy-on-write), the
//! prefix cache that lets full blocks be reused across requests, and the chained block hash the
//! gateway computes too.
//!
//! Brief overview:
//! - [`KvLayout`] says how one block is laid out in memory. Peers read it to address blocks remotely.
//! - [`rechunk`] copies a sequence's K/V between pools whose block size or [`KvOrder`] differ.
//! - [`KvPool`] owns the memory: allocated once, never resized or moved, so it can be registered
//!   with a NIC (UCX) and read by peers.
//! - [`BlockAllocator`] owns the bookkeeping: free list in LRU order, reference counts, the
//!   hash → block map of the prefix cache.
//! - [`block_hash`] / [`hash_full_blocks`] chain a block's tokens onto its parent's hash.
//! - [`prompt_binding`] binds leased KV to its prompt under the cluster's [`BindingKey`].
//! - [`LeaseTable`] keeps blocks handed to a peer alive until released or expired; its
//!   [`LeaseBoard`] publishes each live lease's record where peers read it one-sidedly.
//!
//! This crate does not run models, know about requests or sequences, do I/O, or read the clock.
//! It depends on neither candle nor tokio, so the gateway can use the hash functions cheaply.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

mod allocator;
mod binding;
mod board;
mod hash;
mod layout;
mod lease;
mod pool;
mod rechunk;

pub use allocator::{AllocatorError, BlockAllocator, BlockId, CacheEvent};
pub use binding::{BindingKey, bindings_equal, prompt_binding};
pub use board::{
    BOARD_HEADER_BYTES, BOARD_SLOT_BYTES, BOARD_SLOT_WORDS, BeatClock, BoardRecord, LeaseBoard,
    board_bytes, read_beat, read_record,
};
pub use hash::{
    BlockHash, ROOT_HASH_SEED, block_hash, hash_full_blocks, hash_full_blocks_from, hash_key,
    root_hash,
};
pub use layout::{KvDtype, KvLayout, KvOrder};
pub use lease::{
    Lease, LeaseContents, LeaseCounts, LeaseError, LeaseId, LeaseTable, blocks_hash,
    deadline_on_wall_clock, lease_covers,
};
pub use pool::{KvElem, KvPool, POOL_ALIGN};
pub use rechunk::{RechunkError, check_rechunk, rechunk};
