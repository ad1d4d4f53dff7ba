//! Two gateways, P and D reporting to both:
//! - across hosts (each process on a harness host of its own), behind a real Envoy (round
//!   robin, retried on a refused or reset connection): one gateway killed with `SIGKILL` under
//!   streaming load: only requests it was serving fail, each with an error and none hanging past
//!   a bound; everything after goes through the other; the prefill node releases the dead
//!   gateway's leases at once;
//! - sharing one PostgreSQL state store (on this machine): a `/v1/responses` conversation whose
//!   turns alternate between the gateways equals one node given the whole conversation, token
//!   for token.

use std::time::{Duration, Instant};

use pd_cluster_tests::cluster::{Node, SeveralGateways, SeveralSpec, args};
use pd_cluster_tests::envoy::Envoy;
use pd_cluster_tests::eventually;
use pd_cluster_tests::load::Load;
use pd_cluster_tests::openai::response_text;
use pd_cluster_tests::postgres::PgServer;
use pd_cluster_tests::process::WorkDir;
use serde_json::{Value, json};

/// Load clients, and the requests each sends at most.
const CLIENTS: usize = 4;
const MAX_PER_CLIENT: usize = 400;
/// No request may take longer than this, the kill included.
const BOUND: Duration = Duration::from_secs(60);

async fn start(name: &str, pg: &PgServer) -> SeveralGateways {
    SeveralGateways::start(
        name,
        SeveralSpec {
            gateways: 2,
            prefill: 1,
            decode: 1,
            gateway_args: args(&["--state-url", &pg.url]),
            ..SeveralSpec::default()
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_under_load_behind_envoy_fails_only_its_own_requests() {
    let work = WorkDir::new("failover-envoy");
    let mut c = SeveralGateways::start_on_hosts(
        "failover",
        SeveralSpec {
            gateways: 2,
            prefill: 1,
            decode: 1,
            ..SeveralSpec::default()
        },
    )
    .await;
    // Envoy here, the gateways on their hosts.
    let envoy = Envoy::start(work.path(), &c.upstreams());
    let load = Load::start(&envoy.http, CLIENTS, MAX_PER_CLIENT, "Failing over.");
    eventually("requests through both gateways", BOUND, async || {
        load.done() >= 20
    })
    .await;

    let killed_at = Instant::now();
    c.gateways[0].proc.kill_and_wait();
    let before = load.done();
    eventually("a first answer after the kill", BOUND, async || {
        load.done() > before
    })
    .await;
    let first = killed_at.elapsed();
    eventually(
        "requests through the surviving gateway",
        BOUND,
        async || load.done() >= before + 40,
    )
    .await;
    let recovered = killed_at.elapsed();
    let outcome = tokio::time::timeout(BOUND, load.stop())
        .await
        .expect("no request hung past the bound");
    println!(
        "failover: {} ok, {} failed, {first:?} from the kill to the next answer, {recovered:?} to 40 more",
        outcome.ok,
        outcome.failed.len()
    );
    // Only what the killed gateway was serving fails: at most one request per client.
    assert!(
        outcome.failed.len() <= CLIENTS,
        "{} failed: {:#?}",
        outcome.failed.len(),
        outcome.failed
    );
    assert!(outcome.ok >= 60, "{outcome:?}");

    // The prefill node saw the dead gateway's stream end: nothing of it waits for a deadline.
    let p = c
        .nodes
        .iter()
        .find(|n| n.engine_id.starts_with('p'))
        .expect("P");
    let p_id = p.engine_id.clone();
    eventually("no live lease on P", Duration::from_secs(10), async || {
        c.node_metrics(&p_id).await.sum("pd_kv_leases_live", &[]) == 0.0
    })
    .await;
    let m = c.node_metrics(&p_id).await;
    assert_eq!(
        m.sum("pd_kv_leases_total", &[("event", "expired")]),
        0.0,
        "{}",
        m.show("pd_kv_leases_total")
    );

    // Envoy saw the refusals and sent everything after to the other gateway.
    let stats = reqwest::get(format!(
        "{}/stats?filter=upstream_rq_retry|outlier",
        envoy.admin
    ))
    .await
    .expect("Envoy's stats")
    .text()
    .await
    .expect("text");
    println!("{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_alternating_between_gateways_equals_one_node() {
    let work = WorkDir::new("alternate-pg");
    let pg = PgServer::start(work.path());
    let c = start("alternate", &pg).await;
    let reference = Node::reference(c.dir(), &c.model);
    let users = [
        "Name three rivers of Europe.",
        "Which is the longest?",
        "And the shortest?",
        "Thank you.",
    ];
    let mut parent: Option<String> = None;
    let mut history: Vec<Value> = Vec::new();
    for (turn, user) in users.iter().enumerate() {
        let g = &c.gateways[turn % 2];
        let mut body = json!({"model": "tiny", "input": user, "max_output_tokens": 8,
                              "temperature": 0});
        if let Some(p) = &parent {
            body["previous_response_id"] = json!(p);
        }
        let resp = c
            .client
            .post(format!("{}/v1/responses", g.http))
            .json(&body)
            .send()
            .await
            .expect("a turn");
        assert_eq!(resp.status().as_u16(), 200, "turn {turn}");
        let got: Value = resp.json().await.expect("JSON");
        history.push(json!({"role": "user", "content": user}));
        let want: Value = c
            .client
            .post(format!("{}/v1/responses", reference.http))
            .json(
                &json!({"model": "tiny", "input": history, "max_output_tokens": 8,
                          "temperature": 0}),
            )
            .send()
            .await
            .expect("the reference")
            .json()
            .await
            .expect("JSON");
        assert_eq!(
            response_text(&got),
            response_text(&want),
            "turn {turn} through gateway {}",
            turn % 2
        );
        history.push(json!({"role": "assistant", "content": response_text(&got)}));
        parent = got["id"].as_str().map(str::to_owned);
    }
}
