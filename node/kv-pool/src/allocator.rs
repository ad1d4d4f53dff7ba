//! Block bookkeeping: reference counts, the free list in LRU order, and the prefix cache.
//!
//! Invariants:
//! - A block with `ref_count > 0` is never on the free list and is never handed out again.
//! - A block on the free list may still carry a hash (it is *cached*): a later request with the
//!   same prefix can take it back ([`BlockAllocator::share`]) until it is evicted.
//! - Allocation takes the least recently freed block first, evicting its hash.
//! - In debug builds the allocator reports every block that stops being valid through
//!   [`BlockAllocator::take_poison_list`], and the owner of the memory poisons it (NaN), so a
//!   sequence that reads a block it no longer owns produces NaN, not plausible output.

use std::collections::HashMap;

use crate::hash::BlockHash;

/// Index of a block in the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// As a `usize` index.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What can go wrong in the pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocatorError {
    /// Every block is referenced.
    #[error("KV pool exhausted: all {total} blocks are in use")]
    Exhausted {
        /// Blocks in the pool.
        total: usize,
    },
    /// The pool's memory could not be allocated.
    #[error("could not allocate {bytes} bytes for the KV pool")]
    OutOfMemory {
        /// Requested size.
        bytes: usize,
    },
    /// The layout's size overflows (layers × heads × head size × positions × blocks, as a model
    /// file and the flags give them).
    #[error("the KV layout's size overflows: {0:?}")]
    TooLarge(crate::KvLayout),
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Meta {
    ref_count: u32,
    hash: Option<BlockHash>,
    prev: u32,
    next: u32,
    on_free_list: bool,
}

/// A change of the prefix cache, as a gateway doing prefix-aware placement wants to hear it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block with this hash became findable.
    Stored(BlockHash),
    /// The block with this hash was evicted; the prefix is gone from this node.
    Removed(BlockHash),
}

/// Hands out blocks, counts references, and remembers which free blocks still hold a prefix.
#[derive(Debug)]
pub struct BlockAllocator {
    meta: Vec<Meta>,
    /// Oldest free block (evicted first).
    head: u32,
    /// Most recently freed block.
    tail: u32,
    num_free: usize,
    cached: HashMap<BlockHash, BlockId>,
    poison: Vec<BlockId>,
    evictions: u64,
    /// Cache changes not yet taken; only recorded after [`BlockAllocator::record_cache_events`].
    events: Option<Vec<CacheEvent>>,
}

impl BlockAllocator {
    /// All `num_blocks` blocks free, nothing cached.
    pub fn new(num_blocks: usize) -> Self {
        let mut a = Self {
            meta: (0..num_blocks)
                .map(|_| Meta {
                    ref_count: 0,
                    hash: None,
                    prev: NIL,
                    next: NIL,
                    on_free_list: false,
                })
                .collect(),
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashMap::new(),
            poison: Vec::new(),
            evictions: 0,
            events: None,
        };
        for b in 0..num_blocks {
            a.push_free(b as u32);
        }
        a
    }

    /// Blocks in the pool.
    pub fn num_total(&self) -> usize {
        self.meta.len()
    }

