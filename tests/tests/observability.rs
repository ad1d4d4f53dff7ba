//! The observability files of `examples/observability` checked for real (issue 49): a real
//! Prometheus (Debian's package) scrapes a gateway, a prefill and a decode node on loopback
//! every second and evaluates the alert rules; after a few requests (a P/D split, a turn served
//! whole by the node holding its history, a streamed chat, a `/v1/responses` call, an error),
//! every query of every panel of the Grafana dashboard, run through Prometheus' HTTP API,
//! returns at least one series, every metric a panel or an alert names exists, every rule
//! evaluates without error, and every process's exposition passes `promtool check metrics`
//! (vLLM's `vllm:` names aside: they are vLLM's contract, colons and all). `promtool` also
//! checks the rule file, runs its unit tests (`alerts.test.yml`) and checks the example
//! scrape config.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pd_cluster_tests::bins::workspace_root;
use pd_cluster_tests::cluster::{ClusterSpec, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Api};
use pd_cluster_tests::prometheus::{Job, Prometheus, promtool, promtool_with_input};
use serde_json::{Value, json};

/// `examples/observability`.
fn observability() -> PathBuf {
    workspace_root().join("examples/observability")
}

/// Every query of the dashboard: (panel title, refId, expr), rows' nested panels included.
fn panel_targets(panels: &[Value], out: &mut Vec<(String, String, String)>) {
    for p in panels {
        let title = p["title"].as_str().unwrap_or("(untitled)");
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title:?}: a target without expr: {t}"));
            let ref_id = t["refId"].as_str().unwrap_or("?");
            out.push((title.to_owned(), ref_id.to_owned(), expr.to_owned()));
        }
        if let Some(nested) = p["panels"].as_array() {
            panel_targets(nested, out);
        }
    }
}

/// `expr` with Grafana's variables as a dashboard over the last hour replaces them; panics
/// naming any other variable (one the test would not know how to fill).
fn substitute(expr: &str) -> String {
    let mut e = expr.to_owned();
    for (var, value) in [
        ("${__rate_interval}", "1m"),
        ("$__rate_interval", "1m"),
        ("${__interval}", "1s"),
        ("$__interval", "1s"),
        ("${__range}", "1h"),
        ("$__range", "1h"),
    ] {
        e = e.replace(var, value);
    }
    assert!(!e.contains('$'), "an unknown variable in {expr:?}");
    e
}

/// The metric names `expr` reads: the identifiers starting with `pd_` or `vllm:`, and `up`.
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.starts_with("pd_") || t.starts_with("vllm:") || *t == "up")
        .map(str::to_owned)
        .collect()
}

