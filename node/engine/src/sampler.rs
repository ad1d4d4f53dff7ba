//! Turns one row of logits into a token: the structured-output mask ([`pick`]), penalties and
//! biases, then greedy, or temperature → min-p → top-k → top-p → draw (vLLM's order).

use pd_grammar::{GrammarError, TokenMatcher};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::request::{SamplingParams, TokenLogprob};

/// What one child has seen, for the penalties: its prompt and the tokens it generated so far.
#[derive(Clone, Copy, Debug)]
pub(crate) struct History<'a> {
    pub(crate) prompt: &'a [u32],
    pub(crate) output: &'a [u32],
}

impl<'a> History<'a> {
    /// `tokens` = prompt followed by output, split at `prompt_len`.
    pub(crate) fn of(tokens: &'a [u32], prompt_len: usize) -> Self {
        let (prompt, output) = tokens.split_at(prompt_len.min(tokens.len()));
        Self { prompt, output }
    }
}

/// Picks a child's next token from its row of `logits` (vocab,): the row masked by the child's
/// structured-output constraint first, when it has one (`grammar`), then [`sample`]d; with the
/// masked row's [`logprobs`] when `params` ask for them. The one way a token is picked: a
/// child's emitted token and a prefill's attested first token (drawn ahead on copies of the
/// child's generator and matcher) both come from here.
///
/// # Errors
/// The constraint could not compute its mask (the request fails).
pub(crate) fn pick(
    logits: &[f32],
    grammar: Option<&mut TokenMatcher>,
    params: &SamplingParams,
    history: History<'_>,
    banned: &[u32],
    rng: &mut ChaCha8Rng,
) -> Result<(u32, Option<TokenLogprob>), GrammarError> {
    let masked;
    let logits = match grammar {
        None => logits,
        Some(grammar) => {
            let mut row = logits.to_vec();
            grammar.mask(&mut row)?;
            masked = row;
            &masked[..]
        }
    };
    let token = sample(logits, params, history, banned, rng);
    let logprob = params.logprobs.map(|k| logprobs(logits, token, k));
    Ok((token, logprob))
}

