//! Multi-turn conversations across nodes (issue 10, node side): a node started with
//! `--kv-retain-after-decode` keeps a finished turn's KV under a retained lease and describes it
//! in the final response's `kv_transfer_params`; the next turn's node pulls that prefix
//! (reverse pull), checks it against its own prompt, and computes only the new tokens. Every
//! turn's greedy output equals one standalone node's on the same full prompt, token for token.

use pd_model::tiny::TinySpec;
use serde_json::{Value, json};

use crate::pd::{
    Api, Node, Seen, consumer_with, eventually, metric, model, model_spec, post, prefill_body,
    producer, recomputes, seen, start, streaming,
};

const RETAIN: &[&str] = &["--kv-retain-after-decode", "30"];

/// A completions request on token ids (so each turn's prompt is exactly the previous prompt,
/// the previous answer, and new tokens), greedy, `max_tokens` long.
fn turn(prompt: &[u64], max_tokens: usize) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "return_token_ids": true})
}

/// The next user message of turn `k`: a few tokens of its own.
fn user(k: u64) -> Vec<u64> {
    (0..5).map(|i| 40 + (k * 7 + i * 3) % 50).collect()
}

/// A retained turn's params as a request to pull them and decode here (`whole` on a node).
fn as_pull(retained: &Value) -> Value {
    let mut p = retained.clone();
    p["do_remote_prefill"] = json!(true);
    p["do_remote_decode"] = json!(false);
    p
}

fn held(params: &Value) -> u64 {
    params["remote_num_tokens"]
        .as_u64()
        .expect("remote_num_tokens")
}

async fn retained_leases(node: &Node) -> f64 {
    metric(node, "pd_node_kv_retained_total").await
}

/// Five turns, each placed differently, each equal to one node's output on the full prompt:
/// 1. P→D1; D1 retains the turn.
/// 2. Reverse pull then P→D: P pulls turn 1 from D1, computes only the new tokens, hands the
///    whole prompt to D2.
/// 3. Pull and decode on another node: D1 pulls turn 2 from D2.
/// 4. On the holder: D1 again, with its own params; the blocks are in its prefix cache, no pull.
/// 5. Params naming a lease the holder does not hold → recomputed, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_turn_of_a_conversation_equals_one_node_wherever_it_is_placed() {
    conversation("multi-turn", &[]).await;
}

/// The same five turns with every node computing on staged KV (`--kv-staged`, the GPU path's
/// copies on CPU): a retained turn's blocks go down to the transfer pool before its lease, a
/// reverse pull's blocks go up before P computes the new tokens. The standalone node computes
/// in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_on_staged_kv_equals_one_node_wherever_it_is_placed() {
    conversation("multi-turn-staged", &["--kv-staged"]).await;
}

