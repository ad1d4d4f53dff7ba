//! `pd-node serve --gateway`: the real node binary registers with a (test) registry over gRPC and
//! streams its state: load, leases, and the block hashes of its prefix cache. A registry restart
//! does not disturb serving; the node re-registers and resyncs. The registration carries the
//! cluster token and the tokenizer files (from which the gateway tokenizes as the node does),
//! and a decode node pulls only from the producers in the gateway's peer list.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pd_kv_pool::hash_full_blocks;
use pd_model::tiny::{TinySpec, generate};
use pd_report::test_registry::{RegistryLog, TestRegistry, TestRegistryOptions};
use pd_rpc::registry as pb;
use pd_tokenize::Tokenizer;
use pd_tokenize::prompt::{ChatMessageIn, PromptKind, chat_messages, prompt_tokens};
use serde_json::{Value, json};

struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const WAIT: Duration = Duration::from_secs(15);

/// Starts `pd-node serve --model dir --port 0 --block-size 4 --served-model-name tiny` plus
/// `args`; returns it and its HTTP base URL once it listens.
fn start(dir: &Path, args: &[&str]) -> (Node, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pd-node"))
        .arg("serve")
        .arg("--model")
        .arg(dir)
        .args(["--port", "0", "--block-size", "4"])
        .args(["--served-model-name", "tiny"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let node = Node(child);
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "pd-node exited");
        if let Some(a) = line.trim().strip_prefix("pd-node listening on ") {
            return (node, a.to_string());
        }
    }
}

