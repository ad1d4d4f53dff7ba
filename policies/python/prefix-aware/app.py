"""Prefix-aware routing policy, in Python, as a WebAssembly component for pd-gateway.

The same rules as the Rust guest `policies/prefix-aware` and `pd_policy::native::prefix_aware`;
the gateway's tests check that they all decide the same. Written against `pd:policy@1.0.0`
(wit/policy.wit): the view comes as columns, node `i` at index `i` of each per-node list, each
role's nodes as an ascending list of indices, with the rates the nodes measure.

- Candidates for a role: its nodes that are not draining (`view.draining`), or all its nodes
  when every one of them is draining.
- Route: if the view has a prefill and a decode node, split; else, if it has a standalone
  node, whole; else reject with 503. Each decode entry takes all `n` children.
- Prefill and whole ranking: score = `prefix-blocks[i] - (waiting + running)` (cached leading
  blocks of this prompt, minus the node's queued and running requests; a node past the end of
  `prefix-blocks` holds 0), highest first; ties in least-loaded order: load =
  `waiting + running + waiting-remote-kv` lowest first, then most `free-blocks`, then lowest
  index.
- Decode ranking: least-loaded order (the decode node pulls the KV, so its cache does not
  matter).

One cached block counts as much as one queued or running request: a node holding 10 more
blocks of the prompt wins over a node with up to 9 more requests on it.

Multi-turn. The holder is `view.conversation`'s node (earlier-turn KV of this conversation
under a lease), when there is one with some tokens (a node index past the view's is ignored):
1. Route to the holder: when it is a decode or standalone node, not draining, the turn adds at
   most `holder-max-new-tokens` prompt tokens beyond what it holds, its load is at most the
   least-loaded candidate of its role's plus `holder-load-slack`, and it has at most
   `holder-max-busy` requests queued or running (`waiting + running`: parked ones compute
   nothing yet; 0: an idle holder, so no decode running there waits behind this prefill):
   whole with the holder first, then the other candidates of its role in least-loaded order,
   reverse pull from the holder with min-tokens 0.
2. Else, on a split, pull the turn back to P when it holds at least min-pull tokens, the fewest
   for which a pull (`pull-overhead-us` + tokens x `kv-bytes-per-token` at `pull-mb-per-s`)
   costs less than recomputing them at `prefill-tokens-per-s`: reverse pull from the holder
   with that min-tokens. The two rates are the ones the first prefill candidate (the node that
   would pull and compute) measured (`view.prefill_tokens_per_s[p]`, `view.pull_mb_per_s[p]`),
   and the KV bytes per token the view's (`view.kv_bytes_per_token`): each where known
   (non-zero), else the config's.
3. Else recompute. Parameters come from the policy config (defaults below).

The Rust guest's opt-in keys (unset by default but the keep rule; `off` unsets one; the Rust
guest's doc says why each exists), read the same way:
- `idle-peer-max-busy`, between 1 and 2: when the holder qualifies for rule 1 but for its load
  or its draining, the least-loaded other candidate of its role takes the whole turn if it has
  at most that many requests queued or running and the held tokens are worth a pull at that
  peer's rates (as in 2): whole with that peer first, then the role's other candidates (the
  holder included unless it drains) in least-loaded order, reverse pull from the holder with
  min-tokens min-pull.
- `decode-holder-slack`: a turn pulled back (2) decodes on the holder when its load is at most
  the least-loaded decode candidate's plus that slack.
- `spill-prefill-busy`: a request with no holder runs whole on the least-loaded decode
  candidate when that one has load 0 and every prefill candidate has at least that many
  requests queued or running; then the other decode candidates; no reverse pull.
- `keep-on-prefill-decode-busy` (1 by default; `off` turns it off): a split (after 2 and 3)
  whose decode candidates all have a load of at least that runs whole on its prefill list when
  the first has load 0; the reverse pull unchanged.

Defaults: prefill-tokens-per-s 2000, kv-bytes-per-token 23040 (SmolLM2-135M, f16 KV),
pull-mb-per-s 1000, pull-overhead-us 2000, holder-max-new-tokens 256, holder-load-slack 2,
holder-max-busy 0. A value is read as the Rust guest reads it: surrounding whitespace trimmed,
a whole number that fits 64 bits (an optional `+`), else the default.

Build: `policies/python/build.sh policies/python/prefix-aware OUT.wasm` (componentize-py; the
bindings module `wit_world` is generated from wit/policy.wit at build time).
"""

import wit_world
from wit_world.imports import host
from wit_world.imports.types import (
    Decision,
    Rejection,
    ReversePull,
    Route_Reject,
    Route_Split,
    Route_Whole,
    Split,
)

# Message of the 503 when no node can serve the request.
NO_NODES = (
    "no node can serve this request: the view has no prefill+decode pair and no standalone node"
)

