//! A request's life at the edges: aborting frees its blocks, invalid requests are refused
//! naming the parameter, shutdown fails live requests and refuses new ones.

use crate::common::*;
use std::time::{Duration, Instant};

use pd_engine::{GenerateRequest, RequestEvent, SamplingParams};

#[tokio::test]
async fn dropping_streams_aborts_and_frees_blocks() {
    let dir = model_dir("abort");
    let h = engine(&dir, |_| {});
    let mut streams = Vec::new();
    for i in 0..3 {
        let mut s = h
            .submit(GenerateRequest {
                prompt_tokens: prompt(30, i),
                params: greedy(900),
                kv: Default::default(),
                cache_salt: None,
                gateway: None,
            })
            .unwrap();
        // Wait for a first token so the request holds blocks.
        loop {
            if let Some(RequestEvent::Token { .. }) = s.recv().await {
                break;
            }
        }
        streams.push(s);
    }
    assert!(h.free_blocks() < h.info().num_blocks);
    drop(streams);
    wait_all_free(&h).await;
}

#[tokio::test]
async fn invalid_requests_are_refused_with_the_param_named() {
    let dir = model_dir("invalid");
    let h = engine(&dir, |c| c.max_model_len = Some(64));
    let submit = |p: Vec<u32>, params: SamplingParams| match h.submit(GenerateRequest {
        prompt_tokens: p,
        params,
        kv: Default::default(),
        cache_salt: None,
        gateway: None,
    }) {
        Err(pd_engine::EngineError::Invalid(e)) => e.param,
        other => panic!("expected invalid, got {other:?}"),
    };
    assert_eq!(submit(prompt(64, 0), greedy(1)), Some("prompt"));
    assert_eq!(submit(prompt(60, 0), greedy(10)), Some("max_tokens"));
    assert_eq!(submit(vec![], greedy(1)), Some("prompt"));
    assert_eq!(submit(vec![100_000], greedy(1)), Some("prompt"));
    assert_eq!(
        submit(prompt(4, 0), SamplingParams { n: 0, ..greedy(1) }),
        Some("n")
    );
    assert_eq!(
        submit(
            prompt(4, 0),
            SamplingParams {
                temperature: -1.0,
                ..greedy(1)
            }
        ),
        Some("temperature")
    );
    // Bounds on what a request makes the engine check on every piece of text.
    let stops = |stop: Vec<String>| SamplingParams { stop, ..greedy(1) };
    assert_eq!(
        submit(prompt(4, 0), stops(vec!["x".into(); 33])),
        Some("stop")
    );
    assert_eq!(
        submit(prompt(4, 0), stops(vec!["y".repeat(513)])),
        Some("stop")
    );
    assert_eq!(
        submit(
            prompt(4, 0),
            SamplingParams {
                stop_token_ids: vec![1; 1025],
                ..greedy(1)
            }
        ),
        Some("stop_token_ids")
    );
    // At the bounds: accepted.
    let ok = h.submit(GenerateRequest {
        prompt_tokens: prompt(4, 0),
        params: stops(vec!["y".repeat(512); 32]),
        kv: Default::default(),
        cache_salt: None,
        gateway: None,
    });
    assert!(ok.is_ok(), "{ok:?}");
}

#[tokio::test]
async fn shutdown_fails_live_requests_and_refuses_new_ones() {
    let dir = model_dir("shutdown");
    let h = engine(&dir, |_| {});
    let mut s = h
        .submit(GenerateRequest {
            prompt_tokens: prompt(8, 1),
            params: greedy(900),
            kv: Default::default(),
            cache_salt: None,
            gateway: None,
        })
        .unwrap();
    h.shutdown();
    let mut failed = false;
    while let Some(e) = s.recv().await {
        if let RequestEvent::Failed { message } = e {
            assert!(message.contains("shut down"), "{message}");
            failed = true;
        }
    }
    assert!(failed, "a live request must be told the engine stopped");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match h.submit(GenerateRequest {
            prompt_tokens: prompt(8, 1),
            params: greedy(4),
            kv: Default::default(),
            cache_salt: None,
            gateway: None,
        }) {
            Err(pd_engine::EngineError::Shutdown) => break,
            Ok(_) => assert!(Instant::now() < deadline, "engine did not shut down"),
            Err(e) => panic!("unexpected {e}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
