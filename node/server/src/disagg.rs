//! Prefill/decode disaggregation as one node plays it: its role, what it advertises as a
//! producer, and the glue between a consumer request and its engine. The pull itself —
//! planning, peers, leases, the reads, the failure policy, the metrics — is
//! [`pd_kv_transfer::Consumer`]'s; this module only hands it what the engine reserved and tells
//! the engine what arrived.
//!
//! The consumer path of one request is a task between the engine's [`RequestStream`] and the
//! HTTP body ([`Events`]):
//! 1. start the pull ([`Consumer::start`]: the lease is kept alive from now on) and wait for
//!    [`RequestEvent::AwaitingKv`] (the engine's [`pd_engine::KvReservation`]; other requests
//!    keep running);
//! 2. pull into the reserved blocks ([`pd_kv_transfer::consumer::Pull::run`]), on a staged
//!    node uploading them into the compute pool as they land, through the reservation's
//!    uploader (`StagedLanding`);
//! 3. give the reservation back with what arrived (or fail the request), then release the
//!    lease (in the background, as the pull is dropped);
//! 4. hand the engine's stream over to the HTTP layer ([`Relay::Handover`]), which reads the
//!    rest of the request's events itself. A client that goes away before that aborts the
//!    request and releases the producer's lease at once; a pull already posted is waited for
//!    first, since its writes land in blocks the engine would otherwise reuse.

use std::sync::Arc;

use pd_engine::{EngineHandle, RemoteKv, RequestEvent, RequestId, RequestStream};
use pd_kv_pool::BlockId;
use pd_kv_transfer::consumer::{Arrived, FirstToken, Outcome, Remote, Reserved};
use pd_kv_transfer::{CompatInfo, Consumer, LandingError, LandingStep, Puller, TransferMetrics};
use tokio::sync::mpsc;

pub use pd_kv_transfer::consumer::{AllowedPeers, PullConfig};

use crate::kv_params::Advert;
use crate::metrics::NodeMetrics;

/// A pull's blocks, uploaded into the engine's staged compute pool as they land (the
/// reservation's [`pd_engine::KvReservation::upload`] through [`pd_kv_transfer::Landing`]): on
/// a GPU node each part's copy to the device runs while the next part is read, and the engine
/// copies nothing after the pull (it hears [`EngineHandle::remote_kv_landed`]).
#[derive(Debug)]
struct StagedLanding(Arc<dyn pd_model::BlockUpload>);

impl pd_kv_transfer::Landing for StagedLanding {
    fn begin(&self) -> Result<(), LandingError> {
        self.0
            .begin()
            .map_err(|e| LandingError::new(LandingStep::Begin, e))
    }

    unsafe fn landed(&self, first: BlockId, bytes: &[u8]) -> Result<(), LandingError> {
        // SAFETY: the same contract (`Landing::landed`): the pull owns the run's blocks in both
        // pools and keeps `bytes` until it settles.
        unsafe { self.0.upload(first, bytes) }
            .map_err(|e| LandingError::new(LandingStep::Landed(first), e))
    }

    fn settle(&self) -> Result<(), LandingError> {
        self.0
            .settle()
            .map_err(|e| LandingError::new(LandingStep::Settle, e))
    }
}

/// A node's part in P/D disaggregation (vLLM's `kv_role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvRole {
    /// No KV transfer: `kv_transfer_params` asking for one is refused.
    #[default]
    Standalone,
    /// Prefill node: serves `do_remote_decode` requests (and, as every role but standalone,
    /// `do_remote_prefill` ones).
    Producer,
    /// Decode node: serves `do_remote_prefill` requests.
    Consumer,
    /// Both (vLLM's deprecated `kv_both`).
    Both,
}

impl KvRole {
    /// Whether `do_remote_decode` requests are served.
    pub fn produces(self) -> bool {
        matches!(self, KvRole::Producer | KvRole::Both)
    }

    /// Whether `do_remote_prefill` requests are served: any role but standalone. A prefill
    /// node pulls a conversation's history back from its holder, so it can also pull a turn
    /// and decode it itself (`whole` on P with a reverse pull).
    pub fn pulls(self) -> bool {
        self != KvRole::Standalone
    }

    /// vLLM's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            KvRole::Standalone => "standalone",
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
            KvRole::Both => "kv_both",
        }
    }
}

/// Everything P/D about one node, shared by the HTTP handlers.
#[derive(Debug)]
pub struct Disagg {
    pub(crate) role: KvRole,
    /// Set when the node has a side channel: how proxies and peers reach it (a prefill's
    /// handoff, a retained turn).
    pub(crate) advert: Option<Advert>,
    /// Set when the node can pull (it has a puller).
    pub(crate) consumer: Option<Arc<Consumer>>,
    pub(crate) metrics: Arc<TransferMetrics>,
    /// The HTTP layer's own counters.
    pub(crate) node_metrics: NodeMetrics,
}

