"""Least-loaded routing policy, in Python, as a WebAssembly component for pd-gateway.

The same rules as the Rust guest `policies/least-loaded` and the gateway's built-in fallback
(`pd_policy::native::least_loaded`); the gateway's tests check that they all decide the same.
Written against `pd:policy@1.0.0` (wit/policy.wit): the view comes as columns, node `i` at index
`i` of each per-node list (`view.waiting[i]`, `view.free_blocks[i]`, ...), and each role's nodes
as an ascending list of indices (`view.prefill`, `view.decode`, `view.standalone`).

- Candidates for a role: its nodes that are not draining (`view.draining`), or all its nodes
  when every one of them is draining.
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
    Rejection,
    Route_Reject,
    Route_Split,
    Route_Whole,
    Split,
)

# Message of the 503 when no node can serve the request.
NO_NODES = (
    "no node can serve this request: the view has no prefill+decode pair and no standalone node"
)


def load(view, i):
    """Requests on node `i`: queued, running, and parked waiting for KV."""
    return view.waiting[i] + view.running[i] + view.waiting_remote_kv[i]


def candidates(view, role):
    """The nodes of `role` (one of the view's role lists) that are not draining, or all of them
    when every one drains; ascending."""
    draining = set(view.draining)
    live = [i for i in role if i not in draining]
    return live if live else list(role)


def ranked(view, role):
    """The candidates of `role`, best first: least load, then most free blocks, then lowest
    index (the index is part of the key, so keys are unique and the order is exact)."""
    return sorted(
        candidates(view, role), key=lambda i: (load(view, i), -view.free_blocks[i], i)
    )


class WitWorld(wit_world.WitWorld):
    def decide(self, request, view):
        if view.prefill and view.decode:
            decode = ranked(view, view.decode)
            route = Route_Split(
                Split(
                    prefill=ranked(view, view.prefill),
                    decode=decode,
                    children=[max(request.n, 1)] * len(decode),
                )
            )
        elif view.standalone:
            route = Route_Whole(ranked(view, view.standalone))
        else:
            route = Route_Reject(Rejection(status=503, message=NO_NODES))
        return Decision(route=route, reverse_pull=None)
