//! Conversation routing from the nodes (issue 46): two gateways, one P and two D reporting to
//! both, the decode nodes keeping each finished turn (`--kv-retain-after-decode`), the shipped
//! `prefix-aware` policy deciding.
//!
//! A chat conversation's turn 1 goes through gateway 1 (which relays the answer and captures the
//! retained turn's params); turn 2, the client resending the history, goes through gateway 2,
//! which never saw that answer. The holder reports the turn on its registry stream, so gateway 2
//! indexed it (`pd_gateway_reported_turns_total{event="added"}`) and uses the holder's KV for
//! turn 2 (`pd_gateway_reverse_pulls_total`): sent to the holder, which serves the history from
//! its cache, or the history pulled back from it, as the policy weighs the holder's load; both
//! turns equal a standalone node's, token for token. Turn 1's lease ended there, and the
//! node's report of it takes turn 1 out of gateway 1's index too.
//!
//! With the nodes' reporting off (`--report-retained-turns false`) the same conversation is
//! still token-exact, but gateway 2 knows no holder: nothing reported, no retained turn used
//! (what every gateway but the one that relayed the answer did before).

use std::time::Duration;

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{Node, SeveralGateways, SeveralSpec, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::metrics::scrape;
use serde_json::{Value, json};

async fn start(name: &str, report: bool) -> SeveralGateways {
    let policy = bins::policy("prefix-aware");
    SeveralGateways::start(
        name,
        SeveralSpec {
            gateways: 2,
            prefill: 1,
            decode: 2,
            gateway_args: args(&[
                "--policy",
                policy.to_str().expect("utf-8 path"),
                "--decision-log-every",
                "1",
            ]),
            prefill_args: args(&["--kv-recompute-threshold", "0"]),
            decode_args: args(&[
                "--kv-retain-after-decode",
                "60",
                "--report-retained-turns",
                if report { "true" } else { "false" },
            ]),
            ..SeveralSpec::default()
        },
    )
    .await
}

fn chat(messages: &[Value]) -> Value {
    json!({"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0,
           "ignore_eos": true, "return_token_ids": true})
}

async fn post(client: &reqwest::Client, base: &str, body: &Value) -> Value {
    let url = format!("{base}/v1/chat/completions");
    let resp = client
        .post(&url)
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = resp.status();
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 200, "POST {url}: {v}");
    v
}

