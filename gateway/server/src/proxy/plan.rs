//! The policy's decision, interpreted once into what the executor runs ([`Plan`]): which nodes
//! serve and in which order, whether P or the serving node pulls an earlier turn first, how many
//! leases P grants, and how a retained turn was used (`pd_gateway_reverse_pulls_total{how}`).
//! Pure: no IO, no clock.

use pd_policy::{ReversePull, Route};

use crate::spread::{self, Group};

/// What the plan needs to know about the request besides its route.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Facts {
    /// The retained turn the prompt continues, when a live node holds one.
    pub(crate) held: Option<HeldTurn>,
    /// The policy's ask to move that turn.
    pub(crate) reverse_pull: Option<ReversePull>,
    /// The answer scores the prompt, or the body lists several prompts: the node that computes
    /// the prompt answers, so one node serves it and no KV comes from elsewhere.
    pub(crate) one_node: bool,
    /// A trusted client's own `kv_transfer_params`: `Some(true)` when they ask for a prefill
    /// (`do_remote_decode`), `Some(false)` for anything else (a decode).
    pub(crate) client_asks_prefill: Option<bool>,
    /// Completions asked for.
    pub(crate) n: u32,
}

/// A retained turn, as the plan sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeldTurn {
    /// The holder's index in the view.
    pub(crate) index: u32,
    /// The prompt continues every block held: the turn can be pulled whole.
    pub(crate) exact: bool,
    /// Tokens held.
    pub(crate) tokens: u32,
}

/// What the executor runs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Plan {
    /// The policy refused the request.
    Reject { status: u16, message: String },
    /// One node serves the request: the first of `candidates` that answers.
    Whole {
        candidates: Vec<u32>,
        /// The failover label: `whole`, `trusted` (a trusted client drives P/D itself) or
        /// `one_node`.
        stage: &'static str,
        /// The node pulls the retained turn first (on the holder itself nothing moves).
        pull: bool,
    },
    /// P, then D.
    Split(SplitPlan),
}

/// P, then D.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SplitPlan {
    /// Prefill candidates, best first.
    pub(crate) prefill: Vec<u32>,
    /// The decode requests: one group per decode node when the children are spread (n>1
    /// over several nodes), else one.
    pub(crate) groups: Vec<Group>,
    /// Every decode node once, in ranking order: a single group's failover list.
    pub(crate) decode: Vec<u32>,
    /// Leases asked of P: one per group when spread, else 1.
    pub(crate) consumers: u32,
    /// P pulls the retained turn first.
    pub(crate) pull: bool,
}

/// A plan and how it uses the retained turn the prompt continues.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Planned {
    pub(crate) plan: Plan,
    /// `pd_gateway_reverse_pulls_total{how}`: `holder`, `decode_pulls`, `prefill_pulls`,
    /// `partial` (asked, but the prompt does not continue all of it), `not_used` (held, not
    /// asked); `None` when there is nothing to count.
    pub(crate) how: Option<&'static str>,
}

impl SplitPlan {
    /// The nodes reserved from the decision on: each group's first candidate, in group order.
    pub(crate) fn reserved_nodes(&self) -> impl Iterator<Item = u32> + '_ {
        self.groups
            .iter()
            .filter_map(|g| g.candidates.first().copied())
    }

    /// Spread: one decode request per group, each with a lease of its own.
    pub(crate) fn spread(&self) -> bool {
        self.consumers > 1
    }
}

