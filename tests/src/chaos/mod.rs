//! The chaos suite's harness: a cluster on harness hosts — two gateways behind a real Envoy,
//! sharing one PostgreSQL state store, two prefill and two decode nodes reporting to both, and a
//! standalone reference node — under a mixed streaming load ([`mix`]), with one fault at a time
//! ([`faults`], and the processes' own kill/stop/restart), each scenario ending as one [`Row`]:
//! requests, wrong answers, errors by code, cut answers, leaks, the counters that account for
//! what happened, the recovery time through each gateway and the memory growth ([`check`]).
//!
//! A scenario is written as
//! `let run = ch.begin(name, Clients::Patient).await; ...fault...; ch.end(run, healed).await`.
//! Nothing here asserts: a scenario's row says what survived, and the suite's test asserts on
//! the rows (`tests/tests/chaos.rs`).

pub mod check;
pub mod faults;
pub mod mix;
pub mod scenarios;

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::{Duration, Instant};

pub use mix::{BOUND, Clients, Mix, Tally};

use crate::cluster::{Node, Role, SeveralGateways, SeveralSpec, args};
use crate::envoy::Envoy;
use crate::postgres::PgServer;
use crate::process::WorkDir;
use check::{Counts, Ledger};

/// Prefill nodes' lease TTL, seconds (`--kv-lease-duration`).
pub const LEASE_SECS: u64 = 5;
/// Decode nodes' retention of a finished turn, seconds (`--kv-retain-after-decode`).
pub const RETAIN_SECS: u64 = 3;
/// The gateways' `--node-timeout-ms` (their default).
pub const NODE_TIMEOUT: Duration = Duration::from_millis(3000);
/// The gateways' `--responses-store-mib`: small enough that the soak fills it, so that a
/// gateway's memory must level off there.
pub const STORE_MIB: u64 = 64;
/// Load clients.
pub const CLIENTS: usize = 4;
/// The most requests a client sends in one scenario.
pub const MAX_PER_CLIENT: usize = 2_000;

/// The cluster under test and the rows so far.
#[derive(Debug)]
pub struct Chaos {
    /// Gateways and nodes, each on a host of its own.
    pub c: SeveralGateways,
    /// Envoy in front of the gateways, on this machine.
    pub envoy: Envoy,
    /// One standalone node answers are compared to.
    pub reference: Node,
    /// The gateways' shared state.
    pub pg: PgServer,
    /// One row per scenario run.
    pub rows: Vec<Row>,
    /// Each process's resident memory after the warm-up, MiB.
    rss_start: BTreeMap<String, f64>,
    runs: u64,
    _work: WorkDir,
}

/// A process of the cluster: its name (`gw1`, an engine id), pid and metrics base URL.
#[derive(Debug, Clone)]
pub struct Member {
    /// `gw1`, `gw2`, or the node's engine id.
    pub name: String,
    /// Its pid.
    pub pid: u32,
    /// `http://addr:port` serving `/metrics`.
    pub metrics: String,
    /// `gw`, `P` or `D`.
    pub whose: String,
}

/// A scenario under way: its load and the counters at its start.
#[derive(Debug)]
pub struct Run {
    /// The scenario, in words (as its row names it).
    pub name: String,
    mix: Mix,
    /// The counters at the start, and those of processes killed since.
    pub ledger: Ledger,
    /// What the scenario observed beyond the row's columns (printed under the table).
    pub notes: Vec<String>,
    started: Instant,
}

impl Run {
    /// Waits until `n` more requests were answered token-exact (the load makes progress).
    pub async fn wait_exact(&self, n: u64) {
        let from = self.mix.exact();
        crate::eventually("progress under load", BOUND, async || {
            self.mix.exact() >= from + n
        })
        .await;
    }

    /// Requests finished so far.
    pub fn done(&self) -> u64 {
        self.mix.done()
    }
}

