//! Issue 12's soak: 2 P + 2 D under aborts and a producer restart.

use super::*;

/// What happened to one soak operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SoakOutcome {
    /// Answered through P and D, token-exact with the standalone node.
    Exact,
    /// The client left before P answered.
    AbortBeforeP,
    /// The client left right after sending D its request (before or during the pull).
    AbortDuringPull,
    /// The client left after D's first streamed token.
    AbortDuringDecode,
    /// P could not be reached or failed (its restart): nothing to compare.
    ProducerDown,
}

/// One soak operation on prompt `i`, through producer `ps[0]` (or `ps[1]` when the first cannot
/// answer, as a proxy fails over) and consumer `d`.
async fn soak_op(i: usize, ps: [&str; 2], d: &str, solo: &str) -> SoakOutcome {
    let api = Api::Completions;
    let mut body = api.body(
        &format!("{i} soak: prefill here, decode there, abort sometimes."),
        6,
    );
    let stream = i.is_multiple_of(3);
    if stream {
        body = streaming(api, &body);
    }
    let client = reqwest::Client::new();
    let pb = prefill_body(api, &body);
    let send_p = {
        let (client, pb) = (client.clone(), pb.clone());
        let ps = [ps[0].to_string(), ps[1].to_string()];
        async move {
            let first = client
                .post(format!("{}{}", ps[0], api.path()))
                .json(&pb)
                .send()
                .await;
            match first {
                Ok(r) if r.status() == 200 => Ok(r),
                _ => {
                    client
                        .post(format!("{}{}", ps[1], api.path()))
                        .json(&pb)
                        .send()
                        .await
                }
            }
        }
    };
    if i % 10 == 1 {
        // Leave before P answers (sometimes before it even got the request).
        let t = tokio::spawn(send_p);
        tokio::time::sleep(Duration::from_micros((i as u64 * 137) % 3000)).await;
        t.abort();
        return SoakOutcome::AbortBeforeP;
    }
    let params = match send_p.await {
        Ok(r) if r.status() == 200 => match seen(api, r).await.kv {
            Some(kv) => kv,
            None => return SoakOutcome::ProducerDown,
        },
        _ => return SoakOutcome::ProducerDown,
    };
    let mut db = body.clone();
    db["kv_transfer_params"] = params;
    let send_d = client.post(format!("{d}{}", api.path())).json(&db).send();
    match i % 10 {
        2 => {
            let t = tokio::spawn(send_d);
            tokio::time::sleep(Duration::from_micros((i as u64 * 71) % 1500)).await;
            t.abort();
            SoakOutcome::AbortDuringPull
        }
        3 => {
            let mut b = db.clone();
            b = streaming(api, &b);
            let mut r = client
                .post(format!("{d}{}", api.path()))
                .json(&b)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            // The first event carries the first token; then the client is gone.
            let _ = r.chunk().await;
            drop(r);
            SoakOutcome::AbortDuringDecode
        }
        _ => {
            let got = seen(api, send_d.await.unwrap()).await;
            let want = seen(api, post(solo, api.path(), &body).await).await;
            assert_eq!(got.tokens, want.tokens, "op {i}");
            assert_eq!(got.texts, want.texts, "op {i}");
            SoakOutcome::Exact
        }
    }
}

