//! The engine's thread and the async handle callers use to reach it.
//!
//! The engine (model, pool, scheduler) lives on one dedicated OS thread: forward passes are
//! CPU-bound and must never run on the async reactor. Callers talk to it over a channel of
//! [`Command`]s and get each request's events back over their own unbounded channel.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use pd_kv_pool::{CacheEvent, LeaseError, LeaseId};
use tokio::sync::{broadcast, mpsc as tokio_mpsc, oneshot};

use crate::engine::Engine;
use crate::error::EngineError;
use crate::lease_book::{LeaseBook, LeaseStats};
use crate::metrics::EngineMetrics;
use crate::request::{GenerateRequest, RemoteKv, RequestEvent, RequestId};

/// The prefix cache now and its changes from then on ([`EngineHandle::subscribe_cache`]).
#[derive(Debug)]
pub struct CacheSubscription {
    /// Every block hash cached when the subscription started.
    pub cached: Vec<pd_kv_pool::BlockHash>,
    /// Later changes, in order. A receiver that falls behind gets `Lagged` and should resubscribe
    /// (the engine never waits for it).
    pub events: broadcast::Receiver<CacheEvent>,
}

/// What the engine thread can be asked to do.
#[derive(Debug)]
pub(crate) enum Command {
    /// Admit a request; its events go to `events`. (Boxed: a request is far larger than the
    /// other commands.)
    Add {
        id: RequestId,
        request: Box<GenerateRequest>,
        /// The request's structured output, compiled by the caller (off the engine thread).
        grammar: Option<Box<pd_grammar::TokenMatcher>>,
        arrival: Instant,
        events: tokio_mpsc::UnboundedSender<RequestEvent>,
    },
    /// Drop a request and free its blocks (client gone).
    Abort(RequestId),
    /// The wait of a [`crate::KvTransfer::Consume`] request for remote KV ended; with `true`,
    /// the pull already put the pulled blocks in the compute pool
    /// ([`crate::KvReservation::upload`]).
    RemoteKv(RequestId, RemoteKv, bool),
    /// Something changed outside the engine (a lease was released): run a loop turn.
    Wake,
    /// Start receiving prefix-cache events; the reply carries every hash cached now, taken on
    /// the engine thread together with the subscription so no event falls between them.
    SubscribeCache(oneshot::Sender<CacheSubscription>),
    /// Stop the thread after failing every live request.
    Shutdown,
}

/// Static facts about the served model and pool, fixed at start.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// Name clients use in the `model` field.
    pub model_name: String,
    /// Longest prompt + completion, in tokens.
    pub max_model_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Vocabulary size of the model.
    pub vocab_size: usize,
    /// Layout of the KV pool (what peers need to read it).
    pub kv_layout: pd_kv_pool::KvLayout,
    /// Fingerprint of the weights and tokenizer ([`pd_model::ModelSource::fingerprint`]): peers
    /// must match it to exchange KV.
    pub fingerprint: String,
    /// Blocks that leases for decode nodes may hold at once
    /// ([`crate::EngineConfig::kv_max_leased_fraction`] of the pool).
    pub max_leased_blocks: usize,
    /// How computed KV reaches the transfer pool: `in-place`, or the compute pool's
    /// [`pd_model::StagedKv::path`] (`host-staged`, `cuda-host-staged`).
    pub kv_path: &'static str,
    /// The key binding leased KV to its prompt ([`crate::EngineConfig::binding_key`]): a
    /// producer binds its leases with it, a consumer checks params and leases with it.
    pub binding_key: pd_kv_pool::BindingKey,
}

/// Cheap, cloneable handle to a running engine thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    commands: mpsc::Sender<Command>,
    info: EngineInfo,
    tokenizer: Arc<pd_tokenize::Tokenizer>,
    metrics: EngineMetrics,
    leases: Arc<LeaseBook>,
    /// The vocabulary structured outputs compile against, or why there is none.
    vocabulary: Result<Arc<pd_grammar::Vocabulary>, pd_grammar::GrammarError>,
    next_id: AtomicU64,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}

impl EngineHandle {
    /// Moves `engine` onto its own thread and returns a handle to it.
    pub fn spawn(engine: Engine) -> std::io::Result<Self> {
        let (commands, rx) = mpsc::channel();
        let info = engine.info().clone();
        let tokenizer = engine.tokenizer().clone();
        let metrics = engine.metrics().clone();
        let leases = engine.leases().clone();
        let vocabulary = engine.vocabulary().clone();
        let thread = std::thread::Builder::new()
            .name("pd-engine".into())
            .spawn(move || engine.run(rx))?;
        Ok(Self {
            inner: Arc::new(Inner {
                commands,
                info,
                tokenizer,
                metrics,
                leases,
                vocabulary,
                next_id: AtomicU64::new(1),
                thread: std::sync::Mutex::new(Some(thread)),
            }),
        })
    }

