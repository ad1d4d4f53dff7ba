//! `validate`: one test per `InvalidDecision` variant, and the valid shapes.

use crate::common::{node, request};
use pd_policy::{
    Decision, DecodeTarget, InvalidDecision, Rejection, ReversePull, Role, Route, Slot, Split,
    View, validate,
};

/// 0: prefill, 1: decode, 2: standalone.
fn view() -> View {
    View {
        nodes: vec![
            node(Role::Prefill, 0, 0, 1),
            node(Role::Decode, 0, 0, 1),
            node(Role::Standalone, 0, 0, 1),
        ],
    }
}

fn split(prefill: Vec<u32>, decode: Vec<(u32, u32)>) -> Decision {
    let decode = decode
        .into_iter()
        .map(|(node, children)| DecodeTarget { node, children })
        .collect();
    Decision {
        route: Route::Split(Split { prefill, decode }),
        reverse_pull: None,
    }
}

fn check(d: &Decision, n: u32) -> Result<(), InvalidDecision> {
    validate(d, &request(0, n, vec![]), &view())
}

#[test]
fn valid_shapes_pass() {
    assert_eq!(check(&split(vec![0], vec![(1, 2)]), 2), Ok(()));
    // More children than n, duplicates: fine.
    assert_eq!(check(&split(vec![0, 0], vec![(1, 1), (1, 5)]), 3), Ok(()));
    // Whole takes any role.
    let whole = Decision {
        route: Route::Whole(vec![0, 1, 2]),
        reverse_pull: None,
    };
    assert_eq!(check(&whole, 1), Ok(()));
    for status in [400, 503, 599] {
        let reject = Decision {
            route: Route::Reject(Rejection {
                status,
                message: String::new(),
            }),
            reverse_pull: None,
        };
        assert_eq!(check(&reject, 1), Ok(()));
    }
    let mut pull = split(vec![0], vec![(1, 1)]);
    pull.reverse_pull = Some(ReversePull {
        from: 2,
        min_tokens: 64,
    });
    assert_eq!(check(&pull, 1), Ok(()));
}

#[test]
fn unknown_node() {
    let err = |slot, index| {
        Err(InvalidDecision::UnknownNode {
            slot,
            index,
            nodes: 3,
        })
    };
    assert_eq!(
        check(&split(vec![3], vec![(1, 1)]), 1),
        err(Slot::Prefill, 3)
    );
    assert_eq!(
        check(&split(vec![0], vec![(1, 1), (u32::MAX, 1)]), 1),
        err(Slot::Decode, u32::MAX)
    );
    let whole = Decision {
        route: Route::Whole(vec![2, 999]),
        reverse_pull: None,
    };
    assert_eq!(check(&whole, 1), err(Slot::Whole, 999));
    let mut pull = split(vec![0], vec![(1, 1)]);
    pull.reverse_pull = Some(ReversePull {
        from: 3,
        min_tokens: 0,
    });
    assert_eq!(check(&pull, 1), err(Slot::ReversePull, 3));
}

#[test]
fn wrong_role() {
    let err = |slot, index, role| Err(InvalidDecision::WrongRole { slot, index, role });
    // Prefill on a decode node, prefill on a standalone node.
    assert_eq!(
        check(&split(vec![1], vec![(1, 1)]), 1),
        err(Slot::Prefill, 1, Role::Decode)
    );
    assert_eq!(
        check(&split(vec![0, 2], vec![(1, 1)]), 1),
        err(Slot::Prefill, 2, Role::Standalone)
    );
    // Decode on a prefill node, decode on a standalone node.
    assert_eq!(
        check(&split(vec![0], vec![(0, 1)]), 1),
        err(Slot::Decode, 0, Role::Prefill)
    );
    assert_eq!(
        check(&split(vec![0], vec![(2, 1)]), 1),
        err(Slot::Decode, 2, Role::Standalone)
    );
}

#[test]
fn empty_list() {
    let err = |slot| Err(InvalidDecision::EmptyList { slot });
    assert_eq!(check(&split(vec![], vec![(1, 1)]), 1), err(Slot::Prefill));
    assert_eq!(check(&split(vec![0], vec![]), 1), err(Slot::Decode));
    let whole = Decision {
        route: Route::Whole(vec![]),
        reverse_pull: None,
    };
    assert_eq!(check(&whole, 1), err(Slot::Whole));
}

#[test]
fn zero_children() {
    assert_eq!(
        check(&split(vec![0], vec![(1, 3), (1, 0)]), 1),
        Err(InvalidDecision::ZeroChildren {
            position: 1,
            node: 1
        })
    );
}

#[test]
fn too_few_children() {
    assert_eq!(
        check(&split(vec![0], vec![(1, 2), (1, 2)]), 5),
        Err(InvalidDecision::TooFewChildren { total: 4, n: 5 })
    );
    // Children are summed without overflow.
    assert_eq!(
        check(
            &split(vec![0], vec![(1, u32::MAX), (1, u32::MAX)]),
            u32::MAX
        ),
        Ok(())
    );
}

#[test]
fn bad_status() {
    for status in [0, 200, 399, 600, u16::MAX] {
        let reject = Decision {
            route: Route::Reject(Rejection {
                status,
                message: "no".to_string(),
            }),
            reverse_pull: None,
        };
        assert_eq!(
            check(&reject, 1),
            Err(InvalidDecision::BadStatus { status })
        );
    }
}
