//! Copying a sequence's K/V between pools whose block size or slab order differ (a peer with
//! other blocks: `block_size` 16 ↔ 32, [`KvOrder::Hnd`] ↔ [`KvOrder::Nhd`]).
//!
//! Both sides are addressed by token position: token `t` of the sequence sits at position
//! `t % block_size` of the `t / block_size`-th block of its side's block list. The copy walks the
//! tokens in runs that stay inside one block on both sides and moves, per (layer, K/V), either
//! whole runs (same order on both sides: a head's rows, or a position's heads, are contiguous
//! over the run) or one `head_dim` row at a time (orders differ). Element types must match:
//! this moves bytes, it does not convert numbers.

use std::ops::Range;

use crate::layout::{KvLayout, KvOrder};

/// Why two pools' blocks cannot be rechunked into each other, or the blocks given do not cover
/// the tokens.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RechunkError {
    /// The layouts differ in more than block size and order.
    #[error("layouts differ in {0}: only block size and order can be converted")]
    Incompatible(&'static str),
    /// A side's block list does not cover the tokens, or a block has the wrong length.
    #[error("the {side} blocks do not cover tokens {start}..{end}")]
    Uncovered {
        /// `source` or `destination`.
        side: &'static str,
        /// First token.
        start: usize,
        /// End of the tokens.
        end: usize,
    },
}

/// The blocks of one side that hold `tokens`: the first of `blocks` holds the tokens from
/// `(tokens.start / block_size) · block_size` on.
fn covers(
    layout: &KvLayout,
    blocks: usize,
    lens: impl Iterator<Item = usize>,
    tokens: &Range<usize>,
    side: &'static str,
) -> Result<(), RechunkError> {
    let uncovered = RechunkError::Uncovered {
        side,
        start: tokens.start,
        end: tokens.end,
    };
    let bs = layout.block_size;
    if bs == 0 {
        return Err(uncovered);
    }
    let needed = if tokens.is_empty() {
        0
    } else {
        tokens.end.div_ceil(bs) - tokens.start / bs
    };
    if blocks < needed {
        return Err(uncovered);
    }
    let mut lens = lens;
    if lens.any(|n| n != layout.block_bytes()) {
        return Err(uncovered);
    }
    Ok(())
}

/// What [`rechunk`] checks before copying, for block lists of `src_blocks` and `dst_blocks`
/// whole blocks: the layouts differ only in block size and order, and each list covers
/// `tokens`. Lets a caller refuse a conversion before it reads anything.
///
/// # Errors
/// [`RechunkError`].
pub fn check_rechunk(
    from: &KvLayout,
    src_blocks: usize,
    to: &KvLayout,
    dst_blocks: usize,
    tokens: &Range<usize>,
) -> Result<(), RechunkError> {
    compatible(from, to)?;
    covers(from, src_blocks, std::iter::empty(), tokens, "source")?;
    covers(to, dst_blocks, std::iter::empty(), tokens, "destination")
}

/// The layouts differ in nothing but block size and order.
fn compatible(from: &KvLayout, to: &KvLayout) -> Result<(), RechunkError> {
    for (what, a, b) in [
        ("num_layers", from.num_layers, to.num_layers),
        ("num_kv_heads", from.num_kv_heads, to.num_kv_heads),
        ("head_dim", from.head_dim, to.head_dim),
    ] {
        if a != b {
            return Err(RechunkError::Incompatible(what));
        }
    }
    if from.dtype != to.dtype {
        return Err(RechunkError::Incompatible("dtype"));
    }
    Ok(())
}

