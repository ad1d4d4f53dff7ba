//! The consumer side of the KV protocol: a node pulls a prompt's KV (or a prefix of it, an
//! earlier turn) from the producer that holds it under a lease, into blocks its engine
//! reserved, and confirms the lease was live across the reads.
//!
//! - [`plan`] and [`confirm`] decide without IO: what the params say and whether they describe
//!   the prompt, what to pull into which blocks, whether to ask the producer early, what
//!   confirms the lease, what arrived, which failure policy applies. Unit-tested alone.
//! - [`allowed`]: which producers may be contacted at all (the request names them).
//! - [`suspects`]: producers that could not be reached lately, whose pulls are skipped for a
//!   cool-off where the prompt would be recomputed anyway (one request probes).
//! - [`Consumer`] does the IO: side-channel clients and handshakes cached per producer
//!   (`peers`), the lease kept alive while a request waits, the early confirmation, the pull
//!   under lease ([`crate::puller::lease`]), the release, the failure policy — and records
//!   every metric of a pull ([`TransferMetrics`]).
//!
//! One request's pull ([`Consumer::start`] → [`Pull`]): on arrival the lease is kept alive and,
//! where the producer's board will not do, its confirmation asked for; the node waits for its
//! engine to reserve blocks ([`Pull::wait_timeout`]), then [`Pull::run`] pulls and says what
//! arrived ([`Outcome`]), and the leases are released once the node told its engine (when the
//! [`Pull`] is dropped, on every way out). [`Pull::run`] can be cancelled only until its reads
//! are posted; after that it returns only once nothing writes the reserved blocks any more.

pub mod allowed;
pub mod confirm;
mod peers;
pub mod plan;
pub mod suspects;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pd_kv_pool::{BindingKey, KvLayout};
use tokio::sync::watch;

pub use allowed::{AllowedPeers, PeerRefused};
pub use plan::{
    Arrived, ParamsMismatch, PullPlan, Remote, Reserved, Step, Wanted, check_prompt, held_tokens,
    plan_pull,
};

use crate::compat::CompatInfo;
use crate::landing::Landing;
use crate::metrics::TransferMetrics;
use crate::peer::{FailurePolicy, Fallback, HandshakeCache, PeerClient, TransferError};
use crate::puller::{LeasedBlocks, Puller, Unawaited, pull_under_lease_with};
use suspects::{Suspects, Verdict};

/// How a consumer pulls.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// This node's engine id (sent to producers with every lease call).
    pub engine_id: String,
    /// What to do when the KV does not arrive.
    pub policy: FailurePolicy,
    /// Compute prompts locally when fewer than this many tokens would be pulled.
    pub recompute_threshold: usize,
    /// Skip the handshake's compatibility check (both sides must agree to).
    pub skip_compat_check: bool,
    /// How often to renew a lease while waiting (the producer's duration / 6).
    pub renew_interval: Duration,
    /// The time one pull gets (handshake, reads, confirmation), plus
    /// [`PULL_DEADLINE_RATE`] for its bytes; past it the pull is cancelled and fails as
    /// `deadline`.
    pub pull_timeout: Duration,
    /// How long a request may wait for free local blocks before it fails and releases the
    /// producer's lease.
    pub wait_timeout: Duration,
    /// A lease is confirmed on the producer's mapped lease board alone when the board beat at
    /// most this long before (`--kv-board-freshness-ms`; `None`: always hear the producer).
    pub board_freshness: Option<Duration>,
    /// Pulls upload their blocks into a staged compute pool as they land, where the node gives
    /// [`Pull::run`] a [`Landing`] (`--kv-upload-while-pulling`).
    pub upload_while_pulling: bool,
    /// Producers this node may contact ([`AllowedPeers`]).
    pub allowed_peers: AllowedPeers,
    /// The cluster token sent on every side-channel call (`--cluster-token`, or the one the
    /// gateway handed out at registration); `None` while there is none.
    pub cluster_token: watch::Receiver<Option<String>>,
    /// Mutual TLS with the cluster CA on the side channel (`--tls-*`); `None`: plain.
    pub tls: Option<pd_tls::ClusterTls>,
}

