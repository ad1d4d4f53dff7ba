//! The engine end to end on a generated model: greedy output must equal a plain, non-paged
//! forward pass (candle-transformers' stock Llama) token for token — alone, in concurrent batches
//! of different lengths, with chunked prefill forced, with prefix-cache hits, under preemption,
//! and for n>1 children. Aborting a request frees its blocks.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use pd_engine::{
    Engine, EngineConfig, EngineHandle, FinishReason, GenerateRequest, KvTransfer, RemoteKv,
    RequestEvent, SamplingParams, StructuredOutput, first_token_key,
};
use pd_grammar::{OutputSpec, TokenMatcher, Vocabulary};
use pd_model::tiny::{TinySpec, generate};

fn model_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pd-engine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    generate(
        &TinySpec {
            seed: 11,
            ..TinySpec::default()
        },
        &d,
    )
    .unwrap();
    d
}

/// Greedy continuation of `prompt` by candle-transformers' Llama (contiguous KV cache).
fn reference_greedy(dir: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    reference_greedy_masked(dir, prompt, n, |_, _| false)
}

/// [`reference_greedy`] with each row of logits first passed to `mask` (which may set
/// logits to −∞) along with the tokens so far; stops early when `mask` says the output ended.
fn reference_greedy_masked(
    dir: &Path,
    prompt: &[u32],
    n: usize,
    mut mask: impl FnMut(&mut [f32], &[u32]) -> bool,
) -> Vec<u32> {
    use candle_transformers::models::llama::{Cache, Llama, LlamaConfig};
    let files = pd_model::llama::safetensors_files(dir).unwrap();
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).unwrap() };
    let cfg: LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = cfg.into_config(false);
    let mut cache = Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    let model = Llama::load(vb, &cfg).unwrap();
    let mut out = Vec::new();
    let mut input = prompt.to_vec();
    let mut pos = 0;
    for _ in 0..n {
        let x = Tensor::new(input.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits: Vec<f32> = model
            .forward(&x, pos, &mut cache)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut logits = logits;
        if mask(&mut logits, &out) {
            break;
        }
        pos += input.len();
        let next = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32;
        out.push(next);
        input = vec![next];
    }
    out
}

fn engine(dir: &Path, f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    let mut cfg = EngineConfig {
        model_dir: dir.to_path_buf(),
        block_size: 4,
        num_blocks: Some(256),
        ..Default::default()
    };
    f(&mut cfg);
    EngineHandle::spawn(Engine::load(&cfg).unwrap()).unwrap()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 31 + salt * 17 + 3) % 256)
        .collect()
}

#[derive(Debug, Default)]
struct Outcome {
    /// Tokens per child.
    tokens: Vec<Vec<u32>>,
    reasons: Vec<Option<FinishReason>>,
    /// Text per child.
    texts: Vec<String>,
    cached_tokens: usize,
    /// `prompt_logprobs`: the logprob of prompt tokens 1.. as the events gave them.
    prompt_logprobs: Vec<pd_engine::TokenLogprob>,
}

async fn run(handle: &EngineHandle, prompt_tokens: Vec<u32>, params: SamplingParams) -> Outcome {
    let n = params.n;
    let mut s = handle
        .submit(GenerateRequest {
            prompt_tokens,
            params,
            kv: Default::default(),
            cache_salt: None,
        })
        .unwrap();
    let mut o = Outcome {
        tokens: vec![Vec::new(); n],
        reasons: vec![None; n],
        texts: vec![String::new(); n],
        cached_tokens: 0,
        prompt_logprobs: Vec::new(),
    };
    while let Some(e) = s.recv().await {
        match e {
            RequestEvent::Started { cached_tokens, .. } => o.cached_tokens = cached_tokens,
            RequestEvent::PromptLogprobs { first, logprobs } => {
                assert!(
                    o.tokens.iter().all(Vec::is_empty),
                    "prompt logprobs after a token"
                );
                assert_eq!(
                    first,
                    o.prompt_logprobs.len() + 1,
                    "contiguous, from token 1"
                );
                o.prompt_logprobs.extend(logprobs);
            }
            RequestEvent::Token {
                child,
                token_id,
                text,
                ..
            } => {
                o.tokens[child].push(token_id);
                o.texts[child].push_str(&text);
            }
            RequestEvent::Finished {
                child,
                reason,
                text,
                ..
            } => {
                o.reasons[child] = Some(reason);
                o.texts[child].push_str(&text);
            }
            RequestEvent::Failed { message } => panic!("request failed: {message}"),
            e @ (RequestEvent::AwaitingKv { .. }
            | RequestEvent::KvReady(_)
            | RequestEvent::Retained(_)) => {
                panic!("a local request got a P/D event: {e:?}")
            }
        }
    }
    o
}

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
    });
    assert!(too_many.is_err());
    wait_all_free(&h).await;
}

