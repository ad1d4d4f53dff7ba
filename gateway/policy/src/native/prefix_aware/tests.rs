//! Tests of prefix-aware's rules.

use super::*;
use crate::native::tests::{node, request, view};
use crate::{DecodeTarget, Route, Split};

#[test]
fn prefix_beats_small_load_difference() {
    let v = view(vec![
        node(Role::Prefill, 0, 10, false),
        node(Role::Prefill, 3, 10, false),
        node(Role::Decode, 2, 10, false),
        node(Role::Decode, 0, 10, false),
    ]);
    // Node 1 holds 8 blocks: 8 - 3 = 5 > 0 - 0.
    let d = prefix_aware(&request(0, 2, vec![0, 8, 0, 0]), &v);
    let want = Split {
        prefill: vec![1, 0],
        decode: vec![
            DecodeTarget {
                node: 3,
                children: 2,
            },
            DecodeTarget {
                node: 2,
                children: 2,
            },
        ],
    };
    assert_eq!(d.route, Route::Split(want));
    // Without the prefix, least-loaded order.
    let d = prefix_aware(&request(0, 1, vec![]), &v);
    let Route::Split(s) = d.route else {
        panic!("expected split")
    };
    assert_eq!(s.prefill, vec![0, 1]);
}

fn holding(mut n: Node, tokens: u32) -> Node {
    n.conversation_tokens = tokens;
    n.conversation_expiry_ms = 30_000;
    n
}

#[test]
fn the_default_threshold_pulls_all_but_a_few_tokens() {
    // 500 µs to compute a token, 23 µs to move one, 2 ms fixed: from 5 tokens on.
    assert_eq!(Thresholds::default().min_pull_tokens(), 5);
    let slow_link = Thresholds {
        pull_mb_per_s: 10,
        ..Thresholds::default()
    };
    assert_eq!(
        slow_link.min_pull_tokens(),
        u32::MAX,
        "a token moves slower than it computes"
    );
}

#[test]
fn a_short_new_turn_goes_to_the_holder() {
    let v = view(vec![
        node(Role::Prefill, 0, 10, false),
        node(Role::Decode, 0, 10, false),
        holding(node(Role::Decode, 0, 10, false), 96),
    ]);
    // 100 prompt tokens, 96 held: 4 new.
    let d = prefix_aware(&request(0, 1, vec![]), &v);
    assert_eq!(d.route, Route::Whole(vec![2, 1]));
    assert_eq!(
        d.reverse_pull,
        Some(ReversePull {
            from: 2,
            min_tokens: 0
        })
    );
}

#[test]
fn a_busy_holder_is_pulled_from_unless_the_config_allows_it() {
    // The holder decodes another conversation: by default P takes the turn (pulling it
    // back), so that running decode does not wait behind this prefill; and as both
    // decode nodes are busy and P is idle, P decodes it too (the keep rule).
    let v = view(vec![
        node(Role::Prefill, 0, 10, false),
        node(Role::Decode, 1, 10, false),
        holding(node(Role::Decode, 1, 10, false), 96),
    ]);
    let r = request(0, 1, vec![]);
    let d = prefix_aware(&r, &v);
    assert_eq!(d.route, Route::Whole(vec![0]), "{d:?}");
    assert_eq!(d.reverse_pull.map(|p| p.from), Some(2));
    // `holder-max-busy 1` lets a holder with one request take it.
    let t = Thresholds {
        holder_max_busy: 1,
        ..Thresholds::default()
    };
    let d = prefix_aware_with(&r, &v, &Measured::default(), &t);
    assert_eq!(d.route, Route::Whole(vec![2, 1]));
}

/// Requests parked for remote KV (a split's decode the gateway reserved there while P
/// computes) are not work the holder's prefill would stall: the holder takes the turn. They
/// still count in the least-loaded order and the slack. (Counting them as busy sent every
/// turn to P once each decode node had one reserved: docs/bench-log/multi-turn.md,
/// "Reservations are not work".)
#[test]
fn a_holder_with_only_parked_requests_is_idle() {
    let mut holder = holding(node(Role::Decode, 0, 10, false), 96);
    holder.waiting_remote_kv = 1;
    let v = view(vec![
        node(Role::Prefill, 0, 10, false),
        node(Role::Decode, 0, 10, false),
        holder,
    ]);
    let r = request(0, 1, vec![]);
    assert_eq!(prefix_aware(&r, &v).route, Route::Whole(vec![2, 1]));
    // Beyond the slack (2) of the lightest node, parked requests pass the holder over.
    let mut far = v.clone();
    far.nodes[2].waiting_remote_kv = 3;
    assert!(matches!(prefix_aware(&r, &far).route, Route::Split(_)));
    // A queued request is work.
    let mut queued = v.clone();
    queued.nodes[2].waiting = 1;
    assert!(matches!(prefix_aware(&r, &queued).route, Route::Split(_)));
}

