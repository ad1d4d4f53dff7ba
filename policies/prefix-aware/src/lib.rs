//! Prefix-aware routing policy, as a WebAssembly component for pd-gateway.
//!
//! The same rules as `pd_policy::native::prefix_aware`; the gateway's tests check that both
//! give the same decision on the same inputs.
//!
//! - Candidates for a role: its nodes that are not draining, or all its nodes when every one of
//!   them is draining.
//! - Route: if the view has a prefill and a decode node, split; else, if it has a standalone
//!   node, whole; else reject with 503. Each decode entry takes all `n` children.
//! - Prefill and whole ranking: score = `prefix-blocks[i] - (waiting + running)` (cached
//!   leading blocks of this prompt, minus the node's queued and running requests; a node past
//!   the end of `prefix-blocks` holds 0), highest first; ties in least-loaded order: load =
//!   `waiting + running + waiting-remote-kv` lowest first, then most `free-blocks`, then lowest
//!   index.
//! - Decode ranking: least-loaded order (the decode node pulls the KV, so its cache does not
//!   matter).
//!
//! Multi-turn. The *holder* is the node with the most `conversation-tokens` (earlier-turn KV of
//! this conversation under a lease; ties to the lowest index), when any has some:
//! 1. Route to the holder: when it is a decode or standalone node, not draining, the turn adds
//!    at most `holder-max-new-tokens` prompt tokens beyond what it holds, and its load is at most
//!    the least-loaded candidate of its role's plus `holder-load-slack`: `whole` with the holder
//!    first, then the other candidates of its role in least-loaded order (they pull the turn from
//!    the holder), `reverse-pull { from: holder, min-tokens: 0 }`.
//! 2. Else, on a split, pull the turn back to P when it holds at least `min-pull` tokens, the
//!    fewest for which a pull (`pull-overhead-us` + tokens × `kv-bytes-per-token` at
//!    `pull-mb-per-s`) costs less than recomputing them at `prefill-tokens-per-s`:
//!    `reverse-pull { from: holder, min-tokens: min-pull }`.
//! 3. Else recompute.
//!
//! The six parameters are read from the policy config (`pd-gateway policy push --config
//! KEY=VALUE`); defaults: prefill-tokens-per-s 2000, kv-bytes-per-token 23040 (SmolLM2-135M,
//! f16 KV), pull-mb-per-s 1000, pull-overhead-us 2000, holder-max-new-tokens 256,
//! holder-load-slack 2.

#![no_std]

extern crate alloc;

use alloc::string::ToString;
use alloc::vec::Vec;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../wit" });

use core::cmp::Reverse;
use pd::policy::host::config;
use pd::policy::types::{DecodeTarget, Node, Rejection, ReversePull, Role, Route, Split};

struct PrefixAware;

export!(PrefixAware);

/// Message of the 503 when no node can serve the request.
const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

impl Guest for PrefixAware {
    fn decide(request: Request, view: View) -> Decision {
        let nodes = &view.nodes;
        let prefix = &request.prefix_blocks;
        let holder = (0u32..)
            .zip(nodes)
            .filter(|(_, n)| n.conversation_tokens > 0)
            .max_by_key(|(i, n)| (n.conversation_tokens, Reverse(*i)))
            .map(|(i, _)| i);
        if let Some(h) = holder
            && let Some(d) = to_holder(&request, nodes, h)
        {
            return d;
        }
        let has = |role: Role| nodes.iter().any(|n| n.role == role);
        let route = if has(Role::Prefill) && has(Role::Decode) {
            Route::Split(Split {
                prefill: by_prefix(nodes, prefix, candidates(nodes, Role::Prefill)),
                decode: least_loaded(nodes, candidates(nodes, Role::Decode))
                    .into_iter()
                    .map(|node| DecodeTarget {
                        node,
                        children: request.n.max(1),
                    })
                    .collect(),
            })
        } else if has(Role::Standalone) {
            Route::Whole(by_prefix(
                nodes,
                prefix,
                candidates(nodes, Role::Standalone),
            ))
        } else {
            Route::Reject(Rejection {
                status: 503,
                message: NO_NODES.to_string(),
            })
        };
        let mut reverse_pull = None;
        if let (Some(h), Route::Split(_)) = (holder, &route) {
            let min_tokens = min_pull_tokens();
            if nodes[h as usize].conversation_tokens >= min_tokens {
                reverse_pull = Some(ReversePull {
                    from: h,
                    min_tokens,
                });
            }
        }
        Decision {
            route,
            reverse_pull,
        }
    }
}

/// A numeric config value, or `default` when unset or not a number.
fn param(key: &str, default: u64) -> u64 {
    config(key)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// Fewest held tokens worth a pull (`u32::MAX`: never, when a token moves slower than it
/// computes).
fn min_pull_tokens() -> u32 {
    let recompute_ns = 1_000_000_000 / param("prefill-tokens-per-s", 2_000).max(1);
    let pull_ns = param("kv-bytes-per-token", 23_040).saturating_mul(1_000)
        / param("pull-mb-per-s", 1_000).max(1);
    match recompute_ns.checked_sub(pull_ns) {
        Some(gain) if gain > 0 => {
            let t = param("pull-overhead-us", 2_000)
                .saturating_mul(1_000)
                .div_ceil(gain);
            u32::try_from(t.max(1)).unwrap_or(u32::MAX)
        }
        _ => u32::MAX,
    }
}

/// Rule 1: the whole request on holder `h`, when it qualifies.
fn to_holder(request: &Request, nodes: &[Node], h: u32) -> Option<Decision> {
    let n = &nodes[h as usize];
    if n.draining || !matches!(n.role, Role::Decode | Role::Standalone) {
        return None;
    }
    let new = request.prompt_tokens.saturating_sub(n.conversation_tokens);
    if u64::from(new) > param("holder-max-new-tokens", 256) {
        return None;
    }
    let others = candidates(nodes, n.role);
    let lightest = others.iter().map(|&i| load(&nodes[i as usize])).min()?;
    if load(n) > lightest.saturating_add(param("holder-load-slack", 2)) {
        return None;
    }
    let mut list = alloc::vec![h];
    list.extend(least_loaded(nodes, others).into_iter().filter(|&i| i != h));
    Some(Decision {
        route: Route::Whole(list),
        reverse_pull: Some(ReversePull {
            from: h,
            min_tokens: 0,
        }),
    })
}

/// Requests on a node: queued, running, and parked waiting for KV.
fn load(n: &Node) -> u64 {
    u64::from(n.waiting) + u64::from(n.running) + u64::from(n.waiting_remote_kv)
}

/// Cached prefix blocks minus queued and running requests.
fn score(n: &Node, prefix_blocks: u32) -> i64 {
    i64::from(prefix_blocks) - i64::from(n.waiting) - i64::from(n.running)
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

/// Least load first, then most free blocks, then lowest index (keys are unique: the index
/// is part of them, so an unstable sort is exact).
fn least_loaded(nodes: &[Node], mut c: Vec<u32>) -> Vec<u32> {
    c.sort_unstable_by_key(|&i| {
        let n = &nodes[i as usize];
        (load(n), Reverse(n.free_blocks), i)
    });
    c
}

/// Highest score first, then least-loaded order.
fn by_prefix(nodes: &[Node], prefix: &[u32], mut c: Vec<u32>) -> Vec<u32> {
    c.sort_unstable_by_key(|&i| {
        let n = &nodes[i as usize];
        let p = prefix.get(i as usize).copied().unwrap_or(0);
        (Reverse(score(n, p)), load(n), Reverse(n.free_blocks), i)
    });
    c
}
