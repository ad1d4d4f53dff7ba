//! Checks a policy's decision against the request and view it was made for.

use crate::{Decision, Request, Role, Route, View};

/// Where in a decision a node index sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// `split.prefill`: prefill nodes only.
    Prefill,
    /// `split.decode`: decode nodes only.
    Decode,
    /// `whole`: any role.
    Whole,
    /// `reverse-pull.from`: any role.
    ReversePull,
}

impl std::fmt::Display for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Slot::Prefill => "prefill",
            Slot::Decode => "decode",
            Slot::Whole => "whole",
            Slot::ReversePull => "reverse-pull.from",
        })
    }
}

/// Why a decision is invalid (the rules in the WIT docs of `decision` and `split`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidDecision {
    /// A node index outside the view.
    #[error("{slot} names node {index}, but the view has {nodes} nodes")]
    UnknownNode {
        /// Where the index sits.
        slot: Slot,
        /// The index named.
        index: u32,
        /// Nodes in the view.
        nodes: usize,
    },
    /// A node of the wrong role for its slot (prefill on a non-prefill node, decode on a
    /// non-decode node).
    #[error("{slot} names node {index}, whose role is {role:?}")]
    WrongRole {
        /// Where the index sits ([`Slot::Prefill`] or [`Slot::Decode`]).
        slot: Slot,
        /// The index named.
        index: u32,
        /// The node's actual role.
        role: Role,
    },
    /// An empty candidate list.
    #[error("the {slot} candidate list is empty")]
    EmptyList {
        /// The empty list ([`Slot::Prefill`], [`Slot::Decode`] or [`Slot::Whole`]).
        slot: Slot,
    },
    /// A decode target with zero children.
    #[error("decode target {position} (node {node}) has zero children")]
    ZeroChildren {
        /// Position in `split.decode`.
        position: usize,
        /// Its node.
        node: u32,
    },
    /// The decode targets' children add up to less than the request's `n`.
    #[error("decode targets place {total} children, the request asks for {n}")]
    TooFewChildren {
        /// Sum of `children` over all decode targets.
        total: u64,
        /// The request's `n`.
        n: u32,
    },
    /// A split whose `children` list is not as long as its `decode` list.
    #[error("split.decode has {decode} entries but split.children has {children}")]
    ChildrenLength {
        /// Entries in `split.decode`.
        decode: usize,
        /// Entries in `split.children`.
        children: usize,
    },
    /// A rejection status outside 400..=599.
    #[error("rejection status {status} is outside 400..=599")]
    BadStatus {
        /// The status given.
        status: u16,
    },
}

/// Checks `decision` against `request` and `view`.
///
/// Invalid: a node index outside the view (any slot, `reverse-pull.from` included), a
/// non-prefill node in `split.prefill`, a non-decode node in `split.decode`, an empty
/// `split.prefill`, `split.decode` or `whole` list, a decode target with zero children,
/// children adding up to less than `request.n`, or a rejection status outside 400..=599.
/// Duplicates are allowed. The first problem found is returned.
///
/// # Errors
///
/// The first rule the decision breaks.
pub fn validate(
    decision: &Decision,
    request: &Request,
    view: &View,
) -> Result<(), InvalidDecision> {
    let nodes = &view.nodes;
    let role_of = |slot: Slot, index: u32| -> Result<Role, InvalidDecision> {
        nodes
            .get(index as usize)
            .map(|n| n.role)
            .ok_or(InvalidDecision::UnknownNode {
                slot,
                index,
                nodes: nodes.len(),
            })
    };
    let expect_role = |slot: Slot, index: u32, want: Role| -> Result<(), InvalidDecision> {
        let role = role_of(slot, index)?;
        if role == want {
            Ok(())
        } else {
            Err(InvalidDecision::WrongRole { slot, index, role })
        }
    };
    match &decision.route {
        Route::Split(split) => {
            if split.prefill.is_empty() {
                return Err(InvalidDecision::EmptyList {
                    slot: Slot::Prefill,
                });
            }
            if split.decode.is_empty() {
                return Err(InvalidDecision::EmptyList { slot: Slot::Decode });
            }
            for &index in &split.prefill {
                expect_role(Slot::Prefill, index, Role::Prefill)?;
            }
            let mut total = 0u64;
            for (position, target) in split.decode.iter().enumerate() {
                expect_role(Slot::Decode, target.node, Role::Decode)?;
                if target.children == 0 {
                    return Err(InvalidDecision::ZeroChildren {
                        position,
                        node: target.node,
                    });
                }
                total += u64::from(target.children);
            }
            if total < u64::from(request.n) {
                return Err(InvalidDecision::TooFewChildren {
                    total,
                    n: request.n,
                });
            }
        }
        Route::Whole(list) => {
            if list.is_empty() {
                return Err(InvalidDecision::EmptyList { slot: Slot::Whole });
            }
            for &index in list {
                role_of(Slot::Whole, index)?;
            }
        }
        Route::Reject(rejection) => {
            if !(400..=599).contains(&rejection.status) {
                return Err(InvalidDecision::BadStatus {
                    status: rejection.status,
                });
            }
        }
    }
    if let Some(pull) = &decision.reverse_pull {
        role_of(Slot::ReversePull, pull.from)?;
    }
    Ok(())
}
