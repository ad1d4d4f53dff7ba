//! CPU reference of `cuda/block_copy.cu`.

/// `staging[i] = pool[ids[i]]`, blocks of `block_words` 32-bit words.
pub fn gather_reference(staging: &mut [u32], pool: &[u32], ids: &[i32], block_words: usize) {
    for (i, &id) in ids.iter().enumerate() {
        let src = &pool[id as usize * block_words..][..block_words];
        staging[i * block_words..][..block_words].copy_from_slice(src);
    }
}

/// `pool[ids[i]] = staging[i]`, blocks of `block_words` 32-bit words.
pub fn scatter_reference(pool: &mut [u32], staging: &[u32], ids: &[i32], block_words: usize) {
    for (i, &id) in ids.iter().enumerate() {
        let src = &staging[i * block_words..][..block_words];
        pool[id as usize * block_words..][..block_words].copy_from_slice(src);
    }
}
