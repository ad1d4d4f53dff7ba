//! Scoring prompts through the cluster, as evaluation harnesses do: lm-evaluation-harness's
//! `local-completions` loglikelihood request (the context and continuation as token ids,
//! `echo`, `logprobs: 1`, `max_tokens: 1`), echo with the prompt alone (`max_tokens: 0`), and
//! vLLM's `prompt_logprobs` on completions and chat, sent by the unmodified `openai` package to
//! the gateway in front of 1 prefill + 1 decode node. Only the node that computes a prompt can
//! score it, so the gateway sends these to one node (a prefill node first): every answer —
//! text, tokens, each logprob, rank and alternative — equals a standalone node's, nothing is
//! pulled and no lease is granted. An echo without logprobs needs no scores and still goes
//! through P and D, token for token. vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`
//! (what lm-eval probes for a remote tokenizer) answer at the gateway as at a node.

use pd_cluster_tests::cluster::{ClusterSpec, Node, Role, TestCluster, tiny_model};
use pd_cluster_tests::process::WorkDir;
use pd_cluster_tests::python;
use serde_json::{Value, json};

/// The requests; each `"scores"` one is served whole.
fn specs() -> Vec<Value> {
    // lm-eval tokenizes context + continuation itself and sends the ids (the byte-level tiny
    // tokenizer's ids are bytes).
    let ids: Vec<u32> = "Question: what moves KV? Answer: the data plane"
        .bytes()
        .map(u32::from)
        .collect();
    vec![
        json!({"api": "completions", "scores": true, "stream": false, "n": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234, "prompt": [ids],
            "sampling": {"echo": true, "logprobs": 1}}),
        json!({"api": "completions", "scores": true, "stream": true, "n": 1, "max_tokens": 4,
            "temperature": 0, "prompt": "01 echoed and scored, streamed",
            "sampling": {"echo": true, "logprobs": 3},
            "extra_body": {"ignore_eos": true, "return_token_ids": true}}),
        json!({"api": "completions", "scores": true, "stream": false, "n": 1, "max_tokens": 0,
            "temperature": 0, "prompt": "02 the prompt alone, scored",
            "sampling": {"echo": true, "logprobs": 0}}),
        json!({"api": "completions", "scores": true, "stream": false, "n": 2, "max_tokens": 3,
            "temperature": 0, "prompt": "03 vLLM's prompt logprobs",
            "extra_body": {"prompt_logprobs": 2, "ignore_eos": true, "return_token_ids": true}}),
        json!({"api": "chat", "scores": true, "stream": false, "n": 1, "max_tokens": 3,
            "temperature": 0,
            "messages": [{"role": "user", "content": "04 score this chat prompt"}],
            "extra_body": {"prompt_logprobs": 1, "ignore_eos": true, "return_token_ids": true}}),
        json!({"api": "completions", "scores": false, "stream": false, "n": 1, "max_tokens": 5,
            "temperature": 0, "prompt": "05 echoed, not scored: through P and D",
            "sampling": {"echo": true},
            "extra_body": {"ignore_eos": true, "return_token_ids": true}}),
        // A list of prompts (lm-eval with --batch_size > 1): answered by one node, choice
        // `i × n + j` for prompt i's child j, streamed and not.
        json!({"api": "completions", "scores": true, "batch": 2, "stream": false, "n": 1,
            "max_tokens": 1, "temperature": 0, "prompt": [ids[..20], ids[20..]],
            "sampling": {"echo": true, "logprobs": 1}}),
        json!({"api": "completions", "scores": true, "batch": 3, "stream": true, "n": 2,
            "max_tokens": 4, "temperature": 0,
            "prompt": ["07 first of three", "07 second of three", "07 third of three"],
            "extra_body": {"ignore_eos": true, "return_token_ids": true}}),
    ]
}

