//! The prefill side of P/D: leases on the prompt's blocks (one per consumer), their release
//! and expiry, none for a client gone; retained turns; the first token attested with a lease.

use crate::common::*;
use std::time::Duration;

use pd_engine::{
    EngineHandle, FinishReason, GenerateRequest, KvTransfer, RequestEvent, SamplingParams,
};

#[tokio::test]
async fn producer_prefills_once_and_leases_the_prompt_blocks_until_released() {
    let dir = model_dir("produce");
    let h = engine(&dir, |_| {});
    let p = prompt(10, 4); // 3 blocks of 4
    let mut s = h
        .submit(GenerateRequest {
            prompt_tokens: p.clone(),
            // max_tokens is ignored: a producer samples one token per child.
            params: SamplingParams { n: 3, ..greedy(50) },
            kv: KvTransfer::Produce { consumers: 1 },
            cache_salt: None,
            gateway: None,
        })
        .unwrap();
    let mut handoffs = Vec::new();
    let mut tokens = vec![Vec::new(); 3];
    let mut reasons = Vec::new();
    while let Some(e) = s.recv().await {
        match e {
            RequestEvent::KvReady(k) => {
                assert!(
                    tokens.iter().all(Vec::is_empty),
                    "handoff comes before tokens"
                );
                handoffs.push(k);
            }
            RequestEvent::Token {
                child, token_id, ..
            } => tokens[child].push(token_id),
            RequestEvent::Finished { reason, .. } => reasons.push(reason),
            _ => {}
        }
    }
    assert_eq!(handoffs.len(), 1, "n=3 hands off once");
    let k = &handoffs[0];
    assert_eq!((k.block_ids.len(), k.num_tokens), (3, 10));
    let first = reference_greedy(&dir, &p, 1);
    assert!(tokens.iter().all(|t| *t == first), "{tokens:?}");
    assert_eq!(reasons, vec![FinishReason::Length; 3]);
    // The request is over; its prompt blocks are still held by the lease.
    eventually("request blocks freed", || {
        h.free_blocks() == h.info().num_blocks - 3
    })
    .await;
    h.leases().renew(k.lease, k.generation, "d").unwrap();
    h.leases().confirm(k.lease, k.generation, "d").unwrap();
    assert!(h.leases().confirm(k.lease, k.generation + 1, "d").is_err());
    h.release_lease(k.lease, k.generation, "d").unwrap();
    wait_all_free(&h).await;
    assert!(h.leases().confirm(k.lease, k.generation, "d").is_err());
    let st = h.lease_stats();
    assert_eq!((st.live, st.counts.granted, st.counts.released), (0, 1, 1));
}

#[tokio::test]
async fn a_producer_for_two_consumers_grants_two_leases_and_keeps_blocks_until_both_end() {
    let dir = model_dir("produce2");
    let h = engine(&dir, |_| {});
    let mut s = h
        .submit(GenerateRequest {
            prompt_tokens: prompt(10, 5), // 3 blocks of 4
            params: greedy(1),
            kv: KvTransfer::Produce { consumers: 2 },
            cache_salt: None,
            gateway: None,
        })
        .unwrap();
    let mut handoffs = Vec::new();
    while let Some(e) = s.recv().await {
        if let RequestEvent::KvReady(k) = e {
            handoffs.push(k);
        }
    }
    assert_eq!(handoffs.len(), 2, "one lease per consumer");
    let (a, b) = (&handoffs[0], &handoffs[1]);
    assert_ne!(a.lease, b.lease);
    assert_eq!(a.block_ids, b.block_ids, "both leases name the same blocks");
    eventually("request blocks freed", || {
        h.free_blocks() == h.info().num_blocks - 3
    })
    .await;
    // Two leases on the same three blocks hold three blocks: what the lease cap counts (a
    // request for 16 consumers must not count 16 times what it holds).
    assert_eq!(h.lease_stats().leased_blocks, 3);
    // One consumer done: the other still reads the blocks, so none is freed.
    h.release_lease(a.lease, a.generation, "d0").unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.free_blocks(), h.info().num_blocks - 3);
    h.leases().confirm(b.lease, b.generation, "d1").unwrap();
    h.release_lease(b.lease, b.generation, "d1").unwrap();
    wait_all_free(&h).await;
    let st = h.lease_stats();
    assert_eq!((st.live, st.counts.granted, st.counts.released), (0, 2, 2));
}

