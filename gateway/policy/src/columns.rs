//! The 0.2.0 and 0.3.0 views (`pd:policy/cluster@0.2.0`, `@0.3.0`): the nodes as columns,
//! with the rates they measure.
//!
//! The gateway keeps one view shape, 0.1.0's [`View`] of records (its admin API, decision
//! records and native policies read it), plus what 0.2.0 adds to it ([`Measured`]: each node's
//! [`Rates`], the model's KV bytes per token). A 0.2.0 policy's call builds the columns from
//! both ([`columns`]): ten vectors, each lowered into the guest as one copy, but for `roles`,
//! lowered element by element. A 0.3.0 policy's call ([`indexed`]) has the roles as three index
//! lists instead, so that every list is one copy.

use crate::bindings::v2::pd::policy0_2_0::cluster::{Holding, View as Columns};
use crate::bindings::v3::pd::policy0_3_0::cluster as v3;
use crate::{Role, View};

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

/// What the 0.2.0 and 0.3.0 views share: every per-node column but the roles, the draining
/// nodes, the conversation's holder (node, tokens, expiry), the KV bytes per token.
struct Facts {
    free_blocks: Vec<u32>,
    total_blocks: Vec<u32>,
    leased_blocks: Vec<u32>,
    waiting: Vec<u32>,
    running: Vec<u32>,
    waiting_remote_kv: Vec<u32>,
    draining: Vec<u32>,
    prefill_tokens_per_s: Vec<u32>,
    pull_mb_per_s: Vec<u32>,
    conversation: Option<(u32, u32, u32)>,
    kv_bytes_per_token: u32,
}

/// [`Facts`] of `view` and `measured`. The conversation is the node with the most
/// `conversation_tokens` (ties to the lowest index), as 0.1.0 policies are told to find it.
fn facts(view: &View, measured: &Measured) -> Facts {
    let nodes = &view.nodes;
    // One pass per column: an exact-size `collect` writes each vector without a capacity check
    // per element (ten `push`es per node in one loop cost ~1.5 µs of a ~8 µs call at 64 nodes).
    let column = |field: fn(&crate::Node) -> u32| -> Vec<u32> { nodes.iter().map(field).collect() };
    let mut conversation: Option<(u32, u32, u32)> = None;
    for (i, node) in (0u32..).zip(nodes) {
        if node.conversation_tokens > conversation.map_or(0, |(_, tokens, _)| tokens) {
            conversation = Some((i, node.conversation_tokens, node.conversation_expiry_ms));
        }
    }
    Facts {
        free_blocks: column(|n| n.free_blocks),
        total_blocks: column(|n| n.total_blocks),
        leased_blocks: column(|n| n.leased_blocks),
        waiting: column(|n| n.waiting),
        running: column(|n| n.running),
        waiting_remote_kv: column(|n| n.waiting_remote_kv),
        draining: (0u32..)
            .zip(nodes)
            .filter(|(_, n)| n.draining)
            .map(|(i, _)| i)
            .collect(),
        prefill_tokens_per_s: (0..nodes.len())
            .map(|i| measured.rates_of(i).prefill_tokens_per_s)
            .collect(),
        pull_mb_per_s: (0..nodes.len())
            .map(|i| measured.rates_of(i).pull_mb_per_s)
            .collect(),
        conversation,
        kv_bytes_per_token: measured.kv_bytes_per_token,
    }
}

/// `view` and `measured` as the 0.2.0 view ([`Facts`], and the roles as a `list<role>`).
pub(crate) fn columns(view: &View, measured: &Measured) -> Columns {
    let f = facts(view, measured);
    Columns {
        roles: view.nodes.iter().map(|n| n.role).collect(),
        free_blocks: f.free_blocks,
        total_blocks: f.total_blocks,
        leased_blocks: f.leased_blocks,
        waiting: f.waiting,
        running: f.running,
        waiting_remote_kv: f.waiting_remote_kv,
        draining: f.draining,
        prefill_tokens_per_s: f.prefill_tokens_per_s,
        pull_mb_per_s: f.pull_mb_per_s,
        conversation: f.conversation.map(|(node, tokens, expiry_ms)| Holding {
            node,
            tokens,
            expiry_ms,
        }),
        kv_bytes_per_token: f.kv_bytes_per_token,
    }
}

/// `view` and `measured` as the 0.3.0 view ([`Facts`], and the roles as three ascending index
/// lists).
pub(crate) fn indexed(view: &View, measured: &Measured) -> v3::View {
    let nodes = &view.nodes;
    // Room for every node in each role list: growing them a push at a time cost more than the
    // rest of the view (a `realloc` each, under the allocator's lock).
    let mut by_role: [Vec<u32>; 3] = std::array::from_fn(|_| Vec::with_capacity(nodes.len()));
    for (i, node) in (0u32..).zip(nodes) {
        by_role[match node.role {
            Role::Prefill => 0,
            Role::Decode => 1,
            Role::Standalone => 2,
        }]
        .push(i);
    }
    let [prefill, decode, standalone] = by_role;
    let f = facts(view, measured);
    v3::View {
        prefill,
        decode,
        standalone,
        free_blocks: f.free_blocks,
        total_blocks: f.total_blocks,
        leased_blocks: f.leased_blocks,
        waiting: f.waiting,
        running: f.running,
        waiting_remote_kv: f.waiting_remote_kv,
        draining: f.draining,
        prefill_tokens_per_s: f.prefill_tokens_per_s,
        pull_mb_per_s: f.pull_mb_per_s,
        conversation: f.conversation.map(|(node, tokens, expiry_ms)| v3::Holding {
            node,
            tokens,
            expiry_ms,
        }),
        kv_bytes_per_token: f.kv_bytes_per_token,
    }
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

    #[test]
    fn indexed_view_holds_the_columns_and_each_node_in_its_role_list() {
        let view = View {
            nodes: vec![
                node(Role::Decode, false, 0),
                node(Role::Prefill, true, 0),
                node(Role::Standalone, false, 64),
                node(Role::Decode, true, 64),
                node(Role::Prefill, false, 0),
            ],
        };
        let measured = Measured {
            rates: vec![
                Rates::default(),
                Rates {
                    prefill_tokens_per_s: 900,
                    pull_mb_per_s: 3000,
                },
            ],
            kv_bytes_per_token: 1536,
        };
        let v = indexed(&view, &measured);
        assert_eq!(v.prefill, [1, 4]);
        assert_eq!(v.decode, [0, 3]);
        assert_eq!(v.standalone, [2]);
        assert_eq!(v.draining, [1, 3]);
        // Every other fact as 0.2.0's columns have it.
        let c = columns(&view, &measured);
        assert_eq!(
            (&v.free_blocks, &v.total_blocks, &v.leased_blocks),
            (&c.free_blocks, &c.total_blocks, &c.leased_blocks)
        );
        assert_eq!(
            (&v.waiting, &v.running, &v.waiting_remote_kv),
            (&c.waiting, &c.running, &c.waiting_remote_kv)
        );
        assert_eq!(v.prefill_tokens_per_s, [0, 900, 0, 0, 0]);
        assert_eq!(v.pull_mb_per_s, [0, 3000, 0, 0, 0]);
        assert_eq!(
            v.conversation,
            Some(v3::Holding {
                node: 2,
                tokens: 64,
                expiry_ms: 640
            })
        );
        assert_eq!(v.kv_bytes_per_token, 1536);
    }
}