    /// Blocks with no reference (cached ones included: they can be evicted at any time).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Cached blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// References held on `block`.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.meta[block.index()].ref_count
    }

    /// The prefix hash `block` is registered under, if any.
    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.meta[block.index()].hash
    }

    /// Takes the least recently freed block (evicting its cached prefix) with one reference.
    ///
    /// # Errors
    /// [`AllocatorError::Exhausted`] when every block is referenced.
    pub fn allocate(&mut self) -> Result<BlockId, AllocatorError> {
        let b = self.head;
        if b == NIL {
            return Err(AllocatorError::Exhausted {
                total: self.meta.len(),
            });
        }
        self.unlink(b);
        let m = &mut self.meta[b as usize];
        if let Some(h) = m.hash.take() {
            if self.cached.get(&h) == Some(&BlockId(b)) {
                self.cached.remove(&h);
                if let Some(ev) = &mut self.events {
                    ev.push(CacheEvent::Removed(h));
                }
            }
            self.evictions += 1;
            if cfg!(debug_assertions) {
                self.poison.push(BlockId(b));
            }
        }
        m.ref_count = 1;
        Ok(BlockId(b))
    }

    /// Takes `n` blocks, or none at all.
    ///
    /// # Errors
    /// [`AllocatorError::Exhausted`] when fewer than `n` are free.
    pub fn allocate_n(&mut self, n: usize) -> Result<Vec<BlockId>, AllocatorError> {
        if n > self.num_free {
            return Err(AllocatorError::Exhausted {
                total: self.meta.len(),
            });
        }
        (0..n).map(|_| self.allocate()).collect()
    }

    /// Adds a reference: a fork sharing a block, or a prefix-cache hit on a block found by
    /// [`BlockAllocator::lookup`]. A block nobody referenced (a cached, free one) leaves the free
    /// list first, so it can never be handed out while this reference lives.
    pub fn share(&mut self, block: BlockId) {
        if self.meta[block.index()].ref_count == 0 {
            self.unlink(block.0);
        }
        self.meta[block.index()].ref_count += 1;
    }

    /// Drops one reference. At zero the block goes to the free list; it stays findable by its
    /// hash (if it has one) until evicted, otherwise it is invalid from now on.
    pub fn free(&mut self, block: BlockId) {
        let m = &mut self.meta[block.index()];
        debug_assert!(m.ref_count > 0, "double free of block {block:?}");
        if m.ref_count == 0 {
            tracing::error!(block = block.0, "double free of KV block ignored");
            return;
        }
        m.ref_count -= 1;
        if m.ref_count == 0 {
            let uncached = m.hash.is_none();
            self.push_free(block.0);
            if uncached && cfg!(debug_assertions) {
                self.poison.push(block);
            }
        }
    }

    /// Records that `block` is full and holds the prefix identified by `hash`. If another block
    /// already holds that prefix, the cache keeps the existing one.
    pub fn register(&mut self, block: BlockId, hash: BlockHash) {
        let m = &mut self.meta[block.index()];
        if m.hash.is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(block);
            m.hash = Some(hash);
            if let Some(ev) = &mut self.events {
                ev.push(CacheEvent::Stored(hash));
            }
        }
    }

    /// Looks up the longest prefix of `hashes` present in the cache, without taking references.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// From now on, record every prefix-cache change for [`BlockAllocator::take_cache_events`]
    /// (whoever turns this on must take them regularly).
    pub fn record_cache_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// Cache changes since the last call, in order.
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Every hash findable in the prefix cache now (a snapshot for a resync).
    pub fn cached_hashes(&self) -> Vec<BlockHash> {
        self.cached.keys().copied().collect()
    }

    /// Blocks that became invalid since the last call (debug builds only; empty in release).
    /// The owner of the memory poisons them.
    pub fn take_poison_list(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.poison)
    }

    fn push_free(&mut self, b: u32) {
        let tail = self.tail;
        let m = &mut self.meta[b as usize];
        m.prev = tail;
        m.next = NIL;
        m.on_free_list = true;
        if tail == NIL {
            self.head = b;
        } else {
            self.meta[tail as usize].next = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: u32) {
        let (prev, next, on) = {
            let m = &self.meta[b as usize];
            (m.prev, m.next, m.on_free_list)
        };
        if !on {
            return;
        }
        if prev == NIL {
            self.head = next;
        } else {
            self.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.meta[next as usize].prev = prev;
        }
        let m = &mut self.meta[b as usize];
        m.prev = NIL;
        m.next = NIL;
        m.on_free_list = false;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::block_hash;

    #[test]
    fn allocate_until_exhausted_then_free() {
        let mut a = BlockAllocator::new(3);
        let b: Vec<_> = (0..3).map(|_| a.allocate().unwrap()).collect();
        assert_eq!(a.num_free(), 0);
        assert_eq!(a.allocate(), Err(AllocatorError::Exhausted { total: 3 }));
        a.free(b[1]);
        assert_eq!(a.allocate().unwrap(), b[1]);
    }

    #[test]
    fn shared_block_is_not_reused_until_last_reference_dropped() {
        let mut a = BlockAllocator::new(2);
        let x = a.allocate().unwrap();
        a.share(x);
        a.free(x);
        assert_eq!(a.ref_count(x), 1);
        let y = a.allocate().unwrap();
        assert_ne!(x, y);
        assert!(
            a.allocate().is_err(),
            "x must not be handed out while referenced"
        );
        a.free(x);
        assert_eq!(a.allocate().unwrap(), x);
    }

    #[test]
    fn sharing_a_free_cached_block_takes_it_off_the_free_list() {
        let mut a = BlockAllocator::new(2);
        let x = a.allocate().unwrap();
        a.register(x, block_hash(None, &[1]));
        a.free(x);
        assert_eq!(a.num_free(), 2);
        a.share(x); // e.g. a lease granted after the sequence finished
        assert_eq!(a.num_free(), 1);
        let y = a.allocate().unwrap();
        assert_ne!(x, y);
        assert!(
            a.allocate().is_err(),
            "x must not be handed out while shared"
        );
    }

    #[test]
    fn cached_block_is_found_then_evicted_lru() {
        let mut a = BlockAllocator::new(2);
        let h1 = block_hash(None, &[1, 2]);
        let h2 = block_hash(None, &[3, 4]);
        let x = a.allocate().unwrap();
        let y = a.allocate().unwrap();
        a.register(x, h1);
        a.register(y, h2);
        a.free(x); // freed first: evicted first
        a.free(y);
        assert_eq!(a.lookup(&[h1]), vec![x]);
        assert_eq!(a.num_free(), 2);
        // Reuse y's prefix: it leaves the free list.
        a.share(y);
        assert_eq!(a.num_free(), 1);
        // The next allocation evicts x (the only free one), not y.
        assert_eq!(a.allocate().unwrap(), x);
        assert_eq!(a.lookup(&[h1]), vec![]);
        assert_eq!(a.lookup(&[h2]), vec![y]);
        assert_eq!(a.evictions(), 1);
    }

    #[test]
    fn cache_events_report_stores_and_evictions_in_order() {
        let mut a = BlockAllocator::new(1);
        a.record_cache_events();
        let x = a.allocate().unwrap();
        a.register(x, BlockHash(7));
        a.register(x, BlockHash(8)); // already registered: no event
        a.free(x);
        assert_eq!(a.cached_hashes(), vec![BlockHash(7)]);
        let _ = a.allocate().unwrap(); // evicts 7
        assert_eq!(
            a.take_cache_events(),
            vec![
                CacheEvent::Stored(BlockHash(7)),
                CacheEvent::Removed(BlockHash(7))
            ]
        );
        assert!(a.take_cache_events().is_empty());
        assert!(a.cached_hashes().is_empty());
    }

    #[test]
    fn lookup_stops_at_first_miss() {
        let mut a = BlockAllocator::new(3);
        let h = [
            block_hash(None, &[1]),
            block_hash(None, &[2]),
            block_hash(None, &[3]),
        ];
        let b0 = a.allocate().unwrap();
        let b2 = a.allocate().unwrap();
        a.register(b0, h[0]);
        a.register(b2, h[2]);
        assert_eq!(a.lookup(&h), vec![b0]);
    }

    #[test]
    fn invalidated_blocks_are_reported_for_poisoning_in_debug() {
        let mut a = BlockAllocator::new(2);
        let x = a.allocate().unwrap();
        a.free(x);
        let p = a.take_poison_list();
        if cfg!(debug_assertions) {
            assert_eq!(p, vec![x]);
        } else {
            assert!(p.is_empty());
        }
    }
}