/// Turn 1 through gateway 1, turn 2 (the history resent) through gateway 2, each compared with
/// the reference; returns gateway 2's metrics after turn 2 and turn 2's answer.
async fn conversation_across_gateways(
    c: &SeveralGateways,
    report: bool,
) -> (pd_cluster_tests::metrics::Metrics, Value) {
    let reference = Node::reference(c.dir(), &c.model);
    let mut history = vec![json!({"role": "user",
        "content": "Name three rivers of Europe, and say which is the longest of them."})];
    let first = post(&c.client, &c.gateways[0].http, &chat(&history)).await;
    let want = post(&c.client, &reference.http, &chat(&history)).await;
    assert_eq!(
        first["choices"][0]["token_ids"],
        want["choices"][0]["token_ids"]
    );
    assert_eq!(
        first["choices"][0]["message"]["content"],
        want["choices"][0]["message"]["content"]
    );
    assert!(
        first.get("kv_transfer_params").is_none(),
        "retained params never reach an untrusted client: {first}"
    );
    let g1 = scrape(&c.client, &c.gateways[0].http).await;
    assert_eq!(g1.sum("pd_gateway_retained_turns_total", &[]), 1.0);

    // Gateway 2 learns of the turn only from the holder's registry stream.
    if report {
        eventually(
            "gateway 2 indexed the turn the holder reported",
            Duration::from_secs(5),
            async || {
                let g2 = scrape(&c.client, &c.gateways[1].http).await;
                g2.sum("pd_gateway_reported_turns_total", &[("event", "added")]) >= 1.0
                    && g2.sum("pd_gateway_conversation_holdings", &[]) >= 1.0
            },
        )
        .await;
    } else {
        // As long as a report would have taken.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    history
        .push(json!({"role": "assistant", "content": first["choices"][0]["message"]["content"]}));
    history.push(json!({"role": "user", "content": "And the shortest?"}));
    let second = post(&c.client, &c.gateways[1].http, &chat(&history)).await;
    let want = post(&c.client, &reference.http, &chat(&history)).await;
    assert_eq!(
        second["choices"][0]["token_ids"],
        want["choices"][0]["token_ids"]
    );
    assert_eq!(
        second["choices"][0]["message"]["content"],
        want["choices"][0]["message"]["content"]
    );
    assert!(second.get("kv_transfer_params").is_none(), "{second}");
    (scrape(&c.client, &c.gateways[1].http).await, second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_through_another_gateway_reaches_the_node_holding_the_conversation() {
    let c = start("reported-turns", true).await;
    let (g2, second) = conversation_across_gateways(&c, true).await;
    // Gateway 2 found the turn and used its KV: turn 2 went whole to the holder (which serves
    // the history from its cache), or the history was pulled back from it (by P, or by the
    // decode node the policy preferred: the holder's load decides).
    let how = |h: &str| g2.sum("pd_gateway_reverse_pulls_total", &[("how", h)]);
    let (holder, by_p, by_d) = (how("holder"), how("prefill_pulls"), how("decode_pulls"));
    assert_eq!(
        holder + by_p + by_d,
        1.0,
        "gateway 2 used the holder's KV for turn 2: {}\ngateway 2's log:\n{}",
        g2.show("pd_gateway_reverse_pulls_total"),
        c.gateways[1].proc.log_tail(40)
    );
    let details = &second["usage"]["prompt_tokens_details"];
    let tokens = |k: &str| details[k].as_u64().unwrap_or(0);
    if holder == 1.0 {
        assert!(
            tokens("cached_tokens") >= 16,
            "the holder served the history from its cache: {second}"
        );
    } else if by_p == 1.0 {
        // P pulled the held blocks it lacked (none when its own cache kept the whole history).
        let p = c.node_metrics("p0").await;
        let reused = p.sum("pd_node_kv_pulled_tokens_total", &[])
            + p.sum("pd_node_prefix_cache_hits_total", &[]);
        assert!(
            reused >= 16.0,
            "P took the history from the holder or its own cache: {} {}",
            p.show("pd_node_kv_pulled_tokens_total"),
            p.show("pd_node_prefix_cache_hits_total")
        );
    } else {
        assert!(
            tokens("kv_pulled_tokens") >= 16,
            "the decode node pulled the history back: {second}"
        );
    }
    assert_eq!(g2.sum("pd_gateway_retained_turns_total", &[]), 1.0);
    assert_eq!(
        g2.sum("pd_gateway_reported_turns_total", &[("event", "refused")]),
        0.0
    );
    // Turn 1's lease ended on the holder (released there, or pulled): the node said so, and
    // gateway 1, which captured turn 1 from the answer it relayed, forgot it and learned turn 2
    // instead. Both gateways index one turn, the last.
    for g in 0..2 {
        eventually(
            "each gateway indexes only the conversation's last turn",
            Duration::from_secs(5),
            async || {
                let m = scrape(&c.client, &c.gateways[g].http).await;
                m.sum("pd_gateway_reported_turns_total", &[("event", "removed")]) >= 1.0
                    && m.sum("pd_gateway_conversation_holdings", &[]) == 1.0
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_nodes_reports_another_gateway_does_not_know_the_holder() {
    let c = start("reported-turns-off", false).await;
    let (g2, _) = conversation_across_gateways(&c, false).await;
    assert_eq!(g2.sum("pd_gateway_reported_turns_total", &[]), 0.0);
    assert_eq!(
        g2.sum("pd_gateway_reverse_pulls_total", &[]),
        0.0,
        "gateway 2 knew of no retained turn: {}",
        g2.show("pd_gateway_reverse_pulls_total")
    );
}
