//! The hand-off itself: greedy output through P and D equals one node's on every API, P's first
//! token taken where it may be, both ways of reading P's pool, and `n` children sharing one
//! hand-off and one pull.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_through_p_and_d_equals_one_node_on_every_api() {
    let dir = model("exact");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    let mut run = 0;
    for api in [Api::Completions, Api::Chat, Api::Responses] {
        for text in [SHORT, LONG] {
            for stream in [false, true] {
                // A distinct prompt per run, so D's prefix cache never holds any of it.
                run += 1;
                let text = format!("{run}{text}");
                let body = api.body(&text, 12);
                let body = if stream { streaming(api, &body) } else { body };
                let want = seen(api, post(&solo.http, api.path(), &body).await).await;
                assert_eq!(want.pulled, None);
                let got = through_pd(&p, &d, api, &body).await;
                assert_eq!(got.texts, want.texts, "{body}");
                assert_eq!(got.tokens, want.tokens, "{body}");
                // The prompt's KV came from P — all of it, with P's greedy first token, so D
                // computes nothing before its first token — except blocks D had cached (the
                // chat template's head). D never answers with params of its own.
                let prompt = got.prompt.expect("usage");
                let pulled = got.pulled.expect("D reports pulled tokens");
                assert!(pulled > 0);
                assert_eq!(got.cached, Some(prompt), "{body}");
                if api == Api::Completions {
                    assert_eq!(pulled, prompt, "no shared prefix: all pulled");
                }
                assert!(got.kv.is_none());
            }
        }
    }
    // P: every lease was released by D right after its pull, none expired.
    eventually("P's leases released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"granted\"}").await,
        12.0
    );
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"released\"}").await,
        12.0
    );
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"expired\"}").await,
        0.0
    );
    assert_eq!(
        metric(
            &d,
            "pd_kv_transfer_failures_total{reason=\"lease_expired\"}"
        )
        .await,
        0.0
    );
    assert!(metric(&d, "pd_kv_transfer_bytes_total").await > 0.0);
    assert!(metric(&d, "pd_node_kv_pulled_tokens_total").await > 0.0);
    // Shared memory maps P's lease board into D: every lease was confirmed there, by a read
    // right after its blocks, not by a round trip.
    assert_eq!(
        metric(&d, "pd_kv_lease_confirms_total{via=\"board\"}").await,
        12.0
    );
    assert_eq!(
        metric(&d, "pd_kv_lease_confirms_total{via=\"rpc\"}").await,
        0.0
    );
    // Prompt logprobs are computed by the node that answers, never through P and D: P refuses
    // to prefill for another node with them (a gateway sends such requests to one node).
    for extra in [
        json!({"echo": true, "logprobs": 1}),
        json!({"prompt_logprobs": 0}),
    ] {
        let mut body = prefill_body(Api::Completions, &Api::Completions.body(SHORT, 4));
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = post(&p.http, "/v1/completions", &body).await;
        assert_eq!(r.status(), 400, "{extra}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["param"], "kv_transfer_params", "{e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("prompt logprobs"),
            "{e}"
        );
    }
}

