//! Every kernel on a GPU against its CPU reference, on fresh random inputs (a new seed each run
//! unless `PD_SEED` is set), in every pool element type and both block orders. Prints one line
//! per check and exits non-zero if any differs beyond its tolerance: exact for the copies and
//! for `reshape_and_cache` (both round to nearest even), 1e-3 (f32 accumulations in another
//! order, `__expf`) for `paged_attention`.
//!
//! ```sh
//! NVCC=$(bash scripts/cuda-toolchain.sh) cargo run --release -p pd-kernels --features cuda --example gpu_check
//! ```

use std::process::ExitCode;

use cudarc::driver::{CudaSlice, ValidAsZeroBits};
use pd_kernels::cuda::{Kernels, PoolElem};
use pd_kernels::{block_copy, paged_attention, rechunk, reshape_and_cache};
use pd_kv_pool::{KvDtype, KvElem, KvLayout, KvOrder};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

type Check = Result<f32, String>;

fn layout(dtype: KvDtype, order: KvOrder, block_size: usize) -> KvLayout {
    // A real-shaped slab (SmolLM2: 3 KV heads of 64) over a few layers and blocks.
    KvLayout {
        num_blocks: 40,
        block_size,
        num_layers: 3,
        num_kv_heads: 3,
        head_dim: 64,
        dtype,
        order,
    }
}

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn widen<T: KvElem>(x: &[T]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    T::load_f32(x, &mut out);
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// reshape_and_cache, then paged_attention over what it wrote (decode rows and a prefill chunk).
fn attention<T: PoolElem + KvElem + ValidAsZeroBits>(
    k: &Kernels,
    l: KvLayout,
    rng: &mut ChaCha8Rng,
) -> [Check; 2] {
    let mut run = || -> Result<[f32; 2], String> {
        let s = k.stream();
        let (heads, n) = (9, l.num_kv_heads * l.head_dim);
        // Two sequences: 70 positions in scattered blocks, 45 positions.
        let max_blocks = 8;
        let mut ids: Vec<usize> = (0..l.num_blocks).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.random_range(0..=i));
        }
        let lens = [70usize, 45];
        let mut tables = vec![-1i32; 2 * max_blocks];
        let mut slots = Vec::new();
        for (seq, &len) in lens.iter().enumerate() {
            let blocks = &ids[seq * max_blocks..][..len.div_ceil(l.block_size)];
            for (i, &b) in blocks.iter().enumerate() {
                tables[seq * max_blocks + i] = b as i32;
            }
            slots.extend(
                (0..len)
                    .map(|p| (blocks[p / l.block_size] * l.block_size + p % l.block_size) as i64),
            );
        }
        let (kk, vv) = (random(rng, slots.len() * n), random(rng, slots.len() * n));
        // Zeroed on the device, copied here: the CPU pool starts equal to the GPU one.
        let mut gpu_pool: CudaSlice<T> =
            s.alloc_zeros(l.num_blocks * l.block_elems()).map_err(err)?;
        let mut cpu_pool: Vec<T> = s.clone_dtoh(&gpu_pool).map_err(err)?;
        reshape_and_cache::reference(&kk, &vv, &slots, &mut cpu_pool, 1, &l);
        let (kd, vd, sd) = (
            s.clone_htod(&kk).map_err(err)?,
            s.clone_htod(&vv).map_err(err)?,
            s.clone_htod(&slots).map_err(err)?,
        );
        // SAFETY: every slot was made from a block of the pool above.
        unsafe { k.reshape_and_cache(&kd.as_view(), &vd.as_view(), &sd, &mut gpu_pool, 1, &l) }
            .map_err(err)?;
        let written = s.clone_dtoh(&gpu_pool).map_err(err)?;
        let cache_diff = max_diff(&widen(&written), &widen(&cpu_pool));
        // Rows: sequence 0 decodes position 69; sequence 1 a prefill chunk of 40..45.
        let rows: Vec<(i32, i32)> = std::iter::once((0, 69))
            .chain((40..45).map(|p| (1, p)))
            .collect();
        let q = random(rng, rows.len() * heads * l.head_dim);
        let (seq, pos): (Vec<i32>, Vec<i32>) = rows.iter().copied().unzip();
        let mut want = vec![0f32; q.len()];
        paged_attention::reference(
            &mut want, &q, &cpu_pool, &tables, max_blocks, &seq, &pos, heads, 1, 0.125, &l,
        );
        let mut out = s.alloc_zeros::<f32>(q.len()).map_err(err)?;
        let (qd, td) = (
            s.clone_htod(&q).map_err(err)?,
            s.clone_htod(&tables).map_err(err)?,
        );
        let (seqd, posd) = (
            s.clone_htod(&seq).map_err(err)?,
            s.clone_htod(&pos).map_err(err)?,
        );
        // SAFETY: sequences 0 and 1 have table rows, positions are at most 69, and the table
        // entries up to them are blocks of the pool.
        unsafe {
            k.paged_attention(
                &mut out,
                &qd.as_view(),
                &gpu_pool,
                &td,
                max_blocks,
                &seqd,
                &posd,
                69,
                heads,
                1,
                0.125,
                &l,
            )
        }
        .map_err(err)?;
        let got = s.clone_dtoh(&out).map_err(err)?;
        Ok([cache_diff, max_diff(&got, &want)])
    };
    match run() {
        Ok([a, b]) => [Ok(a), Ok(b)],
        Err(e) => [Err(e.clone()), Err(e)],
    }
}

