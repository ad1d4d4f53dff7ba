//! Round-robin: candidates rotated by `request.seq`, children dealt over the decode nodes
//! (see the [module docs](super)).

use super::route;
use crate::{Decision, DecodeTarget, Request, Route, View};

/// Every candidate list (in index order) rotated left by `request.seq % len`: candidate
/// `seq % len` first, then the ones after it, wrapping around. The `n` children are dealt one
/// at a time over the rotated decode list ([`deal`]). Same rules as `policies/round-robin`.
pub fn round_robin(request: &Request, view: &View) -> Decision {
    let mut d = route(request, view, |_, mut c| {
        if !c.is_empty() {
            let start = (request.seq % c.len() as u64) as usize;
            c.rotate_left(start);
        }
        c
    });
    if let Route::Split(split) = &mut d.route {
        deal(&mut split.decode, request.n);
    }
    d
}

/// Deals `n` children one at a time over `targets` in order: entry `j` of `k` gets
/// `n / k + (j < n % k)` children, and at least 1 (an entry past the `n`-th is a failover
/// candidate: the gateway places all children before it reaches that entry).
pub fn deal(targets: &mut [DecodeTarget], n: u32) {
    let k = targets.len() as u32;
    if k == 0 {
        return;
    }
    let n = n.max(1);
    for (j, t) in (0u32..).zip(targets.iter_mut()) {
        t.children = (n / k + u32::from(j < n % k)).max(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::tests::{node, request, view};
    use crate::{Role, Route};

    #[test]
    fn rotates_by_seq_and_skips_draining() {
        let v = view(vec![
            node(Role::Standalone, 0, 1, false),
            node(Role::Standalone, 0, 1, true),
            node(Role::Standalone, 0, 1, false),
            node(Role::Standalone, 0, 1, false),
        ]);
        let whole = |seq| round_robin(&request(seq, 1, vec![]), &v).route;
        assert_eq!(whole(0), Route::Whole(vec![0, 2, 3]));
        assert_eq!(whole(1), Route::Whole(vec![2, 3, 0]));
        assert_eq!(whole(2), Route::Whole(vec![3, 0, 2]));
        assert_eq!(whole(3), Route::Whole(vec![0, 2, 3]));
        assert_eq!(whole(u64::MAX), Route::Whole(vec![0, 2, 3]));
    }

    #[test]
    fn deals_children_over_the_decode_nodes() {
        let v = view(vec![
            node(Role::Prefill, 0, 1, false),
            node(Role::Decode, 0, 1, false),
            node(Role::Decode, 0, 1, false),
            node(Role::Decode, 0, 1, false),
        ]);
        let children = |seq, n| match round_robin(&request(seq, n, vec![]), &v).route {
            Route::Split(s) => s
                .decode
                .iter()
                .map(|t| (t.node, t.children))
                .collect::<Vec<_>>(),
            r => panic!("{r:?}"),
        };
        assert_eq!(children(0, 1), vec![(1, 1), (2, 1), (3, 1)]);
        assert_eq!(children(0, 3), vec![(1, 1), (2, 1), (3, 1)]);
        assert_eq!(children(1, 5), vec![(2, 2), (3, 2), (1, 1)]);
        assert_eq!(children(0, 8), vec![(1, 3), (2, 3), (3, 2)]);
    }
}
