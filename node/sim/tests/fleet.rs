//! A fleet registers over the registry protocol (a recording test registry) and answers the
//! `kv_transfer_params` protocol over HTTP: a split answer equals a whole one, token for token.
//! (A real gateway serving through the simulator: the cluster test `simulator`.)

use std::time::Duration;

use pd_node_sim::{Fleet, FleetConfig, Role, Timing};
use pd_report::test_registry::TestRegistry;
use serde_json::{Value, json};

fn config(registry: String) -> FleetConfig {
    FleetConfig {
        roles: vec![
            (Role::Producer, 2),
            (Role::Consumer, 2),
            (Role::Standalone, 1),
        ],
        id_prefix: "t".into(),
        model: "sim".into(),
        host: "127.0.0.1".parse().unwrap(),
        gateways: vec![registry],
        timing: Timing {
            tpot: Duration::from_millis(1),
            ..Timing::default()
        },
        tokenizer: pd_node_sim::byte_level_tokenizer().unwrap(),
        block_size: 4,
        total_blocks: 256,
        max_model_len: 4096,
        lease_duration: Duration::from_secs(30),
        churn: true,
        state_interval: Duration::from_secs(1),
        change_poll: Duration::from_millis(20),
        cluster_token: "token".into(),
        hash_key: 0,
    }
}

async fn post(url: String, body: Value) -> (u16, String) {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_registers_and_a_split_answer_equals_a_whole_one() {
    let registry = TestRegistry::start("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let fleet = Fleet::start(config(registry.addr().to_string()))
        .await
        .unwrap();
    let conns = registry
        .log()
        .wait_for(Duration::from_secs(10), |c| {
            c.len() == 5 && c.iter().all(|c| c.states().count() >= 3)
        })
        .await
        .unwrap();
    let roles: Vec<i32> = conns.iter().map(|c| c.register().unwrap().role).collect();
    assert_eq!(
        roles
            .iter()
            .filter(|&&r| r == pd_rpc::registry::Role::Producer as i32)
            .count(),
        2
    );
    for c in &conns {
        let reg = c.register().unwrap();
        assert!(
            reg.takes_prompt_token_ids && reg.tokenizer.is_some(),
            "{}",
            reg.engine_id
        );
        let producer = reg.role == pd_rpc::registry::Role::Producer as i32;
        assert_eq!(
            !reg.kv_side_channel_addr.is_empty(),
            producer,
            "{}",
            reg.engine_id
        );
    }
    assert_eq!(fleet.registered(), 5);

    let [p, _, d, _, s] = [0, 1, 2, 3, 4].map(|i| fleet.nodes[i].clone());
    let url = |n: &pd_node_sim::SimNode, api: &str| format!("http://{}/v1/{api}", n.id.http);
    let ids: Vec<u32> = (0..10).collect();
    let (code, body) = post(
        url(&p, "completions"),
        json!({"prompt_token_ids": ids, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let handoff: Value = serde_json::from_str(&body).unwrap();
    let params = handoff["kv_transfer_params"].clone();
    assert_eq!(params["remote_num_tokens"], 10);
    assert_eq!(params["remote_block_ids"], json!([0, 1, 2]));
    assert_eq!(p.load.live_leases(), 1);
    let ask = |kv: Option<Value>, stream: bool| {
        let mut b = json!({"prompt_token_ids": (0..10).collect::<Vec<u32>>(), "max_tokens": 6,
            "n": 2, "stream": stream});
        if let Some(kv) = kv {
            b["kv_transfer_params"] = kv;
        }
        b
    };
    let (code, pulled) = post(url(&d, "completions"), ask(Some(params), false)).await;
    assert_eq!(code, 200, "{pulled}");
    assert_eq!(p.load.live_leases(), 0, "the pull released P's lease");
    let (_, whole) = post(url(&s, "completions"), ask(None, false)).await;
    let texts = |b: &str| -> Vec<Value> {
        let v: Value = serde_json::from_str(b).unwrap();
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].clone())
            .collect()
    };
    assert_eq!(texts(&pulled), texts(&whole));
    assert_eq!(
        handoff["choices"][0]["text"].as_str().unwrap(),
        pd_node_sim::word(xxhash_digest(&ids), 0, 0),
        "P's token is the first of the answer"
    );

    // Streamed, usage included: the same text, chunk by chunk.
    let mut b = ask(None, true);
    b["stream_options"] = json!({"include_usage": true});
    let (code, sse) = post(url(&s, "completions"), b).await;
    assert_eq!(code, 200);
    let mut text = [String::new(), String::new()];
    let mut usage = None;
    for data in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        for c in v["choices"].as_array().unwrap() {
            text[c["index"].as_u64().unwrap() as usize] += c["text"].as_str().unwrap();
        }
        if !v["usage"].is_null() {
            usage = Some(v["usage"]["completion_tokens"].clone());
        }
    }
    assert_eq!(text.map(Value::from).to_vec(), texts(&whole));
    assert_eq!(usage, Some(json!(12)));
    assert!(sse.trim_end().ends_with("data: [DONE]"));

    // Refusals are OpenAI errors.
    let (code, body) = post(
        url(&s, "completions"),
        json!({"prompt": "x",
        "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(code, 400);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["param"],
        "kv_transfer_params"
    );
    fleet.shutdown().await;
}

fn xxhash_digest(ids: &[u32]) -> u64 {
    let mut m = serde_json::Map::new();
    m.insert("prompt_token_ids".into(), json!(ids));
    pd_node_sim::Prompt::of(&m).digest
}
