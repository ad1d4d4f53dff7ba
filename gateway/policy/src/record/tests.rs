//! Tests of the record format: round trips, the WIT's names on the wire, short cases.

use super::*;

fn sample() -> Record {
    let node = |role, waiting| Node {
        role,
        free_blocks: 7,
        total_blocks: 9,
        leased_blocks: 1,
        waiting,
        running: 2,
        waiting_remote_kv: 3,
        draining: waiting == 5,
        conversation_tokens: 11,
        conversation_expiry_ms: 12,
    };
    Record {
        request: Request {
            seq: u64::MAX,
            api: Api::Responses,
            prompt_tokens: 40,
            block_size: 16,
            block_hashes: vec![u64::MAX, 1],
            prefix_blocks: vec![2, 0, 1],
            n: 3,
            max_tokens: Some(16),
            stream: true,
            conversation_key: Some("c".into()),
        },
        view: View {
            nodes: vec![
                node(Role::Prefill, 5),
                node(Role::Decode, 0),
                node(Role::Standalone, 1),
            ],
        },
        measured: Measured {
            rates: vec![
                Rates {
                    prefill_tokens_per_s: 2400,
                    pull_mb_per_s: 0,
                },
                Rates::default(),
                Rates {
                    prefill_tokens_per_s: 0,
                    pull_mb_per_s: 900,
                },
            ],
            kv_bytes_per_token: 23_040,
        },
        decision: Decision {
            route: Route::Split(Split {
                prefill: vec![0],
                decode: vec![DecodeTarget {
                    node: 1,
                    children: 3,
                }],
            }),
            reverse_pull: Some(ReversePull {
                from: 2,
                min_tokens: 64,
            }),
        },
        node_names: vec!["p".into(), "d".into(), "s".into()],
        policy: Some("prefix-aware".into()),
        policy_sha256: Some("ab".into()),
        time_ms: Some(5),
        latency_ns: Some(6),
        fallback: true,
    }
}

#[test]
fn a_record_reads_back_as_written() {
    let r = sample();
    let line = serde_json::to_string(&r.to_json()).expect("json");
    let back: Value = serde_json::from_str(&line).expect("parse");
    assert_eq!(Record::from_json(&back).expect("record"), r);
    for route in [
        Route::Whole(vec![2, 0]),
        Route::Reject(Rejection {
            status: 429,
            message: "busy".into(),
        }),
    ] {
        let mut r = sample();
        r.decision.route = route;
        assert_eq!(Record::from_json(&r.to_json()).expect("record"), r);
    }
}

#[test]
fn wit_names_on_the_wire() {
    let v = sample().to_json();
    assert_eq!(v["request"]["prompt-tokens"], 40);
    assert_eq!(v["request"]["api"], "responses");
    assert_eq!(v["view"]["nodes"][1]["role"], "decode");
    assert_eq!(v["view"]["nodes"][0]["waiting-remote-kv"], 3);
    assert_eq!(v["decision"]["route"]["split"]["decode"][0]["children"], 3);
    assert_eq!(v["decision"]["reverse-pull"]["min-tokens"], 64);
    assert_eq!(v["rates"][0]["prefill-tokens-per-s"], 2400);
    assert_eq!(v["rates"][2]["pull-mb-per-s"], 900);
    assert_eq!(v["kv-bytes-per-token"], 23_040);
    assert_eq!(v["wit"], WIT_VERSION);
    // Nothing measured, nothing known: neither key at all.
    let mut r = sample();
    r.measured = Measured {
        rates: vec![Rates::default(); 3],
        kv_bytes_per_token: 0,
    };
    let v = r.to_json();
    assert!(v.get("rates").is_none() && v.get("kv-bytes-per-token").is_none());
}

#[test]
fn short_cases_fill_in_defaults_and_bad_ones_name_the_field() {
    let case = json!({
        "request": {"n": 2},
        "view": {"nodes": [{"role": "standalone", "waiting": 1}]},
        "decision": {"route": {"whole": [0]}},
    });
    let r = Record::from_json(&case).expect("short case");
    assert_eq!(r.request.n, 2);
    assert_eq!(r.request.block_size, 16);
    assert_eq!(r.view.nodes[0].waiting, 1);
    assert_eq!(r.view.nodes[0].free_blocks, 0);

    let bad = |v: Value| Record::from_json(&v).expect_err("bad").path;
    let mut v = case.clone();
    v["view"]["nodes"][0]["role"] = json!("leader");
    assert_eq!(bad(v), "view.nodes[0].role");
    let mut v = case.clone();
    v["view"]["nodes"][0]["waiting"] = json!(-1);
    assert_eq!(bad(v), "view.nodes[0].waiting");
    let mut v = case.clone();
    v["decision"]["route"] = json!({"whole": [0], "split": {}});
    assert_eq!(bad(v), "decision.route");
    let mut v = case.clone();
    v["rates"] = json!([{"pull-mb-per-s": 10}, {"prefill-tokens-per-s": "fast"}]);
    assert_eq!(bad(v), "rates[1].prefill-tokens-per-s");
    let mut v = case.clone();
    v["wit"] = json!("pd:policy@9.0.0");
    assert_eq!(bad(v), "wit");
    let mut v = case;
    v.as_object_mut().expect("object").remove("view");
    assert_eq!(bad(v), "view");
}