#[tokio::test]
async fn an_unreleased_lease_expires_frees_its_blocks_and_is_counted() {
    let dir = model_dir("expire");
    let h = engine(&dir, |c| c.kv_lease_duration = Duration::from_millis(300));
    let mut s = h
        .submit(GenerateRequest {
            prompt_tokens: prompt(9, 1),
            params: greedy(1),
            kv: KvTransfer::Produce { consumers: 1 },
            cache_salt: None,
            gateway: None,
        })
        .unwrap();
    let mut lease = None;
    while let Some(e) = s.recv().await {
        if let RequestEvent::KvReady(k) = e {
            lease = Some(k);
        }
    }
    let k = lease.expect("a handoff");
    // The idle engine wakes up for the deadline by itself: nothing else is submitted.
    eventually("the lease to expire", || {
        h.lease_stats().counts.expired == 1
    })
    .await;
    assert_eq!(h.lease_stats().live, 0);
    wait_all_free(&h).await;
    assert!(h.leases().renew(k.lease, k.generation, "d").is_err());
}

#[tokio::test]
async fn a_producer_whose_client_leaves_mid_prefill_grants_no_lease() {
    let dir = model_dir("produce-gone");
    // A 400-token prompt at 2 tokens a step: two hundred steps of prefill, so the client is
    // surely gone before the prompt is computed (with ten steps, a test thread descheduled for
    // those few milliseconds left while P still had a client, and a lease was rightly granted).
    let h = engine(&dir, |c| c.max_num_batched_tokens = 2);
    let mut s = h
        .submit(GenerateRequest {
            prompt_tokens: prompt(400, 3),
            params: greedy(1),
            kv: KvTransfer::Produce { consumers: 1 },
            cache_salt: None,
            gateway: None,
        })
        .unwrap();
    assert!(matches!(s.recv().await, Some(RequestEvent::Started { .. })));
    drop(s); // admitted, prefill under way, client gone
    wait_all_free(&h).await;
    // One more request runs through the engine, so the first one was certainly handled.
    run(&h, prompt(5, 1), greedy(1)).await;
    assert_eq!(
        h.lease_stats().counts.granted,
        0,
        "nobody to hand the KV to"
    );
    assert_eq!(h.lease_stats().live, 0);
}

/// Runs a greedy local request to the end: its tokens and the retained turn, if kept.
async fn run_retained(
    h: &EngineHandle,
    prompt_tokens: Vec<u32>,
    max_tokens: usize,
) -> (Vec<u32>, Option<pd_engine::KvHandoff>) {
    let mut s = h
        .submit(GenerateRequest {
            prompt_tokens,
            params: greedy(max_tokens),
            kv: KvTransfer::Local,
            cache_salt: None,
            gateway: None,
        })
        .unwrap();
    let (mut tokens, mut kept) = (Vec::new(), None);
    while let Some(e) = s.recv().await {
        match e {
            RequestEvent::Token { token_id, .. } => tokens.push(token_id),
            RequestEvent::Retained(k) => {
                assert!(kept.is_none(), "one retained turn per completion");
                kept = Some(k);
            }
            RequestEvent::Failed { message } => panic!("request failed: {message}"),
            _ => {}
        }
    }
    (tokens, kept)
}