/// A single completion without logprobs — greedy or sampled — takes P's first token: D then
/// computes nothing before its first token and reports the whole prompt pulled. A seeded
/// sampled request still answers token for token as one node does: D's generator skips the
/// draw P took for that token. A request asking for logprobs and an `n = 2` request compute
/// the last prompt position on D as before (pulled = prompt − 1). An unseeded sampled request
/// takes P's token too. The same holds with penalties, biases and `min_p` set, under
/// structured output, and under `min_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_single_completion_without_logprobs_takes_the_producers_first_token() {
    let dir = model("first-token");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    let api = Api::Completions;
    let base = |i: usize| api.body(&format!("{i}{LONG}"), 6);
    let mut sampled = base(1);
    sampled["temperature"] = json!(0.9);
    sampled["seed"] = json!(7);
    let mut logprobs = base(2);
    logprobs["logprobs"] = json!(2);
    let mut two = base(3);
    two["n"] = json!(2);
    // Penalties and biases act on the first token too (the repetition penalty reads the
    // prompt): P's token stands for D's only under the same ones, which the key attests.
    // (A bias against the plain answer's second token makes sure D's part changes.)
    let plain = seen(api, post(&solo.http, api.path(), &base(5)).await).await;
    let second = plain.tokens[0][1].to_string();
    let mut penalized = base(5);
    for (k, v) in [
        ("repetition_penalty", json!(1.3)),
        ("frequency_penalty", json!(0.7)),
        ("presence_penalty", json!(0.4)),
        ("logit_bias", json!({"17": 3.5, "3": -2, second: -100})),
    ] {
        penalized[k] = v;
    }
    let alone = seen(api, post(&solo.http, api.path(), &penalized).await).await;
    assert_ne!(
        plain.tokens, alone.tokens,
        "the penalties change the answer"
    );
    let mut penalized_sampled = penalized.clone();
    penalized_sampled["prompt"] = base(6)["prompt"].clone();
    penalized_sampled["temperature"] = json!(0.9);
    penalized_sampled["seed"] = json!(11);
    penalized_sampled["min_p"] = json!(0.05);
    let mut penalized_two = penalized_sampled.clone();
    penalized_two["prompt"] = base(7)["prompt"].clone();
    penalized_two["n"] = json!(2);
    // Structured output masks every pick, P's first among them: P's token stands for D's only
    // under the same constraint (the key carries its fingerprint). Greedy under a schema takes
    // P's token; two sampled children under a regex compute it on D.
    let mut schema = base(8);
    schema["max_tokens"] = json!(80);
    schema["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "r",
        "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
        "maximum": 99}, "s": {"enum": ["ab", "cd"]}}, "required": ["n", "s"],
        "additionalProperties": false}}});
    let mut regex_two = base(9);
    regex_two["n"] = json!(2);
    regex_two["temperature"] = json!(0.8);
    regex_two["seed"] = json!(3);
    regex_two["structured_outputs"] = json!({"regex": "[a-f]{3}-[0-9]{2}"});
    let structured = seen(api, post(&solo.http, api.path(), &schema).await).await;
    let v: Value = serde_json::from_str(&structured.texts[0]).expect("JSON under the schema");
    assert!(v["n"].is_u64() && v["s"].is_string(), "{v}");
    // `min_tokens` bans the ending tokens from the first pick on: P bans them too (the key
    // carries the ban). A stop id that is the plain answer's first token moves it.
    let plain_first = seen(api, post(&solo.http, api.path(), &base(10)).await)
        .await
        .tokens[0][0];
    let mut min_tokens = base(10);
    min_tokens["stop_token_ids"] = json!([plain_first]);
    min_tokens["min_tokens"] = json!(3);
    let held = seen(api, post(&solo.http, api.path(), &min_tokens).await).await;
    assert_ne!(
        held.tokens[0][0], plain_first,
        "min_tokens banned the stop id"
    );
    for (body, takes_first) in [
        (min_tokens, true),
        (base(0), true),
        (sampled, true),
        (logprobs, false),
        (two, false),
        (penalized, true),
        (penalized_sampled, true),
        (penalized_two, false),
        (schema, true),
        (regex_two, false),
    ] {
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p, &d, api, &body).await;
        assert_eq!(got.tokens, want.tokens, "{body}");
        assert_eq!(got.texts, want.texts, "{body}");
        let prompt = got.prompt.expect("usage");
        let pulled = if takes_first { prompt } else { prompt - 1 };
        assert_eq!(got.pulled, Some(pulled), "{body}");
        assert_eq!(got.cached, Some(pulled), "{body}");
    }
    let mut unseeded = base(4);
    unseeded["temperature"] = json!(1.2);
    let got = through_pd(&p, &d, api, &unseeded).await;
    assert_eq!(got.tokens[0].len(), 6);
    assert_eq!(got.pulled, got.prompt, "{unseeded}");
}

