//! Prompt logprobs: every prompt token scored as a plain forward pass does, chunked, cached or
//! forked, and refused for P/D.

use crate::common::*;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use pd_engine::{GenerateRequest, KvTransfer, SamplingParams};

/// Log-softmax of candle-transformers' Llama at every position of `prompt`, fed one token at
/// a time (contiguous KV cache): row `p` scores the token at `p + 1`.
fn reference_prompt_logprobs(dir: &Path, prompt: &[u32]) -> Vec<Vec<f32>> {
    use candle_transformers::models::llama::{Cache, Llama, LlamaConfig};
    let files = pd_model::llama::safetensors_files(dir).unwrap();
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).unwrap() };
    let cfg: LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = cfg.into_config(false);
    let mut cache = Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    let model = Llama::load(vb, &cfg).unwrap();
    (0..prompt.len() - 1)
        .map(|pos| {
            let x = Tensor::new(&prompt[pos..=pos], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            // (1, vocab) → (vocab,)
            let logits: Vec<f32> = model
                .forward(&x, pos, &mut cache)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
            logits.iter().map(|&l| l - lse).collect()
        })
        .collect()
}

/// Checks `got` (prompt logprobs of prompt tokens 1.., `k` alternatives each) against the
/// reference's rows.
fn check_prompt_logprobs(
    got: &[pd_engine::TokenLogprob],
    prompt: &[u32],
    rows: &[Vec<f32>],
    k: usize,
) {
    assert_eq!(
        got.len(),
        prompt.len() - 1,
        "one per prompt token after the first"
    );
    for (p, (lp, row)) in got.iter().zip(rows).enumerate() {
        let token = prompt[p + 1];
        assert_eq!(lp.token_id, token, "position {}", p + 1);
        assert!(
            (lp.logprob - row[token as usize]).abs() < 1e-3,
            "position {}: {} vs the reference's {}",
            p + 1,
            lp.logprob,
            row[token as usize]
        );
        assert_eq!(lp.top.len(), k);
        for &(id, l) in &lp.top {
            assert!((l - row[id as usize]).abs() < 1e-3, "top {id} at {}", p + 1);
        }
        // The alternatives are the most likely tokens: none outside them beats the last.
        if let Some(&(_, last)) = lp.top.last() {
            let better = row.iter().filter(|&&l| l > last + 1e-3).count();
            assert!(
                better < k,
                "position {}: {better} tokens beat the top {k}",
                p + 1
            );
        }
    }
}

#[tokio::test]
async fn prompt_logprobs_score_every_prompt_token_as_a_plain_forward_pass_does() {
    let dir = model_dir("prompt-logprobs");
    // A 7-token step budget: the 37-token prompt is computed in chunks beside another request.
    let h = engine(&dir, |c| c.max_num_batched_tokens = 7);
    let p = prompt(37, 21);
    let rows = reference_prompt_logprobs(&dir, &p);
    let params = SamplingParams {
        prompt_logprobs: Some(3),
        ..greedy(6)
    };
    let other = prompt(19, 22);
    let (got, beside) = tokio::join!(
        run(&h, p.clone(), params.clone()),
        run(&h, other.clone(), greedy(6))
    );
    check_prompt_logprobs(&got.prompt_logprobs, &p, &rows, 3);
    assert_eq!(
        got.tokens[0],
        reference_greedy(&dir, &p, 6),
        "decoding is unchanged"
    );
    assert_eq!(beside.tokens[0], reference_greedy(&dir, &other, 6));
    assert!(beside.prompt_logprobs.is_empty(), "only who asks gets them");

    // The prompt's blocks are in the prefix cache now; a request for its prompt logprobs
    // computes it again (a cached position has no logits), and gets the same answer.
    let again = run(&h, p.clone(), params.clone()).await;
    assert_eq!(again.cached_tokens, 0);
    check_prompt_logprobs(&again.prompt_logprobs, &p, &rows, 3);
    let cached = run(&h, p.clone(), greedy(6)).await;
    assert_eq!(
        cached.cached_tokens, 36,
        "without them the cache serves the prompt"
    );

    // n children share the one prompt computation; the logprobs come once.
    let forked = run(
        &h,
        p.clone(),
        SamplingParams {
            n: 3,
            ..params.clone()
        },
    )
    .await;
    check_prompt_logprobs(&forked.prompt_logprobs, &p, &rows, 3);
    assert!(forked.tokens.iter().all(|t| *t == got.tokens[0]));

    // No alternatives asked: the token's own logprob only. A one-token prompt has none.
    let plain = run(
        &h,
        p.clone(),
        SamplingParams {
            prompt_logprobs: Some(0),
            ..greedy(2)
        },
    )
    .await;
    check_prompt_logprobs(&plain.prompt_logprobs, &p, &rows, 0);
    let one = run(
        &h,
        vec![5],
        SamplingParams {
            prompt_logprobs: Some(2),
            ..greedy(2)
        },
    )
    .await;
    assert!(one.prompt_logprobs.is_empty());
    assert_eq!(one.tokens[0], reference_greedy(&dir, &[5], 2));

    // They are this node's to compute: no P/D.
    for kv in [KvTransfer::Produce { consumers: 1 }, KvTransfer::Consume] {
        let e = h
            .submit(GenerateRequest {
                prompt_tokens: p.clone(),
                params: params.clone(),
                kv,
                cache_salt: None,
                gateway: None,
            })
            .expect_err("refused");
        assert!(e.to_string().contains("prompt logprobs"), "{e}");
    }
    let too_many = h.submit(GenerateRequest {
        prompt_tokens: p.clone(),
        params: SamplingParams {
            prompt_logprobs: Some(21),
            ..greedy(2)
        },
        kv: KvTransfer::Local,
        cache_salt: None,
        gateway: None,
    });
    assert!(too_many.is_err());
    wait_all_free(&h).await;
}
