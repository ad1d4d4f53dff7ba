#!/usr/bin/env python3
"""What mode c's policy saw of a turn's holder, against what was running on it.

Reads a trace of `examples/multi_turn.rs` (`PD_BENCH_TRACE=DIR`): the gateway's decision log
(`DIR/decisions.jsonl`, every decision) and the client's turns (`DIR/turns.jsonl`, wall-clock
times). Each decision is matched to its turn (same prompt length, sent just before), so each
turn's node and the time it was open there are known: from its decision to its last byte, on
the node that took it whole or on the decode node of its split (the gateway counts a split's
decode node from the decision on).

For every decision whose conversation has a holder, prints the holder's load in the view
(waiting + running + waiting-remote-kv) beside the turns then open on it, and sums up: how
often the holder looked busy, and how often it was busy. A view that shows load where no turn
is open is a stale view; a holder that is busy is the load itself.

    python3 scripts/multi-turn-trace.py DIR [--mode c] [--all]
"""

import json
import sys


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
            else:
                t["node"], t["how"] = route["split"]["decode"][0]["node"], "split"
            t["decided_ms"] = d["time-ms"]
    unmatched = [t for t in turns if t["decision"] is None]

    def open_on(node, at, me):
        return [
            u
            for u in turns
            if u is not me and u.get("node") == node and u["decided_ms"] < at < u["end_ms"]
        ]

    names = decisions[0]["node-names"] if decisions else []
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
        load = n["waiting"] + n["running"] + n["waiting-remote-kv"]
        really = open_on(h, d["time-ms"], t)
        rows.append((t, h, load, len(really)))
        if show_all or (load > 0) != bool(really):
            print(
                f"conv {t['conversation']} turn {t['turn']:2}: holder {names[h] if names else h} "
                f"view load {load} (w{n['waiting']} r{n['running']} k{n['waiting-remote-kv']}), "
                f"open there {len(really)}; went {t['how']} to {names[t['node']] if names else t['node']}"
            )
    looked = sum(1 for r in rows if r[2] > 0)
    was = sum(1 for r in rows if r[3] > 0)
    stale = sum(1 for r in rows if r[2] > 0 and r[3] == 0)
    missed = sum(1 for r in rows if r[2] == 0 and r[3] > 0)
    on_holder = sum(1 for r in rows if r[0]["how"] == "whole" and r[0]["node"] == r[1])
    print(
        f"mode {mode}: {len(rows)} turns with a holder ({len(unmatched)} turns unmatched); "
        f"holder looked busy {looked}, was busy {was}; looked busy but idle {stale}, "
        f"looked idle but busy {missed}; went whole to the holder {on_holder}"
    )


if __name__ == "__main__":
    main()
