//! The gateway's registry with a real `pd-node`: the node registers (cluster token checked),
//! hands over its tokenizer, and streams its prefix-cache hashes; the gateway tokenizes a request
//! with that tokenizer — through the same `openai::analyze` + `pd_tokenize::prompt` path the
//! proxy uses — and its block hashes are exactly the ones the node reported for that request.
//! A node leaves the view as soon as it dies.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_gateway::cluster::Cluster;
use pd_gateway::openai::analyze;
use pd_gateway::registry::{Registry, RegistryConfig};
use pd_policy::{Api, Role};
use serde_json::{Value, json};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const WAIT: Duration = Duration::from_secs(20);

/// `pd-node`, built next to this test's binaries (`cargo test --workspace` builds it).
fn pd_node() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target profile dir");
    let node = dir.join("pd-node");
    assert!(
        node.exists(),
        "{} is missing: cargo build -p pd-node",
        node.display()
    );
    node
}

fn start_node(model: &Path, registry: &str, args: &[&str]) -> (Proc, String) {
    let (proc, addr, _) = start_node_logged(model, registry, args, Stdio::null());
    (proc, addr)
}

/// Like [`start_node`], with the node's stderr as given (piped: returned for reading).
fn start_node_logged(
    model: &Path,
    registry: &str,
    args: &[&str],
    stderr: Stdio,
) -> (Proc, String, Option<std::process::ChildStderr>) {
    let mut child = Command::new(pd_node())
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args([
            "--port",
            "0",
            "--block-size",
            "4",
            "--served-model-name",
            "tiny",
        ])
        .args(["--gateway", registry])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("pd-node starts");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let err = child.stderr.take();
    let proc = Proc(child);
    loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).expect("stdout") > 0,
            "pd-node exited"
        );
        if let Some(a) = line.trim().strip_prefix("pd-node listening on ") {
            return (proc, a.to_owned(), err);
        }
    }
}