/// Both ways of reading a producer's pool on one host — copying from the mapping UCX gives
/// (`--kv-pull-via auto`, the default) and UCX gets (`get`) — bring the same KV: token for
/// token as one node, the whole prompt pulled, the lease confirmed on the board either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_through_the_mapping_and_through_ucx_gets_bring_the_same_kv() {
    let dir = model("via");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let mapped = consumer_with(&dir, "fail", &["--engine-id", "d1"]);
    let gets = consumer_with(&dir, "fail", &["--engine-id", "d2", "--kv-pull-via", "get"]);
    let api = Api::Completions;
    for (i, (d, via)) in [(&mapped, "mapped"), (&gets, "get")]
        .into_iter()
        .enumerate()
    {
        let body = api.body(&format!("{i}{LONG}"), 8);
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p, d, api, &body).await;
        assert_eq!(got.tokens, want.tokens, "{body}");
        assert_eq!(got.pulled, got.prompt, "{body}");
        assert!(metric(d, "pd_kv_transfer_bytes_total").await > 0.0);
        assert_eq!(
            metric(d, &format!("pd_kv_pulls_total{{via=\"{via}\"}}")).await,
            1.0,
            "read via {via}"
        );
        assert_eq!(
            metric(d, "pd_kv_lease_confirms_total{via=\"board\"}").await,
            1.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_children_share_one_handoff_and_one_pull() {
    let dir = model("fork");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    // `salt` makes prompts of one length that share no block (D's prefix cache stays cold).
    let body_salted = |n: usize, salt: char| {
        json!({"model": "tiny", "prompt": format!("{salt}{LONG}"), "max_tokens": 10, "n": n,
               "seed": 42, "temperature": 0.9, "ignore_eos": true, "return_token_ids": true})
    };
    let body = |n: usize| body_salted(n, 'a');
    let want = seen(
        Api::Completions,
        post(&solo.http, "/v1/completions", &body(3)).await,
    )
    .await;
    assert_eq!(want.tokens.len(), 3);
    assert_ne!(want.tokens[0], want.tokens[1], "seeded children differ");

    // n=3: P hands off one object; D pulls once and forks three children.
    let params = prefill(&p, Api::Completions, &body(3)).await;
    assert!(params.is_object(), "one handoff for n>1: {params}");
    let mut db = body(3);
    db["kv_transfer_params"] = params;
    let got = seen(
        Api::Completions,
        post(&d.http, "/v1/completions", &db).await,
    )
    .await;
    assert_eq!(
        got.tokens, want.tokens,
        "children equal the standalone node's with the same seeds"
    );
    let bytes_n3 = metric(&d, "pd_kv_transfer_bytes_total").await;

    // n=1 and n=8 move the same bytes (the KV of one prompt).
    let mut moved = Vec::new();
    for (n, salt) in [(1, 'b'), (8, 'c')] {
        let before = metric(&d, "pd_kv_transfer_bytes_total").await;
        let params = prefill(&p, Api::Completions, &body_salted(n, salt)).await;
        let mut db = body_salted(n, salt);
        db["kv_transfer_params"] = params;
        let got = seen(
            Api::Completions,
            post(&d.http, "/v1/completions", &db).await,
        )
        .await;
        assert_eq!(got.tokens.len(), n);
        moved.push(metric(&d, "pd_kv_transfer_bytes_total").await - before);
    }
    assert_eq!(moved[0], bytes_n3);
    assert_eq!(moved[0], moved[1], "n=8 moves the bytes of n=1");

    // The list form (one params object per child, seed PR #38900): blocks shared by the
    // children are pulled once, and every lease is released.
    let before = metric(&d, "pd_kv_transfer_bytes_total").await;
    let want = seen(
        Api::Completions,
        post(&solo.http, "/v1/completions", &body_salted(3, 'd')).await,
    )
    .await;
    let params = prefill(&p, Api::Completions, &body_salted(3, 'd')).await;
    let mut db = body_salted(3, 'd');
    db["kv_transfer_params"] = json!([params.clone(), params.clone(), params]);
    let got = seen(
        Api::Completions,
        post(&d.http, "/v1/completions", &db).await,
    )
    .await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        metric(&d, "pd_kv_transfer_bytes_total").await - before,
        bytes_n3
    );
    eventually("P's leases released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
}
