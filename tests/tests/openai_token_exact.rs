//! The unmodified `openai` Python package, as an application would use it, gets the same tokens
//! from a standalone node as from the gateway in front of 1 prefill + 1 decode node, and in front
//! of 2 + 2: chat, completions and responses, streamed and not, greedy and (chat, completions)
//! n=3 seeded sampling. Every P/D answer's usage shows the prompt's KV pulled from P (the
//! prompt but its last token, which D recomputes for its logits), and the gateway's and the
//! nodes' counters show the split path ran for every request with no fallback, failover,
//! recompute or leaked lease. Behind 2 + 2 the round-robin policy deals n=3's children over both
//! decode nodes (2 + 1): P grants a lease per decode node, each pulls, and the gateway merges
//! the two answers (choice indices, seeds, usage, one stream) into what one node gives. The 2 + 2
//! cluster's prefill nodes keep their KV in the GPU block layout (`--kv-layout nhd`, blocks of
//! 16) and its decode nodes in the CPU one with blocks of 32, so every pull there is converted
//! (issue 13): still token for token. Structured output (`response_format`, `text.format`,
//! vLLM's `structured_outputs`) and forced tool calls (`tools` with `tool_choice` named or
//! `"required"`) too: each answer complete under its constraint, and the same through P and D
//! as on one node. So are tool calls the model writes itself (`tool_choice` `"auto"`, every
//! node serving with `--tool-call-parser hermes`): text first, then `<tool_call>` blocks that
//! come back as `tool_calls` (the blocks are held to that shape by a regex in
//! `structured_outputs`, since a random tiny model would never write one). The Responses API
//! takes the same tools in its own shapes and answers with `function_call` items.

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, Node, Role, TestCluster, args, tiny_model};
use pd_cluster_tests::eventually;
use pd_cluster_tests::process::WorkDir;
use pd_cluster_tests::python;
use serde_json::{Value, json};

const MAX_TOKENS: u32 = 12;

