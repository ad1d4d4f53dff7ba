//! What the chaos suite checks after a scenario: the counters that account for what happened
//! (a [`Ledger`] of deltas, restarts included), that nothing leaked ([`leaks`]), each process's
//! resident memory ([`rss_mib`]), and the time to the first good answer through each gateway
//! ([`recovery`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::Chaos;
use crate::cluster::ADMIN_TOKEN;
use crate::metrics::{Metrics, try_scrape};
use crate::openai::{self, Api};

/// How long a scrape may take before the process counts as not answering.
const SCRAPE: Duration = Duration::from_secs(2);

/// The counters a row accounts with, and the label each is split by.
const COUNTED: [(&str, &str); 12] = [
    ("pd_node_kv_pulled_tokens_total", ""),
    ("pd_kv_recompute_total", "reason"),
    ("pd_kv_transfer_failures_total", "reason"),
    ("pd_kv_leases_total", "event"),
    ("pd_node_kv_lease_capacity_refusals_total", ""),
    ("pd_gateway_requests_total", "outcome"),
    ("pd_gateway_failovers_total", "stage"),
    ("pd_gateway_admission_refused_total", "reason"),
    ("pd_gateway_policy_failures_total", "reason"),
    ("pd_gateway_policy_fallbacks_total", ""),
    ("pd_gateway_leases_released_total", "why"),
    ("pd_gateway_state_calls_total", "outcome"),
];

/// `metric{label}` → value, for the counters of [`COUNTED`].
pub type Counts = BTreeMap<String, f64>;

/// `whose` (`P`, `D`, `gw`) prefixes each key: a lease event on a producer is not one on a
/// decode node keeping a finished turn.
fn counts(whose: &str, m: &Metrics) -> Counts {
    let mut out = Counts::new();
    for (name, label) in COUNTED {
        for s in m.matching(name, &[]) {
            let key = match s.labels.get(label) {
                Some(v) => format!("{whose}:{name}{{{v}}}"),
                None => format!("{whose}:{name}"),
            };
            *out.entry(key).or_default() += s.value;
        }
    }
    out
}

/// Counter deltas over a scenario, across restarts: a process's counts at the start, and
/// what processes killed during it had counted by then.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Process name → (pid, counts at the start or at its start).
    start: BTreeMap<String, (u32, Counts)>,
    /// Deltas of processes replaced during the scenario.
    carried: Counts,
    /// The processes killed during it.
    killed: Vec<String>,
}

impl Ledger {
    /// Every process's counts now.
    pub async fn open(ch: &Chaos) -> Self {
        let mut start = BTreeMap::new();
        for p in ch.processes() {
            let m = try_scrape(&ch.c.client, &p.metrics, SCRAPE).await;
            let c = m.map(|m| counts(&p.whose, &m)).unwrap_or_default();
            start.insert(p.name, (p.pid, c));
        }
        Self {
            start,
            carried: Counts::new(),
            killed: Vec::new(),
        }
    }

    /// Before `name` is killed: keeps what it counted since the start.
    pub async fn before_kill(&mut self, ch: &Chaos, name: &str) {
        let Some(p) = ch.processes().into_iter().find(|p| p.name == name) else {
            return;
        };
        if let Some(m) = try_scrape(&ch.c.client, &p.metrics, SCRAPE).await {
            let base = self.start.remove(name).map(|(_, c)| c).unwrap_or_default();
            for (k, v) in counts(&p.whose, &m) {
                *self.carried.entry(k.clone()).or_default() += v - base.get(&k).unwrap_or(&0.0);
            }
        }
        self.start.remove(name);
        self.killed.push(name.to_owned());
    }

    /// Whether a gateway was killed during the scenario.
    pub fn gateway_killed(&self) -> bool {
        self.killed.iter().any(|k| k.starts_with("gw"))
    }

