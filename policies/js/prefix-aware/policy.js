// Prefix-aware routing policy, in JavaScript, as a WebAssembly component for pd-gateway.
//
// The same rules as the Rust guest `policies/prefix-aware` and
// `pd_policy::native::prefix_aware`; the gateway's tests check that they all decide the same.
//
// - Candidates for a role: its nodes that are not draining, or all its nodes when every one of
//   them is draining.
// - Route: if the view has a prefill and a decode node, split; else, if it has a standalone
//   node, whole; else reject with 503. Each decode entry takes all `n` children.
// - Prefill and whole ranking: score = `prefix-blocks[i] - (waiting + running)` (cached leading
//   blocks of this prompt, minus the node's queued and running requests; a node past the end of
//   `prefix-blocks` holds 0), highest first; ties in least-loaded order: load =
//   `waiting + running + waiting-remote-kv` lowest first, then most `free-blocks`, then lowest
//   index.
// - Decode ranking: least-loaded order (the decode node pulls the KV, so its cache does not
//   matter).
//
// One cached block counts as much as one queued or running request: a node holding 10 more
// blocks of the prompt wins over a node with up to 9 more requests on it.
//
// Multi-turn. The holder is the node with the most `conversationTokens` (earlier-turn KV of
// this conversation under a lease; ties to the lowest index), when any has some:
// 1. Route to the holder: when it is a decode or standalone node, not draining, the turn adds at
//    most `holder-max-new-tokens` prompt tokens beyond what it holds, and its load is at most the
//    least-loaded candidate of its role's plus `holder-load-slack`, and it has at most
//    `holder-max-busy` requests queued or running (parked ones compute nothing yet; 0: an
//    idle holder, so no decode running there waits behind this prefill): whole with the holder first,
//    then the other candidates of its role in least-loaded order, reverse pull from the holder
//    with min-tokens 0.
// 2. Else, on a split, pull the turn back to P when it holds at least min-pull tokens, the
//    fewest for which a pull (`pull-overhead-us` + tokens x `kv-bytes-per-token` at
//    `pull-mb-per-s`) costs less than recomputing them at `prefill-tokens-per-s`.
// 3. Else recompute. Parameters come from the policy config (defaults below).
//
// The Rust guest's opt-in keys (unset by default but the keep rule; `off` unsets one; the Rust
// guest's doc says why each exists), read the same way:
// - `idle-peer-max-busy`, between 1 and 2: when the holder qualifies for rule 1 but for its
//   load or its draining, the least-loaded other candidate of its role takes the whole turn if
//   it has at most that many requests queued or running and the held tokens are worth a pull
//   (as in 2): whole with that peer first, then the role's other candidates in least-loaded
//   order, reverse pull from the holder with min-tokens min-pull.
// - `decode-holder-slack`: a turn pulled back (2) decodes on the holder when its load is at
//   most the least-loaded decode candidate's plus that slack.
// - `spill-prefill-busy`: a request with no holder runs whole on the least-loaded decode
//   candidate when that one has load 0 and every prefill candidate has at least that many
//   requests queued or running; then the other decode candidates; no reverse pull.
// - `keep-on-prefill-decode-busy` (1 by default; `off` turns it off): a split (after 2 and 3)
//   whose decode candidates all have a load of at least that runs whole on its prefill list
//   when the first has load 0; the reverse pull unchanged.
//
// Build: `policies/js/build.sh policies/js/prefix-aware OUT.wasm` (componentize-js).
//
// How WIT values look here (componentize-js): records are objects with camelCase fields
// (`freeBlocks`, `waitingRemoteKv`, `prefixBlocks`), enums are strings (`"prefill"`), a variant
// is `{ tag, val }`, an absent option is `undefined`, u32 is a number and u64 a BigInt
// (`request.seq`). Sums of u32 fields stay exact in a JS number (below 2^53).

import { config } from "pd:policy/host@0.1.0";