impl PullConfig {
    /// Whether `host:port` may be contacted (see [`AllowedPeers::check`]).
    pub fn allows(&self, host: &str, port: u16) -> bool {
        self.allowed_peers.allows(host, port)
    }

    /// The deadline of a pull of `bytes` starting now: [`PullConfig::pull_timeout`] plus the
    /// bytes at [`PULL_DEADLINE_RATE`].
    pub fn pull_deadline(&self, bytes: usize) -> Instant {
        let transfer = Duration::from_secs_f64(bytes as f64 / PULL_DEADLINE_RATE);
        Instant::now() + self.pull_timeout + transfer
    }
}

/// Bytes per second a pull's deadline grants beyond the base timeout (100 MiB/s: well below
/// even TCP-emulated RMA, so only a stalled peer reaches it).
pub const PULL_DEADLINE_RATE: f64 = 100.0 * 1024.0 * 1024.0;

/// Side-channel clients (and handshakes) a consumer keeps; beyond, one is dropped to make room.
pub const MAX_PEER_CLIENTS: usize = 64;

/// A node's pulling machinery: its puller, what it tells producers at the handshake, its
/// settings, the side-channel clients and handshakes it keeps per producer, and the metrics
/// every pull is recorded in.
pub struct Consumer {
    puller: Puller,
    compat: CompatInfo,
    /// Our pool's layout.
    layout: KvLayout,
    /// This process's incarnation (sent at the handshake).
    epoch: u64,
    cfg: PullConfig,
    /// The key binding a lease to the prompt it holds: what a producer's lease must say.
    binding_key: BindingKey,
    metrics: Arc<TransferMetrics>,
    /// Side-channel clients per producer address.
    clients: Mutex<HashMap<String, PeerClient>>,
    handshakes: Mutex<HandshakeCache>,
    /// Producers that could not be reached lately.
    suspects: Mutex<Suspects>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("engine_id", &self.cfg.engine_id)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A consumer pulling through `puller` into a pool laid out as `layout`, saying `compat` at
    /// handshakes as incarnation `epoch`, checking leases' contents under `binding_key` (the
    /// producers'), recording into `metrics`.
    pub fn new(
        puller: Puller,
        compat: CompatInfo,
        layout: KvLayout,
        epoch: u64,
        cfg: PullConfig,
        binding_key: BindingKey,
        metrics: Arc<TransferMetrics>,
    ) -> Self {
        let cfg_cool_off = cfg.pull_timeout.max(Duration::from_secs(1));
        Self {
            puller,
            compat,
            layout,
            epoch,
            cfg,
            binding_key,
            metrics,
            clients: Mutex::new(HashMap::new()),
            handshakes: Mutex::new(HandshakeCache::default()),
            suspects: Mutex::new(Suspects::new(cfg_cool_off)),
        }
    }

    /// Its settings.
    pub fn config(&self) -> &PullConfig {
        &self.cfg
    }

    /// Whether the producer at `host:port` may be contacted (`--kv-allowed-peers`, the
    /// gateway's peers).
    ///
    /// # Errors
    /// [`PeerRefused`], saying why not.
    pub fn check_peer(&self, host: &str, port: u16) -> Result<(), PeerRefused> {
        self.cfg.allowed_peers.check(host, port)
    }

    /// The producers this node could not reach lately (side channels), whose pulls it skips
    /// where it would recompute anyway ([`suspects`]).
    pub fn unreachable(&self) -> Vec<String> {
        self.suspects
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .peers()
    }

    /// Brings the metrics' view of the puller up to date (the path to each peer).
    pub fn observe_paths(&self) {
        self.metrics.observe_peer_paths(&self.puller.peer_paths());
    }

