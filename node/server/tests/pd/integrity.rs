//! D never reads the wrong KV (issue 12): not through a stale handshake with a restarted
//! producer, not on forged or spliced params, not from a pool outside its cluster (the
//! side-channel token).

use super::*;

/// Issue 12's first wrong-KV hole: P restarts under the same engine id and side-channel port.
/// D must not read through its cached handshake with the old incarnation (old worker, old
/// remote key) and then confirm the new incarnation's lease: the params name P's epoch, D
/// handshakes again when it differs, and P refuses lease calls naming another epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_restarted_under_the_same_id_and_port_is_never_read_through_a_stale_handshake() {
    let dir = model("restart");
    let solo = start(&dir, &[]);
    let d = consumer(&dir, "fail");
    let port = free_port().to_string();
    let args = [
        "--kv-role",
        "kv_producer",
        "--kv-port",
        port.as_str(),
        "--engine-id",
        "p0",
    ];
    let api = Api::Completions;
    // Same length, different words: the same number of blocks, different KV.
    let texts = [
        "Alpha prompt: prefill and decode nodes share one KV cache between them.",
        "Omega prompt: a restarted producer must never be read through old keys.",
    ];
    let mut epochs = Vec::new();
    for text in texts {
        let p = start(&dir, &args);
        let body = api.body(text, 12);
        let want = seen(api, post(&solo.http, api.path(), &body).await).await;
        let params = prefill(&p, api, &body).await;
        epochs.push(params["remote_engine_epoch"].clone());
        let mut db = body.clone();
        db["kv_transfer_params"] = params;
        let got = seen(api, post(&d.http, api.path(), &db).await).await;
        assert_eq!(got.tokens, want.tokens, "{text}");
        assert_eq!(got.texts, want.texts, "{text}");
        assert!(got.pulled.is_some_and(|n| n > 0), "{text}: KV was pulled");
        drop(p); // killed; the next one takes the same id and port
    }
    assert!(epochs[0].is_string(), "P names its epoch: {epochs:?}");
    assert_ne!(epochs[0], epochs[1], "a new epoch per process");

    // A proxy that drops `remote_engine_epoch` (D cannot see the restart): D reads through its
    // cached handshake, names that epoch when it confirms, and the new P refuses: the request
    // fails by D's policy ("fail") instead of decoding on the old process's memory.
    let p = start(&dir, &args);
    let body = api.body(
        "Gamma prompt: without the epoch in the params, P itself must refuse.",
        12,
    );
    let mut params = prefill(&p, api, &body).await;
    params
        .as_object_mut()
        .unwrap()
        .remove("remote_engine_epoch");
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let r = post(&d.http, api.path(), &db).await;
    assert!(r.status().is_server_error(), "{}", r.status());
    let text = r.text().await.unwrap();
    assert!(text.contains("stale_epoch"), "{text}");
    assert_eq!(
        metric(&d, "pd_kv_transfer_failures_total{reason=\"stale_epoch\"}").await,
        1.0
    );
    // D forgot the stale handshake: the next request through this P is served exactly.
    let body = api.body("Delta prompt: after the refusal D handshakes afresh.", 12);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;
    let got = through_pd(&p, &d, api, &body).await;
    assert_eq!(got.tokens, want.tokens);
    assert!(got.pulled.is_some_and(|n| n > 0));
}

/// Issue 12's second wrong-KV hole: params whose optional checks (`remote_prompt_hash`,
/// `remote_num_tokens`) were stripped or forged, naming another prompt's blocks of the same
/// count. D must not decode on them nor enter them in its prefix cache under its own prompt's
/// hashes: P binds each lease to the tokens it computed and says so when D confirms; D compares
/// before using the blocks (`prompt_mismatch`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_params_naming_another_prompts_blocks_never_reach_the_answer_or_the_cache() {
    let dir = model("forged");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    let api = Api::Completions;
    // The same block count (`failures_follow_the_policy_and_are_counted` relies on it too).
    let a = api.body(LONG, 12);
    let b = api.body(&LONG.chars().rev().collect::<String>(), 12);
    let want_b = seen(api, post(&solo.http, api.path(), &b).await).await;
    let mut params = prefill(&p, api, &a).await;
    let o = params.as_object_mut().unwrap();
    o.remove("remote_prompt_hash");
    o.remove("remote_num_tokens");
    let mut db = b.clone();
    db["kv_transfer_params"] = params;
    let r = post(&d.http, api.path(), &db).await;
    assert_eq!(r.status(), 500, "A's KV under B's prompt is refused");
    let text = r.text().await.unwrap();
    assert!(text.contains("prompt_mismatch"), "{text}");
    assert_eq!(
        metric(
            &d,
            "pd_kv_transfer_failures_total{reason=\"prompt_mismatch\"}"
        )
        .await,
        1.0
    );
    // D's prefix cache holds nothing of A under B's hashes: B served by D alone is exact.
    let got = seen(api, post(&d.http, api.path(), &b).await).await;
    assert_eq!(got.tokens, want_b.tokens);
    eventually("P's leases released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
}

