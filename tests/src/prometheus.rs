//! A real Prometheus server (Debian's `prometheus` package, `scripts/setup.sh`) scraping a test
//! cluster on loopback, and `promtool` beside it: the observability files in
//! `examples/observability` checked against live processes.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::process::Proc;

/// How long Prometheus may take to answer `/-/ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// `$PD_TEST_<var>` when set, else `/usr/bin/<name>` (what Debian's package installs); panics
/// with how to install it when missing.
fn tool(var: &str, name: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .filter(|p| !p.is_empty())
        .map_or_else(|| PathBuf::from("/usr/bin").join(name), PathBuf::from);
    assert!(
        path.is_file(),
        "{name} not found at {} (set {var}, or install Debian's `prometheus` package: \
         `bash scripts/setup.sh` does)",
        path.display()
    );
    path
}

/// The `prometheus` server binary (`PD_TEST_PROMETHEUS`, default `/usr/bin/prometheus`).
pub fn prometheus_binary() -> PathBuf {
    tool("PD_TEST_PROMETHEUS", "prometheus")
}

/// `promtool` (`PD_TEST_PROMTOOL`, default `/usr/bin/promtool`).
pub fn promtool_binary() -> PathBuf {
    tool("PD_TEST_PROMTOOL", "promtool")
}

/// Runs `promtool args...` in `dir`; returns whether it succeeded and what it printed
/// (stdout, then stderr).
pub fn promtool(dir: &Path, args: &[&str]) -> (bool, String) {
    promtool_with_input(dir, args, None)
}

/// [`promtool`] with `input` on its standard input (`promtool check metrics`).
pub fn promtool_with_input(dir: &Path, args: &[&str], input: Option<&[u8]>) -> (bool, String) {
    use std::io::Write as _;
    use std::process::Stdio;
    let mut child = Command::new(promtool_binary())
        .args(args)
        .current_dir(dir)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running promtool {args:?}: {e}"));
    if let Some(bytes) = input {
        let mut stdin = child.stdin.take().expect("stdin is piped");
        stdin.write_all(bytes).expect("writing promtool's input");
    }
    let out = child.wait_with_output().expect("promtool's output");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// A scrape job: its name and `host:port` targets (each serving `/metrics`).
#[derive(Debug, Clone)]
pub struct Job {
    /// `job` label.
    pub name: String,
    /// `host:port` of each target.
    pub targets: Vec<String>,
}

/// A running Prometheus, killed on drop (its [`Proc`]).
#[derive(Debug)]
pub struct Prometheus {
    /// `http://127.0.0.1:PORT`: its HTTP API.
    pub url: String,
    /// The process.
    pub proc: Proc,
}

impl Prometheus {
    /// Starts Prometheus in `dir` (its config, its own TSDB, its log `prometheus.log`) on a free
    /// loopback port, scraping `jobs` every second and evaluating `rule_files` every second;
    /// waits until it is ready.
    pub async fn start(
        dir: &Path,
        jobs: &[Job],
        rule_files: &[PathBuf],
        client: &reqwest::Client,
    ) -> Self {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").expect("a free port");
            l.local_addr().expect("its address").port()
        };
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n",
        );
        config.push_str("rule_files:\n");
        for f in rule_files {
            config.push_str(&format!("  - {}\n", json_str(&f.display().to_string())));
        }
        config.push_str("scrape_configs:\n");
        for job in jobs {
            let targets: Vec<String> = job.targets.iter().map(|t| json_str(t)).collect();
            config.push_str(&format!(
                "  - job_name: {}\n    static_configs:\n      - targets: [{}]\n",
                json_str(&job.name),
                targets.join(", ")
            ));
        }
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, &config).expect("writing prometheus.yml");
        let (ok, out) = promtool(dir, &["check", "config", "prometheus.yml"]);
        assert!(ok, "the generated config is invalid:\n{config}\n{out}");
        let mut cmd = Command::new(prometheus_binary());
        cmd.arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("prometheus-data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .current_dir(dir);
        let proc = Proc::spawn("prometheus", cmd, dir);
        let url = format!("http://127.0.0.1:{port}");
        let start = Instant::now();
        loop {
            let ready = client
                .get(format!("{url}/-/ready"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                break;
            }
            assert!(
                start.elapsed() < READY_TIMEOUT,
                "prometheus was not ready within {READY_TIMEOUT:?}; its log:\n{}",
                proc.log_tail(40)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self { url, proc }
    }

    /// `GET /api/v1/<path>` with `query` parameters; the answer's `data` (panics, with the
    /// body, unless `status` is `success`).
    pub async fn api(&self, client: &reqwest::Client, path: &str, query: &[(&str, &str)]) -> Value {
        let url = format!("{}/api/v1/{path}", self.url);
        let resp = client
            .get(&url)
            .query(query)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        let text = resp.text().await.unwrap_or_default();
        let body: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("GET {url} {query:?}: {e}: {text}"));
        assert_eq!(body["status"], "success", "GET {url} {query:?}: {text}");
        body["data"].clone()
    }

    /// Evaluates `expr` now (an instant query); its result's series. Panics if Prometheus
    /// refuses the query (a syntax error, an unknown function).
    pub async fn query(&self, client: &reqwest::Client, expr: &str) -> Vec<Value> {
        let data = self.api(client, "query", &[("query", expr)]).await;
        match &data["result"] {
            Value::Array(series) => series.clone(),
            // A scalar or a string: one value, no series.
            _ => Vec::new(),
        }
    }
}

/// `s` as a YAML (JSON) double-quoted string.
fn json_str(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}
