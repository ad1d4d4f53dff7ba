//! Shared helpers: a generated model, the reference (candle-transformers' stock Llama), an
//! engine on it, and running a request to its end.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use pd_engine::{
    Engine, EngineConfig, EngineHandle, FinishReason, GenerateRequest, KvTransfer, RequestEvent,
    SamplingParams,
};
use pd_model::tiny::{TinySpec, generate};

pub fn model_dir(name: &str) -> PathBuf {
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
pub fn reference_greedy(dir: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    reference_greedy_masked(dir, prompt, n, |_, _| false)
}

/// [`reference_greedy`] with each row of logits first passed to `mask` (which may set
/// logits to −∞) along with the tokens so far; stops early when `mask` says the output ended.
pub fn reference_greedy_masked(
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

pub fn engine(dir: &Path, f: impl FnOnce(&mut EngineConfig)) -> EngineHandle {
    let mut cfg = EngineConfig {
        model_dir: dir.to_path_buf(),
        block_size: 4,
        num_blocks: Some(256),
        ..Default::default()
    };
    f(&mut cfg);
    EngineHandle::spawn(Engine::load(&cfg).unwrap()).unwrap()
}

pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 31 + salt * 17 + 3) % 256)
        .collect()
}

#[derive(Debug, Default)]
pub struct Outcome {
    /// Tokens per child.
    pub tokens: Vec<Vec<u32>>,
    pub reasons: Vec<Option<FinishReason>>,
    /// Text per child.
    pub texts: Vec<String>,
    pub cached_tokens: usize,
    /// `prompt_logprobs`: the logprob of prompt tokens 1.. as the events gave them.
    pub prompt_logprobs: Vec<pd_engine::TokenLogprob>,
}

pub async fn run(
    handle: &EngineHandle,
    prompt_tokens: Vec<u32>,
    params: SamplingParams,
) -> Outcome {
    let n = params.n;
    let mut s = handle
        .submit(GenerateRequest {
            prompt_tokens,
            params,
            kv: Default::default(),
            cache_salt: None,
            gateway: None,
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

pub async fn wait_all_free(handle: &EngineHandle) {
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

/// Waits until `cond` holds, failing after 10 s.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Submits a consumer request and returns its stream and the reservation its `AwaitingKv`
/// event handed out.
pub async fn consume(
    h: &EngineHandle,
    p: Vec<u32>,
    params: SamplingParams,
) -> (pd_engine::RequestStream, pd_engine::KvReservation) {
    let mut s = h
        .submit(GenerateRequest {
            prompt_tokens: p,
            params,
            kv: KvTransfer::Consume,
            cache_salt: None,
            gateway: None,
        })
        .unwrap();
    match s.recv().await {
        Some(RequestEvent::AwaitingKv(reservation)) => {
            assert_eq!(reservation.id(), s.id());
            (s, reservation)
        }
        other => panic!("expected AwaitingKv, got {other:?}"),
    }
}
