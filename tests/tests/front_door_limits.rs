//! Everything on the gateway's request path is bounded (a gateway + 2P + 1D, round-robin, a
//! node timeout long enough that a stopped node stays in the view: only the new deadlines act):
//!
//! 1. A slowloris client (a partial head, then a header line now and then) is cut off with a
//!    408 by the head deadline (`--header-timeout-ms 1000`).
//! 2. A body whose `content-length` is over its route's limit gets 413 with an OpenAI error
//!    object at once, without the gateway waiting for (or reading) it: a generation route over
//!    `--max-body`, a tokenizer route over the smaller `--max-small-body`.
//! 3. Admission applies by default (no `--max-concurrent-requests`): a request held on a
//!    stopped decode node counts in flight, and it ends with an error within the node answer
//!    deadline (`--node-first-byte-timeout-ms 2000`) instead of hanging.
//! 4. A prefill node that stops answering: the request waiting on it fails over to the other
//!    prefill node within the deadline and is answered.
//! 5. The connection cap (`--max-connections`) closes the connection past it at once.
//! 6. A whole (not streamed) request on a stopped decode node, whose answer head would only
//!    come with its end, ends with a 504 at the request deadline (`--request-timeout-secs 6`).
//!
//! Before, the slowloris held its connection (pingora's read timeout is per read), the
//! oversized bodies were waited for, admission was off (nothing counted in flight), the
//! requests on stopped nodes waited for as long as the nodes stayed in the view, and every
//! connection was taken.

use std::time::{Duration, Instant};

use pd_cluster_tests::cluster::{ClusterSpec, Stopped, TestCluster, args};
use pd_cluster_tests::eventually;
use pd_cluster_tests::openai::{self, Api};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MAX_CONNECTIONS: usize = 12;

/// What the gateway sent on `s` until it closed it (or `within` passed: `None`).
async fn read_until_closed(s: &mut TcpStream, within: Duration) -> Option<String> {
    let mut got = Vec::new();
    let read = tokio::time::timeout(within, s.read_to_end(&mut got)).await;
    match read {
        Ok(_) => Some(String::from_utf8_lossy(&got).into_owned()),
        Err(_) => None,
    }
}

