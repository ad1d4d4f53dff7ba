//! The arithmetic of one attention row, defined once: a scalar definition and an AVX2 + FMA
//! twin that gives the same bits.
//!
//! Why bits matter: a prompt's K/V and logits must not depend on how a step grouped its rows
//! (one prefill, a chunked prefill after a prefix-cache hit, one decode row at a time, a peer
//! with another block size or CPU). So every quantity here is a fixed expression of one row's
//! own inputs, in a fixed order:
//! - a score is `tree(lanes) · scale`, where lane `i` is the fused multiply-add chain, in
//!   ascending `d`, of `q[d] · k[d]` over the dims `d ≡ i (mod 8)`, and `tree(a)` is
//!   `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))` ([`tree`]);
//! - a numerator is [`exp`] of `score − max`, and the denominator is `tree` of eight lane sums,
//!   lane `i` summing, in ascending position, the numerators of positions `≡ i (mod 8)`;
//! - an output element is the fused multiply-add chain, in ascending position, of numerator ·
//!   V, times `1 / denominator`.
//!
//! The AVX2 kernels reach those expressions through 8-wide vectors ([`dot8`] reduces eight
//! keys' lanes at once, [`exp_sum`] takes eight positions per step, [`accumulate`] up to eight
//! rows per V load); the tests check them bit for bit against the scalar definitions. The
//! scalar path runs where AVX2 + FMA is missing or `head_dim` is not a multiple of 8.

/// Which implementation of the same arithmetic runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// The definitions, one element at a time.
    Scalar,
    /// 8-wide AVX2 + FMA (x86-64 only; chosen at run time).
    Avx2,
}

impl Isa {
    /// The fastest implementation this CPU runs for rows of `head_dim`.
    pub(crate) fn detect(head_dim: usize) -> Isa {
        #[cfg(target_arch = "x86_64")]
        if head_dim.is_multiple_of(8)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return Isa::Avx2;
        }
        let _ = head_dim;
        Isa::Scalar
    }
}