impl Disagg {
    /// A node without KV transfer.
    pub fn standalone() -> Self {
        Self {
            role: KvRole::Standalone,
            advert: None,
            consumer: None,
            metrics: Arc::new(TransferMetrics::new()),
            node_metrics: NodeMetrics::new(),
        }
    }

    /// A node playing `role`, in its incarnation `epoch` (new at every start). A producer needs
    /// `side_channel` (the host, kept current, and port peers reach it at); pulling — a
    /// consumer's, or any node's reverse pull of an earlier turn — needs a `puller` over the
    /// engine's pool.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        role: KvRole,
        engine: &EngineHandle,
        engine_id: &str,
        epoch: u64,
        side_channel: Option<(tokio::sync::watch::Receiver<String>, u16)>,
        puller: Option<Puller>,
        pull: PullConfig,
        metrics: Arc<TransferMetrics>,
    ) -> Self {
        let info = engine.info();
        let advert = side_channel.map(|(host, port)| Advert {
            engine_id: engine_id.to_string(),
            epoch,
            host,
            port,
            block_size: info.block_size,
            turns: None,
        });
        let consumer = puller.map(|puller| {
            let compat = CompatInfo::new(info.model_name.clone(), &info.kv_layout)
                .with_fingerprint(info.fingerprint.clone());
            Arc::new(Consumer::new(
                puller,
                compat,
                info.kv_layout,
                epoch,
                pull,
                info.binding_key.clone(),
                metrics.clone(),
            ))
        });
        Self {
            role,
            advert,
            consumer,
            metrics,
            node_metrics: NodeMetrics::new(),
        }
    }

    /// Reports the turns this node retains to `turns` as well (read by the gateways' reporters):
    /// a node with a side channel, reporting to gateways, retaining turns.
    pub fn with_retained_turns(mut self, turns: Option<Arc<pd_report::RetainedTurns>>) -> Self {
        if let Some(advert) = &mut self.advert {
            advert.turns = turns;
        }
        self
    }

    /// The transfer metrics (for `/metrics`).
    pub fn metrics(&self) -> &TransferMetrics {
        &self.metrics
    }

    /// Brings the transfer metrics' view of the puller up to date (the path to each peer).
    pub(crate) fn observe_puller(&self) {
        if let Some(consumer) = &self.consumer {
            consumer.observe_paths();
        }
    }

    /// Releases the leases of `remotes` in the background (a request that will not pull).
    pub(crate) fn release(&self, remotes: &[Remote]) {
        if let Some(consumer) = &self.consumer {
            consumer.release(remotes);
        }
    }
}

/// A request's events as the HTTP layer reads them, and the span of the request's phase on
/// this node (`prefill`, `decode`, `generate`: none while traces are off), which ends with
/// them. Dropping it aborts the request.
#[derive(Debug)]
pub(crate) struct Events {
    source: Source,
    _phase: tracing::Span,
}

/// Where the events come from: straight from the engine, or from the consumer task while it
/// pulls, then — once the engine has the KV — straight from the engine again (the task hands
/// the stream over: no hop per token).
#[derive(Debug)]
enum Source {
    Engine(RequestStream),
    Relayed(RequestId, mpsc::UnboundedReceiver<Relay>),
    /// Handed over by the consumer task; its first token (or whatever ends the request instead)
    /// is timed as D's `first_token` stage.
    Handed(RequestStream, Option<FirstToken>),
}

/// What the consumer task sends the HTTP layer.
#[derive(Debug)]
pub(crate) enum Relay {
    /// An event (a failure before the engine took over).
    Event(RequestEvent),
    /// The engine has the KV: read the request's events from its stream from now on.
    Handover(RequestStream, FirstToken),
}

impl Events {
    /// Straight from the engine, timed as `phase`.
    pub(crate) fn engine(stream: RequestStream, phase: tracing::Span) -> Self {
        Self {
            source: Source::Engine(stream),
            _phase: phase,
        }
    }

    pub(crate) fn id(&self) -> RequestId {
        match &self.source {
            Source::Engine(s) | Source::Handed(s, _) => s.id(),
            Source::Relayed(id, _) => *id,
        }
    }

    /// Next event; `None` when the request ended.
    pub(crate) async fn recv(&mut self) -> Option<RequestEvent> {
        self.source.recv().await
    }
}

impl Source {
    async fn recv(&mut self) -> Option<RequestEvent> {
        loop {
            let handed = match self {
                Source::Engine(s) => return s.recv().await,
                Source::Handed(s, first) => {
                    let e = s.recv().await;
                    if !matches!(e, Some(RequestEvent::Started { .. }))
                        && let Some(f) = first.take()
                    {
                        f.record();
                    }
                    return e;
                }
                Source::Relayed(_, rx) => match rx.recv().await {
                    Some(Relay::Event(e)) => return Some(e),
                    Some(Relay::Handover(stream, first)) => Source::Handed(stream, Some(first)),
                    None => return None,
                },
            };
            *self = handed;
        }
    }
}

