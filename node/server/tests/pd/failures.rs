//! When the hand-off fails: the failure policy and its counters, a producer with other weights
//! refused, a frozen producer costing only its own pulls until the deadline, and keep-alive
//! comments on a stream waiting for its KV.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_follow_the_policy_and_are_counted() {
    let dir = model("fail");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &["--kv-lease-duration", "0.6"]);
    let d_fail = consumer(&dir, "fail");
    let d_recompute = consumer(&dir, "recompute");
    let api = Api::Completions;
    let body = api.body(LONG, 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;

    // Lease expired before the pull: P frees the blocks; D must not use whatever they hold.
    let params = prefill(&p, api, &body).await;
    eventually("the lease to expire on P", async || {
        metric(&p, "pd_kv_leases_total{event=\"expired\"}").await == 1.0
    })
    .await;
    let mut db = body.clone();
    db["kv_transfer_params"] = params.clone();
    let r = post(&d_fail.http, api.path(), &db).await;
    assert_eq!(r.status(), 500);
    let e: Value = r.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("lease_expired"), "{msg}");
    let got = seen(api, post(&d_recompute.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.pulled, None, "nothing pulled: recomputed");
    assert_eq!(recomputes(&d_recompute, "lease_expired").await, 1.0);

    // Forged lease id: never served.
    let fresh = prefill(&p, api, &body).await;
    let mut forged = fresh.clone();
    forged["remote_lease_id"] = json!("0123456789abcdef0123456789abcdef");
    db["kv_transfer_params"] = forged;
    let got = seen(api, post(&d_recompute.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(recomputes(&d_recompute, "lease_expired").await, 2.0);

    // A list form longer than n (one object per completion at most): a 400 before anything is
    // contacted.
    let mut long_list = body.clone();
    long_list["kv_transfer_params"] = json!([fresh.clone(), fresh.clone()]);
    let r = post(&d_fail.http, api.path(), &long_list).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("n = 1"),
        "{e}"
    );

    // Params of another prompt: a 400 naming what does not fit, before any read; P's lease is
    // released at once (not left to expire).
    let released = metric(&p, "pd_kv_leases_total{event=\"released\"}").await;
    let mut other = body.clone();
    other["prompt"] = json!("A different prompt of another length.");
    other["kv_transfer_params"] = fresh.clone();
    let r = post(&d_fail.http, api.path(), &other).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_block_ids");
    let same_length: String = LONG.chars().rev().collect();
    other["prompt"] = json!(same_length);
    let r = post(&d_recompute.http, api.path(), &other).await;
    assert_eq!(r.status(), 400, "a bad request whatever the failure policy");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_prompt_hash");
    eventually("P's lease released after the 400", async || {
        metric(&p, "pd_kv_leases_total{event=\"released\"}").await == released + 1.0
    })
    .await;

    // A producer outside `--kv-allowed-peers`: refused before it is contacted (SSRF guard).
    let d_strict = start(
        &dir,
        &[
            "--kv-role",
            "kv_consumer",
            "--kv-port",
            "0",
            "--engine-id",
            "d3",
            "--kv-allowed-peers",
            "10.9.8.7,p.example:1",
        ],
    );
    db["kv_transfer_params"] = fresh.clone();
    let r = post(&d_strict.http, api.path(), &db).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_host");
    assert_eq!(metric(&d_strict, "pd_kv_transfer_bytes_total").await, 0.0);
    // Under `recompute` the producer is not contacted either, and the prompt is computed here
    // (a producer the gateways stopped listing after the request was routed to it).
    let d_strict_recompute = start(
        &dir,
        &[
            "--kv-role",
            "kv_consumer",
            "--kv-port",
            "0",
            "--engine-id",
            "d4",
            "--kv-allowed-peers",
            "10.9.8.7",
            "--kv-load-failure-policy",
            "recompute",
        ],
    );
    let got = seen(api, post(&d_strict_recompute.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        metric(
            &d_strict_recompute,
            "pd_kv_recompute_total{reason=\"peer_not_allowed\"}"
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&d_strict_recompute, "pd_kv_transfer_bytes_total").await,
        0.0
    );

    // Incomplete params: no pull, as vLLM; counted.
    let mut partial = fresh;
    partial.as_object_mut().unwrap().remove("remote_host");
    db["kv_transfer_params"] = partial;
    let got = seen(api, post(&d_fail.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        metric(
            &d_fail,
            "pd_kv_params_incomplete_total{field=\"remote_host\"}"
        )
        .await,
        1.0
    );

    // Malformed params: 400 naming the field, on D and on P.
    db["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_block_ids": "1,2"});
    let r = post(&d_fail.http, api.path(), &db).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params.remote_block_ids");
    db["kv_transfer_params"] = json!({"do_remote_decode": "yes"});
    let r = post(&p.http, api.path(), &db).await;
    assert_eq!(r.status(), 400);
    // A standalone node refuses P/D requests instead of silently computing.
    db["kv_transfer_params"] = json!({"do_remote_decode": true});
    let r = post(&solo.http, api.path(), &db).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "kv_transfer_params");

    // P killed after its prefill, and dead for longer than D trusts its lease board alone (a
    // moment after its last grant D would read the dead process's leased blocks, intact, from
    // the mapping: `a_lease_board_that_beat_a_moment_ago_confirms_without_the_owner`).
    let params = prefill(&p, api, &body).await;
    drop(p);
    tokio::time::sleep(BOARD_FRESHNESS * 5).await;
    db["kv_transfer_params"] = params;
    let r = post(&d_fail.http, api.path(), &db).await;
    assert_eq!(r.status(), 500);
    let got = seen(api, post(&d_recompute.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    let total: f64 = {
        let mut t = 0.0;
        for reason in [
            "peer_unreachable",
            "transfer_error",
            "rpc_error",
            "lease_expired",
        ] {
            t += recomputes(&d_recompute, reason).await;
        }
        t
    };
    assert_eq!(total, 3.0, "the dead producer's recompute is counted");
    // D itself is fine and serves on.
    let again = seen(api, post(&d_recompute.http, api.path(), &body).await).await;
    assert_eq!(again.tokens, want.tokens);
}

/// A stream with nothing to say (here: D waiting for a frozen producer's KV) sends SSE
/// comments every `--sse-keep-alive`, so proxies and clients with idle timeouts keep it open;
/// once the producer thaws, the same stream carries the answer, equal to one node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_sends_keep_alive_comments_until_its_answer() {
    let dir = model("keep-alive");
    let (solo, p, d) = warm_pair(&dir, &["--sse-keep-alive", "0.2"]).await;
    let api = Api::Completions;

    let body = api.body("a prompt whose producer freezes while D waits.", 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let params = prefill(&p, api, &body).await;
    let frozen = Frozen::past_the_board(&p);
    let mut db = body.clone();
    db["stream"] = json!(true);
    db["stream_options"] = json!({"include_usage": true});
    db["kv_transfer_params"] = params;
    let mut resp = post(&d.http, api.path(), &db).await;
    assert_eq!(resp.status(), 200);
    // 1.5 s of a frozen producer: comments only (several), no data.
    let mut text = String::new();
    let _ = tokio::time::timeout(Duration::from_millis(1500), async {
        while let Some(chunk) = resp.chunk().await.unwrap() {
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    })
    .await;
    let comments = text.lines().filter(|l| l.starts_with(':')).count();
    assert!(comments >= 2, "keep-alive comments while frozen: {text:?}");
    assert!(
        !text.contains("data:"),
        "data while the producer is frozen: {text:?}"
    );
    drop(frozen);
    while let Some(chunk) = resp.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let got = seen_sse(api, &text);
    assert_eq!(got.texts, want.texts);
    assert!(got.pulled.unwrap_or(0) > 0, "the answer came from P's KV");
}

/// CPU seconds (user + system) process `pid` has used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / hz
}

/// Issue 12, "never stall": a producer frozen with `SIGSTOP` while D pulls from it. Its pull ends
/// at D's deadline (`--kv-pull-timeout`) and follows the failure policy (recompute: the answer is
/// still exact); pulls from a second producer keep flowing meanwhile; D does not spin while it
/// waits (under 10% of a core); afterwards both producers and D are idle.
///
/// Run under the default transports (shared memory: the reads themselves do not need P, the
/// lease confirmation does) and under `UCX_TLS=tcp` (the reads need P's progress too). Before
/// the fix, the first hung for the side channel's 10 s call timeout and the second forever,
/// with the single puller thread spinning and every other pull queued behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_producer_costs_only_its_own_pulls_and_only_until_the_deadline() {
    for tls in [None, Some("tcp")] {
        frozen_producer(tls).await;
    }
}

async fn frozen_producer(tls: Option<&str>) {
    let name = tls.unwrap_or("default");
    let dir = model(&format!("frozen-{name}"));
    let env: Vec<(&str, &str)> = tls.map(|t| vec![("UCX_TLS", t)]).unwrap_or_default();
    let solo = start(&dir, &[]);
    let producer_args = |id: &'static str| {
        [
            "--kv-role",
            "kv_producer",
            "--kv-port",
            "0",
            "--engine-id",
            id,
            "--kv-lease-duration",
            "3",
        ]
    };
    let p1 = start_env(&dir, &producer_args("p1"), &env);
    let p2 = start_env(&dir, &producer_args("p2"), &env);
    let timeout = 5.0;
    let d = consumer_env(
        &dir,
        "recompute",
        &["--engine-id", "d1", "--kv-pull-timeout", "5"],
        &env,
    );
    let api = Api::Completions;
    // Warm: D has handshaken and connected to both producers.
    for (i, p) in [&p1, &p2].into_iter().enumerate() {
        let body = api.body(&format!("{i} {name} warm-up prompt of some blocks."), 4);
        let got = through_pd(p, &d, api, &body).await;
        assert!(got.pulled.unwrap_or(0) > 0, "{name}: warm-up pulled");
    }

    let body_a = api.body(&format!("{name}: a prompt whose producer freezes."), 8);
    let want_a = seen(api, post(&solo.http, api.path(), &body_a).await).await;
    let params_a = prefill(&p1, api, &body_a).await;
    let frozen = Frozen::past_the_board(&p1);
    let mut db = body_a.clone();
    db["kv_transfer_params"] = params_a;
    let started = Instant::now();
    let http = d.http.clone();
    let a = tokio::spawn(async move { seen(api, post(&http, api.path(), &db).await).await });

    // While A's pull is stalled, D idles: no spinning on the frozen peer.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (cpu0, t0) = (cpu_seconds(d.child.id()), Instant::now());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let used = (cpu_seconds(d.child.id()) - cpu0) / t0.elapsed().as_secs_f64();
    if a.is_finished() {
        let early = a.await;
        panic!("{name}: A ended while its producer was frozen: {early:?}");
    }
    assert!(
        used < 0.10,
        "{name}: D used {:.0}% of a core while its pull waited on a frozen producer",
        used * 100.0
    );

    // Pulls from the other producer flow meanwhile.
    for i in 0..2 {
        let body = api.body(&format!("{i} {name}: through the live producer."), 8);
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let got = through_pd(&p2, &d, api, &body).await;
        assert_eq!(got.tokens, want.tokens, "{name}");
        assert!(got.pulled.unwrap_or(0) > 0, "{name}: pulled from P2");
    }
    assert!(
        !a.is_finished(),
        "{name}: P2's pulls completed while A still waits on the frozen P1"
    );

    // A ends by its deadline, recomputed on D: still exact.
    let got_a = tokio::time::timeout(Duration::from_secs(30), a)
        .await
        .unwrap_or_else(|_| panic!("{name}: the pull from a frozen producer never ended"))
        .unwrap();
    let took = started.elapsed().as_secs_f64();
    assert!(
        took < timeout * 1.6,
        "{name}: A took {took:.1} s with a {timeout} s pull deadline"
    );
    assert_eq!(got_a.tokens, want_a.tokens, "{name}");
    assert_eq!(
        got_a.pulled.unwrap_or(0),
        0,
        "{name}: recomputed, not pulled"
    );
    assert_eq!(recomputes(&d, "deadline").await, 1.0, "{name}");
    assert_eq!(
        metric(&d, "pd_kv_transfer_failures_total{reason=\"deadline\"}").await,
        1.0,
        "{name}"
    );

    // Thawed: every pool is idle again (A's lease released or expired).
    drop(frozen);
    for (node, what) in [(&p1, "P1"), (&p2, "P2")] {
        eventually(&format!("{name}: {what}'s leases gone"), async || {
            metric(node, "pd_kv_leases_live").await == 0.0
        })
        .await;
    }
    for m in [
        "pd_node_requests_running",
        "pd_node_requests_waiting",
        "pd_node_requests_waiting_remote_kv",
    ] {
        assert_eq!(metric(&d, m).await, 0.0, "{name}: {m}");
    }
    // P1 serves again, through a fresh endpoint, once D's cool-off for it passed (for one pull
    // timeout after A's deadline D computes P1's prompts itself; then one request probes P1).
    tokio::time::sleep(Duration::from_secs_f64(timeout)).await;
    let body = api.body(&format!("{name}: P1 after the thaw."), 4);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let got = through_pd(&p1, &d, api, &body).await;
    assert_eq!(got.tokens, want.tokens, "{name}");
    assert!(got.pulled.unwrap_or(0) > 0, "{name}: pulled from P1 again");
}

/// Issue 12: the compatibility check covers the weights, not only shapes and the served name.
/// P and D serve "tiny" with the same shapes and tokenizer but different weights: D must never
/// decode on P's KV (it would answer 200 with another model's continuation). The handshake is
/// refused naming `model_fingerprint`; under `recompute` D answers from its own model, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_with_other_weights_under_the_same_name_is_refused() {
    let ours = model_seeded("fp-ours", 21);
    let theirs = model_seeded("fp-theirs", 22);
    let solo = start(&ours, &[]);
    let p = producer(&theirs, &[]);
    let d_fail = consumer(&ours, "fail");
    let d_recompute = consumer_with(&ours, "recompute", &["--engine-id", "d2"]);
    let api = Api::Completions;
    let body = api.body(LONG, 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;

    let params = prefill(&p, api, &body).await;
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let r = post(&d_fail.http, api.path(), &db).await;
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("model_fingerprint"), "{text}");

    let params = prefill(&p, api, &body).await;
    db["kv_transfer_params"] = params;
    let got = seen(api, post(&d_recompute.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.pulled.unwrap_or(0), 0);
    assert_eq!(recomputes(&d_recompute, "handshake_refused").await, 1.0);
}