    /// The deltas since [`Ledger::open`]: a process that is new since (restarted, renamed)
    /// counts from zero.
    pub async fn close(&self, ch: &Chaos) -> Counts {
        let mut out = self.carried.clone();
        for p in ch.processes() {
            let Some(m) = try_scrape(&ch.c.client, &p.metrics, SCRAPE).await else {
                continue;
            };
            let base = match self.start.get(&p.name) {
                Some((pid, c)) if *pid == p.pid => c.clone(),
                _ => Counts::new(),
            };
            for (k, v) in counts(&p.whose, &m) {
                *out.entry(k.clone()).or_default() += v - base.get(&k).unwrap_or(&0.0);
            }
        }
        out.retain(|_, v| *v != 0.0);
        out
    }
}

/// The sum of the counts of `metric` (`name`, or `whose:name`), every label.
pub fn total(c: &Counts, metric: &str) -> f64 {
    c.iter()
        .filter(|(k, _)| match metric.contains(':') {
            true => k.split('{').next() == Some(metric),
            false => metric_of(k) == metric,
        })
        .map(|(_, v)| v)
        .sum::<f64>()
        + 0.0
}

/// The metric of a [`Counts`] key (`D:pd_kv_recompute_total{deadline}`).
fn metric_of(key: &str) -> &str {
    let name = key.split('{').next().unwrap_or(key);
    name.split_once(':').map_or(name, |(_, m)| m)
}

/// `label×n, ...` of `metric`'s counts.
pub fn by_label(c: &Counts, metric: &str) -> String {
    let v: Vec<String> = c
        .iter()
        .filter(|(k, _)| metric_of(k) == metric)
        .map(|(k, v)| {
            let label = k
                .split_once('{')
                .map_or("", |(_, l)| l.trim_end_matches('}'));
            format!("{label}×{v}")
        })
        .collect();
    v.join(", ")
}

