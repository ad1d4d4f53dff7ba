//! A routing policy for pd-gateway, in Rust: least-loaded, to start from.
//!
//! The gateway calls `decide(request, view)` once per request, in a fresh instance; the
//! contract (every field, with units) is `wit/policy.wit`. The rules:
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

use pd::policy::types::{DecodeTarget, Node, Rejection, Role, Route, Split};

struct Policy;

export!(Policy);

impl Guest for Policy {
    fn decide(request: Request, view: View) -> Decision {
        let nodes = &view.nodes;
        let has = |role: Role| nodes.iter().any(|n| n.role == role);
        let route = if has(Role::Prefill) && has(Role::Decode) {
            Route::Split(Split {
                prefill: ranked(nodes, Role::Prefill),
                decode: ranked(nodes, Role::Decode)
                    .into_iter()
                    .map(|node| DecodeTarget {
                        node,
                        children: request.n.max(1),
                    })
                    .collect(),
            })
        } else if has(Role::Standalone) {
            Route::Whole(ranked(nodes, Role::Standalone))
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

/// Requests on a node: queued, running, and parked waiting for KV.
fn load(n: &Node) -> u64 {
    u64::from(n.waiting) + u64::from(n.running) + u64::from(n.waiting_remote_kv)
}

/// Indices of the candidates of `role`, best first.
fn ranked(nodes: &[Node], role: Role) -> Vec<u32> {
    let of_role = |draining_ok: bool| -> Vec<u32> {
        (0u32..)
            .zip(nodes)
            .filter(|(_, n)| n.role == role && (draining_ok || !n.draining))
            .map(|(i, _)| i)
            .collect()
    };
    let mut c = of_role(false);
    if c.is_empty() {
        c = of_role(true);
    }
    c.sort_by_key(|&i| {
        let n = &nodes[i as usize];
        (load(n), std::cmp::Reverse(n.free_blocks), i)
    });
    c
}
