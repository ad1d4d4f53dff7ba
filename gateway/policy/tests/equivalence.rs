//! Each shipped guest policy (a real component under real wasmtime) decides exactly as its
//! native copy: over a seeded random sweep, and on hand-written views with recorded answers.

use crate::common::{Rng, holder_cases, load, names, node, random_case, random_measured, request};
use pd_policy::native::prefix_aware::{Thresholds, prefix_aware_with};
use pd_policy::native::{self, NO_NODES};
use pd_policy::{
    Decision, DecodeTarget, Measured, PolicyEngine, Rates, Rejection, Request, Role, Route, Split,
    View, WasmPolicy, validate,
};

type Native = fn(&Request, &View, &Measured) -> Decision;

/// The shipped Rust guests (on `pd:policy@1.0.0`, which carries the nodes' rates) and their
/// native copies.
const SHIPPED: [(&str, Native); 3] = [
    ("least-loaded", |r, v, _| native::least_loaded(r, v)),
    ("round-robin", |r, v, _| native::round_robin(r, v)),
    ("prefix-aware", |r, v, m| {
        prefix_aware_with(r, v, m, &Thresholds::default())
    }),
];

const CASES: u64 = 200;

#[test]
fn guests_match_native_on_random_views() {
    let engine = PolicyEngine::new().expect("engine");
    for (name, native) in SHIPPED {
        let policy = load(&engine, name);
        assert_eq!(policy.contract(), "1.0.0", "{name}");
        let mut rng = Rng::new(0x5eed_0000 + name.len() as u64);
        let (mut splits, mut wholes, mut rejects, mut rated) = (0, 0, 0, 0);
        for case in 0..CASES {
            let (request, view) = random_case(&mut rng, case);
            let measured = random_measured(&mut rng, view.nodes.len());
            let want = native(&request, &view, &measured);
            validate(&want, &request, &view)
                .unwrap_or_else(|e| panic!("{name} case {case}: native decision invalid: {e}"));
            let got = policy
                .decide_measured(&request, &view, &measured, &names(&view))
                .unwrap_or_else(|e| panic!("{name} case {case}: {e:?}"));
            assert_eq!(
                got, want,
                "{name} case {case}: guest and native disagree on {request:?} {view:?} {measured:?}"
            );
            if want != native(&request, &view, &Measured::default()) {
                rated += 1;
            }
            match want.route {
                Route::Split(_) => splits += 1,
                Route::Whole(_) => wholes += 1,
                Route::Reject(_) => rejects += 1,
            }
        }
        if name == "prefix-aware" {
            for (i, (request, view)) in holder_cases().into_iter().enumerate() {
                let want = native(&request, &view, &Measured::default());
                let got = policy
                    .decide_measured(&request, &view, &Measured::default(), &names(&view))
                    .unwrap_or_else(|e| panic!("holder case {i}: {e:?}"));
                assert_eq!(got, want, "holder case {i}: {view:?}");
            }
        }
        // The sweep reaches every route shape.
        assert!(
            splits > 20 && wholes > 20 && rejects > 5,
            "{name}: {splits}/{wholes}/{rejects}"
        );
        // ...and what the nodes measured decides some of prefix-aware's pulls.
        if name == "prefix-aware" {
            assert!(rated > 3, "measurements changed {rated} decisions");
        }
    }
}

