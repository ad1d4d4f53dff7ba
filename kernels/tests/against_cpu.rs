//! Each kernel's CPU reference against the CPU code the node runs, on seeded random inputs:
//! `reshape_and_cache` and `paged_attention` against `pd_model::paged_attention::{write_kv,
//! attend}`, `block_copy` against `pd_kv_pool::KvPool::block`, `rechunk` against
//! `pd_kv_pool::rechunk` — in every element type and both block orders.

use pd_kernels::{block_copy, paged_attention, rechunk, reshape_and_cache};
use pd_kv_pool::{BlockId, KvDtype, KvElem, KvLayout, KvOrder, KvPool};
use pd_model::SeqView;
use pd_model::paged_attention::{attend, write_kv};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn layout(dtype: KvDtype, order: KvOrder) -> KvLayout {
    KvLayout {
        num_blocks: 12,
        block_size: 4,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 8,
        dtype,
        order,
    }
}

fn cases() -> impl Iterator<Item = KvLayout> {
    [KvDtype::F32, KvDtype::F16, KvDtype::BF16]
        .into_iter()
        .flat_map(|d| [layout(d, KvOrder::Hnd), layout(d, KvOrder::Nhd)])
}

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// The whole pool's elements, block after block.
fn elements<T: KvElem>(pool: &KvPool) -> Vec<T> {
    (0..pool.layout().num_blocks)
        .flat_map(|b| pool.block::<T>(BlockId(b as u32)).to_vec())
        .collect()
}

/// Runs `f::<T>(l)` with `l`'s element type as `T`.
macro_rules! typed {
    ($f:ident, $l:expr) => {
        match $l.dtype {
            KvDtype::F32 => $f::<f32>($l),
            KvDtype::F16 => $f::<half::f16>($l),
            KvDtype::BF16 => $f::<half::bf16>($l),
        }
    };
}

#[test]
fn reshape_and_cache_writes_what_write_kv_writes() {
    fn check<T: KvElem + PartialEq + std::fmt::Debug>(l: KvLayout) {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let n = l.num_kv_heads * l.head_dim;
        let slots: Vec<usize> = vec![45, 3, 0, 17, 18, 31, 8];
        let (k, v) = (
            random(&mut rng, slots.len() * n),
            random(&mut rng, slots.len() * n),
        );
        let mut pool = KvPool::new(l).unwrap();
        let mut ours = elements::<T>(&pool);
        write_kv(&mut pool, 1, &k, &v, &slots);
        let signed: Vec<i64> = slots.iter().map(|&s| s as i64).collect();
        reshape_and_cache::reference(&k, &v, &signed, &mut ours, 1, &l);
        assert_eq!(ours, elements::<T>(&pool), "{l:?}");
        // A negative slot (padding) writes nothing.
        let before = ours.clone();
        reshape_and_cache::reference(&k[..n], &v[..n], &[-1], &mut ours, 0, &l);
        assert_eq!(ours, before);
    }
    for l in cases() {
        typed!(check, l);
    }
}

#[test]
fn paged_attention_equals_attend_for_decode_and_a_prefill_chunk() {
    fn check<T: KvElem>(l: KvLayout) {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (heads, hd, bs) = (4, l.head_dim, l.block_size);
        let n = l.num_kv_heads * hd;
        // Sequence 0: 10 positions in blocks 7, 2, 9; decodes position 9.
        // Sequence 1: 13 positions in blocks 0, 11, 4, 5; a prefill chunk of positions 10..13
        // over its cached prefix.
        let tables = [vec![7u32, 2, 9], vec![0u32, 11, 4, 5]];
        let lens = [10usize, 13];
        let mut pool = KvPool::new(l).unwrap();
        for (table, &len) in tables.iter().zip(&lens) {
            let slots: Vec<usize> = (0..len)
                .map(|p| table[p / bs] as usize * bs + p % bs)
                .collect();
            let (k, v) = (random(&mut rng, len * n), random(&mut rng, len * n));
            write_kv(&mut pool, 0, &k, &v, &slots);
        }
        let rows = [(0usize, 9usize), (1, 10), (1, 11), (1, 12)];
        let q = random(&mut rng, rows.len() * heads * hd);
        let seqs = [
            SeqView {
                query_start: 0,
                query_len: 1,
                context_len: 10,
                block_table: tables[0].iter().map(|&b| BlockId(b)).collect(),
            },
            SeqView {
                query_start: 1,
                query_len: 3,
                context_len: 13,
                block_table: tables[1].iter().map(|&b| BlockId(b)).collect(),
            },
        ];
        let want = attend(&pool, 0, &q, heads, &seqs, 0.3);
        let max_blocks = 4;
        let mut block_tables = vec![-1i32; 2 * max_blocks];
        for (s, t) in tables.iter().enumerate() {
            for (i, &b) in t.iter().enumerate() {
                block_tables[s * max_blocks + i] = b as i32;
            }
        }
        let token_seq: Vec<i32> = rows.iter().map(|r| r.0 as i32).collect();
        let token_pos: Vec<i32> = rows.iter().map(|r| r.1 as i32).collect();
        let mut got = vec![0f32; q.len()];
        paged_attention::reference(
            &mut got,
            &q,
            &elements::<T>(&pool),
            &block_tables,
            max_blocks,
            &token_seq,
            &token_pos,
            heads,
            0,
            0.3,
            &l,
        );
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() < 1e-5, "{l:?} [{i}]: {a} vs {b}");
        }
    }
    for l in cases() {
        typed!(check, l);
    }
}

