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

Build: `policies/python/build.sh policies/python/prefix-aware OUT.wasm` (componentize-py; the
bindings module `wit_world` is generated from wit/policy.wit at build time).
"""

import wit_world
from wit_world.imports.types import (
    Decision,
    DecodeTarget,
    Rejection,
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


class WitWorld(wit_world.WitWorld):
    def decide(self, request, view):
        nodes = view.nodes
        prefix = request.prefix_blocks
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
        return Decision(route=route, reverse_pull=None)
