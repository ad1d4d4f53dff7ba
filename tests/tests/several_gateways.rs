//! Active-active gateways: two `pd-gateway serve` with one cluster token, and a P and a D each
//! given both (`--gateway g1,g2`).
//!
//! 1. Both gateways list both nodes, and a chat request through each is split over P and D
//!    (D pulled the prompt) and token for token what a standalone node answers.
//! 2. Leases follow their gateway. D is frozen (`SIGSTOP`), and one request goes through each
//!    gateway: P grants a lease for each (tagged with the gateway's `x-pd-gateway-id`), then
//!    the requests wait at D. g1 is killed (`SIGKILL`): P releases g1's lease at once — far
//!    within its 600 s duration, counted in `pd_kv_leases_total{event="gateway_left"}` — and
//!    keeps g2's. D resumed, the request through g2 completes, pulled under its untouched
//!    lease, token-exact.
//!
//! 3. Across hosts, one name for every gateway: two gateways on hosts of their own behind
//!    `pd-gateway-registry` (every host's `/etc/hosts` names both, as a headless Service's DNS
//!    does), a P and a D on hosts of their own given only that name. Both gateways list both
//!    nodes and each serves a split request; a third gateway added behind the name is
//!    registered with by both nodes within the re-resolve interval (plus slack).
//!
//! Before the node side of this (one `--gateway` only, untagged leases), g1's lease stayed live
//! until its deadline.

use std::time::{Duration, Instant};