/// Picks the next token from `logits` (vocab,) under `params` for a child with `history`,
/// drawing from `rng` unless greedy; never one of `banned` (the tokens `min_tokens` holds back:
/// [`min_tokens_ban`]).
///
/// No full sort of the vocabulary: top-k is a partial selection (`select_nth_unstable`) and only
/// the candidates are sorted; top-p sorts a prefix of the most likely tokens, growing it until it
/// holds the nucleus (usually a few dozen of 49 152 entries).
pub(crate) fn sample(
    logits: &[f32],
    params: &SamplingParams,
    history: History<'_>,
    banned: &[u32],
    rng: &mut ChaCha8Rng,
) -> u32 {
    let adjusted;
    let logits = if params.adjusts_logits() || !banned.is_empty() {
        adjusted = adjust(logits, params, history, banned);
        &adjusted[..]
    } else {
        logits
    };
    if is_greedy(params) || logits.is_empty() {
        return argmax(logits);
    }
    let inv_t = 1.0 / params.temperature;
    // (vocab,) scaled logits; rank: most likely first, lowest id first on ties.
    let scaled: Vec<f32> = logits.iter().map(|&l| l * inv_t).collect();
    let by_rank = |a: &u32, b: &u32| {
        scaled[*b as usize]
            .total_cmp(&scaled[*a as usize])
            .then(a.cmp(b))
    };
    let mut cand: Vec<u32> = if params.min_p > 0.0 {
        // Probability ≥ min_p × the top one's ⇔ scaled logit ≥ top's + ln(min_p).
        let top = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let floor = top + params.min_p.ln();
        let kept: Vec<u32> = (0..scaled.len() as u32)
            .filter(|&i| scaled[i as usize] >= floor)
            .collect();
        if kept.is_empty() {
            // Only when no logit is a number (NaN everywhere): nothing to weigh.
            return argmax(logits);
        }
        kept
    } else {
        (0..scaled.len() as u32).collect()
    };
    if params.top_k > 0 && params.top_k < cand.len() {
        cand.select_nth_unstable_by(params.top_k - 1, by_rank);
        cand.truncate(params.top_k);
    }
    let max = cand
        .iter()
        .map(|&i| scaled[i as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    let weight = |i: u32| (scaled[i as usize] - max).exp();
    if params.top_p < 1.0 {
        // The nucleus: the most likely candidates until their mass reaches top_p.
        let target = params.top_p * cand.iter().map(|&i| weight(i)).sum::<f32>();
        let mut m = NUCLEUS_FIRST_GUESS.min(cand.len());
        loop {
            if m < cand.len() {
                cand.select_nth_unstable_by(m - 1, by_rank);
            }
            cand[..m].sort_unstable_by(by_rank);
            let mut acc = 0.0;
            let keep = cand[..m].iter().position(|&i| {
                acc += weight(i);
                acc >= target
            });
            if let Some(j) = keep {
                cand.truncate(j + 1);
                break;
            }
            if m == cand.len() {
                break; // (rounding) the whole set
            }
            m = (m * 8).min(cand.len());
        }
    } else if params.top_k > 0 {
        cand.sort_unstable_by(by_rank);
    }
    let mass: f32 = cand.iter().map(|&i| weight(i)).sum();
    let mut u = rng.random::<f32>() * mass;
    for &i in &cand {
        let p = weight(i);
        if u < p {
            return i;
        }
        u -= p;
    }
    cand[cand.len() - 1]
}

/// `logits` (vocab,) with `params`' biases and penalties applied, in vLLM's order: `logit_bias`,
/// then the repetition penalty (prompt and output), the frequency and the presence penalty
/// (output); `banned` tokens last, at −∞. Token ids outside the row are skipped (the engine
/// checks them against the vocabulary).
fn adjust(
    logits: &[f32],
    params: &SamplingParams,
    history: History<'_>,
    banned: &[u32],
) -> Vec<f32> {
    let mut out = logits.to_vec();
    for &(token, bias) in &params.logit_bias {
        if let Some(l) = out.get_mut(token as usize) {
            *l += bias;
        }
    }
    if params.repetition_penalty != 1.0 {
        // Each token seen once, whatever its count: sort the ids (prompt and output) and dedup.
        let mut seen: Vec<u32> = history
            .prompt
            .iter()
            .chain(history.output)
            .copied()
            .collect();
        seen.sort_unstable();
        seen.dedup();
        let r = params.repetition_penalty;
        for t in seen {
            if let Some(l) = out.get_mut(t as usize) {
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        let mut generated = history.output.to_vec();
        generated.sort_unstable();
        for run in generated.chunk_by(|a, b| a == b) {
            if let Some(l) = out.get_mut(run[0] as usize) {
                *l -= params.frequency_penalty * run.len() as f32 + params.presence_penalty;
            }
        }
    }
    for &token in banned {
        if let Some(l) = out.get_mut(token as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
    out
}

/// The tokens a child may not pick while it is short of `min_tokens`: those that would end it
/// (`eos` unless `ignore_eos` — under structured output EOS ends a child even then — and
/// `stop_token_ids`), sorted; none without `min_tokens`.
pub(crate) fn min_tokens_ban(params: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    if params.min_tokens == 0 {
        return Vec::new();
    }
    let mut ban: Vec<u32> = params.stop_token_ids.clone();
    if !params.ignore_eos || params.structured.is_some() {
        ban.extend_from_slice(eos);
    }
    ban.sort_unstable();
    ban.dedup();
    ban
}

/// Tokens sorted first when looking for a top-p nucleus (grown ×8 while too small).
const NUCLEUS_FIRST_GUESS: usize = 64;

/// Whether `params` sample greedily: the token is the argmax of the logits and no random
/// number is drawn. Below a temperature of 1e-5 the scaled logits overflow: greedy, as in vLLM.
pub(crate) fn is_greedy(params: &SamplingParams) -> bool {
    params.temperature < 1e-5 || params.top_k == 1
}

/// How [`sample`] picks a child's *first* token under `params`, as a key a producer attests
/// that token with and a consumer compares with its own: 0 for the plain argmax (greedy with no
/// bias or repetition penalty: any such request picks the same), else xxh3 of what that pick
/// depends on (never 0): the temperature, top-k, top-p, seed and min-p unless greedy, and the
/// bias and repetition penalty when set, the structured-output constraint's fingerprint (a
/// masked row may pick another token), and `min_tokens`' ban (its stop ids, `ignore_eos`).
/// The frequency and presence penalties are left out: they count generated tokens, and there
/// are none yet. Requests whose keys are equal pick the
/// same first token from the same logits and prompt with the same generator state — without a
/// seed they draw from fresh generators, which is the same distribution.
pub fn first_token_key(params: &SamplingParams) -> u64 {
    let greedy = is_greedy(params);
    let adjusted = params.repetition_penalty != 1.0 || !params.logit_bias.is_empty();
    if greedy && !adjusted && params.structured.is_none() && params.min_tokens == 0 {
        return 0;
    }
    let mut bytes = Vec::with_capacity(32);
    if greedy {
        bytes.push(2);
    } else {
        bytes.extend_from_slice(&params.temperature.to_bits().to_le_bytes());
        bytes.extend_from_slice(&(params.top_k as u64).to_le_bytes());
        bytes.extend_from_slice(&params.top_p.to_bits().to_le_bytes());
        match params.seed {
            Some(s) => {
                bytes.push(1);
                bytes.extend_from_slice(&s.to_le_bytes());
            }
            None => bytes.push(0),
        }
        if params.min_p > 0.0 {
            bytes.push(b'm');
            bytes.extend_from_slice(&params.min_p.to_bits().to_le_bytes());
        }
    }
    if let Some(s) = &params.structured {
        bytes.push(b's');
        bytes.extend_from_slice(&s.spec.fingerprint().to_le_bytes());
    }
    if params.min_tokens > 0 {
        // The first pick bans the ending tokens (EOS is the model's: the same on both sides).
        bytes.push(b'n');
        bytes.push(u8::from(params.ignore_eos));
        for &token in &params.stop_token_ids {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
    }
    if adjusted {
        bytes.push(b'a');
        bytes.extend_from_slice(&params.repetition_penalty.to_bits().to_le_bytes());
        for &(token, bias) in &params.logit_bias {
            bytes.extend_from_slice(&token.to_le_bytes());
            bytes.extend_from_slice(&bias.to_bits().to_le_bytes());
        }
    }
    xxhash_rust::xxh3::xxh3_64(&bytes).max(1)
}

/// Advances `rng` past what [`sample`] draws for one token under `params` (one `f32` unless
/// greedy), for a token taken as given instead of sampled here: the sequence's later draws
/// then match a sequence that sampled it itself.
pub(crate) fn skip_draw(params: &SamplingParams, rng: &mut ChaCha8Rng) {
    if !is_greedy(params) {
        let _: f32 = rng.random();
    }
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
        // Tokens a structured output's mask ruled out (−∞) are no alternatives: fewer than `k`
        // come back where fewer were allowed (−∞ would be `null` in JSON).
        top = idx
            .into_iter()
            .map(|i| (i, logits[i as usize] - lse))
            .filter(|(_, l)| l.is_finite())
            .collect();
    }
    let own = logits[token as usize];
    let rank = 1 + logits.iter().filter(|&&l| l > own).count() as u32;
    TokenLogprob {
        token_id: token,
        logprob: own - lse,
        top,
        rank,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// A child with an empty prompt that generated nothing yet.
    const FRESH: History<'static> = History {
        prompt: &[],
        output: &[],
    };

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
        assert_eq!(
            sample(&[0.1, 3.0, 2.9], &params(0.0, 0, 1.0), FRESH, &[], &mut rng),
            1
        );
    }

    /// Without a constraint, [`pick`] is [`sample`] from the same generator state, with the
    /// row's logprobs when asked.
    #[test]
    fn pick_without_a_constraint_samples_and_scores_the_row() {
        let l = [0.3, 1.0, 0.9, -2.0, 0.5];
        let p = SamplingParams {
            logprobs: Some(2),
            seed: Some(7),
            ..params(0.8, 0, 0.95)
        };
        let (mut a, mut b) = (ChaCha8Rng::seed_from_u64(7), ChaCha8Rng::seed_from_u64(7));
        for _ in 0..20 {
            let (token, logprob) = pick(&l, None, &p, FRESH, &[], &mut a).unwrap();
            assert_eq!(token, sample(&l, &p, FRESH, &[], &mut b));
            let logprob = logprob.expect("asked for");
            assert_eq!(logprob.token_id, token);
            assert_eq!(logprob.top.len(), 2);
        }
        let plain = params(0.0, 0, 1.0);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(
            pick(&l, None, &plain, FRESH, &[], &mut rng).unwrap(),
            (1, None)
        );
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let l = [1.0, 2.0, 5.0, 0.0];
        for _ in 0..20 {
            assert_eq!(sample(&l, &params(1.0, 1, 1.0), FRESH, &[], &mut rng), 2);
            assert_eq!(sample(&l, &params(1.0, 0, 0.01), FRESH, &[], &mut rng), 2);
        }
    }

    #[test]
    fn top_k_restricts_support() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let l = [1.0, 1.1, 1.2, 1.3];
        for _ in 0..200 {
            let t = sample(&l, &params(1.0, 2, 1.0), FRESH, &[], &mut rng);
            assert!(t == 2 || t == 3, "{t}");
        }
    }

    #[test]
    fn same_seed_same_draws() {
        let l: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..30)
                .map(|_| sample(&l, &params(1.0, 0, 0.9), FRESH, &[], &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    #[test]
    fn top_p_nucleus_larger_than_the_first_guess_is_found_whole() {
        // 49 152 entries: 1000 equally likely tokens hold almost all the mass.
        let mut l = vec![-30.0f32; 49_152];
        for i in 0..1000 {
            l[i * 37] = 5.0;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..3000 {
            let t = sample(&l, &params(1.0, 0, 0.5), FRESH, &[], &mut rng) as usize;
            assert_eq!(t % 37, 0, "{t} is outside the nucleus");
            assert!(t < 1000 * 37);
            seen.insert(t);
        }
        // Half the mass is ~500 of the 1000 tokens (the lowest ids first on ties): far more
        // than the first guess of 64, and never beyond the nucleus.
        assert!(seen.len() > 400 && seen.len() <= 501, "{}", seen.len());
        assert!(seen.iter().all(|&t| t / 37 <= 500));
    }

    #[test]
    fn top_k_and_top_p_together_keep_the_most_likely() {
        let l: Vec<f32> = (0..5000).map(|i| -((i % 977) as f32) * 0.01).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for _ in 0..500 {
            let t = sample(&l, &params(0.7, 20, 0.8), FRESH, &[], &mut rng) as usize;
            // The 20 most likely are ids ≡ 0..=3 (mod 977) below 5000: 0,977,…,1,978,…
            assert!(t % 977 <= 3, "{t}");
        }
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
        assert_eq!(lp.rank, 2, "one token is more likely");
        assert_eq!(logprobs(&l, 2, 0).rank, 1);
        assert_eq!(logprobs(&l, 0, 0).rank, 3);
    }

    #[test]
    fn masked_tokens_are_no_alternatives() {
        // A structured output's mask left two tokens.
        let l = [f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY, 0.5];
        let lp = logprobs(&l, 1, 4);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!(lp.top.iter().all(|t| t.1.is_finite()) && lp.logprob.is_finite());
    }

    #[test]
    fn logit_bias_moves_the_greedy_pick_and_is_added_as_given() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let l = [0.5f32, 3.0, 2.9, -1.0];
        let biased = |bias: Vec<(u32, f32)>| SamplingParams {
            logit_bias: bias,
            ..params(0.0, 0, 1.0)
        };
        // +100 on the least likely token makes it the argmax; −100 on the argmax hands the pick
        // to the runner-up; +0.05 on the runner-up is not enough (2.95 < 3.0), +0.2 is.
        assert_eq!(
            sample(&l, &biased(vec![(3, 100.0)]), FRESH, &[], &mut rng),
            3
        );
        assert_eq!(
            sample(&l, &biased(vec![(1, -100.0)]), FRESH, &[], &mut rng),
            2
        );
        assert_eq!(
            sample(&l, &biased(vec![(2, 0.05)]), FRESH, &[], &mut rng),
            1
        );
        assert_eq!(sample(&l, &biased(vec![(2, 0.2)]), FRESH, &[], &mut rng), 2);
        let adjusted = adjust(&l, &biased(vec![(0, -0.5), (2, 1.0)]), FRESH, &[]);
        assert_eq!(adjusted, vec![0.0, 3.0, 3.9, -1.0]);
    }

    #[test]
    fn frequency_and_presence_penalties_count_only_generated_tokens() {
        let l = [1.0f32, 1.0, 1.0, 1.0, -1.0];
        let p = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..params(0.0, 0, 1.0)
        };
        // Token 0 is in the prompt only: untouched. Token 1 was generated three times, token 4
        // once; token 2 never.
        let h = History::of(&[0, 0, 7, 1, 4, 1, 1], 3);
        assert_eq!(h.prompt, &[0, 0, 7]);
        assert_eq!(h.output, &[1, 4, 1, 1]);
        assert_eq!(
            adjust(&l, &p, h, &[]),
            vec![1.0, 1.0 - 1.5 - 0.25, 1.0, 1.0, -1.0 - 0.5 - 0.25]
        );
        // A negative penalty rewards repeats.
        let eager = SamplingParams {
            frequency_penalty: -2.0,
            ..params(0.0, 0, 1.0)
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample(&l, &eager, h, &[], &mut rng), 1);
        assert_eq!(sample(&l, &params(0.0, 0, 1.0), h, &[], &mut rng), 0);
    }

    #[test]
    fn repetition_penalty_shrinks_seen_tokens_toward_unlikely_once_each() {
        let l = [2.0f32, -2.0, 2.0, 1.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..params(0.0, 0, 1.0)
        };
        // Token 0 seen three times (prompt and output) is divided once; token 1 (negative) is
        // multiplied; token 2 unseen keeps its logit and wins the greedy pick.
        let h = History::of(&[0, 1, 0, 0], 2);
        assert_eq!(adjust(&l, &p, h, &[]), vec![1.0, -4.0, 2.0, 1.0]);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample(&l, &p, h, &[], &mut rng), 2);
    }

    #[test]
    fn min_p_over_a_row_without_numbers_picks_without_panicking() {
        let p = SamplingParams {
            min_p: 0.1,
            ..params(1.0, 0, 1.0)
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert!(sample(&[f32::NAN; 4], &p, FRESH, &[], &mut rng) < 4);
    }

    #[test]
    fn min_p_drops_tokens_far_below_the_top_one() {
        // Probabilities ∝ e^0, e^-1, e^-3, e^-3: with min_p 0.3 only tokens within ln(0.3) ≈
        // −1.2 of the top survive (0 and 1); without it all four are drawn.
        let l = [0.0f32, -1.0, -3.0, -3.0];
        let draw = |min_p: f32| {
            let p = SamplingParams {
                min_p,
                ..params(1.0, 0, 1.0)
            };
            let mut rng = ChaCha8Rng::seed_from_u64(3);
            (0..2000)
                .map(|_| sample(&l, &p, FRESH, &[], &mut rng))
                .collect::<std::collections::BTreeSet<_>>()
        };
        assert_eq!(draw(0.3), [0, 1].into());
        assert_eq!(draw(0.0), [0, 1, 2, 3].into());
    }

    #[test]
    fn min_tokens_bans_the_ending_tokens_until_it_is_reached() {
        let p = SamplingParams {
            min_tokens: 2,
            stop_token_ids: vec![3, 1],
            ..params(0.0, 0, 1.0)
        };
        assert_eq!(min_tokens_ban(&p, &[2, 1]), vec![1, 2, 3]);
        let ignoring = SamplingParams {
            ignore_eos: true,
            ..p.clone()
        };
        assert_eq!(min_tokens_ban(&ignoring, &[2]), vec![1, 3]);
        assert!(min_tokens_ban(&params(0.0, 0, 1.0), &[2]).is_empty());
        // The most likely token is banned: the next one is picked, greedy or sampled.
        let l = [0.0, 1.0, 5.0, 2.0];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        assert_eq!(sample(&l, &p, FRESH, &[2], &mut rng), 3);
        for _ in 0..200 {
            let t = sample(&l, &params(1.0, 0, 1.0), FRESH, &[2, 3], &mut rng);
            assert!(t < 2, "{t}");
        }
    }

    #[test]
    fn the_first_token_key_changes_with_every_adjustment() {
        let greedy = params(0.0, 0, 1.0);
        assert_eq!(first_token_key(&greedy), 0);
        let keys = [
            SamplingParams {
                logit_bias: vec![(5, 1.0)],
                ..greedy.clone()
            },
            SamplingParams {
                logit_bias: vec![(5, 2.0)],
                ..greedy.clone()
            },
            SamplingParams {
                repetition_penalty: 1.1,
                ..greedy.clone()
            },
            params(1.0, 0, 1.0),
            SamplingParams {
                min_p: 0.1,
                ..params(1.0, 0, 1.0)
            },
            SamplingParams {
                min_tokens: 3,
                ..greedy.clone()
            },
            SamplingParams {
                min_tokens: 3,
                stop_token_ids: vec![9],
                ..greedy.clone()
            },
        ]
        .map(|p| first_token_key(&p));
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len(), "{keys:?}");
        assert!(keys.iter().all(|&k| k != 0));
        // min_p changes nothing of a greedy pick, and the frequency and presence penalties
        // nothing of a first pick (nothing generated yet): none changes the key.
        for same in [
            SamplingParams {
                min_p: 0.5,
                ..greedy.clone()
            },
            SamplingParams {
                presence_penalty: 0.5,
                frequency_penalty: -1.0,
                ..greedy.clone()
            },
        ] {
            assert_eq!(first_token_key(&same), 0, "{same:?}");
        }
        let sampled = params(1.0, 0, 1.0);
        let penalized = SamplingParams {
            presence_penalty: 0.5,
            ..sampled.clone()
        };
        assert_eq!(first_token_key(&penalized), first_token_key(&sampled));
    }
}
