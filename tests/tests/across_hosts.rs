//! Across machines, as operators deploy: the gateway and every node on hosts of their own
//! (`pd_cluster_tests::hosts`: network namespaces with their own address, hostname, boot id and
//! `/dev/shm`, so UCX takes them for separate machines and moves KV over TCP), driven by the
//! unmodified `openai` package from the test's own machine.
//!
//! - Gateway, P and D on three hosts, each bound to its own address: every API, streamed and
//!   not, n>1, structured output and tool calls, token for token what a standalone node
//!   answers; D's pulls went over `tcp/eth0` as UCX gets (no peer pool mapped: no shared
//!   memory), pulled tokens > 0.
//! - 2 P + 2 D on five hosts as container runtimes start them: each PID 1 of its own PID
//!   namespace, bound to `0.0.0.0`, no `--engine-id`, the gateway found by a DNS name. Every
//!   node is listed under its own default engine id (its hostname + a random suffix) at the
//!   address its registration came from, and serves. On the old node (engine id `pd-node-<pid>`:
//!   `pd-node-1` for all four, registering `0.0.0.0`) this failed (see the issue's note).
//! - A second node claiming a live node's engine id is refused, exits saying why with both
//!   addresses, and is counted; the first keeps its id and serves on.
//! - A node bound to loopback on another host is refused (nobody could reach it) and exits
//!   naming `--advertise-host`.

use std::time::Duration;

use pd_cluster_tests::cluster::{ClusterSpec, Hosting, Node, Role, TestCluster, args, tiny_model};
use pd_cluster_tests::openai::{self, Api};
use pd_cluster_tests::process::WorkDir;
use pd_cluster_tests::python;
use serde_json::Value;

use super::openai_token_exact::{check_counters, compare, hermes, round_robin, specs};

/// The reference answers: one standalone node on this machine, no gateway.
async fn reference(python: &std::path::Path, specs: &[Value]) -> Vec<Value> {
    let dir = WorkDir::new("hosts-reference");
    let model = tiny_model(&dir);
    let reference = Node::reference_with(&dir, &model, &hermes());
    python::run_specs(python, &reference.http, specs).await
}