use pd_cluster_tests::cluster::{Node, SeveralGateways, SeveralSpec, Stopped, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::metrics::scrape;
use pd_cluster_tests::openai::{self, Api};

/// Long enough that no lease can expire within the test: only a release explains one ending.
const LEASE_SECONDS: u64 = 600;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_serve_the_same_nodes_and_leases_follow_their_gateway() {
    let c = SeveralGateways::start(
        "several",
        SeveralSpec {
            gateways: 2,
            prefill: 1,
            decode: 1,
            // A frozen D stays in the view: the gateways wait for it instead of giving up.
            gateway_args: args(&["--node-timeout-ms", "600000"]),
            prefill_args: args(&["--kv-lease-duration", &LEASE_SECONDS.to_string()]),
            ..SeveralSpec::default()
        },
    )
    .await;
    let reference = Node::reference(c.dir(), &c.model);

    // 1. Both gateways list both nodes (start waited for it); each serves, split, exactly.
    for g in 0..2 {
        let ids: Vec<String> = c
            .admin_nodes(g)
            .await
            .iter()
            .filter_map(|n| n["engine_id"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(ids.len(), 2, "gateway {}: {ids:?}", g + 1);
        let api = Api::Chat;
        let body = api.body(&format!("{g} Two gateways in front of one P and one D."), 8);
        let got = openai::send(&c.client, &c.gateways[g].http, api, &body, None)
            .await
            .ok();
        let want = openai::send(&c.client, &reference.http, api, &body, None)
            .await
            .ok();
        assert_eq!(got.texts, want.texts, "through gateway {}", g + 1);
        assert!(
            got.pulled_tokens.is_some_and(|t| t > 0),
            "gateway {} split the request (D pulled): {}",
            g + 1,
            got.body
        );
    }
    let p = c.node("p0");
    let d = c.node("d0");
    let m = c.node_metrics("p0").await;
    assert_eq!(m.sum("pd_kv_leases_live", &[]), 0.0, "both leases released");
    let d_bytes = c
        .node_metrics("d0")
        .await
        .sum("pd_kv_transfer_bytes_total", &[]);
    assert!(d_bytes > 0.0, "D pulled");

    // 2. D frozen; one request through each gateway waits at D with its lease granted on P.
    let frozen = Stopped::new(d);
    let api = Api::Completions;
    let bodies: Vec<_> = (0..2)
        .map(|g| api.body(&format!("{g} A lease for each gateway, held at P."), 8))
        .collect();
    let through_g1 = {
        let (client, url) = (
            c.client.clone(),
            format!("{}{}", c.gateways[0].http, api.path()),
        );
        let body = bodies[0].clone();
        // The answer never comes (g1 dies): only that it was sent matters.
        tokio::spawn(async move { client.post(url).json(&body).send().await.is_ok() })
    };
    let through_g2 = {
        let (client, url) = (c.client.clone(), c.gateways[1].http.clone());
        let body = bodies[1].clone();
        tokio::spawn(async move { openai::send(&client, &url, api, &body, None).await })
    };
    eventually(
        "P to hold a lease for each gateway's request",
        Duration::from_secs(60),
        async || c.node_metrics("p0").await.sum("pd_kv_leases_live", &[]) == 2.0,
    )
    .await;
    eventually(
        "the requests to wait in D's socket",
        Duration::from_secs(30),
        async || d.unread_bytes() > 0,
    )
    .await;

    // g1 dies: P releases its lease, far within the lease's duration, and only that one.
    c.gateways[0].proc.signal(libc::SIGKILL);
    let killed = Instant::now();
    eventually(
        "P to release g1's lease",
        Duration::from_secs(30),
        async || c.node_metrics("p0").await.sum("pd_kv_leases_live", &[]) == 1.0,
    )
    .await;
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(LEASE_SECONDS / 10),
        "released after {took:?}"
    );
    let m = c.node_metrics("p0").await;
    let leases = |event| m.sum("pd_kv_leases_total", &[("event", event)]);
    assert_eq!(
        leases("gateway_left"),
        1.0,
        "{}",
        m.show("pd_kv_leases_total")
    );
    assert_eq!(leases("expired"), 0.0, "{}", m.show("pd_kv_leases_total"));
    assert!(
        p.proc
            .log()
            .contains("released the leases granted for its requests"),
        "P said why: {}",
        p.proc.log_tail(20)
    );
    let _ = through_g1.await;

    // D resumed: g2's request completes under its untouched lease, token for token.
    drop(frozen);
    let got = tokio::time::timeout(Duration::from_secs(60), through_g2)
        .await
        .expect("the request through g2 answers once D resumed")
        .expect("the request task")
        .ok();
    let want = openai::send(&c.client, &reference.http, api, &bodies[1], None)
        .await
        .ok();
    assert_eq!(got.texts, want.texts, "through g2 after g1 died");
    assert!(
        got.pulled_tokens.is_some_and(|t| t > 0),
        "D pulled g2's prompt: {}",
        got.body
    );
    let d_after = c
        .node_metrics("d0")
        .await
        .sum("pd_kv_transfer_bytes_total", &[]);
    assert!(
        d_after > d_bytes,
        "D pulled again: {d_after} after {d_bytes}"
    );
    eventually(
        "P's last lease released by D",
        Duration::from_secs(30),
        async || c.node_metrics("p0").await.sum("pd_kv_leases_live", &[]) == 0.0,
    )
    .await;
    let m = c.node_metrics("p0").await;
    assert_eq!(
        m.sum("pd_kv_leases_total", &[("event", "gateway_left")]),
        1.0,
        "{}",
        m.show("pd_kv_leases_total")
    );
}

/// How often the nodes of the hosts test look the name up again.
const RESOLVE_MS: u64 = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_name_for_every_gateway_and_a_new_gateway_behind_it_is_found() {
    let mut c = SeveralGateways::start_on_hosts(
        "several-hosts",
        SeveralSpec {
            gateways: 2,
            prefill: 1,
            decode: 1,
            node_args: args(&["--gateway-resolve-ms", &RESOLVE_MS.to_string()]),
            ..SeveralSpec::default()
        },
    )
    .await;
    // Both gateways list both nodes (start waited for it) and each serves a split request.
    for g in 0..2 {
        let api = Api::Chat;
        let body = api.body(&format!("{g} One name, two gateways."), 4);
        let a = openai::send(&c.client, &c.gateways[g].http, api, &body, None)
            .await
            .ok();
        assert!(
            a.pulled_tokens.is_some_and(|t| t > 0),
            "gateway {} split the request: {}",
            g + 1,
            a.body
        );
    }

    // A third gateway behind the name: both nodes register with it at their next lookup.
    let g3 = c.add_gateway();
    let added = Instant::now();
    c.wait_listed(g3, &["p0", "d0"], Duration::from_secs(30))
        .await;
    let took = added.elapsed();
    eprintln!("the third gateway listed both nodes {took:?} after it was added");
    assert!(
        took < Duration::from_millis(RESOLVE_MS) + Duration::from_secs(5),
        "found after {took:?}"
    );
    for n in &c.nodes {
        assert!(
            n.proc.log().contains("reporting to the gateway"),
            "{} logs its gateways: {}",
            n.engine_id,
            n.proc.log_tail(20)
        );
    }
    // The new gateway serves too, split over the same nodes.
    let api = Api::Completions;
    let body = api.body("Served by the gateway found later.", 4);
    let a = openai::send(&c.client, &c.gateways[g3].http, api, &body, None)
        .await
        .ok();
    assert!(a.pulled_tokens.is_some_and(|t| t > 0), "{}", a.body);
    let g = scrape(&c.client, &c.gateways[g3].http).await;
    assert!(
        g.sum("pd_gateway_requests_total", &[]) >= 1.0,
        "{}",
        g.show("pd_gateway_requests_total")
    );
}

/// A frozen gateway (`SIGSTOP`: its sockets open, nothing read; as a VM paused or a process
/// starved) neither takes the nodes out of the other gateway's view nor, once it runs again,
/// holds its own stall against the nodes: for three node timeouts g2 lists P and D as
/// routable and serves split requests token-exact, and right after `SIGCONT` g1 does too.
/// Found by the chaos suite (`SIGSTOP a gateway`): the resumed gateway's sweeper found every
/// node silent past the timeout, emptied its view, and answered `no_capacity` until the nodes'
/// reports, queued in its sockets, brought them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_gateway_leaves_the_other_serving_and_serves_again_at_once() {
    const NODE_TIMEOUT_MS: u64 = 1000;
    let c = SeveralGateways::start(
        "frozen-gateway",
        SeveralSpec {
            gateways: 2,
            prefill: 1,
            decode: 1,
            gateway_args: args(&["--node-timeout-ms", &NODE_TIMEOUT_MS.to_string()]),
            ..SeveralSpec::default()
        },
    )
    .await;
    let reference = Node::reference(c.dir(), &c.model);
    let exact = async |g: usize, i: usize| {
        let api = Api::Completions;
        let body = api.body(&format!("{i} Served while a gateway is frozen."), 4);
        let got = openai::send(&c.client, &c.gateways[g].http, api, &body, None).await;
        let want = openai::send(&c.client, &reference.http, api, &body, None).await;
        match got.status == 200 && got.complete && got.texts == want.texts {
            true => Ok(()),
            false => Err(format!("gateway {}: {} {}", g + 1, got.status, got.body)),
        }
    };
    exact(0, 0).await.expect("g1 serves");
    c.gateways[0].proc.signal(libc::SIGSTOP);
    let frozen = Instant::now();
    let (mut served, mut gaps) = (0, Vec::new());
    while frozen.elapsed() < Duration::from_millis(NODE_TIMEOUT_MS * 3) {
        let nodes = c.admin_nodes(1).await;
        if nodes.iter().filter(|n| n["routable"] == true).count() != 2 {
            gaps.push(format!("{:?}: g2 lists {nodes:?}", frozen.elapsed()));
        }
        match exact(1, served + 1).await {
            Ok(()) => served += 1,
            Err(e) => gaps.push(format!("{:?}: {e}", frozen.elapsed())),
        }
    }
    c.gateways[0].proc.signal(libc::SIGCONT);
    let resumed = Instant::now();
    for i in 0..5 {
        if let Err(e) = exact(0, 100 + i).await {
            gaps.push(format!("{:?} after SIGCONT: {e}", resumed.elapsed()));
        }
    }
    assert!(gaps.is_empty(), "{served} served by g2; {gaps:#?}");
    assert!(served >= 3, "{served}");
}