async fn wait_all_free(handle: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while handle.free_blocks() != handle.info().num_blocks {
        assert!(
            Instant::now() < deadline,
            "blocks not freed: {} of {}",
            handle.free_blocks(),
            handle.info().num_blocks
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn greedy_single_requests_equal_reference() {
    let dir = model_dir("single");
    let h = engine(&dir, |_| {});
    for (len, salt) in [(1, 0), (5, 1), (16, 2), (37, 3)] {
        let p = prompt(len, salt);
        let got = run(&h, p.clone(), greedy(20)).await;
        assert_eq!(
            got.tokens[0],
            reference_greedy(&dir, &p, 20),
            "prompt of {len} tokens"
        );
        assert_eq!(got.reasons[0], Some(FinishReason::Length));
    }
    wait_all_free(&h).await;
}

#[tokio::test]
async fn concurrent_batch_with_chunked_prefill_equals_reference() {
    let dir = model_dir("batch");
    // A 7-token step budget forces every prompt longer than 7 into chunks, interleaved with
    // other sequences' decode steps.
    let h = engine(&dir, |c| c.max_num_batched_tokens = 7);
    let prompts: Vec<Vec<u32>> = [3, 9, 17, 30, 41]
        .iter()
        .enumerate()
        .map(|(i, &l)| prompt(l, 10 + i as u32))
        .collect();
    let futs = prompts.iter().map(|p| run(&h, p.clone(), greedy(16)));
    let outs = futures::future::join_all(futs).await;
    for (p, o) in prompts.iter().zip(outs) {
        assert_eq!(
            o.tokens[0],
            reference_greedy(&dir, p, 16),
            "prompt of {} tokens",
            p.len()
        );
    }
    wait_all_free(&h).await;
}

#[tokio::test]
async fn prefix_cache_hit_gives_same_tokens() {
    let dir = model_dir("prefix");
    let h = engine(&dir, |_| {});
    let p = prompt(26, 5);
    let first = run(&h, p.clone(), greedy(12)).await;
    let second = run(&h, p.clone(), greedy(12)).await;
    assert_eq!(first.cached_tokens, 0);
    // 26 tokens = 6 full blocks of 4 + 2; all 6 full blocks are reused.
    assert_eq!(second.cached_tokens, 24);
    assert_eq!(first.tokens, second.tokens);
    assert_eq!(second.tokens[0], reference_greedy(&dir, &p, 12));
    // A prompt sharing only the first 10 tokens reuses 2 blocks.
    let mut q = p[..10].to_vec();
    q.extend(prompt(9, 99));
    let third = run(&h, q.clone(), greedy(12)).await;
    assert_eq!(third.cached_tokens, 8);
    assert_eq!(third.tokens[0], reference_greedy(&dir, &q, 12));
    let m = prometheus::TextEncoder::new()
        .encode_to_string(&h.metrics().registry().gather())
        .unwrap();
    assert!(m.contains("pd_node_prefix_cache_hits_total 32"), "{m}");
}

#[tokio::test]
async fn preemption_under_block_pressure_keeps_output_exact() {
    let dir = model_dir("preempt");
    // 24 blocks of 4 = 96 slots; four requests needing ~11 blocks each cannot all fit.
    let h = engine(&dir, |c| c.num_blocks = Some(24));
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(20, 40 + i)).collect();
    let outs =
        futures::future::join_all(prompts.iter().map(|p| run(&h, p.clone(), greedy(24)))).await;
    for (p, o) in prompts.iter().zip(outs) {
        assert_eq!(o.tokens[0], reference_greedy(&dir, p, 24));
    }
    assert!(
        h.metrics().preemptions.get() > 0,
        "the test must actually preempt"
    );
    wait_all_free(&h).await;
}

#[tokio::test]
async fn n_greedy_children_all_equal_reference_and_share_the_prefill() {
    let dir = model_dir("n");
    let h = engine(&dir, |_| {});
    let p = prompt(18, 7);
    let mut params = greedy(10);
    params.n = 4;
    let o = run(&h, p.clone(), params).await;
    let want = reference_greedy(&dir, &p, 10);
    for c in &o.tokens {
        assert_eq!(c, &want);
    }
    // The prompt was prefilled once: 18 prompt tokens counted once, not four times.
    assert_eq!(h.metrics().prompt_tokens.get(), 18);
    wait_all_free(&h).await;
}

#[tokio::test]
async fn seeded_sampling_is_reproducible_and_children_differ() {
    let dir = model_dir("seed");
    let h = engine(&dir, |_| {});
    let p = prompt(9, 3);
    let params = SamplingParams {
        temperature: 1.0,
        n: 3,
        seed: Some(42),
        max_tokens: Some(16),
        ignore_eos: true,
        ..Default::default()
    };
    let a = run(&h, p.clone(), params.clone()).await;
    let b = run(&h, p.clone(), params).await;
    assert_eq!(a.tokens, b.tokens);
    assert!(
        a.tokens[0] != a.tokens[1] || a.tokens[1] != a.tokens[2],
        "children should differ: {:?}",
        a.tokens
    );
    wait_all_free(&h).await;
}

#[tokio::test]
async fn stop_token_and_stop_string() {
    let dir = model_dir("stop");
    let h = engine(&dir, |_| {});
    let p = prompt(12, 8);
    let want = reference_greedy(&dir, &p, 12);
    // Stop at the 5th generated token's id.
    let params = SamplingParams {
        stop_token_ids: vec![want[4]],
        ..greedy(12)
    };
    let o = run(&h, p.clone(), params).await;
    let first = want.iter().position(|&t| t == want[4]).unwrap();
    assert_eq!(o.tokens[0], want[..=first]);
    assert_eq!(o.reasons[0], Some(FinishReason::Stop));

    // Stop string: two characters from the middle of the greedy text; the output is the text
    // before their first occurrence, and the stop string itself is not returned.
    let full = run(&h, p.clone(), greedy(12)).await.texts.remove(0);
    assert_eq!(full, h.tokenizer().decode(&want, true).unwrap());
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    let (start, _) = chars[chars.len() / 2];
    let end = chars.get(chars.len() / 2 + 2).map_or(full.len(), |c| c.0);
    let stop = full[start..end].to_string();
    let o = run(
        &h,
        p.clone(),
        SamplingParams {
            stop: vec![stop.clone()],
            ..greedy(12)
        },
    )
    .await;
    let cut = full.find(&stop).unwrap();
    assert_eq!(o.texts[0], full[..cut], "stop string {stop:?}");
    assert_eq!(o.reasons[0], Some(FinishReason::Stop));
    wait_all_free(&h).await;
}

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
        }) {
            Err(pd_engine::EngineError::Shutdown) => break,
            Ok(_) => assert!(Instant::now() < deadline, "engine did not shut down"),
            Err(e) => panic!("unexpected {e}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn forked_children_with_copy_on_write_under_preemption_stay_exact() {
    // 6 blocks of 4: a 5-token prompt forked into 2 children (sharing a partial block, so the
    // first child to write copies it) next to another request cannot all fit, so sequences are
    // preempted while children share blocks. Output must stay exact. (The exact step ordering
    // where a copy source loses its last sharer is pinned down deterministically by the
    // scheduler unit test `copy_on_write_source_stays_valid_until_copied_...`.)
    // The two requests preempt each other only when the second arrives before the first has
    // finished; on a loaded machine the test thread may stall between them, so the pair is
    // run again (other prompts) until one run preempted. Every run must be exact.
    let dir = model_dir("cow");
    let h = engine(&dir, |c| c.num_blocks = Some(6));
    for attempt in 0..10u32 {
        let a = prompt(5, 61 + 2 * attempt);
        let x = prompt(6, 62 + 2 * attempt);
        let mut pa = greedy(8);
        pa.n = 2;
        let (oa, ox) = futures::join!(run(&h, a.clone(), pa), run(&h, x.clone(), greedy(8)));
        let want_a = reference_greedy(&dir, &a, 8);
        assert_eq!(oa.tokens, vec![want_a.clone(), want_a], "attempt {attempt}");
        assert_eq!(
            ox.tokens[0],
            reference_greedy(&dir, &x, 8),
            "attempt {attempt}"
        );
        wait_all_free(&h).await;
        if h.metrics().preemptions.get() > 0 {
            break;
        }
    }
    assert!(
        h.metrics().preemptions.get() > 0,
        "the test must actually preempt (no run of 10 did)"
    );
}

/// Waits until `cond` holds, failing after 10 s.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

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

/// Submits a consumer request and returns its stream and the `AwaitingKv` event.
async fn consume(
    h: &EngineHandle,
    p: Vec<u32>,
    params: SamplingParams,
) -> (
    pd_engine::RequestStream,
    Vec<pd_kv_pool::BlockId>,
    usize,
    usize,
) {
    let mut s = h
        .submit(GenerateRequest {
            prompt_tokens: p,
            params,
            kv: KvTransfer::Consume,
            cache_salt: None,
        })
        .unwrap();
    match s.recv().await {
        Some(RequestEvent::AwaitingKv {
            blocks,
            first_block,
            cached_tokens,
        }) => (s, blocks, first_block, cached_tokens),
        other => panic!("expected AwaitingKv, got {other:?}"),
    }
}

#[tokio::test]
async fn consumer_waits_without_blocking_others_and_recompute_is_exact() {
    let dir = model_dir("consume");
    let h = engine(&dir, |_| {});
    let p = prompt(11, 5);
    let (mut s, blocks, first, cached) =
        consume(&h, p.clone(), SamplingParams { n: 2, ..greedy(6) }).await;
    assert_eq!((blocks.len(), first, cached), (3, 0, 0));
    // While it waits, another request runs to completion.
    let other = run(&h, prompt(6, 9), greedy(4)).await;
    assert_eq!(other.tokens[0], reference_greedy(&dir, &prompt(6, 9), 4));
    h.remote_kv_ready(s.id(), RemoteKv::Recompute);
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
    let (s, blocks, first, cached) = consume(&h, p, greedy(3)).await;
    assert_eq!((blocks.len(), first, cached), (2, 2, 8));
    // A client that goes away while the pull is pending frees everything.
    drop(s);
    wait_all_free(&h).await;
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

/// Issue 11: forking n children must respect the pool and `max_num_seqs`. Children that cannot
/// get a block for their first step (or a sequence slot) wait in the queue holding the shared
/// prompt blocks, instead of running and being preempted at once (which throws their prompt
/// away). Seeded children equal the same request on a roomy engine, token for token.
#[tokio::test]
async fn forking_many_children_into_a_tight_pool_preempts_none() {
    let dir = model_dir("tight-fork");
    let p = prompt(10, 7);
    let params = SamplingParams {
        n: 8,
        seed: Some(11),
        temperature: 0.8,
        ..greedy(2)
    };
    let roomy = engine(&dir, |_| {});
    let want = run(&roomy, p.clone(), params.clone()).await;
    // 10 prompt tokens = 3 blocks (the last partial); 10 + 2 tokens still fit in 3 blocks. With
    // 7 blocks, 4 are free after the prompt: not enough for 7 copies at once.
    let tight = engine(&dir, |c| {
        c.num_blocks = Some(7);
        c.max_num_seqs = 4;
    });
    let got = run(&tight, p, params).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        tight.metrics().preemptions.get(),
        0,
        "children were preempted instead of waiting"
    );
    wait_all_free(&tight).await;
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
            pd_kv_pool::LeaseContents::of(&held).in_blocks(&k.block_ids)
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
        assert!(contents.same_contents(&pd_kv_pool::LeaseContents::of(&p).in_blocks(&k.block_ids)));
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
        let (mut s, blocks, first, cached) = consume(&h, p.clone(), params).await;
        assert_eq!((blocks.len(), first, cached), (3, 0, 0));
        h.remote_kv_ready(
            s.id(),
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

fn structured(spec: OutputSpec) -> Option<StructuredOutput> {
    Some(StructuredOutput {
        spec,
        field: "response_format",
    })
}

/// A schema whose every output ends within a few dozen bytes.
fn bounded_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
            "tag": {"enum": ["red", "green", "blue"]},
            "name": {"type": "string", "maxLength": 5}
        },
        "required": ["id", "ok", "tag", "name"],
        "additionalProperties": false
    })
}

