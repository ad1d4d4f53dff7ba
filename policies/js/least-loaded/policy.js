// Least-loaded routing policy, in JavaScript, as a WebAssembly component for pd-gateway.
//
// The same rules as the Rust guest `policies/least-loaded` and the gateway's built-in fallback
// (`pd_policy::native::least_loaded`); the gateway's tests check that they all decide the same.
// Written against `pd:policy@1.0.0` (wit/policy.wit): the view comes as columns, node `i` at
// index `i` of each per-node list (`view.waiting[i]`, `view.freeBlocks[i]`, ...), and each
// role's nodes as an ascending list of indices (`view.prefill`, `view.decode`,
// `view.standalone`).
//
// - Candidates for a role: its nodes that are not draining (`view.draining`), or all its nodes
//   when every one of them is draining.
// - Route: if the view has a prefill and a decode node, split (prefill ranked, decode ranked,
//   each decode entry taking all `n` children: one pull, children forked on that node, the
//   other entries are failover); else, if it has a standalone node, whole (standalone ranked);
//   else reject with 503.
// - Rank: load = `waiting + running + waiting-remote-kv`, lowest first; then most `free-blocks`
//   first; then lowest index first.
//
// Build: `policies/js/build.sh policies/js/least-loaded OUT.wasm` (componentize-js).
//
// How WIT values look here (componentize-js): records are objects with camelCase fields
// (`view.freeBlocks`, `view.waitingRemoteKv`, `request.prefixBlocks`), a `list<u32>` is a
// `Uint32Array` (`Array.from` makes a plain array of it; answer plain arrays), a variant is
// `{ tag, val }`, an absent option is `undefined`, u32 is a number and u64 a BigInt
// (`request.seq`).

/** Message of the 503 when no node can serve the request. */
const NO_NODES =
  "no node can serve this request: the view has no prefill+decode pair and no standalone node";

/** Requests on node `i`: queued, running, and parked waiting for KV. */
function load(view, i) {
  return view.waiting[i] + view.running[i] + view.waitingRemoteKv[i];
}

/** The nodes of `role` (one of the view's role lists) that are not draining, or all of them
 * when every one drains; ascending, as a plain array. */
function candidates(view, role) {
  const draining = new Set(view.draining);
  const all = Array.from(role);
  const live = all.filter((i) => !draining.has(i));
  return live.length > 0 ? live : all;
}

/** The candidates of `role`, best first: least load, then most free blocks, then lowest index
 * (the index is part of the key, so keys are unique and the order is exact). */
function ranked(view, role) {
  return candidates(view, role).sort(
    (a, b) => load(view, a) - load(view, b) || view.freeBlocks[b] - view.freeBlocks[a] || a - b,
  );
}

/** Decides where `request` goes, given `view` (the world's export `decide`). */
export function decide(request, view) {
  let route;
  if (view.prefill.length > 0 && view.decode.length > 0) {
    const decode = ranked(view, view.decode);
    route = {
      tag: "split",
      val: {
        prefill: ranked(view, view.prefill),
        decode,
        children: decode.map(() => Math.max(request.n, 1)),
      },
    };
  } else if (view.standalone.length > 0) {
    route = { tag: "whole", val: ranked(view, view.standalone) };
  } else {
    route = { tag: "reject", val: { status: 503, message: NO_NODES } };
  }
  return { route, reversePull: undefined };
}
