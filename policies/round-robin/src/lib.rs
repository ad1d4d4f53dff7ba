//! Round-robin routing policy, as a WebAssembly component for pd-gateway.
//!
//! The same rules as `pd_policy::native::round_robin`; the gateway's tests check that both
//! give the same decision on the same inputs. A policy keeps no state between calls, so it
//! counts with `request.seq`. Written against `pd:policy@1.0.0` (`wit/policy.wit`): the
//! view comes as columns, node `i` at index `i` of each per-node list, and each role's nodes
//! as a list of indices.
//!
//! - Candidates for a role: its nodes that are not draining, or all its nodes when every one of
//!   them is draining, in index order.
//! - Route: if the view has a prefill and a decode node, split; else, if it has a standalone
//!   node, whole; else reject with 503.
//! - Children: dealt one at a time over the ranked decode list, so n>1 spreads over the
//!   decode nodes: entry `j` of `k` gets `n / k + (j < n % k)` children, and at least 1 (an
//!   entry past the `n`-th is only a failover candidate).
//! - Rank: the candidate list rotated left by `seq % len` (candidate `seq % len` first, then
//!   the ones after it, wrapping around).

#![no_std]

extern crate alloc;

use alloc::string::ToString;
use alloc::vec::Vec;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../wit" });

use pd::policy::types::{Rejection, Route, Split};

struct RoundRobin;

export!(RoundRobin);

/// Message of the 503 when no node can serve the request.
const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

impl Guest for RoundRobin {
    fn decide(request: Request, view: View) -> Decision {
        let seq = request.seq;
        let v = &view;
        let route = if !v.prefill.is_empty() && !v.decode.is_empty() {
            let decode = rotated(candidates(v, &v.decode), seq);
            Route::Split(Split {
                prefill: rotated(candidates(v, &v.prefill), seq),
                children: dealt(decode.len(), request.n),
                decode,
            })
        } else if !v.standalone.is_empty() {
            Route::Whole(rotated(candidates(v, &v.standalone), seq))
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

/// The nodes of `role` (one of the view's role lists) that are not draining, or all of them
/// when every one drains; ascending.
fn candidates(v: &View, role: &[u32]) -> Vec<u32> {
    let mut live = Vec::with_capacity(role.len());
    // Both lists are ascending: one cursor walks `draining` beside the role's nodes.
    let mut next_draining = v.draining.iter().copied().peekable();
    for &i in role {
        while next_draining.next_if(|&d| d < i).is_some() {}
        if next_draining.peek() != Some(&i) {
            live.push(i);
        }
    }
    if live.is_empty() {
        live.extend_from_slice(role);
    }
    live
}

/// `c` rotated left by `seq % c.len()`.
fn rotated(mut c: Vec<u32>, seq: u64) -> Vec<u32> {
    if !c.is_empty() {
        let start = (seq % c.len() as u64) as usize;
        c.rotate_left(start);
    }
    c
}

/// `n` children dealt one at a time over `k` decode entries, at least 1 per entry.
fn dealt(k: usize, n: u32) -> Vec<u32> {
    let n = n.max(1);
    let k32 = k as u32;
    (0..k32)
        .map(|j| (n / k32 + u32::from(j < n % k32)).max(1))
        .collect()
}