/// The error object of a raw HTTP answer.
fn error_of(answer: &str) -> serde_json::Value {
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_wait_on_the_request_path_is_bounded() {
    let c = TestCluster::start(
        "front-door",
        ClusterSpec {
            prefill: 2,
            decode: 1,
            gateway_args: args(&[
                "--node-timeout-ms",
                "120000",
                "--native-policy",
                "round-robin",
                "--header-timeout-ms",
                "1000",
                "--node-first-byte-timeout-ms",
                "2000",
                "--max-body",
                "1000000",
                "--max-small-body",
                "10000",
                "--max-connections",
                &MAX_CONNECTIONS.to_string(),
                "--request-timeout-secs",
                "6",
            ]),
            ..ClusterSpec::default()
        },
    )
    .await;
    let addr = c.gateway.http.trim_start_matches("http://").to_owned();
    let api = Api::Chat;
    openai::send(
        &c.client,
        &c.gateway.http,
        api,
        &api.body("Warm-up.", 4),
        None,
    )
    .await
    .ok();

    // 1. Slowloris: a partial head, then a header line every 300 ms, the answer read meanwhile.
    let s = TcpStream::connect(&addr).await.unwrap();
    let (mut r, mut w) = s.into_split();
    w.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
        .await
        .unwrap();
    let start = Instant::now();
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while let Ok(n) = r.read(&mut buf).await {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        (String::from_utf8_lossy(&got).into_owned(), start.elapsed())
    });
    for i in 0..30 {
        if reader.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let _ = w.write_all(format!("x-slow-{i}: 1\r\n").as_bytes()).await;
    }
    let (answer, cut) = tokio::time::timeout(Duration::from_secs(1), reader)
        .await
        .expect("the trickling client is still connected after 9 s")
        .unwrap();
    assert!(
        cut < Duration::from_secs(5),
        "the trickling client was not cut off by the 1 s head deadline ({cut:?}, {answer:?})"
    );
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert_eq!(error_of(&answer)["error"]["code"], "request_timeout");
    drop(w);

    // 2. Bodies declared over their route's limit: 413 at once, the body never sent.
    for (path, len) in [
        ("/v1/chat/completions", 1_000_001u64),
        ("/v1/completions", 1u64 << 40),
        ("/tokenize", 10_001),
    ] {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: gw\r\ncontent-type: application/json\r\n\
             content-length: {len}\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let answer = read_until_closed(&mut s, Duration::from_secs(3))
            .await
            .unwrap_or_else(|| panic!("{path}: no answer without the {len}-byte body"));
        assert!(answer.starts_with("HTTP/1.1 413"), "{path}: {answer:?}");
        assert_eq!(
            error_of(&answer)["error"]["type"],
            "invalid_request_error",
            "{answer}"
        );
    }
    // Under the limits, the same routes serve.
    let tokenized = c
        .client
        .post(format!("{}/tokenize", c.gateway.http))
        .json(&serde_json::json!({"model": openai::MODEL, "prompt": "Hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(tokenized.status(), 200);

    let gauge = async |name: &str| c.gateway_metrics().await.sum(name, &[]);
    // 3. D stops: the request held on it counts in flight (admission is on by default), and
    //    ends with an error when D sends no answer within the deadline.
    {
        let _d0 = Stopped::new(c.node("d0"));
        let body = api.streaming(&api.body("Held on a stopped decode node.", 4));
        let (client, gw) = (c.client.clone(), c.gateway.http.clone());
        let start = Instant::now();
        let held = tokio::spawn(async move { openai::send(&client, &gw, api, &body, None).await });
        eventually(
            "the request in flight",
            Duration::from_secs(3),
            async || gauge("pd_gateway_requests_in_flight").await == 1.0,
        )
        .await;
        let a = tokio::time::timeout(Duration::from_secs(10), held)
            .await
            .expect("the request still waits on the stopped decode node")
            .unwrap();
        assert_eq!(a.status, 503, "{}", a.body);
        assert!(
            a.body.contains("sent no answer within 2000 ms"),
            "{}",
            a.body
        );
        assert!(
            start.elapsed() >= Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }
    assert_eq!(gauge("pd_gateway_requests_in_flight").await, 0.0);

    // 4. p0 stops; two requests at once: round-robin ranks p0 first for one of them, which
    //    fails over to p1 once p0 sent nothing for the deadline.
    let answers = {
        let _p0 = Stopped::new(c.node("p0"));
        let sends = (0..2).map(|i| {
            let body = api.body(&format!("{i} A prefill node stops."), 4);
            let (client, gw) = (c.client.clone(), c.gateway.http.clone());
            async move { openai::send(&client, &gw, api, &body, None).await }
        });
        tokio::time::timeout(Duration::from_secs(15), futures::future::join_all(sends))
            .await
            .expect("the requests still wait on the stopped prefill node")
    };
    for a in &answers {
        assert!(a.status == 200 && a.complete, "{} {}", a.status, a.body);
    }
    let g = c.gateway_metrics().await;
    assert!(
        g.sum("pd_gateway_failovers_total", &[("stage", "prefill")]) >= 1.0,
        "{}",
        g.show("pd_gateway_failovers_total")
    );

    // 5. Connections up to the cap are served (keep-alive, held open); the one past it is
    //    closed at once. (The test's own pooled connections may hold a few places.)
    let mut held = Vec::new();
    let mut refused = None;
    for i in 0..=MAX_CONNECTIONS {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("connection {i}: neither served nor closed"))
            .unwrap_or(0);
        if n == 0 {
            refused = Some(i);
            break;
        }
        assert!(buf.starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
        held.push(s);
    }
    let refused = refused.expect("a connection past --max-connections was refused");
    assert!(
        (MAX_CONNECTIONS - 3..=MAX_CONNECTIONS).contains(&refused),
        "refused after {refused} connections of the test's own"
    );
    drop(held);

    // 6. D stops under a whole request: the request deadline ends it.
    {
        let _d0 = Stopped::new(c.node("d0"));
        let start = Instant::now();
        let body = api.body("A whole answer from a stopped decode node.", 4);
        let a = tokio::time::timeout(
            Duration::from_secs(15),
            openai::send(&c.client, &c.gateway.http, api, &body, None),
        )
        .await
        .expect("the request still waits on the stopped decode node");
        assert_eq!(a.status, 504, "{}", a.body);
        let e = a.error.as_ref().expect("an error object");
        assert_eq!(e["code"], "timeout", "{}", a.body);
        assert!(
            start.elapsed() >= Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }
    eventually("a place free again", Duration::from_secs(3), async || {
        let Ok(mut s) = TcpStream::connect(&addr).await else {
            return false;
        };
        let _ = s
            .write_all(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
            .await;
        let mut buf = [0u8; 64];
        matches!(s.read(&mut buf).await, Ok(n) if n > 0)
    })
    .await;
}
