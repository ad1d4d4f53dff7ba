//! The operator's API as something on a network reaches it: a caller without the admin token
//! is refused before the gateway reads a byte of its body, and a push cannot ask for limits a
//! policy on the request path must not have (a deadline over a second, fuel without end).

use std::time::Duration;

use pd_cluster_tests::cluster::{ADMIN_TOKEN, Gateway};
use pd_cluster_tests::process::WorkDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A push without the token announcing a 60 MiB body and sending 5 bytes of it: the 401 comes
/// at once, while the body is still outstanding (a gateway that read the body first would
/// wait for the rest and answer nothing).
#[tokio::test]
async fn a_caller_without_the_token_is_refused_before_its_body_is_read() {
    let dir = WorkDir::new("admin-unread-body");
    let gw = Gateway::start(&dir, &[]);
    let addr = gw.admin.trim_start_matches("http://");
    for auth in ["", "authorization: Bearer wrong\r\n"] {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!(
            "PUT /admin/policy?name=x HTTP/1.1\r\nhost: {addr}\r\n{auth}content-length: {}\r\n\r\nhello",
            60 << 20
        );
        s.write_all(head.as_bytes()).await.expect("write");
        let mut answer = vec![0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("{auth:?}: no answer while the body is outstanding"))
            .expect("read");
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 401"), "{auth:?}: {answer}");
    }
}

/// Deadlines over 1 s and fuel over 10¹⁰ are refused by name, before the component is looked
/// at; the ceilings themselves are accepted (a bad component then fails to compile instead).
#[tokio::test]
async fn a_push_cannot_ask_for_limits_past_the_ceilings() {
    let dir = WorkDir::new("admin-ceilings");
    let gw = Gateway::start(&dir, &[]);
    let client = reqwest::Client::new();
    let push = |query: &'static str| {
        client
            .put(format!("{}/admin/policy?name=x&{query}", gw.admin))
            .bearer_auth(ADMIN_TOKEN)
            .body("not a component")
            .send()
    };
    for (query, names) in [
        ("deadline_ms=1001", "deadline_ms must be in (0, 1000]"),
        ("deadline_ms=10000", "deadline_ms must be in (0, 1000]"),
        (
            "fuel=10000000001",
            "fuel: not an integer in 1..=10000000000",
        ),
        ("memory_mib=257", "memory_mib: not an integer in 1..=256"),
    ] {
        let r = push(query).await.expect("push");
        let status = r.status();
        let body = r.text().await.expect("body");
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains(names), "{query}: {body}");
    }
    for query in ["deadline_ms=1000", "fuel=10000000000", "memory_mib=256"] {
        let r = push(query).await.expect("push");
        let status = r.status();
        let body = r.text().await.expect("body");
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains("policy refused"), "{query}: {body}");
    }
}
