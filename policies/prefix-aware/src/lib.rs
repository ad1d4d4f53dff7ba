//! Prefix-aware routing policy, as a WebAssembly component for pd-gateway.
//!
//! The same rules as `pd_policy::native::prefix_aware`; the gateway's tests check that both
//! give the same decision on the same inputs. Written against `pd:policy@1.0.0`
//! (`wit/policy.wit`): the view comes as columns, node `i` at index `i` of each per-node
//! list, each role's nodes as a list of indices, with the rates the nodes measure.
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
//! Multi-turn. The *holder* is `view.conversation`'s node (earlier-turn KV of this
//! conversation under a lease), when there is one:
//! 1. Route to the holder: when it is a decode or standalone node, not draining, the turn adds
//!    at most `holder-max-new-tokens` prompt tokens beyond what it holds, its load is at most
//!    the least-loaded candidate of its role's plus `holder-load-slack`, and it is *busy*
//!    (`waiting + running`: requests parked for KV, and decodes the gateway reserved there
//!    during P's phase, compute nothing yet) with at most `holder-max-busy` (0 by default:
//!    an idle holder): `whole` with the holder
//!    first, then the other candidates of its role in least-loaded order (they pull the turn from
//!    the holder), `reverse-pull { from: holder, min-tokens: 0 }`.
//! 2. Else, on a split, pull the turn back to P when it holds at least `min-pull` tokens, the
//!    fewest for which a pull (`pull-overhead-us` + tokens × `kv-bytes-per-token` at
//!    `pull-mb-per-s`) costs less than recomputing them at `prefill-tokens-per-s`:
//!    `reverse-pull { from: holder, min-tokens: min-pull }`. The two rates are the ones the
//!    first prefill candidate (the node that would pull and compute) measured, and the KV bytes
//!    per token the view's: each where known (non-zero), else the config's.
//! 3. Else recompute.
//!
//! With `idle-peer-max-busy` set (unset by default), between 1 and 2: when the holder
//! qualifies for rule 1 but for its load or its draining, the least-loaded other candidate of
//! its role takes
//! the whole turn if it is busy with at most that setting and the held tokens are worth a pull at
//! its rates (as in 2): `whole` with that peer first, then the role's other candidates (the
//! holder included) in least-loaded order, `reverse-pull { from: holder, min-tokens }`. The
//! turn skips P's queue and the second transfer (P to D) a pulled-back turn makes.
//!
//! With `decode-holder-slack` set (unset by default), a turn pulled back by P (2) decodes on
//! the holder when its load is at most the least-loaded decode candidate's plus that slack:
//! the holder still has the history in its prefix cache, so it pulls only the new blocks.
//!
//! With `spill-prefill-busy` set (unset by default), a request with no holder whose split would
//! queue at P (every prefill candidate busy, `waiting + running`, with at least that) runs
//! `whole` on the least-loaded decode candidate when its load is 0 (nothing queued, running or
//! parked), then the other decode candidates in least-loaded order; no reverse pull. That node
//! computes the prompt itself rather than wait for P (conditional disaggregation).
//!
//! With `keep-on-prefill-decode-busy` at N (1 by default; `off` turns it off), a split (after
//! 2 and 3) whose decode candidates all have a load of at least N runs `whole` on its first
//! prefill candidate when that node's load is 0, then the other prefill candidates; the reverse
//! pull as on the split. P decodes the turn itself instead of adding it to a decode node that
//! is already decoding (the mirror of the spill rule). An opt-in key set to `off` is unset.
//!
//! The parameters are read from the policy config (`pd-gateway policy push --config
//! KEY=VALUE`); defaults: prefill-tokens-per-s 2000, kv-bytes-per-token 23040 (SmolLM2-135M,
//! f16 KV), pull-mb-per-s 1000, pull-overhead-us 2000, holder-max-new-tokens 256,
//! holder-load-slack 2, holder-max-busy 0 (only an idle holder takes a turn, so no decode
//! running there waits behind its prefill), keep-on-prefill-decode-busy 1, idle-peer-max-busy,
//! decode-holder-slack and spill-prefill-busy unset.