fn check_bounded(text: &str) {
    let v: serde_json::Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("{text:?} is not an object"));
    assert_eq!(o.len(), 4, "{text}");
    assert!((0..=999).contains(&o["id"].as_i64().expect("id")), "{text}");
    assert!(o["ok"].is_boolean(), "{text}");
    assert!(
        ["red", "green", "blue"].contains(&o["tag"].as_str().expect("tag")),
        "{text}"
    );
    assert!(
        o["name"].as_str().expect("name").chars().count() <= 5,
        "{text}"
    );
}

/// Structured output on the engine: greedy under a JSON schema is the stock model's greedy
/// pick over logits masked by the same matcher, token for token, and ends (reason `stop`) where
/// the JSON value closes; sampled children each follow the schema on their own; preemption
/// (recompute) keeps every child's output and position in the schema; a bad schema is refused
/// naming the field. Structured output never lets the model write outside the constraint.
#[tokio::test]
async fn structured_outputs_follow_their_constraint_token_for_token() {
    let dir = model_dir("structured");
    let h = engine(&dir, |_| {});
    let p = prompt(12, 21);
    let spec = OutputSpec::JsonSchema(bounded_schema());
    let params = SamplingParams {
        structured: structured(spec.clone()),
        ..greedy(120)
    };
    let o = run(&h, p.clone(), params.clone()).await;
    assert_eq!(o.reasons, vec![Some(FinishReason::Stop)]);
    check_bounded(&o.texts[0]);

    // The reference: candle-transformers' Llama, its rows masked by a matcher of our own.
    let tokenizer = std::sync::Arc::new(pd_tokenize::Tokenizer::from_dir(&dir).unwrap());
    let eos = tokenizer.eos_token_ids().to_vec();
    let vocab = Vocabulary::new(tokenizer, &eos).unwrap();
    let mut m: TokenMatcher = vocab.compile(&spec).unwrap();
    let want = reference_greedy_masked(&dir, &p, 120, |row, out| {
        if let Some(&t) = out.last() {
            m.accept(t).unwrap();
            if m.is_complete() {
                return true;
            }
        }
        m.mask(row).unwrap();
        false
    });
    assert_eq!(
        o.tokens[0], want,
        "structured greedy differs from the masked reference"
    );
    // Unconstrained, the same prompt writes something else (the mask did the work).
    let plain = run(&h, p.clone(), greedy(want.len())).await;
    assert_ne!(plain.tokens[0], want);

    // n = 3 sampled children, each valid on its own, and not all the same.
    let sampled = SamplingParams {
        n: 3,
        temperature: 1.0,
        seed: Some(5),
        ..params.clone()
    };
    let o = run(&h, p.clone(), sampled.clone()).await;
    for t in &o.texts {
        check_bounded(t);
    }
    assert!(
        o.texts[0] != o.texts[1] || o.texts[1] != o.texts[2],
        "{:?}",
        o.texts
    );

    // Preempted and recomputed in a pool too small for all at once: every output the same as
    // with room, each child still valid.
    let tight = engine(&dir, |c| c.num_blocks = Some(28));
    let sampled = SamplingParams {
        max_tokens: Some(80),
        ..sampled
    };
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(20, 60 + i)).collect();
    let roomy =
        futures::future::join_all(prompts.iter().map(|p| run(&h, p.clone(), sampled.clone())))
            .await;
    let squeezed = futures::future::join_all(
        prompts
            .iter()
            .map(|p| run(&tight, p.clone(), sampled.clone())),
    )
    .await;
    assert!(
        tight.metrics().preemptions.get() > 0,
        "the test must preempt"
    );
    for (a, b) in roomy.iter().zip(&squeezed) {
        assert_eq!(a.tokens, b.tokens);
        for t in &b.texts {
            check_bounded(t);
        }
    }

    // Other kinds, greedy: a choice and a regex.
    let choice = vec!["alpha".to_string(), "beta".into(), "gamma delta".into()];
    let o = run(
        &h,
        p.clone(),
        SamplingParams {
            structured: structured(OutputSpec::Choice(choice.clone())),
            ..greedy(50)
        },
    )
    .await;
    assert!(choice.contains(&o.texts[0]), "{:?}", o.texts[0]);
    let o = run(
        &h,
        p.clone(),
        SamplingParams {
            structured: structured(OutputSpec::Regex("[A-F]{2}[0-9]{4}".into())),
            ..greedy(50)
        },
    )
    .await;
    let t = o.texts[0].as_bytes();
    assert!(
        t.len() == 6
            && t[..2].iter().all(|c| (b'A'..=b'F').contains(c))
            && t[2..].iter().all(u8::is_ascii_digit),
        "{:?}",
        o.texts[0]
    );

    // A bad constraint is refused before it runs, naming the field it came in.
    match h.submit(GenerateRequest {
        prompt_tokens: p.clone(),
        params: SamplingParams {
            structured: Some(StructuredOutput {
                spec: OutputSpec::Regex("(unclosed".into()),
                field: "structured_outputs",
            }),
            ..greedy(5)
        },
        kv: Default::default(),
        cache_salt: None,
    }) {
        Err(pd_engine::EngineError::Invalid(e)) => {
            assert_eq!(e.param, Some("structured_outputs"), "{e}");
        }
        other => panic!("expected invalid, got {other:?}"),
    }
    // A structured request is picked differently from a plain one: its own first-token key.
    assert_ne!(first_token_key(&params), first_token_key(&greedy(1)));
    assert_ne!(first_token_key(&params), 0);
    wait_all_free(&h).await;
    wait_all_free(&tight).await;
}

