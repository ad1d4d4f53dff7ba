//! Prefix-aware: cached prefix against load, and a conversation's earlier turn reused where it
//! is cheaper than recomputing it (see the [module docs](super)).

use super::{candidates, least_loaded_key, load, route};
use crate::{
    Decision, DecodeTarget, Measured, Node, Rates, Request, ReversePull, Role, Route, Split, View,
};
use std::cmp::Reverse;

/// The multi-turn rule's parameters (the guest reads each from its policy config, under the
/// name in brackets; these are the defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// Prompt tokens a prefill node computes per second (`prefill-tokens-per-s`).
    pub prefill_tokens_per_s: u64,
    /// Bytes of KV per token moved by a pull (`kv-bytes-per-token`; SmolLM2-135M with f16 KV:
    /// 30 layers × K and V × 3 KV heads × 64 × 2 bytes = 23 040).
    pub kv_bytes_per_token: u64,
    /// Pull bandwidth, MB/s (`pull-mb-per-s`).
    pub pull_mb_per_s: u64,
    /// Fixed cost of a pull (handshake, lease confirm, a round trip or two), µs
    /// (`pull-overhead-us`).
    pub pull_overhead_us: u64,
    /// Route a turn to the node holding its history (`whole`) when it adds at most this many
    /// new prompt tokens (`holder-max-new-tokens`): the holder prefills them beside its decodes.
    pub holder_max_new_tokens: u64,
    /// ...and when the holder's load is at most the least-loaded node of its role's plus this
    /// (`holder-load-slack`): an overloaded holder is passed over.
    pub holder_load_slack: u64,
    /// ...and when the holder has at most this many requests queued or running (`holder-max-busy`;
    /// requests parked for KV, and decodes the gateway reserved there during P's phase, compute
    /// nothing yet and do not count). The default, 0, sends a turn to its holder only when the
    /// holder is idle, so no decode running there waits behind a new turn's prefill (TPOT as on a
    /// decode node that only decodes: what P/D disaggregation is for; a reserved decode whose KV
    /// lands during that prefill waits for it, and is counted idle because counting it starved the
    /// holders: docs/bench-log/multi-turn.md, "Reservations are not work"); a busy holder's turn
    /// goes to P, which pulls the history back. Larger values trade the holder's decodes' TPOT for
    /// the turn's TTFT.
    pub holder_max_busy: u64,
    /// On a turn pulled back to P, put the holder first among the decode candidates when its
    /// load is at most the least-loaded decode candidate's plus this (`decode-holder-slack`;
    /// `None`, the default: decode candidates in least-loaded order only). The holder still
    /// has the history in its prefix cache, so as D it pulls only the turn's new blocks from P
    /// instead of the whole history again.
    pub decode_holder_slack: Option<u64>,
    /// When the holder is too busy (or draining) for rule 1, give the whole turn to the
    /// least-loaded other node of its role if that one has at most this many requests queued
    /// or running (`idle-peer-max-busy`; `None`, the default: the turn goes to P instead). The peer pulls
    /// the history from the holder and prefills only the new tokens, so the turn skips P's
    /// queue and the second transfer (P to D) a pulled-back turn makes; at 0 it only takes an
    /// idle node, whose decodes cannot wait behind that prefill because it has none. A draining
    /// holder's conversations move to its peers this way.
    pub idle_peer_max_busy: Option<u64>,
    /// A request with no holder, whose split would queue at P (every prefill candidate has at
    /// least this many requests queued or running: `spill-prefill-busy`; `None`, the default:
    /// never), runs `whole` on a decode node with nothing queued, running or parked, if there
    /// is one: that node computes the prompt itself instead of waiting for P and pulling the
    /// result (conditional disaggregation, as Dynamo's router does past a prefill queue
    /// length). An idle node delays no one's decode by it, and with
    /// `--kv-retain-after-decode` it becomes the conversation's holder.
    pub spill_prefill_busy: Option<u64>,
    /// A split whose every decode candidate already has at least this many requests (queued,
    /// running, or parked for KV: `keep-on-prefill-decode-busy`; `Some(1)`, the default; `off`
    /// in the config: never) runs `whole` on its first prefill candidate instead, when that
    /// node has none: P computes the prompt (after pulling a conversation's history back, as on
    /// a split) and decodes it itself, so the decode does not share a decode node's steps with
    /// another turn's. The mirror of `spill_prefill_busy`: in a cluster whose decode nodes are
    /// all decoding and whose P is idle, P is the node with a step to spare. On by default
    /// since it met the multi-turn benchmark's TPOT goal where nodes compute at their own pace
    /// (docs/bench-log/multi-turn.md, "Nodes at their own pace on the VM").
    pub keep_on_prefill_decode_busy: Option<u64>,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 2_000,
            kv_bytes_per_token: 23_040,
            pull_mb_per_s: 1_000,
            pull_overhead_us: 2_000,
            holder_max_new_tokens: 256,
            holder_load_slack: 2,
            holder_max_busy: 0,
            decode_holder_slack: None,
            idle_peer_max_busy: None,
            spill_prefill_busy: None,
            keep_on_prefill_decode_busy: Some(1),
        }
    }
}

