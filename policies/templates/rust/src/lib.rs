//! A routing policy for pd-gateway, in Rust: least-loaded, to start from.
//!
//! The gateway calls `decide(request, view)` once per request, in a fresh instance; the
//! contract (every field, with units) is `wit/policy.wit` (`pd:policy@1.0.0`: the view as
//! one list per field, node `i` at index `i`, and each role's nodes as a list of indices). The
//! rules:
//!
//! - Candidates for a role: its nodes that are not draining, or all of them when every node of
//!   the role drains.
//! - Route: split when the view has a prefill and a decode node (every decode entry takes all
//!   `n` children: one pull, the children forked on that node; the other entries are
//!   failover); else whole on the standalone nodes; else reject with 503.
//! - Rank: load = `waiting + running + waiting-remote-kv`, lowest first; then most
//!   `free-blocks`; then lowest index.
//!
//! Build: `bash build.sh . policy.wasm`; test: `pd-gateway policy test policy.wasm --cases cases`.

wit_bindgen::generate!({ world: "policy", path: "wit" });

use pd::policy::types::{Rejection, Route, Split};
use std::cmp::Reverse;

struct Policy;

export!(Policy);

impl Guest for Policy {
    fn decide(request: Request, view: View) -> Decision {
        let v = &view;
        let route = if !v.prefill.is_empty() && !v.decode.is_empty() {
            let decode = ranked(v, &v.decode);
            Route::Split(Split {
                prefill: ranked(v, &v.prefill),
                // Children per decode entry: all `n` on each (the first takes them; the others
                // are failover).
                children: vec![request.n.max(1); decode.len()],
                decode,
            })
        } else if !v.standalone.is_empty() {
            Route::Whole(ranked(v, &v.standalone))
        } else {
            Route::Reject(Rejection {
                status: 503,
                message: "no node can serve this request: the view has no prefill+decode pair \
                          and no standalone node"
                    .to_string(),
            })
        };
        Decision {
            route,
            reverse_pull: None,
        }
    }
}

/// The nodes of `role` (one of the view's role lists), best first.
fn ranked(v: &View, role: &[u32]) -> Vec<u32> {
    let mut c: Vec<u32> = role
        .iter()
        .copied()
        .filter(|i| !v.draining.contains(i))
        .collect();
    if c.is_empty() {
        c = role.to_vec();
    }
    // Each key computed once, then sorted (keys end with the index: unique).
    let mut keyed: Vec<_> = c
        .into_iter()
        .map(|i| {
            let n = i as usize;
            let load = u64::from(v.waiting[n])
                + u64::from(v.running[n])
                + u64::from(v.waiting_remote_kv[n]);
            (load, Reverse(v.free_blocks[n]), i)
        })
        .collect();
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, _, i)| i).collect()
}
