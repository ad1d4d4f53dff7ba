//! `pd-node serve --gateway A,B`: the real node binary reports to two (test) registries at
//! once, and the leases a prefill node grants follow the gateway whose request asked for them
//! (`x-pd-gateway-id`): when that gateway's stream ends, they are released (counted in
//! `pd_kv_leases_total{event="gateway_left"}`), and nobody else's are.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pd_model::tiny::{TinySpec, generate};
use pd_report::test_registry::{TestRegistry, TestRegistryOptions};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every sample of `/metrics` whose name (with labels, as printed) is `sample`; 0 when absent.
async fn metric(http: &str, sample: &str) -> f64 {
    let text = reqwest::get(format!("{http}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == sample).then(|| value.parse().unwrap())
        })
        .unwrap_or(0.0)
}

async fn wait_metric(http: &str, sample: &str, want: f64) {
    let start = Instant::now();
    loop {
        let got = metric(http, sample).await;
        if got == want {
            return;
        }
        assert!(start.elapsed() < WAIT, "{sample} is {got}, not {want}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A prefill for a decode node that never comes, through `gateway` (its `x-pd-gateway-id`).
async fn prefill(http: &str, prompt: &str, gateway: Option<&str>) {
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true}});
    let mut req = reqwest::Client::new()
        .post(format!("{http}/v1/completions"))
        .json(&body);
    if let Some(g) = gateway {
        req = req.header("x-pd-gateway-id", g);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["kv_transfer_params"]["remote_lease_id"].is_string(),
        "a lease: {v}"
    );
}

async fn registry(id: &str) -> TestRegistry {
    TestRegistry::start_with(
        "127.0.0.1:0".parse::<SocketAddr>().unwrap(),
        TestRegistryOptions {
            gateway_id: id.to_string(),
            state_interval_ms: 50,
            ..TestRegistryOptions::default()
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_nodes_leases_follow_the_gateway_that_asked_for_them() {
    let dir = std::env::temp_dir().join(format!("pd-gateways-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    generate(&TinySpec::default(), &dir).unwrap();
    let (g1, g2) = (registry("gw-one").await, registry("gw-two").await);

    let mut child = Command::new(env!("CARGO_BIN_EXE_pd-node"))
        .arg("serve")
        .arg("--model")
        .arg(&dir)
        .args([
            "--port",
            "0",
            "--block-size",
            "4",
            "--num-gpu-blocks",
            "128",
        ])
        .args(["--served-model-name", "tiny", "--kv-role", "kv_producer"])
        .args(["--kv-port", "0", "--engine-id", "p-two-gateways"])
        // Leases outlive the test: only the gateway leaving can end them.
        .args(["--kv-lease-duration", "600"])
        .args(["--gateway", &format!("{},{}", g1.addr(), g2.addr())])
        .env("PD_CLUSTER_TOKEN", "s3cret")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let _node = Node(child);
    let http = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "pd-node exited");
        if let Some(a) = line.trim().strip_prefix("pd-node listening on ") {
            break a.to_string();
        }
    };

    // Both registries hear from the node.
    for g in [&g1, &g2] {
        let conns = g
            .log()
            .wait_for(WAIT, |c| c.iter().any(|c| c.register().is_some()))
            .await
            .unwrap();
        assert_eq!(conns[0].register().unwrap().engine_id, "p-two-gateways");
    }

    // A lease for each gateway, one untagged (no header), one whose header is too long.
    prefill(&http, "A prompt through gateway one.", Some("gw-one")).await;
    prefill(&http, "A prompt through gateway two.", Some("gw-two")).await;
    prefill(&http, "A prompt from no gateway at all.", None).await;
    let long = "gw-one".repeat(30);
    prefill(&http, "A prompt with an overlong gateway id.", Some(&long)).await;
    wait_metric(&http, "pd_kv_leases_live", 4.0).await;
    assert_eq!(
        metric(&http, "pd_kv_leases_total{event=\"gateway_left\"}").await,
        0.0
    );

    // Gateway one goes away: its lease, and only its, is released at once.
    let _ = g1.stop().await.unwrap();
    wait_metric(&http, "pd_kv_leases_live", 3.0).await;
    assert_eq!(
        metric(&http, "pd_kv_leases_total{event=\"gateway_left\"}").await,
        1.0
    );
    assert_eq!(
        metric(&http, "pd_kv_leases_total{event=\"released\"}").await,
        1.0
    );
    assert_eq!(
        metric(&http, "pd_kv_leases_total{event=\"expired\"}").await,
        0.0
    );
    // The other registry still has the node, whose state shows three live leases.
    g2.log()
        .wait_for(WAIT, |c| {
            c.len() == 1
                && c[0].end.is_none()
                && c[0]
                    .states()
                    .last()
                    .is_some_and(|s| s.leases.is_some_and(|l| l.live == 3))
        })
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
