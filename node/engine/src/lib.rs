//! The engine of one node: it owns the model, the KV block pool and the scheduler, runs them on a
//! dedicated thread, and turns [`GenerateRequest`]s into streams of [`RequestEvent`]s.
//!
//! Brief overview:
//! - [`EngineHandle`] is what the HTTP layer holds: `submit` a request, read its
//!   [`RequestStream`], drop it to abort.
//! - `engine` runs one step at a time: schedule, one batched forward pass, sample, emit events.
//!   `engine/mod.rs`: the [`Engine`] type, its command loop and request checks;
//!   `config.rs`: [`EngineConfig`]; `load.rs`: [`Engine::load`]; `step.rs`: the step pipeline
//!   (plan, batch, forward, commit, prompt logprobs, sample); `emit.rs`: one token out of a
//!   child in named steps (pick, grammar, detokenize, stops and hold-back, length, finish);
//!   `hand_off.rs`: leases the engine grants (a prefill's prompt, a retained turn).
//! - `scheduler` decides which sequences run each step (continuous batching, chunked prefill,
//!   preemption by recompute) and owns every block reference; `scheduler/remote.rs`: sequences
//!   parked while their KV comes from another node.
//! - `lease_book` holds the leases a prefill node grants on its blocks for decode nodes.
//! - `sampler` turns a row of logits into a token (greedy, temperature, top-k, top-p, seed);
//!   `sampler::pick` is the one way a token is picked: structured output masks the row first
//!   (`pd_grammar`: one matcher per child), for an emitted token and for a prefill's attested
//!   first token alike.
//!
//! This crate does not speak HTTP, parse JSON or know the OpenAI API; it never touches the pool's
//! memory except through `pd_model` (forward pass) and `pd_kv_pool` (block bookkeeping).
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]
#![deny(unused_must_use)]

mod engine;
mod error;
mod handle;
mod lease_book;
mod metrics;
mod request;
mod reservation;
mod sampler;
mod scheduler;
mod sequence;

pub use engine::{Engine, EngineConfig, KvCompute, ModelDtype, PoolMemory};
pub use error::EngineError;
pub use handle::{CacheSubscription, EngineHandle, EngineInfo, RequestStream};
pub use lease_book::{LeaseBook, LeaseStats};
pub use metrics::EngineMetrics;
pub use request::{
    FinishReason, GenerateRequest, InvalidRequest, KvHandoff, KvTransfer, MAX_LOGIT_BIAS,
    MAX_LOGPROBS, MAX_N, MAX_STOP, MAX_STOP_LEN, MAX_STOP_TOKEN_IDS, RemoteKv, RequestEvent,
    RequestId, SamplingParams, StructuredOutput, TokenLogprob,
};
pub use reservation::KvReservation;
pub use sampler::first_token_key;
