//! Turning "remote blocks r₀, r₁, … into local blocks l₀, l₁, …" into few byte ranges.
//!
//! A block is one contiguous `block_bytes` range of the pool (see `pd_kv_pool::KvLayout`), so a
//! run where both the remote and the local ids are consecutive is one contiguous read.

use pd_kv_pool::BlockId;

/// One contiguous read: `len` bytes from `remote_offset` of the peer's pool into `local_offset`
/// of ours (offsets from each pool's base).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRange {
    /// Offset in the peer's pool.
    pub remote_offset: usize,
    /// Offset in our pool.
    pub local_offset: usize,
    /// Bytes.
    pub len: usize,
}

/// Pairs `remote[i]` with `local[i]` and coalesces runs that are consecutive on both sides.
/// Extra ids on the longer side are ignored (the caller checks lengths).
pub fn plan_ranges(remote: &[BlockId], local: &[BlockId], block_bytes: usize) -> Vec<CopyRange> {
    let mut out: Vec<CopyRange> = Vec::new();
    for (&r, &l) in remote.iter().zip(local) {
        let (ro, lo) = (r.index() * block_bytes, l.index() * block_bytes);
        if let Some(last) = out.last_mut()
            && last.remote_offset + last.len == ro
            && last.local_offset + last.len == lo
        {
            last.len += block_bytes;
            continue;
        }
        out.push(CopyRange {
            remote_offset: ro,
            local_offset: lo,
            len: block_bytes,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&i| BlockId(i)).collect()
    }

    #[test]
    fn runs_consecutive_on_both_sides_coalesce() {
        let r = plan_ranges(&ids(&[4, 5, 6, 9, 10]), &ids(&[0, 1, 2, 3, 7]), 100);
        assert_eq!(
            r,
            vec![
                CopyRange {
                    remote_offset: 400,
                    local_offset: 0,
                    len: 300
                },
                CopyRange {
                    remote_offset: 900,
                    local_offset: 300,
                    len: 100
                },
                CopyRange {
                    remote_offset: 1000,
                    local_offset: 700,
                    len: 100
                },
            ]
        );
    }

    #[test]
    fn reversed_order_never_coalesces() {
        let r = plan_ranges(&ids(&[3, 2, 1]), &ids(&[3, 2, 1]), 10);
        assert_eq!(r.len(), 3);
        assert_eq!(r.iter().map(|c| c.len).sum::<usize>(), 30);
    }
}
