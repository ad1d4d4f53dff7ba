//! The node's client: one tokio task that keeps a `NodeRegistry.Report` stream open to the
//! gateway, and reconnects with backoff whenever it breaks.
//!
//! One connection, in order (see `proto/registry.proto` for the gateway's side):
//!
//! 1. `Register`, then wait for the gateway's `RegisterAck` ([`ReporterOptions::ack_timeout`]);
//! 2. a full `NodeState` (seq 1);
//! 3. a block resync: a fresh [`BlockSubscription`](crate::BlockSubscription), its snapshot
//!    sent as `BlockEvents` with `resync = true` (split into several messages when larger than
//!    [`ReporterOptions::max_hashes_per_message`]; only the first carries `resync`);
//! 4. a retained turn resync, when the source reports turns
//!    ([`StateSource::subscribe_turns`]): `RetainedTurns` with `resync = true`, split within
//!    the message bounds;
//! 5. then, until the stream breaks: `NodeState` every [`ReporterOptions::change_poll`] when it
//!    differs from the last one sent and at least every state interval regardless; `BlockEvents`
//!    deltas as the feed delivers them, gathered for [`ReporterOptions::block_coalesce`] after
//!    the first; `RetainedTurns` deltas as turns are retained and end; a new resync whenever a
//!    feed lagged.
//!
//! Gateway messages are read at any time after `Register`: a `RegisterAck` (also a later one)
//! sets the state interval and, when it carries one, offers the cluster token
//! ([`ReporterHandle::cluster_token`]); a `PeerList` replaces the KV peers the gateway
//! registered ([`ReporterHandle::peers`]). Both are kept across reconnects: a gateway that is
//! away leaves the node with what it said last. What every reporter of a node hears is merged
//! by its `Joined` (one per [`crate::Gateways`], or one of its own for a lone reporter), which
//! may refuse a gateway whose cluster token conflicts.
//!
//! The task only reads from the [`StateSource`]; nothing the node does waits for it. A stalled
//! gateway stalls only this task (HTTP/2 flow control, then a bounded outgoing queue), and the
//! block feed it stops draining drops old events instead of growing: the task resyncs when it
//! catches up.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_rpc::registry as pb;
use pd_rpc::registry::node_registry_client::NodeRegistryClient;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;
use tracing::{debug, error, info, warn};

use crate::backoff::Backoff;
use crate::error::{ReportError, chain};
use crate::joined::Joined;
use crate::live::Live;
use crate::registration::Registration;
use crate::source::StateSource;

/// Messages queued for the gateway beyond what HTTP/2 flow control already buffers.
const OUTBOUND_QUEUE: usize = 16;
/// The shortest state interval a gateway may ask for.
const MIN_STATE_INTERVAL: Duration = Duration::from_millis(10);

/// Timing and sizing of the reporter. `Default` gives the production values.
#[derive(Debug, Clone)]
pub struct ReporterOptions {
    /// A `NodeState` is sent at least this often, changed or not, unless the gateway's
    /// `RegisterAck` asks for another period. Default: 1 s.
    pub state_interval: Duration,
    /// How often the counters are read and sent if they changed (the state interval instead, if
    /// shorter). Default: 100 ms.
    pub change_poll: Duration,
    /// First reconnect delay; doubles after every failed attempt, and is back to this after a
    /// registration was acknowledged. Default: 100 ms.
    pub backoff_initial: Duration,
    /// Longest reconnect delay. Default: 5 s.
    pub backoff_max: Duration,
    /// Limit on establishing the TCP/HTTP2 connection. Default: 3 s.
    pub connect_timeout: Duration,
    /// Limit on the gateway's `RegisterAck` after connecting. Default: 5 s.
    pub ack_timeout: Duration,
    /// HTTP/2 keep-alive ping period; a gateway that does not answer a ping within this long is
    /// taken as gone, even when the stream is idle. Default: 10 s.
    pub keepalive: Duration,
    /// Hashes per `BlockEvents` message (resync chunks and deltas); keeps every message far below
    /// tonic's 4 MiB default limit. Default: 16384 (about 180 KB).
    pub max_hashes_per_message: usize,
    /// On shutdown, how long to wait for the gateway to see the stream end cleanly. Default: 1 s.
    pub close_grace: Duration,
    /// After a block event arrives, how long to gather more before sending them as one
    /// `BlockEvents`: the events of one request (blocks stored, blocks evicted for them) and of
    /// the requests right behind it then travel together, and the gateway wakes once for them
    /// instead of once per event batch (at a few hundred requests a second, that was a
    /// thousand wake-ups of its control thread). The gateway sees new blocks this much later.
    /// Default: 2 ms; zero sends at once.
    pub block_coalesce: Duration,
    /// Mutual TLS with the cluster CA (the gateway's `--tls-*`): the connection is `https`,
    /// the gateway's certificate checked against the CA, this node's presented. Default: none.
    pub tls: Option<pd_tls::ClusterTls>,
}

