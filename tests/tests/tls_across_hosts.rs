//! The cluster under mutual TLS across hosts, as an operator runs it on a network it does not
//! trust: gateway, P and D on three hosts, every hop (registry, gateway→node HTTP, lease
//! releases, the KV side channel and data port) under TLS with one cluster CA minted by
//! `scripts/cluster-certs.sh`.
//!
//! - Answers through P→D are token for token a standalone node's, and D pulled over the
//!   network, the later pulls through P's data port (under TLS).
//! - `tcpdump` on the hosts' bridge, from before the first process started, finds neither the
//!   cluster token, the admin token nor the prompt anywhere on it (the client's hop to the
//!   gateway's OpenAI and admin ports is TLS too, `--client-tls-*`) — and does find a canary a
//!   host sent in clear to D's API port (so the capture saw that link, and D answered the
//!   plain-text client nothing).
//! - A node with a certificate from another CA, and one with none, both holding the right
//!   cluster token, are refused at the handshake: never listed, never counted as registrations.
//!   (The capture stops before they start: the one without TLS sends its token in clear.)

use std::time::Duration;

use pd_cluster_tests::cluster::{Certs, ClusterSpec, Hosting, Node, Role, TestCluster, tiny_model};
use pd_cluster_tests::openai::{self, Api};
use pd_cluster_tests::process::WorkDir;

/// Words of the prompts, looked for in the capture.
const PROMPT: &str = "Zebra lantern quartz meridian";
/// What a host sends D in clear, to show the capture sees that link.
const CANARY: &str = "pd-capture-canary-4f1e";

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mutual_tls_across_hosts_nothing_sensitive_crosses_in_clear_and_strangers_are_refused()
 {
    let dir = WorkDir::new("tls-reference");
    let model = tiny_model(&dir);
    let reference = Node::reference(&dir, &model);
    let pcap = dir.path().join("link.pcap");
    let mut c = TestCluster::start(
        "hosts-tls",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            hosts: Some(Hosting::default()),
            tls: true,
            capture: Some(pcap.clone()),
            ..ClusterSpec::default()
        },
    )
    .await;
    for url in c
        .nodes
        .iter()
        .map(|n| &n.http)
        .chain([&c.gateway.http, &c.gateway.admin])
    {
        assert!(url.starts_with("https://"), "{url}");
    }

    // Token-exact P→D across hosts, over TLS.
    let plain = reqwest::Client::new();
    let mut pulled = 0;
    for (i, api) in [Api::Chat, Api::Completions, Api::Chat, Api::Completions]
        .into_iter()
        .enumerate()
    {
        let mut body = api.body(&format!("{PROMPT} number {i}"), 6);
        if i >= 2 {
            body = api.streaming(&body);
        }
        let want = openai::send(&plain, &reference.http, api, &body, None)
            .await
            .ok();
        let got = openai::send(&c.client, &c.gateway.http, api, &body, None)
            .await
            .ok();
        assert_eq!(got.texts, want.texts, "{api:?} #{i}");
        pulled += got.pulled_tokens.unwrap_or(0);
    }
    let d = c.role(Role::Decode).next().expect("a decode node");
    let m = d.metrics(&c.client).await;
    let (gets, tcp) = (
        m.sum("pd_kv_pulls_total", &[("via", "get")]),
        m.sum("pd_kv_pulls_total", &[("via", "tcp")]),
    );
    assert!(
        gets > 0.0 && tcp > 0.0 && pulled > 0,
        "pulled {pulled} tokens: {}",
        m.show("pd_kv_pulls_total")
    );

    // A plain-text client on another host: D's API answers it nothing.
    let p = c.role(Role::Prefill).next().expect("a prefill node");
    let d_plain = d.http.replace("https://", "http://");
    let out = p
        .host
        .as_ref()
        .expect("on a host")
        .command("curl")
        .args(["-s", "-m", "5", "-H"])
        .arg(format!("x-canary: {CANARY}"))
        .arg(format!("{d_plain}/v1/models"))
        .output()
        .expect("curl runs");
    assert!(
        !out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("object"),
        "D answered plain HTTP: {out:?}"
    );

    // The capture: nothing sensitive, but the canary.
    // Stopped before the strangers come: one of them sends its token in clear, its own doing.
    c.capture.take().expect("capturing").stop();
    let bytes = std::fs::read(&pcap).expect("the capture file");
    assert!(
        contains(&bytes, CANARY.as_bytes()),
        "the capture ({} bytes) missed the canary: it did not see the link",
        bytes.len()
    );
    assert!(
        !contains(&bytes, pd_cluster_tests::cluster::CLUSTER_TOKEN.as_bytes()),
        "the cluster token crossed the link in clear"
    );
    assert!(
        !contains(&bytes, PROMPT.as_bytes()),
        "a prompt crossed the link in clear"
    );
    assert!(
        !contains(&bytes, pd_cluster_tests::cluster::ADMIN_TOKEN.as_bytes()),
        "the admin token crossed the link in clear"
    );
    // TLS application records (type 23, version 3.3) carried the traffic.
    let records = bytes.windows(3).filter(|w| w == b"\x17\x03\x03").count();
    assert!(records > 20, "{records} TLS records in the capture");
    eprintln!(
        "hosts-tls: {} bytes captured between hosts, {records} TLS records; {pulled} prompt tokens pulled P→D",
        bytes.len()
    );
    // Strangers holding the right cluster token: a certificate from another CA, and none.
    let theirs = Certs::new(&c.dir().path().join("their-ca"));
    let listed_before = c.admin_nodes().await.len();
    // A refusal at the handshake never reaches the registry: no join, no refusal counted.
    let joined = || c.gateway.proc.log().matches("node joined").count();
    let refused = "pd_gateway_registrations_refused_total";
    let before = (joined(), c.gateway_metrics().await.sum(refused, &[]));
    let mut strangers = Vec::new();
    for (name, foreign) in [("foreign", true), ("bare", false)] {
        let mut extra = vec!["--engine-id".to_owned(), name.to_owned()];
        if foreign {
            theirs.mint(name, &["DNS:foreign".to_owned()]);
            let mut flags = theirs.flags(name);
            // It trusts our CA (so only the gateway's check can refuse it).
            let ours = c.certs.as_ref().expect("tls").dir().join("ca.pem");
            flags[5] = ours.display().to_string();
            extra.extend(flags);
        }
        strangers.push(c.spawn_on_new_host(name, Role::Decode, false, &extra));
    }
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(c.admin_nodes().await.len(), listed_before);
    let after = (joined(), c.gateway_metrics().await.sum(refused, &[]));
    assert_eq!(after, before, "{}", c.gateway.proc.log_tail(20));
    for s in &strangers {
        let log = s.proc.log();
        assert!(
            log.contains("cannot register with the gateway")
                && !log.contains("registered with the gateway"),
            "{}: {log}",
            s.engine_id
        );
    }
    drop(strangers);
}