/// [`every_turn_of_a_conversation_equals_one_node_wherever_it_is_placed`], with `extra` flags
/// on P, D1 and D2.
async fn conversation(name: &str, extra: &[&str]) {
    let dir = model(name);
    let solo = start(&dir, &[]);
    // Threshold 0: pull even a block or two (the default computes short prefixes locally).
    let p = producer(&dir, &[&["--kv-recompute-threshold", "0"], extra].concat());
    let d1 = consumer_with(
        &dir,
        "recompute",
        &[&["--engine-id", "d1"], RETAIN, extra].concat(),
    );
    // D2 fails a prefill's handoff it cannot pull; an earlier turn's KV is recomputed anyway.
    let d2 = consumer_with(
        &dir,
        "fail",
        &[&["--engine-id", "d2"], RETAIN, extra].concat(),
    );
    let api = Api::Completions;
    let path = api.path();
    let mut prompt: Vec<u64> = (1..=11).collect();
    let want = |prompt: Vec<u64>| {
        let solo = &solo;
        async move { seen(api, post(&solo.http, path, &turn(&prompt, 6)).await).await }
    };
    let next = |prompt: &mut Vec<u64>, answer: &Seen, k: u64| {
        prompt.extend(&answer.tokens[0]);
        prompt.extend(user(k));
    };

    // Turn 1: P → D1, which keeps the turn.
    let body = turn(&prompt, 6);
    let mut db = body.clone();
    db["kv_transfer_params"] = seen(api, post(&p.http, path, &prefill_body(api, &body)).await)
        .await
        .kv
        .unwrap();
    let got = seen(api, post(&d1.http, path, &db).await).await;
    assert_eq!(got.tokens, want(prompt.clone()).await.tokens, "turn 1");
    let kept = got.kv.clone().expect("D1 describes the retained turn");
    assert_eq!(kept["do_remote_decode"], true, "{kept}");
    assert_eq!(kept["remote_engine_id"], "d1");
    // Prompt 11 + 6 generated, the last without KV: 16 tokens computed, 4 whole blocks of 4.
    assert_eq!(held(&kept), 16, "{kept}");
    // Keyed by the chain hash of the last held block: the next turn's prompt hashes to it.
    let mut held_tokens: Vec<u32> = prompt.iter().map(|&t| t as u32).collect();
    held_tokens.extend(got.tokens[0].iter().map(|&t| t as u32));
    let chain = pd_kv_pool::hash_full_blocks(&held_tokens[..16], 4);
    assert_eq!(
        kept["remote_last_block_hash"],
        format!("{:016x}", chain[3].0),
        "{kept}"
    );
    assert_eq!(retained_leases(&d1).await, 1.0);
    next(&mut prompt, &got, 1);

    // Turn 2: P pulls turn 1 back from D1, computes only the new tokens, then hands off to D2.
    let body = turn(&prompt, 6);
    let mut pb = prefill_body(api, &body);
    pb["kv_transfer_params"] = kept.clone();
    let at_p = seen(api, post(&p.http, path, &pb).await).await;
    // P's own prefix cache has turn 1's prompt blocks; the rest of what D1 held is pulled.
    assert_eq!(at_p.cached, Some(held(&kept)), "{at_p:?}");
    assert!(at_p.pulled.is_some_and(|n| n > 0), "{at_p:?}");
    let mut db = body.clone();
    db["kv_transfer_params"] = at_p.kv.expect("P hands off");
    let got = seen(api, post(&d2.http, path, &db).await).await;
    assert_eq!(got.tokens, want(prompt.clone()).await.tokens, "turn 2");
    eventually("D1's retained lease released by P's pull", async || {
        metric(&d1, "pd_kv_leases_total{event=\"released\"}").await >= 1.0
    })
    .await;
    let kept = got.kv.clone().expect("D2 retains turn 2");
    assert_eq!(kept["remote_engine_id"], "d2");
    next(&mut prompt, &got, 2);

    // Turn 3: D1 pulls turn 2 from D2 and decodes (a whole request on a non-holder).
    let mut body = turn(&prompt, 6);
    body["kv_transfer_params"] = as_pull(&kept);
    let got = seen(api, post(&d1.http, path, &body).await).await;
    assert_eq!(got.tokens, want(prompt.clone()).await.tokens, "turn 3");
    assert!(
        got.pulled.is_some_and(|n| n > 0),
        "D1 pulled turn 2's new blocks from D2: {got:?}"
    );
    let kept = got.kv.clone().expect("D1 retains turn 3");
    assert_eq!(kept["remote_engine_id"], "d1");
    next(&mut prompt, &got, 3);

    // Turn 4: back on the holder with its own params: its prefix cache has every held block.
    let mut body = turn(&prompt, 6);
    body["kv_transfer_params"] = as_pull(&kept);
    let got = seen(api, post(&d1.http, path, &body).await).await;
    assert_eq!(got.tokens, want(prompt.clone()).await.tokens, "turn 4");
    assert_eq!(
        got.pulled.unwrap_or(0),
        0,
        "nothing to pull on the holder: {got:?}"
    );
    assert!(got.cached.unwrap() >= held(&kept), "{got:?}");
    next(&mut prompt, &got, 4);

    // Turn 5 on D2 (whose cache stops at turn 2), with D1's turn-3 params under a lease id D1
    // never granted (what a client resending stale params carries): D2 reads, the confirm is
    // refused, the prompt is recomputed (under D2's `fail` policy too: a prefix only saves
    // compute), counted, still exact.
    let mut stale = kept.clone();
    stale["remote_lease_id"] = json!("0123456789abcdef0123456789abcdef");
    let mut body = turn(&prompt, 6);
    body["kv_transfer_params"] = as_pull(&stale);
    let before = recomputes(&d2, "lease_expired").await;
    let got = seen(api, post(&d2.http, path, &body).await).await;
    assert_eq!(got.tokens, want(prompt.clone()).await.tokens, "turn 5");
    assert_eq!(got.pulled.unwrap_or(0), 0, "{got:?}");
    assert_eq!(recomputes(&d2, "lease_expired").await, before + 1.0);

    // P holds nothing once its handoff was pulled.
    eventually("P's leases all ended", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
    // Staged nodes copied: D1 and D2 down for their retained turns, P up for its reverse pull
    // (as the blocks landed, from the pull).
    let staged = !extra.is_empty();
    for (node, name) in [
        (&d1, "pd_node_kv_staged_blocks_down_total"),
        (&d2, "pd_node_kv_staged_blocks_down_total"),
        (&p, "pd_kv_landed_blocks_total"),
    ] {
        assert_eq!(metric(node, name).await > 0.0, staged, "{name}");
    }
}

/// Every API, whole and streamed, describes the retained turn in its final
/// `kv_transfer_params` (chat / completions: the chunk finishing the choice; responses: the
/// `response.completed` object); a node without `--kv-retain-after-decode` describes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_returns_the_retained_turn_whole_or_streamed() {
    let dir = model("retain-apis");
    let d = consumer_with(&dir, "fail", &[&["--engine-id", "d1"], RETAIN].concat());
    let plain = consumer_with(&dir, "fail", &["--engine-id", "d2"]);
    let text = "a conversation long enough to fill a few blocks";
    for api in [Api::Completions, Api::Chat, Api::Responses] {
        for body in [api.body(text, 6), streaming(api, &api.body(text, 6))] {
            let got = seen(api, post(&d.http, api.path(), &body).await).await;
            let kv = got.kv.unwrap_or_else(|| panic!("{api:?}: no params"));
            assert_eq!(kv["do_remote_decode"], true, "{api:?} {kv}");
            assert_eq!(kv["remote_engine_id"], "d1");
            let held = kv["remote_num_tokens"].as_u64().unwrap();
            let prompt = got.prompt.unwrap();
            // Whole blocks of prompt + 6 generated, the last one without KV.
            assert_eq!(held, (prompt + 5) / 4 * 4, "{api:?} {kv}");
            assert_eq!(
                kv["remote_block_ids"].as_array().unwrap().len() as u64,
                held / 4
            );
            let got = seen(api, post(&plain.http, api.path(), &body).await).await;
            assert_eq!(got.kv, None, "{api:?}: nothing retained");
        }
    }
    assert_eq!(retained_leases(&d).await, 6.0);
}