impl Thresholds {
    /// The thresholds a policy config sets, under the keys the guest reads (in brackets on
    /// each field): a key that is unset or not a whole number keeps its default, as in the
    /// guest. The gateway's fallback reads the failed policy's config this way, so an operator's
    /// tuning holds on a failed call too.
    pub fn from_config<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Thresholds {
        let d = Thresholds::default();
        let num = |key: &str| get(key).and_then(|v| v.trim().parse::<u64>().ok());
        // An opt-in rule's key: a whole number sets it, `off` turns it off, anything else
        // keeps its default.
        let opt = |key: &str, default: Option<u64>| match get(key).map(str::trim) {
            Some(v) if v.eq_ignore_ascii_case("off") => None,
            Some(v) => v.parse::<u64>().ok().or(default),
            None => default,
        };
        Thresholds {
            prefill_tokens_per_s: num("prefill-tokens-per-s").unwrap_or(d.prefill_tokens_per_s),
            kv_bytes_per_token: num("kv-bytes-per-token").unwrap_or(d.kv_bytes_per_token),
            pull_mb_per_s: num("pull-mb-per-s").unwrap_or(d.pull_mb_per_s),
            pull_overhead_us: num("pull-overhead-us").unwrap_or(d.pull_overhead_us),
            holder_max_new_tokens: num("holder-max-new-tokens").unwrap_or(d.holder_max_new_tokens),
            holder_load_slack: num("holder-load-slack").unwrap_or(d.holder_load_slack),
            holder_max_busy: num("holder-max-busy").unwrap_or(d.holder_max_busy),
            decode_holder_slack: opt("decode-holder-slack", d.decode_holder_slack),
            idle_peer_max_busy: opt("idle-peer-max-busy", d.idle_peer_max_busy),
            spill_prefill_busy: opt("spill-prefill-busy", d.spill_prefill_busy),
            keep_on_prefill_decode_busy: opt(
                "keep-on-prefill-decode-busy",
                d.keep_on_prefill_decode_busy,
            ),
        }
    }

    /// These thresholds with a node's measured rates and the model's KV bytes per token in
    /// place of the configured ones, each where it is known (non-zero).
    pub fn measured(&self, rates: Rates, kv_bytes_per_token: u32) -> Thresholds {
        let or = |measured: u32, configured: u64| {
            if measured > 0 {
                u64::from(measured)
            } else {
                configured
            }
        };
        Thresholds {
            prefill_tokens_per_s: or(rates.prefill_tokens_per_s, self.prefill_tokens_per_s),
            pull_mb_per_s: or(rates.pull_mb_per_s, self.pull_mb_per_s),
            kv_bytes_per_token: or(kv_bytes_per_token, self.kv_bytes_per_token),
            ..*self
        }
    }

    /// Fewest held tokens worth a pull: pulling `t` tokens costs `overhead + t × bytes / bandwidth`,
    /// recomputing them `t / prefill rate`; pull from the first `t` where that is cheaper
    /// (`u32::MAX`: never, when a token moves slower than it computes).
    pub fn min_pull_tokens(&self) -> u32 {
        let recompute_ns = 1_000_000_000 / self.prefill_tokens_per_s.max(1);
        let pull_ns = self.kv_bytes_per_token.saturating_mul(1_000) / self.pull_mb_per_s.max(1);
        match recompute_ns.checked_sub(pull_ns) {
            Some(gain) if gain > 0 => {
                let t = self.pull_overhead_us.saturating_mul(1_000).div_ceil(gain);
                u32::try_from(t.max(1)).unwrap_or(u32::MAX)
            }
            _ => u32::MAX,
        }
    }
}

/// [`prefix_aware_with`] at the default [`Thresholds`], no rates measured.
pub fn prefix_aware(request: &Request, view: &View) -> Decision {
    prefix_aware_with(request, view, &Measured::default(), &Thresholds::default())
}