impl Default for ReporterOptions {
    fn default() -> Self {
        Self {
            state_interval: Duration::from_secs(1),
            change_poll: Duration::from_millis(100),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            ack_timeout: Duration::from_secs(5),
            keepalive: Duration::from_secs(10),
            max_hashes_per_message: 16384,
            close_grace: Duration::from_secs(1),
            block_coalesce: Duration::from_millis(2),
            tls: None,
        }
    }
}

/// Where the reporter stands, as of the last change.
#[derive(Debug, Clone, Default)]
pub struct ReporterStatus {
    /// Registered with a gateway and streaming now.
    pub connected: bool,
    /// The `gateway_id` of the last acknowledged registration.
    pub gateway_id: Option<String>,
    /// Registrations acknowledged since spawn (1 after the first connection; each reconnect adds
    /// one).
    pub connects: u64,
    /// Connection attempts that failed plus connections that broke.
    pub failures: u64,
    /// Full block resyncs sent (one per connection, plus one per lagged feed).
    pub resyncs: u64,
    /// The state interval in effect (the option, or what the gateway asked for).
    pub state_interval: Duration,
    /// The most recent failure, kept after a successful reconnect.
    pub last_error: Option<Arc<ReportError>>,
    /// Set when the gateway refused the node for good, or the node the gateway
    /// ([`ReportError::is_final`]): the reporter has stopped. A node reporting to this gateway
    /// alone should exit with this error.
    pub refused: Option<Arc<ReportError>>,
}