/// `got` equals `want` with numbers within 1e-4 (a logprob computed by another process may
/// differ in its last bits); everything else exactly.
fn close(got: &Value, want: &Value, at: &str) {
    match (got, want) {
        (Value::Number(g), Value::Number(w)) => {
            let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
            assert!((g - w).abs() < 1e-4, "{at}: {g} vs {w}");
        }
        (Value::Array(g), Value::Array(w)) => {
            assert_eq!(g.len(), w.len(), "{at}: {got} vs {want}");
            for (i, (g, w)) in g.iter().zip(w).enumerate() {
                close(g, w, &format!("{at}[{i}]"));
            }
        }
        (Value::Object(g), Value::Object(w)) => {
            let keys = |m: &serde_json::Map<String, Value>| m.keys().cloned().collect::<Vec<_>>();
            assert_eq!(keys(g), keys(w), "{at}");
            for (k, v) in g {
                close(v, &w[k], &format!("{at}.{k}"));
            }
        }
        _ => assert_eq!(got, want, "{at}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_are_scored_through_the_gateway_as_one_node_scores_them() {
    let python = python::interpreter();
    let specs = specs();
    let want = {
        let dir = WorkDir::new("scoring-reference");
        let model = tiny_model(&dir);
        let reference = Node::reference(&dir, &model);
        python::run_specs(&python, &reference.http, &specs).await
    };
    // The reference's answers are what each request asks for.
    for (spec, w) in specs.iter().zip(&want) {
        if let Some(batch) = spec["batch"].as_u64() {
            let choices = batch * spec["n"].as_u64().unwrap();
            assert_eq!(w["texts"].as_array().unwrap().len() as u64, choices, "{w}");
            continue;
        }
        if spec["api"] == "chat" {
            let entries = w["prompt_logprobs"]
                .as_array()
                .expect("chat prompt_logprobs");
            assert_eq!(
                Some(entries.len() as u64),
                w["prompt_tokens"].as_u64(),
                "{w}"
            );
            continue;
        }
        let text = w["texts"][0].as_str().unwrap();
        if let Some(p) = spec["prompt"].as_str()
            && spec["sampling"]["echo"] == true
        {
            assert!(text.starts_with(p), "echo: {text:?}");
            if spec["max_tokens"] == 0 {
                assert_eq!(text, p, "the prompt alone");
            }
        }
        if spec["sampling"].get("logprobs").is_some() {
            let lp = &w["logprobs"][0];
            assert_eq!(lp["token_logprobs"][0], Value::Null, "{lp}");
            let scored = lp["token_logprobs"].as_array().unwrap().len() as u64;
            let generated = spec["max_tokens"].as_u64().unwrap();
            assert_eq!(
                Some(scored),
                w["prompt_tokens"].as_u64().map(|p| p + generated)
            );
        }
        if spec["extra_body"].get("prompt_logprobs").is_some() {
            for per_choice in w["prompt_logprobs"].as_array().unwrap() {
                assert_eq!(per_choice[0], Value::Null);
                assert_eq!(
                    Some(per_choice.as_array().unwrap().len() as u64),
                    w["prompt_tokens"].as_u64()
                );
            }
        }
    }

    let c = TestCluster::start(
        "scoring-1p1d",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            ..ClusterSpec::default()
        },
    )
    .await;
    let got = python::run_specs(&python, &c.gateway.http, &specs).await;
    for ((spec, w), g) in specs.iter().zip(&want).zip(&got) {
        let at = spec.to_string();
        for key in ["texts", "token_ids", "finish_reasons", "prompt_tokens"] {
            assert_eq!(g[key], w[key], "{key}: {at}");
        }
        close(&g["logprobs"], &w["logprobs"], &format!("logprobs of {at}"));
        close(
            &g["prompt_logprobs"],
            &w["prompt_logprobs"],
            &format!("prompt_logprobs of {at}"),
        );
        if spec["scores"] == true {
            assert!(g["kv_pulled_tokens"].is_null(), "served whole: {at}: {g}");
            assert_eq!(
                g["cached_tokens"], 0,
                "a scored prompt is all computed: {g}"
            );
        } else {
            let prompt = g["prompt_tokens"].as_u64().unwrap();
            assert_eq!(g["kv_pulled_tokens"], prompt, "P/D: {g}");
        }
    }
    // A remote tokenizer (lm-eval's `tokenizer_backend=remote`) gets from the gateway what the
    // node answers: the gateway tokenizes with the tokenizer the node registered.
    let reference = {
        let dir = WorkDir::new("scoring-reference-2");
        let model = tiny_model(&dir);
        Node::reference(&dir, &model)
    };
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    for (path, body) in [
        (
            "/tokenize",
            json!({"prompt": "Question: what moves KV?", "return_token_strs": true}),
        ),
        (
            "/tokenize",
            json!({"prompt": "no BOS", "add_special_tokens": false}),
        ),
        (
            "/tokenize",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "tools": tools}),
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "Hi"}],
            "add_generation_prompt": false}),
        ),
        ("/detokenize", json!({"tokens": [72, 101, 108, 108, 111]})),
        ("/tokenize", json!({"model": "other", "prompt": "x"})),
        ("/tokenize", json!({"prompt": ""})),
    ] {
        let ask = |base: &str| c.client.post(format!("{base}{path}")).json(&body).send();
        let (from_gw, from_node) = (
            ask(&c.gateway.http).await.unwrap(),
            ask(&reference.http).await.unwrap(),
        );
        assert_eq!(from_gw.status(), from_node.status(), "{path} {body}");
        let (g, n): (Value, Value) = (
            from_gw.json().await.unwrap(),
            from_node.json().await.unwrap(),
        );
        if g.get("error").is_some() {
            // (A model-not-found error's `param` is null at the gateway, as OpenAI's is.)
            for k in ["type", "code"] {
                assert_eq!(g["error"][k], n["error"][k], "{path} {body}: {g} {n}");
            }
            if !g["error"]["param"].is_null() {
                assert_eq!(g["error"]["param"], n["error"]["param"], "{path} {body}");
            }
        } else {
            assert_eq!(g, n, "{path} {body}");
        }
    }
    let info = |base: String| async move {
        let r = reqwest::get(format!("{base}/tokenizer_info"))
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()
    };
    assert_eq!(
        info(c.gateway.http.clone()).await,
        info(reference.http.clone()).await
    );

    let scored = specs.iter().filter(|s| s["scores"] == true).count() as f64;
    // Prompts computed: a batch's each.
    let computed: f64 = specs
        .iter()
        .map(|s| s["batch"].as_f64().unwrap_or(1.0))
        .sum();
    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "ok")]),
        specs.len() as f64,
        "{}",
        g.show("pd_gateway_requests_total")
    );
    assert_eq!(g.sum("pd_gateway_failovers_total", &[]), 0.0);
    assert_eq!(g.sum("pd_gateway_policy_fallbacks_total", &[]), 0.0);
    // The prefill node served every request (scored ones whole, the other's prefill); the
    // decode node only the one through P and D, with the one lease.
    let prompts = |role| c.sum_over(role, "pd_node_prompts_total", &[]);
    assert_eq!(prompts(Role::Prefill).await, computed);
    assert_eq!(prompts(Role::Decode).await, specs.len() as f64 - scored);
    assert_eq!(
        c.sum_over(Role::Prefill, "pd_kv_leases_total", &[("event", "granted")])
            .await,
        specs.len() as f64 - scored
    );
}