/// Every combination, each with its own prompt: its first block (chat template head + the
/// numbered start of the text, or BOS + text) differs from every other's, so no node ever holds
/// a cached prefix of it and D must pull all of it (but the last token, when sampling).
pub(super) fn specs() -> Vec<Value> {
    let mut specs = Vec::new();
    for api in ["chat", "completions", "responses"] {
        for stream in [false, true] {
            for (n, temperature, seed) in [(1, 0.0, None), (3, 0.8, Some(7))] {
                if api == "responses" && n != 1 {
                    continue; // the Responses API has no `n`
                }
                let text = format!(
                    "{:02} {api} stream={stream} n={n}: prefill and decode nodes share one KV cache.",
                    specs.len()
                );
                let mut s = json!({"api": api, "stream": stream, "n": n, "max_tokens": MAX_TOKENS,
                    "temperature": temperature, "seed": seed});
                match api {
                    "chat" => s["messages"] = json!([{"role": "user", "content": text}]),
                    "completions" => s["prompt"] = json!(text),
                    _ => s["input"] = json!(text),
                }
                if api != "responses" {
                    s["extra_body"] = json!({"ignore_eos": true, "return_token_ids": true});
                }
                specs.push(s);
            }
        }
    }
    // OpenAI's penalties and bias (SDK arguments) and vLLM's (`extra_body`), which act on
    // every token: on P's first one (attested with the lease) and on D's. (`min_tokens` above
    // the 1 token the gateway asks of P is D's to honour, not a 400 on P.)
    for (api, stream, n, temperature, seed) in [
        ("chat", false, 1, 0.0, None),
        ("completions", true, 3, 0.8, Some(7)),
    ] {
        let text = format!(
            "{:02} {api} penalties n={n}: prefill and decode nodes share one KV cache.",
            specs.len()
        );
        let mut s = json!({"api": api, "stream": stream, "n": n, "max_tokens": MAX_TOKENS,
            "temperature": temperature, "seed": seed,
            "sampling": {"presence_penalty": 0.5, "frequency_penalty": 0.8,
                "logit_bias": {"17": 4, "40": -3}},
            "extra_body": {"ignore_eos": true, "return_token_ids": true,
                "repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 5}});
        match api {
            "chat" => s["messages"] = json!([{"role": "user", "content": text}]),
            _ => s["prompt"] = json!(text),
        }
        specs.push(s);
    }
    // Structured output, as the SDK sends it (`response_format`, the Responses API's
    // `text.format`) and as vLLM's clients do (`structured_outputs` in `extra_body`): every
    // pick masked, P's first one among them.
    let schema = json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 6},
            "rain": {"type": "boolean"},
            "level": {"enum": ["low", "high"]}},
        "required": ["city", "rain", "level"], "additionalProperties": false});
    let text = |i: usize, api: &str| {
        format!("{i:02} {api} structured: prefill and decode nodes share one KV cache.")
    };
    specs.push(
        json!({"api": "chat", "stream": false, "n": 1, "max_tokens": STRUCTURED_MAX_TOKENS,
        "temperature": 0.0, "structured": "json",
        "messages": [{"role": "user", "content": text(specs.len(), "chat")}],
        "sampling": {"response_format": {"type": "json_schema",
            "json_schema": {"name": "weather", "schema": schema, "strict": true}}},
        "extra_body": {"return_token_ids": true}}),
    );
    specs.push(
        json!({"api": "completions", "stream": true, "n": 3, "max_tokens": STRUCTURED_MAX_TOKENS,
        "temperature": 0.8, "seed": 7, "structured": "words",
        "prompt": text(specs.len(), "completions"),
        "extra_body": {"return_token_ids": true,
            "structured_outputs": {"regex": "[a-z]{2,5}( [a-z]{2,5}){2}"}}}),
    );
    // Forced tool calls, as the SDK sends tools: a named one streamed, a required list not.
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": schema}}, {"type": "function", "function": {"name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": false}}}]);
    specs.push(
        json!({"api": "chat", "stream": true, "n": 1, "max_tokens": STRUCTURED_MAX_TOKENS,
        "temperature": 0.0, "structured": "tool",
        "messages": [{"role": "user", "content": text(specs.len(), "chat")}],
        "sampling": {"tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        "extra_body": {"return_token_ids": true}}),
    );
    specs.push(
        json!({"api": "chat", "stream": false, "n": 1, "max_tokens": STRUCTURED_MAX_TOKENS,
        "temperature": 0.0, "structured": "tool",
        "messages": [{"role": "user", "content": text(specs.len(), "chat")}],
        "sampling": {"tools": tools, "tool_choice": "required"},
        "extra_body": {"return_token_ids": true}}),
    );
    // Calls the model writes itself (`"auto"`, the SDK's default with tools), in Hermes'
    // format: some text, then two calls, read by the node's parser. Streamed and not; n=3
    // seeded through a spread over two decode nodes.
    let hermes = r#"[A-Z][a-z]{1,6}\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,5}", "rain": (true|false), "level": "(low|high)"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>"#;
    for (stream, n, temperature, seed) in [(true, 1, 0.0, None), (false, 3, 0.8, Some(7))] {
        specs.push(
            json!({"api": "chat", "stream": stream, "n": n, "max_tokens": STRUCTURED_MAX_TOKENS,
            "temperature": temperature, "seed": seed, "structured": "auto-tool",
            "messages": [{"role": "user", "content": text(specs.len(), "chat")}],
            "sampling": {"tools": tools},
            "extra_body": {"return_token_ids": true, "structured_outputs": {"regex": hermes}}}),
        );
    }
    // The same tools on the Responses API, in its shapes: a named call streamed, `"auto"` not.
    let responses_tools: Vec<Value> = tools
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let f = &t["function"];
            json!({"type": "function", "name": f["name"], "parameters": f["parameters"]})
        })
        .collect();
    specs.push(
        json!({"api": "responses", "stream": true, "n": 1, "max_tokens": STRUCTURED_MAX_TOKENS,
        "temperature": 0.0, "structured": "tool", "input": text(specs.len(), "responses"),
        "sampling": {"tools": responses_tools,
            "tool_choice": {"type": "function", "name": "get_weather"}}}),
    );
    specs.push(
        json!({"api": "responses", "stream": false, "n": 1, "max_tokens": STRUCTURED_MAX_TOKENS,
        "temperature": 0.0, "structured": "auto-tool", "input": text(specs.len(), "responses"),
        "sampling": {"tools": responses_tools},
        "extra_body": {"structured_outputs": {"regex": hermes}}}),
    );
    specs.push(
        json!({"api": "responses", "stream": true, "n": 1, "max_tokens": STRUCTURED_MAX_TOKENS,
        "temperature": 0.0, "structured": "json", "input": text(specs.len(), "responses"),
        "sampling": {"text": {"format": {"type": "json_schema", "name": "weather",
            "schema": schema}}}}),
    );
    specs
}

