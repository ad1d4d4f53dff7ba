//! P's leases on a prompt's blocks: released at once when a client leaves, renewed while D waits
//! for blocks, given up after `--kv-wait-timeout`, capped by `--kv-max-leased-fraction`, and
//! confirmed by P's lease board alone when it beat a moment ago.

use super::*;

/// A decode node whose 16-block pool is 15/16 held by its own prefill leases (it is `kv_both`,
/// deprecated but working) lasting `lease_secs`: a P/D request of 5 blocks waits for them.
async fn full_decoder(dir: &Path, lease_secs: &str) -> Node {
    full_decoder_with(dir, lease_secs, &[]).await
}

/// [`full_decoder`] with `extra` flags.
async fn full_decoder_with(dir: &Path, lease_secs: &str, extra: &[&str]) -> Node {
    let mut args = vec![
        "--kv-role",
        "kv_both",
        "--kv-port",
        "0",
        "--engine-id",
        "d1",
        "--kv-recompute-threshold",
        "0",
        "--num-gpu-blocks",
        "16",
        "--kv-lease-duration",
        lease_secs,
        "--kv-max-leased-fraction",
        "1",
    ];
    args.extend_from_slice(extra);
    let d = start(dir, &args);
    let api = Api::Completions;
    for i in 0..3 {
        // Distinct first blocks: 3 × 5 blocks, no prefix shared.
        prefill(&d, api, &api.body(&format!("{i} filler prompt no."), 1)).await;
    }
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_d_releases_the_lease_on_p_at_once() {
    let dir = model("abort");
    let p = producer(&dir, &[]);
    // D also produces (kv_both, deprecated but working), so leases can fill its small pool:
    // the P/D request then waits for blocks on D.
    let d = full_decoder(&dir, "30").await;
    let api = Api::Completions;
    assert_eq!(metric(&d, "pd_kv_leases_live").await, 3.0);
    let body = api.body("twenty-token prompt.", 4);
    let params = prefill(&p, api, &body).await;
    assert_eq!(metric(&p, "pd_kv_leases_live").await, 1.0);
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let http = d.http.clone();
    let client = tokio::spawn(async move { post(&http, api.path(), &db).await });
    eventually("D to wait for blocks", async || {
        metric(&d, "pd_node_requests_waiting_remote_kv").await == 1.0
    })
    .await;
    assert_eq!(
        metric(&d, "pd_kv_transfer_bytes_total").await,
        0.0,
        "still waiting"
    );
    client.abort();
    released_and_gone(&p, &d).await;
}

/// P's one lease was released (not expired: well before its 30 s), and D holds no request
/// waiting for KV any more.
async fn released_and_gone(p: &Node, d: &Node) {
    eventually("P's lease released", async || {
        metric(p, "pd_kv_leases_live").await == 0.0
    })
    .await;
    assert_eq!(
        metric(p, "pd_kv_leases_total{event=\"released\"}").await,
        1.0
    );
    eventually("D's request gone", async || {
        metric(d, "pd_node_requests_waiting_remote_kv").await == 0.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_renews_the_lease_while_it_waits_for_blocks() {
    let dir = model("renew");
    let solo = start(&dir, &[]);
    // P's leases last 0.6 s unless renewed.
    let p = producer(&dir, &["--kv-lease-duration", "0.6"]);
    // D's pool is held by its own prefill leases for 2 s, so the P/D request waits that long.
    let d = full_decoder(&dir, "2").await;
    let api = Api::Completions;
    let body = api.body("twenty-token prompt.", 4);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let params = prefill(&p, api, &body).await;
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let got = seen(api, post(&d.http, api.path(), &db).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        got.pulled,
        Some(20),
        "pulled, not recomputed, after waiting"
    );
    // D waited until its own leases expired (one or more) to get blocks.
    assert!(metric(&d, "pd_kv_leases_total{event=\"expired\"}").await >= 1.0);
    assert!(metric(&p, "pd_kv_leases_total{event=\"renewed\"}").await >= 2.0);
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"expired\"}").await,
        0.0
    );
    assert_eq!(
        metric(&p, "pd_kv_leases_total{event=\"released\"}").await,
        1.0
    );
}

/// A producer's lease board that beat a moment ago (its latest grant) confirms a lease on its
/// own: D reads the lease's record right after its reads and does not wait for the producer's
/// answer. Shown with a producer frozen right after its prefill, so its answer never comes
/// while the request runs: D still answers at once, token for token as one node, the whole
/// prompt pulled, counted as a board-alone confirmation. A frozen (or dead) process writes
/// nothing, and the record shows the lease's blocks were not handed out before it stopped, so
/// they are the lease's KV. The window is generous here (10 s) so that a slow machine cannot
/// turn the test into a wait; the default is 50 ms, and a producer silent for longer is heard
/// (`a_frozen_producer_costs_only_its_own_pulls_and_only_until_the_deadline`). After the
/// thaw, the lease is released and both pools are idle.
/// On one host (the board mapped), D asks P nothing once P's board beats: no confirmation
/// alongside its reads (skipped at arrival: `Loader::board_beat_within`) and none after them
/// (the record alone confirms). With `--kv-board-freshness-ms 0` D asks once per request.
/// P counts the confirmations it answered (`pd_kv_leases_total{event="confirmed"}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_lease_board_spares_the_owner_every_confirmation() {
    let dir = model("asks");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    // A 10 s window: a slow machine cannot make the beat look stale at arrival (half of it).
    let board = consumer_with(
        &dir,
        "fail",
        &["--engine-id", "db", "--kv-board-freshness-ms", "10000"],
    );
    let asks = consumer_with(
        &dir,
        "fail",
        &["--engine-id", "da", "--kv-board-freshness-ms", "0"],
    );
    let confirmed = "pd_kv_leases_total{event=\"confirmed\"}";
    let api = Api::Completions;
    for (d, name, per_request) in [(&board, "board", 0.0), (&asks, "asks", 1.0)] {
        // The first request hands D the handshake and maps the board.
        let body = api.body(&format!("{name}: warm-up."), 4);
        through_pd(&p, d, api, &body).await;
        let before = metric(&p, confirmed).await;
        for i in 0..3 {
            let body = api.body(&format!("{i} {name}: {LONG}"), 6);
            let want = seen(api, post(&solo.http, api.path(), &body).await).await;
            let got = through_pd(&p, d, api, &body).await;
            assert_eq!(got.tokens, want.tokens, "{name}");
            assert!(got.pulled.unwrap_or(0) > 0, "{name}");
        }
        assert_eq!(
            metric(&p, confirmed).await - before,
            3.0 * per_request,
            "{name}: confirmations P answered for three requests"
        );
    }
    assert_eq!(
        metric(&board, "pd_kv_lease_board_alone_confirms_total").await,
        4.0
    );
    assert_eq!(
        metric(&asks, "pd_kv_lease_board_alone_confirms_total").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_board_that_beat_a_moment_ago_confirms_without_the_owner() {
    let dir = model("board-alone");
    let (solo, p, d) = warm_pair(&dir, &["--kv-board-freshness-ms", "10000"]).await;
    let api = Api::Completions;
    let alone = "pd_kv_lease_board_alone_confirms_total";
    let before = metric(&d, alone).await;

    let body = api.body(LONG, 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let params = prefill(&p, api, &body).await;
    let frozen = Frozen::new(&p);
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let got = tokio::time::timeout(Duration::from_secs(30), async {
        seen(api, post(&d.http, api.path(), &db).await).await
    })
    .await
    .expect("D waited for its frozen producer's answer");
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(got.texts, want.texts);
    assert_eq!(got.pulled, got.prompt, "the whole prompt pulled");
    assert_eq!(
        metric(&d, alone).await,
        before + 1.0,
        "confirmed on the board alone"
    );
    assert_eq!(
        metric(&d, "pd_kv_lease_confirms_total{via=\"rpc\"}").await,
        0.0
    );

    drop(frozen);
    eventually("P's lease released after the thaw", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
    for m in [
        "pd_node_requests_running",
        "pd_node_requests_waiting",
        "pd_node_requests_waiting_remote_kv",
    ] {
        assert_eq!(metric(&d, m).await, 0.0, "{m}");
    }
}

/// Issue 12: a consumer that cannot get blocks to pull into gives up after `--kv-wait-timeout`
/// and releases the producer's lease at once, instead of holding P's blocks until they expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_gives_up_waiting_for_blocks_and_releases_the_lease() {
    let dir = model("wait");
    let p = producer(&dir, &[]);
    // D's pool stays held by its own leases for 30 s; it waits at most 1 s for blocks.
    let d = full_decoder_with(&dir, "30", &["--kv-wait-timeout", "1"]).await;
    let api = Api::Completions;
    let body = api.body("twenty-token prompt.", 4);
    let params = prefill(&p, api, &body).await;
    assert_eq!(metric(&p, "pd_kv_leases_live").await, 1.0);
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let r = tokio::time::timeout(Duration::from_secs(20), post(&d.http, api.path(), &db))
        .await
        .expect("D gives up waiting");
    assert_eq!(r.status(), 500);
    let e: Value = r.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("no free KV blocks"), "{msg}");
    assert_eq!(
        metric(&d, "pd_kv_transfer_failures_total{reason=\"wait_timeout\"}").await,
        1.0
    );
    released_and_gone(&p, &d).await;
}

/// Issue 12: a prefill node caps the share of its pool that leases may hold
/// (`--kv-max-leased-fraction`): beyond it a prefill for a decode node is a clear 503, while the
/// node's own requests keep being served; once a lease ends the next prefill is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_caps_the_blocks_leases_may_hold() {
    let dir = model("cap");
    let solo = start(&dir, &[]);
    // 16 blocks, leases may hold 8: one 5-block prompt fits, a second would make 10.
    let p = producer(
        &dir,
        &["--num-gpu-blocks", "16", "--kv-max-leased-fraction", "0.5"],
    );
    let d = consumer(&dir, "fail");
    let api = Api::Completions;
    let first = api.body("twenty-token prompt.", 4);
    let params = prefill(&p, api, &first).await;
    assert_eq!(metric(&p, "pd_kv_leases_live").await, 1.0);

    let second = api.body("another twenty tokens.", 4);
    let r = post(&p.http, api.path(), &prefill_body(api, &second)).await;
    assert_eq!(r.status(), 503);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "kv_lease_capacity", "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--kv-max-leased-fraction"), "{msg}");
    assert_eq!(
        metric(&p, "pd_node_kv_lease_capacity_refusals_total").await,
        1.0
    );
    // The node's own (non-P/D) requests are not refused.
    let own = seen(api, post(&p.http, api.path(), &second).await).await;
    let want = seen(api, post(&solo.http, api.path(), &second).await).await;
    assert_eq!(own.tokens, want.tokens);

    // D pulls the first prompt and releases its lease: room again.
    let mut db = first.clone();
    db["kv_transfer_params"] = params;
    let got = seen(api, post(&d.http, api.path(), &db).await).await;
    assert!(got.pulled.unwrap_or(0) > 0);
    eventually("P's lease released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
    let got = through_pd(&p, &d, api, &second).await;
    assert_eq!(got.tokens, want.tokens);
    assert!(got.pulled.unwrap_or(0) > 0);
}