/// Every distinct node of `nodes`, in order.
fn distinct(nodes: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut out = Vec::new();
    for n in nodes {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}

/// Interprets `route` for a request with `facts`.
pub(crate) fn plan(route: Route, facts: &Facts) -> Planned {
    // The earlier turn is moved only when the policy asks for it, from the node holding it,
    // it is worth the policy's threshold, and the prompt continues all of it (a lease is
    // pulled whole).
    let asked = match (facts.held, facts.reverse_pull) {
        (Some(h), Some(rp)) => rp.from == h.index && h.tokens >= rp.min_tokens,
        _ => false,
    };
    let pull = asked && !facts.one_node && facts.held.is_some_and(|h| h.exact);
    let holder = facts.held.map(|h| h.index);
    let not_used = (facts.held.is_some() && !asked).then_some("not_used");
    match route {
        Route::Reject(r) => Planned {
            plan: Plan::Reject {
                status: r.status,
                message: r.message,
            },
            how: not_used,
        },
        Route::Whole(candidates) => {
            let how = if !asked {
                not_used
            } else if candidates.first().copied() == holder {
                // Pulled or not, the holder serves the history from its prefix cache.
                Some("holder")
            } else if pull {
                Some("decode_pulls")
            } else {
                Some("partial")
            };
            Planned {
                plan: Plan::Whole {
                    candidates,
                    stage: "whole",
                    pull,
                },
                how,
            }
        }
        Route::Split(split) => {
            let decode_nodes = || split.decode.iter().map(|d| d.node);
            if let Some(prefill) = facts.client_asks_prefill {
                // A trusted client drives P/D itself: forward to the role its params ask for.
                let candidates = if prefill {
                    split.prefill.clone()
                } else {
                    decode_nodes().collect()
                };
                return Planned {
                    plan: Plan::Whole {
                        candidates,
                        stage: "trusted",
                        pull: false,
                    },
                    how: None,
                };
            }
            if facts.one_node {
                // Prompt logprobs come from the node that computes the prompt, and a batch's
                // prompts are answered together: a prefill node first (it is a prompt's work),
                // then the decode ranking, as failover.
                return Planned {
                    plan: Plan::Whole {
                        candidates: distinct(split.prefill.iter().copied().chain(decode_nodes())),
                        stage: "one_node",
                        pull: false,
                    },
                    how: None,
                };
            }
            let how = if pull {
                // A prefill node that holds the turn itself (it decoded and kept it) serves the
                // history from its prefix cache, as a holder taking it whole does.
                Some(if split.prefill.first().copied() == holder {
                    "holder"
                } else {
                    "prefill_pulls"
                })
            } else if asked {
                Some("partial")
            } else {
                not_used
            };
            let groups = spread::plan(&split.decode, facts.n);
            let consumers = match groups.len() {
                k @ 2..=spread::MAX_GROUPS => k as u32,
                _ => 1,
            };
            Planned {
                plan: Plan::Split(SplitPlan {
                    prefill: split.prefill,
                    decode: distinct(decode_nodes()),
                    groups,
                    consumers,
                    pull,
                }),
                how,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_policy::{DecodeTarget, Rejection, Split};

    fn split(prefill: &[u32], decode: &[(u32, u32)]) -> Route {
        Route::Split(Split {
            prefill: prefill.to_vec(),
            decode: decode
                .iter()
                .map(|&(node, children)| DecodeTarget { node, children })
                .collect(),
        })
    }

    fn held(index: u32, exact: bool) -> Facts {
        Facts {
            held: Some(HeldTurn {
                index,
                exact,
                tokens: 64,
            }),
            reverse_pull: Some(ReversePull {
                from: index,
                min_tokens: 32,
            }),
            n: 1,
            ..Facts::default()
        }
    }

    #[test]
    fn a_split_spreads_children_and_asks_a_lease_per_group() {
        let f = Facts {
            n: 4,
            ..Facts::default()
        };
        let Plan::Split(s) = plan(split(&[0], &[(1, 2), (2, 2), (1, 1)]), &f).plan else {
            panic!()
        };
        assert_eq!((s.consumers, s.groups.len(), s.pull), (2, 2, false));
        assert_eq!(s.decode, vec![1, 2]);
        assert_eq!(s.reserved_nodes().collect::<Vec<_>>(), vec![1, 2]);
        let one = plan(split(&[0], &[(1, 4), (2, 1)]), &f).plan;
        assert!(matches!(one, Plan::Split(s) if s.consumers == 1 && s.decode == vec![1, 2]));
    }

    #[test]
    fn a_retained_turn_is_pulled_by_p_or_the_whole_node_and_counted() {
        // P pulls it; on the holder itself it is the holder's prefix cache.
        let p = plan(split(&[3], &[(1, 1)]), &held(2, true));
        assert!(matches!(&p.plan, Plan::Split(s) if s.pull));
        assert_eq!(p.how, Some("prefill_pulls"));
        assert_eq!(
            plan(split(&[2], &[(1, 1)]), &held(2, true)).how,
            Some("holder")
        );
        // Whole: another node pulls, the holder does not need to.
        let w = plan(Route::Whole(vec![1, 2]), &held(2, true));
        assert_eq!(
            (w.plan.clone(), w.how),
            (
                Plan::Whole {
                    candidates: vec![1, 2],
                    stage: "whole",
                    pull: true
                },
                Some("decode_pulls")
            )
        );
        assert_eq!(
            plan(Route::Whole(vec![2]), &held(2, true)).how,
            Some("holder")
        );
        // Not all of it continues: nothing moves.
        let partial = plan(split(&[3], &[(1, 1)]), &held(2, false));
        assert!(matches!(&partial.plan, Plan::Split(s) if !s.pull));
        assert_eq!(partial.how, Some("partial"));
        // Below the policy's threshold, or from another node: not used.
        let mut f = held(2, true);
        f.reverse_pull = Some(ReversePull {
            from: 2,
            min_tokens: 65,
        });
        assert_eq!(plan(Route::Whole(vec![1]), &f).how, Some("not_used"));
        let reject = Route::Reject(Rejection {
            status: 429,
            message: "busy".into(),
        });
        assert_eq!(plan(reject, &f).how, Some("not_used"));
    }

    #[test]
    fn one_node_requests_and_trusted_clients_are_served_whole() {
        let mut f = held(2, true);
        f.one_node = true;
        let p = plan(split(&[0, 1], &[(1, 1), (3, 1)]), &f);
        assert_eq!(
            p.plan,
            Plan::Whole {
                candidates: vec![0, 1, 3],
                stage: "one_node",
                pull: false
            }
        );
        let trusted = |asks_prefill| Facts {
            client_asks_prefill: Some(asks_prefill),
            n: 1,
            ..Facts::default()
        };
        let to_p = plan(split(&[0], &[(1, 1)]), &trusted(true)).plan;
        assert!(
            matches!(to_p, Plan::Whole { candidates, stage: "trusted", .. } if candidates == vec![0])
        );
        let to_d = plan(split(&[0], &[(1, 1)]), &trusted(false)).plan;
        assert!(matches!(to_d, Plan::Whole { candidates, .. } if candidates == vec![1]));
    }
}