/// What one scenario left behind.
#[derive(Debug, Clone)]
pub struct Row {
    /// The scenario, in words.
    pub scenario: String,
    /// What the clients saw.
    pub tally: Tally,
    /// What was not idle within the lease TTL + 1 s of the load's end.
    pub leaks: Vec<String>,
    /// Counter deltas over the scenario.
    pub counts: Counts,
    /// Time from the fault's end to the first good answer through each gateway.
    pub recovery: Vec<Option<Duration>>,
    /// The largest growth of a process's resident memory since the warm-up, MiB, and whose.
    pub rss_growth: (f64, String),
    /// How long the scenario ran.
    pub took: Duration,
    /// What the counters do not account for ([`check::unaccounted`]); empty when they add up.
    pub unaccounted: Vec<String>,
    /// The scenario's own observations.
    pub notes: Vec<String>,
}

impl Row {
    /// Recomputes the decode nodes made instead of pulling.
    pub fn recomputes(&self) -> f64 {
        check::total(&self.counts, "D:pd_kv_recompute_total")
    }

    /// Prompt tokens the decode nodes pulled (the P/D path ran, not only recomputes).
    pub fn pulled_tokens(&self) -> f64 {
        check::total(&self.counts, "D:pd_node_kv_pulled_tokens_total")
    }

    /// Pulls that failed.
    pub fn failed_pulls(&self) -> f64 {
        check::total(&self.counts, "D:pd_kv_transfer_failures_total")
    }

    /// The slowest gateway's recovery (`None`: one never recovered).
    pub fn recovered(&self) -> Option<Duration> {
        self.recovery
            .iter()
            .copied()
            .try_fold(Duration::ZERO, |m, r| r.map(|r| m.max(r)))
    }
}

impl Chaos {
    /// Starts the cluster on hosts and warms it up.
    pub async fn start(name: &str) -> Self {
        let work = WorkDir::new(&format!("{name}-work"));
        let mut spec = SeveralSpec {
            gateways: 2,
            prefill: 2,
            decode: 2,
            prefill_args: args(&["--kv-lease-duration", &LEASE_SECS.to_string()]),
            decode_args: args(&[
                "--kv-load-failure-policy",
                "recompute",
                "--kv-retain-after-decode",
                &RETAIN_SECS.to_string(),
                "--kv-pull-timeout",
                "2",
            ]),
            node_args: args(&["--threads", "1"]),
            ..SeveralSpec::default()
        };
        let mut c = SeveralGateways::hosts(name, &spec);
        let bridge = c.net.as_ref().expect("on hosts").gateway_addr();
        let pg = PgServer::start_on(work.path(), bridge);
        spec.gateway_args = args(&[
            "--state-url",
            &pg.url,
            "--responses-store-mib",
            &STORE_MIB.to_string(),
        ]);
        c.start_on_net(&spec).await;
        let envoy = Envoy::start(work.path(), &c.upstreams());
        let reference = Node::reference_with(c.dir(), &c.model, &args(&["--threads", "1"]));
        let mut ch = Self {
            c,
            envoy,
            reference,
            pg,
            rows: Vec::new(),
            rss_start: BTreeMap::new(),
            runs: 0,
            _work: work,
        };
        let warm = ch.begin("warm-up", Clients::Patient).await;
        warm.wait_exact(16).await;
        let _ = warm.mix.stop().await;
        for m in ch.processes() {
            ch.rss_start.insert(m.name, check::rss_mib(m.pid));
        }
        ch
    }

    /// Every gateway and node of the cluster.
    pub fn processes(&self) -> Vec<Member> {
        let gateways = self.c.gateways.iter().enumerate().map(|(g, gw)| Member {
            name: format!("gw{}", g + 1),
            pid: gw.proc.pid(),
            metrics: gw.http.clone(),
            whose: "gw".into(),
        });
        let nodes = self.c.nodes.iter().map(|n| Member {
            name: n.engine_id.clone(),
            pid: n.proc.pid(),
            metrics: n.http.clone(),
            whose: match n.role {
                Role::Prefill => "P".into(),
                _ => "D".into(),
            },
        });
        gateways.chain(nodes).collect()
    }

    /// Starts scenario `name`: counters read, load started (`how`), and running.
    pub async fn begin(&mut self, name: &str, how: Clients) -> Run {
        self.begin_bounded(name, how, MAX_PER_CLIENT).await
    }