fn copies(k: &Kernels, rng: &mut ChaCha8Rng) -> Result<f32, String> {
    let s = k.stream();
    let l = layout(KvDtype::BF16, KvOrder::Nhd, 16);
    let words = l.block_bytes() / 4;
    let pool: Vec<u32> = (0..l.num_blocks * words).map(|_| rng.random()).collect();
    let ids: Vec<i32> = vec![17, 3, 4, 39, 0];
    let mut want = vec![0u32; ids.len() * words];
    block_copy::gather_reference(&mut want, &pool, &ids, words);
    let gpu_pool = s.clone_htod(&pool).map_err(err)?;
    let gpu_ids = s.clone_htod(&ids).map_err(err)?;
    let mut staging = s.alloc_zeros::<u32>(want.len()).map_err(err)?;
    // SAFETY: the ids are blocks of the pool (and of the second, same-sized pool).
    unsafe { k.gather_blocks(&mut staging, &gpu_pool, &gpu_ids, words) }.map_err(err)?;
    let gathered = s.clone_dtoh(&staging).map_err(err)?;
    let mut back = vec![0u32; pool.len()];
    block_copy::scatter_reference(&mut back, &want, &ids, words);
    let mut gpu_back = s.alloc_zeros::<u32>(pool.len()).map_err(err)?;
    // SAFETY: as above.
    unsafe { k.scatter_blocks(&mut gpu_back, &staging, &gpu_ids, words) }.map_err(err)?;
    let scattered = s.clone_dtoh(&gpu_back).map_err(err)?;
    Ok(if gathered == want && scattered == back {
        0.0
    } else {
        f32::INFINITY
    })
}

fn rechunks(
    k: &Kernels,
    rng: &mut ChaCha8Rng,
    from: KvLayout,
    to: KvLayout,
) -> Result<f32, String> {
    let s = k.stream();
    let tokens = 21usize..150;
    let span = |l: &KvLayout| tokens.end.div_ceil(l.block_size) - tokens.start / l.block_size;
    let src_ids: Vec<i32> = (0..span(&from) as i32).map(|i| 2 * i + 1).collect();
    let dst_ids: Vec<i32> = (0..span(&to) as i32).rev().map(|i| 2 * i).collect();
    let src: Vec<u16> = (0..from.num_blocks * from.block_elems())
        .map(|_| rng.random())
        .collect();
    let mut want = vec![0u16; to.num_blocks * to.block_elems()];
    rechunk::reference(
        &mut want,
        &src,
        &src_ids,
        &dst_ids,
        tokens.start,
        tokens.len(),
        &from,
        &to,
    );
    let mut dst = s.alloc_zeros::<u16>(want.len()).map_err(err)?;
    let (srcd, sid, did) = (
        s.clone_htod(&src).map_err(err)?,
        s.clone_htod(&src_ids).map_err(err)?,
        s.clone_htod(&dst_ids).map_err(err)?,
    );
    // SAFETY: the lists name blocks 1, 3, 5… and 0, 2, 4… of pools of 40 blocks.
    unsafe { k.rechunk(&mut dst, &srcd, &sid, &did, tokens, &from, &to) }.map_err(err)?;
    let got = s.clone_dtoh(&dst).map_err(err)?;
    Ok(if got == want { 0.0 } else { f32::INFINITY })
}

fn main() -> ExitCode {
    let seed = std::env::var("PD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("gpu_check: seed {seed}");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let k = match Kernels::load(0) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("gpu_check: cannot load the kernels on device 0: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut results: Vec<(String, Check, f32)> = Vec::new();
    for order in [KvOrder::Hnd, KvOrder::Nhd] {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
            let l = layout(dtype, order, 16);
            let [cache, attn] = match dtype {
                KvDtype::F32 => attention::<f32>(&k, l, &mut rng),
                KvDtype::F16 => attention::<half::f16>(&k, l, &mut rng),
                KvDtype::BF16 => attention::<half::bf16>(&k, l, &mut rng),
            };
            let name = format!("{} {}", dtype.as_str(), order.as_str());
            results.push((format!("reshape_and_cache {name}"), cache, 0.0));
            results.push((format!("paged_attention {name}"), attn, 1e-3));
        }
    }
    results.push((
        "gather_blocks + scatter_blocks".into(),
        copies(&k, &mut rng),
        0.0,
    ));
    for (fbs, fo, tbs, to) in [
        (16, KvOrder::Hnd, 32, KvOrder::Nhd),
        (32, KvOrder::Nhd, 16, KvOrder::Hnd),
        (16, KvOrder::Nhd, 16, KvOrder::Hnd),
    ] {
        let (from, to) = (layout(KvDtype::F16, fo, fbs), layout(KvDtype::F16, to, tbs));
        results.push((
            format!(
                "rechunk {fbs} {} -> {tbs} {}",
                fo.as_str(),
                to.order.as_str()
            ),
            rechunks(&k, &mut rng, from, to),
            0.0,
        ));
    }
    let mut failed = false;
    for (name, r, tol) in &results {
        match r {
            Ok(d) if d <= tol => println!("ok    {name}: max difference {d:e}"),
            Ok(d) => {
                failed = true;
                println!("FAIL  {name}: max difference {d:e} > {tol:e}");
            }
            Err(e) => {
                failed = true;
                println!("FAIL  {name}: {e}");
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
