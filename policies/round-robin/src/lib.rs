//! Round-robin routing policy, as a WebAssembly component for pd-gateway.
//!
//! The same rules as `pd_policy::native::round_robin`; the gateway's tests check that both
//! give the same decision on the same inputs. A policy keeps no state between calls, so it
//! counts with `request.seq`. Written against `pd:policy@0.2.0` (`wit/0.2.0/policy.wit`): the
//! view comes as columns, node `i` at index `i` of each list.
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

wit_bindgen::generate!({
    world: "pd:policy/policy@0.2.0",
    path: "../../wit/0.2.0",
    generate_all,
});

use pd::policy0_1_0::types::{DecodeTarget, Rejection, Route, Split};

struct RoundRobin;

export!(RoundRobin);

/// Message of the 503 when no node can serve the request.
const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

impl Guest for RoundRobin {
    fn decide(request: Request, view: View) -> Decision {
        let seq = request.seq;
        let [prefill, decode, standalone] = candidates(&view);
        let route = if !prefill.is_empty() && !decode.is_empty() {
            Route::Split(Split {
                prefill: rotated(prefill, seq),
                decode: dealt(rotated(decode, seq), request.n),
            })
        } else if !standalone.is_empty() {
            Route::Whole(rotated(standalone, seq))
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

/// The indices of each role's candidates (prefill, decode, standalone), ascending, in one pass
/// over the view: a role's nodes that are not draining, or all of them when every one drains.
fn candidates(v: &View) -> [Vec<u32>; 3] {
    let n = v.roles.len();
    let mut live: [Vec<u32>; 3] = core::array::from_fn(|_| Vec::with_capacity(n));
    let mut draining: [Vec<u32>; 3] = Default::default();
    // `draining` is ascending: one cursor walks it beside the nodes.
    let mut next_draining = v.draining.iter().copied().peekable();
    for (i, role) in (0u32..).zip(&v.roles) {
        let drains = next_draining.next_if(|&d| d <= i).is_some_and(|d| d == i);
        // `Role`'s discriminants are its WIT order: prefill, decode, standalone.
        let slot = *role as usize;
        if drains {
            &mut draining[slot]
        } else {
            &mut live[slot]
        }
        .push(i);
    }
    for (live, draining) in live.iter_mut().zip(draining) {
        if live.is_empty() {
            *live = draining;
        }
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

/// `n` children dealt one at a time over `nodes`, at least 1 per entry.
fn dealt(nodes: Vec<u32>, n: u32) -> Vec<DecodeTarget> {
    let k = nodes.len() as u32;
    let n = n.max(1);
    (0u32..)
        .zip(nodes)
        .map(|(j, node)| DecodeTarget {
            node,
            children: (n / k + u32::from(j < n % k)).max(1),
        })
        .collect()
}
