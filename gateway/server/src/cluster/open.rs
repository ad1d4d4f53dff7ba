//! What the gateway itself knows of a node's load: the requests it routed there and has not
//! seen end ([`OpenRequests`]), counted by guards ([`OnNode`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use pd_rpc::registry as pb;

use super::{ConnId, sat};

/// Requests the gateway has open on one node, and decode phases it has reserved there.
///
/// A request is *open* on a node from its send (or, for a `whole` route, its decision) until
/// the node's part of it is over. A split's decode node is *reserved* from the decision until
/// P's phase ends and the gateway sends it the decode; the node knows nothing of it before.
///
/// A node reports its queue when it changes, at most every `change_poll` (100 ms), so a burst
/// of decisions would all see the same stale load and pile onto one node, and a node that has
/// just finished a request would look busy until its next report. The view therefore shows a
/// node's load as `max(open, reported + open - open_at_report)` ([`OpenRequests::adjust`]): the
/// report moved on by what the gateway itself sent and saw end since, and never below what
/// the gateway knows is open there now. Reservations come on top, as requests waiting for
/// remote KV — which they are: the decode will wait for P's KV. They are not in `waiting` or
/// `running`, because the node computes nothing for them yet: a policy asking whether a node
/// is free to prefill now must not see them as work (a conversation's holder reserved for a
/// turn still queued at P looked busy for seconds, and every later turn then went to P, see
/// docs/bench-log/multi-turn.md, "Reservations are not work").
#[derive(Debug, Default)]
pub struct OpenRequests {
    pub(super) counts: Arc<Counts>,
    /// Open requests when the node's last state arrived (the state counts those already).
    pub(super) at_state: u32,
}

/// The two counts of [`OpenRequests`], shared with the requests' guards ([`OnNode`]).
#[derive(Debug, Default)]
pub struct Counts {
    pub(super) open: AtomicU32,
    pub(super) reserved: AtomicU32,
}

impl OpenRequests {
    /// Requests open on the node now.
    pub fn now(&self) -> u32 {
        self.counts.open.load(Ordering::Acquire)
    }

    /// Decode phases reserved on the node now, not yet sent.
    pub fn reserved(&self) -> u32 {
        self.counts.reserved.load(Ordering::Acquire)
    }

    /// `(waiting, running, waiting_remote_kv)` of a report, moved on as the type docs say:
    /// requests sent since wait, requests ended since leave `running` first; reservations
    /// wait for remote KV.
    pub(super) fn adjust(&self, s: &pb::NodeState) -> (u32, u32, u32) {
        let (mut waiting, mut running, mut remote) =
            (sat(s.waiting), sat(s.running), sat(s.waiting_remote_kv));
        let reported = i64::from(waiting) + i64::from(running) + i64::from(remote);
        let open = i64::from(self.now());
        let estimate = (reported + open - i64::from(self.at_state)).max(open);
        let mut delta = estimate - reported;
        if delta >= 0 {
            waiting = waiting.saturating_add(u32::try_from(delta).unwrap_or(u32::MAX));
        } else {
            for field in [&mut running, &mut remote, &mut waiting] {
                let cut = u32::try_from(-delta).unwrap_or(u32::MAX).min(*field);
                *field -= cut;
                delta += i64::from(cut);
            }
        }
        (waiting, running, remote.saturating_add(self.reserved()))
    }
}

/// One request on a node, open or reserved: counted in [`OpenRequests`] until dropped.
#[derive(Debug)]
pub struct OnNode {
    pub(super) conn: ConnId,
    pub(super) counts: Arc<Counts>,
    pub(super) reserved: bool,
}

impl OnNode {
    /// The node's connection.
    pub fn conn(&self) -> ConnId {
        self.conn
    }

    /// The reserved decode is being sent: from now it counts as open (the same guard when it
    /// already was).
    pub fn sent(mut self) -> OnNode {
        if self.reserved {
            // Open first, so the node's total never dips between the two.
            self.counts.open.fetch_add(1, Ordering::AcqRel);
            self.counts.reserved.fetch_sub(1, Ordering::AcqRel);
            self.reserved = false;
        }
        self
    }
}

impl Drop for OnNode {
    fn drop(&mut self) {
        let count = match self.reserved {
            true => &self.counts.reserved,
            false => &self.counts.open,
        };
        count.fetch_sub(1, Ordering::AcqRel);
    }
}