/// Prefill and whole lists by score `prefix_blocks[i] - (waiting + running)` descending
/// (`i64`; a node past the end of `request.prefix_blocks` holds 0 blocks), ties in
/// least-loaded order; the decode list in least-loaded order (a decode node pulls the KV, its
/// cache does not matter). Same rules as `policies/prefix-aware`.
///
/// One cached block counts as much as one queued or running request: a node holding 10 more
/// blocks of the prompt wins over a node with up to 9 more requests on it.
///
/// Multi-turn (the *holder*: the node with the most `conversation_tokens`, ties to the lowest
/// index, when any has some):
/// 1. **Route to the holder** when it is a decode or standalone node, not draining, the turn
///    adds at most `holder_max_new_tokens` prompt tokens beyond what it holds, its load is
///    at most the least-loaded of its role's candidates plus `holder_load_slack`, and it is
///    busy (`waiting + running`: requests parked for KV compute nothing yet) with at most
///    `holder_max_busy`: `whole` with
///    the holder first, then the other candidates of its role in least-loaded order (they pull
///    the turn from the holder), `reverse-pull { from: holder, min-tokens: 0 }`.
/// 2. Otherwise, on a split, **pull the turn back** when it holds at least
///    [`Thresholds::min_pull_tokens`]: `reverse-pull { from: holder, min-tokens: that }`. The
///    thresholds are `t` [measured](Thresholds::measured) with the first prefill candidate's
///    rates (the node that would pull and compute) and the model's KV bytes per token.
/// 3. Otherwise recompute (no reverse pull).
///
/// With [`Thresholds::idle_peer_max_busy`] set, between 1 and 2: **an idle peer takes the
/// turn** when the holder qualifies for rule 1 but for its load or its draining, and the
/// least-loaded other
/// candidate of the holder's role is busy (`waiting + running`) with at most that, and the held tokens are worth a
/// pull at the peer's measured rates ([`Thresholds::min_pull_tokens`]): `whole` with that peer
/// first, then the role's other candidates (the holder included) in least-loaded order,
/// `reverse-pull { from: holder, min-tokens: that }`.
///
/// With [`Thresholds::decode_holder_slack`] set, a turn pulled back (2) decodes on the holder
/// when the holder is within that slack of the least-loaded decode candidate.
///
/// With [`Thresholds::spill_prefill_busy`] set, a request with no holder **spills to an idle
/// decode node** when every prefill candidate is busy (`waiting + running`) with at least
/// that: `whole` with the least-loaded decode candidate first if its load (queued, running and
/// parked) is 0, then the other decode candidates in least-loaded order; no reverse pull.
///
/// With [`Thresholds::keep_on_prefill_decode_busy`] set (1 by default), a split (after rules 2 and 3) whose
/// decode candidates all have a load of at least that **stays on P** when its first prefill
/// candidate's load is 0: `whole` with the prefill list, the reverse pull unchanged.
pub fn prefix_aware_with(
    request: &Request,
    view: &View,
    measured: &Measured,
    t: &Thresholds,
) -> Decision {
    let nodes = &view.nodes;
    let holder = (0u32..)
        .zip(nodes)
        .filter(|(_, n)| n.conversation_tokens > 0)
        .max_by_key(|(i, n)| (n.conversation_tokens, Reverse(*i)))
        .map(|(i, _)| i);
    if let Some(h) = holder
        && let Some(d) =
            to_holder(request, nodes, h, t).or_else(|| to_idle_peer(request, nodes, measured, h, t))
    {
        return d;
    }
    if holder.is_none()
        && let Some(d) = spill(nodes, t)
    {
        return d;
    }
    let mut d = route(request, view, |role, mut c| {
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
    });
    if let (Some(h), Route::Split(split)) = (holder, &d.route) {
        let p = split.prefill[0] as usize;
        let min_tokens = t
            .measured(measured.rates_of(p), measured.kv_bytes_per_token)
            .min_pull_tokens();
        if nodes[h as usize].conversation_tokens >= min_tokens {
            d.reverse_pull = Some(ReversePull {
                from: h,
                min_tokens,
            });
        }
    }
    if let (Some(h), Some(_), Some(slack), Route::Split(split)) =
        (holder, &d.reverse_pull, t.decode_holder_slack, &mut d.route)
    {
        holder_decodes_first(nodes, h, slack, &mut split.decode);
    }
    if let (Some(min_load), Route::Split(split)) = (t.keep_on_prefill_decode_busy, &d.route)
        && keep_on_prefill(nodes, min_load, split)
    {
        d.route = Route::Whole(split.prefill.clone());
    }
    d
}

/// The keep rule (`keep_on_prefill_decode_busy`): whether `split` should run whole on its
/// first prefill node, because that node has no load and every decode candidate at least
/// `min_load`.
fn keep_on_prefill(nodes: &[Node], min_load: u64, split: &Split) -> bool {
    load(&nodes[split.prefill[0] as usize]) == 0
        && split
            .decode
            .iter()
            .all(|d| load(&nodes[d.node as usize]) >= min_load)
}

