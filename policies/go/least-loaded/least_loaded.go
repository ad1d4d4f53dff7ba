// Least-loaded routing policy, written in Go, as a WebAssembly component for pd-gateway.
//
// The same rules as the Rust guest `policies/least-loaded` and the gateway's built-in fallback
// `pd_policy::native::least_loaded`; the gateway's tests (gateway/policy/tests/languages.rs)
// check that all of them give the same decision on the same inputs.
//
//   - Candidates for a role: its nodes that are not draining, or all its nodes when every one
//     of them is draining.
//   - Route: if the view has a prefill and a decode node, split (prefill ranked, decode
//     ranked, each decode entry taking all `n` children: one pull, children forked on that
//     node, the other entries are failover); else, if it has a standalone node, whole
//     (standalone ranked); else reject with 503.
//   - Rank: load = `waiting + running + waiting-remote-kv`, lowest first; then most
//     `free-blocks` first; then lowest index first.
//
// Build it with policies/go/build.sh, which generates the bindings (`wit-bindgen go`) into a
// module `wit_component` and puts this file in its package `export_wit_world`: the package
// whose `Decide` the generated `decide` export calls. Each call runs in a fresh instance, so
// nothing here needs to outlive a call (and the Go garbage collector frees what does).
package export_wit_world

import (
	"cmp"
	"slices"

	types "wit_component/pd_policy_types"

	witTypes "go.bytecodealliance.org/pkg/wit/types"
)

// noNodes is the message of the 503 when no node can serve the request.
const noNodes = "no node can serve this request: the view has no prefill+decode pair and no standalone node"

// Decide decides where `request` goes, given `view`: the world's `decide` export.
func Decide(request types.Request, view types.View) types.Decision {
	nodes := view.Nodes
	var route types.Route
	switch {
	case has(nodes, types.RolePrefill) && has(nodes, types.RoleDecode):
		children := max(request.N, 1)
		order := ranked(nodes, candidates(nodes, types.RoleDecode))
		decode := make([]types.DecodeTarget, len(order))
		for k, i := range order {
			decode[k] = types.DecodeTarget{Node: i, Children: children}
		}
		route = types.MakeRouteSplit(types.Split{
			Prefill: ranked(nodes, candidates(nodes, types.RolePrefill)),
			Decode:  decode,
		})
	case has(nodes, types.RoleStandalone):
		route = types.MakeRouteWhole(ranked(nodes, candidates(nodes, types.RoleStandalone)))
	default:
		route = types.MakeRouteReject(types.Rejection{Status: 503, Message: noNodes})
	}
	return types.Decision{Route: route, ReversePull: witTypes.None[types.ReversePull]()}
}

// has tells whether the view has a node of `role` (draining or not).
func has(nodes []types.Node, role types.Role) bool {
	return slices.ContainsFunc(nodes, func(n types.Node) bool { return n.Role == role })
}

// load is the requests on a node: queued, running, and parked waiting for KV (in uint64, so
// the sum of three uint32 cannot wrap).
func load(n *types.Node) uint64 {
	return uint64(n.Waiting) + uint64(n.Running) + uint64(n.WaitingRemoteKv)
}

// candidates is the indices of the nodes of `role`, not draining ones unless all of them drain.
func candidates(nodes []types.Node, role types.Role) []uint32 {
	pick := func(drainingOK bool) []uint32 {
		c := make([]uint32, 0, len(nodes))
		for i := range nodes {
			if nodes[i].Role == role && (drainingOK || !nodes[i].Draining) {
				c = append(c, uint32(i))
			}
		}
		return c
	}
	if live := pick(false); len(live) > 0 {
		return live
	}
	return pick(true)
}

// ranked sorts `c` least load first, then most free blocks, then lowest index (keys are
// unique: the index is part of them, so an unstable sort is exact).
func ranked(nodes []types.Node, c []uint32) []uint32 {
	slices.SortFunc(c, func(a, b uint32) int {
		na, nb := &nodes[a], &nodes[b]
		if o := cmp.Compare(load(na), load(nb)); o != 0 {
			return o
		}
		if o := cmp.Compare(nb.FreeBlocks, na.FreeBlocks); o != 0 {
			return o
		}
		return cmp.Compare(a, b)
	})
	return c
}
