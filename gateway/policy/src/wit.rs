//! The edge between the gateway's types (`model.rs`) and the policy contract's generated
//! bindings: `pd:policy@1.0.0` (`wit/policy.wit`), world `policy`.
//!
//! The bindings are private to this crate. A call converts once at this edge: the request
//! field by field ([`request`]), the view into the contract's columns ([`view`]: one vector per
//! field, each lowered into the guest as one copy, and the roles as three index lists), and
//! the guest's answer back ([`decision`]: a split's `decode` and `children` lists into
//! [`DecodeTarget`]s, lists of different lengths an [`InvalidDecision`]). Host imports
//! (`pd:policy/host@1.0.0`) are plain, non-trappable functions implemented on the store's
//! state in `engine/host.rs`.

use crate::{
    Api, Decision, DecodeTarget, InvalidDecision, Measured, Rejection, Request, ReversePull, Role,
    Route, Split, View,
};

#[allow(missing_docs, unreachable_pub, missing_debug_implementations)]
mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "pd:policy/policy@1.0.0",
        additional_derives: [PartialEq, Eq],
    });
}

pub(crate) use bindings::pd::policy::host;
pub(crate) use bindings::pd::policy::types as contract;
pub(crate) use bindings::{Policy, PolicyPre};

/// The contract's package version.
pub(crate) const CONTRACT: &str = "1.0.0";

/// `request` in the contract's types.
pub(crate) fn request(request: &Request) -> contract::Request {
    contract::Request {
        seq: request.seq,
        api: match request.api {
            Api::ChatCompletions => contract::Api::ChatCompletions,
            Api::Completions => contract::Api::Completions,
            Api::Responses => contract::Api::Responses,
        },
        prompt_tokens: request.prompt_tokens,
        block_size: request.block_size,
        block_hashes: request.block_hashes.clone(),
        prefix_blocks: request.prefix_blocks.clone(),
        n: request.n,
        max_tokens: request.max_tokens,
        stream: request.stream,
        conversation_key: request.conversation_key.clone(),
    }
}

/// `view` and `measured` as the contract's view: every per-node field a column, the roles and
/// the draining nodes as ascending index lists, the conversation's holder the node with the
/// most `conversation_tokens` (ties to the lowest index).
pub(crate) fn view(view: &View, measured: &Measured) -> contract::View {
    let nodes = &view.nodes;
    // Room for every node in each role list: growing them a push at a time cost more than the
    // rest of the view (a `realloc` each, under the allocator's lock).
    let mut by_role: [Vec<u32>; 3] = std::array::from_fn(|_| Vec::with_capacity(nodes.len()));
    let mut conversation: Option<contract::Holding> = None;
    for (i, node) in (0u32..).zip(nodes) {
        by_role[match node.role {
            Role::Prefill => 0,
            Role::Decode => 1,
            Role::Standalone => 2,
        }]
        .push(i);
        if node.conversation_tokens > conversation.as_ref().map_or(0, |h| h.tokens) {
            conversation = Some(contract::Holding {
                node: i,
                tokens: node.conversation_tokens,
                expiry_ms: node.conversation_expiry_ms,
            });
        }
    }
    let [prefill, decode, standalone] = by_role;
    // One pass per column: an exact-size `collect` writes each vector without a capacity check
    // per element (ten `push`es per node in one loop cost ~1.5 µs of a ~8 µs call at 64 nodes).
    // Generic over the field, not a `fn` pointer: a pointer was called per element, not
    // inlined, which was a third of the host's own part at 1 024 nodes (docs/bench-log/
    // policy-decisions.md, 2026-12-02).
    fn column(nodes: &[crate::Node], field: impl Fn(&crate::Node) -> u32) -> Vec<u32> {
        nodes.iter().map(field).collect()
    }
    // Rates missing for the last nodes read as not measured (0).
    fn rates(nodes: usize, measured: &Measured, field: impl Fn(&crate::Rates) -> u32) -> Vec<u32> {
        let known = measured.rates.len().min(nodes);
        let mut out = Vec::with_capacity(nodes);
        out.extend(measured.rates[..known].iter().map(field));
        out.resize(nodes, 0);
        out
    }
    let n = nodes.len();
    contract::View {
        prefill,
        decode,
        standalone,
        free_blocks: column(nodes, |n| n.free_blocks),
        total_blocks: column(nodes, |n| n.total_blocks),
        leased_blocks: column(nodes, |n| n.leased_blocks),
        waiting: column(nodes, |n| n.waiting),
        running: column(nodes, |n| n.running),
        waiting_remote_kv: column(nodes, |n| n.waiting_remote_kv),
        draining: (0u32..)
            .zip(nodes)
            .filter(|(_, n)| n.draining)
            .map(|(i, _)| i)
            .collect(),
        prefill_tokens_per_s: rates(n, measured, |r| r.prefill_tokens_per_s),
        pull_mb_per_s: rates(n, measured, |r| r.pull_mb_per_s),
        conversation,
        kv_bytes_per_token: measured.kv_bytes_per_token,
    }
}

