//! [`ReportedTurns`]: the retained turns one node reports on its registry stream
//! (`pd.registry.v1.RetainedTurns`, `node/rpc/proto/registry.proto`), applied to the same
//! [`Holdings`] the proxy fills from the answers it relays, so a gateway that never saw a turn's
//! answer (another of several, or this one after a restart) still routes the next turn to its
//! holder. One per registry connection: its turns leave the index when the node resyncs them or
//! leaves the view. The params never leave the gateway (they are only indexed).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use pd_rpc::registry as pb;
use pd_wire::KvTransferParams;

use super::{Holding, Holdings};

/// Most turns indexed from one node (as the node's own bound, `pd_report::MAX_RETAINED_TURNS`).
pub const MAX_REPORTED_TURNS: usize = 65_536;
/// Largest params of one reported turn, in bytes.
const MAX_PARAMS_BYTES: usize = 64 << 10;

/// What one message changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Turns indexed.
    pub added: usize,
    /// Turns taken out (ended, or forgotten at a resync).
    pub removed: usize,
    /// Turns refused: unreadable params, another node's or incarnation's, over the bounds.
    pub refused: usize,
    /// Of the turns whose lease ended, those taken out of the index unused because their lease
    /// ran out (`pd_gateway_conversation_dropped_total{why="expired"}`).
    pub expired: usize,
}

/// The turns one registered node reported, by lease id.
#[derive(Debug)]
pub struct ReportedTurns {
    engine_id: Arc<str>,
    epoch: u64,
    /// Lease id → the key (last block hash) it was indexed under.
    by_lease: HashMap<String, u64>,
}

impl ReportedTurns {
    /// For the node `engine_id` in its incarnation `epoch` (its registration).
    pub fn new(engine_id: &str, epoch: u64) -> Self {
        Self {
            engine_id: engine_id.into(),
            epoch,
            by_lease: HashMap::new(),
        }
    }

    /// Turns of this node indexed now.
    pub fn len(&self) -> usize {
        self.by_lease.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.by_lease.is_empty()
    }

    /// Applies one message to `holdings`: a resync first forgets every turn this node reported.
    pub fn apply(&mut self, holdings: &Holdings, msg: pb::RetainedTurns) -> Applied {
        let mut out = Applied::default();
        if msg.resync {
            out.removed += self.clear(holdings);
        }
        let now = SystemTime::now();
        for ended in msg.removed {
            if let Some(key) = self.by_lease.remove(&ended.lease_id) {
                // The lease ended: the turn goes however this gateway learned it.
                let gone = holdings.remove_lease(key, &ended.lease_id, false);
                out.expired += usize::from(gone.is_some_and(|h| h.expires <= now));
                out.removed += 1;
            }
        }
        for turn in msg.added {
            match self.holding(&turn) {
                Some(h) if self.by_lease.len() < MAX_REPORTED_TURNS => {
                    let lease = h.params.remote_lease_id.clone().unwrap_or_default();
                    if let Some(old) = self.by_lease.insert(lease.clone(), h.last_hash) {
                        // Reported again (a node repeating itself): the newer word stands.
                        holdings.remove_lease(old, &lease, true);
                    }
                    holdings.insert_reported(h);
                    out.added += 1;
                }
                _ => out.refused += 1,
            }
        }
        out
    }

    /// Takes every turn this node reported out of `holdings` (it left the view, or resyncs);
    /// returns how many it had reported. A turn this gateway also captured from the answer it
    /// relayed stays (as before reports: its expiry and its holder's epoch are checked when a
    /// next turn meets it).
    pub fn clear(&mut self, holdings: &Holdings) -> usize {
        let n = self.by_lease.len();
        for (lease, key) in self.by_lease.drain() {
            holdings.remove_lease(key, &lease, true);
        }
        n
    }

