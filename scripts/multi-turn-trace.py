#!/usr/bin/env python3
"""What mode c's policy saw of a turn's holder, against what was running on it.

Reads a trace of `examples/multi_turn.rs` (`PD_BENCH_TRACE=DIR`): the gateway's decision log
(`DIR/decisions.jsonl`, every decision) and the client's turns (`DIR/turns.jsonl`, wall-clock
times). Each decision is matched to its turn (same prompt length, sent just before), so each
turn's node and the time it was open there are known: from its decision to its last byte, on
the node that took it whole or on the decode node of its split (the gateway counts a split's
decode node from the decision on).

For every decision whose conversation has a holder, prints the holder's load in the view
beside the turns then on it — computing (a whole turn, or a split's decode phase) or reserved
(a split whose decode the gateway reserved there while P computes) — when the view's `waiting +
running` and what was computing disagree (`--all`: every decision), and sums up. A view busy
where nothing computes is stale; a holder with only reservations is free to prefill.

Then TPOT by whether a turn decoded alone on its node, beside another turn's decode (for
more than `SHARED` of its decode, first token to last: two decodes in one step cost each of
them more), or beside another turn's prefill on that node (a prefill step stalls the node's
decodes for its whole length); and of the turns that decoded on a prefill node (kept there by
`keep-on-prefill-decode-busy`).

    python3 scripts/multi-turn-trace.py DIR [--mode c] [--all]
"""

import json
import statistics
import sys

# A turn decoded beside another when another turn decoded on its node for more than this
# fraction of its own decode.
SHARED = 0.3


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    trace, mode, show_all = args[0], "c", "--all" in args
    if "--mode" in args:
        mode = args[args.index("--mode") + 1]
    decisions = [json.loads(l) for l in open(f"{trace}/decisions.jsonl")]
    turns = [json.loads(l) for l in open(f"{trace}/turns.jsonl")]
    turns = [t for t in turns if t["mode"] == mode]
    if not turns:
        sys.exit(f"no turns of mode {mode}")
    t0, t1 = min(t["sent_ms"] for t in turns), max(t["end_ms"] for t in turns)
    decisions = [d for d in decisions if t0 - 5 <= d["time-ms"] <= t1]

    # Match: each turn takes the first unmatched decision of its prompt length at or after it
    # was sent (the gateway decides within milliseconds).
    used = set()
    for t in sorted(turns, key=lambda t: t["sent_ms"]):
        best = None
        for i, d in enumerate(decisions):
            if i in used or d["request"]["prompt-tokens"] != t["prompt_tokens"]:
                continue
            if t["sent_ms"] - 5 <= d["time-ms"] <= t["first_ms"]:
                best = i
                break
        t["decision"] = best
        if best is not None:
            used.add(best)
            d = decisions[best]
            route = d["decision"]["route"]
            if "whole" in route:
                t["node"], t["how"] = route["whole"][0], "whole"
                t["prefill_node"] = t["node"]
            else:
                t["node"], t["how"] = route["split"]["decode"][0]["node"], "split"
                t["prefill_node"] = route["split"]["prefill"][0]
            t["on_prefill_node"] = (
                d["view"]["nodes"][t["node"]].get("role") == "prefill"
            )
            t["decided_ms"] = d["time-ms"]
    unmatched = [t for t in turns if t["decision"] is None]

    def on(node, at, me):
        """Turns computing on `node` at `at`, and turns reserved there (a split in P's phase)."""
        computing, reserved = [], []
        for u in turns:
            if u is me or u.get("node") != node or not u["decided_ms"] < at < u["end_ms"]:
                continue
            if u["how"] == "split" and at < u["first_ms"]:
                reserved.append(u)
            else:
                computing.append(u)
        return computing, reserved

    names = decisions[0]["node-names"] if decisions else []
    name = lambda i: names[i] if names else str(i)
    rows = []
    for t in sorted(turns, key=lambda t: t["sent_ms"]):
        if t["decision"] is None:
            continue
        d = decisions[t["decision"]]
        nodes = d["view"]["nodes"]
        holders = [i for i, n in enumerate(nodes) if n["conversation-tokens"] > 0]
        if not holders:
            continue
        h = holders[0]
        n = nodes[h]
        busy = n["waiting"] + n["running"]
        computing, reserved = on(h, d["time-ms"], t)
        rows.append((t, h, busy, len(computing), n["waiting-remote-kv"], len(reserved)))
        if show_all or (busy > 0) != bool(computing):
            print(
                f"conv {t['conversation']} turn {t['turn']:2}: holder {name(h)} "
                f"view w{n['waiting']} r{n['running']} k{n['waiting-remote-kv']}, "
                f"computing there {len(computing)}, reserved there {len(reserved)}; "
                f"went {t['how']} to {name(t['node'])}"
            )
    looked = sum(1 for r in rows if r[2] > 0)
    was = sum(1 for r in rows if r[3] > 0)
    stale = sum(1 for r in rows if r[2] > 0 and r[3] == 0)
    missed = sum(1 for r in rows if r[2] == 0 and r[3] > 0)
    only_reserved = sum(1 for r in rows if r[3] == 0 and r[5] > 0)
    on_holder = sum(1 for r in rows if r[0]["how"] == "whole" and r[0]["node"] == r[1])
    print(
        f"mode {mode}: {len(rows)} turns with a holder ({len(unmatched)} unmatched); "
        f"holder busy (waiting + running) in the view {looked}, computing {was}; "
        f"busy in the view but not computing {stale}, the reverse {missed}; "
        f"holder with only reservations {only_reserved}; went whole to the holder {on_holder}"
    )
    decode_sharing(turns, mode)


def decode_sharing(turns, mode):
    """Prints TPOT of later turns that decoded alone on their node against those that shared
    it: with another turn's decode (for more than `SHARED` of their own), or with another
    turn's prefill (any overlap: a prefill step stalls every decode of its node). Turns
    decoding on a prefill node (kept there) are counted apart as well."""
    alone, shared, prefill, on_p = [], [], [], []
    for t in turns:
        if t["turn"] == 0 or t["decision"] is None or t["end_ms"] <= t["first_ms"]:
            continue
        a, b = t["first_ms"], t["end_ms"]
        others = [u for u in turns if u is not t and u["decision"] is not None]
        beside = sum(
            max(0.0, min(b, u["end_ms"]) - max(a, u["first_ms"]))
            for u in others
            if u["node"] == t["node"]
        )
        # Another turn's prefill phase on this node: from its decision to its first token.
        stalled = any(
            min(b, u["first_ms"]) > max(a, u["decided_ms"])
            for u in others
            if u["prefill_node"] == t["node"]
        )
        if stalled:
            prefill.append(t)
        else:
            (shared if beside / (b - a) > SHARED else alone).append(t)
        if t["on_prefill_node"]:
            on_p.append(t)
    # Traces before `tpot_ms` was logged: the example's default 24 tokens a turn.
    of = lambda t: t.get("tpot_ms", (t["end_ms"] - t["first_ms"]) / 23)
    tpot = lambda ts: f"{statistics.mean(of(t) for t in ts):.1f} ms" if ts else "-"
    print(
        f"mode {mode}: later turns decoding alone on their node {len(alone)} (TPOT {tpot(alone)}), "
        f"beside another turn's decode {len(shared)} (TPOT {tpot(shared)}), "
        f"beside another turn's prefill {len(prefill)} (TPOT {tpot(prefill)}); "
        f"decoding on a prefill node {len(on_p)} (TPOT {tpot(on_p)})"
    )


if __name__ == "__main__":
    main()
