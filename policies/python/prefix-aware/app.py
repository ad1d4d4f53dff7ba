"""Prefix-aware routing policy, in Python, as a WebAssembly component for pd-gateway.

The same rules as the Rust guest `policies/prefix-aware` and `pd_policy::native::prefix_aware`;
the gateway's tests check that they all decide the same.

- Candidates for a role: its nodes that are not draining, or all its nodes when every one of
  them is draining.
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

Multi-turn. The holder is the node with the most `conversation_tokens` (earlier-turn KV of this
conversation under a lease; ties to the lowest index), when any has some:
1. Route to the holder: when it is a decode or standalone node, not draining, the turn adds at
   most `holder-max-new-tokens` prompt tokens beyond what it holds, and its load is at most the
   least-loaded candidate of its role's plus `holder-load-slack`, and it has at most
   `holder-max-busy` requests queued or running (parked ones compute nothing yet; 0: an idle
   holder, so no decode running there waits behind this prefill): whole with the holder first,
   then the other candidates of its role in least-loaded order, reverse pull from the holder
   with min-tokens 0.
2. Else, on a split, pull the turn back to P when it holds at least min-pull tokens, the fewest
   for which a pull (`pull-overhead-us` + tokens x `kv-bytes-per-token` at `pull-mb-per-s`)
   costs less than recomputing them at `prefill-tokens-per-s`.
3. Else recompute. Parameters come from the policy config (defaults below).

The Rust guest's opt-in keys (unset by default but the keep rule; `off` unsets one; the Rust
guest's doc says why each exists), read the same way:
- `idle-peer-max-busy`, between 1 and 2: when the holder qualifies for rule 1 but for its load
  or its draining, the least-loaded other candidate of its role takes the whole turn if it has
  at most that many requests queued or running and the held tokens are worth a pull (as in 2):
  whole with that peer first, then the role's other candidates in least-loaded order, reverse
  pull from the holder with min-tokens min-pull.
- `decode-holder-slack`: a turn pulled back (2) decodes on the holder when its load is at most
  the least-loaded decode candidate's plus that slack.
- `spill-prefill-busy`: a request with no holder runs whole on the least-loaded decode
  candidate when that one has load 0 and every prefill candidate has at least that many
  requests queued or running; then the other decode candidates; no reverse pull.
- `keep-on-prefill-decode-busy` (1 by default; `off` turns it off): a split (after 2 and 3)
  whose decode candidates all have a load of at least that runs whole on its prefill list when
  the first has load 0; the reverse pull unchanged.

Build: `policies/python/build.sh policies/python/prefix-aware OUT.wasm` (componentize-py; the
bindings module `wit_world` is generated from wit/policy.wit at build time).
"""

import wit_world
from wit_world.imports import host
from wit_world.imports.types import (
    Decision,
    DecodeTarget,
    Rejection,
    ReversePull,
    Role,
    Route_Reject,
    Route_Split,
    Route_Whole,
    Split,
)

# Message of the 503 when no node can serve the request.
NO_NODES = (
    "no node can serve this request: the view has no prefill+decode pair and no standalone node"
)


def load(node):
    """Requests on a node: queued, running, and parked waiting for KV."""
    return node.waiting + node.running + node.waiting_remote_kv


def busy(node):
    """Requests a node computes or has queued to compute (parked ones compute nothing yet)."""
    return node.waiting + node.running


def score(node, prefix_blocks):
    """Cached prefix blocks minus queued and running requests (may be negative)."""
    return prefix_blocks - node.waiting - node.running


def candidates(nodes, role):
    """Indices of the nodes of `role`, not draining ones unless all of them drain."""
    of_role = [i for i, n in enumerate(nodes) if n.role == role]
    live = [i for i in of_role if not nodes[i].draining]
    return live if live else of_role


def least_loaded_key(nodes, i):
    """Least load first, then most free blocks, then lowest index (unique keys: exact order)."""
    n = nodes[i]
    return (load(n), -n.free_blocks, i)


def least_loaded(nodes, indices):
    """Least-loaded order."""
    return sorted(indices, key=lambda i: least_loaded_key(nodes, i))


def by_prefix(nodes, prefix, indices):
    """Highest score first, then least-loaded order. `prefix[i]` is how many leading blocks of
    the prompt node `i` holds; the list may be shorter than the view (missing: 0)."""

    def key(i):
        p = prefix[i] if i < len(prefix) else 0
        return (-score(nodes[i], p), least_loaded_key(nodes, i))

    return sorted(indices, key=key)


def param(key, default):
    """A numeric config value, or `default` when unset or not a number."""
    v = host.config(key)
    if v is None or not v.strip().isdigit():
        return default
    return int(v.strip())


def opt(key, default=None):
    """An opt-in rule's setting: the config's whole number, None for `off`, else `default`."""
    v = host.config(key)
    if v is None:
        return default
    v = v.strip()
    if v.lower() == "off":
        return None
    return int(v) if v.isdigit() else default