async fn serve_registry(token: &str, required: bool) -> (Arc<Cluster>, String) {
    let cluster = Arc::new(Cluster::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let registry = Registry::new(
        cluster.clone(),
        pd_gateway::metrics::Metrics::new(),
        RegistryConfig {
            gateway_id: "test-gateway".into(),
            cluster_token: token.into(),
            token_required: required,
            node_timeout: Duration::from_secs(5),
            tls: None,
        },
    );
    tokio::spawn(registry.serve(listener, std::future::pending()));
    (cluster, addr)
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn gen_model(dir: &Path) {
    let status = Command::new(pd_node())
        .args(["gen-tiny-model", "--out"])
        .arg(dir)
        .args(["--seed", "3"])
        .stdout(Stdio::null())
        .status()
        .expect("gen-tiny-model");
    assert!(status.success());
}

/// Starts a node with `args` (its `--engine-id` among them) that the registry must refuse: waits
/// for the node's own report of the refusal (a stderr line holding every word of `says`), then
/// checks it is not in the view.
async fn refused_node(
    cluster: &Cluster,
    model: &Path,
    registry: &str,
    args: &[&str],
    says: &[&str],
) {
    let id = args[args
        .iter()
        .position(|a| *a == "--engine-id")
        .expect("an engine id")
        + 1];
    let (_node, _, err) = start_node_logged(model, registry, args, Stdio::piped());
    let err = err.expect("piped stderr");
    let says: Vec<String> = says.iter().map(|s| s.to_string()).collect();
    let refused = tokio::task::spawn_blocking(move || {
        BufReader::new(err)
            .lines()
            .map_while(Result::ok)
            .any(|l| says.iter().all(|s| l.contains(s.as_str())))
    });
    assert!(
        tokio::time::timeout(WAIT, refused)
            .await
            .expect("the refusal within the deadline")
            .expect("reader"),
        "node {id} did not report the refusal"
    );
    assert!(
        cluster.read().nodes.values().all(|n| &*n.engine_id != id),
        "node {id} joined"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_hashes_equal_the_hashes_the_node_reported() {
    let tmp = std::env::temp_dir().join(format!("pd-gw-registry-{}", std::process::id()));
    let model = tmp.join("model");
    gen_model(&model);
    let (cluster, registry) = serve_registry("secret", true).await;
    let (node, http) = start_node(
        &model,
        &registry,
        &[
            "--cluster-token",
            "secret",
            "--engine-id",
            "solo",
            "--kv-hash-key",
            "deployment-key",
        ],
    );
    until("the node to register", || !cluster.live_models().is_empty()).await;

    let body = json!({"model": "tiny", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Tell me how prefill and decode share a KV cache, 123456."}]});
    let resp: Value = reqwest::Client::new()
        .post(format!("{http}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("node answers")
        .json()
        .await
        .expect("json");
    let prompt_tokens = resp["usage"]["prompt_tokens"].as_u64().expect("usage") as usize;

    // The gateway's path: analyze → prompt_tokens with the registered tokenizer → hashes.
    let Value::Object(map) = &body else {
        unreachable!()
    };
    let analyzed = analyze(Api::ChatCompletions, map, None).expect("valid request");
    let (tokenizer, block_size) = cluster.model("tiny").expect("registered model");
    assert_eq!(block_size, 4);
    let tokens = pd_tokenize::prompt::prompt_tokens(&tokenizer, analyzed.prompt).expect("tokens");
    assert_eq!(
        tokens.len(),
        prompt_tokens,
        "the gateway counts the prompt as the node does"
    );
    // Keyed with the key the node registered (the gateway never sees it otherwise).
    let key = cluster.hash_key("tiny");
    assert_eq!(key, pd_kv_pool::hash_key("deployment-key"));
    let root = pd_kv_pool::root_hash(key, analyzed.cache_salt.as_deref());
    let hashes: Vec<u64> = pd_kv_pool::hash_full_blocks_from(root, &tokens, block_size as usize)
        .into_iter()
        .map(|h| h.0)
        .collect();
    assert!(hashes.len() >= 10, "a prompt of several blocks");
    let public: Vec<u64> = pd_kv_pool::hash_full_blocks(&tokens, block_size as usize)
        .into_iter()
        .map(|h| h.0)
        .collect();
    // The node reports every full prompt block it cached: the view shows it holds them all.
    until("the node's block hashes", || {
        cluster.snapshot("tiny", &hashes).prefix_blocks == vec![hashes.len() as u32]
    })
    .await;
    let snap = cluster.snapshot("tiny", &hashes);
    assert_eq!(snap.view.nodes[0].role, Role::Standalone);
    // The public (unkeyed) chain matches nothing.
    assert_eq!(cluster.snapshot("tiny", &public).prefix_blocks, vec![0]);
    // A different prompt shares no prefix with it.
    let other = pd_kv_pool::hash_full_blocks(&[7, 7, 7, 7, 7, 7, 7, 7], 4);
    let other: Vec<u64> = other.into_iter().map(|h| h.0).collect();
    assert_eq!(cluster.snapshot("tiny", &other).prefix_blocks, vec![0]);

    // A node with the wrong cluster token never joins.
    refused_node(
        &cluster,
        &model,
        &registry,
        &["--cluster-token", "wrong", "--engine-id", "intruder"],
        &["refused", "cluster token"],
    )
    .await;
    // A node of the same model with another hash key never joins either: its hashes would
    // never match the gateway's.
    refused_node(
        &cluster,
        &model,
        &registry,
        &[
            "--cluster-token",
            "secret",
            "--engine-id",
            "other-key",
            "--kv-hash-key",
            "another-key",
        ],
        &["--kv-hash-key", "differs"],
    )
    .await;

    // A dead node leaves the view at once (its stream ends).
    drop(node);
    until("the dead node to leave", || cluster.read().nodes.is_empty()).await;
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A registration is bounded before anything of it is kept: a name or an address over its
/// length, and a tokenizer bundle over its file count or size, are refused as invalid, and the
/// view stays empty. (Before, only the 64 MiB message cap bounded them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_over_its_bounds_is_refused_as_invalid() {
    use pd_rpc::registry as pb;
    let (cluster, registry) = serve_registry("secret", true).await;
    let register = |f: &dyn Fn(&mut pb::Register)| {
        let mut r = pb::Register {
            protocol_version: pd_gateway::registry::PROTOCOL_VERSION,
            cluster_token: "secret".into(),
            engine_id: "n0".into(),
            model: "m".into(),
            http_addr: "127.0.0.1:9".into(),
            block_size: 16,
            ..pb::Register::default()
        };
        f(&mut r);
        pb::NodeMessage {
            msg: Some(pb::node_message::Msg::Register(r)),
        }
    };
    let file = |name: &str, bytes: usize| pb::TokenizerFile {
        name: name.into(),
        content: "x".repeat(bytes),
    };
    let cases: Vec<(&str, pb::NodeMessage)> = vec![
        ("engine_id", register(&|r| r.engine_id = "e".repeat(300))),
        ("model", register(&|r| r.model = "m".repeat(300))),
        (
            "http_addr",
            register(&|r| r.http_addr = format!("{}:1", "h".repeat(300))),
        ),
        (
            "tokenizer bundle",
            register(&|r| {
                r.tokenizer = Some(pb::TokenizerBundle {
                    files: (0..17).map(|i| file(&format!("f{i}"), 1)).collect(),
                    fingerprint: 0,
                })
            }),
        ),
        (
            "tokenizer bundle",
            register(&|r| {
                r.tokenizer = Some(pb::TokenizerBundle {
                    files: vec![file("tokenizer.json", 49 << 20)],
                    fingerprint: 0,
                })
            }),
        ),
    ];
    for (says, message) in cases {
        let mut client =
            pb::node_registry_client::NodeRegistryClient::connect(format!("http://{registry}"))
                .await
                .unwrap()
                .max_encoding_message_size(64 << 20);
        let status = match client.report(tokio_stream::iter(vec![message])).await {
            Ok(r) => r.into_inner().message().await.expect_err("refused"),
            Err(s) => s,
        };
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{says}: {status:?}"
        );
        assert!(
            status.message().contains(says),
            "{says}: {}",
            status.message()
        );
    }
    assert!(cluster.read().nodes.is_empty());
}