    /// [`Chaos::begin`] with each client sending at most `max_per_client` requests.
    pub async fn begin_bounded(&mut self, name: &str, how: Clients, max_per_client: usize) -> Run {
        self.runs += 1;
        let ledger = Ledger::open(self).await;
        let mix = Mix::start(
            &self.envoy.http,
            &self.reference.http,
            (CLIENTS, max_per_client),
            how,
            self.runs,
        );
        let run = Run {
            name: name.to_owned(),
            mix,
            ledger,
            notes: Vec::new(),
            started: Instant::now(),
        };
        run.wait_exact(4).await;
        run
    }

    /// Ends `run`, whose fault ended at `healed`: the recovery through each gateway measured
    /// (under load), the load stopped, leaks, counters and memory read; the row kept and
    /// returned.
    pub async fn end(&mut self, run: Run, healed: Instant) -> Row {
        let (recovery, probes_failed) = check::recovery(self, healed, BOUND).await;
        // A little more load after the recovery: the cluster serves as before.
        run.wait_exact(4).await;
        let tally = run.mix.stop().await;
        let leaks = check::leaks(self, Duration::from_secs(LEASE_SECS.max(RETAIN_SECS) + 1)).await;
        let counts = run.ledger.close(self).await;
        let mut rss_growth = (0.0f64, String::new());
        for m in self.processes() {
            let now = check::rss_mib(m.pid);
            let start = *self.rss_start.entry(m.name.clone()).or_insert(now);
            if now - start > rss_growth.0 {
                rss_growth = (now - start, m.name);
            }
        }
        let unaccounted =
            check::unaccounted(&counts, &tally, probes_failed, run.ledger.gateway_killed());
        let row = Row {
            unaccounted,
            notes: run.notes,
            scenario: run.name,
            tally,
            leaks,
            counts,
            recovery,
            rss_growth,
            took: run.started.elapsed(),
        };
        println!("{}", table(std::slice::from_ref(&row)));
        self.rows.push(row.clone());
        row
    }
}

/// The rows as a Markdown table (and, below, each row's counters).
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| scenario | requests | exact | wrong | errors | cut | hung | left | slowest | leaks | recomputes | failed pulls | accounted | recovery (gw1, gw2) | RSS growth |\n\
         |---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|\n",
    );
    for r in rows {
        let t = &r.tally;
        let errors = match t.error_count() + t.not_openai.len() {
            0 => "0".to_owned(),
            n => format!(
                "{n} ({}{})",
                t.error_codes(),
                match t.not_openai.len() {
                    0 => String::new(),
                    k => format!("; {k} not OpenAI"),
                }
            ),
        };
        let recovery: Vec<String> = r
            .recovery
            .iter()
            .map(|d| d.map_or("never".into(), |d| format!("{:.2} s", d.as_secs_f64())))
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {errors} | {} | {} | {} | {:.2} s | {} | {} | {} | {} | {} | {:.0} MiB ({}) |",
            r.scenario,
            t.sent,
            t.exact,
            t.wrong.len(),
            t.cut.len(),
            t.hung,
            t.left,
            t.slowest.as_secs_f64(),
            r.leaks.len(),
            r.recomputes(),
            r.failed_pulls(),
            if r.unaccounted.is_empty() {
                "yes"
            } else {
                "no"
            },
            recovery.join(", "),
            r.rss_growth.0,
            r.rss_growth.1,
        );
    }
    out.push('\n');
    for r in rows {
        let c: Vec<String> = r.counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            out,
            "- {} ({:.0} s): {}",
            r.scenario,
            r.took.as_secs_f64(),
            c.join("; ")
        );
        for (code, message) in &r.tally.messages {
            let _ = writeln!(out, "  - {code}: {message}");
        }
        for w in r.tally.wrong.iter().take(3) {
            let _ = writeln!(out, "  - wrong: {w}");
        }
        for e in r.tally.cut.iter().chain(&r.tally.not_openai).take(3) {
            let _ = writeln!(out, "  - {e}");
        }
        for l in r.leaks.iter().take(5) {
            let _ = writeln!(out, "  - leak: {l}");
        }
        for u in &r.unaccounted {
            let _ = writeln!(out, "  - unaccounted: {u}");
        }
        for n in &r.notes {
            let _ = writeln!(out, "  - {n}");
        }
    }
    out
}
