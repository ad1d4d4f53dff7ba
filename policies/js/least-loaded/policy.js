// Least-loaded routing policy, in JavaScript, as a WebAssembly component for pd-gateway.
//
// The same rules as the Rust guest `policies/least-loaded` and the gateway's built-in fallback
// (`pd_policy::native::least_loaded`); the gateway's tests check that they all decide the same.
//
// - Candidates for a role: its nodes that are not draining, or all its nodes when every one of
//   them is draining.
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
// (`freeBlocks`, `waitingRemoteKv`, `prefixBlocks`), enums are strings (`"prefill"`), a variant
// is `{ tag, val }`, an absent option is `undefined`, u32 is a number and u64 a BigInt
// (`request.seq`).

/** Message of the 503 when no node can serve the request. */
const NO_NODES =
  "no node can serve this request: the view has no prefill+decode pair and no standalone node";

/** Requests on a node: queued, running, and parked waiting for KV. */
function load(node) {
  return node.waiting + node.running + node.waitingRemoteKv;
}

/** Indices of the nodes of `role`, not draining ones unless all of them drain. */
function candidates(nodes, role) {
  const ofRole = [];
  nodes.forEach((n, i) => {
    if (n.role === role) ofRole.push(i);
  });
  const live = ofRole.filter((i) => !nodes[i].draining);
  return live.length > 0 ? live : ofRole;
}

/** Least load first, then most free blocks, then lowest index (the index is part of the key,
 * so keys are unique and the order is exact). */
function ranked(nodes, indices) {
  return indices.sort((a, b) => {
    const na = nodes[a];
    const nb = nodes[b];
    return load(na) - load(nb) || nb.freeBlocks - na.freeBlocks || a - b;
  });
}

/** Decides where `request` goes, given `view` (the world's export `decide`). */
export function decide(request, view) {
  const nodes = view.nodes;
  const has = (role) => nodes.some((n) => n.role === role);
  let route;
  if (has("prefill") && has("decode")) {
    const children = Math.max(request.n, 1);
    route = {
      tag: "split",
      val: {
        prefill: ranked(nodes, candidates(nodes, "prefill")),
        decode: ranked(nodes, candidates(nodes, "decode")).map((node) => ({ node, children })),
      },
    };
  } else if (has("standalone")) {
    route = { tag: "whole", val: ranked(nodes, candidates(nodes, "standalone")) };
  } else {
    route = { tag: "reject", val: { status: 503, message: NO_NODES } };
  }
  return { route, reversePull: undefined };
}
