// Prefix-aware routing policy, in JavaScript, as a WebAssembly component for pd-gateway.
//
// The same rules as the Rust guest `policies/prefix-aware` and
// `pd_policy::native::prefix_aware`; the gateway's tests check that they all decide the same.
// Written against `pd:policy@1.0.0` (wit/policy.wit): the view comes as columns, node `i` at
// index `i` of each per-node list, each role's nodes as an ascending list of indices, with the
// rates the nodes measure.
//
// - Candidates for a role: its nodes that are not draining (`view.draining`), or all its nodes
//   when every one of them is draining.
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
// Multi-turn. The holder is `view.conversation`'s node (earlier-turn KV of this conversation
// under a lease), when there is one with some tokens (a node index past the view's is ignored):
// 1. Route to the holder: when it is a decode or standalone node, not draining, the turn adds at
//    most `holder-max-new-tokens` prompt tokens beyond what it holds, its load is at most the
//    least-loaded candidate of its role's plus `holder-load-slack`, and it has at most
//    `holder-max-busy` requests queued or running (`waiting + running`: parked ones compute
//    nothing yet; 0: an idle holder, so no decode running there waits behind this prefill):
//    whole with the holder first, then the other candidates of its role in least-loaded order,
//    reverse pull from the holder with min-tokens 0.
// 2. Else, on a split, pull the turn back to P when it holds at least min-pull tokens, the
//    fewest for which a pull (`pull-overhead-us` + tokens x `kv-bytes-per-token` at
//    `pull-mb-per-s`) costs less than recomputing them at `prefill-tokens-per-s`: reverse pull
//    from the holder with that min-tokens. The two rates are the ones the first prefill
//    candidate (the node that would pull and compute) measured (`view.prefillTokensPerS[p]`,
//    `view.pullMbPerS[p]`), and the KV bytes per token the view's (`view.kvBytesPerToken`):
//    each where known (non-zero), else the config's.
// 3. Else recompute. Parameters come from the policy config (defaults below).
//
// The Rust guest's opt-in keys (unset by default but the keep rule; `off` unsets one; the Rust
// guest's doc says why each exists), read the same way:
// - `idle-peer-max-busy`, between 1 and 2: when the holder qualifies for rule 1 but for its
//   load or its draining, the least-loaded other candidate of its role takes the whole turn if
//   it has at most that many requests queued or running and the held tokens are worth a pull
//   at that peer's rates (as in 2): whole with that peer first, then the role's other
//   candidates (the holder included unless it drains) in least-loaded order, reverse pull from
//   the holder with min-tokens min-pull.
// - `decode-holder-slack`: a turn pulled back (2) decodes on the holder when its load is at
//   most the least-loaded decode candidate's plus that slack.
// - `spill-prefill-busy`: a request with no holder runs whole on the least-loaded decode
//   candidate when that one has load 0 and every prefill candidate has at least that many
//   requests queued or running; then the other decode candidates; no reverse pull.
// - `keep-on-prefill-decode-busy` (1 by default; `off` turns it off): a split (after 2 and 3)
//   whose decode candidates all have a load of at least that runs whole on its prefill list
//   when the first has load 0; the reverse pull unchanged.
//
// Defaults: prefill-tokens-per-s 2000, kv-bytes-per-token 23040 (SmolLM2-135M, f16 KV),
// pull-mb-per-s 1000, pull-overhead-us 2000, holder-max-new-tokens 256, holder-load-slack 2,
// holder-max-busy 0. A value is read as the Rust guest reads it: surrounding whitespace
// trimmed, a whole number that fits 64 bits (an optional `+`), else the default (the runtime
// drops a leading U+FEFF of a string before the policy sees it). Config values are BigInts
// here, so the arithmetic on them is exact (and saturates at 2^64 - 1 as the Rust guest's);
// sums of the view's u32 fields stay exact in a JS number (below 2^53).
//
// Build: `policies/js/build.sh policies/js/prefix-aware OUT.wasm` (componentize-js).
//
// How WIT values look here (componentize-js): records are objects with camelCase fields
// (`view.freeBlocks`, `view.waitingRemoteKv`, `request.prefixBlocks`), a `list<u32>` is a
// `Uint32Array` (`Array.from` makes a plain array of it; answer plain arrays), a variant is
// `{ tag, val }`, an absent option is `undefined` (`view.conversation`), u32 is a number and
// u64 a BigInt (`request.seq`).

