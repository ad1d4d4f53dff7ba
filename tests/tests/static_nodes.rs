//! Nodes that speak only vLLM's protocol behind the gateway (DESIGN §5, "interop both ways"):
//! a prefill and a decode `pd-node` started without `--gateway`, so they never register, and
//! given to the gateway with `--static-node` — as a vLLM P/D pair would be. The gateway learns
//! their model from `/v1/models` and their load from their `/metrics` under vLLM's names, and
//! drives them over their OpenAI API with `kv_transfer_params` only.
//!
//! 1. Both join the view with their pool's size read from `vllm:cache_config_info`.
//! 2. Every API, streamed and not, goes P → D through the WASM policy, token for token what a
//!    standalone node answers, every answer showing the prompt's KV pulled from P (no silent
//!    recompute), no policy fallback.
//! 3. The view follows their load: a request held on D shows in `/admin/nodes`.
//! 4. A static node that stops answering (`SIGSTOP`) leaves the view after the node timeout and
//!    comes back by itself once it answers again.

use std::time::Duration;

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{ClusterSpec, NUM_BLOCKS, Node, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Api};

const NODE_TIMEOUT_MS: u64 = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_do_not_register_serve_p_to_d_through_the_gateway() {
    let policy = bins::policy("least-loaded");
    let c = TestCluster::start_static(
        "static_nodes",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args: args(&[
                "--policy",
                &policy.display().to_string(),
                "--node-timeout-ms",
                &NODE_TIMEOUT_MS.to_string(),
                "--static-scrape-ms",
                "100",
            ]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let reference = Node::reference(c.dir(), &c.model);

    // 1. In the view, sized from their metrics.
    for n in c.admin_nodes().await {
        assert_eq!(n["source"], "static", "{n}");
        assert_eq!(n["total_blocks"], NUM_BLOCKS, "{n}");
        assert_eq!(
            n["free_blocks"], NUM_BLOCKS,
            "an idle pool is all free: {n}"
        );
    }
    let models: serde_json::Value = c
        .client
        .get(format!("{}/v1/models", c.gateway.http))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], openai::MODEL, "{models}");

    // 2. Every API, streamed and not, P → D, token-exact.
    let mut requests = 0.0;
    for api in Api::ALL {
        for stream in [false, true] {
            let body = api.body(
                &format!(
                    "{} static nodes answer {stream} like any other",
                    api.label()
                ),
                8,
            );
            let body = if stream { api.streaming(&body) } else { body };
            let got = openai::send(&c.client, &c.gateway.http, api, &body, None)
                .await
                .ok();
            let want = openai::send(&c.client, &reference.http, api, &body, None)
                .await
                .ok();
            assert_eq!(got.texts, want.texts, "{api:?} stream={stream}");
            assert_eq!(got.prompt_tokens, want.prompt_tokens);
            let pulled = got.pulled_tokens.unwrap_or(0);
            assert!(
                pulled > 0 && pulled <= got.prompt_tokens.unwrap_or(0),
                "{api:?} stream={stream}: D pulled {pulled} of {:?} prompt tokens: {}",
                got.prompt_tokens,
                got.body
            );
            requests += 1.0;
        }
    }
    let gw = c.gateway_metrics().await;
    assert_eq!(
        gw.sum("pd_gateway_requests_total", &[("outcome", "ok")]),
        requests
    );
    assert_eq!(gw.sum("pd_gateway_policy_fallbacks_total", &[]), 0.0);
    // The WASM policy decided every one (the native fallback's version label is `native`).
    assert_eq!(
        gw.sum_except("pd_gateway_policy_decisions_total", "version", "native"),
        requests,
        "{}",
        gw.show("pd_gateway_policy_decisions_total")
    );
    let p = c.node_metrics("p0").await;
    let d = c.node_metrics("d0").await;
    assert_eq!(
        p.sum(
            "pd_node_kv_params_requests_total",
            &[("directive", "produce")]
        ),
        requests,
        "every request prefilled on P"
    );
    assert_eq!(
        d.sum(
            "pd_node_kv_params_requests_total",
            &[("directive", "consume")]
        ),
        requests,
        "every request decoded on D"
    );
    assert_eq!(
        d.sum("pd_kv_recompute_total", &[]),
        0.0,
        "nothing recomputed"
    );

    // 3. The view follows D's load: a long stream held open shows as running there.
    let api = Api::Completions;
    // Near the tiny model's 2048-token context: it cannot finish before a scrape sees it.
    let long = api.streaming(&api.body("hold the decode node busy for a while", 1900));
    let mut held = c
        .client
        .post(format!("{}{}", c.gateway.http, api.path()))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(held.status().as_u16(), 200);
    held.chunk().await.unwrap().expect("a first chunk");
    eventually(
        "the held request running on d0 in /admin/nodes",
        Duration::from_secs(5),
        async || {
            let nodes = c.admin_nodes().await;
            let d = nodes.iter().find(|n| n["engine_id"] == "d0").expect("d0");
            d["running"].as_u64().unwrap_or(0) >= 1
                && d["free_blocks"].as_u64().unwrap_or(0) < u64::from(NUM_BLOCKS)
        },
    )
    .await;
    drop(held);

    // 4. Silent → out of the view; answering again → back, and served.
    c.node("p0").proc.signal(libc::SIGSTOP);
    c.wait_unlisted("p0", Duration::from_millis(NODE_TIMEOUT_MS + 3000))
        .await;
    c.node("p0").proc.signal(libc::SIGCONT);
    c.wait_listed(&["p0", "d0"], Duration::from_secs(10)).await;
    let body = Api::Chat.body("back in the view", 4);
    let got = openai::send(&c.client, &c.gateway.http, Api::Chat, &body, None)
        .await
        .ok();
    let want = openai::send(&c.client, &reference.http, Api::Chat, &body, None)
        .await
        .ok();
    assert_eq!(got.texts, want.texts);
    assert!(got.pulled_tokens.unwrap_or(0) > 0, "{}", got.body);
}

