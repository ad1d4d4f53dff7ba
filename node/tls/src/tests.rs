//! Handshakes between real certificates minted by `scripts/cluster-certs.sh` (openssl).

use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Mints a CA in `dir` and a certificate per `NAME=SAN`.
fn mint(dir: &Path, specs: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/cluster-certs.sh");
    let out = std::process::Command::new("bash")
        .arg(script)
        .arg(dir)
        .args(specs)
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn paths(dir: &Path, name: &str, ca_dir: &Path) -> TlsPaths {
    TlsPaths {
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}.key")),
        ca: ca_dir.join("ca.pem"),
    }
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pd-tls-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A server echoing one line back over TLS; returns its address and the incoming stream's task.
async fn echo_server(tls: &ClusterTls) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut incoming = TlsIncoming::spawn(listener, tls.acceptor(), "test");
    tokio::spawn(async move {
        while let Some((mut s, _)) = incoming.next().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 5];
                if s.read_exact(&mut buf).await.is_ok() {
                    let _ = s.write_all(&buf).await;
                    let _ = s.shutdown().await;
                }
            });
        }
    });
    addr
}

async fn hello(client: &ClusterTls, addr: SocketAddr) -> Result<Vec<u8>, std::io::Error> {
    let tcp = TcpStream::connect(addr).await?;
    let mut s = client
        .connector()
        .connect(server_name("127.0.0.1").unwrap(), tcp)
        .await?;
    s.write_all(b"hello").await?;
    let mut back = Vec::new();
    s.read_to_end(&mut back).await?;
    Ok(back)
}

#[tokio::test]
async fn members_of_one_ca_talk_and_strangers_are_refused_at_the_handshake() {
    let ours = tempdir("ours");
    let theirs = tempdir("theirs");
    mint(&ours, &["server=IP:127.0.0.1", "client=DNS:client"]);
    mint(&theirs, &["client=IP:127.0.0.1"]);
    let server = ClusterTls::load(&paths(&ours, "server", &ours)).unwrap();
    let addr = echo_server(&server).await;

    let member = ClusterTls::load(&paths(&ours, "client", &ours)).unwrap();
    assert_eq!(hello(&member, addr).await.unwrap(), b"hello");

    // A certificate from another CA (trusting ours, so only the server's check can refuse it).
    let stranger = ClusterTls::load(&paths(&theirs, "client", &ours)).unwrap();
    let refused = hello(&stranger, addr).await;
    assert!(
        refused.as_ref().map_or(true, Vec::is_empty),
        "a certificate from another CA was served: {refused:?}"
    );

    // Plain text: the server answers nothing readable.
    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain
        .write_all(b"POST / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut back = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut back)).await;
    assert!(!back.starts_with(b"HTTP"), "{back:?}");

    // A server whose certificate does not name the address dialled is refused by the client.
    let wrong = ClusterTls::load(&paths(&ours, "client", &ours)).unwrap();
    let addr = echo_server(&wrong).await;
    let err = hello(&member, addr).await.unwrap_err();
    assert!(err.to_string().contains("certificate"), "{err}");
    let _ = std::fs::remove_dir_all(&ours);
    let _ = std::fs::remove_dir_all(&theirs);
}

#[test]
fn a_key_that_is_not_the_certificates_is_refused_at_load() {
    let d = tempdir("mismatch");
    mint(&d, &["a=IP:127.0.0.1", "b=IP:127.0.0.1"]);
    let err = ClusterTls::load(&TlsPaths {
        cert: d.join("a.pem"),
        key: d.join("b.key"),
        ca: d.join("ca.pem"),
    })
    .unwrap_err();
    assert!(err.to_string().contains("certificate and key"), "{err}");
    let err = ClusterTls::load(&TlsPaths {
        cert: d.join("a.key"),
        key: d.join("a.key"),
        ca: d.join("ca.pem"),
    })
    .unwrap_err();
    assert!(err.to_string().contains("no certificate"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}