import { config } from "pd:policy/host@1.0.0";

/** Message of the 503 when no node can serve the request. */
const NO_NODES =
  "no node can serve this request: the view has no prefill+decode pair and no standalone node";

const U32_MAX = 0xffffffffn;
const U64_MAX = 0xffffffffffffffffn;

/** `keep-on-prefill-decode-busy` when the config does not set it. */
const KEEP_ON_PREFILL_DEFAULT = 1n;

/** What Rust's `str::trim` strips (Unicode White_Space; JS's `trim()` differs: it strips
 * U+FEFF and keeps U+0085). */
const RUST_SPACE =
  /[\t\n\v\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]/.source;
const RUST_TRIM = new RegExp(`^${RUST_SPACE}+|${RUST_SPACE}+$`, "g");

function rustTrim(text) {
  return text.replace(RUST_TRIM, "");
}

/** `text.trim().parse::<u64>()` as in Rust: an optional `+`, ASCII digits, at most
 * 2^64 - 1; a BigInt, or `undefined`. */
function parseU64(text) {
  const m = /^\+?([0-9]+)$/.exec(rustTrim(text));
  if (m === null) return undefined;
  const v = BigInt(m[1]);
  return v <= U64_MAX ? v : undefined;
}

/** A numeric config value (a BigInt), or `fallback` when unset or not a number. */
function param(key, fallback) {
  const v = config(key);
  if (v === undefined) return fallback;
  return parseU64(v) ?? fallback;
}

/** An opt-in rule's setting: the config's whole number (a BigInt), `undefined` for `off`, else
 * `fallback`. */
function optIn(key, fallback) {
  const v = config(key);
  if (v === undefined) return fallback;
  // ASCII case only, as Rust's `eq_ignore_ascii_case` (without the `u` flag, `i` folds no
  // other character onto an ASCII letter).
  if (/^off$/i.test(rustTrim(v))) return undefined;
  return parseU64(v) ?? fallback;
}

/** `measured` (a number) when known (non-zero), else the config's `key`; a BigInt. */
function knownOr(measured, key, fallback) {
  return measured > 0 ? BigInt(measured) : param(key, fallback);
}

const max = (a, b) => (a > b ? a : b);
const min = (a, b) => (a < b ? a : b);

/** Fewest held tokens worth a pull for a node that prefills at `prefillTokensPerS` and pulls
 * at `pullMbPerS`, `kvBytesPerToken` moving per token (each 0: unknown, the config's)
 * (2^32 - 1: never, when a token moves slower than it computes). Integer nanoseconds in
 * BigInts, saturating at 2^64 - 1, as the Rust guest; a number. */
function minPullTokens(prefillTokensPerS, pullMbPerS, kvBytesPerToken) {
  const prefillRate = max(knownOr(prefillTokensPerS, "prefill-tokens-per-s", 2000n), 1n);
  const kvBytes = knownOr(kvBytesPerToken, "kv-bytes-per-token", 23040n);
  const pullRate = max(knownOr(pullMbPerS, "pull-mb-per-s", 1000n), 1n);
  const recomputeNs = 1_000_000_000n / prefillRate;
  const pullNs = min(kvBytes * 1000n, U64_MAX) / pullRate;
  const gain = recomputeNs - pullNs;
  if (gain <= 0n) return Number(U32_MAX);
  const overheadNs = min(param("pull-overhead-us", 2000n) * 1000n, U64_MAX);
  const t = (overheadNs + gain - 1n) / gain;
  return Number(min(max(t, 1n), U32_MAX));
}