/// The reporting task's state. Built and started by [`Reporter::spawn`]; the caller keeps the
/// [`ReporterHandle`].
pub struct Reporter {
    addr: String,
    endpoint: Endpoint,
    register: pb::Register,
    source: Arc<dyn StateSource>,
    options: ReporterOptions,
    status: watch::Sender<ReporterStatus>,
    /// The gateway's latest `PeerList`.
    peers: watch::Sender<Option<Vec<String>>>,
    /// The address the gateway saw this node register from.
    observed_host: watch::Sender<Option<String>>,
    /// What this node's gateways said, merged; this gateway's key there.
    joined: Arc<Joined>,
    key: u64,
    backoff: Backoff,
    /// The connection being streamed on, kept outside the session future so a shutdown can end
    /// it cleanly after cancelling that future.
    live: Option<Live>,
}

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reporter")
            .field("addr", &self.addr)
            .field("engine_id", &self.register.engine_id)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Reporter {
    /// Starts reporting `registration` and `source` to the gateway at `gateway_addr`
    /// (`host:port`, or a full `http://` URI) on the current tokio runtime, and returns at once:
    /// the first connection is made in the background, and a gateway that is down is retried
    /// with backoff for as long as the handle lives.
    ///
    /// # Errors
    /// [`ReportError::InvalidAddress`] when `gateway_addr` is not a URI; nothing is spawned then.
    ///
    /// # Panics
    /// Outside a tokio runtime (as `tokio::spawn`).
    pub fn spawn(
        gateway_addr: impl Into<String>,
        registration: Registration,
        source: Arc<dyn StateSource>,
        options: ReporterOptions,
    ) -> Result<ReporterHandle, ReportError> {
        let given = gateway_addr.into();
        let endpoint = pd_tls::grpc_endpoint(&given, options.tls.as_ref()).map_err(|source| {
            ReportError::InvalidAddress {
                addr: given.clone(),
                source,
            }
        })?;
        let addr = endpoint.uri().to_string().trim_end_matches('/').to_owned();
        let (joined, _left) = Joined::new(&registration.cluster_token);
        let key = joined.add(&addr);
        Ok(Self::launch(
            Target { addr, endpoint },
            pb::Register::from(&registration),
            source,
            options,
            joined,
            key,
        ))
    }

    /// Starts reporting to `target` as gateway `key` of `joined`.
    pub(crate) fn launch(
        target: Target,
        register: pb::Register,
        source: Arc<dyn StateSource>,
        options: ReporterOptions,
        joined: Arc<Joined>,
        key: u64,
    ) -> ReporterHandle {
        let endpoint = target
            .endpoint
            .connect_timeout(options.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(options.keepalive)
            .keep_alive_timeout(options.keepalive)
            .keep_alive_while_idle(true);
        let (status, status_rx) = watch::channel(ReporterStatus {
            state_interval: options.state_interval,
            ..ReporterStatus::default()
        });
        let (stop, stop_rx) = watch::channel(false);
        let (peers, peers_rx) = watch::channel(None);
        let (observed_host, observed_host_rx) = watch::channel(None);
        let cluster_token = joined.watch_token();
        let reporter = Self {
            addr: target.addr,
            endpoint,
            register,
            source,
            backoff: Backoff::new(options.backoff_initial, options.backoff_max),
            options,
            status,
            peers,
            observed_host,
            joined,
            key,
            live: None,
        };
        let task = tokio::spawn(reporter.run(stop_rx));
        ReporterHandle {
            status: status_rx,
            peers: peers_rx,
            cluster_token,
            observed_host: observed_host_rx,
            stop,
            task: Some(task),
        }
    }

    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        loop {
            let err = tokio::select! {
                Err(err) = self.session() => err,
                _ = stopped(&mut stop) => break,
            };
            self.live = None;
            let was_connected = self.status.borrow().connected;
            if was_connected {
                self.joined.ended(self.key, false);
            }
            let failures = {
                let mut failures = 0;
                self.status.send_modify(|s| {
                    s.connected = false;
                    s.failures += 1;
                    failures = s.failures;
                });
                failures
            };
            if err.is_final() {
                error!(gateway = %self.addr, error = %chain(&err), "no more reporting to this gateway: refused for good; not retrying");
                let err = Arc::new(err);
                self.status.send_modify(|s| {
                    s.last_error = Some(err.clone());
                    s.refused = Some(err.clone());
                });
                self.joined.refused(self.key, err);
                return;
            }
            let delay = self.backoff.next_delay();
            let attempt = self.backoff.attempts;
            if matches!(err, ReportError::Unauthenticated(_)) {
                // A configuration error, not an outage: said loudly, and again now and then.
                if attempt == 1 || attempt.is_multiple_of(12) {
                    error!(gateway = %self.addr, error = %chain(&err), ?delay, attempt, "the gateway refused the registration: wrong or missing cluster token (--cluster-token / PD_CLUSTER_TOKEN); retrying with backoff");
                } else {
                    debug!(gateway = %self.addr, ?delay, attempt, "cluster token still refused");
                }
            } else if was_connected {
                warn!(gateway = %self.addr, error = %chain(&err), ?delay, "lost the gateway; reconnecting");
            } else if attempt == 1 {
                warn!(gateway = %self.addr, error = %chain(&err), ?delay, "cannot register with the gateway; retrying with backoff");
            } else {
                debug!(gateway = %self.addr, error = %chain(&err), ?delay, attempt, failures, "gateway still unavailable");
            }
            self.status
                .send_modify(|s| s.last_error = Some(Arc::new(err)));
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = stopped(&mut stop) => break,
            }
        }
        self.close().await;
    }

    /// Ends the current connection cleanly: the request stream finishes (the gateway reads "node
    /// leaving", not a failure), and the gateway gets `close_grace` to end its side.
    async fn close(&mut self) {
        let was_connected = self.status.borrow().connected;
        self.status.send_modify(|s| s.connected = false);
        if was_connected {
            self.joined.ended(self.key, true);
        }
        let Some(Live {
            tx, mut inbound, ..
        }) = self.live.take()
        else {
            return;
        };
        drop(tx);
        let drained = tokio::time::timeout(self.options.close_grace, async {
            while let Ok(Some(_)) = inbound.message().await {}
        })
        .await;
        if drained.is_err() {
            debug!(gateway = %self.addr, "the gateway did not end the stream within the grace period");
        }
        info!(gateway = %self.addr, "stopped reporting to the gateway");
    }

    /// One connection, from connect to failure. Returns only with the reason it ended.
    async fn session(&mut self) -> Result<std::convert::Infallible, ReportError> {
        self.live = None;
        let channel = self
            .endpoint
            .connect()
            .await
            .map_err(|source| ReportError::Connect {
                addr: self.addr.clone(),
                source,
            })?;
        let mut client = NodeRegistryClient::new(channel);
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let register = pb::NodeMessage {
            msg: Some(pb::node_message::Msg::Register(self.register.clone())),
        };
        tx.send(register).await.map_err(|_| ReportError::Closed)?;

        let ack_timeout = self.options.ack_timeout;
        let (peers, joined, key) = (&self.peers, &self.joined, self.key);
        let (inbound, ack) = tokio::time::timeout(ack_timeout, async {
            let mut inbound = client.report(ReceiverStream::new(rx)).await?.into_inner();
            loop {
                match inbound.message().await? {
                    Some(pb::GatewayMessage {
                        msg: Some(pb::gateway_message::Msg::Ack(ack)),
                    }) => return Ok((inbound, ack)),
                    Some(pb::GatewayMessage {
                        msg: Some(pb::gateway_message::Msg::Peers(list)),
                    }) => publish_peers(peers, joined, key, list),
                    // A message this version does not know: not an acknowledgement.
                    Some(_) => debug!("ignoring a gateway message before the acknowledgement"),
                    None => return Err(ReportError::Closed),
                }
            }
        })
        .await
        .map_err(|_| ReportError::AckTimeout(ack_timeout))??;

        self.joined.acked(self.key, &ack)?;
        if !ack.observed_host.is_empty() {
            self.observed_host.send_if_modified(|h| {
                let changed = h.as_deref() != Some(ack.observed_host.as_str());
                *h = Some(ack.observed_host.clone());
                changed
            });
        }
        let state_interval = state_interval_from(&ack, self.options.state_interval);
        self.backoff.reset();
        let mut connects = 0;
        self.status.send_modify(|s| {
            s.connected = true;
            s.connects += 1;
            s.gateway_id = Some(ack.gateway_id.clone());
            s.state_interval = state_interval;
            connects = s.connects;
        });
        info!(gateway = %self.addr, gateway_id = %ack.gateway_id, connects, ?state_interval, "registered with the gateway");

        let live = self.live.insert(Live {
            tx,
            inbound,
            seq: 0,
            last_state: None,
            last_sent: Instant::now(),
            state_interval,
        });
        live.send_state(self.source.state()).await?;
        let mut blocks = self.source.subscribe_blocks();
        live.send_resync(&mut blocks, self.options.max_hashes_per_message)
            .await?;
        self.status.send_modify(|s| s.resyncs += 1);
        let mut turns = self.source.subscribe_turns();
        if let Some(t) = turns.as_mut() {
            live.send_turns_resync(t).await?;
        }

        let mut feed_open = true;
        let mut poll = poll_timer(self.options.change_poll, live.state_interval);
        loop {
            tokio::select! {
                msg = live.inbound.message() => match msg? {
                    Some(pb::GatewayMessage { msg: Some(pb::gateway_message::Msg::Ack(ack)) }) => {
                        self.joined.acked(self.key, &ack)?;
                        let interval = state_interval_from(&ack, self.options.state_interval);
                        live.state_interval = interval;
                        poll = poll_timer(self.options.change_poll, interval);
                        self.status.send_modify(|s| s.state_interval = interval);
                    }
                    Some(pb::GatewayMessage { msg: Some(pb::gateway_message::Msg::Peers(list)) }) => {
                        publish_peers(&self.peers, &self.joined, self.key, list);
                    }
                    Some(_) => debug!("ignoring an unknown gateway message"),
                    None => return Err(ReportError::Closed),
                },
                _ = poll.tick() => {
                    let state = self.source.state();
                    if !live.last_state.is_some_and(|l| l.same_load(&state)) || live.last_sent.elapsed() >= live.state_interval {
                        live.send_state(state).await?;
                    }
                }
                event = blocks.events.recv(), if feed_open => match event {
                    Ok(first) => {
                        if !self.options.block_coalesce.is_zero() {
                            tokio::time::sleep(self.options.block_coalesce).await;
                        }
                        live.send_deltas(first, &mut blocks, self.options.max_hashes_per_message).await?;
                    }
                    Err(RecvError::Lagged(missed)) => {
                        warn!(missed, "block event feed lagged behind the node; resyncing");
                        blocks = self.source.subscribe_blocks();
                        live.send_resync(&mut blocks, self.options.max_hashes_per_message).await?;
                        self.status.send_modify(|s| s.resyncs += 1);
                    }
                    Err(RecvError::Closed) => {
                        debug!("the node closed its block event feed");
                        feed_open = false;
                    }
                },
                event = next_turn(&mut turns) => match event {
                    Ok(first) => {
                        let t = turns.as_mut().expect("a feed only when subscribed");
                        live.send_turn_deltas(first, t, crate::MAX_TURNS_PER_MESSAGE).await?;
                    }
                    Err(RecvError::Lagged(missed)) => {
                        warn!(missed, "retained turn feed lagged behind the node; resyncing");
                        turns = self.source.subscribe_turns();
                        if let Some(t) = turns.as_mut() {
                            live.send_turns_resync(t).await?;
                        }
                    }
                    Err(RecvError::Closed) => {
                        debug!("the node closed its retained turn feed");
                        turns = None;
                    }
                },
            }
        }
    }
}