/// Runs a consumer request: returns the events the HTTP layer reads while a task pulls the KV.
/// `remotes[0]` drives the pull; every distinct lease in `remotes` is released at the end.
/// The task runs in `spans`' `pull` (its end: the engine has the KV, or the request failed),
/// the events are timed as its `phase` (both none while traces are off).
///
/// Without a consumer (a node that does not pull) the request fails with a clear message.
pub(crate) fn consume(
    disagg: Arc<Disagg>,
    engine: EngineHandle,
    stream: RequestStream,
    (remotes, prompt): (Vec<Remote>, Vec<u32>),
    spans: PullSpans,
) -> Events {
    let id = stream.id();
    let (tx, rx) = mpsc::unbounded_channel();
    let task = relay(disagg, engine, stream, remotes, prompt, tx);
    if spans.pull.is_none() {
        tokio::spawn(task);
    } else {
        tokio::spawn(tracing::Instrument::instrument(task, spans.pull));
    }
    Events {
        source: Source::Relayed(id, rx),
        _phase: spans.phase,
    }
}

/// The spans of a request that pulls: its phase on this node, and the pull within it.
#[derive(Debug)]
pub(crate) struct PullSpans {
    pub(crate) phase: tracing::Span,
    pub(crate) pull: tracing::Span,
}

/// What the engine hears of what arrived.
fn remote_kv(kv: Arrived) -> RemoteKv {
    match kv {
        Arrived::Pulled(n) => RemoteKv::Pulled(n),
        Arrived::Unattested(n) => RemoteKv::PulledUnattested(n),
        Arrived::WithFirstToken {
            tokens,
            first_token,
            key,
        } => RemoteKv::PulledWithFirstToken {
            tokens,
            first_token,
            key,
        },
        Arrived::Recompute => RemoteKv::Recompute,
    }
}

async fn relay(
    disagg: Arc<Disagg>,
    engine: EngineHandle,
    mut stream: RequestStream,
    remotes: Vec<Remote>,
    prompt: Vec<u32>,
    tx: mpsc::UnboundedSender<Relay>,
) {
    let fail = |message: String| {
        let _ = tx.send(Relay::Event(RequestEvent::Failed { message }));
    };
    let Some(consumer) = disagg.consumer.as_ref() else {
        // `kv_directive` admits consumer requests only on a node with a consumer.
        return fail("this node cannot pull KV (no puller)".into());
    };
    let id = stream.id();
    let Some(mut pull) = consumer.start(remotes, prompt, id.to_string()) else {
        // `kv_params::parse` never yields an empty list.
        return fail("kv_transfer_params name no producer".into());
    };
    // 1. Blocks reserved? (bounded: a node with no room must not hold P's blocks forever)
    let first = tokio::select! {
        () = tx.closed() => None,
        e = tokio::time::timeout(pull.wait_timeout(), stream.recv()) => match e {
            Ok(e) => Some(e),
            Err(_) => {
                let message = pull.gave_up_waiting().to_string();
                Some(Some(RequestEvent::Failed { message }))
            }
        },
    };
    let reservation = match first {
        Some(Some(RequestEvent::AwaitingKv(reservation))) => reservation,
        other => {
            // Client gone, engine gone, or a failure (passed on): nothing to pull (dropping
            // `pull` releases the leases).
            if let Some(Some(e)) = other {
                let _ = tx.send(Relay::Event(e));
            }
            return;
        }
    };
    let reserved = Reserved {
        blocks: reservation.blocks().to_vec(),
        first_block: reservation.first_block(),
        cached: reservation.cached_tokens(),
    };
    // 2. Pull into the reserved blocks (and, on a staged node, into the compute pool too, as
    // they land, through the reservation's uploader).
    let landing = reservation
        .upload()
        .map(|u| Arc::new(StagedLanding(u.clone())) as Arc<dyn pd_kv_transfer::Landing>);
    let Some(outcome) = pull.run(reserved, landing, tx.closed()).await else {
        return; // the client left before the reads: dropping `pull` releases the leases
    };
    // 3. Start decoding (or fail), then release the producer's blocks: the engine hears first,
    // so the release's round trip does not compete with the first token.
    let first_token = match outcome {
        Outcome::Ready {
            kv,
            landed,
            first_token,
        } => {
            match landed {
                true => engine.remote_kv_landed(reservation, remote_kv(kv)),
                false => engine.remote_kv_ready(reservation, remote_kv(kv)),
            }
            first_token
        }
        Outcome::Failed(e) => {
            // (The leases are released.)
            return fail(e.to_string()); // dropping `stream` aborts the request and frees its blocks
        }
    };
    drop(pull);
    // 4. Hand the engine's stream to the HTTP layer: it reads the rest of the request's events
    // itself (a client gone by now drops it with the channel, which aborts the request).
    let _ = tx.send(Relay::Handover(stream, first_token));
}
