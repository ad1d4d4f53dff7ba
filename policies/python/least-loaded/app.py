"""Least-loaded routing policy, in Python, as a WebAssembly component for pd-gateway.

The same rules as the Rust guest `policies/least-loaded` and the gateway's built-in fallback
(`pd_policy::native::least_loaded`); the gateway's tests check that they all decide the same.

- Candidates for a role: its nodes that are not draining, or all its nodes when every one of
  them is draining.
- Route: if the view has a prefill and a decode node, split (prefill ranked, decode ranked,
  each decode entry taking all `n` children: one pull, children forked on that node, the other
  entries are failover); else, if it has a standalone node, whole (standalone ranked); else
  reject with 503.
- Rank: load = `waiting + running + waiting-remote-kv`, lowest first; then most `free-blocks`
  first; then lowest index first.

Build: `policies/python/build.sh policies/python/least-loaded OUT.wasm` (componentize-py; the
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


def candidates(nodes, role):
    """Indices of the nodes of `role`, not draining ones unless all of them drain."""
    of_role = [i for i, n in enumerate(nodes) if n.role == role]
    live = [i for i in of_role if not nodes[i].draining]
    return live if live else of_role


def ranked(nodes, indices):
    """Least load first, then most free blocks, then lowest index (the index is part of the
    key, so keys are unique and the order is exact)."""
    return sorted(indices, key=lambda i: (load(nodes[i]), -nodes[i].free_blocks, i))


class WitWorld(wit_world.WitWorld):
    def decide(self, request, view):
        nodes = view.nodes
        roles = {n.role for n in nodes}
        if Role.PREFILL in roles and Role.DECODE in roles:
            children = max(request.n, 1)
            route = Route_Split(
                Split(
                    prefill=ranked(nodes, candidates(nodes, Role.PREFILL)),
                    decode=[
                        DecodeTarget(node=i, children=children)
                        for i in ranked(nodes, candidates(nodes, Role.DECODE))
                    ],
                )
            )
        elif Role.STANDALONE in roles:
            route = Route_Whole(ranked(nodes, candidates(nodes, Role.STANDALONE)))
        else:
            route = Route_Reject(Rejection(status=503, message=NO_NODES))
        return Decision(route=route, reverse_pull=None)
