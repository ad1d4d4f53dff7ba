//! Test-only guest: the least-loaded policy as it shipped on `pd:policy@0.2.0` (the view as
//! columns, roles as a `list<role>`), before `policies/least-loaded` moved to 0.3.0. The host's
//! tests check that a 0.2.0 Rust guest still decides as the native copy does, and the decide
//! bench measures the contracts against each other with the same rules.
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

wit_bindgen::generate!({
    world: "pd:policy/policy@0.2.0",
    path: "../../../wit/0.2.0",
    generate_all,
});

use pd::policy0_1_0::types::{DecodeTarget, Rejection, Route, Split};

struct LeastLoaded;

export!(LeastLoaded);

/// Message of the 503 when no node can serve the request.
const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

impl Guest for LeastLoaded {
    fn decide(request: Request, view: View) -> Decision {
        let [prefill, decode, standalone] = candidates(&view);
        let route = if !prefill.is_empty() && !decode.is_empty() {
            Route::Split(Split {
                prefill: ranked(prefill),
                decode: ranked(decode)
                    .into_iter()
                    .map(|node| DecodeTarget {
                        node,
                        children: request.n.max(1),
                    })
                    .collect(),
            })
        } else if !standalone.is_empty() {
            Route::Whole(ranked(standalone))
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

/// The candidates of each role (prefill, decode, standalone) with their rank keys, in one
/// pass over the view: a role's nodes that are not draining, or all of them when every one
/// drains.
fn candidates(v: &View) -> [Vec<Key>; 3] {
    let n = v.roles.len();
    let mut live: [Vec<Key>; 3] = core::array::from_fn(|_| Vec::with_capacity(n));
    let mut draining: [Vec<Key>; 3] = Default::default();
    // `draining` is ascending: one cursor walks it beside the nodes.
    let mut next_draining = v.draining.iter().copied().peekable();
    for (i, role) in v.roles.iter().enumerate() {
        let index = i as u32;
        let drains = next_draining
            .next_if(|&d| d <= index)
            .is_some_and(|d| d == index);
        let load =
            u64::from(v.waiting[i]) + u64::from(v.running[i]) + u64::from(v.waiting_remote_kv[i]);
        let key = (load, Reverse(v.free_blocks[i]), index);
        // `Role`'s discriminants are its WIT order: prefill, decode, standalone.
        let slot = *role as usize;
        if drains {
            &mut draining[slot]
        } else {
            &mut live[slot]
        }
        .push(key);
    }
    for (live, draining) in live.iter_mut().zip(draining) {
        if live.is_empty() {
            *live = draining;
        }
    }
    live
}

/// The candidates' indices, best first.
fn ranked(mut keyed: Vec<Key>) -> Vec<u32> {
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, _, i)| i).collect()
}
