//! Prefix-aware routing policy, as a WebAssembly component for pd-gateway.
//!
//! The same rules as `pd_policy::native::prefix_aware`; the gateway's tests check that both
//! give the same decision on the same inputs.
//!
//! - Candidates for a role: its nodes that are not draining, or all its nodes when every one of
//!   them is draining.
//! - Route: if the view has a prefill and a decode node, split; else, if it has a standalone
//!   node, whole; else reject with 503. Each decode entry takes all `n` children.
//! - Prefill and whole ranking: score = `prefix-blocks[i] - (waiting + running)` (cached
//!   leading blocks of this prompt, minus the node's queued and running requests; a node past
//!   the end of `prefix-blocks` holds 0), highest first; ties in least-loaded order: load =
//!   `waiting + running + waiting-remote-kv` lowest first, then most `free-blocks`, then lowest
//!   index.
//! - Decode ranking: least-loaded order (the decode node pulls the KV, so its cache does not
//!   matter).

#![no_std]

extern crate alloc;

use alloc::string::ToString;
use alloc::vec::Vec;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../wit" });

use core::cmp::Reverse;
use pd::policy::types::{DecodeTarget, Node, Rejection, Role, Route, Split};

struct PrefixAware;

export!(PrefixAware);

/// Message of the 503 when no node can serve the request.
const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

impl Guest for PrefixAware {
    fn decide(request: Request, view: View) -> Decision {
        let nodes = &view.nodes;
        let prefix = &request.prefix_blocks;
        let has = |role: Role| nodes.iter().any(|n| n.role == role);
        let route = if has(Role::Prefill) && has(Role::Decode) {
            Route::Split(Split {
                prefill: by_prefix(nodes, prefix, candidates(nodes, Role::Prefill)),
                decode: least_loaded(nodes, candidates(nodes, Role::Decode))
                    .into_iter()
                    .map(|node| DecodeTarget {
                        node,
                        children: request.n.max(1),
                    })
                    .collect(),
            })
        } else if has(Role::Standalone) {
            Route::Whole(by_prefix(
                nodes,
                prefix,
                candidates(nodes, Role::Standalone),
            ))
        } else {
            Route::Reject(Rejection {
                status: 503,
                message: NO_NODES.to_string(),
            })
        };
        Decision {
            route,
            reverse_pull: None,
        }
    }
}

/// Requests on a node: queued, running, and parked waiting for KV.
fn load(n: &Node) -> u64 {
    u64::from(n.waiting) + u64::from(n.running) + u64::from(n.waiting_remote_kv)
}

/// Cached prefix blocks minus queued and running requests.
fn score(n: &Node, prefix_blocks: u32) -> i64 {
    i64::from(prefix_blocks) - i64::from(n.waiting) - i64::from(n.running)
}

/// Indices of the nodes of `role`, not draining ones unless all of them drain.
fn candidates(nodes: &[Node], role: Role) -> Vec<u32> {
    let pick = |draining_ok: bool| -> Vec<u32> {
        (0u32..)
            .zip(nodes)
            .filter(|(_, n)| n.role == role && (draining_ok || !n.draining))
            .map(|(i, _)| i)
            .collect()
    };
    let live = pick(false);
    if live.is_empty() { pick(true) } else { live }
}

/// Least load first, then most free blocks, then lowest index (keys are unique: the index
/// is part of them, so an unstable sort is exact).
fn least_loaded(nodes: &[Node], mut c: Vec<u32>) -> Vec<u32> {
    c.sort_unstable_by_key(|&i| {
        let n = &nodes[i as usize];
        (load(n), Reverse(n.free_blocks), i)
    });
    c
}

/// Highest score first, then least-loaded order.
fn by_prefix(nodes: &[Node], prefix: &[u32], mut c: Vec<u32>) -> Vec<u32> {
    c.sort_unstable_by_key(|&i| {
        let n = &nodes[i as usize];
        let p = prefix.get(i as usize).copied().unwrap_or(0);
        (Reverse(score(n, p)), load(n), Reverse(n.free_blocks), i)
    });
    c
}