/** `minPullTokens` at node `i`'s measured rates and the view's KV bytes per token. */
function minPullTokensAt(view, i) {
  return minPullTokens(view.prefillTokensPerS[i], view.pullMbPerS[i], view.kvBytesPerToken);
}

/** Requests on node `i`: queued, running, and parked waiting for KV. */
function load(view, i) {
  return view.waiting[i] + view.running[i] + view.waitingRemoteKv[i];
}

/** Requests node `i` computes or has queued to compute: `waiting + running` (requests parked
 * for KV compute nothing yet). */
function busy(view, i) {
  return view.waiting[i] + view.running[i];
}

/** Cached prefix blocks minus queued and running requests (may be negative). */
function score(view, i, prefixBlocks) {
  return prefixBlocks - view.waiting[i] - view.running[i];
}

/** The nodes of `role` (one of the view's role lists) that are not draining, or all of them
 * when every one drains; ascending, as a plain array. */
function candidates(view, role) {
  const draining = new Set(view.draining);
  const all = Array.from(role);
  const live = all.filter((i) => !draining.has(i));
  return live.length > 0 ? live : all;
}

/** Least-loaded comparison: least load first, then most free blocks, then lowest index. */
function leastLoadedCmp(view, a, b) {
  return load(view, a) - load(view, b) || view.freeBlocks[b] - view.freeBlocks[a] || a - b;
}

/** Least-loaded order (the index is part of the key: keys are unique, the order exact). */
function leastLoaded(view, indices) {
  return indices.sort((a, b) => leastLoadedCmp(view, a, b));
}

/** Highest score first, then least-loaded order. `prefix[i]` is how many leading blocks of the
 * prompt node `i` holds; the list may be shorter than the view (missing: 0). */
function byPrefix(view, prefix, indices) {
  const blocks = (i) => (i < prefix.length ? prefix[i] : 0);
  return indices.sort(
    (a, b) =>
      score(view, b, blocks(b)) - score(view, a, blocks(a)) || leastLoadedCmp(view, a, b),
  );
}

/** Whether the ascending list `list` holds `i`. */
function holds(list, i) {
  return Array.prototype.includes.call(list, i);
}

/** The role list (decode or standalone) holder `h` is in, or `undefined` (a prefill holder). */
function holderRole(view, h) {
  if (holds(view.decode, h)) return view.decode;
  if (holds(view.standalone, h)) return view.standalone;
  return undefined;
}

/** Rule 1: the whole request on the holder, or `undefined` when it does not qualify. */
function toHolder(request, view, h) {
  const role = holderRole(view, h.node);
  if (role === undefined || holds(view.draining, h.node)) return undefined;
  const fresh = Math.max(request.promptTokens - h.tokens, 0);
  if (fresh > param("holder-max-new-tokens", 256n)) return undefined;
  const others = candidates(view, role);
  const lightest = Math.min(...others.map((i) => load(view, i)));
  if (BigInt(load(view, h.node)) > BigInt(lightest) + param("holder-load-slack", 2n)) {
    return undefined;
  }
  if (busy(view, h.node) > param("holder-max-busy", 0n)) return undefined;
  const list = [h.node, ...leastLoaded(view, others).filter((i) => i !== h.node)];
  return { route: { tag: "whole", val: list }, reversePull: { from: h.node, minTokens: 0 } };
}

/** Rule 1b (`idle-peer-max-busy` set): the whole turn on the least-loaded other node of the
 * holder's role, when that peer is busy with at most the setting and the history is worth
 * pulling at the peer's rates; or `undefined`. */
function toIdlePeer(request, view, h) {
  const maxBusy = optIn("idle-peer-max-busy", undefined);
  if (maxBusy === undefined) return undefined;
  const role = holderRole(view, h.node);
  if (role === undefined) return undefined;
  const fresh = Math.max(request.promptTokens - h.tokens, 0);
  if (fresh > param("holder-max-new-tokens", 256n)) return undefined;
  const ranked = leastLoaded(view, candidates(view, role));
  const peer = ranked.find((i) => i !== h.node);
  if (peer === undefined || busy(view, peer) > maxBusy) return undefined;
  const minTokens = minPullTokensAt(view, peer);
  if (h.tokens < minTokens) return undefined;
  // The peer first, then the rest in least-loaded order (the holder among them unless it
  // drains).
  const list = [peer, ...ranked.filter((i) => i !== peer)];
  return { route: { tag: "whole", val: list }, reversePull: { from: h.node, minTokens } };
}

