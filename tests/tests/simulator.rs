//! The node simulator (`pd-node-sim`, a benchmark instrument) behind a real gateway: its
//! registration and protocol are the real ones, so the gateway routes to simulated nodes as to
//! real ones.
//!
//! Two simulated prefill and two decode nodes in one process register with a real
//! `pd-gateway`; chat and completions, streamed and not, `n = 2`, go P → D through the WASM
//! least-loaded policy, and each answer is what a simulated node answers for the same prompt
//! ids alone. The simulator's counters show the handoffs and pulls (no whole-request
//! fallback), and every lease P granted was released by the pull.

use std::process::Command;
use std::time::Duration;

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{CLUSTER_TOKEN, Gateway, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::metrics::scrape;
use pd_cluster_tests::openai::{self, Api};
use pd_cluster_tests::process::{Proc, WorkDir};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_gateway_routes_p_to_d_through_simulated_nodes() {
    let dir = WorkDir::new("simulator");
    let policy = bins::policy("least-loaded").display().to_string();
    let gw = Gateway::start(&dir, &args(&["--policy", &policy]));
    let mut cmd = Command::new(bins::pd_node_sim());
    cmd.args(["--gateway", &gw.registry, "--prefill", "2", "--decode", "2"])
        .args(["--tpot-ms", "1", "--cluster-token", CLUSTER_TOKEN]);
    let mut sim = Proc::spawn("pd-node-sim", cmd, dir.path());
    sim.wait_line("pd-node-sim: 4 nodes registered", Duration::from_secs(30));
    let client = reqwest::Client::new();
    let nodes = || async {
        let v: Value = client
            .get(format!("{}/admin/nodes", gw.admin))
            .bearer_auth(pd_cluster_tests::cluster::ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["nodes"].as_array().cloned().unwrap_or_default()
    };
    eventually(
        "four routable simulated nodes",
        Duration::from_secs(20),
        async || {
            let n = nodes().await;
            n.len() == 4 && n.iter().all(|n| n["routable"] == true)
        },
    )
    .await;
    let listed = nodes().await;
    let addr_of = |role: &str| -> Vec<String> {
        listed
            .iter()
            .filter(|n| n["role"] == role)
            .map(|n| format!("http://{}", n["http_addr"].as_str().unwrap()))
            .collect()
    };
    let (p_addrs, d_addrs) = (addr_of("prefill"), addr_of("decode"));
    assert_eq!((p_addrs.len(), d_addrs.len()), (2, 2), "{listed:?}");

    let cases = [
        (
            Api::Chat,
            json!({"messages": [{"role": "user", "content": "Where do blocks go?"}]}),
        ),
        (
            Api::Completions,
            json!({"prompt": "The gateway splits every request in two"}),
        ),
    ];
    let mut answers = 0;
    for (api, base) in cases {
        // The ids the gateway sends the nodes: its own tokenizer endpoint's.
        let tokenized: Value = client
            .post(format!("{}/tokenize", gw.http))
            .json(&base)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let ids = tokenized["tokens"].clone();
        assert!(ids.as_array().is_some_and(|t| !t.is_empty()), "{tokenized}");
        for stream in [false, true] {
            let mut body = base.clone();
            body["model"] = json!("sim");
            body["max_tokens"] = json!(7);
            body["n"] = json!(2);
            body["stream"] = json!(stream);
            let split = openai::send(&client, &gw.http, api, &body, None).await.ok();
            let mut alone = body.clone();
            alone["prompt_token_ids"] = ids.clone();
            alone["stream"] = json!(false);
            let whole = openai::send(&client, &d_addrs[0], api, &alone, None)
                .await
                .ok();
            assert_eq!(split.texts, whole.texts, "{api:?} stream={stream}");
            assert_eq!(split.texts.len(), 2);
            assert!(split.texts[0].split(' ').count() > 7, "{:?}", split.texts);
            answers += 1;
        }
    }

    // The real path ran: every split answer was a handoff on P and a pull on D.
    let sum = |addrs: &[String], work: &str| {
        let addrs = addrs.to_vec();
        let client = client.clone();
        let work = work.to_owned();
        async move {
            let mut total = 0.0;
            for a in &addrs {
                total += scrape(&client, a)
                    .await
                    .sum("pd_sim_requests_total", &[("work", &work)]);
            }
            total
        }
    };
    assert_eq!(sum(&p_addrs, "handoff").await, f64::from(answers));
    assert_eq!(sum(&d_addrs, "pull").await, f64::from(answers));
    assert_eq!(sum(&p_addrs, "whole").await, 0.0);
    let mut live = 0.0;
    for a in &p_addrs {
        live += scrape(&client, a).await.sum("pd_sim_leases_live", &[]);
    }
    assert_eq!(live, 0.0, "every lease was released by its pull");
    let gm = scrape(&client, &gw.http).await;
    assert_eq!(gm.sum("pd_gateway_policy_fallbacks_total", &[]), 0.0);
    assert!(gm.sum("pd_gateway_policy_decisions_total", &[]) >= f64::from(answers));
}
