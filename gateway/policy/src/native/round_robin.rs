//! Round-robin: candidates rotated by `request.seq` (see the [module docs](super)).

use super::route;
use crate::{Decision, Request, View};

/// Every candidate list (in index order) rotated left by `request.seq % len`: candidate
/// `seq % len` first, then the ones after it, wrapping around. Same rules as
/// `policies/round-robin`.
pub fn round_robin(request: &Request, view: &View) -> Decision {
    route(request, view, |_, mut c| {
        if !c.is_empty() {
            let start = (request.seq % c.len() as u64) as usize;
            c.rotate_left(start);
        }
        c
    })
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
}
