//! The pull of one lease: read the blocks, then confirm that the lease was live across the
//! reads (its record on the owner's lease board, or the owner's `ConfirmLease`) and holds the
//! reader's prompt. Also the confirmation asked for early ([`EarlyConfirm`], [`Unawaited`]) and
//! the keeper that renews a lease while a request waits ([`LeaseKeeper`]).
//!
//! This is the IO; what to do at each step (ask early or not, whether the board alone
//! confirms, what the owner's answer means) is decided by [`crate::consumer::confirm`], and
//! what happened is returned as a [`LeaseTrace`] for the consumer to record
//! ([`crate::TransferMetrics::record_lease_pull`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_kv_pool::BlockId;

use super::{Pulled, Puller};
use crate::consumer::confirm::{self, Answer, Confirmed, Verdict};
use crate::landing::Landing;
use crate::peer::{PeerInfo, TransferError};
use crate::pull::{PullStats, Rechunk};

/// Blocks of a peer held under one lease, and where they go locally.
#[derive(Debug, Clone)]
pub struct LeasedBlocks {
    /// The lease.
    pub lease: pd_kv_pool::LeaseId,
    /// Its generation.
    pub generation: u64,
    /// The peer's block ids.
    pub remote: Vec<BlockId>,
    /// Our block ids, one per remote block (with `rechunk`: ours holding its tokens).
    pub local: Vec<BlockId>,
    /// The peer's blocks differ from ours in size or order: convert these tokens.
    pub rechunk: Option<Rechunk>,
    /// What the blocks must hold (the reader's prompt), checked against what the owner says at
    /// confirm. Not attested (all zero): no check.
    pub expect: pd_kv_pool::LeaseContents,
    /// The lease's record on the owner's lease board (`remote_lease_slot`), if it said.
    pub board_slot: Option<u32>,
    /// Confirm on the board alone — without waiting for the owner's answer — when the board's
    /// beat shows the owner alive at most this long before the record was read (`None`:
    /// always hear the owner). See [`pull_under_lease_with`].
    pub board_freshness: Option<Duration>,
    /// Where the blocks go as they land (a staged node's compute pool), if anywhere.
    pub landing: Option<Arc<dyn Landing>>,
}

/// The whole pull of one lease: read the blocks, then confirm with the owner that the lease
/// was still live — live now means live during the whole read, since a lease never comes back
/// once ended. If not, the data is discarded (the caller must not use the local blocks) and the
/// error says why. Successes and failures (by reason) are recorded in `metrics`
/// ([`crate::TransferMetrics::record_lease_pull`]); the caller keeps the lease alive meanwhile
/// with a [`LeaseKeeper`] and releases it afterwards.
///
/// Reads and confirmation end by `deadline`: past it the reads are cancelled (and, when it is the
/// confirmation that hangs, the peer's endpoint is closed) and the error is
/// [`TransferError::Deadline`]. Either way, when this returns nothing writes the local blocks.
///
/// # Errors
/// [`TransferError`] for every way the KV did not arrive intact.
pub async fn pull_under_lease(
    puller: &Puller,
    client: &mut crate::peer::PeerClient,
    peer: &PeerInfo,
    blocks: LeasedBlocks,
    deadline: Instant,
    metrics: &crate::metrics::TransferMetrics,
) -> Result<LeasePull, TransferError> {
    let (result, trace) = pull_under_lease_with(puller, client, peer, blocks, None, deadline).await;
    metrics.record_lease_pull(&trace, &result);
    result
}

/// The owner's confirmation of a lease, asked for before the pull started (e.g. as soon as the
/// request arrived, while it waited for blocks): [`pull_under_lease_with`] uses it in place of
/// the one it would send alongside its reads.
pub type EarlyConfirm = tokio::task::JoinHandle<Result<pd_kv_pool::LeaseContents, TransferError>>;