    /// Starts the pull of a request for `prompt` whose KV `remotes` name (`remotes[0]` drives
    /// the pull; every distinct lease among them is released at the end): keeps the lease
    /// alive from now on, asks the producer to confirm it early where its board will not do,
    /// and wakes the copier. `request` names the request in logs. `None` when `remotes` is
    /// empty.
    pub fn start(
        self: &Arc<Self>,
        remotes: Vec<Remote>,
        prompt: Vec<u32>,
        request: String,
    ) -> Option<Pull> {
        let remote = remotes.first()?.clone();
        let arrived = Instant::now();
        // The copy comes once blocks are reserved: its helper thread may wake now.
        if let Some(epoch) = remote.epoch {
            self.puller.prepare_copy(
                &remote.engine_id,
                epoch,
                remote.block_ids.len() * self.layout.block_bytes(),
            );
        }
        // Keep the producer's lease alive from now on: the request may wait a while for blocks.
        let keeper = AbortOnDrop(tokio::spawn(self.clone().keep_alive(remote.clone())));
        // A producer with a lease board: ask it to confirm the lease now, while this request
        // waits for blocks and reads them; the board's record, read after the reads, says the
        // lease had not ended by then (`pull_under_lease_with`). Dropped unused when nothing is
        // pulled; not asked when its board, mapped here, beat recently (`confirm::ask_early`).
        let beat_age = self
            .cfg
            .board_freshness
            .and_then(|_| self.board_beat_age(&remote));
        let early = confirm::ask_early(remote.board_slot, self.cfg.board_freshness, beat_age);
        let early =
            Unawaited(early.then(|| tokio::spawn(self.clone().early_confirm(remote.clone()))));
        Some(Pull {
            consumer: self.clone(),
            remotes,
            prompt,
            request,
            arrived,
            keeper: Some(keeper),
            early,
            released: false,
        })
    }

    /// The producer's confirmation of `remote`'s lease, asked for as the request arrives (see
    /// [`crate::puller::pull_under_lease_with`]).
    async fn early_confirm(
        self: Arc<Self>,
        remote: Remote,
    ) -> Result<pd_kv_pool::LeaseContents, TransferError> {
        let (mut client, _) = self.prepare(&remote).await?;
        client.confirm(remote.lease, remote.generation).await
    }

    /// Renews `remote`'s lease until aborted: every duration / 6 of the producer's lease (read
    /// off its expiry time), at most the configured interval.
    async fn keep_alive(self: Arc<Self>, remote: Remote) {
        // Capped by our own setting: a producer whose clock runs ahead must not stretch it.
        let interval = remote
            .expiry
            .and_then(|e| e.duration_since(std::time::SystemTime::now()).ok())
            .map_or(self.cfg.renew_interval, |left| {
                (left / 6)
                    .max(Duration::from_millis(10))
                    .min(self.cfg.renew_interval)
            });
        let Ok(client) = self.client(&remote.side_channel()).await else {
            return; // the pull will find out and say why
        };
        let _keeper = crate::puller::LeaseKeeper::start(
            client,
            remote.lease,
            remote.generation,
            interval,
            self.metrics.clone(),
        );
        std::future::pending::<()>().await;
    }
}

/// One request's pull, from its arrival ([`Consumer::start`]) to its end. Dropping it releases
/// the producers' leases (in the background) unless [`Pull::run`] already did, and stops
/// keeping them alive.
#[derive(Debug)]
pub struct Pull {
    consumer: Arc<Consumer>,
    remotes: Vec<Remote>,
    prompt: Vec<u32>,
    /// The request, for logs.
    request: String,
    arrived: Instant,
    keeper: Option<AbortOnDrop>,
    early: Unawaited,
    released: bool,
}

/// What a pull comes to ([`Pull::run`]).
#[derive(Debug)]
pub enum Outcome {
    /// Tell the engine: this arrived (or compute the prompt here). `landed`: the pull already
    /// put the blocks in the compute pool through the [`Landing`] it was given.
    Ready {
        /// What arrived.
        kv: Arrived,
        /// Uploaded as the blocks landed.
        landed: bool,
        /// Times D's first token from now on.
        first_token: FirstToken,
    },
    /// The KV did not arrive and the failure policy says fail the request (leases released).
    Failed(PullFailed),
}

/// A pull that failed under the `fail` policy: the request fails with this.
#[derive(Debug, thiserror::Error)]
#[error("KV transfer failed ({reason}): {0}", reason = .0.reason())]
pub struct PullFailed(pub TransferError);

