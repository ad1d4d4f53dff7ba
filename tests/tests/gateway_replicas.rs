//! Two gateways sharing one PostgreSQL state store (a real server from Debian's package): a
//! policy pushed on one serves on the other within a second; two pushed at once end on one
//! policy, the same on both; a response stored through one is read through the other, and
//! deleted everywhere; with the store stopped, plain requests are served and what needs it is
//! refused with a clear error, and a turn answered meanwhile is written once it is back;
//! then everything works again.

use std::time::{Duration, Instant};

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{ADMIN_TOKEN, ClusterSpec, Gateway, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::postgres::PgServer;
use pd_cluster_tests::process::WorkDir;
use serde_json::{Value, json};

async fn send(req: reqwest::RequestBuilder) -> (u16, Value) {
    let resp = req.send().await.expect("a request to a gateway");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn policy_of(client: &reqwest::Client, g: &Gateway) -> Value {
    let (status, v) = send(
        client
            .get(format!("{}/admin/policy", g.admin))
            .bearer_auth(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    v["current"].clone()
}

async fn push(client: &reqwest::Client, g: &Gateway, name: &str) -> (u16, Value) {
    let wasm = std::fs::read(bins::policy(name)).expect("a built guest policy");
    send(
        client
            .put(format!("{}/admin/policy?name={name}", g.admin))
            .bearer_auth(ADMIN_TOKEN)
            .body(wasm),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_the_policy_and_responses_and_survive_a_store_outage() {
    let work = WorkDir::new("replicas-pg");
    let mut pg = PgServer::start(work.path());
    let flags = args(&["--state-url", &pg.url, "--policy-deadline-ms", "50"]);
    let c = TestCluster::start(
        "replicas",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args: flags.clone(),
            ..ClusterSpec::default()
        },
    )
    .await;
    let g1 = &c.gateway;
    // A scratch directory of its own: its log is not the first gateway's.
    let g2_dir = WorkDir::new("replicas-g2");
    let g2 = Gateway::start(&g2_dir, &flags);
    let client = &c.client;

    // A push on one serves on the other within a second (notified, not polled).
    let start = Instant::now();
    let (status, pushed) = push(client, g1, "round-robin").await;
    assert_eq!(status, 200, "{pushed}");
    let version = pushed["current"]["version"].clone();
    loop {
        if policy_of(client, &g2).await["version"] == version {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "the second gateway still serves {} after 1 s:\n{}",
            policy_of(client, &g2).await,
            g2.proc.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("policy converged across replicas in {:?}", start.elapsed());

    // Two pushes at once, one per gateway: both end on the same policy.
    let (a, b) = tokio::join!(
        push(client, g1, "least-loaded"),
        push(client, &g2, "prefix-aware")
    );
    assert_eq!((a.0, b.0), (200, 200), "{a:?} {b:?}");
    eventually(
        "both gateways on one policy",
        Duration::from_secs(5),
        async || policy_of(client, g1).await["version"] == policy_of(client, &g2).await["version"],
    )
    .await;
    let settled = policy_of(client, g1).await;
    assert!(
        ["least-loaded", "prefix-aware"].contains(&settled["name"].as_str().unwrap_or("")),
        "{settled}"
    );

    // A response stored through the first is read through the second, and deleted everywhere.
    let ask = json!({"model": "tiny", "input": "Name three rivers of Europe.",
                     "max_output_tokens": 8, "temperature": 0});
    let (status, r1) = send(client.post(format!("{}/v1/responses", g1.http)).json(&ask)).await;
    assert_eq!(status, 200, "{r1}");
    let id = r1["id"].as_str().expect("an id").to_owned();
    let at = |g: &Gateway| format!("{}/v1/responses/{id}", g.http);
    let (status, got) = send(client.get(at(&g2))).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["output"], r1["output"]);
    let (status, _) = send(client.delete(at(g1))).await;
    assert_eq!(status, 200);
    eventually(
        "the deletion reaches the other gateway's memory",
        Duration::from_secs(2),
        async || send(client.get(at(&g2))).await.0 == 404,
    )
    .await;

    // The store stops: plain requests are served, what needs the store says so.
    let (status, r2) = send(client.post(format!("{}/v1/responses", g1.http)).json(&ask)).await;
    assert_eq!(status, 200, "{r2}");
    let id2 = r2["id"].as_str().expect("an id").to_owned();
    pg.stop();
    let chat = json!({"model": "tiny", "max_tokens": 4, "temperature": 0,
                      "messages": [{"role": "user", "content": "Hello"}]});
    let (status, v) = send(
        client
            .post(format!("{}/v1/chat/completions", g1.http))
            .json(&chat),
    )
    .await;
    assert_eq!(status, 200, "a plain request while the store is down: {v}");
    let (status, v) = send(client.get(format!("{}/v1/responses/{id2}", g2.http))).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "state_unavailable", "{v}");
    let (status, v) = push(client, g1, "round-robin").await;
    assert_eq!(status, 503, "a push the store cannot keep is refused: {v}");
    assert_eq!(policy_of(client, g1).await["version"], settled["version"]);
    // A new turn is answered (it needs nothing stored) and kept in g1's memory; its write
    // waits for the store.
    let (status, r3) = send(client.post(format!("{}/v1/responses", g1.http)).json(&ask)).await;
    assert_eq!(status, 200, "a new turn while the store is down: {r3}");
    let id3 = r3["id"].as_str().expect("an id").to_owned();

    // Back: the stored response is read again, and pushes converge again.
    pg.resume();
    eventually(
        "the stored response through the other gateway once the store is back",
        Duration::from_secs(10),
        async || {
            send(client.get(format!("{}/v1/responses/{id2}", g2.http)))
                .await
                .0
                == 200
        },
    )
    .await;
    // The turn answered during the outage reached the store once it was back: the other
    // gateway reads it (before, its write was lost and g2 answered 404 for good).
    eventually(
        "the turn answered during the outage, through the other gateway",
        Duration::from_secs(10),
        async || {
            send(client.get(format!("{}/v1/responses/{id3}", g2.http)))
                .await
                .0
                == 200
        },
    )
    .await;
    let (status, pushed) = push(client, &g2, "round-robin").await;
    assert_eq!(status, 200, "{pushed}");
    let version = pushed["current"]["version"].clone();
    eventually(
        "a push after the outage reaches the other gateway",
        Duration::from_secs(5),
        async || policy_of(client, g1).await["version"] == version,
    )
    .await;
}

/// The shared store over TLS: with `sslmode=require` and the database's CA, the gateway's
/// connections are TLS ones (the server's `pg_stat_ssl` says so); with another CA, the gateway
/// does not start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_store_is_reached_over_tls() {
    let work = WorkDir::new("replicas-pg-tls");
    let certs = pd_cluster_tests::cluster::Certs::new(&work.path().join("certs"));
    certs.mint("postgres", &["IP:127.0.0.1".to_owned()]);
    let pg = PgServer::start_tls(work.path(), &work.path().join("certs"));
    let url = format!("{}?sslmode=require", pg.url);
    let ca = work.path().join("certs/ca.pem");
    let flags = args(&[
        "--state-url",
        &url,
        "--state-tls-ca",
        ca.to_str().expect("UTF-8"),
    ]);
    let g = Gateway::start(&work, &flags);
    let client = reqwest::Client::new();
    let (status, v) = push(&client, &g, "round-robin").await;
    assert_eq!(status, 200, "a push saved over TLS: {v}");
    let tls_backends = pg.query(
        "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE s.ssl AND a.usename = 'pd' AND a.pid <> pg_backend_pid()",
    );
    assert!(
        tls_backends.parse::<u32>().unwrap_or(0) >= 1,
        "no TLS connection from the gateway: {tls_backends}"
    );
    let plain = pg.query(
        "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE NOT s.ssl AND a.usename = 'pd' AND a.pid <> pg_backend_pid() \
         AND a.backend_type = 'client backend'",
    );
    assert_eq!(plain, "0", "a plain connection from the gateway");

    // Another CA: the gateway refuses the database's certificate and does not start.
    let other = pd_cluster_tests::cluster::Certs::new(&work.path().join("other"));
    drop(other);
    let other_ca = work.path().join("other/ca.pem");
    let mut cmd = std::process::Command::new(pd_cluster_tests::bins::pd_gateway());
    cmd.args([
        "serve",
        "--port",
        "0",
        "--registry-port",
        "0",
        "--admin-port",
        "0",
    ])
    .args(["--state-url", &url, "--state-tls-ca"])
    .arg(&other_ca);
    let out = cmd.output().expect("running pd-gateway");
    assert!(
        !out.status.success(),
        "started with a CA that did not sign the database's certificate"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("state"), "{err}");
}

/// The shared store forgets turns past their age: a gateway's sweep (at its start, then every
/// minute) deletes them from PostgreSQL. Found by the chaos suite: the sweep's statement
/// compared PostgreSQL's `numeric` (a `SUM` of `bigint`s) with an `i64` parameter and failed
/// every time (`sweeping stored responses failed`), so the table only grew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_store_forgets_turns_past_their_age() {
    let work = WorkDir::new("replicas-sweep");
    let pg = PgServer::start(work.path());
    let c = TestCluster::start(
        "replicas-sweep",
        ClusterSpec {
            prefill: 1,
            decode: 1,
            gateway_args: args(&["--state-url", &pg.url]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let ask = json!({"model": "tiny", "input": "Keep me a moment.", "max_output_tokens": 2,
                     "temperature": 0});
    let (status, v) = send(
        c.client
            .post(format!("{}/v1/responses", c.gateway.http))
            .json(&ask),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(pg.query("SELECT count(*) FROM pd_turns"), "1");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Another gateway whose responses live a second: its first sweep forgets the turn.
    let dir = WorkDir::new("replicas-sweep-g2");
    let g2 = Gateway::start(
        &dir,
        &args(&["--state-url", &pg.url, "--responses-ttl-secs", "1"]),
    );
    eventually("the old turn swept", Duration::from_secs(10), async || {
        pg.query("SELECT count(*) FROM pd_turns") == "0"
    })
    .await;
    assert!(
        !g2.proc.log().contains("sweeping stored responses failed"),
        "{}",
        g2.proc.log_tail(20)
    );
}