def min_pull_tokens():
    """Fewest held tokens worth a pull (2**32 - 1: never). Integer nanoseconds, as the Rust guest."""
    recompute_ns = 1_000_000_000 // max(param("prefill-tokens-per-s", 2000), 1)
    pull_ns = param("kv-bytes-per-token", 23040) * 1000 // max(param("pull-mb-per-s", 1000), 1)
    gain = recompute_ns - pull_ns
    if gain <= 0:
        return 0xFFFFFFFF
    t = -(-(param("pull-overhead-us", 2000) * 1000) // gain)
    return min(max(t, 1), 0xFFFFFFFF)


def to_holder(request, nodes, h):
    """Rule 1: the whole request on holder `h`, or None when it does not qualify."""
    n = nodes[h]
    if n.draining or n.role not in (Role.DECODE, Role.STANDALONE):
        return None
    fresh = max(request.prompt_tokens - n.conversation_tokens, 0)
    if fresh > param("holder-max-new-tokens", 256):
        return None
    others = candidates(nodes, n.role)
    if not others:
        return None
    lightest = min(load(nodes[i]) for i in others)
    if load(n) > lightest + param("holder-load-slack", 2):
        return None
    if busy(n) > param("holder-max-busy", 0):
        return None
    ranked = [h] + [i for i in least_loaded(nodes, others) if i != h]
    return Decision(route=Route_Whole(ranked), reverse_pull=ReversePull(from_=h, min_tokens=0))


def to_idle_peer(request, nodes, h):
    """Rule 1b (`idle-peer-max-busy` set): the whole turn on the least-loaded other node of the
    holder's role, or None."""
    max_busy = opt("idle-peer-max-busy")
    n = nodes[h]
    if max_busy is None or n.role not in (Role.DECODE, Role.STANDALONE):
        return None
    if max(request.prompt_tokens - n.conversation_tokens, 0) > param("holder-max-new-tokens", 256):
        return None
    ranked = least_loaded(nodes, candidates(nodes, n.role))
    peers = [i for i in ranked if i != h]
    if not peers or busy(nodes[peers[0]]) > max_busy:
        return None
    min_tokens = min_pull_tokens()
    if n.conversation_tokens < min_tokens:
        return None
    ranked = [peers[0]] + [i for i in ranked if i != peers[0]]
    return Decision(
        route=Route_Whole(ranked), reverse_pull=ReversePull(from_=h, min_tokens=min_tokens)
    )


def spill(nodes):
    """The spill rule (`spill-prefill-busy` set): whole on an idle decode node when every
    prefill candidate is busy with at least the setting, or None."""
    min_busy = opt("spill-prefill-busy")
    if min_busy is None:
        return None
    prefill = candidates(nodes, Role.PREFILL)
    decode = least_loaded(nodes, candidates(nodes, Role.DECODE))
    if not prefill or not decode or any(busy(nodes[i]) < min_busy for i in prefill):
        return None
    if load(nodes[decode[0]]) > 0:
        return None
    return Decision(route=Route_Whole(decode), reverse_pull=None)


class WitWorld(wit_world.WitWorld):
    def decide(self, request, view):
        nodes = view.nodes
        prefix = request.prefix_blocks
        holder = None
        for i, n in enumerate(nodes):
            if n.conversation_tokens > 0 and (
                holder is None or n.conversation_tokens > nodes[holder].conversation_tokens
            ):
                holder = i
        if holder is not None:
            d = to_holder(request, nodes, holder) or to_idle_peer(request, nodes, holder)
            if d is not None:
                return d
        else:
            d = spill(nodes)
            if d is not None:
                return d
        roles = {n.role for n in nodes}
        if Role.PREFILL in roles and Role.DECODE in roles:
            children = max(request.n, 1)
            route = Route_Split(
                Split(
                    prefill=by_prefix(nodes, prefix, candidates(nodes, Role.PREFILL)),
                    decode=[
                        DecodeTarget(node=i, children=children)
                        for i in least_loaded(nodes, candidates(nodes, Role.DECODE))
                    ],
                )
            )
        elif Role.STANDALONE in roles:
            route = Route_Whole(by_prefix(nodes, prefix, candidates(nodes, Role.STANDALONE)))
        else:
            route = Route_Reject(Rejection(status=503, message=NO_NODES))
        reverse_pull = None
        if holder is not None and isinstance(route, Route_Split):
            min_tokens = min_pull_tokens()
            if nodes[holder].conversation_tokens >= min_tokens:
                reverse_pull = ReversePull(from_=holder, min_tokens=min_tokens)
        slack = opt("decode-holder-slack")
        if reverse_pull is not None and slack is not None:
            # The holder first among the decode targets when it is within the slack.
            targets = route.value.decode
            pos = next((j for j, t in enumerate(targets) if t.node == holder), None)
            lightest = min(load(nodes[t.node]) for t in targets)
            if pos and load(nodes[holder]) <= lightest + slack:
                targets.insert(0, targets.pop(pos))
        min_load = opt("keep-on-prefill-decode-busy", 1)
        if (
            min_load is not None
            and isinstance(route, Route_Split)
            and load(nodes[route.value.prefill[0]]) == 0
            and all(load(nodes[t.node]) >= min_load for t in route.value.decode)
        ):
            route = Route_Whole(route.value.prefill)
        return Decision(route=route, reverse_pull=reverse_pull)