/// `kv_retain_after_decode`: a finished turn's whole blocks (prompt and generated tokens, the
/// last sampled token has no KV yet) stay under a retained lease bound to those tokens; they do
/// not count against the leases for decode nodes. When the pool runs short, the oldest retained
/// turn is revoked (its confirm fails from then on, counted) before anything is preempted, and
/// the request that needed the blocks is exact.
#[tokio::test]
async fn retained_turns_are_revoked_oldest_first_before_anything_is_preempted() {
    let dir = model_dir("retain");
    // 24 blocks of 4 tokens.
    let h = engine(&dir, |c| {
        c.num_blocks = Some(24);
        c.kv_retain_after_decode = Some(Duration::from_secs(60));
    });
    let mut kept = Vec::new();
    for i in 0..3 {
        let p = prompt(20, 60 + i);
        let (tokens, k) = run_retained(&h, p.clone(), 8).await;
        assert_eq!(tokens, reference_greedy(&dir, &p, 8));
        let k = k.expect("the turn is retained");
        // 20 + 8 tokens, 27 with KV: 6 whole blocks.
        assert_eq!((k.num_tokens, k.block_ids.len()), (24, 6));
        let (_, contents) = h.leases().confirm(k.lease, k.generation, "").unwrap();
        let held: Vec<u32> = p.iter().chain(&tokens).copied().take(24).collect();
        assert_eq!(
            contents,
            pd_kv_pool::LeaseContents::of(&h.info().binding_key, &held).in_blocks(&k.block_ids)
        );
        kept.push(k);
    }
    let st = h.lease_stats();
    assert_eq!(
        (st.retained, st.retained_blocks, st.leased_blocks),
        (3, 18, 0)
    );
    assert_eq!(h.free_blocks(), 6);

    // 40 + 8 tokens need 12 blocks; 6 are free: the oldest turn (6 blocks) goes, nothing else.
    let p = prompt(40, 99);
    let (tokens, _) = run_retained(&h, p.clone(), 8).await;
    assert_eq!(tokens, reference_greedy(&dir, &p, 8));
    assert_eq!(h.metrics().preemptions.get(), 0, "evicted, not preempted");
    assert_eq!(h.lease_stats().counts.revoked, 1);
    assert!(
        h.leases()
            .confirm(kept[0].lease, kept[0].generation, "")
            .is_err()
    );
    for k in &kept[1..] {
        h.leases().confirm(k.lease, k.generation, "").unwrap();
    }
}

/// A single completion's prefill lease names its first token — the one it emitted, greedy or
/// sampled; one with logprobs or `n > 1` names none.
#[tokio::test]
async fn a_producer_attests_its_first_token_with_the_lease() {
    let dir = model_dir("first-token-produce");
    let h = engine(&dir, |_| {});
    let p = prompt(10, 6);
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: Some(3),
        ..greedy(1)
    };
    let unseeded = SamplingParams {
        temperature: 1.5,
        ..greedy(1)
    };
    let with_logprobs = SamplingParams {
        logprobs: Some(2),
        ..greedy(1)
    };
    let two = SamplingParams { n: 2, ..greedy(1) };
    for (params, attested) in [
        (greedy(1), true),
        (sampled, true),
        (unseeded, true),
        (with_logprobs, false),
        (two, false),
    ] {
        let greedy_first = params.temperature == 0.0 && params.n == 1;
        let mut s = h
            .submit(GenerateRequest {
                prompt_tokens: p.clone(),
                params,
                kv: KvTransfer::Produce { consumers: 1 },
                cache_salt: None,
                gateway: None,
            })
            .unwrap();
        let (mut handoff, mut tokens) = (None, Vec::new());
        while let Some(e) = s.recv().await {
            match e {
                RequestEvent::KvReady(k) => handoff = Some(k),
                RequestEvent::Token { token_id, .. } => tokens.push(token_id),
                _ => {}
            }
        }
        let k = handoff.expect("a handoff");
        let (_, contents) = h.leases().confirm(k.lease, k.generation, "d").unwrap();
        assert!(contents.same_contents(
            &pd_kv_pool::LeaseContents::of(&h.info().binding_key, &p).in_blocks(&k.block_ids)
        ));
        if greedy_first {
            assert_eq!(tokens, reference_greedy(&dir, &p, 1));
        }
        if attested {
            // The token the lease names is the one the prefill emitted.
            assert_eq!(tokens.len(), 1);
            assert_eq!(contents.next_token, Some(tokens[0]));
        } else {
            assert_eq!(
                contents.next_token, None,
                "no single first token to hand off"
            );
        }
        h.release_lease(k.lease, k.generation, "d").unwrap();
    }
    wait_all_free(&h).await;
}