/// Issue 12's soak: 2 P + 2 D (recompute on failure), 500 operations from 6 concurrent clients,
/// a tenth of them leaving before P answers, a tenth right after sending D its request (during
/// the pull), a tenth after the first streamed token; P1 is killed and restarted under the same
/// engine id and ports midway. Every completed answer equals the standalone node's; afterwards
/// every pool is idle within the lease TTL + 1 s (no lease left, no block referenced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_two_producers_two_consumers_with_aborts_and_a_producer_restart() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    const OPS: usize = 500;
    const TTL: f64 = 2.0;
    let dir = model("soak");
    let solo = start(&dir, &[]);
    let (http1, kv1) = (free_port().to_string(), free_port().to_string());
    let ttl = TTL.to_string();
    let p1_args: Vec<String> = [
        "--kv-role",
        "kv_producer",
        "--port",
        &http1,
        "--kv-port",
        &kv1,
        "--engine-id",
        "p1",
        "--kv-lease-duration",
        &ttl,
        "--num-gpu-blocks",
        "2048",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let start_p1 = || {
        let args: Vec<&str> = p1_args.iter().map(String::as_str).collect();
        start(&dir, &args)
    };
    let p1 = Arc::new(Mutex::new(Some(start_p1())));
    let p1_http = p1.lock().unwrap().as_ref().unwrap().http.clone();
    let p2 = start(
        &dir,
        &[
            "--kv-role",
            "kv_producer",
            "--kv-port",
            "0",
            "--engine-id",
            "p2",
            "--kv-lease-duration",
            &ttl,
            // Room for the leases that clients leaving before D strand until their TTL.
            "--num-gpu-blocks",
            "2048",
        ],
    );
    let d1 = consumer_with(&dir, "recompute", &["--engine-id", "d1"]);
    let d2 = consumer_with(&dir, "recompute", &["--engine-id", "d2"]);
    let ps = [p1_http.clone(), p2.http.clone()];
    let ds = [d1.http.clone(), d2.http.clone()];

    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let outcomes: Arc<Mutex<HashMap<SoakOutcome, usize>>> = Arc::default();
    let mut clients = Vec::new();
    for _ in 0..6 {
        let (next, done, outcomes) = (next.clone(), done.clone(), outcomes.clone());
        let (ps, ds, solo) = (ps.clone(), ds.clone(), solo.http.clone());
        clients.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= OPS {
                    return;
                }
                let order = [ps[i % 2].as_str(), ps[(i + 1) % 2].as_str()];
                let o = soak_op(i, order, &ds[(i / 2) % 2], &solo).await;
                *outcomes.lock().unwrap().entry(o).or_default() += 1;
                done.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    // Midway, P1 dies and comes back under the same id and ports (a new epoch).
    while done.load(Ordering::SeqCst) < OPS / 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Params from the old incarnation, used after it died: D must recompute, exactly.
    let api = Api::Completions;
    let stale_body = api.body("Stale params: their producer restarted meanwhile.", 6);
    let old = p1.lock().unwrap().take().expect("P1 runs");
    let stale = prefill(&old, api, &stale_body).await;
    drop(old);
    tokio::time::sleep(Duration::from_millis(200)).await;
    *p1.lock().unwrap() = Some(start_p1());
    let mut db = stale_body.clone();
    db["kv_transfer_params"] = stale;
    let got = seen(api, post(&d1.http, api.path(), &db).await).await;
    let want = seen(api, post(&solo.http, api.path(), &stale_body).await).await;
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(
        got.pulled.unwrap_or(0),
        0,
        "recomputed, not read from a dead process"
    );
    assert_eq!(recomputes(&d1, "stale_epoch").await, 1.0);
    for c in clients {
        c.await.unwrap();
    }
    let ended = Instant::now();
    let outcomes = outcomes.lock().unwrap().clone();
    eprintln!("soak outcomes: {outcomes:?}");
    let count = |o| outcomes.get(&o).copied().unwrap_or(0);
    assert_eq!(outcomes.values().sum::<usize>(), OPS);
    assert!(count(SoakOutcome::Exact) >= OPS / 2, "{outcomes:?}");
    for o in [
        SoakOutcome::AbortBeforeP,
        SoakOutcome::AbortDuringPull,
        SoakOutcome::AbortDuringDecode,
    ] {
        assert!(count(o) >= OPS / 20, "{o:?}: {outcomes:?}");
    }

    // Idle within the lease TTL + 1 s: no lease, no request, every block free.
    let p1 = p1.lock().unwrap().take().unwrap();
    let deadline = Duration::from_secs_f64(TTL + 1.0);
    for (node, name) in [(&p1, "P1"), (&p2, "P2"), (&d1, "D1"), (&d2, "D2")] {
        loop {
            let idle = metric(node, "pd_kv_leases_live").await == 0.0
                && metric(node, "pd_node_requests_running").await == 0.0
                && metric(node, "pd_node_requests_waiting").await == 0.0
                && metric(node, "pd_node_requests_waiting_remote_kv").await == 0.0
                && metric(node, "pd_node_kv_blocks_free").await
                    == metric(node, "pd_node_kv_blocks_capacity").await;
            if idle {
                break;
            }
            assert!(
                ended.elapsed() < deadline,
                "{name} not idle {:.1} s after the soak",
                ended.elapsed().as_secs_f64()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // The KV really moved during the soak, and the restarted P1 served too.
    for d in [&d1, &d2] {
        assert!(metric(d, "pd_node_kv_pulled_tokens_total").await > 0.0);
        let text = reqwest::get(format!("{}/metrics", d.http))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for l in text
            .lines()
            .filter(|l| l.starts_with("pd_kv_recompute_total"))
        {
            eprintln!("{}: {l}", d.http);
        }
    }
    assert!(metric(&p1, "pd_kv_leases_total{event=\"granted\"}").await > 0.0);
}
