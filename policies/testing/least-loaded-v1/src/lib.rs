//! Test-only guest: the least-loaded policy as it shipped on `pd:policy@0.1.0` (the view as a
//! list of `node` records), before `policies/least-loaded` moved to 0.2.0. The host's tests
//! check that a 0.1.0 Rust guest still decides as the native copy does, and the decide bench
//! measures the two contracts against each other with the same rules.
//!
//! - Candidates for a role: its nodes that are not draining, or all its nodes when every one of
//!   them is draining.
//! - Route: if the view has a prefill and a decode node, split (prefill ranked, decode ranked,
//!   each decode entry taking all `n` children: one pull, children forked on that node, the
//!   other entries are failover); else, if it has a standalone node, whole (standalone ranked);
//!   else reject with 503.
//! - Rank: load = `waiting + running + waiting-remote-kv`, lowest first; then most
//!   `free-blocks` first; then lowest index first.

#![no_std]

extern crate alloc;

use alloc::string::ToString;
use alloc::vec::Vec;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../../wit" });

use pd::policy::types::{DecodeTarget, Node, Rejection, Role, Route, Split};

struct LeastLoaded;

export!(LeastLoaded);

/// Message of the 503 when no node can serve the request.
const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

impl Guest for LeastLoaded {
    fn decide(request: Request, view: View) -> Decision {
        let nodes = &view.nodes;
        let has = |role: Role| nodes.iter().any(|n| n.role == role);
        let route = if has(Role::Prefill) && has(Role::Decode) {
            Route::Split(Split {
                prefill: ranked(nodes, candidates(nodes, Role::Prefill)),
                decode: ranked(nodes, candidates(nodes, Role::Decode))
                    .into_iter()
                    .map(|node| DecodeTarget {
                        node,
                        children: request.n.max(1),
                    })
                    .collect(),
            })
        } else if has(Role::Standalone) {
            Route::Whole(ranked(nodes, candidates(nodes, Role::Standalone)))
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
fn ranked(nodes: &[Node], mut c: Vec<u32>) -> Vec<u32> {
    c.sort_unstable_by_key(|&i| {
        let n = &nodes[i as usize];
        (load(n), core::cmp::Reverse(n.free_blocks), i)
    });
    c
}
