//! What the gateway's benchmarks share: child processes read from their stdout, a process's
//! CPU time and resident memory from `/proc`, percentiles, simulated fleets and a closed-loop
//! load generator.
#![allow(dead_code)] // each bench uses its own part

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A child process, killed when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

/// Starts `bin args`; returns it and, for each of `prefixes`, the rest of the stdout line
/// starting with it.
pub fn start<S: AsRef<std::ffi::OsStr>>(
    bin: &Path,
    args: &[S],
    prefixes: &[&str],
) -> (Proc, Vec<String>) {
    let mut child = Command::new(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let stdout = child.stdout.take().expect("piped stdout");
    let mut found = vec![String::new(); prefixes.len()];
    let mut lines = BufReader::new(stdout).lines();
    while found.iter().any(String::is_empty) {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("{} exited before it was ready", bin.display()))
            .expect("stdout line");
        for (i, p) in prefixes.iter().enumerate() {
            if let Some(rest) = line.strip_prefix(p) {
                found[i] = rest.trim().to_owned();
            }
        }
    }
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (Proc(child), found)
}

/// Starts `bin args` with its output discarded (a router whose readiness is polled instead).
pub fn start_quiet<S: AsRef<std::ffi::OsStr>>(bin: &Path, args: &[S]) -> Proc {
    let child = Command::new(bin)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    Proc(child)
}

/// The `q` quantile of sorted values.
pub fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

/// CPU seconds (user + system, every thread) the process has used so far.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the command.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

/// Resident memory of the process, MiB.
pub fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The workspace's target directory.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"))
}

/// `pd-gateway` from the release build (`BENCH_GATEWAY_BIN` names another).
pub fn gateway_bin() -> PathBuf {
    std::env::var_os("BENCH_GATEWAY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("release/pd-gateway"))
}

/// A free TCP port on loopback (closed again; the child binds it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A running `pd-gateway` with its addresses.
pub struct GatewayProc {
    /// The process.
    pub proc: Proc,
    /// `http://…` of the OpenAI API.
    pub http: String,
    /// `http://…` of the admin API.
    pub admin: String,
    /// `host:port` of the registry.
    pub registry: String,
}

/// The admin and cluster tokens the benches start gateways and fleets with.
pub const TOKEN: &str = "bench-token";

/// Starts `pd-gateway serve` on free ports with `extra` flags.
pub fn gateway(extra: &[&str]) -> GatewayProc {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--registry-port",
        "0",
        "--admin-port",
        "0",
        "--admin-token",
        TOKEN,
        "--cluster-token",
        TOKEN,
    ];
    args.extend_from_slice(extra);
    let (proc, found) = start(
        &gateway_bin(),
        &args,
        &[
            "pd-gateway registry on ",
            "pd-gateway admin on ",
            "pd-gateway listening on ",
        ],
    );
    GatewayProc {
        proc,
        registry: found[0].clone(),
        admin: found[1].clone(),
        http: found[2].clone(),
    }
}

impl GatewayProc {
    /// `GET /admin/nodes`' list.
    pub async fn nodes(&self, c: &reqwest::Client) -> Vec<Value> {
        let v: Value = match c
            .get(format!("{}/admin/nodes", self.admin))
            .bearer_auth(TOKEN)
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        v["nodes"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until `count` nodes are listed and routable.
    pub async fn wait_nodes(&self, c: &reqwest::Client, count: usize, timeout: Duration) {
        let t = Instant::now();
        loop {
            let n = self.nodes(c).await;
            if n.len() >= count && n.iter().all(|n| n["routable"] == true) {
                return;
            }
            assert!(
                t.elapsed() < timeout,
                "{} of {count} nodes listed after {timeout:?}",
                n.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A fleet of simulated nodes reporting to `registry`.
pub async fn fleet(
    registry: &str,
    roles: Vec<(pd_node_sim::Role, usize)>,
    model: &str,
    timing: pd_node_sim::Timing,
    tune: impl FnOnce(&mut pd_node_sim::FleetConfig),
) -> pd_node_sim::Fleet {
    let mut config = pd_node_sim::FleetConfig {
        roles,
        id_prefix: model.to_owned(),
        model: model.to_owned(),
        host: "127.0.0.1".parse().expect("an address"),
        gateways: vec![registry.to_owned()],
        timing,
        tokenizer: pd_node_sim::byte_level_tokenizer().expect("a tokenizer"),
        block_size: 16,
        total_blocks: 4096,
        max_model_len: 8192,
        lease_duration: Duration::from_secs(30),
        churn: false,
        state_interval: Duration::from_secs(1),
        change_poll: Duration::from_millis(100),
        cluster_token: TOKEN.to_owned(),
        hash_key: 0,
    };
    tune(&mut config);
    pd_node_sim::Fleet::start(config)
        .await
        .expect("the fleet starts")
}

/// What a closed-loop load measured.
#[derive(Debug, Default)]
pub struct Load {
    /// Requests answered 200 in full.
    pub ok: usize,
    /// Requests that failed (status or transport).
    pub errors: usize,
    /// Latencies of the answered ones, ms, sorted.
    pub ms: Vec<f64>,
    /// The measured window.
    pub elapsed: Duration,
    /// The first error seen.
    pub first_error: Option<String>,
}

/// `clients` tasks each posting `body(i)` to `url` back to back for `window`; every answer is
/// read to its end.
pub async fn closed_loop(
    c: &reqwest::Client,
    url: &str,
    clients: usize,
    window: Duration,
    body: Arc<dyn Fn(usize) -> Value + Send + Sync>,
) -> Load {
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|k| {
            let (c, url, body) = (c.clone(), url.to_owned(), Arc::clone(&body));
            tokio::spawn(async move {
                let mut load = Load::default();
                let mut i = k;
                while start.elapsed() < window {
                    let t = Instant::now();
                    let r = c.post(&url).json(&body(i)).send().await;
                    i += clients;
                    match r {
                        Ok(r) if r.status().is_success() => match r.bytes().await {
                            Ok(_) => {
                                load.ok += 1;
                                load.ms.push(t.elapsed().as_secs_f64() * 1e3);
                            }
                            Err(e) => note(&mut load, e.to_string()),
                        },
                        Ok(r) => {
                            let s = r.status();
                            note(
                                &mut load,
                                format!("{s}: {}", r.text().await.unwrap_or_default()),
                            );
                        }
                        Err(e) => note(&mut load, e.to_string()),
                    }
                }
                load
            })
        })
        .collect();
    let mut all = Load::default();
    for t in tasks {
        let l = t.await.expect("a client task");
        all.ok += l.ok;
        all.errors += l.errors;
        all.ms.extend(l.ms);
        if all.first_error.is_none() {
            all.first_error = l.first_error;
        }
    }
    all.elapsed = start.elapsed();
    all.ms.sort_by(f64::total_cmp);
    all
}

fn note(load: &mut Load, e: String) {
    load.errors += 1;
    if load.first_error.is_none() {
        load.first_error = Some(e);
    }
}

/// Polls `url` until it answers (any status) or `timeout` passes.
pub async fn wait_http(c: &reqwest::Client, url: &str, timeout: Duration) {
    let t = Instant::now();
    while c.get(url).send().await.is_err() {
        assert!(
            t.elapsed() < timeout,
            "{url} did not answer within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
