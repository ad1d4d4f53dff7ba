//! Least-loaded routing policy, as a WebAssembly component for pd-gateway.
//!
//! The same rules as `pd_policy::native::least_loaded` (the gateway's built-in fallback); the
//! gateway's tests check that both give the same decision on the same inputs. Written against
//! `pd:policy@1.0.0` (`wit/policy.wit`): the view comes as columns, node `i` at index `i`
//! of each per-node list, and each role's nodes as a list of indices.
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
use core::cmp::Reverse;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../wit" });

use pd::policy::types::{Rejection, Route, Split};

struct LeastLoaded;

export!(LeastLoaded);

/// Message of the 503 when no node can serve the request.
const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

impl Guest for LeastLoaded {
    fn decide(request: Request, view: View) -> Decision {
        let v = &view;
        let route = if !v.prefill.is_empty() && !v.decode.is_empty() {
            let decode = ranked(v, &v.decode);
            Route::Split(Split {
                prefill: ranked(v, &v.prefill),
                children: alloc::vec![request.n.max(1); decode.len()],
                decode,
            })
        } else if !v.standalone.is_empty() {
            Route::Whole(ranked(v, &v.standalone))
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

/// A node's rank key: least load (`waiting + running + waiting-remote-kv`) first, then most
/// free blocks, then lowest index. Keys are unique (the index is part of them), so an
/// unstable sort of them is exact.
type Key = (u64, Reverse<u32>, u32);

/// The nodes of `role` (one of the view's role lists), best first: the ones not draining, or
/// all of them when every one drains. Each key is computed once, before the sort (its
/// comparisons would compute it ~2 log n times each).
fn ranked(v: &View, role: &[u32]) -> Vec<u32> {
    let key = |i: u32| -> Key {
        let n = i as usize;
        let load =
            u64::from(v.waiting[n]) + u64::from(v.running[n]) + u64::from(v.waiting_remote_kv[n]);
        (load, Reverse(v.free_blocks[n]), i)
    };
    let mut keyed: Vec<Key> = Vec::with_capacity(role.len());
    // Both lists are ascending: one cursor walks `draining` beside the role's nodes.
    let mut next_draining = v.draining.iter().copied().peekable();
    for &i in role {
        while next_draining.next_if(|&d| d < i).is_some() {}
        if next_draining.peek() != Some(&i) {
            keyed.push(key(i));
        }
    }
    if keyed.is_empty() {
        keyed.extend(role.iter().map(|&i| key(i)));
    }
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, _, i)| i).collect()
}