    /// The served model and pool.
    pub fn info(&self) -> &EngineInfo {
        &self.inner.info
    }

    /// The model's tokenizer and chat template.
    pub fn tokenizer(&self) -> &Arc<pd_tokenize::Tokenizer> {
        &self.inner.tokenizer
    }

    /// The engine's metrics (also readable while it runs).
    pub fn metrics(&self) -> &EngineMetrics {
        &self.inner.metrics
    }

    /// Blocks currently not referenced by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.inner.metrics.kv_blocks_free.get().max(0) as usize
    }

    /// The leases this node granted (as a prefill node): renew and confirm through it.
    pub fn leases(&self) -> &LeaseBook {
        &self.inner.leases
    }

    /// Live leases and counters.
    pub fn lease_stats(&self) -> LeaseStats {
        self.inner.leases.stats()
    }

    /// A peer is done with a lease: ends it and has the engine drop its block references.
    ///
    /// # Errors
    /// [`LeaseError`] when it was not live.
    pub fn release_lease(
        &self,
        id: LeaseId,
        generation: u64,
        peer: &str,
    ) -> Result<(), LeaseError> {
        self.inner.leases.release(id, generation, peer)?;
        let _ = self.inner.commands.send(Command::Wake);
        Ok(())
    }

    /// Gateway `gateway_id` left (its registry stream ended): releases the live leases granted
    /// for requests that came through it, through the same path as a reader's release, and
    /// returns how many. Retained turns, untagged leases and other gateways' stay.
    pub fn release_gateway_leases(&self, gateway_id: &str) -> usize {
        let n = self
            .inner
            .leases
            .release_gateway(gateway_id, Instant::now());
        if n > 0 {
            let _ = self.inner.commands.send(Command::Wake);
        }
        n
    }

    /// Gives back the reservation of a request submitted with [`crate::KvTransfer::Consume`]
    /// (its [`RequestEvent::AwaitingKv`]), ending its wait for the prompt's KV: what arrived
    /// in the reservation's blocks, or that it must be computed here.
    pub fn remote_kv_ready(&self, reservation: crate::KvReservation, outcome: RemoteKv) {
        let _ = self
            .inner
            .commands
            .send(Command::RemoteKv(reservation.id, outcome, false));
    }

    /// [`EngineHandle::remote_kv_ready`] after a pull that uploaded every block it pulled into
    /// the compute pool itself, through the reservation's [`crate::KvReservation::upload`]
    /// (settled): the engine copies nothing more.
    pub fn remote_kv_landed(&self, reservation: crate::KvReservation, outcome: RemoteKv) {
        let _ = self
            .inner
            .commands
            .send(Command::RemoteKv(reservation.id, outcome, true));
    }

    /// The prefix cache's hashes now, and its changes from then on.
    ///
    /// # Errors
    /// [`EngineError::Shutdown`] when the engine thread is gone.
    pub async fn subscribe_cache(&self) -> Result<CacheSubscription, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.inner
            .commands
            .send(Command::SubscribeCache(reply))
            .map_err(|_| EngineError::Shutdown)?;
        rx.await.map_err(|_| EngineError::Shutdown)
    }

    /// Stops the engine thread: every live request gets [`RequestEvent::Failed`], and later
    /// [`EngineHandle::submit`] calls fail with [`EngineError::Shutdown`].
    pub fn shutdown(&self) {
        let _ = self.inner.commands.send(Command::Shutdown);
    }

    /// Compiles a request's structured output against the model's vocabulary, on the caller's
    /// thread: a schema's compile never holds up the engine's steps. It is bounded by
    /// llguidance's limits but may take tens of milliseconds for a large schema, so an async
    /// caller runs it on a blocking pool and hands the result to
    /// [`EngineHandle::submit_compiled`].
    ///
    /// # Errors
    /// [`EngineError::Invalid`] naming `structured.field` when the constraint does not compile
    /// or the model's tokenizer has no vocabulary for it.
    pub fn compile(
        &self,
        structured: &crate::StructuredOutput,
    ) -> Result<pd_grammar::TokenMatcher, EngineError> {
        let vocabulary = self.inner.vocabulary.as_ref().map_err(|e| {
            EngineError::Invalid(crate::InvalidRequest::new(structured.field, e.to_string()))
        })?;
        vocabulary.compile(&structured.spec).map_err(|e| {
            EngineError::Invalid(crate::InvalidRequest::new(
                structured.field,
                format!("{}: {e}", structured.field),
            ))
        })
    }

    /// Validates `request` against the model and queues it. The returned stream yields its
    /// events; dropping the stream before it ends aborts the request and frees its blocks.
    ///
    /// # Errors
    /// [`EngineError::Invalid`] when a parameter is out of range or the prompt does not fit the
    /// context; [`EngineError::Shutdown`] when the engine thread is gone.
    pub fn submit(&self, request: GenerateRequest) -> Result<RequestStream, EngineError> {
        crate::engine::validate(&self.inner.info, &request)?;
        let grammar = match &request.params.structured {
            None => None,
            Some(s) => Some(self.compile(s)?),
        };
        self.submit_validated(request, grammar)
    }

    /// Checks `request` as [`EngineHandle::submit`] would, without queueing it (before a
    /// structured output's compile, so a malformed request costs none).
    ///
    /// # Errors
    /// As [`EngineHandle::submit`]'s validation.
    pub fn validate(&self, request: &GenerateRequest) -> Result<(), EngineError> {
        Ok(crate::engine::validate(&self.inner.info, request)?)
    }

    /// [`EngineHandle::submit`] with the request's structured output already compiled
    /// ([`EngineHandle::compile`] of `request.params.structured`).
    ///
    /// # Errors
    /// As [`EngineHandle::submit`]; [`EngineError::Invalid`] naming `structured_outputs` when
    /// a matcher is given without a constraint or a constraint without one.
    pub fn submit_compiled(
        &self,
        request: GenerateRequest,
        grammar: Option<pd_grammar::TokenMatcher>,
    ) -> Result<RequestStream, EngineError> {
        crate::engine::validate(&self.inner.info, &request)?;
        if request.params.structured.is_some() != grammar.is_some() {
            return Err(EngineError::Invalid(crate::InvalidRequest::new(
                "structured_outputs",
                "a structured output and its compiled matcher go together",
            )));
        }
        self.submit_validated(request, grammar)
    }

    fn submit_validated(
        &self,
        request: GenerateRequest,
        grammar: Option<pd_grammar::TokenMatcher>,
    ) -> Result<RequestStream, EngineError> {
        if let crate::KvTransfer::Produce { .. } | crate::KvTransfer::PullThenProduce { .. } =
            request.kv
        {
            // Admission, not reservation: prefills admitted at the same moment may overshoot
            // the cap by their own prompts before their leases show here.
            let info = &self.inner.info;
            let leased = self.inner.leases.stats().leased_blocks;
            let wanted = request.prompt_tokens.len().div_ceil(info.block_size);
            if leased + wanted > info.max_leased_blocks {
                self.inner.metrics.lease_capacity_refusals.inc();
                return Err(EngineError::LeaseCapacity {
                    leased,
                    wanted,
                    cap: info.max_leased_blocks,
                });
            }
        }
        let n = request.params.n;
        let id = RequestId(self.inner.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, rx) = tokio_mpsc::unbounded_channel();
        self.inner
            .commands
            .send(Command::Add {
                id,
                request: Box::new(request),
                grammar: grammar.map(Box::new),
                arrival: Instant::now(),
                events,
            })
            .map_err(|_| EngineError::Shutdown)?;
        Ok(RequestStream {
            id,
            rx,
            commands: self.inner.commands.clone(),
            open_children: n,
        })
    }
}

/// The events of one request. Dropping it before the last child finished aborts the request.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    rx: tokio_mpsc::UnboundedReceiver<RequestEvent>,
    commands: mpsc::Sender<Command>,
    /// Children not yet finished.
    open_children: usize,
}

impl RequestStream {
    /// The engine's id for this request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Next event, or `None` once every child finished (or the engine went away).
    pub async fn recv(&mut self) -> Option<RequestEvent> {
        if self.open_children == 0 {
            return None;
        }
        let event = self.rx.recv().await?;
        match &event {
            RequestEvent::Started { .. } => {}
            RequestEvent::Finished { .. } => {
                self.open_children = self.open_children.saturating_sub(1)
            }
            RequestEvent::Failed { .. } => self.open_children = 0,
            RequestEvent::Token { .. }
            | RequestEvent::PromptLogprobs { .. }
            | RequestEvent::AwaitingKv { .. }
            | RequestEvent::KvReady(_)
            | RequestEvent::Retained(_) => {}
        }
        Some(event)
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.open_children != 0 {
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}