/// What a pull of one lease went through, for its caller to record
/// ([`crate::TransferMetrics::record_lease_pull`]): set as far as the pull got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseTrace {
    /// From handing the pull to the puller to its reads' completion (the reads succeeded).
    pub reads: Option<Duration>,
    /// How the lease was (or was being) confirmed once the reads were in.
    pub confirmed: Option<Confirmed>,
    /// From the reads' completion to the lease's confirmation (it was confirmed).
    pub confirm: Option<Duration>,
}

/// [`pull_under_lease`], with the owner's confirmation already on its way (`early`), recording
/// nothing: it returns what happened ([`LeaseTrace`]) beside the outcome. `early` counts
/// only where the owner has a lease board mapped here — the board's record, read after the
/// reads, shows the lease had not ended by then; elsewhere it is dropped and the owner confirms
/// after the reads as usual.
///
/// Where the board also beats recently enough (`blocks.board_freshness`: the owner granted a
/// lease that long ago at most, by the clock its handshake stated), the record alone confirms
/// the lease and the owner's answer is not waited for (nor asked for alongside the reads, when
/// no `early` one was: with `board_freshness` the caller counts on the board, and the owner is
/// asked after the reads only if the board does not do). What the owner's answer adds is that it
/// is alive; a recent beat says it was a moment ago. An owner that died (or froze) since then
/// left its leased blocks as they were — a dead or stopped process writes nothing, and the
/// record's generation shows the blocks were not handed out before it stopped — so what was
/// read is the lease's KV either way, and its hashes are checked against the prompt below.
///
/// # Errors
/// As [`pull_under_lease`].
pub async fn pull_under_lease_with(
    puller: &Puller,
    client: &mut crate::peer::PeerClient,
    peer: &PeerInfo,
    blocks: LeasedBlocks,
    early: Option<EarlyConfirm>,
    deadline: Instant,
) -> (Result<LeasePull, TransferError>, LeaseTrace) {
    let mut trace = LeaseTrace::default();
    let result = async {
        let handed = std::time::Instant::now();
        let late = || {
            puller.forget(&peer.engine_id);
            TransferError::Deadline(format!(
                "the owner did not confirm lease {} in time",
                blocks.lease
            ))
        };
        // With a lease board mapped here, the owner's confirmation runs alongside the reads (the
        // owner is alive and says what the lease holds) and the lease's record, read right after
        // the reads, shows it had not ended by then: together what a confirmation after the
        // reads says, in the time of the longer of the two. Otherwise the owner confirms after.
        let overlap = confirm::board_counts(blocks.board_slot, peer.board_slots);
        let (lease, generation) = (blocks.lease, blocks.generation);
        // Aborted on every way out that does not await it (a failed pull, a fresh board).
        let mut early = Unawaited(early.filter(|_| overlap));
        let tcp = blocks.rechunk.is_none() && blocks.landing.is_none() && puller.over_tcp(peer);
        let who = (client.me().to_owned(), client.token());
        let pull = async {
            match tcp {
                true => {
                    let (remote, local) = (blocks.remote, blocks.local);
                    puller
                        .pull_over_tcp(peer, who, lease, generation, remote, local, deadline)
                        .await
                }
                false => {
                    puller
                        .pull_converting(
                            peer,
                            blocks.remote,
                            blocks.local,
                            blocks.rechunk,
                            blocks.board_slot,
                            blocks.landing,
                            deadline,
                        )
                        .await
                }
            }
        };
        // Without an early confirmation, one goes out alongside the reads — unless the caller
        // counts on a fresh board (then the owner is asked after the reads if it is not).
        let alongside = confirm::alongside(overlap, early.0.is_some(), blocks.board_freshness);
        let (pulled, mut asked) = if alongside {
            let confirm =
                tokio::time::timeout_at(deadline.into(), client.confirm(lease, generation));
            let (p, c) = tokio::join!(pull, confirm);
            (p, Some(Answer::from(c)))
        } else {
            (pull.await, None)
        };
        let read_at = std::time::Instant::now();
        // A failed pull first: it says what became of our blocks.
        let Pulled { stats, record, .. } = pulled?;
        trace.reads = Some(read_at - handed);
        let confirming = read_at;
        // This lease's record, on a board that beat recently: no need to hear the owner.
        let fresh = confirm::fresh_record(
            record,
            (lease, generation),
            blocks.board_freshness,
            peer.owner_clock,
            crate::monotonic_ns(),
        );
        if fresh.is_some() {
            drop(early);
        } else if asked.is_none()
            && let Some(h) = early.0.take()
        {
            let joined = tokio::time::timeout_at(deadline.into(), h).await;
            asked = Some(Answer::from(joined.map(|joined| {
                joined.unwrap_or_else(|e| {
                    Err(TransferError::Rpc(format!("confirming lease {lease}: {e}")))
                })
            })));
        }
        let theirs = match confirm::verdict(fresh, asked, record, generation) {
            Verdict::Board { contents, alone } => {
                trace.confirmed = Some(match alone {
                    true => Confirmed::BoardAlone,
                    false => Confirmed::Board,
                });
                contents
            }
            Verdict::Refused(e) => return Err(e),
            Verdict::Late => return Err(late()),
            // No board record (not mapped here, or not this lease's any more): the owner says
            // after the reads, and says why not.
            Verdict::AskOwner => {
                trace.confirmed = Some(Confirmed::Rpc);
                let confirm = client.confirm(lease, generation);
                match tokio::time::timeout_at(deadline.into(), confirm).await {
                    Ok(r) => r?,
                    Err(_) => return Err(late()),
                }
            }
        };
        trace.confirm = Some(confirming.elapsed());
        // An owner that attests its lease must hold exactly the reader's prompt: otherwise the
        // params were forged or mixed up, and the blocks are another prompt's KV.
        let attested = confirm::attest(lease, theirs, blocks.expect)?;
        Ok(LeasePull {
            stats,
            attested: attested.attested,
            next_token: attested.next_token,
        })
    }
    .await;
    (result, trace)
}