/// Every node reads the tool calls a model writes in Hermes' format (the tiny model's files
/// do not name `<tool_call>`, so `auto` would pick none).
pub(super) fn hermes() -> Vec<String> {
    args(&["--tool-call-parser", "hermes"])
}

/// The gateway flags of a cluster whose every node serves: the WASM round-robin, with a deadline
/// a loaded 2-core debug build always meets (the tests assert zero fallbacks).
pub(super) fn round_robin() -> Vec<String> {
    let policy = pd_cluster_tests::bins::policy("round-robin");
    args(&[
        "--policy",
        policy.to_str().expect("a UTF-8 path"),
        "--policy-deadline-ms",
        "50",
    ])
}

/// Room for the structured specs' outputs to end where their constraint does.
const STRUCTURED_MAX_TOKENS: u32 = 200;

/// A structured spec's answer: complete under its constraint.
fn check_structured(spec: &Value, answer: &Value) {
    for (i, (text, reason)) in answer["texts"]
        .as_array()
        .unwrap()
        .iter()
        .zip(answer["finish_reasons"].as_array().unwrap())
        .enumerate()
    {
        let text = text.as_str().unwrap();
        // Chat's finish reason for calls; a response's status.
        let called = if spec["api"] == "responses" {
            "completed"
        } else {
            "tool_calls"
        };
        if spec["structured"] == "auto-tool" {
            // The sentence before the calls is content; the two blocks are calls.
            assert_eq!(reason, called, "{spec}: {answer}");
            assert!(
                text.ends_with(".\n") && !text.contains("tool_call"),
                "{text:?}"
            );
            let calls = answer["tool_calls"][i].as_array().expect("tool calls");
            let names: Vec<&str> = calls.iter().map(|c| c["name"].as_str().unwrap()).collect();
            assert_eq!(names, ["get_weather", "get_time"], "{answer}");
            for c in calls {
                let args: Value = serde_json::from_str(c["arguments"].as_str().unwrap())
                    .unwrap_or_else(|e| panic!("{c}: {e}"));
                assert!(args["city"].is_string() || args["zone"].is_string(), "{c}");
            }
            continue;
        }
        if spec["structured"] == "tool" {
            assert_eq!(reason, called, "{spec}: {answer}");
            let calls = answer["tool_calls"][0].as_array().expect("tool calls");
            assert!(!calls.is_empty(), "{answer}");
            for c in calls {
                let name = c["name"].as_str().unwrap();
                assert!(["get_weather", "get_time"].contains(&name), "{c}");
                let args: Value = serde_json::from_str(c["arguments"].as_str().unwrap())
                    .unwrap_or_else(|e| panic!("{c}: {e}"));
                assert!(args.is_object(), "{c}");
            }
            continue;
        }
        assert!(
            reason == "stop" || reason == "completed",
            "{spec}: {answer}"
        );
        match spec["structured"].as_str() {
            Some("json") => {
                let v: Value = serde_json::from_str(text)
                    .unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}: {spec}"));
                assert!(v["rain"].is_boolean() && v["city"].is_string(), "{v}");
                assert!(
                    ["low", "high"].contains(&v["level"].as_str().unwrap()),
                    "{v}"
                );
            }
            _ => {
                let words: Vec<&str> = text.split(' ').collect();
                assert_eq!(words.len(), 3, "{text:?}");
                for w in words {
                    assert!((2..=5).contains(&w.len()), "{text:?}");
                    assert!(w.bytes().all(|b| b.is_ascii_lowercase()), "{text:?}");
                }
            }
        }
    }
}