/// The rates a policy weighs a pull against a recompute with: P's prefill tokens per second
/// (moving average over its prefill steps) and D's pull bandwidth (over pulls of 4 MiB and
/// more), both measured on real work and exported (and streamed to a gateway in `NodeState`).
/// A model with more KV per token than the others (8 KiB: 8 layers of 4 KV heads of 32), so
/// 1000 tokens make a pull that counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_rate_and_pull_bandwidth_are_measured() {
    let dir = model_spec(
        "rates",
        &TinySpec {
            seed: 21,
            layers: 8,
            hidden: 256,
            heads: 8,
            kv_heads: 4,
            intermediate: 256,
            ..TinySpec::default()
        },
    );
    let blocks = ["--num-gpu-blocks", "2048"];
    let p = producer(
        &dir,
        &[&["--kv-recompute-threshold", "0"], &blocks[..]].concat(),
    );
    let d = consumer_with(&dir, "fail", &blocks);
    assert_eq!(metric(&p, "pd_node_prefill_tokens_per_second").await, 0.0);
    assert_eq!(metric(&d, "pd_kv_pull_bytes_per_second").await, 0.0);
    // 1000 prompt tokens: P computes them in steps of at least 32; D pulls their KV at once.
    let prompt: Vec<u64> = (0..1000).map(|i| 1 + (i * 7) % 400).collect();
    let api = Api::Completions;
    let body = turn(&prompt, 2);
    let mut db = body.clone();
    db["kv_transfer_params"] = seen(
        api,
        post(&p.http, api.path(), &prefill_body(api, &body)).await,
    )
    .await
    .kv
    .expect("P hands off");
    let got = seen(api, post(&d.http, api.path(), &db).await).await;
    assert!(got.pulled.is_some_and(|n| n > 0), "{got:?}");
    let kv_bytes = metric(&d, "pd_kv_transfer_bytes_total").await;
    assert!(
        kv_bytes >= pd_kv_transfer::metrics::PULL_RATE_MIN_BYTES as f64,
        "pulled {kv_bytes} bytes"
    );
    assert!(metric(&p, "pd_node_prefill_tokens_per_second").await > 0.0);
    assert!(metric(&d, "pd_kv_pull_bytes_per_second").await > 0.0);
}

