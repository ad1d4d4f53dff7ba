//! Issue 45: a decode node uses pulled KV only for the prompt it was computed for, and the
//! prompt's binding (`remote_prompt_hash`, and the lease's attested contents) is what says so.
//! Nodes drive P and D directly with `kv_transfer_params` (the gateway only lists them).
//!
//! 1. Nodes started with `PD_INSECURE_BINDING_BITS=16` (a debug build's weakening: unkeyed, 16
//!    bits) let the attack through. The test finds two prompts A and B of one length that bind
//!    alike, offline, with the nodes' own `pd_kv_pool::prompt_binding`; prefills A on P; and
//!    sends B to D with A's params. D pulls (its pull counter grows) and answers B with A's
//!    tokens, not B's; and it caches A's KV under B's block hashes: a later plain B on D hits
//!    the prefix cache and answers the same wrong tokens.
//! 2. The same pair on nodes with the real binding (HMAC under the cluster token, 128 bits): D
//!    refuses A's params for B (400 naming `remote_prompt_hash`) and pulls nothing, and B is
//!    answered right; A's own params still pull.

use std::collections::HashMap;

use pd_cluster_tests::cluster::{CLUSTER_TOKEN, ClusterSpec, Node, TestCluster};
use pd_cluster_tests::openai::MODEL;
use pd_kv_pool::{BindingKey, prompt_binding};
use serde_json::{Value, json};

/// Tokens per block (the nodes' default `--block-size`).
const BLOCK: usize = 16;
/// The prompts' length: two full blocks (cached, and pulled) and one token after them.
const LEN: usize = 2 * BLOCK + 1;
/// Tokens each answer generates.
const MAX_TOKENS: u32 = 8;

/// A prompt of [`LEN`] token ids: `x` and `y`, then the same bytes for every prompt. Two
/// prompts differ in their first block only, so an answer decoded on the other's KV is the
/// other's answer.
fn prompt(x: u32, y: u32) -> Vec<u32> {
    let common = (0..LEN as u32 - 2).map(|i| 97 + (i * 7) % 26);
    [x, y].into_iter().chain(common).collect()
}

/// Two prompts.
type Pair = (Vec<u32>, Vec<u32>);

/// Pairs of distinct prompts whose bindings under `key` are equal, by a birthday search over
/// the first two tokens (byte ids 1..=255), and how many prompts it tried.
fn colliding_pairs(key: &BindingKey, want: usize) -> (Vec<Pair>, usize) {
    let mut seen: HashMap<u128, Vec<u32>> = HashMap::new();
    let mut pairs = Vec::new();
    let mut tried = 0;
    'search: for x in 1..=255 {
        for y in 1..=255 {
            let p = prompt(x, y);
            tried += 1;
            if let Some(other) = seen.insert(prompt_binding(key, &p), p.clone()) {
                pairs.push((other, p));
                if pairs.len() == want {
                    break 'search;
                }
            }
        }
    }
    (pairs, tried)
}

/// Posts a greedy completion of `prompt` (token ids) to `node`, with `params` as its
/// `kv_transfer_params`; returns the status and the body.
async fn complete(
    client: &reqwest::Client,
    node: &Node,
    prompt: &[u32],
    max_tokens: u32,
    params: Option<Value>,
) -> (u16, Value) {
    let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    if let Some(p) = params {
        body["kv_transfer_params"] = p;
    }
    let url = format!("{}/v1/completions", node.http);
    let resp = client
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// A 200 answer's generated token ids.
#[track_caller]
fn tokens((status, v): &(u16, Value)) -> Vec<u64> {
    assert_eq!(*status, 200, "{v}");
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids: {v}"))
        .iter()
        .filter_map(Value::as_u64)
        .collect()
}

/// `usage.prompt_tokens_details.<field>` of an answer (0 when absent).
fn usage(v: &Value, field: &str) -> u64 {
    v["usage"]["prompt_tokens_details"][field]
        .as_u64()
        .unwrap_or(0)
}

/// P's handoff params for `prompt` (a prefill asked for `do_remote_decode`).
async fn prefill(client: &reqwest::Client, p: &Node, prompt: &[u32]) -> Value {
    let params = Some(json!({"do_remote_decode": true}));
    let (status, v) = complete(client, p, prompt, 1, params).await;
    assert_eq!(status, 200, "P's prefill: {v}");
    assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], true, "{v}");
    v["kv_transfer_params"].clone()
}

/// A node's counter `name` (summed over its labels).
async fn counter(client: &reqwest::Client, node: &Node, name: &str) -> f64 {
    node.metrics(client).await.sum(name, &[])
}

const PULLS: &str = "pd_kv_pulls_total";
const HITS: &str = "pd_node_prefix_cache_hits_total";

