//! The chaos suite's scenarios, one fault each under the mixed load, each returning its
//! [`Row`]. The suite's test (`tests/tests/chaos.rs`) picks which run and asserts on the rows.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use super::faults::{self, bad_link, clock_off, partition};
use super::{Chaos, Clients, NODE_TIMEOUT, Row, Run, STORE_MIB};
use crate::bins;
use crate::cluster::{ADMIN_TOKEN, Role};
use crate::metrics::{Metrics, try_scrape};

/// How long a fault lasts where nothing else decides it.
const FAULT: Duration = Duration::from_secs(8);

/// Waits until `pred` holds of node `id`'s metrics (polled every 10 ms), at most `within`;
/// whether it did.
async fn when_node(
    ch: &Chaos,
    id: &str,
    within: Duration,
    pred: impl Fn(&crate::metrics::Metrics) -> bool,
) -> bool {
    let http = ch.c.node(id).http.clone();
    let start = Instant::now();
    while start.elapsed() < within {
        if let Some(m) = try_scrape(&ch.c.client, &http, Duration::from_secs(1)).await
            && pred(&m)
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// Keeps the load running `d` (the fault in force).
async fn under_load(d: Duration) {
    tokio::time::sleep(d).await;
}

fn addr(ch: &Chaos, id: &str) -> Ipv4Addr {
    ch.c.node(id).host.as_ref().expect("on a host").addr
}

fn gateway_addrs(ch: &Chaos) -> Vec<Ipv4Addr> {
    ch.c.gateways
        .iter()
        .map(|g| g.host.as_ref().expect("on a host").addr)
        .collect()
}

/// `kill -9` a node busy with the load — a prefill node while decode nodes pull from it (a
/// lease of it live), a decode node mid-stream (requests running on it) — down a moment, then
/// started again under its engine id or a new one.
pub async fn kill_node(ch: &mut Chaos, role: Role, new_id: bool) -> Row {
    let (what, busy): (&str, fn(&Metrics) -> bool) = match role {
        Role::Prefill => ("P during pulls", |m| m.sum("pd_kv_leases_live", &[]) > 0.0),
        _ => ("D mid-stream", |m| {
            m.sum("pd_node_requests_running", &[]) > 0.0
        }),
    };
    let name = format!(
        "kill -9 {what}, restart as {}",
        if new_id {
            "a new engine id"
        } else {
            "the same engine id"
        }
    );
    let mut run = ch.begin(&name, Clients::Patient).await;
    let id = ch.c.id_of(role, 0);
    when_node(ch, &id, Duration::from_secs(20), busy).await;
    run.ledger.before_kill(ch, &id).await;
    ch.c.kill_node(&id);
    run.wait_exact(8).await;
    let again = if new_id { format!("{id}x") } else { id.clone() };
    ch.c.restart_node(&id, &again, &[]).await;
    ch.end(run, Instant::now()).await
}

/// `kill -9` a gateway with requests in flight through it, then started again on its host and
/// ports (its state in PostgreSQL).
pub async fn kill_gateway(ch: &mut Chaos) -> Row {
    let mut run = ch
        .begin("kill -9 a gateway mid-split, restart", Clients::Patient)
        .await;
    let gw = ch.c.gateways[0].http.clone();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        let busy = try_scrape(&ch.c.client, &gw, Duration::from_secs(1))
            .await
            .is_some_and(|m| m.sum("pd_gateway_requests_in_flight", &[]) > 0.0);
        if busy {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    run.ledger.before_kill(ch, "gw1").await;
    ch.c.gateways[0].proc.kill_and_wait();
    run.wait_exact(8).await;
    ch.c.restart_gateway(0, Duration::from_secs(30)).await;
    ch.end(run, Instant::now()).await
}

/// What [`stop`] freezes.
#[derive(Debug, Clone, Copy)]
pub enum Frozen {
    /// The first prefill node.
    Prefill,
    /// The first decode node.
    Decode,
    /// The first gateway.
    Gateway,
}

/// `SIGSTOP` for twice the gateways' node timeout and a second, then `SIGCONT`.
pub async fn stop(ch: &mut Chaos, which: Frozen) -> Row {
    let (name, pid) = match which {
        Frozen::Prefill => ("SIGSTOP P past the node timeout, SIGCONT", {
            ch.c.node(&ch.c.id_of(Role::Prefill, 0)).proc.pid()
        }),
        Frozen::Decode => ("SIGSTOP D past the node timeout, SIGCONT", {
            ch.c.node(&ch.c.id_of(Role::Decode, 0)).proc.pid()
        }),
        Frozen::Gateway => (
            "SIGSTOP a gateway past the node timeout, SIGCONT",
            ch.c.gateways[0].proc.pid(),
        ),
    };
    let run = ch.begin(name, Clients::Patient).await;
    signal(pid, libc::SIGSTOP);
    under_load(NODE_TIMEOUT * 2 + Duration::from_secs(1)).await;
    signal(pid, libc::SIGCONT);
    ch.end(run, Instant::now()).await
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a child of this test.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// Every prefill node cut off from every decode node (the KV side channel, UCX and the data
/// port all dropped), the registry and HTTP up; healed after [`FAULT`].
pub async fn partition_prefill_decode(ch: &mut Chaos) -> Row {
    let run = ch.begin("partition P↔D only", Clients::Patient).await;
    let decoders: Vec<Ipv4Addr> = (0..2)
        .map(|i| addr(ch, &ch.c.id_of(Role::Decode, i)))
        .collect();
    let hosts: Vec<String> = (0..2).map(|i| ch.c.id_of(Role::Prefill, i)).collect();
    let filters: Vec<_> = hosts
        .iter()
        .map(|p| partition(ch.c.node(p).host.as_ref().expect("on a host"), &decoders))
        .collect();
    under_load(FAULT).await;
    filters.into_iter().for_each(faults::Filter::heal);
    ch.end(run, Instant::now()).await
}

/// A decode node cut off from both gateways (registry and HTTP), the other nodes reachable;
/// healed after [`FAULT`].
pub async fn partition_from_gateways(ch: &mut Chaos) -> Row {
    let run = ch
        .begin("partition a D from the gateways", Clients::Patient)
        .await;
    let d = ch.c.id_of(Role::Decode, 0);
    let filter = partition(
        ch.c.node(&d).host.as_ref().expect("on a host"),
        &gateway_addrs(ch),
    );
    under_load(FAULT).await;
    filter.heal();
    ch.end(run, Instant::now()).await
}

/// 1% loss each way on a decode node's link, and delay (netem) or a capped rate; for
/// [`FAULT`].
pub async fn bad_link_on_decode(ch: &mut Chaos) -> Row {
    let mut run = ch.begin("bad link on a D", Clients::Patient).await;
    let d = ch.c.id_of(Role::Decode, 0);
    let host = ch.c.node(&d).host.as_ref().expect("on a host");
    let (filter, what) = bad_link(host, 1, 20);
    run.name = format!("bad link on a D: {what}");
    under_load(FAULT).await;
    filter.heal();
    ch.end(run, Instant::now()).await
}

/// A node restarted (drained first, `SIGTERM`) with its wall clock `offset` (`+30s`, `-30s`)
/// off, served under load for [`FAULT`], then restarted on the right time.
pub async fn clock_skew(ch: &mut Chaos, role: Role, offset: &str) -> Row {
    let env = clock_off(offset);
    assert!(
        faults::clock_is_off(&env, offset.trim_end_matches('s').parse().unwrap_or(0)),
        "libfaketime does not move the clock here"
    );
    let id = ch.c.id_of(role, 0);
    let label = if role == Role::Prefill { "P" } else { "D" };
    let mut run = ch
        .begin(&format!("{label}'s clock {offset} off"), Clients::Patient)
        .await;
    // Restarted gracefully (drained), so that only the clock can cost a request.
    run.ledger.before_kill(ch, &id).await;
    ch.c.stop_node(&id, Duration::from_secs(30));
    ch.c.restart_node(&id, &id, &env).await;
    run.wait_exact(16).await;
    under_load(FAULT).await;
    run.ledger.before_kill(ch, &id).await;
    ch.c.stop_node(&id, Duration::from_secs(30));
    ch.c.restart_node(&id, &id, &[]).await;
    ch.end(run, Instant::now()).await
}

/// `ops` policy changes through both gateways' admin APIs under load: pushes of the built-in
/// guests and the Python one (17 MiB), pushes of guests that trap, loop or exhaust memory
/// (refused by the smoke test, or installed and contained), and rollbacks.
pub async fn policy_churn(ch: &mut Chaos, ops: usize) -> Row {
    let run = ch
        .begin(
            &format!("{ops} policy pushes and rollbacks"),
            Clients::Patient,
        )
        .await;
    let guests: [(&str, &[(&str, &str)]); 7] = [
        ("round-robin", &[]),
        ("least-loaded", &[]),
        ("trapping", &[("config.mode", "always")]),
        ("looping", &[]),
        ("hungry", &[("config.mode", "always")]),
        ("trapping", &[]),
        ("prefix-aware", &[]),
    ];
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for i in 0..ops {
        let g = &ch.c.gateways[i % 2];
        let req = if i % 4 == 3 {
            ch.c.client
                .post(format!("{}/admin/policy/rollback", g.admin))
        } else {
            let (name, query) = if i % 25 == 10 {
                ("python/least-loaded", &[][..])
            } else {
                guests[i % guests.len()]
            };
            let wasm = std::fs::read(bins::policy(name)).expect("a built guest policy");
            let mut q = vec![("name".to_owned(), name.replace('/', "-"))];
            q.extend(query.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            ch.c.client
                .put(format!("{}/admin/policy", g.admin))
                .query(&q)
                .body(wasm)
        };
        let resp = req
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("the admin API");
        *statuses.entry(resp.status().as_u16()).or_default() += 1;
    }
    println!("policy churn: admin answers by status {statuses:?}");
    ch.end(run, Instant::now()).await
}

/// Clients leaving at random points (most of them: before P answers, between P and D,
/// mid-decode) for [`FAULT`] and more.
pub async fn abort_storm(ch: &mut Chaos) -> Row {
    let run = ch.begin("abort storm", Clients::Leaving).await;
    under_load(FAULT * 2).await;
    ch.end(run, Instant::now()).await
}

/// The shared PostgreSQL stopped for [`FAULT`], then started again.
pub async fn store_outage(ch: &mut Chaos) -> Row {
    let run = ch
        .begin("state store stopped and restarted", Clients::Patient)
        .await;
    ch.pg.stop();
    under_load(FAULT).await;
    ch.pg.resume();
    ch.end(run, Instant::now()).await
}

/// Load and nothing else for `d` (a soak): one row, with notes on each process's resident
/// memory (sampled every minute) and on the nodes' registrations with each gateway (sampled
/// every 5 s): a node not routable at a sample, or registered anew (its stream to that
/// gateway dropped and reconnected), is noted.
pub async fn soak(ch: &mut Chaos, d: Duration) -> Row {
    let minutes = d.as_secs().div_ceil(60) as usize;
    let mut run: Run = ch
        .begin_bounded(
            &format!("soak, {minutes} min"),
            Clients::Patient,
            minutes * 3_000,
        )
        .await;
    let registrations = |nodes: &[serde_json::Value]| -> Vec<(String, String, bool)> {
        nodes
            .iter()
            .map(|n| {
                (
                    n["engine_id"].as_str().unwrap_or("").to_owned(),
                    n["registered_at"].to_string(),
                    n["routable"] == true,
                )
            })
            .collect()
    };
    let mut first = Vec::new();
    for g in 0..ch.c.gateways.len() {
        first.push(registrations(&ch.c.admin_nodes(g).await));
    }
    let start = Instant::now();
    let mut rss: Vec<(String, Vec<f64>)> = ch
        .processes()
        .into_iter()
        .map(|m| (m.name, Vec::new()))
        .collect();
    let mut stored = vec![Vec::new(); ch.c.gateways.len()];
    let (mut unroutable, mut reconnected) = (0usize, std::collections::BTreeSet::new());
    let mut samples = 0u64;
    while start.elapsed() < d {
        if samples.is_multiple_of(12) {
            for (m, (_, series)) in ch.processes().iter().zip(rss.iter_mut()) {
                series.push(super::check::rss_mib(m.pid));
            }
            for (g, series) in stored.iter_mut().enumerate() {
                let m =
                    try_scrape(&ch.c.client, &ch.c.gateways[g].http, Duration::from_secs(2)).await;
                series.push(
                    m.map_or(0.0, |m| m.sum("pd_gateway_responses_stored_bytes", &[])) / 1048576.0,
                );
            }
        }
        for (g, before) in first.iter().enumerate() {
            for (id, at, routable) in registrations(&ch.c.admin_nodes(g).await) {
                unroutable += usize::from(!routable);
                if before.iter().any(|(i, a, _)| *i == id && *a != at) {
                    reconnected.insert(format!("{id} with gw{}", g + 1));
                }
            }
        }
        samples += 1;
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    for (name, series) in &rss {
        let v: Vec<String> = series.iter().map(|m| format!("{m:.0}")).collect();
        run.notes
            .push(format!("{name} RSS MiB each minute: {}", v.join(" ")));
    }
    for (g, series) in stored.iter().enumerate() {
        let v: Vec<String> = series.iter().map(|m| format!("{m:.0}")).collect();
        run.notes.push(format!(
            "gw{} stored responses MiB each minute (bound {STORE_MIB}): {}",
            g + 1,
            v.join(" ")
        ));
    }
    run.notes.push(format!(
        "registrations: {samples} samples of both gateways' node lists; a node not routable \
         {unroutable} times; registered anew: {}",
        if reconnected.is_empty() {
            "none (every stream kept the whole soak)".to_owned()
        } else {
            reconnected.into_iter().collect::<Vec<_>>().join(", ")
        }
    ));
    ch.end(run, Instant::now()).await
}