#![no_std]

extern crate alloc;

use alloc::string::ToString;
use alloc::vec::Vec;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../wit" });

use core::cmp::Reverse;
use pd::policy::host::config;
use pd::policy::types::{Holding, Rejection, ReversePull, Route, Split};

struct PrefixAware;

export!(PrefixAware);

/// Message of the 503 when no node can serve the request.
const NO_NODES: &str =
    "no node can serve this request: the view has no prefill+decode pair and no standalone node";

impl Guest for PrefixAware {
    fn decide(request: Request, view: View) -> Decision {
        let v = &view;
        let prefix = &request.prefix_blocks;
        let holding = v
            .conversation
            .filter(|h| h.tokens > 0 && (h.node as usize) < v.free_blocks.len());
        if let Some(h) = holding
            && let Some(d) = to_holder(&request, v, h).or_else(|| to_idle_peer(&request, v, h))
        {
            return d;
        }
        if holding.is_none()
            && let Some(d) = spill(v)
        {
            return d;
        }
        let mut route = if !v.prefill.is_empty() && !v.decode.is_empty() {
            let decode = least_loaded(v, candidates(v, &v.decode));
            Route::Split(Split {
                prefill: by_prefix(v, prefix, candidates(v, &v.prefill)),
                children: alloc::vec![request.n.max(1); decode.len()],
                decode,
            })
        } else if !v.standalone.is_empty() {
            Route::Whole(by_prefix(v, prefix, candidates(v, &v.standalone)))
        } else {
            Route::Reject(Rejection {
                status: 503,
                message: NO_NODES.to_string(),
            })
        };
        let mut reverse_pull = None;
        if let (Some(h), Route::Split(split)) = (holding, &route) {
            let p = split.prefill[0] as usize;
            let min_tokens = min_pull_tokens(
                v.prefill_tokens_per_s[p],
                v.pull_mb_per_s[p],
                v.kv_bytes_per_token,
            );
            if h.tokens >= min_tokens {
                reverse_pull = Some(ReversePull {
                    from: h.node,
                    min_tokens,
                });
            }
        }
        if let (Some(h), Some(_), Some(slack), Route::Split(split)) = (
            holding,
            &reverse_pull,
            opt_in("decode-holder-slack", None),
            &mut route,
        ) {
            holder_decodes_first(v, h.node, slack, &mut split.decode);
        }
        if let Route::Split(split) = &route
            && keep_on_prefill(v, split)
        {
            route = Route::Whole(split.prefill.clone());
        }
        Decision {
            route,
            reverse_pull,
        }
    }
}

/// Moves holder `h` to the front of `decode` when it is there and its load is at most the
/// lightest candidate's plus `slack` (`decode-holder-slack`): it still has the history in its
/// prefix cache, so as D it pulls only the turn's new blocks from P. (Every entry takes the
/// same children, so `children` needs no reordering.)
fn holder_decodes_first(v: &View, h: u32, slack: u64, decode: &mut Vec<u32>) {
    let Some(pos) = decode.iter().position(|&d| d == h) else {
        return;
    };
    let lightest = decode.iter().map(|&d| load(v, d)).min().unwrap_or(0);
    if pos > 0 && load(v, h) <= lightest.saturating_add(slack) {
        let target = decode.remove(pos);
        decode.insert(0, target);
    }
}

/// The keep rule (`keep-on-prefill-decode-busy` set): whether `split` should run whole on its
/// first prefill node, because that node has no load and every decode candidate at least the
/// setting.
fn keep_on_prefill(v: &View, split: &Split) -> bool {
    // Cheap test first: a busy P (the common case) skips the host call.
    if load(v, split.prefill[0]) > 0 {
        return false;
    }
    let Some(min_load) = opt_in("keep-on-prefill-decode-busy", Some(KEEP_ON_PREFILL_DEFAULT))
    else {
        return false;
    };
    split.decode.iter().all(|&d| load(v, d) >= min_load)
}