/// An early confirmation not (yet) awaited: aborted when dropped, so a request or a pull that
/// ends without it leaves no RPC running. Take it out (`.0.take()`) to await or hand it on.
#[derive(Debug)]
pub struct Unawaited(pub Option<EarlyConfirm>);

impl Drop for Unawaited {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// What [`pull_under_lease`] brought.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasePull {
    /// The reads.
    pub stats: PullStats,
    /// Whether the owner attested what the blocks hold (and it matched the reader's prompt).
    /// KV nobody vouched for may serve the request it was pulled for but must never enter a
    /// prefix cache.
    pub attested: bool,
    /// The owner's token after the blocks' tokens (a prefill's first token) and how it was
    /// chosen (`LeaseContents::next_token_key`), when it said and its tokens are the reader's.
    pub next_token: Option<(u32, u64)>,
}

/// Renews a lease every `interval` (duration / 6) until dropped, so a pull that waits in a
/// queue does not lose its blocks. Unacknowledged renewals are counted.
#[derive(Debug)]
pub struct LeaseKeeper {
    task: tokio::task::JoinHandle<()>,
}

impl LeaseKeeper {
    /// Starts renewing `(lease, generation)` through `client`.
    pub fn start(
        mut client: crate::peer::PeerClient,
        lease: pd_kv_pool::LeaseId,
        generation: u64,
        interval: std::time::Duration,
        metrics: Arc<crate::metrics::TransferMetrics>,
    ) -> Self {
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.tick().await;
            loop {
                tick.tick().await;
                match client.renew(lease, generation).await {
                    Ok(true) => {}
                    Ok(false) => {
                        metrics.notification_failures.inc();
                        tracing::warn!(%lease, "lease renewal refused: the lease ended");
                        return;
                    }
                    Err(e) => {
                        metrics.notification_failures.inc();
                        tracing::warn!(%lease, error = %e, "lease renewal failed");
                    }
                }
            }
        });
        Self { task }
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}
