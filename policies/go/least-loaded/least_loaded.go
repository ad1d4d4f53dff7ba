// Least-loaded routing policy, written in Go, as a WebAssembly component for pd-gateway.
//
// The same rules as the Rust guest `policies/least-loaded` and the gateway's built-in fallback
// `pd_policy::native::least_loaded`; the gateway's tests (gateway/policy/tests/languages.rs)
// check that all of them give the same decision on the same inputs. Written against
// `pd:policy@1.0.0` (`wit/policy.wit`): the view comes as columns, node `i` at index `i` of
// each per-node list, and each role's nodes as a list of indices.
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
	v := &view
	var route types.Route
	switch {
	case len(v.Prefill) > 0 && len(v.Decode) > 0:
		decode := ranked(v, v.Decode)
		children := make([]uint32, len(decode))
		for j := range children {
			children[j] = max(request.N, 1)
		}
		route = types.MakeRouteSplit(types.Split{
			Prefill:  ranked(v, v.Prefill),
			Decode:   decode,
			Children: children,
		})
	case len(v.Standalone) > 0:
		route = types.MakeRouteWhole(ranked(v, v.Standalone))
	default:
		route = types.MakeRouteReject(types.Rejection{Status: 503, Message: noNodes})
	}
	return types.Decision{Route: route, ReversePull: witTypes.None[types.ReversePull]()}
}

// load is the requests on node `i`: queued, running, and parked waiting for KV (in uint64, so
// the sum of three uint32 cannot wrap).
func load(v *types.View, i uint32) uint64 {
	return uint64(v.Waiting[i]) + uint64(v.Running[i]) + uint64(v.WaitingRemoteKv[i])
}

// ranked is the nodes of `role` (one of the view's role lists), best first: the ones not
// draining, or all of them when every one drains; in a new slice (`role` is left as it is).
// Least load first, then most free blocks, then lowest index: keys are unique (the index is
// part of them), so an unstable sort is exact.
func ranked(v *types.View, role []uint32) []uint32 {
	c := make([]uint32, 0, len(role))
	// Both lists are ascending: one cursor walks `draining` beside the role's nodes.
	d := 0
	for _, i := range role {
		for d < len(v.Draining) && v.Draining[d] < i {
			d++
		}
		if d == len(v.Draining) || v.Draining[d] != i {
			c = append(c, i)
		}
	}
	if len(c) == 0 {
		c = append(c, role...)
	}
	slices.SortFunc(c, func(a, b uint32) int {
		if o := cmp.Compare(load(v, a), load(v, b)); o != 0 {
			return o
		}
		if o := cmp.Compare(v.FreeBlocks[b], v.FreeBlocks[a]); o != 0 {
			return o
		}
		return cmp.Compare(a, b)
	})
	return c
}
