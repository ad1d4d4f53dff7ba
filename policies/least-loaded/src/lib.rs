//! Least-loaded routing policy, as a WebAssembly component for pd-gateway.
//!
//! The same rules as `pd_policy::native::least_loaded` (the gateway's built-in fallback); the
//! gateway's tests check that both give the same decision on the same inputs. Written against
//! `pd:policy@0.2.0` (`wit/0.2.0/policy.wit`): the view comes as columns, node `i` at index `i`
//! of each list.
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

wit_bindgen::generate!({
    world: "pd:policy/policy@0.2.0",
    path: "../../wit/0.2.0",
    generate_all,
});

use pd::policy0_1_0::types::{DecodeTarget, Rejection, Role, Route, Split};

struct LeastLoaded;

export!(LeastLoaded);

/// Message of the 503 when no node can serve the request.
const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

impl Guest for LeastLoaded {
    fn decide(request: Request, view: View) -> Decision {
        let has = |role: Role| view.roles.contains(&role);
        let route = if has(Role::Prefill) && has(Role::Decode) {
            Route::Split(Split {
                prefill: ranked(&view, candidates(&view, Role::Prefill)),
                decode: ranked(&view, candidates(&view, Role::Decode))
                    .into_iter()
                    .map(|node| DecodeTarget {
                        node,
                        children: request.n.max(1),
                    })
                    .collect(),
            })
        } else if has(Role::Standalone) {
            Route::Whole(ranked(&view, candidates(&view, Role::Standalone)))
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

/// Requests on node `i`: queued, running, and parked waiting for KV.
fn load(v: &View, i: u32) -> u64 {
    let i = i as usize;
    u64::from(v.waiting[i]) + u64::from(v.running[i]) + u64::from(v.waiting_remote_kv[i])
}

/// Indices of the nodes of `role`, not draining ones unless all of them drain.
fn candidates(v: &View, role: Role) -> Vec<u32> {
    let pick = |draining_ok: bool| -> Vec<u32> {
        (0u32..)
            .zip(&v.roles)
            .filter(|&(i, r)| *r == role && (draining_ok || !v.draining.contains(&i)))
            .map(|(i, _)| i)
            .collect()
    };
    let live = pick(false);
    if live.is_empty() { pick(true) } else { live }
}

/// Least load first, then most free blocks, then lowest index (keys are unique: the index
/// is part of them, so an unstable sort is exact).
fn ranked(v: &View, mut c: Vec<u32>) -> Vec<u32> {
    c.sort_unstable_by_key(|&i| (load(v, i), core::cmp::Reverse(v.free_blocks[i as usize]), i));
    c
}