/// `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`: the one order lanes are summed in.
#[inline(always)]
pub(crate) fn tree(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Lowest argument [`exp`] takes (below it, the numerator is `exp(-87)`, ~1.6e-38).
const EXP_MIN: f32 = -87.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two (Cephes), so `x − n·ln 2` keeps its low bits.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' minimax polynomial for `(e^r − 1 − r) / r²` on |r| ≤ ln 2 / 2.
const EXP_POLY: [f32; 6] = [
    1.987_569_2e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `e^x` for `x ≤ 0` (a score minus its row's maximum), within 2 ulp of the true value for
/// `x ≥ EXP_MIN`: `2ⁿ · (1 + r + r²·P(r))` with `n = round(x · log2 e)`, `r = x − n·ln 2`.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.max(EXP_MIN);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // n ∈ [-126, 0]: 2ⁿ is a normal float.
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Scores of one query row against 8 keys: `out[k] = tree(lanes(q · keys[k])) · scale`.
///
/// - `q`: `(head_dim,)`; `keys`: `(8, head_dim)` contiguous f32 rows.
#[inline(always)]
pub(crate) fn dot8(isa: Isa, q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    let hd = q.len();
    assert!(
        keys.len() >= 8 * hd && out.len() >= 8,
        "dot8: short keys or out"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU has AVX2 + FMA and `hd % 8 == 0`; the
        // lengths were checked above.
        Isa::Avx2 => unsafe { avx2::dot8(q, keys, scale, out) },
        _ => {
            for (k, o) in out.iter_mut().take(8).enumerate() {
                *o = dot(q, &keys[k * hd..(k + 1) * hd]) * scale;
            }
        }
    }
}

/// `tree` of the lanes of `q · k` (the definition; [`dot8`] without the scale).
#[inline(always)]
fn dot(q: &[f32], k: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    for (d, (a, b)) in q.iter().zip(k).enumerate() {
        lanes[d % 8] = a.mul_add(*b, lanes[d % 8]);
    }
    tree(&lanes)
}

/// Replaces `s[..n]` by `exp(s[j] − max)` and returns the denominator (`tree` of the lane
/// sums by position mod 8). `s` must hold at least `n` rounded up to 8 values; those past `n`
/// may be overwritten.
#[inline(always)]
pub(crate) fn exp_sum(isa: Isa, s: &mut [f32], n: usize, max: f32) -> f32 {
    assert!(s.len() >= n.div_ceil(8) * 8, "exp_sum: scores not padded");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU has AVX2 + FMA; length checked above.
        Isa::Avx2 => unsafe { avx2::exp_sum(s, n, max) },
        _ => {
            let mut lanes = [0f32; 8];
            for (j, x) in s[..n].iter_mut().enumerate() {
                *x = exp(*x - max);
                lanes[j % 8] += *x;
            }
            tree(&lanes)
        }
    }
}

/// Adds, for every row `r`, `Σ_j w[r][j] · v[j]` over positions `j0 .. ends[r]` to
/// `acc[r]`, one fused multiply-add per element in ascending `j`.
///
/// - `acc`: `(rows, head_dim)`; `w`: `(rows, w_stride)` numerators by absolute position;
/// - `v`: `(keys, head_dim)`, row `j − j0` holding position `j`; `ends[r] ≤ j0 + keys`.
pub(crate) fn accumulate(
    isa: Isa,
    acc: &mut [f32],
    w: &[f32],
    w_stride: usize,
    v: &[f32],
    j0: usize,
    ends: &[usize],
) {
    let rows = ends.len();
    let hd = acc.len() / rows.max(1);
    assert!(acc.len() == rows * hd && w.len() >= rows * w_stride);
    for &end in ends {
        assert!(end <= w_stride && (end <= j0 || (end - j0) * hd <= v.len()));
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU has AVX2 + FMA and `hd % 8 == 0`; every
        // row's range lies inside `w` and `v` (checked above).
        Isa::Avx2 => unsafe { avx2::accumulate(acc, w, w_stride, v, j0, ends, hd) },
        _ => {
            for (r, &end) in ends.iter().enumerate() {
                let a = &mut acc[r * hd..(r + 1) * hd];
                for j in j0..end.max(j0) {
                    let p = w[r * w_stride + j];
                    for (x, y) in a.iter_mut().zip(&v[(j - j0) * hd..(j - j0 + 1) * hd]) {
                        *x = p.mul_add(*y, *x);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 + FMA twins. Every function requires a CPU with AVX2 and FMA and
    //! `head_dim % 8 == 0`; the callers in the parent module check both.
    use std::arch::x86_64::*;

    use super::{EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E};

    /// Lane `k` of the result is `tree` of `v[k]` (the transposing sum of eight vectors).
    #[target_feature(enable = "avx2,fma")]
    fn tree8(v: [__m256; 8]) -> __m256 {
        // x_k = lo(v_k) + hi(v_k): lanes (a_i + a_{i+4}), i < 4; two vectors per register.
        let half = |a: __m256, b: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            )
        };
        let (x04, x15, x26, x37) = (
            half(v[0], v[4]),
            half(v[1], v[5]),
            half(v[2], v[6]),
            half(v[3], v[7]),
        );
        // y0 = x0 + x2, y1 = x1 + x3, interleaved per vector.
        let pair = |a: __m256, b: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        };
        let (y01, y23) = (pair(x04, x15), pair(x26, x37));
        // y0 + y1.
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(y01, y23),
            _mm256_shuffle_ps::<0b11_01_11_01>(y01, y23),
        )
    }

    /// `tree` of one vector's lanes.
    #[target_feature(enable = "avx2,fma")]
    fn tree1(v: __m256) -> f32 {
        let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let y = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(y, _mm_shuffle_ps::<0b01>(y, y)))
    }

    /// [`super::dot8`]. Requires `keys.len() ≥ 8·q.len()`, `out.len() ≥ 8`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot8(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
        let hd = q.len();
        let (qp, kp) = (q.as_ptr(), keys.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (0..hd).step_by(8) {
            // SAFETY: c + 8 ≤ hd, and key k's row ends at (k + 1)·hd ≤ keys.len().
            unsafe {
                let qv = _mm256_loadu_ps(qp.add(c));
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp.add(k * hd + c)), *a);
                }
            }
        }
        let s = _mm256_mul_ps(tree8(acc), _mm256_set1_ps(scale));
        // SAFETY: out holds at least 8.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    }

    /// [`super::exp`], eight at a time.
    #[target_feature(enable = "avx2,fma")]
    fn exp(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let pow = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow))
    }

    /// [`super::exp_sum`]. Requires `s.len() ≥ ⌈n / 8⌉ · 8`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum(s: &mut [f32], n: usize, max: f32) -> f32 {
        let m = _mm256_set1_ps(max);
        let mut sum = _mm256_setzero_ps();
        let p = s.as_mut_ptr();
        for j in (0..n).step_by(8) {
            // SAFETY: j + 8 ≤ ⌈n / 8⌉ · 8 ≤ s.len().
            unsafe {
                let mut e = exp(_mm256_sub_ps(_mm256_loadu_ps(p.add(j)), m));
                if j + 8 > n {
                    // Lanes past n add +0: a lane sum (≥ +0) is unchanged, as in the definition.
                    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    let live = _mm256_cmpgt_epi32(_mm256_set1_epi32((n - j) as i32), idx);
                    e = _mm256_and_ps(e, _mm256_castsi256_ps(live));
                }
                _mm256_storeu_ps(p.add(j), e);
                sum = _mm256_add_ps(sum, e);
            }
        }
        tree1(sum)
    }

    /// [`super::accumulate`]: rows in groups of up to 8, one V load per group and position.
    /// Requires every row's range inside `w` and `v` (the caller checks it).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn accumulate(
        acc: &mut [f32],
        w: &[f32],
        w_stride: usize,
        v: &[f32],
        j0: usize,
        ends: &[usize],
        hd: usize,
    ) {
        for g in (0..ends.len()).step_by(8) {
            let rows = (ends.len() - g).min(8);
            // SAFETY: forwarded from the caller's contract; rows g..g + rows exist.
            unsafe {
                match rows {
                    1 => group::<1>(acc, w, w_stride, v, j0, ends, hd, g),
                    2 => group::<2>(acc, w, w_stride, v, j0, ends, hd, g),
                    3 => group::<3>(acc, w, w_stride, v, j0, ends, hd, g),
                    4 => group::<4>(acc, w, w_stride, v, j0, ends, hd, g),
                    5 => group::<5>(acc, w, w_stride, v, j0, ends, hd, g),
                    6 => group::<6>(acc, w, w_stride, v, j0, ends, hd, g),
                    7 => group::<7>(acc, w, w_stride, v, j0, ends, hd, g),
                    _ => group::<8>(acc, w, w_stride, v, j0, ends, hd, g),
                }
            }
        }
    }

    /// Rows `g .. g + G` of [`accumulate`]: positions every row takes with all `G` at once,
    /// then each row's remaining positions alone (the same chain per element either way).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group<const G: usize>(
        acc: &mut [f32],
        w: &[f32],
        w_stride: usize,
        v: &[f32],
        j0: usize,
        ends: &[usize],
        hd: usize,
        g: usize,
    ) {
        let ends = &ends[g..g + G];
        let common = ends.iter().copied().min().unwrap_or(j0).max(j0);
        let (ap, wp, vp) = (acc.as_mut_ptr(), w.as_ptr(), v.as_ptr());
        for c in (0..hd).step_by(8) {
            // SAFETY: row g + r's accumulator is acc[(g + r)·hd ..][..hd]; its weights up to
            // ends[r] ≤ w_stride lie in w; position j's V row (j − j0) lies in v.
            unsafe {
                let mut a = [_mm256_setzero_ps(); G];
                for (r, x) in a.iter_mut().enumerate() {
                    *x = _mm256_loadu_ps(ap.add((g + r) * hd + c));
                }
                for j in j0..common {
                    let vv = _mm256_loadu_ps(vp.add((j - j0) * hd + c));
                    for (r, x) in a.iter_mut().enumerate() {
                        let p = _mm256_broadcast_ss(&*wp.add((g + r) * w_stride + j));
                        *x = _mm256_fmadd_ps(p, vv, *x);
                    }
                }
                for (r, x) in a.iter_mut().enumerate() {
                    for j in common..ends[r] {
                        let vv = _mm256_loadu_ps(vp.add((j - j0) * hd + c));
                        let p = _mm256_broadcast_ss(&*wp.add((g + r) * w_stride + j));
                        *x = _mm256_fmadd_ps(p, vv, *x);
                    }
                    _mm256_storeu_ps(ap.add((g + r) * hd + c), *x);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u32) -> impl FnMut() -> f32 {
        let mut x = seed as f32 * 0.001 + 0.37;
        move || {
            x = (x * 9301.0 + 0.49297).fract();
            x - 0.5
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut x = 0f32;
        while x > EXP_MIN {
            let (ours, libm) = (exp(x), x.exp());
            let ulp = (libm.to_bits() as i64 - ours.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {ours}, libm {libm}");
            x -= 0.000_731;
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1e-37);
    }

    #[test]
    fn tree_is_the_one_lane_order() {
        // Values whose sum depends on the order, so a different tree would show.
        let a = [1e8f32, 1.0, -1e8, 3.0, 0.5, 1e-3, 7.0, -2.5];
        assert_eq!(
            tree(&a),
            ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
        );
    }

    /// Every AVX2 kernel equals the scalar definition bit for bit (where the CPU has AVX2).
    #[test]
    fn avx2_twins_give_the_definitions_bits() {
        let isa = Isa::detect(64);
        if isa == Isa::Scalar {
            eprintln!("no AVX2 + FMA here: only the scalar definitions run");
            return;
        }
        let mut r = rng(7);
        for hd in [8, 16, 64, 128] {
            let q: Vec<f32> = (0..hd).map(|_| r() * 3.0).collect();
            let keys: Vec<f32> = (0..8 * hd).map(|_| r() * 3.0).collect();
            let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
            dot8(Isa::Avx2, &q, &keys, 0.125, &mut a);
            dot8(Isa::Scalar, &q, &keys, 0.125, &mut b);
            assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "dot8 hd {hd}");
        }
        for n in [1usize, 7, 8, 9, 31, 200, 1001] {
            let s: Vec<f32> = (0..n.div_ceil(8) * 8).map(|_| r() * 40.0).collect();
            let max = s[..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (mut a, mut b) = (s.clone(), s.clone());
            let (da, db) = (
                exp_sum(Isa::Avx2, &mut a, n, max),
                exp_sum(Isa::Scalar, &mut b, n, max),
            );
            assert_eq!(da.to_bits(), db.to_bits(), "denominator n {n}");
            for j in 0..n {
                assert_eq!(a[j].to_bits(), b[j].to_bits(), "numerator {j} of {n}");
            }
        }
        // 11 rows (a group of 8 and one of 3) with ragged ends inside a tile of 20 positions
        // starting at 40, over accumulators that already hold earlier tiles' sums.
        let (hd, rows, stride, j0, keys) = (64, 11, 64, 40, 20);
        let w: Vec<f32> = (0..rows * stride).map(|_| r() + 0.5).collect();
        let v: Vec<f32> = (0..keys * hd).map(|_| r()).collect();
        let ends: Vec<usize> = (0..rows).map(|i| [60, 57, 41, 40, 59][i % 5]).collect();
        let start: Vec<f32> = (0..rows * hd).map(|_| r()).collect();
        let (mut a, mut b) = (start.clone(), start);
        accumulate(Isa::Avx2, &mut a, &w, stride, &v, j0, &ends);
        accumulate(Isa::Scalar, &mut b, &w, stride, &v, j0, &ends);
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}