U32_MAX = 0xFFFFFFFF
U64_MAX = 0xFFFFFFFFFFFFFFFF

# `keep-on-prefill-decode-busy` when the config does not set it.
KEEP_ON_PREFILL_DEFAULT = 1

# What Rust's `str::trim` strips (Unicode White_Space; Python's `strip()` also strips
# U+001C..U+001F).
_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def parse_u64(text):
    """`text.trim().parse::<u64>()` as in Rust: an optional `+`, ASCII digits, at most
    2**64 - 1; None otherwise."""
    s = text.strip(_WHITESPACE)
    if s.startswith("+"):
        s = s[1:]
    if not s or not (s.isascii() and s.isdigit()):
        return None
    s = s.lstrip("0") or "0"
    if len(s) > 20:
        return None
    v = int(s)
    return v if v <= U64_MAX else None


def param(key, default):
    """A numeric config value, or `default` when unset or not a number."""
    v = host.config(key)
    if v is None:
        return default
    n = parse_u64(v)
    return default if n is None else n


def opt_in(key, default=None):
    """An opt-in rule's setting: the config's whole number, None for `off`, else `default`."""
    v = host.config(key)
    if v is None:
        return default
    t = v.strip(_WHITESPACE)
    if t.isascii() and t.lower() == "off":
        return None
    n = parse_u64(t)
    return default if n is None else n


def known_or(measured, key, default):
    """`measured` when known (non-zero), else the config's `key`."""
    return measured if measured > 0 else param(key, default)


