//! The 0.2.0 view (`pd:policy/cluster@0.2.0`): the nodes as columns, with the rates they
//! measure.
//!
//! The gateway keeps one view shape, 0.1.0's [`View`] of records (its admin API, decision
//! records and native policies read it), plus what 0.2.0 adds to it ([`Measured`]: each node's
//! [`Rates`], the model's KV bytes per token). A 0.2.0 policy's call builds the columns from
//! both ([`columns`]): ten vectors, each lowered into the guest as one copy.

use crate::View;
use crate::bindings::v2::pd::policy0_2_0::cluster::{Holding, View as Columns};

/// What a node measures of itself and reports in its state stream (0: not measured yet).
/// 0.2.0 policies see these in their view; 0.1.0 has no place for them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Rates {
    /// Prompt tokens per second its prefill steps compute (moving average).
    pub prefill_tokens_per_s: u32,
    /// Bandwidth of its KV pulls, MB/s (10^6 bytes; moving average).
    pub pull_mb_per_s: u32,
}

/// What the nodes report about themselves beyond 0.1.0's view: the facts 0.2.0's view adds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Measured {
    /// `rates[i]` is what `view.nodes[i]` measured; missing entries read as not measured.
    pub rates: Vec<Rates>,
    /// Bytes of KV per token of the model's nodes (all layers, K and V, as stored): what a
    /// pull moves per token (0: unknown).
    pub kv_bytes_per_token: u32,
}

impl Measured {
    /// Node `i`'s rates (not measured when missing).
    pub fn rates_of(&self, i: usize) -> Rates {
        self.rates.get(i).copied().unwrap_or_default()
    }
}

/// `view` and `measured` as the 0.2.0 view. The conversation is the node with the most
/// `conversation_tokens` (ties to the lowest index), as 0.1.0 policies are told to find it.
pub(crate) fn columns(view: &View, measured: &Measured) -> Columns {
    let n = view.nodes.len();
    let mut c = Columns {
        roles: Vec::with_capacity(n),
        free_blocks: Vec::with_capacity(n),
        total_blocks: Vec::with_capacity(n),
        leased_blocks: Vec::with_capacity(n),
        waiting: Vec::with_capacity(n),
        running: Vec::with_capacity(n),
        waiting_remote_kv: Vec::with_capacity(n),
        draining: Vec::new(),
        prefill_tokens_per_s: Vec::with_capacity(n),
        pull_mb_per_s: Vec::with_capacity(n),
        conversation: None,
        kv_bytes_per_token: measured.kv_bytes_per_token,
    };
    for (i, node) in (0u32..).zip(&view.nodes) {
        c.roles.push(node.role);
        c.free_blocks.push(node.free_blocks);
        c.total_blocks.push(node.total_blocks);
        c.leased_blocks.push(node.leased_blocks);
        c.waiting.push(node.waiting);
        c.running.push(node.running);
        c.waiting_remote_kv.push(node.waiting_remote_kv);
        if node.draining {
            c.draining.push(i);
        }
        let r = measured.rates_of(i as usize);
        c.prefill_tokens_per_s.push(r.prefill_tokens_per_s);
        c.pull_mb_per_s.push(r.pull_mb_per_s);
        if node.conversation_tokens > c.conversation.as_ref().map_or(0, |h| h.tokens) {
            c.conversation = Some(Holding {
                node: i,
                tokens: node.conversation_tokens,
                expiry_ms: node.conversation_expiry_ms,
            });
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Node, Role};

    fn node(role: Role, draining: bool, conversation_tokens: u32) -> Node {
        Node {
            role,
            free_blocks: 10,
            total_blocks: 20,
            leased_blocks: 1,
            waiting: 2,
            running: 3,
            waiting_remote_kv: 4,
            draining,
            conversation_tokens,
            conversation_expiry_ms: conversation_tokens * 10,
        }
    }

    #[test]
    fn columns_hold_every_field_at_the_node_index() {
        let view = View {
            nodes: vec![
                node(Role::Prefill, false, 0),
                node(Role::Decode, true, 64),
                node(Role::Standalone, true, 64),
            ],
        };
        let measured = Measured {
            rates: vec![Rates {
                prefill_tokens_per_s: 900,
                pull_mb_per_s: 3000,
            }],
            kv_bytes_per_token: 1536,
        };
        let c = columns(&view, &measured);
        assert_eq!(c.roles, [Role::Prefill, Role::Decode, Role::Standalone]);
        assert_eq!(c.free_blocks, [10; 3]);
        assert_eq!(c.total_blocks, [20; 3]);
        assert_eq!(c.leased_blocks, [1; 3]);
        assert_eq!(c.waiting, [2; 3]);
        assert_eq!(c.running, [3; 3]);
        assert_eq!(c.waiting_remote_kv, [4; 3]);
        assert_eq!(c.draining, [1, 2]);
        // Rates missing for nodes 1 and 2 read as "not measured".
        assert_eq!(c.prefill_tokens_per_s, [900, 0, 0]);
        assert_eq!(c.pull_mb_per_s, [3000, 0, 0]);
        // A tie goes to the lowest index.
        assert_eq!(
            c.conversation,
            Some(Holding {
                node: 1,
                tokens: 64,
                expiry_ms: 640
            })
        );
        assert_eq!(c.kv_bytes_per_token, 1536);
        let empty = columns(&View { nodes: vec![] }, &Measured::default());
        assert_eq!((empty.conversation, empty.kv_bytes_per_token), (None, 0));
    }
}
