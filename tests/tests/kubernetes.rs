//! The Kubernetes manifests (`examples/k8s`, cpu overlay) as the multi-host harness starts them:
//! the gateway, prefill and decode Deployments' containers, each on a host of its own as PID 1,
//! with exactly the rendered command, args and env (`pd_cluster_tests::k8s`): the pod's name and
//! IP filled in from the downward API, the Secrets' and the ConfigMap's values, `$(VAR)`
//! expanded, and the model volume mapped to SmolLM2 (`$PD_MODEL_GGUF`). The `openai` package
//! asks through the gateway's Service port with a client key from the Secret; each greedy answer
//! equals a standalone node's on the same model, with the prompt's KV pulled from P across
//! hosts. The nodes are listed under their pod names at their pod IPs, the policy the ConfigMap
//! names serves, and the admin port answers inside the gateway's pod only.
//!
//! The inference-extension overlay the same way, behind a real Envoy configured from its
//! InferencePool as an implementation of the Gateway API Inference Extension configures one:
//! `ext_proc` to the pool's `endpointPickerRef` Service port (pd-gateway's Endpoint Picker), the
//! pool's pods on its target port as the subset hint, its failure mode. Each answer through
//! Envoy equals the standalone node's; the picker picked every request (a split names P to D,
//! which pulls the KV across hosts) with the client's key swapped for the nodes' credential,
//! which the nodes require; pd-gateway's own front door carried nothing.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use pd_cluster_tests::bins;
use pd_cluster_tests::envoy::{Envoy, PickerSetup};
use pd_cluster_tests::hosts::{Host, Net};
use pd_cluster_tests::k8s::{Pod, Rendered};
use pd_cluster_tests::process::{Proc, WorkDir};
use pd_cluster_tests::python;
use serde_json::{Value, json};

const START: Duration = Duration::from_secs(120);