    /// The holding `turn` describes, when it is a retained turn of this node's incarnation.
    fn holding(&self, turn: &pb::RetainedTurn) -> Option<Holding> {
        if turn.kv_transfer_params.len() > MAX_PARAMS_BYTES {
            return None;
        }
        let value: serde_json::Value = serde_json::from_str(&turn.kv_transfer_params).ok()?;
        let params = KvTransferParams::from_value(&value).ok()?;
        let mut h = Holding::from_params(&params)?;
        if h.engine_id != self.engine_id || h.epoch != self.epoch {
            return None;
        }
        h.prompt_key = (turn.prompt_tokens > 0 && turn.prompt_tokens <= h.tokens)
            .then_some((turn.prompt_last_block_hash, turn.prompt_tokens));
        Some(h)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{SystemTime, UNIX_EPOCH};

    use serde_json::json;

    use super::*;

    fn params(engine: &str, epoch: &str, lease: &str, hash: u64) -> String {
        let expiry = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            + 60.0;
        json!({
            "do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": engine, "remote_engine_epoch": epoch,
            "remote_block_ids": [1, 2, 3, 4], "remote_request_id": "chatcmpl-1",
            "remote_host": "127.0.0.1", "remote_port": 7000,
            "remote_num_tokens": 64, "remote_lease_id": lease,
            "remote_lease_generation": 1, "remote_blocks_expiry_time": expiry,
            "remote_last_block_hash": format!("{hash:016x}"),
        })
        .to_string()
    }

    fn turn(lease: &str, hash: u64) -> pb::RetainedTurn {
        pb::RetainedTurn {
            kv_transfer_params: params("d0", "00000000000000ab", lease, hash),
            prompt_last_block_hash: hash + 1000,
            prompt_tokens: 32,
        }
    }

    fn lease(i: u32) -> String {
        format!("{i:032x}")
    }

    fn found(idx: &Holdings, hashes: &[u64]) -> Option<(String, u32, bool)> {
        let f = idx.longest(hashes, SystemTime::now()).0?;
        Some((f.holding.engine_id.to_string(), f.tokens, f.exact))
    }

    #[test]
    fn reported_turns_are_indexed_as_captured_ones_and_end_with_their_lease() {
        let idx = Holdings::new(16);
        let mut d0 = ReportedTurns::new("d0", 0xab);
        let applied = d0.apply(
            &idx,
            pb::RetainedTurns {
                resync: true,
                added: vec![turn(&lease(1), 40), turn(&lease(2), 50)],
                removed: vec![],
            },
        );
        assert_eq!(applied.added, 2);
        assert_eq!(idx.len(), 2);
        // Found by the whole turn, and by its prompt's last block (the partial key).
        assert_eq!(found(&idx, &[10, 40]), Some(("d0".into(), 64, true)));
        assert_eq!(found(&idx, &[10, 1040, 99]), Some(("d0".into(), 32, false)));
        // A lease that ended leaves the index.
        let applied = d0.apply(
            &idx,
            pb::RetainedTurns {
                resync: false,
                added: vec![],
                removed: vec![pb::RetainedTurnEnded {
                    lease_id: lease(1),
                    last_block_hash: 40,
                }],
            },
        );
        assert_eq!(applied.removed, 1);
        assert_eq!(found(&idx, &[10, 40]), None);
        assert_eq!((idx.len(), d0.len()), (1, 1));
    }

    #[test]
    fn a_captured_and_a_reported_turn_are_one_entry() {
        let idx = Holdings::new(16);
        let raw = params("d0", "00000000000000ab", &lease(7), 70);
        let p = KvTransferParams::from_value(&serde_json::from_str(&raw).unwrap()).unwrap();
        let mut captured = Holding::from_params(&p).unwrap();
        captured.prompt_key = Some((1070, 32));
        idx.insert(captured.clone());
        let mut d0 = ReportedTurns::new("d0", 0xab);
        let msg = pb::RetainedTurns {
            resync: true,
            added: vec![turn(&lease(7), 70)],
            removed: vec![],
        };
        assert_eq!(d0.apply(&idx, msg).added, 1);
        assert_eq!(idx.len(), 1);
        assert_eq!(
            idx.longest(&[70], SystemTime::now()).0.unwrap().holding,
            captured
        );
        // Another turn under the same key (the same history retained again) replaces it, and
        // the first lease's end does not take the second out.
        let again = pb::RetainedTurns {
            resync: false,
            added: vec![turn(&lease(8), 70)],
            removed: vec![pb::RetainedTurnEnded {
                lease_id: lease(7),
                last_block_hash: 70,
            }],
        };
        d0.apply(&idx, again);
        let f = idx.longest(&[70], SystemTime::now()).0.unwrap();
        assert_eq!(f.holding.params.remote_lease_id, Some(lease(8)));
        assert_eq!(idx.len(), 1);
        // The node leaves: what only it reported goes; a turn this gateway captured stays.
        let raw = params("d0", "00000000000000ab", &lease(9), 90);
        let p = KvTransferParams::from_value(&serde_json::from_str(&raw).unwrap()).unwrap();
        idx.insert(Holding::from_params(&p).unwrap());
        d0.apply(
            &idx,
            pb::RetainedTurns {
                resync: false,
                added: vec![turn(&lease(9), 90)],
                removed: vec![],
            },
        );
        assert_eq!(d0.clear(&idx), 2);
        assert!(idx.longest(&[70], SystemTime::now()).0.is_none());
        assert!(idx.longest(&[90], SystemTime::now()).0.is_some());
    }

    #[test]
    fn a_resync_replaces_and_leaving_drops_what_the_node_reported() {
        let idx = Holdings::new(16);
        let mut d0 = ReportedTurns::new("d0", 0xab);
        let all = |added| pb::RetainedTurns {
            resync: true,
            added,
            removed: vec![],
        };
        d0.apply(&idx, all(vec![turn(&lease(1), 40), turn(&lease(2), 50)]));
        let applied = d0.apply(&idx, all(vec![turn(&lease(3), 60)]));
        assert_eq!((applied.removed, applied.added), (2, 1));
        assert_eq!(found(&idx, &[40]), None);
        assert_eq!(found(&idx, &[50]), None);
        assert!(found(&idx, &[60]).is_some());
        // Another node's holdings stay when this one leaves.
        let mut d1 = ReportedTurns::new("d1", 0xcd);
        let other = pb::RetainedTurn {
            kv_transfer_params: params("d1", "00000000000000cd", &lease(9), 90),
            prompt_last_block_hash: 0,
            prompt_tokens: 0,
        };
        d1.apply(&idx, all(vec![other]));
        assert_eq!(d0.clear(&idx), 1);
        assert_eq!(found(&idx, &[60]), None);
        assert_eq!(found(&idx, &[90]), Some(("d1".into(), 64, true)));
        assert!(d0.is_empty());
    }

    #[test]
    fn a_node_speaks_only_for_its_own_turns_within_the_bounds() {
        let idx = Holdings::new(16);
        let mut d0 = ReportedTurns::new("d0", 0xab);
        let bad = |p: String| pb::RetainedTurn {
            kv_transfer_params: p,
            prompt_last_block_hash: 0,
            prompt_tokens: 0,
        };
        let msg = pb::RetainedTurns {
            resync: true,
            added: vec![
                bad(params("d1", "00000000000000ab", &lease(1), 1)),
                bad(params("d0", "0000000000000001", &lease(2), 2)),
                bad("not json".into()),
                bad(format!("{{\"pad\": \"{}\"}}", "x".repeat(MAX_PARAMS_BYTES))),
                bad(json!({"do_remote_decode": false}).to_string()),
            ],
            removed: vec![],
        };
        let applied = d0.apply(&idx, msg);
        assert_eq!((applied.added, applied.refused), (0, 5));
        assert!(idx.is_empty());
    }
}
