//! The decode side of P/D: waiting for remote KV without blocking others, recompute, reusing
//! the local prefix, and emitting the producer's first token without computing.

use crate::common::*;
use pd_engine::{FinishReason, RemoteKv, RequestEvent, SamplingParams, first_token_key};

#[tokio::test]
async fn consumer_waits_without_blocking_others_and_recompute_is_exact() {
    let dir = model_dir("consume");
    let h = engine(&dir, |_| {});
    let p = prompt(11, 5);
    let (mut s, r) = consume(&h, p.clone(), SamplingParams { n: 2, ..greedy(6) }).await;
    assert_eq!(
        (r.blocks().len(), r.first_block(), r.cached_tokens()),
        (3, 0, 0)
    );
    // While it waits, another request runs to completion.
    let other = run(&h, prompt(6, 9), greedy(4)).await;
    assert_eq!(other.tokens[0], reference_greedy(&dir, &prompt(6, 9), 4));
    h.remote_kv_ready(r, RemoteKv::Recompute);
    let mut tokens = vec![Vec::new(); 2];
    let mut started = None;
    while let Some(e) = s.recv().await {
        match e {
            RequestEvent::Started {
                cached_tokens,
                pulled_tokens,
                ..
            } => started = Some((cached_tokens, pulled_tokens)),
            RequestEvent::Token {
                child, token_id, ..
            } => tokens[child].push(token_id),
            RequestEvent::Failed { message } => panic!("{message}"),
            _ => {}
        }
    }
    assert_eq!(started, Some((0, 0)));
    let want = reference_greedy(&dir, &p, 6);
    assert_eq!(tokens, vec![want.clone(), want]);
    wait_all_free(&h).await;
}

#[tokio::test]
async fn consumer_reuses_its_local_prefix_and_asks_only_for_the_rest() {
    let dir = model_dir("consume-prefix");
    let h = engine(&dir, |_| {});
    let p = prompt(14, 2);
    run(&h, p[..9].to_vec(), greedy(1)).await; // caches blocks 0 and 1 (8 tokens)
    let (s, r) = consume(&h, p, greedy(3)).await;
    assert_eq!(
        (r.blocks().len(), r.first_block(), r.cached_tokens()),
        (2, 2, 8)
    );
    // A client that goes away while the pull is pending frees everything.
    drop(s);
    wait_all_free(&h).await;
}

/// A consumer given the producer's first token with the whole prompt's KV emits it at once
/// when it samples once (greedy or not) without logprobs; otherwise it computes the last
/// prompt position as before and the given token plays no part.
#[tokio::test]
async fn a_consumer_emits_the_producers_first_token_without_computing() {
    let dir = model_dir("first-token-consume");
    let h = engine(&dir, |_| {});
    // One prompt per case (the pulled blocks of one enter the prefix cache), and for each a
    // token the model would not pick: seeing it proves it was taken as given.
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(10, 8 + i)).collect();
    let given: Vec<u32> = prompts
        .iter()
        .map(|p| (reference_greedy(&dir, p, 1)[0] + 1) % 256)
        .collect();
    let stop_on_it = SamplingParams {
        stop_token_ids: vec![given[1]],
        ignore_eos: false,
        ..greedy(5)
    };
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: Some(1),
        ..greedy(1)
    };
    let with_logprobs = SamplingParams {
        logprobs: Some(2),
        ..greedy(1)
    };
    let two = SamplingParams { n: 2, ..greedy(1) };
    // The producer's token was sampled with another seed (a child the proxy gave its own).
    let other_seed = SamplingParams {
        seed: Some(2),
        ..sampled.clone()
    };
    // (params, the producer's key, pulled tokens reported, whether the given token is
    // emitted, finish reason)
    let cases = [
        (greedy(1), 0, 10, true, FinishReason::Length),
        (stop_on_it, 0, 10, true, FinishReason::Stop),
        (
            sampled.clone(),
            first_token_key(&sampled),
            10,
            true,
            FinishReason::Length,
        ),
        (
            other_seed,
            first_token_key(&sampled),
            9,
            false,
            FinishReason::Length,
        ),
        (sampled.clone(), 0, 9, false, FinishReason::Length),
        (with_logprobs, 0, 9, false, FinishReason::Length),
        (two, 0, 9, false, FinishReason::Length),
        // A biased greedy pick is not the plain argmax a producer without the bias took.
        (
            SamplingParams {
                logit_bias: vec![(5, 1.5)],
                ..greedy(1)
            },
            0,
            9,
            false,
            FinishReason::Length,
        ),
    ];
    for (i, (params, key, want_pulled, emitted, want_reason)) in cases.into_iter().enumerate() {
        let (p, given) = (&prompts[i], given[i]);
        let what = format!("{params:?}, key {key}");
        let (mut s, r) = consume(&h, p.clone(), params).await;
        assert_eq!(
            (r.blocks().len(), r.first_block(), r.cached_tokens()),
            (3, 0, 0)
        );
        h.remote_kv_ready(
            r,
            RemoteKv::PulledWithFirstToken {
                tokens: p.len(),
                first_token: given,
                key,
            },
        );
        let (mut pulled, mut firsts, mut reasons) = (None, Vec::new(), Vec::new());
        while let Some(e) = s.recv().await {
            match e {
                RequestEvent::Started { pulled_tokens, .. } => pulled = Some(pulled_tokens),
                RequestEvent::Token { token_id, .. } => firsts.push(token_id),
                RequestEvent::Finished { reason, .. } => reasons.push(reason),
                RequestEvent::Failed { message } => panic!("{what}: {message}"),
                _ => {}
            }
        }
        assert_eq!(pulled, Some(want_pulled), "{what}");
        assert!(
            reasons.iter().all(|r| *r == want_reason),
            "{what}: {reasons:?}"
        );
        if emitted {
            assert_eq!(firsts, vec![given], "{what}");
        } else {
            assert!(!firsts.is_empty(), "{what}");
        }
        wait_all_free(&h).await;
    }
}