/// Copies the K/V of `tokens` from `src` (blocks laid out as `from`) into `dst` (blocks laid out
/// as `to`). `src[0]` is the block of `from` holding token `tokens.start` (so it starts at
/// token `(tokens.start / from.block_size) · from.block_size`), and so on; the same for `dst`
/// with `to`. Each slice is one whole block (`block_bytes`). Positions of `dst`'s blocks outside
/// `tokens` are not touched.
///
/// # Errors
/// [`RechunkError`]; nothing is copied then.
pub fn rechunk(
    from: &KvLayout,
    src: &[&[u8]],
    to: &KvLayout,
    dst: &mut [&mut [u8]],
    tokens: Range<usize>,
) -> Result<(), RechunkError> {
    compatible(from, to)?;
    covers(
        from,
        src.len(),
        src.iter().map(|b| b.len()),
        &tokens,
        "source",
    )?;
    covers(
        to,
        dst.len(),
        dst.iter().map(|b| b.len()),
        &tokens,
        "destination",
    )?;
    let size = from.dtype.size();
    let (fbs, tbs) = (from.block_size, to.block_size);
    let (heads, hd) = (from.num_kv_heads, from.head_dim);
    // Whole runs move in one copy when both sides keep the run's rows in the same order.
    let same_order = from.order == to.order;
    let (first_src, first_dst) = (tokens.start / fbs, tokens.start / tbs);
    let mut t = tokens.start;
    while t < tokens.end {
        let (sb, sp) = (t / fbs - first_src, t % fbs);
        let (db, dp) = (t / tbs - first_dst, t % tbs);
        // Tokens until either side's block ends.
        let run = (fbs - sp).min(tbs - dp).min(tokens.end - t);
        let (s, d) = (src[sb], &mut *dst[db]);
        for layer in 0..from.num_layers {
            for kv in 0..2 {
                // Byte offsets of the (layer, K/V) slab in each block.
                let s_slab = from.slab_offset(0, layer, kv) * size;
                let d_slab = to.slab_offset(0, layer, kv) * size;
                let row = |l: &KvLayout, base: usize, h: usize, p: usize| base + l.row(h, p) * size;
                match (same_order, from.order) {
                    (true, KvOrder::Hnd) => {
                        // Per head, the run's rows are contiguous on both sides.
                        let n = run * hd * size;
                        for h in 0..heads {
                            let (so, dof) = (row(from, s_slab, h, sp), row(to, d_slab, h, dp));
                            d[dof..dof + n].copy_from_slice(&s[so..so + n]);
                        }
                    }
                    (true, KvOrder::Nhd) => {
                        // The run's positions, every head, are contiguous on both sides.
                        let n = run * heads * hd * size;
                        let (so, dof) = (row(from, s_slab, 0, sp), row(to, d_slab, 0, dp));
                        d[dof..dof + n].copy_from_slice(&s[so..so + n]);
                    }
                    (false, _) => {
                        let n = hd * size;
                        for h in 0..heads {
                            for i in 0..run {
                                let so = row(from, s_slab, h, sp + i);
                                let dof = row(to, d_slab, h, dp + i);
                                d[dof..dof + n].copy_from_slice(&s[so..so + n]);
                            }
                        }
                    }
                }
            }
        }
        t += run;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvDtype;

    fn layout(block_size: usize, order: KvOrder, dtype: KvDtype) -> KvLayout {
        KvLayout {
            num_blocks: 0,
            block_size,
            num_layers: 2,
            num_kv_heads: 3,
            head_dim: 4,
            dtype,
            order,
        }
    }

    /// The element of (token, layer, kv, head, dim), as a value no two elements share.
    fn value(t: usize, layer: usize, kv: usize, h: usize, i: usize) -> u16 {
        ((((t * 2 + layer) * 2 + kv) * 3 + h) * 4 + i) as u16
    }

    /// Blocks of `l` holding tokens from `(first / bs) · bs` to `end`, every element written
    /// through the layout's own addressing ([`KvLayout::row`]).
    fn blocks(l: &KvLayout, first: usize, end: usize) -> Vec<Vec<u8>> {
        let bs = l.block_size;
        let n = end.div_ceil(bs) - first / bs;
        let mut out = vec![vec![0xEEu8; l.block_bytes()]; n];
        for t in (first / bs) * bs..end {
            let b = &mut out[t / bs - first / bs];
            for layer in 0..2 {
                for kv in 0..2 {
                    for h in 0..3 {
                        for i in 0..4 {
                            let e = l.slab_offset(0, layer, kv) + l.row(h, t % bs) + i;
                            let v = value(t, layer, kv, h, i).to_le_bytes();
                            b[e * 2..e * 2 + 2].copy_from_slice(&v);
                        }
                    }
                }
            }
        }
        out
    }

    /// Reads (token, layer, kv, head, dim) back through the layout's addressing.
    fn read(l: &KvLayout, blocks: &[Vec<u8>], first: usize, t: usize, at: [usize; 4]) -> u16 {
        let bs = l.block_size;
        let b = &blocks[t / bs - first / bs];
        let e = l.slab_offset(0, at[0], at[1]) + l.row(at[2], t % bs) + at[3];
        u16::from_le_bytes([b[e * 2], b[e * 2 + 1]])
    }

    #[test]
    fn every_token_lands_where_the_other_layout_addresses_it() {
        let orders = [KvOrder::Hnd, KvOrder::Nhd];
        for (fbs, tbs) in [(16, 32), (32, 16), (16, 16), (4, 6)] {
            for fo in orders {
                for to_ in orders {
                    // A range starting mid-block on the source side, ending mid-block.
                    for tokens in [0..45, 32..70, 5..6] {
                        let from = layout(fbs, fo, KvDtype::F16);
                        let to = layout(tbs, to_, KvDtype::F16);
                        let src = blocks(&from, tokens.start, tokens.end);
                        let dst_start = (tokens.start / tbs) * tbs;
                        let n = tokens.end.div_ceil(tbs) - tokens.start / tbs;
                        let mut dst = vec![vec![0xEEu8; to.block_bytes()]; n];
                        let s: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
                        let mut d: Vec<&mut [u8]> = dst.iter_mut().map(Vec::as_mut_slice).collect();
                        rechunk(&from, &s, &to, &mut d, tokens.clone()).unwrap();
                        for t in dst_start..n * tbs + dst_start {
                            for at in coords() {
                                let got = read(&to, &dst, tokens.start, t, at);
                                let want = if tokens.contains(&t) {
                                    value(t, at[0], at[1], at[2], at[3])
                                } else {
                                    0xEEEE // untouched
                                };
                                assert_eq!(got, want, "{fbs}->{tbs} {fo:?}->{to_:?} t={t} {at:?}");
                            }
                        }
                    }
                }
            }
        }
    }

    fn coords() -> impl Iterator<Item = [usize; 4]> {
        (0..2).flat_map(|l| {
            (0..2).flat_map(move |kv| (0..3).flat_map(move |h| (0..4).map(move |i| [l, kv, h, i])))
        })
    }

    #[test]
    fn other_shapes_and_short_lists_are_refused_before_copying() {
        let a = layout(16, KvOrder::Hnd, KvDtype::F16);
        let src = blocks(&a, 0, 32);
        let s: Vec<&[u8]> = src.iter().map(Vec::as_slice).collect();
        let other_heads = KvLayout {
            num_kv_heads: 2,
            ..layout(32, KvOrder::Nhd, KvDtype::F16)
        };
        let mut dst = vec![vec![0u8; other_heads.block_bytes()]; 1];
        let mut d: Vec<&mut [u8]> = dst.iter_mut().map(Vec::as_mut_slice).collect();
        assert_eq!(
            rechunk(&a, &s, &other_heads, &mut d, 0..32),
            Err(RechunkError::Incompatible("num_kv_heads"))
        );
        let f32_ = layout(32, KvOrder::Hnd, KvDtype::F32);
        let mut dst = vec![vec![0u8; f32_.block_bytes()]; 1];
        let mut d: Vec<&mut [u8]> = dst.iter_mut().map(Vec::as_mut_slice).collect();
        assert_eq!(
            rechunk(&a, &s, &f32_, &mut d, 0..32),
            Err(RechunkError::Incompatible("dtype"))
        );
        // 33 tokens need two destination blocks of 32 and three source blocks of 16.
        let b = layout(32, KvOrder::Nhd, KvDtype::F16);
        let mut dst = vec![vec![7u8; b.block_bytes()]; 1];
        let mut d: Vec<&mut [u8]> = dst.iter_mut().map(Vec::as_mut_slice).collect();
        assert!(matches!(
            rechunk(&a, &s, &b, &mut d, 0..33),
            Err(RechunkError::Uncovered { .. })
        ));
        assert!(dst[0].iter().all(|&x| x == 7), "nothing copied");
        // A block size of 0 is refused, not divided by.
        let zero = KvLayout {
            block_size: 0,
            ..layout(16, KvOrder::Hnd, KvDtype::F16)
        };
        assert!(matches!(
            check_rechunk(&zero, 1, &b, 1, &(0..4)),
            Err(RechunkError::Uncovered { .. })
        ));
        assert_eq!(check_rechunk(&a, 3, &b, 2, &(0..33)), Ok(()));
    }
}
