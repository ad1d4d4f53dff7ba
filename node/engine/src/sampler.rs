//! Turns one row of logits into a token: greedy, or temperature → top-k → top-p → draw.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::request::{SamplingParams, TokenLogprob};

/// Picks the next token from `logits` (vocab,) under `params`, drawing from `rng` unless greedy.
pub(crate) fn sample(logits: &[f32], params: &SamplingParams, rng: &mut ChaCha8Rng) -> u32 {
    // Below 1e-5 the scaled logits overflow: treat as greedy (as vLLM does).
    if params.temperature < 1e-5 || params.top_k == 1 {
        return argmax(logits);
    }
    let inv_t = 1.0 / params.temperature;
    // (token, scaled logit), most likely first.
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l * inv_t))
        .collect();
    cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if params.top_k > 0 && params.top_k < cand.len() {
        cand.truncate(params.top_k);
    }
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    for p in &mut probs {
        *p /= total;
    }
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= params.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let mass: f32 = probs.iter().sum();
    let mut u = rng.random::<f32>() * mass;
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return cand[i].0;
        }
        u -= p;
    }
    cand[probs.len() - 1].0
}

/// Index of the largest logit (lowest index on ties).
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-probability of `token` and the `k` most likely tokens under the model's distribution.
pub(crate) fn logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k);
    if k > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = k.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        idx.truncate(k);
        idx.sort_unstable_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        top = idx
            .into_iter()
            .map(|i| (i, logits[i as usize] - lse))
            .collect();
    }
    TokenLogprob {
        token_id: token,
        logprob: logits[token as usize] - lse,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params(t: f32, k: usize, p: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample(&[0.1, 3.0, 2.9], &params(0.0, 0, 1.0), &mut rng), 1);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let l = [1.0, 2.0, 5.0, 0.0];
        for _ in 0..20 {
            assert_eq!(sample(&l, &params(1.0, 1, 1.0), &mut rng), 2);
            assert_eq!(sample(&l, &params(1.0, 0, 0.01), &mut rng), 2);
        }
    }

    #[test]
    fn top_k_restricts_support() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let l = [1.0, 1.1, 1.2, 1.3];
        for _ in 0..200 {
            let t = sample(&l, &params(1.0, 2, 1.0), &mut rng);
            assert!(t == 2 || t == 3, "{t}");
        }
    }

    #[test]
    fn same_seed_same_draws() {
        let l: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..30)
                .map(|_| sample(&l, &params(1.0, 0, 0.9), &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let l = [0.0f32, 1.0, 2.0];
        let lp = logprobs(&l, 1, 2);
        let lse = 2.0 - lp.top[0].1;
        let total: f32 = l.iter().map(|&x| (x - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!((lp.logprob - lp.top[1].1).abs() < 1e-6);
    }
}