/// The dashboard is provisioning-ready: its data source is the `datasource` variable (type
/// prometheus), which every panel and query uses; ids are unique.
fn check_dashboard_shape(d: &Value) {
    assert!(
        d["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "{}",
        d["schemaVersion"]
    );
    assert_eq!(d["uid"], "pd-serve");
    let vars = d["templating"]["list"].as_array().expect("templating.list");
    assert!(
        vars.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "no `datasource` variable of type prometheus: {vars:?}"
    );
    let mut ids = BTreeSet::new();
    let mut all = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        all.push(p);
        all.extend(p["panels"].as_array().into_iter().flatten());
    }
    for p in all {
        assert!(
            ids.insert(p["id"].as_u64().expect("a panel id")),
            "duplicate id: {p}"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        for t in p["targets"].as_array().expect("targets") {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        }
    }
}

/// `prometheus-kubernetes.yml` as far as Debian's promtool can check it: that Prometheus is
/// built without Kubernetes discovery, so each job's `kubernetes_sd_configs` is swapped for a
/// static target and the rest (relabelling, rule files) checked in `scratch`.
fn check_kubernetes_config(rules_dir: &Path, scratch: &Path) {
    let text = std::fs::read_to_string(rules_dir.join("prometheus-kubernetes.yml"))
        .expect("reading prometheus-kubernetes.yml");
    let discovery =
        "    kubernetes_sd_configs:\n      - role: pod\n        namespaces: {names: [pd]}\n";
    assert_eq!(text.matches(discovery).count(), 2, "each job finds pods");
    let checked = text.replace(
        discovery,
        "    static_configs:\n      - targets: [\"pod.example:8000\"]\n",
    );
    let dir = scratch.join("k8s-config");
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    std::fs::write(dir.join("prometheus.yml"), checked).expect("writing the config");
    std::fs::copy(rules_dir.join("alerts.yml"), dir.join("alerts.yml")).expect("copying");
    promtool_ok(&dir, &["check", "config", "prometheus.yml"]);
}

fn promtool_ok(dir: &Path, args: &[&str]) {
    let (ok, out) = promtool(dir, args);
    assert!(ok, "promtool {}:\n{out}", args.join(" "));
}

async fn post(client: &reqwest::Client, base: &str, path: &str, body: &Value) -> Value {
    let r = client
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .expect("the request is sent");
    let status = r.status();
    let text = r.text().await.expect("the body");
    assert!(status.is_success(), "{path}: {status}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
}

/// A greedy completions request on token ids.
fn turn(prompt: &[u64]) -> Value {
    json!({"model": openai::MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0,
           "ignore_eos": true, "return_token_ids": true})
}

fn token_ids(answer: &Value) -> Vec<u64> {
    answer["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids: {answer}"))
        .iter()
        .map(|t| t.as_u64().expect("a token id"))
        .collect()
}

/// Requests that move the counters the dashboard shows: a P/D split (a pull, a lease), the next
/// turn whole on the decode node that kept the first (a one-node route), a streamed chat, a
/// `/v1/responses` call and a request for a model nobody serves (an error).
async fn traffic(c: &TestCluster) {
    let gw = c.gateway.http.clone();
    let mut prompt: Vec<u64> = (1..=40).collect();
    let first = post(&c.client, &gw, "/v1/completions", &turn(&prompt)).await;
    eventually(
        "the first turn is indexed",
        Duration::from_secs(10),
        async || {
            c.gateway_metrics()
                .await
                .sum("pd_gateway_retained_turns_total", &[])
                == 1.0
        },
    )
    .await;
    prompt.extend(token_ids(&first));
    prompt.extend([41, 42, 43, 44, 45]);
    post(&c.client, &gw, "/v1/completions", &turn(&prompt)).await;
    let chat = Api::Chat;
    let streamed = chat.streaming(&chat.body("Streamed through the gateway.", 8));
    openai::send(&c.client, &gw, chat, &streamed, None)
        .await
        .ok();
    let responses = Api::Responses;
    let body = responses.body("Answered on the Responses API.", 8);
    openai::send(&c.client, &gw, responses, &body, None)
        .await
        .ok();
    let mut unknown = chat.body("A model nobody serves.", 4);
    unknown["model"] = json!("no-such-model");
    let refused = openai::send(&c.client, &gw, chat, &unknown, None).await;
    assert_eq!(refused.status, 404, "{}", refused.body);

    let g = c.gateway_metrics().await;
    for route in ["split", "whole"] {
        assert!(
            g.sum("pd_gateway_routes_total", &[("route", route)]) >= 1.0,
            "no {route} route: {}",
            g.show("pd_gateway_routes_total")
        );
    }
}

/// Every problem `promtool check metrics` finds in `text` but those about vLLM's names.
fn lint(dir: &Path, text: &[u8]) -> Vec<String> {
    let (_, out) = promtool_with_input(dir, &["check", "metrics"], Some(text));
    out.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("vllm:"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_and_alert_reads_a_live_cluster() {
    let files = observability();
    let rules_dir = files.join("prometheus");
    promtool_ok(&rules_dir, &["check", "rules", "alerts.yml"]);
    promtool_ok(&rules_dir, &["test", "rules", "alerts.test.yml"]);
    promtool_ok(&rules_dir, &["check", "config", "prometheus.yml"]);
    let dashboard_path = files.join("grafana/dashboards/pd-serve.json");
    let dashboard: Value =
        serde_json::from_slice(&std::fs::read(&dashboard_path).expect("reading the dashboard"))
            .expect("the dashboard is JSON");
    check_dashboard_shape(&dashboard);
    let mut targets = Vec::new();
    panel_targets(
        dashboard["panels"].as_array().expect("panels"),
        &mut targets,
    );
    assert!(targets.len() >= 20, "{} queries", targets.len());

    let c = TestCluster::start(
        "observability",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            // prefix-aware sends a turn to the node holding its history (a one-node route);
            // a concurrency limit makes admission time its queue.
            gateway_args: args(&[
                "--native-policy",
                "prefix-aware",
                "--max-concurrent-requests",
                "8",
            ]),
            decode_args: args(&["--kv-retain-after-decode", "60"]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let hostport = |url: &str| {
        url.trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned()
    };
    let jobs = [
        Job {
            name: "pd-gateway".into(),
            targets: vec![hostport(&c.gateway.http)],
        },
        Job {
            name: "pd-node".into(),
            targets: c.nodes.iter().map(|n| hostport(&n.http)).collect(),
        },
    ];
    check_kubernetes_config(&rules_dir, c.dir().path());
    let client = reqwest::Client::new();
    let prom = Prometheus::start(
        c.dir().path(),
        &jobs,
        &[rules_dir.join("alerts.yml")],
        &client,
    )
    .await;

    traffic(&c).await;

    // Prometheus has scraped every target after the traffic: the decode node's pulled tokens
    // and the gateway's error are in.
    let scraped = async |expr: &str| !prom.query(&client, expr).await.is_empty();
    eventually(
        "prometheus scraped the traffic",
        Duration::from_secs(30),
        async || {
            scraped("sum(pd_node_kv_pulled_tokens_total) > 0").await
                && scraped(r#"sum(pd_gateway_requests_total{outcome!="ok"}) > 0"#).await
                && scraped(r#"sum(pd_gateway_routes_total{route="whole"}) > 0"#).await
                && scraped("count(up == 1) == 3").await
        },
    )
    .await;
    // Two more scrapes of every target, so a series that first appeared with the traffic has
    // the two samples a rate() needs.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64();
    eventually("two more scrapes", Duration::from_secs(30), async || {
        let oldest = prom.query(&client, "min(timestamp(up))").await;
        oldest
            .first()
            .and_then(|s| s["value"][1].as_str())
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|t| t > now + 1.0)
    })
    .await;

    // Every panel's every query returns series; every metric it names exists.
    let mut failed = Vec::new();
    let mut names = BTreeSet::new();
    for (title, ref_id, expr) in &targets {
        let e = substitute(expr);
        names.extend(metric_names(&e));
        if prom.query(&client, &e).await.is_empty() {
            failed.push(format!("panel {title:?} query {ref_id}: {e}"));
        }
    }

    // Every rule evaluated without error, and every metric it names exists.
    let rules_ok = async || {
        let data = prom.api(&client, "rules", &[]).await;
        let rules: Vec<Value> = data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let evaluated = rules.iter().all(|r| {
            r["lastEvaluation"]
                .as_str()
                .is_some_and(|t| !t.starts_with("0001"))
        });
        (rules, evaluated)
    };
    eventually(
        "every rule evaluated",
        Duration::from_secs(10),
        async || rules_ok().await.1,
    )
    .await;
    let (rules, _) = rules_ok().await;
    assert!(rules.len() >= 10, "{} rules loaded", rules.len());
    for r in &rules {
        if r["health"] != "ok" {
            failed.push(format!(
                "rule {}: {} {}",
                r["name"], r["health"], r["lastError"]
            ));
        }
        names.extend(metric_names(r["query"].as_str().unwrap_or_default()));
    }
    for name in &names {
        let expr = format!(r#"count({{__name__="{name}"}})"#);
        if prom.query(&client, &expr).await.is_empty() {
            failed.push(format!("no series named {name}"));
        }
    }

    // Metric names and types follow Prometheus' conventions on every process.
    for url in std::iter::once(&c.gateway.http).chain(c.nodes.iter().map(|n| &n.http)) {
        let text = client
            .get(format!("{url}/metrics"))
            .send()
            .await
            .expect("scraping")
            .bytes()
            .await
            .expect("the exposition");
        for problem in lint(c.dir().path(), &text) {
            failed.push(format!("promtool check metrics {url}: {problem}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} panel queries, {} rules and {} metric names checked; failures:\n{}",
        failed.len(),
        targets.len(),
        rules.len(),
        names.len(),
        failed.join("\n")
    );
    eprintln!(
        "{} panel queries returned series; {} rules ok; {} metric names exist",
        targets.len(),
        rules.len(),
        names.len()
    );
    drop(prom);
}
