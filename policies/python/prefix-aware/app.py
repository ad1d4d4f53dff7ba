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
            d = to_holder(request, nodes, holder)
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
        return Decision(route=route, reverse_pull=reverse_pull)