/// Params whose lease is genuine for D's prompt but whose block ids are another live lease's
/// (both obtained from P, spliced by a client that may send params): D would read the other
/// prompt's KV and the lease it confirms would vouch for D's prompt. P binds each lease to its
/// block ids too and says so at confirm; D compares them with the ids it read
/// (`prompt_mismatch`), and never decodes on or caches the other prompt's KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spliced_params_with_another_leases_blocks_never_reach_the_answer_or_the_cache() {
    let dir = model("spliced");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &[]);
    let d = consumer(&dir, "fail");
    let api = Api::Completions;
    // Two prompts of the same length, so the block lists fit either.
    let a = api.body(LONG, 12);
    let b = api.body(&LONG.chars().rev().collect::<String>(), 12);
    let want_a = seen(api, post(&solo.http, api.path(), &a).await).await;
    let params_a = prefill(&p, api, &a).await;
    let params_b = prefill(&p, api, &b).await;
    assert_ne!(params_a["remote_block_ids"], params_b["remote_block_ids"]);
    let mut spliced = params_a.clone();
    spliced["remote_block_ids"] = params_b["remote_block_ids"].clone();
    let mut da = a.clone();
    da["kv_transfer_params"] = spliced;
    let r = post(&d.http, api.path(), &da).await;
    assert_eq!(r.status(), 500, "B's KV under A's lease is refused");
    let text = r.text().await.unwrap();
    assert!(text.contains("prompt_mismatch"), "{text}");
    // D's prefix cache holds nothing of B under A's hashes: A served by D alone is exact.
    let got = seen(api, post(&d.http, api.path(), &a).await).await;
    assert_eq!(got.tokens, want_a.tokens);
    // B's own lease was never used; it ends by release (D's) or expiry all the same.
    let mut db = b.clone();
    db["kv_transfer_params"] = params_b;
    let want_b = seen(api, post(&solo.http, api.path(), &b).await).await;
    let got_b = seen(api, post(&d.http, api.path(), &db).await).await;
    assert_eq!(got_b.tokens, want_b.tokens);
    eventually("P's leases released", async || {
        metric(&p, "pd_kv_leases_live").await == 0.0
    })
    .await;
}

/// Who may read a pool: a decode node outside the cluster (without its token) refuses the
/// params before any call, its prompt binding keyed otherwise; a caller without the token is
/// refused by the producer's side channel (`UNAUTHENTICATED`, counted), so it cannot
/// handshake, read or touch leases; a node with the token pulls as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_side_channel_requires_the_cluster_token() {
    let dir = model("token");
    let solo = start(&dir, &[]);
    let p = producer(&dir, &["--cluster-token", "s3cret"]);
    let outsider = consumer(&dir, "fail");
    let member = consumer_with(
        &dir,
        "fail",
        &["--engine-id", "d2", "--cluster-token", "s3cret"],
    );
    let api = Api::Completions;
    let body = api.body(LONG, 8);
    let want = seen(api, post(&solo.http, api.path(), &body).await).await;

    let mut db = body.clone();
    let params = prefill(&p, api, &body).await;
    db["kv_transfer_params"] = params.clone();
    let r = post(&outsider.http, api.path(), &db).await;
    assert_eq!(r.status(), 400);
    let text = r.text().await.unwrap();
    assert!(text.contains("remote_prompt_hash"), "{text}");
    let side_channel = format!(
        "http://{}:{}",
        params["remote_host"].as_str().unwrap(),
        params["remote_port"]
    );
    let mut caller = pd_kv_transfer::peer::PeerClient::connect(&side_channel, "d9", None)
        .await
        .unwrap();
    let err = caller
        .confirm(pd_kv_pool::LeaseId(1), 1)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("cluster token"), "{err}");
    assert!(metric(&p, "pd_kv_side_channel_refused_total").await >= 1.0);
    assert_eq!(
        metric(&outsider, "pd_node_kv_pulled_tokens_total").await,
        0.0
    );

    let got = through_pd(&p, &member, api, &body).await;
    assert_eq!(got.tokens, want.tokens);
    assert!(got.pulled.is_some_and(|n| n > 0));
}