/// When the engine was told to decode, to time the first token (`first_token` stage).
#[derive(Debug)]
pub struct FirstToken {
    since: Instant,
    metrics: Arc<TransferMetrics>,
}

impl FirstToken {
    /// The first token (or whatever ended the request instead) came now.
    pub fn record(self) {
        self.metrics
            .record_stage("first_token", self.since.elapsed());
    }
}

impl Pull {
    /// How long the request may wait for its engine to reserve blocks (bounded: a node with no
    /// room must not hold the producer's blocks forever).
    pub fn wait_timeout(&self) -> Duration {
        self.consumer.cfg.wait_timeout
    }

    /// The wait for blocks timed out: counted, logged, and the error to fail the request with.
    pub fn gave_up_waiting(&self) -> TransferError {
        let e = TransferError::BlocksUnavailable(self.wait_timeout());
        self.consumer.metrics.record_failure(&e);
        tracing::warn!(request = %self.request, error = %e, "giving up waiting for blocks");
        e
    }

    /// Pulls into the blocks the engine reserved (`reserved`), handing them to `landing` as they
    /// land where the node uploads while pulling, and says what arrived; a failure is counted
    /// and the failure policy applied (the leases released first). `None`: `cancelled`
    /// resolved (the client left) before the reads were posted — nothing was written.
    /// Once posted the reads are not cancellable: they land in the reserved blocks, so this
    /// returns only once nothing writes them.
    pub async fn run(
        &mut self,
        reserved: Reserved,
        landing: Option<Arc<dyn Landing>>,
        cancelled: impl Future<Output = ()>,
    ) -> Option<Outcome> {
        let consumer = self.consumer.clone();
        let (cfg, metrics) = (&consumer.cfg, &consumer.metrics);
        metrics.record_stage("wait_blocks", self.arrived.elapsed());
        let remote = self.remotes.first()?.clone();
        let prompt_len = self.prompt.len();
        let step = plan::decide(
            &remote,
            prompt_len,
            &consumer.layout,
            &reserved,
            cfg.recompute_threshold,
        );
        // Into the compute pool too, as the blocks land, on a staged node.
        let landing = landing.filter(|_| cfg.upload_while_pulling);
        let mut landed = false;
        let mut held = prompt_len;
        let outcome = match step {
            Step::Nothing => Ok(Arrived::Pulled(reserved.cached)),
            Step::BelowThreshold { tokens } => {
                metrics
                    .recomputes
                    .with_label_values(&["below_threshold"])
                    .inc();
                tracing::debug!(request = %self.request, tokens, "below kv_recompute_threshold: computing locally");
                Ok(Arrived::Recompute)
            }
            Step::Pull(wanted) if self.skip(&remote, wanted.held, prompt_len) => {
                metrics
                    .recomputes
                    .with_label_values(&["peer_suspect"])
                    .inc();
                tracing::debug!(request = %self.request, peer = %remote.side_channel(), "the producer could not be reached lately: computing locally");
                Ok(Arrived::Recompute)
            }
            Step::Pull(wanted) => {
                held = wanted.held;
                let deadline = cfg.pull_deadline(wanted.bytes);
                let preparing = Instant::now();
                let prepared = tokio::select! {
                    () = cancelled => {
                        self.abandon_probe(&remote);
                        return None;
                    }
                    p = tokio::time::timeout_at(deadline.into(), consumer.prepare(&remote)) => {
                        p.unwrap_or_else(|_| Err(TransferError::Deadline(format!(
                            "the producer at {} did not answer the handshake in time",
                            remote.side_channel()
                        ))))
                    }
                };
                metrics.record_stage("prepare", preparing.elapsed());
                let planned = prepared.and_then(|(client, peer)| {
                    let plan = plan_pull(
                        &consumer.layout,
                        &peer.layout,
                        wanted.said_block_size,
                        &remote.block_ids,
                        &reserved.blocks,
                        reserved.first_block,
                        wanted.held,
                    )?;
                    Ok((client, peer, plan))
                });
                match planned {
                    Err(e) => {
                        metrics.record_failure(&e);
                        self.pulled(&remote, Err(&e));
                        Err(e)
                    }
                    Ok((mut client, peer, plan)) => {
                        if plan.rechunk.is_some() {
                            metrics.rechunked_pulls.inc();
                        }
                        let leased = LeasedBlocks {
                            lease: remote.lease,
                            generation: remote.generation,
                            remote: plan.remote,
                            local: plan.local,
                            rechunk: plan.rechunk,
                            // The lease's tokens (our prompt's) in the lease's blocks (the ids
                            // the params name, which we read).
                            expect: pd_kv_pool::LeaseContents::of(
                                &consumer.binding_key,
                                &self.prompt[..wanted.held],
                            )
                            .in_blocks(&remote.block_ids),
                            board_slot: remote.board_slot,
                            board_freshness: cfg.board_freshness,
                            landing: landing.clone(),
                        };
                        // Not cancellable: the reads land in our reserved blocks.
                        let early = self.early.0.take();
                        let (r, trace) = pull_under_lease_with(
                            &consumer.puller,
                            &mut client,
                            &peer,
                            leased,
                            early,
                            deadline,
                        )
                        .await;
                        metrics.record_lease_pull(&trace, &r);
                        self.pulled(&remote, r.as_ref().map(|_| ()));
                        r.map(|p| {
                            landed = landing.is_some();
                            plan::arrived(&p, wanted.held, prompt_len)
                        })
                    }
                }
            }
        };
        // Stop asking and renewing: the engine hears next, then the producer's blocks are
        // released (the release's round trip must not compete with the first token).
        self.early = Unawaited(None);
        self.keeper = None;
        let first_token = FirstToken {
            since: Instant::now(),
            metrics: metrics.clone(),
        };
        let e = match outcome {
            Ok(kv) => {
                return Some(Outcome::Ready {
                    kv,
                    landed,
                    first_token,
                });
            }
            Err(e) => e,
        };
        self.release();
        if plan::forgets(&e) {
            // Reconnect and handshake afresh next time.
            consumer.forget(&remote.side_channel(), &remote.engine_id);
        }
        let reason = e.reason();
        match plan::policy_for(held, prompt_len, cfg.policy).apply(e) {
            Ok(Fallback::Recompute) => {
                metrics.recomputes.with_label_values(&[reason]).inc();
                Some(Outcome::Ready {
                    kv: Arrived::Recompute,
                    landed: false,
                    first_token,
                })
            }
            Err(e) => Some(Outcome::Failed(PullFailed(e))),
        }
    }