#[tokio::test(flavor = "multi_thread")]
async fn a_forgeable_binding_poisons_decode_and_the_keyed_one_refuses() {
    let started = std::time::Instant::now();
    let weak_key = BindingKey::insecure_unkeyed(16).expect("16 bits");
    // 1. The weakened build: P, D, and a standalone node for the reference answers.
    let weak = TestCluster::start_static(
        "prompt-binding-weak",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            standalone: 1,
            node_env: vec![("PD_INSECURE_BINDING_BITS".into(), "16".into())],
            ..ClusterSpec::default()
        },
    )
    .await;
    let client = &weak.client;
    let (p, d, reference) = (weak.node("p0"), weak.node("d0"), weak.node("s0"));
    for n in [p, d] {
        assert!(
            n.proc.log().contains("PD_INSECURE_BINDING_BITS is set"),
            "{} did not weaken its binding:\n{}",
            n.engine_id,
            n.proc.log_tail(20)
        );
    }
    // Offline: pairs that bind alike; the first whose right answers differ.
    let (pairs, tried) = colliding_pairs(&weak_key, 8);
    let mut chosen = None;
    for (a, b) in pairs {
        let ref_a = tokens(&complete(client, reference, &a, MAX_TOKENS, None).await);
        let ref_b = tokens(&complete(client, reference, &b, MAX_TOKENS, None).await);
        if ref_a != ref_b {
            chosen = Some((a, b, ref_a, ref_b));
            break;
        }
    }
    let (a, b, ref_a, ref_b) = chosen.expect("a colliding pair whose answers differ");
    let binding = prompt_binding(&weak_key, &a);
    assert_eq!(binding, prompt_binding(&weak_key, &b));
    println!(
        "16-bit collision after {tried} prompts: A {:?}.., B {:?}.. bind to {binding:#06x}; \
         right answers A {ref_a:?}, B {ref_b:?}",
        &a[..2],
        &b[..2]
    );

    let params = prefill(client, p, &a).await;
    // The test computed exactly what the node put on the wire.
    assert_eq!(
        params["remote_prompt_hash"],
        format!("{binding:032x}"),
        "{params}"
    );
    let (pulls, hits) = (
        counter(client, d, PULLS).await,
        counter(client, d, HITS).await,
    );
    let attacked = complete(client, d, &b, MAX_TOKENS, Some(params)).await;
    let wrong = tokens(&attacked);
    let pulled = counter(client, d, PULLS).await - pulls;
    println!(
        "weak D: B with A's params: {pulled} pull(s), {} tokens pulled, answer {wrong:?}",
        usage(&attacked.1, "kv_pulled_tokens")
    );
    assert_eq!(pulled, 1.0, "D pulled A's KV for B: {}", attacked.1);
    assert_eq!(usage(&attacked.1, "kv_pulled_tokens"), LEN as u64);
    assert_ne!(wrong, ref_b, "B decoded on A's KV is not B's answer");
    assert_eq!(wrong, ref_a, "it is A's");
    // The poisoned cache: a plain B, no params, reuses the blocks pulled for A.
    let later = complete(client, d, &b, MAX_TOKENS, None).await;
    let again = tokens(&later);
    let hit = counter(client, d, HITS).await - hits;
    println!(
        "weak D: plain B later: {hit} prefix-cache hit tokens ({} cached), answer {again:?}",
        usage(&later.1, "cached_tokens")
    );
    assert_eq!(usage(&later.1, "cached_tokens"), 2 * BLOCK as u64);
    assert!(hit >= (2 * BLOCK) as f64, "{hit} hit tokens");
    assert_eq!(again, wrong, "the cache answers B with A's answer");
    assert_eq!(
        counter(client, d, PULLS).await - pulls,
        1.0,
        "no second pull"
    );
    drop(weak);

    // 2. The real build: the binding keyed with the cluster token.
    let real = TestCluster::start_static(
        "prompt-binding-keyed",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            ..ClusterSpec::default()
        },
    )
    .await;
    let client = &real.client;
    let (p, d) = (real.node("p0"), real.node("d0"));
    let params = prefill(client, p, &a).await;
    // Keyed with the cluster token: not what an outsider computes without it.
    let under = |key: &BindingKey| format!("{:032x}", prompt_binding(key, &a));
    assert_eq!(
        params["remote_prompt_hash"],
        under(&BindingKey::from_cluster_token(CLUSTER_TOKEN)),
        "{params}"
    );
    for outsider in [
        BindingKey::from_cluster_token(""),
        BindingKey::insecure_unkeyed(128).expect("128 bits"),
    ] {
        assert_ne!(params["remote_prompt_hash"], under(&outsider), "{params}");
    }
    let failures = counter(client, d, "pd_kv_transfer_failures_total").await;
    let (status, refused) = complete(client, d, &b, MAX_TOKENS, Some(params)).await;
    println!(
        "keyed D: B with A's params: {status} {}",
        refused["error"]["message"]
    );
    assert_eq!(status, 400, "{refused}");
    assert_eq!(
        refused["error"]["param"], "kv_transfer_params.remote_prompt_hash",
        "{refused}"
    );
    assert_eq!(counter(client, d, PULLS).await, 0.0, "D pulled nothing");
    assert_eq!(
        counter(client, d, "pd_kv_transfer_failures_total").await,
        failures
    );
    // B is answered right, from nothing cached.
    let plain = complete(client, d, &b, MAX_TOKENS, None).await;
    assert_eq!(tokens(&plain), ref_b, "B's own answer");
    assert_eq!(usage(&plain.1, "cached_tokens"), 0);
    // A's own params still pull: the refusal was the binding's.
    let params = prefill(client, p, &a).await;
    let own = complete(client, d, &a, MAX_TOKENS, Some(params)).await;
    assert_eq!(tokens(&own), ref_a);
    assert_eq!(counter(client, d, PULLS).await, 1.0, "A's params pulled");
    println!(
        "keyed D: B answered right {:?}, A pulled and right; {:.1} s",
        ref_b,
        started.elapsed().as_secs_f64()
    );
}