#[test]
fn a_pulled_back_turn_decodes_on_its_holder_only_when_configured() {
    // P pulls the turn back from the busy holder (2); node 1 is idle. By default the
    // decode goes to the least-loaded node; with `decode-holder-slack 1` to the holder,
    // which has the history cached and pulls only the new blocks; a slack of 0 keeps the
    // idle node first (the holder runs one request more).
    let v = view(vec![
        node(Role::Prefill, 0, 10, false),
        node(Role::Decode, 0, 10, false),
        holding(node(Role::Decode, 1, 10, false), 96),
    ]);
    let r = request(0, 1, vec![]);
    let decode_order = |slack: Option<u64>| {
        let t = Thresholds {
            decode_holder_slack: slack,
            ..Thresholds::default()
        };
        let d = prefix_aware_with(&r, &v, &Measured::default(), &t);
        assert_eq!(d.reverse_pull.map(|p| p.from), Some(2), "{d:?}");
        match d.route {
            Route::Split(s) => s.decode.iter().map(|t| t.node).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(decode_order(None), vec![1, 2]);
    assert_eq!(decode_order(Some(1)), vec![2, 1]);
    assert_eq!(decode_order(Some(0)), vec![1, 2]);
}

#[test]
fn an_idle_peer_takes_a_busy_holders_turn_only_when_configured() {
    // The holder (2) decodes another conversation; node 1, the other decode node, is idle.
    let v = view(vec![
        node(Role::Prefill, 0, 10, false),
        node(Role::Decode, 0, 10, false),
        holding(node(Role::Decode, 1, 10, false), 96),
    ]);
    let r = request(0, 1, vec![]);
    let with = |max_busy: Option<u64>, v: &View| {
        let t = Thresholds {
            idle_peer_max_busy: max_busy,
            ..Thresholds::default()
        };
        prefix_aware_with(&r, v, &Measured::default(), &t)
    };
    // By default P takes it (pulling the history back).
    assert!(matches!(with(None, &v).route, Route::Split(_)));
    // Configured: the idle peer, pulling the history from the holder (5 tokens or more
    // are worth a pull at the default rates), the holder as its failover.
    let d = with(Some(0), &v);
    assert_eq!(d.route, Route::Whole(vec![1, 2]));
    assert_eq!(
        d.reverse_pull,
        Some(ReversePull {
            from: 2,
            min_tokens: 5
        })
    );
    // A peer busier than allowed: P again (both decode nodes busy: P decodes it too).
    let mut busy_peer = v.clone();
    busy_peer.nodes[1].running = 1;
    assert_eq!(with(Some(0), &busy_peer).route, Route::Whole(vec![0]));
    assert_eq!(with(Some(1), &busy_peer).route, Route::Whole(vec![1, 2]));
    // A draining holder (idle or not): its peer takes the turn, the holder is no failover.
    let mut drains = v.clone();
    drains.nodes[2].draining = true;
    drains.nodes[2].running = 0;
    assert!(matches!(with(None, &drains).route, Route::Split(_)));
    assert_eq!(with(Some(0), &drains).route, Route::Whole(vec![1]));
    // A turn with too many new tokens is not the peer's either (prefill is P's job).
    let long = request(0, 1, vec![]);
    let long = Request {
        prompt_tokens: 96 + 257,
        ..long
    };
    let t = Thresholds {
        idle_peer_max_busy: Some(0),
        ..Thresholds::default()
    };
    assert!(matches!(
        prefix_aware_with(&long, &v, &Measured::default(), &t).route,
        Route::Split(_)
    ));
}

#[test]
fn an_overloaded_or_draining_holder_is_pulled_from_instead() {
    let t = Thresholds {
        holder_max_busy: u64::MAX,
        ..Thresholds::default()
    };
    for holder in [
        holding(node(Role::Decode, 5, 10, false), 96),
        holding(node(Role::Decode, 0, 10, true), 96),
    ] {
        let v = view(vec![
            node(Role::Prefill, 0, 10, false),
            node(Role::Decode, 0, 10, false),
            holder,
        ]);
        let d = prefix_aware_with(&request(0, 1, vec![]), &v, &Measured::default(), &t);
        assert!(matches!(d.route, Route::Split(_)), "{d:?}");
        assert_eq!(
            d.reverse_pull,
            Some(ReversePull {
                from: 2,
                min_tokens: 5
            })
        );
    }
}

#[test]
fn a_long_new_turn_is_prefilled_on_p_after_a_pull_and_a_tiny_history_is_recomputed() {
    let mut r = request(0, 1, vec![]);
    r.prompt_tokens = 1_000;
    let v = view(vec![
        node(Role::Prefill, 0, 10, false),
        holding(node(Role::Decode, 0, 10, false), 96),
    ]);
    let d = prefix_aware(&r, &v);
    assert!(matches!(d.route, Route::Split(_)), "{d:?}");
    assert_eq!(
        d.reverse_pull,
        Some(ReversePull {
            from: 1,
            min_tokens: 5
        })
    );
    let v = view(vec![
        node(Role::Prefill, 0, 10, false),
        holding(node(Role::Decode, 0, 10, false), 4),
    ]);
    assert_eq!(prefix_aware(&r, &v).reverse_pull, None);
}

#[test]
fn a_config_sets_the_keys_the_guest_reads_and_leaves_the_rest_at_their_defaults() {
    let config = [
        ("holder-max-busy", " 3 "),
        ("pull-overhead-us", "0"),
        ("idle-peer-max-busy", "1"),
        ("holder-load-slack", "lots"),
        ("spill-prefill-busy", "2"),
        ("keep-on-prefill-decode-busy", "2"),
        ("decode-holder-slack", "some"),
        ("some-other-policys-key", "9"),
    ];
    let t = Thresholds::from_config(|k| config.iter().find(|c| c.0 == k).map(|c| c.1));
    assert_eq!(
        t,
        Thresholds {
            holder_max_busy: 3,
            pull_overhead_us: 0,
            idle_peer_max_busy: Some(1),
            spill_prefill_busy: Some(2),
            keep_on_prefill_decode_busy: Some(2),
            ..Thresholds::default()
        },
        "a value that is not a whole number keeps the default, as in the guest"
    );
    assert_eq!(Thresholds::from_config(|_| None), Thresholds::default());
    // `off` turns an opt-in rule off, the keep rule (on by default) included.
    let off = Thresholds::from_config(|k| {
        (k == "keep-on-prefill-decode-busy" || k == "spill-prefill-busy").then_some(" OFF ")
    });
    assert_eq!(
        off,
        Thresholds {
            keep_on_prefill_decode_busy: None,
            ..Thresholds::default()
        }
    );
    let garbage =
        Thresholds::from_config(|k| (k == "keep-on-prefill-decode-busy").then_some("sometimes"));
    assert_eq!(garbage.keep_on_prefill_decode_busy, Some(1));
}

#[test]
fn only_a_request_without_a_holder_spills_and_only_to_an_idle_decode_node() {
    let spill = Thresholds {
        spill_prefill_busy: Some(1),
        ..Thresholds::default()
    };
    let r = request(0, 1, vec![]);
    let m = Measured::default();
    // P has a request queued; decode node 2 is idle, node 1 runs one.
    let mut busy_d = node(Role::Decode, 0, 10, false);
    busy_d.running = 1;
    let v = view(vec![
        node(Role::Prefill, 1, 10, false),
        busy_d,
        node(Role::Decode, 0, 10, false),
    ]);
    let d = prefix_aware_with(&r, &v, &m, &spill);
    assert_eq!(d.route, Route::Whole(vec![2, 1]), "{d:?}");
    assert_eq!(d.reverse_pull, None);
    assert!(matches!(
        prefix_aware_with(&r, &v, &m, &Thresholds::default()).route,
        Route::Split(_)
    ));
    // A conversation's turn (node 1 holds it, too busy for rule 1) is pulled back by P as
    // before: spilling would recompute its history.
    let mut held = v.clone();
    held.nodes[1] = holding(held.nodes[1], 96);
    held.nodes[1].running = 1;
    let mut turn = r.clone();
    turn.prompt_tokens = 120;
    let d = prefix_aware_with(&turn, &held, &m, &spill);
    assert!(matches!(d.route, Route::Split(_)), "{d:?}");
    assert_eq!(d.reverse_pull.map(|p| p.from), Some(1));
}

#[test]
fn a_split_stays_on_an_idle_p_only_when_every_decode_node_is_busy_unless_turned_off() {
    // The default.
    let keep = Thresholds::default();
    assert_eq!(keep.keep_on_prefill_decode_busy, Some(1));
    let m = Measured::default();
    // Node 1 holds the conversation and runs a turn (too busy for rule 1); node 2 has a
    // decode parked for its KV; P is idle.
    let mut holder = holding(node(Role::Decode, 0, 10, false), 96);
    holder.running = 1;
    let mut parked = node(Role::Decode, 0, 10, false);
    parked.waiting_remote_kv = 1;
    let v = view(vec![node(Role::Prefill, 0, 10, false), holder, parked]);
    let mut turn = request(0, 1, vec![]);
    turn.prompt_tokens = 120;
    let d = prefix_aware_with(&turn, &v, &m, &keep);
    assert_eq!(d.route, Route::Whole(vec![0]), "{d:?}");
    assert_eq!(
        d.reverse_pull,
        Some(ReversePull {
            from: 1,
            min_tokens: 5
        }),
        "P still pulls the history back"
    );
    let off = Thresholds {
        keep_on_prefill_decode_busy: None,
        ..Thresholds::default()
    };
    let unset = prefix_aware_with(&turn, &v, &m, &off);
    assert!(matches!(unset.route, Route::Split(_)), "{unset:?}");
    assert_eq!(unset.reverse_pull, d.reverse_pull);
    // At 2, one request on each decode node is not enough.
    let two = Thresholds {
        keep_on_prefill_decode_busy: Some(2),
        ..Thresholds::default()
    };
    let d2 = prefix_aware_with(&turn, &v, &m, &two);
    assert!(matches!(d2.route, Route::Split(_)), "{d2:?}");
    // A decode node with nothing on it takes the decode as before.
    let mut free_d = v.clone();
    free_d.nodes[2].waiting_remote_kv = 0;
    let d = prefix_aware_with(&turn, &free_d, &m, &keep);
    assert!(matches!(d.route, Route::Split(_)), "{d:?}");
    // A busy P splits as before: its decode would wait behind its queue.
    let mut busy_p = v.clone();
    busy_p.nodes[0].waiting = 1;
    let d = prefix_aware_with(&turn, &busy_p, &m, &keep);
    assert!(matches!(d.route, Route::Split(_)), "{d:?}");
    // A request with no holder stays on P too, with no pull.
    let mut fresh = v.clone();
    fresh.nodes[1] = node(Role::Decode, 0, 10, false);
    fresh.nodes[1].running = 1;
    let d = prefix_aware_with(&request(0, 1, vec![]), &fresh, &m, &keep);
    assert_eq!(d.route, Route::Whole(vec![0]), "{d:?}");
    assert_eq!(d.reverse_pull, None);
}

#[test]
fn the_prefill_nodes_measured_rates_replace_the_configured_ones() {
    let mut r = request(0, 1, vec![]);
    r.prompt_tokens = 1_000;
    let v = view(vec![
        node(Role::Prefill, 0, 10, false),
        node(Role::Prefill, 3, 10, false),
        holding(node(Role::Decode, 0, 10, false), 96),
    ]);
    let pull_at = |rates: &[Rates], kv_bytes_per_token| {
        let m = Measured {
            rates: rates.to_vec(),
            kv_bytes_per_token,
        };
        prefix_aware_with(&r, &v, &m, &Thresholds::default())
            .reverse_pull
            .map(|p| p.min_tokens)
    };
    let pull = |rates: &[Rates]| pull_at(rates, 0);
    let rates = |prefill_tokens_per_s, pull_mb_per_s| Rates {
        prefill_tokens_per_s,
        pull_mb_per_s,
    };
    assert_eq!(pull(&[]), Some(5));
    // P (node 0) computes 40 000 tokens/s: 25 µs a token against 23 µs to move one at
    // 1000 MB/s, 2 ms fixed: a pull pays from 1021 tokens on, more than the 96 held.
    assert_eq!(pull(&[rates(40_000, 0)]), None);
    // ...but P pulls at 10 GB/s: 2.3 µs a token, from 89 tokens on.
    assert_eq!(pull(&[rates(40_000, 10_000)]), Some(89));
    // Only the first prefill candidate's rates count (node 1 is busier).
    assert_eq!(pull(&[rates(0, 0), rates(40_000, 0)]), Some(5));
    // A model with 2 KiB of KV per token: 2 µs a token at 1000 MB/s, from 88 tokens on.
    assert_eq!(pull_at(&[rates(40_000, 0)], 2_048), Some(88));
}