/// Issue 13 with issue 10: a conversation between nodes whose blocks differ (P: blocks of 16,
/// `hnd`; D: blocks of 32, `nhd`, the GPU layout). Turn 1 goes P→D; D retains it in its own
/// blocks of 32; for turn 2, P pulls the part its own cache lacks back from the middle of D's
/// block (converting 32 `nhd` → 16 `hnd`), computes the rest, and hands off to D again
/// (16 `hnd` → 32 `nhd`). Both turns equal one node's output token for token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_between_nodes_with_other_blocks_equals_one_node() {
    let dir = model("multi-turn-hetero");
    let solo = start(&dir, &["--block-size", "16"]);
    let p = producer(
        &dir,
        &[
            "--engine-id",
            "p16",
            "--block-size",
            "16",
            "--kv-recompute-threshold",
            "0",
        ],
    );
    let d = consumer_with(
        &dir,
        "fail",
        &[
            &[
                "--engine-id",
                "d32n",
                "--block-size",
                "32",
                "--kv-layout",
                "nhd",
            ],
            RETAIN,
        ]
        .concat(),
    );
    let api = Api::Completions;
    let path = api.path();
    // 50 prompt tokens and 20 generated: D holds 64 (two blocks of 32), P's cache 48 (three
    // of 16) of the next prompt, so P pulls tokens 48..64, the second half of D's block 1.
    let mut prompt: Vec<u64> = (0..50).map(|i| 3 + (i * 29) % 400).collect();
    let want = |prompt: Vec<u64>| {
        let solo = &solo;
        async move { seen(api, post(&solo.http, path, &turn(&prompt, 20)).await).await }
    };
    let body = turn(&prompt, 20);
    let mut db = body.clone();
    db["kv_transfer_params"] = seen(api, post(&p.http, path, &prefill_body(api, &body)).await)
        .await
        .kv
        .unwrap();
    let got = seen(api, post(&d.http, path, &db).await).await;
    assert_eq!(got.tokens, want(prompt.clone()).await.tokens, "turn 1");
    assert!(got.pulled.is_some_and(|n| n > 0), "{got:?}");
    let kept = got.kv.clone().expect("D describes the retained turn");
    assert_eq!(kept["remote_block_size"], 32, "{kept}");
    assert_eq!(held(&kept), 64, "{kept}");
    prompt.extend(&got.tokens[0]);
    prompt.extend(user(1));

    let body = turn(&prompt, 20);
    let mut pb = prefill_body(api, &body);
    pb["kv_transfer_params"] = kept;
    let at_p = seen(api, post(&p.http, path, &pb).await).await;
    assert_eq!(at_p.cached, Some(64), "{at_p:?}");
    assert_eq!(at_p.pulled, Some(16), "{at_p:?}");
    let mut db = body.clone();
    db["kv_transfer_params"] = at_p.kv.expect("P hands off");
    let got = seen(api, post(&d.http, path, &db).await).await;
    assert_eq!(got.tokens, want(prompt.clone()).await.tokens, "turn 2");
    assert!(got.pulled.is_some_and(|n| n > 0), "{got:?}");
    assert_eq!(metric(&p, "pd_kv_rechunked_pulls_total").await, 1.0);
    assert_eq!(metric(&d, "pd_kv_rechunked_pulls_total").await, 2.0);
}