/// SmolLM2's GGUF file (`scripts/fetch-model.sh` when `PD_MODEL_GGUF` is not set).
fn model_file() -> PathBuf {
    if let Some(p) = std::env::var_os("PD_MODEL_GGUF").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let out = Command::new("bash")
        .arg(bins::workspace_root().join("scripts/fetch-model.sh"))
        .output()
        .expect("running scripts/fetch-model.sh");
    assert!(out.status.success(), "scripts/fetch-model.sh failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Starts Deployment `deployment`'s container as pod `host.name` on `host`.
fn start_pod(
    rendered: &Rendered,
    deployment: &str,
    host: &Host,
    dir: &WorkDir,
    models: &std::path::Path,
) -> Proc {
    let mut volumes = BTreeMap::new();
    volumes.insert("models".to_owned(), models.to_path_buf());
    for v in ["tmp", "cache", "shm"] {
        let d = dir.path().join(&host.name).join(v);
        std::fs::create_dir_all(&d).expect("a volume directory");
        volumes.insert(v.to_owned(), d);
    }
    let pod = Pod {
        name: &host.name,
        ip: host.addr.to_string(),
        // limits.cpu as the kubelet fills it would be 2-4; three pods share this machine's two
        // cores, so one compute thread each.
        cpus: 1,
        volumes,
    };
    let launch = rendered.launch(deployment, &pod);
    let binary = match launch.program.as_str() {
        "pd-gateway" => bins::pd_gateway(),
        "pd-node" => bins::pd_node(),
        other => panic!("{deployment} runs {other}, not one of the workspace's binaries"),
    };
    let mut cmd = host.container(binary);
    launch.apply(&mut cmd);
    Proc::spawn_contained(&host.name, cmd, dir.path())
}

/// `GET 127.0.0.1:8081<path>` from inside the gateway's pod, with the admin token.
fn admin_inside(gw: &Host, token: &str, path: &str) -> Value {
    let out = gw
        .command("curl")
        .args(["-sf", "-H", &format!("Authorization: Bearer {token}")])
        .arg(format!("http://127.0.0.1:8081{path}"))
        .output()
        .expect("running curl in the gateway's pod");
    assert!(out.status.success(), "admin {path}: {out:?}");
    serde_json::from_slice(&out.stdout).expect("admin JSON")
}

/// The rendered gateway, prefill and decode pods running, each on a host of its own (dropped:
/// the processes first, then the hosts).
struct Deployed {
    _gateway: Proc,
    _nodes: Vec<Proc>,
    gw: Host,
    p: Host,
    d: Host,
    _net: Net,
}

/// Starts `rendered`'s three pods and waits until the nodes are listed, routable, under their
/// pod names at their pod IPs.
async fn deploy(rendered: &Rendered, dir: &WorkDir, models: &std::path::Path) -> Deployed {
    let net = Net::new(dir.path());
    let gw = net.host("pd-gateway-7d9f8b6c5-x2k4q");
    net.alias("pd-gateway-registry", &gw);
    let p = net.host("pd-prefill-5d8f7c9b4-q7h2m");
    let d = net.host("pd-decode-6c9b4d8f7-m3n8p");
    let mut gateway = start_pod(rendered, "pd-gateway", &gw, dir, models);
    let mut nodes: Vec<Proc> = [("pd-prefill", &p), ("pd-decode", &d)]
        .into_iter()
        .map(|(deployment, host)| start_pod(rendered, deployment, host, dir, models))
        .collect();
    gateway.wait_line("pd-gateway listening on ", START);
    for n in &mut nodes {
        n.wait_line("pd-node listening on ", START);
    }
    let admin_token = rendered.secret("pd-secrets", "admin-token");
    let started = Instant::now();
    let listed = loop {
        let v = admin_inside(&gw, &admin_token, "/admin/nodes");
        let nodes = v["nodes"].as_array().cloned().unwrap_or_default();
        if nodes.len() == 2 && nodes.iter().all(|n| n["routable"] == true) {
            break nodes;
        }
        assert!(started.elapsed() < START, "nodes not listed: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for host in [&p, &d] {
        let n = listed
            .iter()
            .find(|n| n["engine_id"] == host.name.as_str())
            .unwrap_or_else(|| panic!("{} not listed: {listed:?}", host.name));
        assert_eq!(n["http_addr"], format!("{}:8000", host.addr), "{n}");
        assert_eq!(
            n["kv_side_channel_addr"],
            format!("{}:9000", host.addr),
            "{n}"
        );
    }
    Deployed {
        _gateway: gateway,
        _nodes: nodes,
        gw,
        p,
        d,
        _net: net,
    }
}

/// Three questions (chat, chat streamed, completions) whose prompts are above the decode
/// nodes' default `--kv-recompute-threshold` (64 tokens), so D pulls the prompt's KV rather
/// than recomputing it.
fn questions(served: &str) -> Vec<Value> {
    let system = "You are a careful assistant for a travel and general-knowledge desk. Answer \
        every question in one short, plain sentence. Do not use lists, headings, preambles or \
        follow-up questions, do not repeat the question, and do not add advice the user did not \
        ask for. If you are unsure, say so in the same single sentence.";
    let question = |i: usize, api: &str, stream: bool| {
        let text = [
            "What is the capital of France?",
            "Name a primary colour.",
            "What is two plus two?",
        ][i % 3];
        let mut s = json!({"api": api, "stream": stream, "n": 1, "max_tokens": 16,
            "temperature": 0.0, "model": served,
            "extra_body": {"return_token_ids": true}});
        match api {
            "chat" => {
                s["messages"] = json!([{"role": "system", "content": system},
                    {"role": "user", "content": text}]);
            }
            _ => s["prompt"] = json!(format!("{system}\nQuestion: {text}\nAnswer:")),
        }
        s
    };
    [("chat", false), ("chat", true), ("completions", false)]
        .iter()
        .enumerate()
        .map(|(i, (api, stream))| question(i, api, *stream))
        .collect()
}

/// Each answer equals the reference's, token for token, and its prompt's KV came from
/// somewhere but its own computation: the first pulled from P across hosts, the later ones
/// (which share its system prompt) pulled or found cached on D.
fn assert_like_one_node(specs: &[Value], want: &[Value], got: &[Value]) {
    for (i, ((spec, w), g)) in specs.iter().zip(want).zip(got).enumerate() {
        assert_eq!(g["token_ids"], w["token_ids"], "{spec}: {g} vs {w}");
        assert_eq!(g["texts"], w["texts"], "{spec}");
        let pulled = g["kv_pulled_tokens"].as_u64().unwrap_or(0);
        let cached = g["cached_tokens"].as_u64().unwrap_or(0);
        assert!(pulled > 0 || (i > 0 && cached > 0), "{spec}: {g}");
    }
}

/// The model file, its directory (the models volume) and its served name.
fn model_volume() -> (PathBuf, PathBuf, String) {
    let model = model_file();
    let models = model.parent().expect("the model's directory").to_path_buf();
    let served = model
        .file_stem()
        .and_then(|s| s.to_str())
        .expect("a model file name")
        .to_owned();
    (model, models, served)
}

/// One standalone node on this machine, same model: the reference; and its `http://` address.
fn reference(dir: &WorkDir, model: &std::path::Path) -> (Proc, String) {
    let mut cmd = Command::new(bins::pd_node());
    cmd.args(["serve", "--port", "0", "--threads", "1", "--model"])
        .arg(model);
    let mut reference = Proc::spawn("reference", cmd, dir.path());
    let http = reference.wait_line("pd-node listening on ", START);
    (reference, http)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rendered_manifests_start_a_cluster_that_answers_like_one_node() {
    let python = python::interpreter();
    let dir = WorkDir::new("k8s");
    let rendered = Rendered::load("cpu", dir.path());
    let (model, models, served) = model_volume();
    let (mut reference, reference_http) = reference(&dir, &model);
    let k = deploy(&rendered, &dir, &models).await;
    let (gw, d) = (&k.gw, &k.d);
    // The Service's port: the manifest's client port on the gateway pod's IP.
    let http = format!("http://{}:8080", gw.addr);

    // The ConfigMap's policy serving.
    let admin_token = rendered.secret("pd-secrets", "admin-token");
    let policy = admin_inside(gw, &admin_token, "/admin/policy");
    assert!(policy.to_string().contains("prefix-aware"), "{policy}");
    // The admin port is the pod's own: refused from another machine.
    let admin_from_outside = std::net::TcpStream::connect_timeout(
        &format!("{}:8081", gw.addr).parse().expect("an address"),
        Duration::from_secs(2),
    );
    assert!(
        admin_from_outside.is_err(),
        "the admin port answers outside its pod"
    );

    let specs = questions(&served);
    let want = python::run_specs(&python, &reference_http, &specs).await;
    let keys = rendered.secret("pd-api-keys", "keys");
    let key = keys.split(',').next().expect("a client key");
    let got = python::run_specs_with_key(&python, &http, &specs, Some(key)).await;
    assert_like_one_node(&specs, &want, &got);
    let m = pd_cluster_tests::metrics::scrape(
        &reqwest::Client::new(),
        &format!("http://{}:8000", d.addr),
    )
    .await;
    assert!(
        m.sum("pd_node_kv_pulled_tokens_total", &[]) > 0.0
            && m.sum("pd_kv_pulls_total", &[("via", "get")]) > 0.0
            && m.sum("pd_kv_pulls_total", &[("via", "mapped")]) == 0.0,
        "{}",
        m.show("pd_kv_pulls_total")
    );
    eprintln!(
        "k8s: {:?}",
        got.iter().map(|g| &g["texts"]).collect::<Vec<_>>()
    );
    // A client without a key from the Secret is refused.
    let status = reqwest::Client::new()
        .post(format!("{http}/v1/chat/completions"))
        .json(&specs[0])
        .send()
        .await
        .expect("POST")
        .status();
    assert_eq!(status.as_u16(), 401);
    drop(k);
    reference.kill_and_wait();
}

/// The port `service` sends `port` to on its pods: the container port its `targetPort` names.
fn target_port(rendered: &Rendered, service: &Value, port: u64) -> u64 {
    let sp = service["spec"]["ports"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["port"] == port))
        .unwrap_or_else(|| panic!("no port {port} on {service}"));
    let target = &sp["targetPort"];
    if let Some(n) = target.as_u64() {
        return n;
    }
    let gateway = rendered.doc("Deployment", "pd-gateway");
    let ports = &gateway["spec"]["template"]["spec"]["containers"][0]["ports"];
    ports
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == *target))
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port named {target}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inference_extension_overlay_serves_through_envoy_and_the_picker_like_one_node() {
    let python = python::interpreter();
    let dir = WorkDir::new("k8s-inference-extension");
    let rendered = Rendered::load("inference-extension", dir.path());
    let (model, models, served) = model_volume();
    let (mut reference, reference_http) = reference(&dir, &model);
    let k = deploy(&rendered, &dir, &models).await;

    // Envoy as an implementation configures it from the pool: the picker at the pool's
    // endpointPickerRef (a Service selecting the gateway's pod), the pool's pods on its target
    // port as the subset, its failure mode.
    let pool = rendered.doc("InferencePool", "pd-pool")["spec"].clone();
    let picker_ref = &pool["endpointPickerRef"];
    let service = rendered.doc(
        "Service",
        picker_ref["name"].as_str().expect("a Service name"),
    );
    assert_eq!(
        service["spec"]["selector"]["app.kubernetes.io/name"],
        "pd-gateway"
    );
    let picker_port = target_port(
        &rendered,
        service,
        picker_ref["port"]["number"].as_u64().unwrap_or(9002),
    );
    let target = pool["targetPorts"][0]["number"]
        .as_u64()
        .expect("a target port");
    assert_eq!(
        pool["selector"]["matchLabels"]["app.kubernetes.io/name"], "pd-node",
        "the pool holds the node pods"
    );
    let subset = [&k.p, &k.d]
        .map(|h| format!("{}:{target}", h.addr))
        .to_vec();
    assert_eq!(picker_ref["failureMode"], "FailClose");
    let envoy = Envoy::start_picker(
        dir.path(),
        &PickerSetup {
            ext_proc: format!("{}:{picker_port}", k.gw.addr),
            subset: Some(subset),
            ..PickerSetup::default()
        },
    );

    let specs = questions(&served);
    let want = python::run_specs(&python, &reference_http, &specs).await;
    let keys = rendered.secret("pd-api-keys", "keys");
    let key = keys.split(',').next().expect("a client key");
    let got = python::run_specs_with_key(&python, &envoy.http, &specs, Some(key)).await;
    for ((spec, w), g) in specs.iter().zip(&want).zip(&got) {
        assert_eq!(g["token_ids"], w["token_ids"], "{spec}: {g} vs {w}");
        assert_eq!(g["texts"], w["texts"], "{spec}");
    }
    // The ConfigMap's policy (prefix-aware) decides each route: every request was picked, the
    // splits' answers report KV pulled (or found cached on D), and D pulled what they report.
    let client = reqwest::Client::new();
    let g = pd_cluster_tests::metrics::scrape(&client, &format!("http://{}:8080", k.gw.addr)).await;
    let picked = |route: &str| {
        g.sum(
            "pd_gateway_picker_picks_total",
            &[("route", route), ("outcome", "picked")],
        )
    };
    let show = g.show("pd_gateway_picker_picks_total");
    assert_eq!(
        picked("split") + picked("whole"),
        specs.len() as f64,
        "{show}"
    );
    assert!(picked("split") >= 1.0, "{show}");
    let kv = |g: &Value, k: &str| g[k].as_u64().unwrap_or(0);
    let from_elsewhere = got
        .iter()
        .filter(|g| kv(g, "kv_pulled_tokens") > 0 || kv(g, "cached_tokens") > 0)
        .count();
    assert!(from_elsewhere as f64 >= picked("split"), "{got:?} {show}");
    let pulled: u64 = got.iter().map(|g| kv(g, "kv_pulled_tokens")).sum();
    assert!(pulled > 0, "{got:?}");
    assert_eq!(
        g.sum("pd_gateway_requests_total", &[]),
        0.0,
        "the front door carried nothing"
    );
    let m = pd_cluster_tests::metrics::scrape(&client, &format!("http://{}:8000", k.d.addr)).await;
    assert_eq!(
        m.sum("pd_node_kv_pulled_tokens_total", &[]),
        pulled as f64,
        "{}",
        m.show("pd_node_kv_pulled_tokens_total")
    );
    assert!(
        m.sum("pd_kv_pulls_total", &[("via", "get")]) > 0.0,
        "{}",
        m.show("pd_kv_pulls_total")
    );
    // A client without a key from the Secret is refused by the picker, before any node.
    let status = client
        .post(format!("{}/v1/chat/completions", envoy.http))
        .json(&specs[0])
        .send()
        .await
        .expect("POST")
        .status();
    assert_eq!(status.as_u16(), 401);
    // The nodes refuse the client's own key: only the picker's swap let the answers through.
    let status = client
        .post(format!("http://{}:8000/v1/chat/completions", k.d.addr))
        .bearer_auth(key)
        .json(&json!({"model": served, "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hello"}]}))
        .send()
        .await
        .expect("POST")
        .status();
    assert_eq!(status.as_u16(), 401);
    drop(envoy);
    drop(k);
    reference.kill_and_wait();
}
