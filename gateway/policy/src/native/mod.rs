//! Native policies: plain Rust, the same rules as the guest policies in `policies/`.
//!
//! The gateway's built-in fallback (when a WASM policy traps, times out or answers an invalid
//! decision) is [`least_loaded`]. The tests in `tests/` check that each guest component and
//! its native copy decide the same on the same inputs; the logic is written twice on purpose,
//! so each guest stays a self-contained example for policy authors.
//!
//! Rules every policy here shares (and that a Python/JS/Go port must match):
//!
//! - **Candidates** for a role: the view's nodes of that role that are not draining, in index
//!   order; when every node of that role is draining, all of them.
//! - **Route**: if the view has at least one prefill and one decode node (draining or not),
//!   [`Route::Split`]: the prefill candidates ranked, and the decode candidates ranked, each
//!   as a decode target with `children = max(request.n, 1)` (all children on the first one:
//!   one pull, children forked copy-on-write there; the others are failover). Otherwise, if it
//!   has a standalone node, [`Route::Whole`] with the standalone candidates ranked. Otherwise
//!   [`Route::Reject`] with status 503 and [`NO_NODES`].
//! - `reverse-pull`: none (but for [`prefix_aware`]'s multi-turn rule).
//! - **Load** of a node: `waiting + running + waiting_remote_kv` (in `u64`).
//! - **Least-loaded order**: load ascending, then `free_blocks` descending, then index
//!   ascending.
//!
//! Per policy, the ranking:
//!
//! - [`least_loaded`]: least-loaded order, for every list.
//! - [`round_robin`]: candidates in index order, rotated left by `request.seq % len`; the
//!   decode list's children dealt one at a time over it ([`round_robin::deal`]: entry `j` of
//!   `k` gets `n / k + (j < n % k)`, at least 1), so n>1 spreads over the decode nodes.
//! - [`prefix_aware`]: prefill and whole lists by score
//!   `prefix_blocks[i] - (waiting + running)` descending (`i64`; a node past the end of
//!   `request.prefix_blocks` holds 0 blocks), ties in least-loaded order; decode list in
//!   least-loaded order. Then its multi-turn rule, when a node holds an earlier turn of the
//!   conversation (`conversation-tokens`): the turn goes `whole` to that node when it adds few
//!   new tokens and the node is not overloaded, else P pulls the turn back when that is
//!   cheaper than recomputing it ([`prefix_aware::Thresholds`]).

mod least_loaded;
pub mod prefix_aware;
pub mod round_robin;

pub use least_loaded::least_loaded;
pub use prefix_aware::prefix_aware;
pub use round_robin::round_robin;

use crate::{
    Decision, DecodeTarget, Measured, Node, PolicyError, Rejection, Request, Role, Route, Split,
    View,
};

/// Message of the 503 a policy answers when no node can serve the request.
pub const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

/// The native policies, by the name an operator uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NativePolicy {
    /// [`least_loaded`], named `least-loaded`.
    LeastLoaded,
    /// [`round_robin`], named `round-robin`.
    RoundRobin,
    /// [`prefix_aware`], named `prefix-aware`.
    PrefixAware,
}

impl NativePolicy {
    /// Every native policy.
    pub const ALL: [NativePolicy; 3] = [
        NativePolicy::LeastLoaded,
        NativePolicy::RoundRobin,
        NativePolicy::PrefixAware,
    ];

    /// The policy named `name` (`least-loaded`, `round-robin`, `prefix-aware`).
    ///
    /// # Errors
    ///
    /// [`PolicyError::UnknownNative`] for any other name.
    pub fn from_name(name: &str) -> Result<Self, PolicyError> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| PolicyError::UnknownNative {
                name: name.to_string(),
            })
    }

    /// The operator-facing name.
    pub fn name(self) -> &'static str {
        match self {
            NativePolicy::LeastLoaded => "least-loaded",
            NativePolicy::RoundRobin => "round-robin",
            NativePolicy::PrefixAware => "prefix-aware",
        }
    }

    /// Decides where `request` goes, no rates measured.
    pub fn decide(self, request: &Request, view: &View) -> Decision {
        self.decide_measured(request, view, &Measured::default())
    }

    /// Decides where `request` goes, with what the nodes measured (only [`prefix_aware`]
    /// reads it).
    pub fn decide_measured(self, request: &Request, view: &View, measured: &Measured) -> Decision {
        match self {
            NativePolicy::LeastLoaded => least_loaded(request, view),
            NativePolicy::RoundRobin => round_robin(request, view),
            NativePolicy::PrefixAware => prefix_aware::prefix_aware_with(
                request,
                view,
                measured,
                &prefix_aware::Thresholds::default(),
            ),
        }
    }
}