/// The cluster token never goes to a static node unless the operator says so: two standalone
/// nodes whose `--api-key` is the cluster token itself (so a node that is sent the token lets
/// the gateway in). The one named without a bearer is refused every scrape (401) and never
/// joins the view; the one named `bearer=cluster-token` joins and serves. On the old gateway,
/// which sent every node the cluster token, both joined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_node_is_not_sent_the_cluster_token_unless_told() {
    let dir = pd_cluster_tests::process::WorkDir::new("static_bearer");
    let model = pd_cluster_tests::cluster::tiny_model(&dir);
    let key = args(&["--api-key", pd_cluster_tests::cluster::CLUSTER_TOKEN]);
    let unnamed = Node::reference_with(&dir, &model, &key);
    let told = Node::reference_with(&dir, &model, &key);
    let spec = |n: &Node, id: &str, bearer: &str| {
        format!(
            "role=standalone,url={},tokenizer={},engine-id={id}{bearer}",
            n.http,
            model.display()
        )
    };
    let gateway = pd_cluster_tests::cluster::Gateway::start(
        &dir,
        &[
            "--static-scrape-ms".into(),
            "100".into(),
            "--static-node".into(),
            spec(&unnamed, "unnamed", ""),
            "--static-node".into(),
            spec(&told, "told", ",bearer=cluster-token"),
        ],
    );
    let client = reqwest::Client::new();
    let listed = || async {
        let v: serde_json::Value = client
            .get(format!("{}/admin/nodes", gateway.admin))
            .bearer_auth(pd_cluster_tests::cluster::ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let mut ids: Vec<String> = v["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n["engine_id"].as_str().map(str::to_owned))
            .collect();
        ids.sort();
        ids
    };
    eventually(
        "only `told` in the view",
        Duration::from_secs(20),
        async || listed().await == ["told"],
    )
    .await;
    // Scrapes keep coming (every 100 ms), and the unnamed node stays out.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(listed().await, ["told"], "{}", gateway.proc.log_tail(10));
    assert!(
        gateway.proc.log().contains("401"),
        "the unnamed node was not refused: {}",
        gateway.proc.log_tail(10)
    );
    let a = openai::send(
        &client,
        &gateway.http,
        Api::Chat,
        &Api::Chat.body("told", 3),
        None,
    )
    .await
    .ok();
    assert_eq!(a.texts.len(), 1, "{a:?}");
}
