//! `pd-node serve --kv-port`: the pool lives in UCX memory and the `KvPeer` side channel
//! publishes how to read it. Runs the real binary as a separate process.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use pd_kv_pool::{KvDtype, KvLayout};
use pd_kv_transfer::{CompatInfo, PeerClient};
use pd_model::tiny::{TinySpec, generate};

struct Node {
    child: Child,
    http: String,
    kv: Option<String>,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(model: &std::path::Path, kv: bool) -> Node {
    start_with(model, kv, &[])
}

/// [`start`] with `extra` flags.
fn start_with(model: &std::path::Path, kv: bool, extra: &[&str]) -> Node {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pd-node"));
    cmd.arg("serve").arg("--model").arg(model);
    cmd.args([
        "--port",
        "0",
        "--num-gpu-blocks",
        "64",
        "--served-model-name",
        "tiny",
    ]);
    if kv {
        cmd.args(["--kv-port", "0", "--engine-id", "node-a"]);
    }
    cmd.args(extra);
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn pd-node");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let (mut http, mut kv_addr) = (None, None);
    while http.is_none() {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "pd-node exited before listening"
        );
        if let Some(a) = line.trim().strip_prefix("pd-node listening on ") {
            http = Some(a.to_string());
        }
        if let Some(a) = line.trim().strip_prefix("pd-node kv side channel on ") {
            kv_addr = Some(a.to_string());
        }
    }
    Node {
        child,
        http: http.unwrap(),
        kv: kv_addr,
    }
}

async fn complete(http: &str) -> serde_json::Value {
    let body = serde_json::json!({
        "model": "tiny", "prompt": "The KV pool of this node lives in UCX memory.",
        "max_tokens": 24, "temperature": 0, "ignore_eos": true, "return_token_ids": true
    });
    let r = reqwest::Client::new()
        .post(format!("{http}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_publishes_its_ucx_pool_and_serves_from_it_token_exact() {
    let dir = std::env::temp_dir().join(format!("pd-node-kv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    generate(
        &TinySpec {
            seed: 5,
            ..TinySpec::default()
        },
        &dir,
    )
    .unwrap();
    let with_kv = start(&dir, true);
    let plain = start(&dir, false);

    // Same greedy tokens whether the pool is heap or UCX memory.
    let a = complete(&with_kv.http).await;
    let b = complete(&plain.http).await;
    assert_eq!(a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]);
    assert_eq!(
        a["choices"][0]["token_ids"].as_array().map(Vec::len),
        Some(24)
    );

    let layout = KvLayout {
        num_blocks: 64,
        block_size: 16,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 16,
        dtype: KvDtype::F32,
        order: pd_kv_pool::KvOrder::Hnd,
    };
    let mut client = PeerClient::connect(with_kv.kv.as_deref().unwrap(), "node-b", None)
        .await
        .unwrap();
    // The same model: same name, shapes and weights (its fingerprint).
    let fingerprint = pd_model::ModelSource::open(&dir)
        .unwrap()
        .fingerprint()
        .unwrap();
    let ours = CompatInfo::new("tiny", &layout).with_fingerprint(fingerprint);
    let peer = client.handshake(&ours, 1, false).await.unwrap();
    assert_eq!(peer.engine_id, "node-a");
    assert_eq!(peer.layout, layout);
    assert!(peer.region_len >= layout.pool_bytes() as u64);
    assert!(!peer.rkey.is_empty() && !peer.worker_address.is_empty());
    assert_eq!(
        peer.kv_path, "in-place",
        "the model computes on the registered pool"
    );
    let stats = client.stats().await.unwrap();
    assert_eq!(stats.total_blocks, 64);
    // A node of another model is refused, naming the field.
    let err = client
        .handshake(&CompatInfo::new("other", &layout), 1, false)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("model"), "{err}");
    // So is one with the same name and shapes but other weights.
    let err = client
        .handshake(&ours.clone().with_fingerprint("0000000000000000"), 1, false)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("model_fingerprint"), "{err}");
    // A node computing on a staged pool (as a GPU node does) says so, and answers the same.
    let staged = start_with(&dir, true, &["--kv-staged"]);
    assert_eq!(
        complete(&staged.http).await["choices"][0]["token_ids"],
        a["choices"][0]["token_ids"]
    );
    let mut client = PeerClient::connect(staged.kv.as_deref().unwrap(), "node-b", None)
        .await
        .unwrap();
    let peer = client.handshake(&ours, 1, false).await.unwrap();
    assert_eq!(peer.kv_path, "host-staged");
    let _ = std::fs::remove_dir_all(&dir);
}
