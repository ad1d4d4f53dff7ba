//! One registered connection's outgoing side: `NodeState` numbering, block resyncs, and block
//! deltas gathered from the feed without ever repeating a hash within one message.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pd_rpc::registry as pb;
use tokio::sync::{broadcast, mpsc};
use tonic::Streaming;

use crate::error::ReportError;
use crate::source::{BlockEvent, BlockSubscription, NodeStateSnapshot};
use crate::turns::{TurnEvent, TurnSubscription};

/// One registered connection.
pub(crate) struct Live {
    pub(crate) tx: mpsc::Sender<pb::NodeMessage>,
    pub(crate) inbound: Streaming<pb::GatewayMessage>,
    /// Last `NodeState.seq` sent on this connection.
    pub(crate) seq: u64,
    pub(crate) last_state: Option<NodeStateSnapshot>,
    pub(crate) last_sent: Instant,
    pub(crate) state_interval: Duration,
}

impl Live {
    async fn send(&self, msg: pb::node_message::Msg) -> Result<(), ReportError> {
        self.tx
            .send(pb::NodeMessage { msg: Some(msg) })
            .await
            .map_err(|_| ReportError::Closed)
    }

    pub(crate) async fn send_state(&mut self, state: NodeStateSnapshot) -> Result<(), ReportError> {
        self.seq += 1;
        let leases = state.leases;
        let msg = pb::NodeState {
            seq: self.seq,
            unix_ms: unix_ms(),
            total_blocks: state.total_blocks,
            free_blocks: state.free_blocks,
            waiting: state.waiting,
            running: state.running,
            waiting_remote_kv: state.waiting_remote_kv,
            leases: Some(pb::LeaseCounters {
                granted: leases.granted,
                renewed: leases.renewed,
                released: leases.released,
                expired: leases.expired,
                live: leases.live,
            }),
            leased_blocks: state.leased_blocks,
            prefill_tokens_per_s: state.prefill_tokens_per_s,
            pull_mb_per_s: state.pull_mb_per_s,
            draining: state.draining,
        };
        self.send(pb::node_message::Msg::State(msg)).await?;
        self.last_state = Some(state);
        self.last_sent = Instant::now();
        Ok(())
    }

    /// Sends `blocks.stored` as a resync (at least one message, even when empty).
    pub(crate) async fn send_resync(
        &mut self,
        blocks: &mut BlockSubscription,
        max_per_message: usize,
    ) -> Result<(), ReportError> {
        let stored = std::mem::take(&mut blocks.stored);
        let mut chunks = stored.chunks(max_per_message.max(1));
        let first = chunks.next().unwrap_or_default();
        self.send(pb::node_message::Msg::Blocks(pb::BlockEvents {
            resync: true,
            stored: first.to_vec(),
            removed: Vec::new(),
        }))
        .await?;
        for chunk in chunks {
            self.send(pb::node_message::Msg::Blocks(pb::BlockEvents {
                resync: false,
                stored: chunk.to_vec(),
                removed: Vec::new(),
            }))
            .await?;
        }
        Ok(())
    }

    /// Sends `turns.turns` as a `RetainedTurns` resync (at least one message).
    pub(crate) async fn send_turns_resync(
        &mut self,
        turns: &mut TurnSubscription,
    ) -> Result<(), ReportError> {
        let now = std::mem::take(&mut turns.turns);
        for msg in crate::turns::resync_messages(&now) {
            self.send(pb::node_message::Msg::Turns(msg)).await?;
        }
        Ok(())
    }

    /// Sends `first` and the turn events already waiting behind it, as deltas.
    pub(crate) async fn send_turn_deltas(
        &mut self,
        first: TurnEvent,
        turns: &mut TurnSubscription,
        max: usize,
    ) -> Result<(), ReportError> {
        for msg in crate::turns::turn_deltas(first, &mut turns.events, max) {
            self.send(pb::node_message::Msg::Turns(msg)).await?;
        }
        Ok(())
    }

    /// Sends `first` and the events already waiting behind it (see [`drain_deltas`]).
    pub(crate) async fn send_deltas(
        &mut self,
        first: BlockEvent,
        blocks: &mut BlockSubscription,
        max_per_message: usize,
    ) -> Result<(), ReportError> {
        for msg in drain_deltas(first, &mut blocks.events, max_per_message) {
            self.send(pb::node_message::Msg::Blocks(msg)).await?;
        }
        Ok(())
    }
}

/// `first` and up to `max - 1` events already waiting behind it, as `BlockEvents` deltas in
/// order, split so that no hash appears twice in one message (the two lists of one message
/// commute; see the proto). Never waits, and takes at most `max` events, so a node producing
/// events faster than they are sent cannot keep this loop busy. A lag noticed here is left in
/// the feed: the next `recv` reports it and the caller resyncs.
pub(crate) fn drain_deltas(
    first: BlockEvent,
    events: &mut broadcast::Receiver<BlockEvent>,
    max: usize,
) -> Vec<pb::BlockEvents> {
    let mut out = Vec::new();
    let mut batch = DeltaBatch::default();
    batch.push(first);
    let mut taken = 1;
    while taken < max {
        let Ok(event) = events.try_recv() else {
            break;
        };
        if batch.hashes.contains(&event.hash()) {
            out.push(batch.take());
        }
        batch.push(event);
        taken += 1;
    }
    out.push(batch.take());
    out
}

/// A `BlockEvents` delta being built.
#[derive(Default)]
struct DeltaBatch {
    stored: Vec<u64>,
    removed: Vec<u64>,
    hashes: HashSet<u64>,
}

impl DeltaBatch {
    fn push(&mut self, event: BlockEvent) {
        self.hashes.insert(event.hash());
        match event {
            BlockEvent::Stored(h) => self.stored.push(h),
            BlockEvent::Removed(h) => self.removed.push(h),
        }
    }

    fn take(&mut self) -> pb::BlockEvents {
        self.hashes.clear();
        pb::BlockEvents {
            resync: false,
            stored: std::mem::take(&mut self.stored),
            removed: std::mem::take(&mut self.removed),
        }
    }
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_keep_order_and_never_repeat_a_hash_within_one_message() {
        let feed = crate::StoredBlocks::with_capacity(64);
        let mut sub = feed.subscribe();
        feed.insert(7);
        feed.insert(8);
        feed.remove(7);
        feed.insert(7);
        feed.insert(9);
        let first = sub.events.try_recv().expect("an event");
        let msgs: Vec<_> = drain_deltas(first, &mut sub.events, 64)
            .into_iter()
            .map(|m| (m.resync, m.stored, m.removed))
            .collect();
        assert_eq!(
            msgs,
            vec![
                (false, vec![7, 8], vec![]),
                (false, vec![], vec![7]),
                (false, vec![7, 9], vec![]),
            ]
        );
    }

    #[test]
    fn one_drain_takes_at_most_max_events() {
        let feed = crate::StoredBlocks::with_capacity(64);
        let mut sub = feed.subscribe();
        for h in 0..10 {
            feed.insert(h);
        }
        let first = sub.events.try_recv().expect("an event");
        let msgs = drain_deltas(first, &mut sub.events, 4);
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].stored, vec![0, 1, 2, 3]);
        let next = sub.events.try_recv().expect("the rest stays in the feed");
        assert_eq!(next, BlockEvent::Stored(4));
    }
}