/// The next retained turn event; pending forever without a feed.
async fn next_turn(
    turns: &mut Option<crate::TurnSubscription>,
) -> Result<crate::TurnEvent, RecvError> {
    match turns {
        Some(t) => t.events.recv().await,
        None => std::future::pending().await,
    }
}

/// Ticks when the counters are read: every `change_poll`, or every state interval when that is
/// shorter (so a gateway asking for a short period gets it).
fn poll_timer(change_poll: Duration, state_interval: Duration) -> tokio::time::Interval {
    let period = change_poll.min(state_interval).max(MIN_STATE_INTERVAL);
    let mut timer = tokio::time::interval(period);
    timer.set_missed_tick_behavior(MissedTickBehavior::Delay);
    timer
}

/// Replaces this gateway's published peer list with `list` (a change is logged) and hands it to
/// the merge.
fn publish_peers(
    peers: &watch::Sender<Option<Vec<String>>>,
    joined: &Joined,
    key: u64,
    list: pb::PeerList,
) {
    let addrs = list.kv_side_channel_addrs;
    let changed = peers.send_if_modified(|current| {
        if current.as_ref() == Some(&addrs) {
            return false;
        }
        *current = Some(addrs.clone());
        true
    });
    if changed {
        debug!(peers = ?addrs, "the gateway's KV peers");
    }
    joined.peers(key, addrs);
}