#[test]
fn gather_and_scatter_move_whole_blocks() {
    let l = layout(KvDtype::F16, KvOrder::Nhd);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let words = l.block_bytes() / 4;
    let pool: Vec<u32> = (0..l.num_blocks * words).map(|_| rng.random()).collect();
    let ids = [9, 2, 3, 11];
    let mut staging = vec![0u32; ids.len() * words];
    block_copy::gather_reference(&mut staging, &pool, &ids, words);
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(
            staging[i * words..][..words],
            pool[id as usize * words..][..words]
        );
    }
    // Scattered into other blocks of a zeroed pool: those blocks equal their sources, the rest
    // is untouched.
    let mut other = vec![0u32; pool.len()];
    let to = [0, 5, 6, 1];
    block_copy::scatter_reference(&mut other, &staging, &to, words);
    for b in 0..l.num_blocks {
        let got = &other[b * words..][..words];
        match to.iter().position(|&t| t as usize == b) {
            Some(i) => assert_eq!(got, &pool[ids[i] as usize * words..][..words]),
            None => assert!(got.iter().all(|&w| w == 0)),
        }
    }
}

#[test]
fn rechunk_reference_equals_the_pools_rechunk() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let bytes = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    for (fbs, tbs) in [(16, 32), (32, 16), (16, 16), (4, 6)] {
        for fo in [KvOrder::Hnd, KvOrder::Nhd] {
            for to_order in [KvOrder::Hnd, KvOrder::Nhd] {
                for tokens in [0usize..45, 21..70] {
                    let from = KvLayout {
                        block_size: fbs,
                        order: fo,
                        ..layout(KvDtype::F16, KvOrder::Hnd)
                    };
                    let to = KvLayout {
                        block_size: tbs,
                        order: to_order,
                        ..from
                    };
                    let blocks = |l: &KvLayout| {
                        tokens.end.div_ceil(l.block_size) - tokens.start / l.block_size
                    };
                    let (ns, nd) = (blocks(&from), blocks(&to));
                    // Source blocks at odd ids of a pool of 2·ns; destinations at even ids of
                    // one of 2·nd, in reverse order.
                    let src_ids: Vec<usize> = (0..ns).map(|i| 2 * i + 1).collect();
                    let dst_ids: Vec<usize> = (0..nd).rev().map(|i| 2 * i).collect();
                    let (se, de) = (from.block_elems(), to.block_elems());
                    let src: Vec<u16> = (0..2 * ns * se).map(|_| rng.random()).collect();
                    let mut got = vec![0xEEEEu16; 2 * nd * de];
                    let ids = |v: &[usize]| v.iter().map(|&i| i as i32).collect::<Vec<_>>();
                    rechunk::reference(
                        &mut got,
                        &src,
                        &ids(&src_ids),
                        &ids(&dst_ids),
                        tokens.start,
                        tokens.len(),
                        &from,
                        &to,
                    );
                    // The pool's rechunk over the same blocks, as byte slices in list order.
                    let src_bytes = bytes(&src);
                    let mut want = bytes(&vec![0xEEEEu16; 2 * nd * de]);
                    let s: Vec<&[u8]> = src_ids
                        .iter()
                        .map(|&i| &src_bytes[i * se * 2..][..se * 2])
                        .collect();
                    let mut by_id: Vec<Option<&mut [u8]>> =
                        want.chunks_mut(de * 2).map(Some).collect();
                    let mut d: Vec<&mut [u8]> =
                        dst_ids.iter().map(|&i| by_id[i].take().unwrap()).collect();
                    pd_kv_pool::rechunk(&from, &s, &to, &mut d, tokens.clone()).unwrap();
                    assert_eq!(
                        bytes(&got),
                        want,
                        "{fbs}->{tbs} {fo:?}->{to_order:?} {tokens:?}"
                    );
                }
            }
        }
    }
}