def min_pull_tokens(prefill_tokens_per_s, pull_mb_per_s, kv_bytes_per_token):
    """Fewest held tokens worth a pull for a node that prefills at `prefill_tokens_per_s` and
    pulls at `pull_mb_per_s`, `kv_bytes_per_token` moving per token (each 0: unknown, the
    config's) (2**32 - 1: never, when a token moves slower than it computes). Integer
    nanoseconds, saturating at 2**64 - 1, as the Rust guest."""
    prefill_rate = max(known_or(prefill_tokens_per_s, "prefill-tokens-per-s", 2000), 1)
    kv_bytes = known_or(kv_bytes_per_token, "kv-bytes-per-token", 23040)
    pull_rate = max(known_or(pull_mb_per_s, "pull-mb-per-s", 1000), 1)
    recompute_ns = 1_000_000_000 // prefill_rate
    pull_ns = min(kv_bytes * 1000, U64_MAX) // pull_rate
    gain = recompute_ns - pull_ns
    if gain <= 0:
        return U32_MAX
    t = -(-min(param("pull-overhead-us", 2000) * 1000, U64_MAX) // gain)
    return min(max(t, 1), U32_MAX)


def min_pull_tokens_at(view, i):
    """`min_pull_tokens` at node `i`'s measured rates and the view's KV bytes per token."""
    return min_pull_tokens(
        view.prefill_tokens_per_s[i], view.pull_mb_per_s[i], view.kv_bytes_per_token
    )


def load(view, i):
    """Requests on node `i`: queued, running, and parked waiting for KV."""
    return view.waiting[i] + view.running[i] + view.waiting_remote_kv[i]


def busy(view, i):
    """Requests node `i` computes or has queued to compute: `waiting + running` (requests
    parked for KV compute nothing yet)."""
    return view.waiting[i] + view.running[i]


def score(view, i, prefix_blocks):
    """Cached prefix blocks minus queued and running requests (may be negative)."""
    return prefix_blocks - view.waiting[i] - view.running[i]


def candidates(view, role):
    """The nodes of `role` (one of the view's role lists) that are not draining, or all of
    them when every one drains; ascending."""
    draining = set(view.draining)
    live = [i for i in role if i not in draining]
    return live if live else list(role)


def least_loaded_key(view, i):
    """Least load first, then most free blocks, then lowest index (unique keys: exact order)."""
    return (load(view, i), -view.free_blocks[i], i)


def least_loaded(view, indices):
    """Least-loaded order."""
    return sorted(indices, key=lambda i: least_loaded_key(view, i))


def by_prefix(view, prefix, indices):
    """Highest score first, then least-loaded order. `prefix[i]` is how many leading blocks of
    the prompt node `i` holds; the list may be shorter than the view (missing: 0)."""

    def key(i):
        p = prefix[i] if i < len(prefix) else 0
        return (-score(view, i, p), least_loaded_key(view, i))

    return sorted(indices, key=key)


def holder_role(view, h):
    """The role list (decode or standalone) holder `h` is in, or None (a prefill holder)."""
    if h in view.decode:
        return view.decode
    if h in view.standalone:
        return view.standalone
    return None


def to_holder(request, view, h):
    """Rule 1: the whole request on the holder, or None when it does not qualify."""
    role = holder_role(view, h.node)
    if role is None or h.node in view.draining:
        return None
    fresh = max(request.prompt_tokens - h.tokens, 0)
    if fresh > param("holder-max-new-tokens", 256):
        return None
    others = candidates(view, role)
    lightest = min(load(view, i) for i in others)
    if load(view, h.node) > lightest + param("holder-load-slack", 2):
        return None
    if busy(view, h.node) > param("holder-max-busy", 0):
        return None
    ranked = [h.node] + [i for i in least_loaded(view, others) if i != h.node]
    return Decision(
        route=Route_Whole(ranked), reverse_pull=ReversePull(from_=h.node, min_tokens=0)
    )


def to_idle_peer(request, view, h):
    """Rule 1b (`idle-peer-max-busy` set): the whole turn on the least-loaded other node of the
    holder's role, when that peer is busy with at most the setting and the history is worth
    pulling at the peer's rates; or None."""
    max_busy = opt_in("idle-peer-max-busy")
    if max_busy is None:
        return None
    role = holder_role(view, h.node)
    if role is None:
        return None
    if max(request.prompt_tokens - h.tokens, 0) > param("holder-max-new-tokens", 256):
        return None
    ranked = least_loaded(view, candidates(view, role))
    peer = next((i for i in ranked if i != h.node), None)
    if peer is None or busy(view, peer) > max_busy:
        return None
    min_tokens = min_pull_tokens_at(view, peer)
    if h.tokens < min_tokens:
        return None
    # The peer first, then the rest in least-loaded order (the holder among them unless it
    # drains).
    ranked = [peer] + [i for i in ranked if i != peer]
    return Decision(
        route=Route_Whole(ranked), reverse_pull=ReversePull(from_=h.node, min_tokens=min_tokens)
    )


def spill(view):
    """The spill rule (`spill-prefill-busy` set): whole on an idle decode node when every
    prefill candidate is busy with at least the setting, or None."""
    # Cheap tests first: most requests meet no idle decode node, and then skip the host call.
    if not view.prefill or not any(load(view, i) == 0 for i in view.decode):
        return None
    min_busy = opt_in("spill-prefill-busy")
    if min_busy is None:
        return None
    if any(busy(view, i) < min_busy for i in candidates(view, view.prefill)):
        return None
    decode = least_loaded(view, candidates(view, view.decode))
    if load(view, decode[0]) > 0:
        return None
    return Decision(route=Route_Whole(decode), reverse_pull=None)


def holder_decodes_first(view, h, slack, decode):
    """Moves holder `h` to the front of `decode` when it is there and its load is at most the
    lightest candidate's plus `slack` (every entry takes the same children, so `children`
    needs no reordering)."""
    if h not in decode:
        return
    pos = decode.index(h)
    lightest = min(load(view, d) for d in decode)
    if pos > 0 and load(view, h) <= lightest + slack:
        decode.insert(0, decode.pop(pos))


def keep_on_prefill(view, split):
    """The keep rule: whether `split` should run whole on its first prefill node, because that
    node has no load and every decode candidate at least `keep-on-prefill-decode-busy`."""
    # Cheap test first: a busy P (the common case) skips the host call.
    if load(view, split.prefill[0]) > 0:
        return False
    min_load = opt_in("keep-on-prefill-decode-busy", KEEP_ON_PREFILL_DEFAULT)
    if min_load is None:
        return False
    return all(load(view, d) >= min_load for d in split.decode)


class WitWorld(wit_world.WitWorld):
    def decide(self, request, view):
        prefix = request.prefix_blocks
        h = view.conversation
        if h is not None and not (h.tokens > 0 and h.node < len(view.free_blocks)):
            h = None
        if h is not None:
            d = to_holder(request, view, h) or to_idle_peer(request, view, h)
            if d is not None:
                return d
        else:
            d = spill(view)
            if d is not None:
                return d
        if view.prefill and view.decode:
            decode = least_loaded(view, candidates(view, view.decode))
            split = Split(
                prefill=by_prefix(view, prefix, candidates(view, view.prefill)),
                decode=decode,
                children=[max(request.n, 1)] * len(decode),
            )
            route = Route_Split(split)
        else:
            split = None
            if view.standalone:
                route = Route_Whole(by_prefix(view, prefix, candidates(view, view.standalone)))
            else:
                route = Route_Reject(Rejection(status=503, message=NO_NODES))
        reverse_pull = None
        if h is not None and split is not None:
            min_tokens = min_pull_tokens_at(view, split.prefill[0])
            if h.tokens >= min_tokens:
                reverse_pull = ReversePull(from_=h.node, min_tokens=min_tokens)
        slack = opt_in("decode-holder-slack")
        if reverse_pull is not None and slack is not None:
            holder_decodes_first(view, h.node, slack, split.decode)
        if split is not None and keep_on_prefill(view, split):
            route = Route_Whole(split.prefill)
        return Decision(route=route, reverse_pull=reverse_pull)