/** Message of the 503 when no node can serve the request. */
const NO_NODES =
  "no node can serve this request: the view has no prefill+decode pair and no standalone node";

/** Requests on a node: queued, running, and parked waiting for KV. */
function load(node) {
  return node.waiting + node.running + node.waitingRemoteKv;
}

// Requests a node computes or has queued to compute (parked ones compute nothing yet).
function busy(node) {
  return node.waiting + node.running;
}

/** Cached prefix blocks minus queued and running requests (may be negative). */
function score(node, prefixBlocks) {
  return prefixBlocks - node.waiting - node.running;
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

/** Least-loaded comparison: least load first, then most free blocks, then lowest index. */
function leastLoadedCmp(nodes, a, b) {
  const na = nodes[a];
  const nb = nodes[b];
  return load(na) - load(nb) || nb.freeBlocks - na.freeBlocks || a - b;
}

/** Least-loaded order (the index is part of the key: keys are unique, the order exact). */
function leastLoaded(nodes, indices) {
  return indices.sort((a, b) => leastLoadedCmp(nodes, a, b));
}

/** Highest score first, then least-loaded order. `prefix[i]` is how many leading blocks of the
 * prompt node `i` holds; the list may be shorter than the view (missing: 0). */
function byPrefix(nodes, prefix, indices) {
  const blocks = (i) => (i < prefix.length ? prefix[i] : 0);
  return indices.sort(
    (a, b) =>
      score(nodes[b], blocks(b)) - score(nodes[a], blocks(a)) || leastLoadedCmp(nodes, a, b),
  );
}

/** A numeric config value (an integer), or `fallback` when unset or not a number. */
function param(key, fallback) {
  const v = config(key);
  if (v === undefined || !/^\s*\d+\s*$/.test(v)) return fallback;
  return Number(v.trim());
}

/** An opt-in rule's setting: the config's whole number, `undefined` for `off`, else
 * `fallback`. */
function opt(key, fallback) {
  const v = config(key);
  if (v === undefined) return fallback;
  if (v.trim().toLowerCase() === "off") return undefined;
  return /^\s*\d+\s*$/.test(v) ? Number(v.trim()) : fallback;
}

/** Fewest held tokens worth a pull (2^32 - 1: never). Integer nanoseconds, as the Rust guest. */
function minPullTokens() {
  const recomputeNs = Math.floor(1e9 / Math.max(param("prefill-tokens-per-s", 2000), 1));
  const pullNs = Math.floor(
    (param("kv-bytes-per-token", 23040) * 1000) / Math.max(param("pull-mb-per-s", 1000), 1),
  );
  const gain = recomputeNs - pullNs;
  if (gain <= 0) return 0xffffffff;
  const t = Math.ceil((param("pull-overhead-us", 2000) * 1000) / gain);
  return Math.min(Math.max(t, 1), 0xffffffff);
}

/** Rule 1: the whole request on holder `h`, or `undefined` when it does not qualify. */
function toHolder(request, nodes, h) {
  const n = nodes[h];
  if (n.draining || (n.role !== "decode" && n.role !== "standalone")) return undefined;
  const fresh = Math.max(request.promptTokens - n.conversationTokens, 0);
  if (fresh > param("holder-max-new-tokens", 256)) return undefined;
  const others = candidates(nodes, n.role);
  if (others.length === 0) return undefined;
  const lightest = Math.min(...others.map((i) => load(nodes[i])));
  if (load(n) > lightest + param("holder-load-slack", 2)) return undefined;
  if (busy(n) > param("holder-max-busy", 0)) return undefined;
  const list = [h, ...leastLoaded(nodes, others).filter((i) => i !== h)];
  return { route: { tag: "whole", val: list }, reversePull: { from: h, minTokens: 0 } };
}

/** Rule 1b (`idle-peer-max-busy` set): the whole turn on the least-loaded other node of the
 * holder's role, or `undefined`. */
function toIdlePeer(request, nodes, h) {
  const maxBusy = opt("idle-peer-max-busy");
  const n = nodes[h];
  if (maxBusy === undefined || (n.role !== "decode" && n.role !== "standalone")) return undefined;
  const fresh = Math.max(request.promptTokens - n.conversationTokens, 0);
  if (fresh > param("holder-max-new-tokens", 256)) return undefined;
  const ranked = leastLoaded(nodes, candidates(nodes, n.role));
  const peer = ranked.find((i) => i !== h);
  if (peer === undefined || busy(nodes[peer]) > maxBusy) return undefined;
  const minTokens = minPullTokens();
  if (n.conversationTokens < minTokens) return undefined;
  const list = [peer, ...ranked.filter((i) => i !== peer)];
  return { route: { tag: "whole", val: list }, reversePull: { from: h, minTokens } };
}

/** The spill rule (`spill-prefill-busy` set): whole on an idle decode node when every prefill
 * candidate is busy with at least the setting, or `undefined`. */
function spill(nodes) {
  const minBusy = opt("spill-prefill-busy");
  if (minBusy === undefined) return undefined;
  const prefill = candidates(nodes, "prefill");
  const decode = leastLoaded(nodes, candidates(nodes, "decode"));
  if (prefill.length === 0 || decode.length === 0) return undefined;
  if (prefill.some((i) => busy(nodes[i]) < minBusy)) return undefined;
  if (load(nodes[decode[0]]) > 0) return undefined;
  return { route: { tag: "whole", val: decode }, reversePull: undefined };
}

/** Decides where `request` goes, given `view` (the world's export `decide`). */
export function decide(request, view) {
  const nodes = view.nodes;
  const prefix = request.prefixBlocks;
  let holder;
  nodes.forEach((n, i) => {
    if (n.conversationTokens > 0 && (holder === undefined || n.conversationTokens > nodes[holder].conversationTokens)) {
      holder = i;
    }
  });
  if (holder !== undefined) {
    const d = toHolder(request, nodes, holder) ?? toIdlePeer(request, nodes, holder);
    if (d !== undefined) return d;
  } else {
    const d = spill(nodes);
    if (d !== undefined) return d;
  }
  const has = (role) => nodes.some((n) => n.role === role);
  let route;
  if (has("prefill") && has("decode")) {
    const children = Math.max(request.n, 1);
    route = {
      tag: "split",
      val: {
        prefill: byPrefix(nodes, prefix, candidates(nodes, "prefill")),
        decode: leastLoaded(nodes, candidates(nodes, "decode")).map((node) => ({
          node,
          children,
        })),
      },
    };
  } else if (has("standalone")) {
    route = { tag: "whole", val: byPrefix(nodes, prefix, candidates(nodes, "standalone")) };
  } else {
    route = { tag: "reject", val: { status: 503, message: NO_NODES } };
  }
  let reversePull;
  if (holder !== undefined && route.tag === "split") {
    const minTokens = minPullTokens();
    if (nodes[holder].conversationTokens >= minTokens) reversePull = { from: holder, minTokens };
  }
  const slack = opt("decode-holder-slack");
  if (reversePull !== undefined && slack !== undefined) {
    // The holder first among the decode targets when it is within the slack.
    const targets = route.val.decode;
    const pos = targets.findIndex((t) => t.node === holder);
    const lightest = Math.min(...targets.map((t) => load(nodes[t.node])));
    if (pos > 0 && load(nodes[holder]) <= lightest + slack) {
      targets.unshift(...targets.splice(pos, 1));
    }
  }
  const minLoad = opt("keep-on-prefill-decode-busy", 1);
  if (
    minLoad !== undefined &&
    route.tag === "split" &&
    load(nodes[route.val.prefill[0]]) === 0 &&
    route.val.decode.every((t) => load(nodes[t.node]) >= minLoad)
  ) {
    route = { tag: "whole", val: route.val.prefill };
  }
  return { route, reversePull };
}