/** The spill rule (`spill-prefill-busy` set): whole on an idle decode node when every prefill
 * candidate is busy with at least the setting, or `undefined`. */
function spill(view) {
  // Cheap tests first: most requests meet no idle decode node, and then skip the host call.
  if (view.prefill.length === 0 || !Array.from(view.decode).some((i) => load(view, i) === 0)) {
    return undefined;
  }
  const minBusy = optIn("spill-prefill-busy", undefined);
  if (minBusy === undefined) return undefined;
  if (candidates(view, view.prefill).some((i) => busy(view, i) < minBusy)) return undefined;
  const decode = leastLoaded(view, candidates(view, view.decode));
  if (load(view, decode[0]) > 0) return undefined;
  return { route: { tag: "whole", val: decode }, reversePull: undefined };
}

/** Moves holder `h` to the front of `decode` when it is there and its load is at most the
 * lightest candidate's plus `slack` (every entry takes the same children, so `children` needs
 * no reordering). */
function holderDecodesFirst(view, h, slack, decode) {
  const pos = decode.indexOf(h);
  if (pos < 0) return;
  const lightest = Math.min(...decode.map((d) => load(view, d)));
  if (pos > 0 && BigInt(load(view, h)) <= BigInt(lightest) + slack) {
    decode.unshift(...decode.splice(pos, 1));
  }
}

/** The keep rule: whether `split` should run whole on its first prefill node, because that
 * node has no load and every decode candidate at least `keep-on-prefill-decode-busy`. */
function keepOnPrefill(view, split) {
  // Cheap test first: a busy P (the common case) skips the host call.
  if (load(view, split.prefill[0]) > 0) return false;
  const minLoad = optIn("keep-on-prefill-decode-busy", KEEP_ON_PREFILL_DEFAULT);
  if (minLoad === undefined) return false;
  return split.decode.every((d) => load(view, d) >= minLoad);
}

/** Decides where `request` goes, given `view` (the world's export `decide`). */
export function decide(request, view) {
  const prefix = request.prefixBlocks;
  let h = view.conversation;
  if (h !== undefined && !(h.tokens > 0 && h.node < view.freeBlocks.length)) h = undefined;
  if (h !== undefined) {
    const d = toHolder(request, view, h) ?? toIdlePeer(request, view, h);
    if (d !== undefined) return d;
  } else {
    const d = spill(view);
    if (d !== undefined) return d;
  }
  let route;
  let split;
  if (view.prefill.length > 0 && view.decode.length > 0) {
    const decode = leastLoaded(view, candidates(view, view.decode));
    split = {
      prefill: byPrefix(view, prefix, candidates(view, view.prefill)),
      decode,
      children: decode.map(() => Math.max(request.n, 1)),
    };
    route = { tag: "split", val: split };
  } else if (view.standalone.length > 0) {
    route = { tag: "whole", val: byPrefix(view, prefix, candidates(view, view.standalone)) };
  } else {
    route = { tag: "reject", val: { status: 503, message: NO_NODES } };
  }
  let reversePull;
  if (h !== undefined && split !== undefined) {
    const minTokens = minPullTokensAt(view, split.prefill[0]);
    if (h.tokens >= minTokens) reversePull = { from: h.node, minTokens };
  }
  const slack = optIn("decode-holder-slack", undefined);
  if (reversePull !== undefined && slack !== undefined) {
    holderDecodesFirst(view, h.node, slack, split.decode);
  }
  if (split !== undefined && keepOnPrefill(view, split)) {
    route = { tag: "whole", val: split.prefill };
  }
  return { route, reversePull };
}