/// Requests on a node: queued, running, and parked waiting for KV.
fn load(n: &Node) -> u64 {
    u64::from(n.waiting) + u64::from(n.running) + u64::from(n.waiting_remote_kv)
}

/// Sort key of the least-loaded order.
fn least_loaded_key(nodes: &[Node], i: u32) -> (u64, std::cmp::Reverse<u32>, u32) {
    let n = &nodes[i as usize];
    (load(n), std::cmp::Reverse(n.free_blocks), i)
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

/// The route shape shared by all native policies; `rank(role, candidates)` orders a list.
fn route(
    request: &Request,
    view: &View,
    mut rank: impl FnMut(Role, Vec<u32>) -> Vec<u32>,
) -> Decision {
    let nodes = &view.nodes;
    let has = |role: Role| nodes.iter().any(|n| n.role == role);
    let route = if has(Role::Prefill) && has(Role::Decode) {
        let prefill = rank(Role::Prefill, candidates(nodes, Role::Prefill));
        let decode = rank(Role::Decode, candidates(nodes, Role::Decode))
            .into_iter()
            .map(|node| DecodeTarget {
                node,
                children: request.n.max(1),
            })
            .collect();
        Route::Split(Split { prefill, decode })
    } else if has(Role::Standalone) {
        Route::Whole(rank(Role::Standalone, candidates(nodes, Role::Standalone)))
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::Api;

    /// A node with `waiting` queued requests and `free_blocks` free blocks.
    pub(crate) fn node(role: Role, waiting: u32, free_blocks: u32, draining: bool) -> Node {
        Node {
            role,
            free_blocks,
            total_blocks: 1000,
            leased_blocks: 0,
            waiting,
            running: 0,
            waiting_remote_kv: 0,
            draining,
            conversation_tokens: 0,
            conversation_expiry_ms: 0,
        }
    }

    pub(crate) fn view(nodes: Vec<Node>) -> View {
        View { nodes }
    }

    pub(crate) fn request(seq: u64, n: u32, prefix_blocks: Vec<u32>) -> Request {
        Request {
            seq,
            api: Api::ChatCompletions,
            prompt_tokens: 100,
            block_size: 16,
            block_hashes: vec![],
            prefix_blocks,
            n,
            max_tokens: None,
            stream: false,
            conversation_key: None,
        }
    }

    #[test]
    fn shapes() {
        let r = request(0, 3, vec![]);
        for p in NativePolicy::ALL {
            // Empty view, prefill only, decode only: 503.
            for nodes in [
                vec![],
                vec![node(Role::Prefill, 0, 1, false)],
                vec![node(Role::Decode, 0, 1, false)],
            ] {
                let d = p.decide(&r, &view(nodes));
                assert_eq!(
                    d.route,
                    Route::Reject(Rejection {
                        status: 503,
                        message: NO_NODES.into()
                    }),
                    "{p:?}"
                );
            }
            // Prefill + standalone: whole on the standalone node.
            let v = view(vec![
                node(Role::Prefill, 0, 1, false),
                node(Role::Standalone, 0, 1, true),
            ]);
            assert_eq!(p.decide(&r, &v).route, Route::Whole(vec![1]), "{p:?}");
            // All prefill nodes draining: still a split, on the draining ones; n on each decode.
            let v = view(vec![
                node(Role::Prefill, 0, 1, true),
                node(Role::Decode, 0, 1, false),
                node(Role::Standalone, 0, 1, false),
            ]);
            let want = Split {
                prefill: vec![0],
                decode: vec![DecodeTarget {
                    node: 1,
                    children: 3,
                }],
            };
            assert_eq!(p.decide(&r, &v).route, Route::Split(want), "{p:?}");
            assert_eq!(p.decide(&r, &v).reverse_pull, None);
            assert_eq!(NativePolicy::from_name(p.name()).ok(), Some(p));
        }
        assert!(matches!(
            NativePolicy::from_name("first-node"),
            Err(PolicyError::UnknownNative { .. })
        ));
    }
}