/// Moves holder `h` to the front of `decode` when it is there and its load is at most the
/// lightest candidate's plus `slack`.
fn holder_decodes_first(nodes: &[Node], h: u32, slack: u64, decode: &mut Vec<DecodeTarget>) {
    let Some(pos) = decode.iter().position(|d| d.node == h) else {
        return;
    };
    let lightest = decode
        .iter()
        .map(|d| load(&nodes[d.node as usize]))
        .min()
        .unwrap_or(0);
    if pos > 0 && load(&nodes[h as usize]) <= lightest.saturating_add(slack) {
        let target = decode.remove(pos);
        decode.insert(0, target);
    }
}

/// Requests a node computes or has queued to compute: `waiting + running`. Requests parked
/// for remote KV (and a split's decode the gateway reserved there) compute nothing yet, so a
/// node with only those is free to prefill a turn now.
fn busy(n: &Node) -> u64 {
    u64::from(n.waiting) + u64::from(n.running)
}

/// Rule 1: the whole request on holder `h`, when it qualifies.
fn to_holder(request: &Request, nodes: &[Node], h: u32, t: &Thresholds) -> Option<Decision> {
    let n = &nodes[h as usize];
    if n.draining || !matches!(n.role, Role::Decode | Role::Standalone) {
        return None;
    }
    let new = request.prompt_tokens.saturating_sub(n.conversation_tokens);
    if u64::from(new) > t.holder_max_new_tokens {
        return None;
    }
    let mut others = candidates(nodes, n.role);
    let lightest = others.iter().map(|&i| load(&nodes[i as usize])).min()?;
    if load(n) > lightest.saturating_add(t.holder_load_slack) || busy(n) > t.holder_max_busy {
        return None;
    }
    others.retain(|&i| i != h);
    others.sort_unstable_by_key(|&i| least_loaded_key(nodes, i));
    let mut list = vec![h];
    list.extend(others);
    Some(Decision {
        route: Route::Whole(list),
        reverse_pull: Some(ReversePull {
            from: h,
            min_tokens: 0,
        }),
    })
}

/// Rule 1b: the whole turn on the least-loaded other node of the holder's role, when it is
/// idle enough (`idle_peer_max_busy`) and the history is worth pulling there (the holder may
/// be draining: its KV moves off it).
fn to_idle_peer(
    request: &Request,
    nodes: &[Node],
    measured: &Measured,
    h: u32,
    t: &Thresholds,
) -> Option<Decision> {
    let max_busy = t.idle_peer_max_busy?;
    let n = &nodes[h as usize];
    if !matches!(n.role, Role::Decode | Role::Standalone) {
        return None;
    }
    let new = request.prompt_tokens.saturating_sub(n.conversation_tokens);
    if u64::from(new) > t.holder_max_new_tokens {
        return None;
    }
    let mut list = candidates(nodes, n.role);
    list.sort_unstable_by_key(|&i| least_loaded_key(nodes, i));
    let peer = list.iter().copied().find(|&i| i != h)?;
    if busy(&nodes[peer as usize]) > max_busy {
        return None;
    }
    let min_tokens = t
        .measured(
            measured.rates_of(peer as usize),
            measured.kv_bytes_per_token,
        )
        .min_pull_tokens();
    if n.conversation_tokens < min_tokens {
        return None;
    }
    // The peer first, then the rest in least-loaded order (the holder among them unless it
    // drains).
    list.retain(|&i| i != peer);
    list.insert(0, peer);
    Some(Decision {
        route: Route::Whole(list),
        reverse_pull: Some(ReversePull {
            from: h,
            min_tokens,
        }),
    })
}

/// The spill rule (`spill_prefill_busy`): `whole` on an idle decode node when every prefill
/// candidate is busy with at least the setting.
fn spill(nodes: &[Node], t: &Thresholds) -> Option<Decision> {
    let min_busy = t.spill_prefill_busy?;
    let prefill = candidates(nodes, Role::Prefill);
    let mut decode = candidates(nodes, Role::Decode);
    if prefill.is_empty()
        || decode.is_empty()
        || prefill.iter().any(|&i| busy(&nodes[i as usize]) < min_busy)
    {
        return None;
    }
    decode.sort_unstable_by_key(|&i| least_loaded_key(nodes, i));
    if load(&nodes[decode[0] as usize]) > 0 {
        return None;
    }
    Some(Decision {
        route: Route::Whole(decode),
        reverse_pull: None,
    })
}

/// Cached prefix blocks of node `i` minus its queued and running requests.
fn score(request: &Request, nodes: &[Node], i: u32) -> i64 {
    let n = &nodes[i as usize];
    let prefix = request.prefix_blocks.get(i as usize).copied().unwrap_or(0);
    i64::from(prefix) - i64::from(n.waiting) - i64::from(n.running)
}

#[cfg(test)]
mod tests;
