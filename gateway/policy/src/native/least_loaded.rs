//! Least-loaded: every list in least-loaded order (see the [module docs](super)).

use super::{least_loaded_key, route};
use crate::{Decision, Request, View};

/// Every candidate list in least-loaded order: load (`waiting + running + waiting_remote_kv`)
/// ascending, then `free_blocks` descending, then index ascending. The gateway's built-in
/// fallback. Same rules as `policies/least-loaded`.
pub fn least_loaded(request: &Request, view: &View) -> Decision {
    route(request, view, |_, mut c| {
        c.sort_unstable_by_key(|&i| least_loaded_key(&view.nodes, i));
        c
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::tests::{node, request, view};
    use crate::{Role, Route};

    #[test]
    fn orders_by_load_then_free_blocks_then_index() {
        let v = view(vec![
            node(Role::Standalone, 5, 100, false), // load 5
            node(Role::Standalone, 1, 10, false),  // load 1, fewer free
            node(Role::Standalone, 1, 50, false),  // load 1, more free
            node(Role::Standalone, 1, 50, false),  // tie with 2 → index
        ]);
        let d = least_loaded(&request(0, 1, vec![]), &v);
        assert_eq!(d.route, Route::Whole(vec![2, 3, 1, 0]));
    }

    #[test]
    fn concurrent_callers_agree() {
        let v = view(vec![
            node(Role::Standalone, 3, 1, false),
            node(Role::Standalone, 2, 1, false),
        ]);
        let r = request(0, 1, vec![]);
        let want = least_loaded(&r, &v);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        assert_eq!(least_loaded(&r, &v), want);
                    }
                });
            }
        });
    }
}