async fn post(url: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The value of a Prometheus sample (`name{labels}` exactly as printed), 0 when absent.
async fn metric(http: &str, sample: &str) -> f64 {
    let text = reqwest::get(format!("{http}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == sample).then(|| value.parse().unwrap())
        })
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_registers_streams_state_and_survives_a_registry_restart() {
    let dir = std::env::temp_dir().join(format!("pd-registry-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    generate(&TinySpec::default(), &dir).unwrap();
    let log = RegistryLog::default();
    let options = || TestRegistryOptions {
        state_interval_ms: 50,
        log: Some(log.clone()),
        ..TestRegistryOptions::default()
    };
    let registry = TestRegistry::start_with("127.0.0.1:0".parse().unwrap(), options())
        .await
        .unwrap();
    let gateway = registry.addr();

    let mut child = Command::new(env!("CARGO_BIN_EXE_pd-node"))
        .arg("serve")
        .arg("--model")
        .arg(&dir)
        .args([
            "--port",
            "0",
            "--block-size",
            "4",
            "--num-gpu-blocks",
            "128",
        ])
        .args(["--served-model-name", "tiny", "--kv-role", "kv_producer"])
        .args(["--kv-port", "0", "--engine-id", "p7"])
        .args(["--gateway", &gateway.to_string()])
        .env("PD_CLUSTER_TOKEN", "s3cret")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let node = Node(child);
    let http = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "pd-node exited");
        if let Some(a) = line.trim().strip_prefix("pd-node listening on ") {
            break a.to_string();
        }
    };

    // Registration first, with who and where the node is.
    let conns = log
        .wait_for(WAIT, |c| c.first().is_some_and(|c| c.register().is_some()))
        .await
        .unwrap();
    let reg = conns[0].register().unwrap().clone();
    assert_eq!(reg.engine_id, "p7");
    assert_eq!(reg.role, pb::Role::Producer as i32);
    assert_eq!(
        (reg.model.as_str(), reg.block_size, reg.num_blocks),
        ("tiny", 4, 128)
    );
    assert_eq!(format!("http://{}", reg.http_addr), http);
    assert!(!reg.kv_side_channel_addr.is_empty());
    assert_ne!(reg.compat_hash, 0);
    assert_eq!(reg.cluster_token, "s3cret", "from PD_CLUSTER_TOKEN");

    // The tokenizer, as files: the gateway rebuilds the node's very tokenizer from them.
    let bundle = reg.tokenizer.clone().expect("the tokenizer is sent");
    let files = conns[0].tokenizer_files();
    for name in ["tokenizer.json", "tokenizer_config.json", "config.json"] {
        assert!(files.contains_key(name), "{name} sent: {:?}", files.keys());
    }
    // KV bytes per token: all layers, K and V, every KV head's `head_dim` elements, as the pool
    // stores them (f16 or f32).
    let spec = TinySpec::default();
    let elems = (spec.layers * 2 * spec.kv_heads * (spec.hidden / spec.heads)) as u32;
    assert!(
        [elems * 2, elems * 4].contains(&reg.kv_bytes_per_token),
        "{} bytes per token for {elems} elements",
        reg.kv_bytes_per_token
    );
    let local = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(&files, local.files());
    assert_eq!(bundle.fingerprint, local.fingerprint());
    let rebuilt = Tokenizer::from_files(&files).unwrap();
    assert_eq!(rebuilt.fingerprint(), bundle.fingerprint);
    let messages: Vec<ChatMessageIn> = serde_json::from_value(json!([
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Same ids"}, {"type": "text", "text": "everywhere?"}]},
    ]))
    .unwrap();
    let r: Value = post(
        &format!("{http}/v1/chat/completions"),
        &json!({"model": "tiny", "messages": messages, "max_tokens": 1, "return_token_ids": true}),
    )
    .await
    .json()
    .await
    .unwrap();
    let node_ids: Vec<u32> = r["prompt_token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("prompt_token_ids in {r}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let gateway_ids = prompt_tokens(
        &rebuilt,
        PromptKind::Chat(chat_messages(&messages).unwrap(), "messages"),
    )
    .unwrap();
    assert_eq!(gateway_ids, node_ids);

    // A prefill: its full blocks show up as stored hashes, its lease in the state.
    let body = json!({"model": "tiny", "prompt": "Twenty bytes prompt!", "max_tokens": 1,
        "return_token_ids": true, "kv_transfer_params": {"do_remote_decode": true}});
    let r: Value = reqwest::Client::new()
        .post(format!("{http}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let prompt: Vec<u32> = r["choices"][0]["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let hashes: Vec<u64> = hash_full_blocks(&prompt, 4).iter().map(|h| h.0).collect();
    assert_eq!(hashes.len(), 5);
    log.wait_for(WAIT, |c| {
        let c = &c[0];
        let leased = c
            .states()
            .last()
            .is_some_and(|s| s.leases.is_some_and(|l| l.granted == 1 && l.live == 1));
        let stored = c.stored_hashes();
        leased && hashes.iter().all(|h| stored.contains(h))
    })
    .await
    .unwrap();
    let states: Vec<u64> = log.connections()[0].states().map(|s| s.seq).collect();
    assert!(states.windows(2).all(|w| w[1] == w[0] + 1), "{states:?}");
    let last = log.connections()[0].states().last().cloned().unwrap();
    assert_eq!(last.total_blocks, 128);
    assert_eq!(last.leased_blocks, 5);
    assert_eq!(
        last.free_blocks,
        128 - 5,
        "the lease holds the prompt's 5 blocks"
    );

    // The gateway goes away: the node keeps serving.
    drop(registry.stop().await.unwrap());
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("kv_transfer_params");
    plain["prompt"] = json!("Served while the gateway is down.");
    let r = reqwest::Client::new()
        .post(format!("{http}/v1/completions"))
        .json(&plain)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // It comes back on the same address: the node registers again and resyncs its cache,
    // now including the blocks of the request served meanwhile.
    let registry = TestRegistry::start_with(gateway, options()).await.unwrap();
    let more: Vec<u64> = hash_full_blocks(
        &"Served while the gateway is down."
            .bytes()
            .map(u32::from)
            .collect::<Vec<_>>(),
        4,
    )
    .iter()
    .map(|h| h.0)
    .collect();
    let conns = log
        .wait_for(WAIT, |c| {
            c.len() >= 2 && {
                let c = c.last().unwrap();
                let stored = c.stored_hashes();
                c.register().is_some()
                    && c.resyncs() >= 1
                    && hashes.iter().chain(&more).all(|h| stored.contains(h))
            }
        })
        .await
        .unwrap();
    let second = conns.last().unwrap();
    assert_eq!(second.register().unwrap().epoch, reg.epoch, "same process");
    // The request served meanwhile computed 33 prompt tokens in one step: the node's prefill
    // rate (a moving average, for policies weighing a recompute) rides along in its state.
    log.wait_for(WAIT, |c| {
        c.last().is_some_and(|c| {
            c.states()
                .last()
                .is_some_and(|s| s.prefill_tokens_per_s > 0)
        })
    })
    .await
    .unwrap();
    drop(registry);
    drop(node);
}

/// Posts `body` to D until `done` holds for the status and the body, at most [`WAIT`].
async fn until(url: &str, body: &Value, mut done: impl FnMut(u16, &Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let r = post(url, body).await;
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        if done(status, &v) {
            return v;
        }
        assert!(Instant::now() < deadline, "last answer {status}: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn message(v: &Value) -> &str {
    v["error"]["message"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_node_with_a_gateway_pulls_only_from_the_peers_it_pushed() {
    let dir = std::env::temp_dir().join(format!("pd-registry-peers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    generate(&TinySpec::default(), &dir).unwrap();
    let registry = TestRegistry::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let gateway = registry.addr().to_string();
    let (_p, p) = start(
        &dir,
        &[
            "--kv-role",
            "kv_producer",
            "--kv-port",
            "0",
            "--engine-id",
            "p1",
        ],
    );
    let (_d, d) = start(
        &dir,
        &[
            "--kv-role",
            "kv_consumer",
            "--kv-port",
            "0",
            "--engine-id",
            "d1",
            "--kv-recompute-threshold",
            "0",
            "--gateway",
            &gateway,
        ],
    );
    registry
        .log()
        .wait_for(WAIT, |c| {
            c.iter()
                .any(|c| c.register().is_some_and(|r| r.engine_id == "d1"))
        })
        .await
        .unwrap();

    // P prefills and answers with the params a proxy forwards to D.
    let body = json!({"model": "tiny", "prompt": "A prompt of several blocks for D to pull.",
        "max_tokens": 4, "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let mut prefill = body.clone();
    prefill["max_tokens"] = json!(1);
    prefill["kv_transfer_params"] = json!({"do_remote_decode": true});
    let r: Value = post(&format!("{p}/v1/completions"), &prefill)
        .await
        .json()
        .await
        .unwrap();
    let params = r["kv_transfer_params"].clone();
    let producer = format!(
        "{}:{}",
        params["remote_host"].as_str().unwrap(),
        params["remote_port"].as_u64().unwrap()
    );
    let mut decode = body.clone();
    decode["kv_transfer_params"] = params;
    let url = format!("{d}/v1/completions");

    // No peer list yet: D refuses to contact anyone, before contacting anything.
    let r = post(&url, &decode).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_host");
    assert!(
        message(&e).contains("not registered with the gateway"),
        "{e}"
    );
    let consumed = "pd_node_kv_params_requests_total{directive=\"consume\"}";
    assert_eq!(metric(&d, consumed).await, 1.0, "counted though refused");
    assert_eq!(
        metric(
            &p,
            "pd_node_kv_params_requests_total{directive=\"produce\"}"
        )
        .await,
        1.0
    );
    assert_eq!(metric(&d, "pd_kv_transfer_bytes_total").await, 0.0);

    // A list without this producer: still refused, now saying so.
    registry.send_peers(vec!["10.9.8.7:1".to_string()]);
    let e = until(&url, &decode, |status, v| {
        status == 400 && message(v).contains("not a KV peer registered with the gateway")
    })
    .await;
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_host");
    assert_eq!(metric(&d, "pd_kv_transfer_bytes_total").await, 0.0);

    // The gateway names it: D pulls.
    registry.send_peers(vec!["10.9.8.7:1".to_string(), producer]);
    let r = until(&url, &decode, |status, _| status != 400).await;
    let pulled = r["usage"]["prompt_tokens_details"]["kv_pulled_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("pulled tokens in {r}"));
    assert!(pulled > 0, "{r}");
    assert!(metric(&d, "pd_kv_transfer_bytes_total").await > 0.0);
    assert_eq!(
        metric(
            &d,
            "pd_node_kv_params_requests_total{directive=\"produce\"}"
        )
        .await,
        0.0
    );

    // Requests without params are not counted.
    let before = metric(&d, consumed).await;
    let r = post(&url, &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(metric(&d, consumed).await, before);
}

/// Issue 12: the prefix-cache hash takes a per-deployment key and a per-request `cache_salt`.
/// A node started with `--kv-hash-key` sends the key at registration (the gateway hashes with
/// it) and its cached blocks carry keyed hashes — not the public chain a client could compute.
/// Requests with different salts never share cached blocks; the same salt does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_hashes_take_the_deployment_key_and_the_request_salt() {
    use pd_kv_pool::{hash_full_blocks_from, hash_key, root_hash};
    let dir = std::env::temp_dir().join(format!("pd-registry-key-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    generate(&TinySpec::default(), &dir).unwrap();
    let log = RegistryLog::default();
    let registry = TestRegistry::start_with(
        "127.0.0.1:0".parse().unwrap(),
        TestRegistryOptions {
            state_interval_ms: 50,
            log: Some(log.clone()),
            ..TestRegistryOptions::default()
        },
    )
    .await
    .unwrap();
    let gateway = registry.addr().to_string();
    let (_node, http) = start(&dir, &["--gateway", &gateway, "--kv-hash-key", "k3y"]);
    let key = hash_key("k3y");
    log.wait_for(WAIT, |c| {
        c.first()
            .and_then(|c| c.register())
            .is_some_and(|r| r.kv_hash_key == key)
    })
    .await
    .unwrap();

    let url = format!("{http}/v1/completions");
    let text = "Twenty tokens of salt.";
    let body = |salt: Option<&str>| {
        let mut b = json!({"model": "tiny", "prompt": text, "max_tokens": 1,
            "temperature": 0, "return_token_ids": true});
        if let Some(s) = salt {
            b["cache_salt"] = json!(s);
        }
        b
    };
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    // Unsalted: the keyed chain is what the node caches and reports.
    let r: Value = post(&url, &body(None)).await.json().await.unwrap();
    let prompt: Vec<u32> = r["choices"][0]["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let keyed: Vec<u64> = hash_full_blocks_from(root_hash(key, None), &prompt, 4)
        .iter()
        .map(|h| h.0)
        .collect();
    let public: Vec<u64> = hash_full_blocks(&prompt, 4).iter().map(|h| h.0).collect();
    assert!(!keyed.is_empty());
    log.wait_for(WAIT, |c| {
        let stored = c[0].stored_hashes();
        keyed.iter().all(|h| stored.contains(h))
    })
    .await
    .unwrap();
    let stored = log.connections()[0].stored_hashes();
    assert!(
        public.iter().all(|h| !stored.contains(h)),
        "unkeyed hashes cached"
    );

    // Salts: a first salted request finds nothing (the unsalted blocks are another tenant's),
    // the same salt again finds its blocks, another salt finds nothing.
    let a1: Value = post(&url, &body(Some("tenant-a")))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(cached(&a1), Some(0), "{a1}");
    let a2: Value = post(&url, &body(Some("tenant-a")))
        .await
        .json()
        .await
        .unwrap();
    assert!(cached(&a2).unwrap() > 0, "{a2}");
    let b1: Value = post(&url, &body(Some("tenant-b")))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(cached(&b1), Some(0), "{b1}");
    let again: Value = post(&url, &body(None)).await.json().await.unwrap();
    assert!(cached(&again).unwrap() > 0, "{again}");
    // An empty salt is a 400 naming the field.
    let r = post(&url, &body(Some(""))).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "cache_salt", "{e}");
}