/// A first token from the producer that breaks the request's constraint (a faulty or forged
/// producer: the key matched, the token did not) fails the request with the reason and is never
/// emitted; the failure is counted and the blocks come back. A token within it is taken as
/// given, and the rest follows the constraint.
#[tokio::test]
async fn a_given_first_token_outside_the_constraint_fails_the_request_instead_of_emitting_it() {
    let dir = model_dir("structured-given");
    let h = engine(&dir, |_| {});
    let params = SamplingParams {
        structured: structured(OutputSpec::Regex("[0-9]{4}".into())),
        ..greedy(10)
    };
    let key = first_token_key(&params);
    for (i, given, ok) in [(0, b'x', false), (1, b'7', true)] {
        let p = prompt(10, 90 + i);
        let (mut s, _, _, _) = consume(&h, p.clone(), params.clone()).await;
        h.remote_kv_ready(
            s.id(),
            RemoteKv::PulledWithFirstToken {
                tokens: p.len(),
                first_token: u32::from(given),
                key,
            },
        );
        let (mut tokens, mut failed, mut text) = (Vec::new(), None, String::new());
        while let Some(e) = s.recv().await {
            match e {
                RequestEvent::Token {
                    token_id, text: t, ..
                } => {
                    tokens.push(token_id);
                    text.push_str(&t);
                }
                RequestEvent::Finished { text: t, .. } => text.push_str(&t),
                RequestEvent::Failed { message } => failed = Some(message),
                _ => {}
            }
        }
        if ok {
            assert_eq!(failed, None);
            assert_eq!(tokens[0], u32::from(given));
            assert_eq!(text.len(), 4, "{text:?}");
            assert!(
                text.starts_with('7') && text.bytes().all(|b| b.is_ascii_digit()),
                "{text:?}"
            );
        } else {
            assert!(tokens.is_empty(), "{tokens:?}");
            let message = failed.expect("the request fails");
            assert!(message.contains("structured output"), "{message}");
        }
    }
    assert_eq!(h.metrics().structured_failures.get(), 1);
    assert_eq!(h.metrics().structured_requests.get(), 2);
    wait_all_free(&h).await;
}
