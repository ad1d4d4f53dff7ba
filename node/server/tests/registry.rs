//! `pd-node serve --gateway`: the real node binary registers with a (test) registry over gRPC and
//! streams its state: load, leases, and the block hashes of its prefix cache. A registry restart
//! does not disturb serving; the node re-registers and resyncs.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use pd_kv_pool::hash_full_blocks;
use pd_model::tiny::{TinySpec, generate};
use pd_report::test_registry::{RegistryLog, TestRegistry, TestRegistryOptions};
use pd_rpc::registry as pb;
use serde_json::{Value, json};

struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const WAIT: Duration = Duration::from_secs(15);

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
    drop(registry);
    drop(node);
}
