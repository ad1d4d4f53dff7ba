//! Prefix-aware: cached prefix against load (see the [module docs](super)).

use super::{least_loaded_key, route};
use crate::{Decision, Node, Request, Role, View};
use std::cmp::Reverse;

/// Prefill and whole lists by score `prefix_blocks[i] - (waiting + running)` descending
/// (`i64`; a node past the end of `request.prefix_blocks` holds 0 blocks), ties in
/// least-loaded order; the decode list in least-loaded order (a decode node pulls the KV, its
/// cache does not matter). Same rules as `policies/prefix-aware`.
///
/// One cached block counts as much as one queued or running request: a node holding 10 more
/// blocks of the prompt wins over a node with up to 9 more requests on it.
pub fn prefix_aware(request: &Request, view: &View) -> Decision {
    let nodes = &view.nodes;
    route(request, view, |role, mut c| {
        if role == Role::Decode {
            c.sort_unstable_by_key(|&i| least_loaded_key(nodes, i));
        } else {
            c.sort_unstable_by_key(|&i| {
                (
                    Reverse(score(request, nodes, i)),
                    least_loaded_key(nodes, i),
                )
            });
        }
        c
    })
}

/// Cached prefix blocks of node `i` minus its queued and running requests.
fn score(request: &Request, nodes: &[Node], i: u32) -> i64 {
    let n = &nodes[i as usize];
    let prefix = request.prefix_blocks.get(i as usize).copied().unwrap_or(0);
    i64::from(prefix) - i64::from(n.waiting) - i64::from(n.running)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::tests::{node, request, view};
    use crate::{DecodeTarget, Route, Split};

    #[test]
    fn prefix_beats_small_load_difference() {
        let v = view(vec![
            node(Role::Prefill, 0, 10, false),
            node(Role::Prefill, 3, 10, false),
            node(Role::Decode, 2, 10, false),
            node(Role::Decode, 0, 10, false),
        ]);
        // Node 1 holds 8 blocks: 8 - 3 = 5 > 0 - 0.
        let d = prefix_aware(&request(0, 2, vec![0, 8, 0, 0]), &v);
        let want = Split {
            prefill: vec![1, 0],
            decode: vec![
                DecodeTarget {
                    node: 3,
                    children: 2,
                },
                DecodeTarget {
                    node: 2,
                    children: 2,
                },
            ],
        };
        assert_eq!(d.route, Route::Split(want));
        // Without the prefix, least-loaded order.
        let d = prefix_aware(&request(0, 1, vec![]), &v);
        let Route::Split(s) = d.route else {
            panic!("expected split")
        };
        assert_eq!(s.prefill, vec![0, 1]);
    }
}