/// What is not idle within `deadline` of now: a node with a live lease, a running or waiting
/// request or a block not free; a gateway with a request in flight or a node it counts open
/// or reserved requests on. Empty when everything went back.
pub async fn leaks(ch: &Chaos, deadline: Duration) -> Vec<String> {
    let start = Instant::now();
    loop {
        let mut found = Vec::new();
        for n in &ch.c.nodes {
            let Some(m) = try_scrape(&ch.c.client, &n.http, SCRAPE).await else {
                found.push(format!("{}: no metrics", n.engine_id));
                continue;
            };
            for (name, want) in [
                ("pd_kv_leases_live", 0.0),
                ("pd_node_requests_running", 0.0),
                ("pd_node_requests_waiting", 0.0),
                ("pd_node_requests_waiting_remote_kv", 0.0),
                (
                    "pd_node_kv_blocks_free",
                    m.sum("pd_node_kv_blocks_capacity", &[]),
                ),
            ] {
                let got = m.sum(name, &[]);
                if got != want {
                    found.push(format!("{}: {name} {got} (idle: {want})", n.engine_id));
                }
            }
        }
        for (g, gw) in ch.c.gateways.iter().enumerate() {
            match try_scrape(&ch.c.client, &gw.http, SCRAPE).await {
                Some(m) => {
                    let open = m.sum("pd_gateway_requests_in_flight", &[]);
                    if open != 0.0 {
                        found.push(format!("gateway {}: {open} requests in flight", g + 1));
                    }
                }
                None => found.push(format!("gateway {}: no metrics", g + 1)),
            }
            for n in admin_nodes(ch, g).await {
                let (open, reserved) = (
                    n["gateway_open_requests"].as_u64().unwrap_or(0),
                    n["gateway_reserved_requests"].as_u64().unwrap_or(0),
                );
                if open + reserved != 0 {
                    found.push(format!(
                        "gateway {}: {} open {open}, reserved {reserved}",
                        g + 1,
                        n["engine_id"]
                    ));
                }
            }
        }
        if found.is_empty() || start.elapsed() >= deadline {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn admin_nodes(ch: &Chaos, g: usize) -> Vec<Value> {
    let url = format!("{}/admin/nodes", ch.c.gateways[g].admin);
    let get = ch.c.client.get(&url).bearer_auth(ADMIN_TOKEN).send();
    let Ok(Ok(resp)) = tokio::time::timeout(SCRAPE, get).await else {
        return Vec::new();
    };
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    v["nodes"].as_array().cloned().unwrap_or_default()
}

/// Resident memory of `pid`, MiB (0 when gone).
pub fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Time from `healed` to the first complete, token-exact answer through each gateway (asked
/// directly, not through Envoy), every 50 ms; `None` for a gateway that gave none within
/// `bound`. Also how many probes failed before (each an error the gateways count).
pub async fn recovery(
    ch: &Chaos,
    healed: Instant,
    bound: Duration,
) -> (Vec<Option<Duration>>, usize) {
    let api = Api::Chat;
    let body = api.body("Recovery probe: the first good answer after the fault.", 3);
    let want = openai::try_send(&ch.c.client, &ch.reference.http, api, &body)
        .await
        .expect("the reference answers");
    let probes = ch.c.gateways.iter().map(|gw| {
        let (client, url, body, want) = (&ch.c.client, &gw.http, &body, &want);
        async move {
            let mut failed = 0;
            while healed.elapsed() < bound {
                let ask = openai::try_send(client, url, api, body);
                if let Ok(Ok(a)) = tokio::time::timeout(Duration::from_secs(5), ask).await
                    && a.status == 200
                    && a.complete
                    && a.texts == want.texts
                {
                    return (Some(healed.elapsed()), failed);
                }
                failed += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (None, failed)
        }
    });
    let all = futures::future::join_all(probes).await;
    let failed = all.iter().map(|(_, f)| f).sum();
    (all.into_iter().map(|(r, _)| r).collect(), failed)
}

/// What the counters do not account for: a failed pull a decode node did not recompute
/// (`--kv-load-failure-policy recompute`: every one must be) or the reverse, by reason (but
/// `peer_suspect`, a pull not tried); and,
/// unless a gateway was killed (its last counts die with it), errors the gateways counted
/// that no client or probe saw, or the reverse. Empty when everything adds up.
pub fn unaccounted(
    c: &Counts,
    tally: &super::Tally,
    probes_failed: usize,
    gateway_killed: bool,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut reasons: Vec<&str> = c
        .keys()
        .filter(|k| {
            k.starts_with("D:pd_kv_recompute_total{")
                || k.starts_with("D:pd_kv_transfer_failures_total{")
        })
        .filter_map(|k| k.split_once('{').map(|(_, r)| r.trim_end_matches('}')))
        .collect();
    reasons.sort();
    reasons.dedup();
    // A pull skipped because its producer could not be reached just before: no pull failed.
    reasons.retain(|r| *r != "peer_suspect");
    for r in reasons {
        let get = |m: &str| c.get(&format!("D:{m}{{{r}}}")).copied().unwrap_or(0.0);
        let (recomputed, failed) = (
            get("pd_kv_recompute_total"),
            get("pd_kv_transfer_failures_total"),
        );
        if recomputed != failed {
            out.push(format!(
                "{r}: {failed} failed pulls, {recomputed} recomputes"
            ));
        }
    }
    if !gateway_killed {
        let counted: f64 = c
            .iter()
            .filter(|(k, _)| k.starts_with("gw:pd_gateway_requests_total{"))
            .filter(|(k, _)| !k.ends_with("{ok}") && !k.ends_with("{aborted}"))
            .map(|(_, v)| v)
            .sum();
        let balancer: usize = tally
            .errors
            .iter()
            .filter(|(code, _)| code.starts_with("balancer_"))
            .map(|(_, n)| n)
            .sum();
        let seen = tally.error_count() - balancer + probes_failed;
        if counted != seen as f64 {
            out.push(format!(
                "the gateways counted {counted} errors; clients and probes saw {seen}"
            ));
        }
    }
    out
}