/// `keep-on-prefill-decode-busy` when the config does not set it.
const KEEP_ON_PREFILL_DEFAULT: u64 = 1;

/// An opt-in rule's setting: the config's whole number, none for `off`, else `default`.
fn opt_in(key: &str, default: Option<u64>) -> Option<u64> {
    match config(key) {
        Some(v) if v.trim().eq_ignore_ascii_case("off") => None,
        Some(v) => v.trim().parse().ok().or(default),
        None => default,
    }
}

/// A numeric config value, or `default` when unset or not a number.
fn param(key: &str, default: u64) -> u64 {
    config(key)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// `measured` when known (non-zero), else the config's `key`.
fn known_or(measured: u32, key: &str, default: u64) -> u64 {
    if measured > 0 {
        u64::from(measured)
    } else {
        param(key, default)
    }
}

/// Fewest held tokens worth a pull for a node that prefills at `prefill_tokens_per_s` and
/// pulls at `pull_mb_per_s`, `kv_bytes_per_token` moving per token (each 0: unknown, the
/// config's) (`u32::MAX`: never, when a token moves slower than it computes).
fn min_pull_tokens(prefill_tokens_per_s: u32, pull_mb_per_s: u32, kv_bytes_per_token: u32) -> u32 {
    let recompute_ns =
        1_000_000_000 / known_or(prefill_tokens_per_s, "prefill-tokens-per-s", 2_000).max(1);
    let pull_ns = known_or(kv_bytes_per_token, "kv-bytes-per-token", 23_040).saturating_mul(1_000)
        / known_or(pull_mb_per_s, "pull-mb-per-s", 1_000).max(1);
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

/// Rule 1: the whole request on the holder, when it qualifies.
fn to_holder(request: &Request, v: &View, h: Holding) -> Option<Decision> {
    // The role lists are ascending.
    let role = [&v.decode, &v.standalone]
        .into_iter()
        .find(|role| role.binary_search(&h.node).is_ok())?;
    if v.draining.contains(&h.node) {
        return None;
    }
    let new = request.prompt_tokens.saturating_sub(h.tokens);
    if u64::from(new) > param("holder-max-new-tokens", 256) {
        return None;
    }
    let others = candidates(v, role);
    let lightest = others.iter().map(|&i| load(v, i)).min()?;
    if load(v, h.node) > lightest.saturating_add(param("holder-load-slack", 2))
        || busy(v, h.node) > param("holder-max-busy", 0)
    {
        return None;
    }
    let mut list = alloc::vec![h.node];
    list.extend(least_loaded(v, others).into_iter().filter(|&i| i != h.node));
    Some(Decision {
        route: Route::Whole(list),
        reverse_pull: Some(ReversePull {
            from: h.node,
            min_tokens: 0,
        }),
    })
}

/// Rule 1b (`idle-peer-max-busy` set): the whole turn on the least-loaded other node of the
/// holder's role, when the holder qualifies for rule 1 but for its load or its draining, that
/// peer's load is at most the setting, and the history is worth pulling at the peer's rates.
fn to_idle_peer(request: &Request, v: &View, h: Holding) -> Option<Decision> {
    let max_busy = opt_in("idle-peer-max-busy", None)?;
    let role = [&v.decode, &v.standalone]
        .into_iter()
        .find(|role| role.binary_search(&h.node).is_ok())?;
    let new = request.prompt_tokens.saturating_sub(h.tokens);
    if u64::from(new) > param("holder-max-new-tokens", 256) {
        return None;
    }
    let mut list = least_loaded(v, candidates(v, role));
    let peer = list.iter().copied().find(|&i| i != h.node)?;
    if busy(v, peer) > max_busy {
        return None;
    }
    let p = peer as usize;
    let min_tokens = min_pull_tokens(
        v.prefill_tokens_per_s[p],
        v.pull_mb_per_s[p],
        v.kv_bytes_per_token,
    );
    if h.tokens < min_tokens {
        return None;
    }
    // The peer first, then the rest in least-loaded order (the holder among them unless it
    // drains).
    list.retain(|&i| i != peer);
    list.insert(0, peer);
    Some(Decision {
        route: Route::Whole(list),
        reverse_pull: Some(ReversePull {
            from: h.node,
            min_tokens,
        }),
    })
}

/// The spill rule (`spill-prefill-busy` set): a request with no holder runs whole on an idle
/// decode node when every prefill candidate is busy with at least the setting.
fn spill(v: &View) -> Option<Decision> {
    // Cheap tests first: most requests meet no idle decode node, and then skip the host call.
    if v.prefill.is_empty() || !v.decode.iter().any(|&i| load(v, i) == 0) {
        return None;
    }
    let min_busy = opt_in("spill-prefill-busy", None)?;
    if candidates(v, &v.prefill)
        .iter()
        .any(|&i| busy(v, i) < min_busy)
    {
        return None;
    }
    let decode = least_loaded(v, candidates(v, &v.decode));
    if load(v, decode[0]) > 0 {
        return None;
    }
    Some(Decision {
        route: Route::Whole(decode),
        reverse_pull: None,
    })
}

/// Requests on node `i`: queued, running, and parked waiting for KV.
fn load(v: &View, i: u32) -> u64 {
    let i = i as usize;
    u64::from(v.waiting[i]) + u64::from(v.running[i]) + u64::from(v.waiting_remote_kv[i])
}

/// Requests node `i` computes or has queued to compute: `waiting + running` (requests parked
/// for KV compute nothing yet).
fn busy(v: &View, i: u32) -> u64 {
    let i = i as usize;
    u64::from(v.waiting[i]) + u64::from(v.running[i])
}

/// Cached prefix blocks minus queued and running requests.
fn score(v: &View, i: u32, prefix_blocks: u32) -> i64 {
    let i = i as usize;
    i64::from(prefix_blocks) - i64::from(v.waiting[i]) - i64::from(v.running[i])
}

/// The nodes of `role` (one of the view's role lists) that are not draining, or all of them
/// when every one drains; ascending.
fn candidates(v: &View, role: &[u32]) -> Vec<u32> {
    let mut live = Vec::with_capacity(role.len());
    // Both lists are ascending: one cursor walks `draining` beside the role's nodes.
    let mut next_draining = v.draining.iter().copied().peekable();
    for &i in role {
        while next_draining.next_if(|&d| d < i).is_some() {}
        if next_draining.peek() != Some(&i) {
            live.push(i);
        }
    }
    if live.is_empty() {
        live.extend_from_slice(role);
    }
    live
}

/// `keyed` sorted by key, as indices. Each key is computed once, before the sort (its
/// comparisons would compute it ~2 log n times each); keys end with the index, so they are
/// unique and an unstable sort is exact.
fn sorted<K: Ord>(keyed: impl Iterator<Item = (K, u32)>) -> Vec<u32> {
    let mut keyed: Vec<(K, u32)> = keyed.collect();
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, i)| i).collect()
}

/// Least load first, then most free blocks, then lowest index.
fn least_loaded(v: &View, c: Vec<u32>) -> Vec<u32> {
    sorted(
        c.into_iter()
            .map(|i| ((load(v, i), Reverse(v.free_blocks[i as usize])), i)),
    )
}

/// Highest score first, then least-loaded order.
fn by_prefix(v: &View, prefix: &[u32], c: Vec<u32>) -> Vec<u32> {
    sorted(c.into_iter().map(|i| {
        let p = prefix.get(i as usize).copied().unwrap_or(0);
        (
            (
                Reverse(score(v, i, p)),
                load(v, i),
                Reverse(v.free_blocks[i as usize]),
            ),
            i,
        )
    }))
}