/// The state interval `ack` asks for, or `default`.
fn state_interval_from(ack: &pb::RegisterAck, default: Duration) -> Duration {
    match ack.state_interval_ms {
        0 => default,
        ms => Duration::from_millis(u64::from(ms)).max(MIN_STATE_INTERVAL),
    }
}

/// Where one reporter connects: its label for logs and the endpoint.
#[derive(Debug)]
pub(crate) struct Target {
    pub(crate) addr: String,
    pub(crate) endpoint: Endpoint,
}

/// Handle to a running [`Reporter`]. Dropping it stops the task as
/// [`shutdown`](Self::shutdown) does, without waiting for it.
#[derive(Debug)]
pub struct ReporterHandle {
    status: watch::Receiver<ReporterStatus>,
    peers: watch::Receiver<Option<Vec<String>>>,
    cluster_token: watch::Receiver<Option<String>>,
    observed_host: watch::Receiver<Option<String>>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl ReporterHandle {
    /// Where the reporter stands now.
    pub fn status(&self) -> ReporterStatus {
        self.status.borrow().clone()
    }

    /// A receiver that sees every status change (for readiness probes and tests).
    pub fn watch_status(&self) -> watch::Receiver<ReporterStatus> {
        self.status.clone()
    }

    /// The KV side channels (`host:port`) of the gateway's latest `PeerList`: `None` until a
    /// gateway sent one, then the last one received (kept while the gateway is away). This
    /// gateway's alone; [`crate::Gateways::peers`] merges them.
    pub fn peers(&self) -> watch::Receiver<Option<Vec<String>>> {
        self.peers.clone()
    }

    /// The cluster token in effect: the registration's when not empty; else the one a gateway's
    /// `RegisterAck` carried (see `Joined` for several). Registrations keep sending the
    /// configured token.
    pub fn cluster_token(&self) -> watch::Receiver<Option<String>> {
        self.cluster_token.clone()
    }

    /// The IP address the gateway saw this node register from (`RegisterAck.observed_host`):
    /// `None` until an acknowledgement carried one. A node bound to a wildcard address without
    /// an advertised host is reached at it.
    pub fn observed_host(&self) -> watch::Receiver<Option<String>> {
        self.observed_host.clone()
    }

    /// Resolves with the error once the gateway refused this node for good
    /// ([`ReporterStatus::refused`]); never otherwise.
    pub async fn refused(&self) -> Arc<ReportError> {
        let mut status = self.status.clone();
        loop {
            if let Some(e) = status.borrow_and_update().refused.clone() {
                return e;
            }
            if status.changed().await.is_err() {
                // The task ended without a refusal (stopped): nothing will come.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops reporting: a live stream is ended cleanly (the gateway sees the node leave, not
    /// fail), waiting at most [`ReporterOptions::close_grace`] for the gateway; a pending
    /// connection attempt or backoff is abandoned. Returns when the task has ended.
    pub async fn shutdown(mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            warn!(error = %e, "the reporter task did not end cleanly");
        }
    }
}

impl Drop for ReporterHandle {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// Resolves once a stop is requested (or the handle is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