fn u64_of(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

/// Checks one cluster's answers against the reference's; returns the KV tokens the answers say
/// were pulled, one entry per answer.
pub(super) fn compare(cluster: &str, specs: &[Value], want: &[Value], got: &[Value]) -> Vec<u64> {
    let mut pulled_each = Vec::new();
    for ((spec, w), g) in specs.iter().zip(want).zip(got) {
        let at = format!("{cluster}: {spec}");
        assert_eq!(
            g["token_ids"], w["token_ids"],
            "tokens differ from the reference: {at}"
        );
        assert_eq!(
            g["texts"], w["texts"],
            "texts differ from the reference: {at}"
        );
        assert_eq!(
            g["finish_reasons"], w["finish_reasons"],
            "finish reasons: {at}"
        );
        assert_eq!(g["tool_calls"], w["tool_calls"], "tool calls: {at}");
        let n = spec["n"].as_u64().unwrap_or(1) as usize;
        assert_eq!(g["texts"].as_array().map_or(0, Vec::len), n, "{at}");
        let prompt = u64_of(g, "prompt_tokens").unwrap_or_else(|| panic!("no usage: {at}: {g}"));
        assert_eq!(
            Some(prompt),
            u64_of(w, "prompt_tokens"),
            "prompt tokens: {at}"
        );
        // D pulled every prompt token P computed (no shared prefix), and reports all of them as
        // cached. A greedy single completion takes P's first token, attested with the lease,
        // so D computes nothing before it: pulled = prompt. Sampled children compute the last
        // prompt position on D for its logits: pulled = prompt - 1 (node/server/tests/pd/handoff.rs).
        let pulled = u64_of(g, "kv_pulled_tokens")
            .unwrap_or_else(|| panic!("no usage.*_details.kv_pulled_tokens: {at}: {g}"));
        assert!(pulled > 0, "{at}");
        let greedy = n == 1 && spec["temperature"].as_f64() == Some(0.0);
        let want = if greedy { prompt } else { prompt - 1 };
        assert_eq!(pulled, want, "KV pulled from P: {at}: {g}");
        assert_eq!(u64_of(g, "cached_tokens"), Some(want), "{at}: {g}");
        pulled_each.push(pulled);
    }
    pulled_each
}

/// `spread`: the cluster's policy deals n=3 over two decode nodes, each pulling the prompt
/// under a lease of its own.
pub(super) async fn check_counters(
    c: &TestCluster,
    specs: &[Value],
    pulled_each: &[u64],
    spread: bool,
) {
    let requests = specs.len() as f64;
    // Decode requests per answer: 2 for a spread n=3, else 1.
    let groups: Vec<u64> = specs
        .iter()
        .map(|s| if spread && s["n"] == 3 { 2 } else { 1 })
        .collect();
    let leases = groups.iter().sum::<u64>() as f64;
    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum("pd_gateway_decode_spread_total", &[("groups", "2")]),
        groups.iter().filter(|&&k| k == 2).count() as f64,
        "{}",
        g.show("pd_gateway_decode_spread_total")
    );
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[("outcome", "ok")]),
        requests,
        "{}",
        g.show("pd_gateway_requests_total")
    );
    assert_eq!(
        g.sum_except("pd_gateway_requests_total", "outcome", "ok"),
        0.0
    );
    for api in ["chat", "completions", "responses"] {
        let n = specs.iter().filter(|s| s["api"] == api).count() as f64;
        assert_eq!(
            g.sum(
                "pd_gateway_requests_total",
                &[("api", api), ("outcome", "ok")]
            ),
            n,
            "{api}"
        );
    }
    assert_eq!(
        g.sum("pd_gateway_policy_decisions_total", &[]),
        requests,
        "{}",
        g.show("pd_gateway_policy_decisions_total")
    );
    for (metric, what) in [
        ("pd_gateway_policy_fallbacks_total", "fallbacks"),
        ("pd_gateway_policy_failures_total", "policy failures"),
        ("pd_gateway_failovers_total", "failovers"),
        ("pd_gateway_kv_params_stripped_total", "stripped params"),
        ("pd_gateway_leases_released_total", "gateway lease releases"),
    ] {
        assert_eq!(g.sum(metric, &[]), 0.0, "{what}: {}", g.show(metric));
    }

    // P: one lease per decode request, every one released by D after its pull, none expired.
    eventually(
        "every P lease released",
        Duration::from_secs(10),
        async || c.sum_over(Role::Prefill, "pd_kv_leases_live", &[]).await == 0.0,
    )
    .await;
    let granted = c
        .sum_over(Role::Prefill, "pd_kv_leases_total", &[("event", "granted")])
        .await;
    assert_eq!(granted, leases, "one P lease per decode request");
    assert_eq!(
        c.sum_over(
            Role::Prefill,
            "pd_kv_leases_total",
            &[("event", "released")]
        )
        .await,
        leases
    );
    assert_eq!(
        c.sum_over(Role::Prefill, "pd_kv_leases_total", &[("event", "expired")])
            .await,
        0.0
    );
    // D: the tokens the answers report are the tokens the decode nodes' counters pulled (each
    // decode node of a spread answer pulled the prompt); nothing failed or was recomputed.
    let pulled: u64 = pulled_each.iter().zip(&groups).map(|(p, k)| p * k).sum();
    assert_eq!(
        c.sum_over(Role::Decode, "pd_node_kv_pulled_tokens_total", &[])
            .await,
        pulled as f64
    );
    assert!(
        c.sum_over(Role::Decode, "pd_kv_transfer_bytes_total", &[])
            .await
            > 0.0
    );
    for metric in ["pd_kv_transfer_failures_total", "pd_kv_recompute_total"] {
        assert_eq!(c.sum_over(Role::Decode, metric, &[]).await, 0.0, "{metric}");
    }
    // The gateway tokenized each prompt once for the cluster: every P and D request took the
    // ids it sent (`prompt_token_ids`) and tokenized nothing itself. The answers above equal a
    // standalone node's, which tokenized the same prompts itself: the ids were the node's own.
    let given = [("tokens", "given")];
    assert_eq!(
        c.sum_over(Role::Prefill, "pd_node_prompts_total", &given)
            .await,
        requests
    );
    assert_eq!(
        c.sum_over(Role::Decode, "pd_node_prompts_total", &given)
            .await,
        leases
    );
    for role in [Role::Prefill, Role::Decode] {
        let computed = [("tokens", "computed")];
        assert_eq!(
            c.sum_over(role, "pd_node_prompts_total", &computed).await,
            0.0,
            "{role:?} computed a prompt"
        );
    }
    // Every node of each role took part (round-robin over 2 + 2).
    for n in &c.nodes {
        let m = n.metrics(&c.client).await;
        let worked = match n.role {
            Role::Prefill => m.sum("pd_kv_leases_total", &[("event", "granted")]),
            _ => m.sum("pd_node_kv_pulled_tokens_total", &[]),
        };
        assert!(worked > 0.0, "{} served nothing", n.engine_id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_package_gets_identical_tokens_through_the_gateway_and_p_d() {
    let python = python::interpreter();
    let specs = specs();

    // (a) The reference: one standalone node, no gateway. The tiny model is generated from a
    // fixed seed, byte-identical in every directory.
    let want = {
        let dir = WorkDir::new("openai-reference");
        let model = tiny_model(&dir);
        let reference = Node::reference_with(&dir, &model, &hermes());
        python::run_specs(&python, &reference.http, &specs).await
    };
    for (spec, w) in specs.iter().zip(&want) {
        assert!(
            w["kv_pulled_tokens"].is_null(),
            "a standalone node pulls nothing: {spec}: {w}"
        );
        if spec.get("structured").is_some() {
            check_structured(spec, w);
        }
        if spec["api"] == "responses" {
            continue; // no token ids on the Responses API
        }
        // Every choice carries its token ids (`return_token_ids`), all MAX_TOKENS of them
        // (`ignore_eos`): the comparison below is token for token, not only text.
        let ids = w["token_ids"].as_array().expect("token ids per choice");
        assert_eq!(ids.len() as u64, spec["n"].as_u64().unwrap_or(1), "{w}");
        for choice in ids {
            let len = choice.as_array().map_or(0, Vec::len);
            if spec.get("structured").is_some() {
                // Ends where the constraint is complete.
                assert!(
                    len > 0 && len < STRUCTURED_MAX_TOKENS as usize,
                    "{spec}: {w}"
                );
            } else {
                assert_eq!(len, MAX_TOKENS as usize, "{spec}: {w}");
            }
        }
        if spec["n"] == 3 {
            assert!(
                ids.windows(2).any(|t| t[0] != t[1]),
                "seeded children differ: {w}"
            );
        }
    }
    // (b) gateway + 1P + 1D (default: the built-in policy), (c) gateway + 2P + 2D (the WASM
    // round-robin, so every node serves).
    let clusters = [
        (
            "openai-1p1d",
            false,
            ClusterSpec {
                prefill: 1,
                decode: 1,
                node_args: hermes(),
                ..ClusterSpec::default()
            },
        ),
        (
            "openai-2p2d",
            true,
            ClusterSpec {
                prefill: 2,
                decode: 2,
                gateway_args: round_robin(),
                // P in the GPU layout with blocks of 16, D in the CPU layout with blocks of 32:
                // D converts every pull.
                prefill_args: args(&["--kv-layout", "nhd"]),
                decode_args: args(&["--block-size", "32"]),
                // Four nodes on the test machine's cores: one compute thread each.
                node_args: args(&["--threads", "1", "--tool-call-parser", "hermes"]),
                ..ClusterSpec::default()
            },
        ),
    ];
    for (name, spread, spec) in clusters {
        let c = TestCluster::start(name, spec).await;
        let got = python::run_specs(&python, &c.gateway.http, &specs).await;
        let pulled = compare(name, &specs, &want, &got);
        eprintln!(
            "{name}: {} answers token-identical to the reference; {} prompt tokens pulled P→D",
            got.len(),
            pulled.iter().sum::<u64>()
        );
        check_counters(&c, &specs, &pulled, spread).await;
        // Converted pulls: every one in the 2 + 2 cluster (one per decode request), none in
        // the 1 + 1 (same layouts).
        let converted = c
            .sum_over(Role::Decode, "pd_kv_rechunked_pulls_total", &[])
            .await;
        let pulls = c
            .sum_over(Role::Prefill, "pd_kv_leases_total", &[("event", "granted")])
            .await;
        assert_eq!(converted, if spread { pulls } else { 0.0 }, "{name}");
        // `--threads` reached candle's pool (the node logs what it computes with).
        if spread {
            for n in &c.nodes {
                assert!(
                    n.proc.log().contains("compute_threads=1"),
                    "{}: {}",
                    n.engine_id,
                    n.proc.log_tail(20)
                );
            }
        }
    }
}