    /// Whether to compute the prompt instead of pulling from `remote`, which could not be
    /// reached lately ([`Suspects`]): only where a failed pull would be recomputed anyway.
    /// Otherwise this pull may be the producer's probe.
    fn skip(&mut self, remote: &Remote, held: usize, prompt_len: usize) -> bool {
        let cfg = &self.consumer.cfg;
        if plan::policy_for(held, prompt_len, cfg.policy) != FailurePolicy::Recompute {
            return false;
        }
        let verdict = self
            .suspects()
            .check(&remote.side_channel(), Instant::now());
        verdict == Verdict::Skip
    }

    /// A pull from `remote` ended: what it says of reaching the producer.
    fn pulled(&self, remote: &Remote, result: Result<(), &TransferError>) {
        self.suspects()
            .ended(&remote.side_channel(), Instant::now(), result);
    }

    /// The request left before its pull said anything of the producer.
    fn abandon_probe(&self, remote: &Remote) {
        self.suspects().probe_abandoned(&remote.side_channel());
    }

    fn suspects(&self) -> std::sync::MutexGuard<'_, Suspects> {
        self.consumer
            .suspects
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Releases the producers' leases now (once).
    fn release(&mut self) {
        if !std::mem::replace(&mut self.released, true) {
            self.consumer.release(&self.remotes);
        }
    }
}

impl Drop for Pull {
    fn drop(&mut self) {
        self.early = Unawaited(None);
        self.keeper = None;
        self.release();
    }
}

/// Aborts a task when dropped (on every way out of a pull).
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