/// Leases follow their gateway: releasing gateway `g1`'s leases ends exactly the lease granted
/// for the request tagged `g1` (its blocks go back once the engine turns), and leaves `g2`'s,
/// an untagged one and a retained turn alone.
#[tokio::test]
async fn a_gateway_leaving_releases_only_the_leases_granted_for_it() {
    let dir = model_dir("gateway-left");
    let h = engine(&dir, |c| {
        c.kv_retain_after_decode = Some(Duration::from_secs(60));
    });
    let mut handoffs = Vec::new();
    for (salt, gateway) in [(11, Some("g1")), (12, Some("g2")), (13, None)] {
        let mut s = h
            .submit(GenerateRequest {
                prompt_tokens: prompt(10, salt),
                params: greedy(1),
                kv: KvTransfer::Produce { consumers: 1 },
                cache_salt: None,
                gateway: gateway.map(Into::into),
            })
            .unwrap();
        let mut handoff = None;
        while let Some(e) = s.recv().await {
            if let RequestEvent::KvReady(k) = e {
                handoff = Some(k);
            }
        }
        handoffs.push(handoff.expect("a handoff"));
    }
    // A turn kept on a decode node for its conversation, whichever gateway sent it.
    let mut s = h
        .submit(GenerateRequest {
            prompt_tokens: prompt(10, 14),
            params: greedy(4),
            kv: KvTransfer::Local,
            cache_salt: None,
            gateway: Some("g1".into()),
        })
        .unwrap();
    let mut retained = None;
    while let Some(e) = s.recv().await {
        if let RequestEvent::Retained(k) = e {
            retained = Some(k);
        }
    }
    let retained = retained.expect("a retained turn");
    assert_eq!(h.lease_stats().live, 4);
    eventually("only leases hold blocks", || {
        h.free_blocks() == h.info().num_blocks - 3 * 3 - retained.block_ids.len()
    })
    .await;

    assert_eq!(h.release_gateway_leases("g3"), 0, "nobody's leases");
    assert_eq!(h.release_gateway_leases("g1"), 1);
    eventually("g1's blocks back", || {
        h.free_blocks() == h.info().num_blocks - 2 * 3 - retained.block_ids.len()
    })
    .await;
    assert_eq!(h.release_gateway_leases("g1"), 0, "released once");
    let st = h.lease_stats();
    assert_eq!((st.live, st.gateway_left, st.counts.released), (3, 1, 1));
    let (g1, g2, untagged) = (&handoffs[0], &handoffs[1], &handoffs[2]);
    assert!(h.leases().confirm(g1.lease, g1.generation, "d").is_err());
    for k in [g2, untagged] {
        h.leases().confirm(k.lease, k.generation, "d").unwrap();
    }
    h.leases()
        .confirm(retained.lease, retained.generation, "")
        .unwrap();
    // g1's blocks go back; the others' stay held.
    for k in [g2, untagged] {
        h.release_lease(k.lease, k.generation, "d").unwrap();
    }
    assert!(
        h.leases()
            .confirm(retained.lease, retained.generation, "")
            .is_ok()
    );
    assert_eq!(
        h.release_gateway_leases("g2"),
        0,
        "g2's lease was released by its reader"
    );
}