/// The guest's answer as the gateway's [`Decision`].
///
/// # Errors
///
/// [`InvalidDecision::ChildrenLength`] when a split's `decode` and `children` differ in
/// length; the rest is [`crate::validate`]'s to check.
pub(crate) fn decision(decision: contract::Decision) -> Result<Decision, InvalidDecision> {
    let route = match decision.route {
        contract::Route::Split(split) => {
            if split.decode.len() != split.children.len() {
                return Err(InvalidDecision::ChildrenLength {
                    decode: split.decode.len(),
                    children: split.children.len(),
                });
            }
            Route::Split(Split {
                prefill: split.prefill,
                decode: split
                    .decode
                    .into_iter()
                    .zip(split.children)
                    .map(|(node, children)| DecodeTarget { node, children })
                    .collect(),
            })
        }
        contract::Route::Whole(list) => Route::Whole(list),
        contract::Route::Reject(r) => Route::Reject(Rejection {
            status: r.status,
            message: r.message,
        }),
    };
    Ok(Decision {
        route,
        reverse_pull: decision.reverse_pull.map(|r| ReversePull {
            from: r.from,
            min_tokens: r.min_tokens,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Node, Rates};

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
    fn the_view_holds_every_field_at_the_node_index_and_each_node_in_its_role_list() {
        let nodes = vec![
            node(Role::Decode, false, 0),
            node(Role::Prefill, true, 0),
            node(Role::Standalone, false, 64),
            node(Role::Decode, true, 64),
            node(Role::Prefill, false, 0),
        ];
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
        let v = view(&View { nodes }, &measured);
        assert_eq!(v.prefill, [1, 4]);
        assert_eq!(v.decode, [0, 3]);
        assert_eq!(v.standalone, [2]);
        assert_eq!(v.draining, [1, 3]);
        assert_eq!(v.free_blocks, [10; 5]);
        assert_eq!(v.total_blocks, [20; 5]);
        assert_eq!(v.leased_blocks, [1; 5]);
        assert_eq!(v.waiting, [2; 5]);
        assert_eq!(v.running, [3; 5]);
        assert_eq!(v.waiting_remote_kv, [4; 5]);
        // Rates missing for nodes 2.. read as "not measured".
        assert_eq!(v.prefill_tokens_per_s, [0, 900, 0, 0, 0]);
        assert_eq!(v.pull_mb_per_s, [0, 3000, 0, 0, 0]);
        // A tie goes to the lowest index.
        assert_eq!(
            v.conversation,
            Some(contract::Holding {
                node: 2,
                tokens: 64,
                expiry_ms: 640
            })
        );
        assert_eq!(v.kv_bytes_per_token, 1536);
        let empty = view(&View::default(), &Measured::default());
        assert_eq!((empty.conversation, empty.kv_bytes_per_token), (None, 0));
    }

    #[test]
    fn a_split_lifts_to_decode_targets_and_mismatched_lists_are_invalid() {
        let split = |decode: Vec<u32>, children: Vec<u32>| contract::Decision {
            route: contract::Route::Split(contract::Split {
                prefill: vec![0],
                decode,
                children,
            }),
            reverse_pull: Some(contract::ReversePull {
                from: 2,
                min_tokens: 32,
            }),
        };
        let lifted = decision(split(vec![2, 1], vec![3, 1])).expect("same lengths");
        assert_eq!(
            lifted,
            Decision {
                route: Route::Split(Split {
                    prefill: vec![0],
                    decode: vec![
                        DecodeTarget {
                            node: 2,
                            children: 3
                        },
                        DecodeTarget {
                            node: 1,
                            children: 1
                        },
                    ],
                }),
                reverse_pull: Some(ReversePull {
                    from: 2,
                    min_tokens: 32
                }),
            }
        );
        for (decode, children) in [(vec![2, 1], vec![3]), (vec![2], vec![1, 1])] {
            assert_eq!(
                decision(split(decode.clone(), children.clone())),
                Err(InvalidDecision::ChildrenLength {
                    decode: decode.len(),
                    children: children.len(),
                })
            );
        }
    }

    #[test]
    fn the_request_keeps_every_field() {
        let r = Request {
            seq: 7,
            api: Api::Responses,
            prompt_tokens: 40,
            block_size: 16,
            block_hashes: vec![1, 2],
            prefix_blocks: vec![2, 0],
            n: 3,
            max_tokens: Some(16),
            stream: true,
            conversation_key: Some("c".into()),
        };
        let c = request(&r);
        assert_eq!(
            (
                c.seq,
                c.api,
                c.prompt_tokens,
                c.block_size,
                c.n,
                c.max_tokens,
                c.stream
            ),
            (7, contract::Api::Responses, 40, 16, 3, Some(16), true)
        );
        assert_eq!((c.block_hashes, c.prefix_blocks), (vec![1, 2], vec![2, 0]));
        assert_eq!(c.conversation_key.as_deref(), Some("c"));
    }
}