/// Every decode node pulled over the network: its first pull from a producer with UCX gets (a
/// peer's pool is never mapped across machines), on an endpoint whose lanes are TCP on `eth0`,
/// the hosts' link; the later ones over the producer's TCP data port, as the node chooses for
/// a peer UCX reaches only over TCP.
async fn assert_pulled_over_tcp(c: &TestCluster) {
    for d in c.role(Role::Decode) {
        let m = d.metrics(&c.client).await;
        let gets = m.sum("pd_kv_pulls_total", &[("via", "get")]);
        let tcp = m.sum("pd_kv_pulls_total", &[("via", "tcp")]);
        assert!(
            gets > 0.0 && tcp > 0.0,
            "{}: {}",
            d.engine_id,
            m.show("pd_kv_pulls_total")
        );
        assert_eq!(
            m.sum("pd_kv_pulls_total", &[("via", "mapped")]),
            0.0,
            "{}: a peer's pool was mapped: shared memory across hosts",
            d.engine_id
        );
        // The node reports the path to each peer it pulled from: UCX's TCP lanes on eth0, and
        // the data port for the blocks.
        let path = "pd_kv_peer_path_info";
        let peers = c.role(Role::Prefill).count() as f64;
        assert!(
            m.sum(path, &[]) >= 1.0 && m.sum(path, &[]) <= peers,
            "{}",
            m.show(path)
        );
        let tcp = [("transports", "tcp/eth0"), ("via", "tcp")];
        assert_eq!(m.sum(path, &tcp), m.sum(path, &[]), "{}", m.show(path));
        let log = d.proc.log();
        assert!(
            log.lines()
                .any(|l| l.contains("TCP-emulated RMA") && l.contains(r#"["tcp/eth0"]"#)),
            "{} did not warn of TCP-emulated RMA: {log}",
            d.engine_id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_is_token_exact_with_gateway_p_and_d_on_three_hosts() {
    let python = python::interpreter();
    let specs = specs();
    let want = reference(&python, &specs).await;
    let c = TestCluster::start(
        "hosts-3",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            node_args: hermes(),
            hosts: Some(Hosting::default()),
            ..ClusterSpec::default()
        },
    )
    .await;
    // Each process on its own host, listed at that host's address.
    let listed = c.admin_nodes().await;
    for n in &c.nodes {
        let host = n.host.as_ref().expect("on a host");
        let entry = listed
            .iter()
            .find(|l| l["engine_id"] == n.engine_id.as_str())
            .expect("listed");
        assert_eq!(
            entry["http_addr"]
                .as_str()
                .and_then(|a| a.split(':').next()),
            Some(host.addr.to_string().as_str()),
            "{entry}"
        );
    }
    let got = python::run_specs(&python, &c.gateway.http, &specs).await;
    let pulled = compare("hosts-3", &specs, &want, &got);
    eprintln!(
        "hosts-3: {} answers token-identical to the reference; {} prompt tokens pulled P→D across hosts",
        got.len(),
        pulled.iter().sum::<u64>()
    );
    check_counters(&c, &specs, &pulled, false).await;
    assert_pulled_over_tcp(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_started_as_containers_on_five_hosts_are_told_apart_and_all_serve() {
    let python = python::interpreter();
    let specs = specs();
    let want = reference(&python, &specs).await;
    let c = TestCluster::start(
        "hosts-containers",
        ClusterSpec {
            prefill: 2,
            decode: 2,
            gateway_args: round_robin(),
            node_args: args(&["--threads", "1", "--tool-call-parser", "hermes"]),
            hosts: Some(Hosting { containers: true }),
            ..ClusterSpec::default()
        },
    )
    .await;
    // Four nodes, four engine ids, each the node's hostname and a random suffix; each PID 1.
    let mut ids: Vec<&str> = c.nodes.iter().map(|n| n.engine_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 4, "{ids:?}");
    for n in &c.nodes {
        let host = n.host.as_ref().expect("on a host");
        assert!(
            n.engine_id.starts_with(&format!("{}-", host.name)) && n.engine_id != "pd-node-1",
            "{}",
            n.engine_id
        );
        assert!(
            n.http.contains(&host.addr.to_string()),
            "{}: {}",
            n.engine_id,
            n.http
        );
    }
    let got = python::run_specs(&python, &c.gateway.http, &specs).await;
    let pulled = compare("hosts-containers", &specs, &want, &got);
    check_counters(&c, &specs, &pulled, true).await;
    assert_pulled_over_tcp(&c).await;
    // The prefill nodes bound 0.0.0.0 and named the address the gateway saw in their params.
    for p in c.role(Role::Prefill) {
        let host = p.host.as_ref().expect("on a host");
        assert!(
            p.proc.log().contains(&format!(
                "the gateway reaches this node at this address: KV handoffs name it host={}",
                host.addr
            )),
            "{}: {}",
            p.engine_id,
            p.proc.log_tail(20)
        );
    }
    let g = c.gateway_metrics().await;
    assert_eq!(
        g.sum("pd_gateway_registrations_refused_total", &[]),
        0.0,
        "{}",
        g.show("pd_gateway_registrations_refused_total")
    );
}

/// `node` was refused by the gateway: it exits non-zero by itself, its log's refusal line holds
/// every word of `says`, and the gateway counted one refusal for `reason`. Returns that line.
async fn refused(c: &TestCluster, node: &mut Node, reason: &str, says: &[&str]) -> String {
    let status = node
        .proc
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| {
            panic!(
                "{} kept running: {}",
                node.engine_id,
                node.proc.log_tail(20)
            )
        });
    assert!(!status.success(), "{status}");
    let log = node.proc.log();
    let said = log
        .lines()
        .find(|l| l.contains("refused this node"))
        .unwrap_or_else(|| panic!("{} did not say why it stopped: {log}", node.engine_id))
        .to_owned();
    assert!(says.iter().all(|w| said.contains(w)), "{said}");
    let g = c.gateway_metrics().await;
    let metric = "pd_gateway_registrations_refused_total";
    assert_eq!(
        g.sum(metric, &[("reason", reason)]),
        1.0,
        "{}",
        g.show(metric)
    );
    said
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_claiming_a_live_engine_id_is_refused_and_the_first_keeps_it() {
    let c = TestCluster::start(
        "hosts-duplicate",
        ClusterSpec {
            standalone: 1,
            hosts: Some(Hosting::default()),
            ..ClusterSpec::default()
        },
    )
    .await;
    let first = c.node("s0");
    let mut twin = c.spawn_on_new_host(
        "twin",
        Role::Standalone,
        true,
        &args(&["--engine-id", "s0"]),
    );
    let twin_addr = twin.host.as_ref().expect("on a host").addr.to_string();
    let first_addr = first.http.trim_start_matches("http://");
    let says = ["engine id `s0`", first_addr, &twin_addr];
    refused(&c, &mut twin, "engine_id_taken", &says).await;
    // The first keeps its id and address and serves on, never swapped out.
    let listed = c.admin_nodes().await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["http_addr"], first_addr, "{listed:?}");
    let joined = c.gateway.proc.log().matches("node joined").count();
    assert_eq!(joined, 1, "{}", c.gateway.proc.log_tail(20));
    let a = openai::send(
        &c.client,
        &c.gateway.http,
        Api::Chat,
        &Api::Chat.body("still served", 4),
        None,
    )
    .await
    .ok();
    assert_eq!(a.texts.len(), 1, "{a:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loopback_address_from_another_host_is_refused_naming_the_fix() {
    let c = TestCluster::start(
        "hosts-loopback",
        ClusterSpec {
            hosts: Some(Hosting::default()),
            ..ClusterSpec::default()
        },
    )
    .await;
    let mut lo = c.spawn_on_new_host(
        "lo",
        Role::Decode,
        false,
        &args(&["--engine-id", "lo", "--host", "127.0.0.1"]),
    );
    refused(
        &c,
        &mut lo,
        "unreachable_address",
        &["loopback", "--advertise-host"],
    )
    .await;
    assert!(c.admin_nodes().await.is_empty());
}

/// A greedy completions request on token ids.
fn turn(prompt: &[u64]) -> Value {
    serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0,
        "ignore_eos": true, "return_token_ids": true})
}

async fn complete(client: &reqwest::Client, base: &str, prompt: &[u64]) -> Vec<u64> {
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(&turn(prompt))
        .send()
        .await
        .expect("sent");
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.expect("JSON");
    v["choices"][0]["token_ids"]
        .as_array()
        .expect("token ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect()
}

/// A conversation whose decode node kept its turns, on another host than P: a short next turn
/// goes to the holder (its own cache), a later one is pulled back by P across hosts (reverse
/// pull over TCP); every turn token-exact with one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_is_sent_to_its_holder_and_pulled_back_across_hosts() {
    let policy = pd_cluster_tests::bins::policy("prefix-aware");
    let c = TestCluster::start(
        "hosts-multi-turn",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args: args(&["--policy", policy.to_str().expect("utf-8 path")]),
            prefill_args: args(&["--kv-recompute-threshold", "0"]),
            decode_args: args(&["--kv-retain-after-decode", "60"]),
            hosts: Some(Hosting { containers: true }),
            ..ClusterSpec::default()
        },
    )
    .await;
    let reference = Node::reference(c.dir(), &c.model);
    let how = async |how: &str| {
        c.gateway_metrics()
            .await
            .sum("pd_gateway_reverse_pulls_total", &[("how", how)])
    };
    let mut prompt: Vec<u64> = (1..=11).collect();
    for k in 1..=3u64 {
        if k == 3 {
            // Never to the holder: P pulls the history back from it, then hands it on.
            let (status, body) = c
                .push_policy(
                    &policy,
                    "prefix-aware",
                    &[
                        ("config.holder-max-new-tokens", "0"),
                        ("config.pull-overhead-us", "0"),
                        ("config.keep-on-prefill-decode-busy", "off"),
                    ],
                )
                .await;
            assert_eq!(status, 200, "{body}");
        }
        c.wait_view_idle(Duration::from_secs(10)).await;
        let got = complete(&c.client, &c.gateway.http, &prompt).await;
        let want = complete(&c.client, &reference.http, &prompt).await;
        assert_eq!(got, want, "turn {k}");
        if k == 1 {
            pd_cluster_tests::eventually("turn 1 kept", Duration::from_secs(5), async || {
                c.gateway_metrics()
                    .await
                    .sum("pd_gateway_retained_turns_total", &[])
                    == 1.0
            })
            .await;
        }
        prompt.extend(got);
        prompt.extend((0..5).map(|i| 40 + (k * 7 + i * 3) % 50));
    }
    assert_eq!(how("holder").await, 1.0);
    assert_eq!(how("prefill_pulls").await, 1.0);
    // P pulled the history from D's host over TCP.
    let p = c.role(Role::Prefill).next().expect("a prefill node");
    let m = p.metrics(&c.client).await;
    assert!(m.sum("pd_node_kv_pulled_tokens_total", &[]) > 0.0);
    assert!(m.sum("pd_kv_pulls_total", &[("via", "get")]) > 0.0);
    assert_eq!(m.sum("pd_kv_pulls_total", &[("via", "mapped")]), 0.0);
}