/// prefix-aware's config reaches its rules the same way in the guest (read with
/// `host.config`) as in the native copy ([`Thresholds`]): with busier holders allowed
/// (`holder-max-busy 3`, default 0) within a slack of 1 (default 2), over a random sweep,
/// decisions change, and the two still agree. (`decode-holder-slack 1` is set too, but the
/// sweep does not reach its rule: [`decode_holder_slack_matches_native`] checks it.)
#[test]
fn prefix_aware_config_matches_native() {
    let engine = PolicyEngine::new().expect("engine");
    let mut spec = crate::common::spec("prefix-aware");
    spec.config = [
        ("holder-max-busy", "3"),
        ("holder-load-slack", "1"),
        ("decode-holder-slack", "1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let policy = engine
        .load(&crate::common::wasm("prefix-aware"), spec)
        .expect("load prefix-aware");
    let t = Thresholds {
        holder_max_busy: 3,
        holder_load_slack: 1,
        decode_holder_slack: Some(1),
        ..Thresholds::default()
    };
    let changed = sweep_agrees(&policy, &t, 0x5eed_b05e, "config");
    assert!(changed > 3, "the config changed {changed} decisions");
}

/// Over the random sweep from `seed`, `policy` (prefix-aware under some config) decides as the
/// native copy at `t`; returns how many of those decisions differ from the defaults'.
fn sweep_agrees(policy: &WasmPolicy, t: &Thresholds, seed: u64, what: &str) -> usize {
    let mut rng = Rng::new(seed);
    let mut changed = 0;
    for case in 0..CASES {
        let (request, view) = random_case(&mut rng, case);
        let measured = random_measured(&mut rng, view.nodes.len());
        let want = prefix_aware_with(&request, &view, &measured, t);
        let got = policy
            .decide_measured(&request, &view, &measured, &names(&view))
            .unwrap_or_else(|e| panic!("{what}, case {case}: {e:?}"));
        assert_eq!(
            got, want,
            "{what}, case {case}: guest and native disagree on {request:?} {view:?} {measured:?}"
        );
        if want != prefix_aware_with(&request, &view, &measured, &Thresholds::default()) {
            changed += 1;
        }
    }
    changed
}

fn draining(mut n: pd_policy::Node) -> pd_policy::Node {
    n.draining = true;
    n
}

fn targets(nodes: &[u32], children: u32) -> Vec<DecodeTarget> {
    nodes
        .iter()
        .map(|&node| DecodeTarget { node, children })
        .collect()
}

/// Hand-written views with the exact decision each policy must give, checked against both
/// the guest and the native copy. The best node is never node 0, so a policy that answers
/// "first node" fails.
#[test]
fn recorded_views() {
    // 0: prefill, busy; 1: prefill, idle; 2: decode, busy; 3: decode, idle, draining;
    // 4: decode, idle; 5: standalone.
    let pd_view = View {
        nodes: vec![
            node(Role::Prefill, 3, 1, 100),
            node(Role::Prefill, 0, 1, 100),
            node(Role::Decode, 2, 2, 100),
            draining(node(Role::Decode, 0, 0, 900)),
            node(Role::Decode, 0, 1, 300),
            node(Role::Standalone, 0, 0, 900),
        ],
    };
    // Standalone only: 0 busy, 1 and 2 tied on load (2 has more free blocks), 3 idle.
    let whole_view = View {
        nodes: vec![
            node(Role::Standalone, 4, 4, 1000),
            node(Role::Standalone, 1, 1, 10),
            node(Role::Standalone, 1, 1, 20),
            node(Role::Standalone, 0, 1, 5),
        ],
    };
    let split =
        |prefill: Vec<u32>, decode: Vec<DecodeTarget>| Route::Split(Split { prefill, decode });
    let cases: Vec<(&str, Request, &View, Route)> = vec![
        // least-loaded: prefill 1 (load 1) before 0 (load 4); decode 4 (load 1) before 2
        // (load 4); draining 3 left out; all n=3 children on each decode entry.
        (
            "least-loaded",
            request(0, 3, vec![]),
            &pd_view,
            split(vec![1, 0], targets(&[4, 2], 3)),
        ),
        // Ties on load (1 and 2) go to more free blocks, then lower index.
        (
            "least-loaded",
            request(0, 1, vec![]),
            &whole_view,
            Route::Whole(vec![3, 2, 1, 0]),
        ),
        // round-robin: seq 1 starts at the second candidate of each list.
        (
            "round-robin",
            request(1, 1, vec![]),
            &pd_view,
            split(vec![1, 0], targets(&[4, 2], 1)),
        ),
        // round-robin deals n=3 children over its two decode candidates: 2 then 1.
        (
            "round-robin",
            request(1, 3, vec![]),
            &pd_view,
            split(
                vec![1, 0],
                vec![
                    DecodeTarget {
                        node: 4,
                        children: 2,
                    },
                    DecodeTarget {
                        node: 2,
                        children: 1,
                    },
                ],
            ),
        ),
        (
            "round-robin",
            request(6, 2, vec![]),
            &whole_view,
            Route::Whole(vec![2, 3, 0, 1]),
        ),
        // prefix-aware: node 0 holds 10 blocks: 10 - 4 = 6 beats node 1's 0 - 1; decode stays
        // least-loaded.
        (
            "prefix-aware",
            request(0, 2, vec![10, 0, 0, 0, 0, 0]),
            &pd_view,
            split(vec![0, 1], targets(&[4, 2], 2)),
        ),
        // 8 blocks on busy node 0 (8 - 8 = 0) lose to 3 blocks on node 2 (3 - 2 = 1); then
        // node 3 (0 - 1; past the end of the prefix list) and node 1 (0 - 2).
        (
            "prefix-aware",
            request(0, 1, vec![8, 0, 3]),
            &whole_view,
            Route::Whole(vec![2, 0, 3, 1]),
        ),
    ];
    let engine = PolicyEngine::new().expect("engine");
    for (name, native) in SHIPPED {
        let policy = load(&engine, name);
        for (i, (_, request, view, route)) in cases.iter().enumerate().filter(|(_, c)| c.0 == name)
        {
            let want = Decision {
                route: route.clone(),
                reverse_pull: None,
            };
            assert_eq!(
                native(request, view, &Measured::default()),
                want,
                "{name} native, case {i}"
            );
            let got = policy.decide(request, view, &names(view)).expect("decide");
            assert_eq!(got, want, "{name} guest, case {i}");
        }
        // No prefill+decode pair and no standalone node: 503, same message everywhere.
        let lonely = View {
            nodes: vec![node(Role::Decode, 0, 0, 1)],
        };
        let want = Decision {
            route: Route::Reject(Rejection {
                status: 503,
                message: NO_NODES.to_string(),
            }),
            reverse_pull: None,
        };
        assert_eq!(
            policy
                .decide(&request(0, 1, vec![]), &lonely, &names(&lonely))
                .expect("decide"),
            want
        );
        assert_eq!(
            native(&request(0, 1, vec![]), &lonely, &Measured::default()),
            want
        );
    }
}

/// The prefix-aware guest with config `key` set to `value` (unset: `None`).
fn prefix_aware_keyed(engine: &PolicyEngine, key: &str, value: Option<u64>) -> WasmPolicy {
    prefix_aware_config(engine, key, value.map(|v| v.to_string()).as_deref())
}

/// The prefix-aware guest with config `key` set to the text `value` (unset: `None`).
fn prefix_aware_config(engine: &PolicyEngine, key: &str, value: Option<&str>) -> WasmPolicy {
    let mut spec = crate::common::spec("prefix-aware");
    if let Some(v) = value {
        spec.config = [(key.to_owned(), v.to_owned())].into_iter().collect();
    }
    engine
        .load(&crate::common::wasm("prefix-aware"), spec)
        .expect("load prefix-aware")
}

/// `decode-holder-slack` (which the random sweep above does not reach): a turn pulled back
/// from its busy holder (node 2) decodes on the holder only with the key set and the holder
/// within the slack of the idle decode node (1); the guest decides as the native copy each time.
#[test]
fn decode_holder_slack_matches_native() {
    let engine = PolicyEngine::new().expect("engine");
    let mut holder = node(Role::Decode, 0, 1, 500);
    holder.conversation_tokens = 60;
    holder.conversation_expiry_ms = 30_000;
    let view = View {
        nodes: vec![
            node(Role::Prefill, 0, 0, 500),
            node(Role::Decode, 0, 0, 500),
            holder,
        ],
    };
    let request = request(0, 1, vec![]);
    let measured = Measured::default();
    for (slack, first) in [(None, 1), (Some(0), 1), (Some(1), 2)] {
        let policy = prefix_aware_keyed(&engine, "decode-holder-slack", slack);
        let t = Thresholds {
            decode_holder_slack: slack,
            ..Thresholds::default()
        };
        let want = prefix_aware_with(&request, &view, &measured, &t);
        let got = policy
            .decide_measured(&request, &view, &measured, &names(&view))
            .expect("decide");
        assert_eq!(got, want, "slack {slack:?}");
        assert_eq!(want.reverse_pull.map(|p| p.from), Some(2), "{want:?}");
        match &want.route {
            Route::Split(s) => assert_eq!(s.decode[0].node, first, "slack {slack:?}: {want:?}"),
            other => panic!("{other:?}"),
        }
    }
}

/// `idle-peer-max-busy` (which the random sweep does not reach): the busy holder's (node 2)
/// turn goes whole to the other decode node (1) only with the key set, node 1 within it, and
/// the history worth a pull at node 1's measured rates; the guest decides as the native copy
/// each time.
#[test]
fn idle_peer_matches_native() {
    let engine = PolicyEngine::new().expect("engine");
    let mut holder = node(Role::Decode, 0, 1, 500);
    holder.conversation_tokens = 60;
    holder.conversation_expiry_ms = 30_000;
    let view = |peer_running: u32, holder_drains: bool| View {
        nodes: vec![
            node(Role::Prefill, 0, 0, 500),
            node(Role::Decode, 0, peer_running, 500),
            pd_policy::Node {
                draining: holder_drains,
                ..holder
            },
        ],
    };
    let request = request(0, 1, vec![]);
    // A peer that computes a token faster than it could pull one: never worth a pull there.
    let fast_peer = Measured {
        rates: vec![
            Rates::default(),
            Rates {
                prefill_tokens_per_s: 100_000,
                pull_mb_per_s: 1_000,
            },
        ],
        kv_bytes_per_token: 23_040,
    };
    // (idle-peer-max-busy, the peer's running requests, the holder drains, rates, the
    // `whole` list when the peer takes the turn)
    type Case<'a> = (Option<u64>, u32, bool, &'a Measured, Option<Vec<u32>>);
    let cases: [Case; 7] = [
        (None, 0, false, &Measured::default(), None),
        (Some(0), 0, false, &Measured::default(), Some(vec![1, 2])),
        (Some(0), 1, false, &Measured::default(), None),
        (Some(1), 1, false, &Measured::default(), Some(vec![1, 2])),
        (Some(0), 0, false, &fast_peer, None),
        // A draining holder: no failover to it.
        (None, 0, true, &Measured::default(), None),
        (Some(0), 0, true, &Measured::default(), Some(vec![1])),
    ];
    for (max_busy, peer_running, holder_drains, measured, to_peer) in cases {
        let policy = prefix_aware_keyed(&engine, "idle-peer-max-busy", max_busy);
        let t = Thresholds {
            idle_peer_max_busy: max_busy,
            ..Thresholds::default()
        };
        let v = view(peer_running, holder_drains);
        let want = prefix_aware_with(&request, &v, measured, &t);
        let got = policy
            .decide_measured(&request, &v, measured, &names(&v))
            .expect("decide");
        let case = format!(
            "max-busy {max_busy:?}, peer running {peer_running}, holder drains {holder_drains}"
        );
        assert_eq!(got, want, "{case}");
        if let Some(list) = to_peer {
            assert_eq!(want.route, Route::Whole(list), "{case}");
        } else {
            // P takes it: a split, or, both decode nodes busy and P idle, whole on P (the keep
            // rule).
            let on_p = match &want.route {
                Route::Split(s) => s.prefill.first() == Some(&0),
                Route::Whole(list) => list == &[0],
                Route::Reject(_) => false,
            };
            assert!(on_p, "{case}: {want:?}");
        }
        assert_eq!(
            want.reverse_pull.map(|p| p.from),
            Some(2),
            "{case}: {want:?}"
        );
    }
}

/// `spill-prefill-busy`: a request with no holder runs whole on an idle decode node only with
/// the key set, every prefill node busy with at least it, and a decode node with nothing
/// queued, running or parked; the guest decides as the native copy in these cases and over
/// the random sweep, where the key changes decisions.
#[test]
fn spill_matches_native() {
    let engine = PolicyEngine::new().expect("engine");
    // (spill-prefill-busy, P's running requests, decode node 1's parked requests, decode node
    // 2's running requests, the `whole` list when the request spills)
    type Case = (Option<u64>, u32, u32, u32, Option<Vec<u32>>);
    let cases: [Case; 7] = [
        (None, 2, 0, 0, None),
        (Some(1), 2, 0, 1, Some(vec![1, 2])),
        (Some(1), 0, 0, 1, None),
        (Some(0), 0, 0, 1, Some(vec![1, 2])),
        (Some(3), 2, 0, 1, None),
        // A decode node with a request parked for KV is not idle.
        (Some(1), 1, 1, 1, None),
        (Some(1), 1, 1, 0, Some(vec![2, 1])),
    ];
    let request = request(0, 1, vec![]);
    for (min_busy, p_running, parked, d2_running, spilled) in cases {
        let mut d1 = node(Role::Decode, 0, 0, 500);
        d1.waiting_remote_kv = parked;
        let v = View {
            nodes: vec![
                node(Role::Prefill, 0, p_running, 500),
                d1,
                node(Role::Decode, 0, d2_running, 500),
            ],
        };
        let t = Thresholds {
            spill_prefill_busy: min_busy,
            ..Thresholds::default()
        };
        let (got, want) = guest_and_native(
            &engine,
            "spill-prefill-busy",
            min_busy.map(|v| v.to_string()).as_deref(),
            &t,
            &request,
            &v,
        );
        let case = format!(
            "min busy {min_busy:?}, P running {p_running}, parked {parked}, d2 running {d2_running}"
        );
        assert_eq!(got, want, "{case}");
        match spilled {
            Some(list) => assert_eq!(want.route, Route::Whole(list), "{case}"),
            None => assert!(matches!(want.route, Route::Split(_)), "{case}: {want:?}"),
        }
        assert_eq!(want.reverse_pull, None, "{case}");
    }

    // Random views seldom have an idle decode node: at 0 the key spills wherever one is.
    key_sweeps_agree(
        &engine,
        "spill-prefill-busy",
        [("0", Some(0)), ("1", Some(1))],
        0x05b1_11ed,
        |v| Thresholds {
            spill_prefill_busy: v,
            ..Thresholds::default()
        },
    );
}

/// The prefix-aware guest's decision with `key` set to `value` (unset: `None`), and the native
/// copy's with `t` (the same setting), on `request` and `v`, no rates measured.
fn guest_and_native(
    engine: &PolicyEngine,
    key: &str,
    value: Option<&str>,
    t: &Thresholds,
    request: &Request,
    v: &View,
) -> (Decision, Decision) {
    let got = prefix_aware_config(engine, key, value)
        .decide_measured(request, v, &Measured::default(), &names(v))
        .expect("decide");
    (got, prefix_aware_with(request, v, &Measured::default(), t))
}

/// The random sweep with `key` at each of two `values` (the config's text, and the native
/// copy's setting of it, made into thresholds by `thresholds`): the guest agrees with the
/// native copy in every case, and against the defaults each value changes some decisions.
fn key_sweeps_agree(
    engine: &PolicyEngine,
    key: &str,
    values: [(&str, Option<u64>); 2],
    seed: u64,
    thresholds: impl Fn(Option<u64>) -> Thresholds,
) {
    let mut changed = [0; 2];
    for ((text, value), changed) in values.into_iter().zip(&mut changed) {
        let policy = prefix_aware_config(engine, key, Some(text));
        *changed = sweep_agrees(&policy, &thresholds(value), seed, &format!("{key} {text}"));
    }
    assert!(
        changed.iter().all(|&c| c > 0),
        "{key} changed {changed:?} decisions"
    );
}

/// `keep-on-prefill-decode-busy` (1 by default, `off` turns it off): a split runs whole on P
/// only with the rule on, P with nothing on it, and every decode node's load (queued, running,
/// parked) at least the setting; a conversation's turn keeps its pull back from the holder.
/// The guest decides as the native copy in these cases and over the random sweep, where the
/// key changes decisions.
#[test]
fn keep_on_prefill_matches_native() {
    let engine = PolicyEngine::new().expect("engine");
    // (the config's text (none: unset), the native setting, P's running requests, decode node
    // 1's parked requests, decode node 2's running requests, node 2 holds the conversation, P
    // keeps the request)
    type Case = (Option<&'static str>, Option<u64>, u32, u32, u32, bool, bool);
    let cases: [Case; 11] = [
        (None, Some(1), 0, 1, 1, false, true),
        (None, Some(1), 0, 1, 1, true, true),
        (Some("off"), None, 0, 1, 1, false, false),
        (Some(" Off "), None, 0, 1, 1, true, false),
        (Some("1"), Some(1), 0, 1, 1, false, true),
        (Some("1"), Some(1), 0, 1, 1, true, true),
        (Some("1"), Some(1), 1, 1, 1, true, false),
        (Some("1"), Some(1), 0, 0, 1, true, false),
        (Some("2"), Some(2), 0, 1, 2, false, false),
        (Some("0"), Some(0), 0, 0, 0, false, true),
        (Some("often"), Some(1), 0, 1, 1, false, true),
    ];
    for (text, min_load, p_running, parked, d2_running, held, kept) in cases {
        let mut d1 = node(Role::Decode, 0, 0, 500);
        d1.waiting_remote_kv = parked;
        let mut d2 = node(Role::Decode, 0, d2_running, 500);
        let mut request = request(0, 1, vec![]);
        if held {
            // Running a turn: too busy for rule 1, so P pulls the history back.
            d2.conversation_tokens = 60;
            d2.conversation_expiry_ms = 30_000;
            request.prompt_tokens = 80;
        }
        let v = View {
            nodes: vec![node(Role::Prefill, 0, p_running, 500), d1, d2],
        };
        let t = Thresholds {
            keep_on_prefill_decode_busy: min_load,
            ..Thresholds::default()
        };
        let (got, want) = guest_and_native(
            &engine,
            "keep-on-prefill-decode-busy",
            text,
            &t,
            &request,
            &v,
        );
        let case = format!(
            "config {text:?}, P running {p_running}, parked {parked}, \
             d2 running {d2_running}, held {held}"
        );
        assert_eq!(got, want, "{case}");
        if kept {
            assert_eq!(want.route, Route::Whole(vec![0]), "{case}");
        } else {
            assert!(matches!(want.route, Route::Split(_)), "{case}: {want:?}");
        }
        assert_eq!(
            want.reverse_pull.map(|p| p.from),
            held.then_some(2),
            "{case}: {want:?}"
        );
    }

    key_sweeps_agree(
        &engine,
        "keep-on-prefill-decode-busy",
        [("0", Some(0)), ("off", None)],
        0x0ee9_0b1e,
        |v| Thresholds {
            keep_on_prefill_decode_busy: v,
            ..Thresholds::default()
        },
    );
}
