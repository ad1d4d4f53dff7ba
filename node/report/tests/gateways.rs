//! A node reporting to several gateways (`Gateways`) against real tonic registries on
//! loopback: it registers with each, merges their peer lists, follows a name that stands for
//! several addresses as they come and go, refuses a gateway whose minted token conflicts,
//! names each gateway that left, tells every gateway it drains, and is refused only when every
//! gateway refused it.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pd_report::test_registry::{ConnectionEnd, TestRegistry, TestRegistryOptions};
use pd_report::{
    BlockSubscription, GatewayLeft, Gateways, GatewaysOptions, NodeStateSnapshot, Registration,
    ReportError, ReporterOptions, Resolve, Resolving, Role, StateSource, StoredBlocks,
};

/// Deadline for every wait: generous, since the machine may be loaded; never a speed assert.
const WAIT: Duration = Duration::from_secs(20);

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn tracing_guard() -> tracing::subscriber::DefaultGuard {
    tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("pd_report=debug")
            .finish(),
    )
}

/// An idle node, draining once told to.
#[derive(Debug, Default)]
struct Idle(StoredBlocks, std::sync::atomic::AtomicBool);

impl StateSource for Idle {
    fn state(&self) -> NodeStateSnapshot {
        NodeStateSnapshot {
            total_blocks: 64,
            free_blocks: 64,
            draining: self.1.load(std::sync::atomic::Ordering::SeqCst),
            ..NodeStateSnapshot::default()
        }
    }

    fn subscribe_blocks(&self) -> BlockSubscription {
        self.0.subscribe()
    }
}

fn registration(cluster_token: &str) -> Registration {
    Registration {
        engine_id: "node-a".to_string(),
        epoch: 42,
        role: Role::Producer,
        model: "tiny".to_string(),
        block_size: 16,
        compat_hash: 1,
        http_addr: "127.0.0.1:8000".to_string(),
        kv_side_channel_addr: Some("127.0.0.1:9000".to_string()),
        grpc_addr: None,
        num_blocks: 64,
        max_model_len: 2048,
        cluster_token: cluster_token.to_string(),
        tokenizer_files: BTreeMap::new(),
        tokenizer_fingerprint: 1,
        kv_hash_key: 0,
        kv_bytes_per_token: 0,
        takes_prompt_token_ids: true,
    }
}

fn options(resolver: Arc<dyn Resolve>) -> GatewaysOptions {
    GatewaysOptions {
        reporter: ReporterOptions {
            backoff_initial: Duration::from_millis(20),
            backoff_max: Duration::from_millis(200),
            close_grace: Duration::from_millis(200),
            ..ReporterOptions::default()
        },
        resolve_every: Duration::from_millis(50),
        resolver,
    }
}

/// A name that stands for whatever addresses the test sets (each with the asked port), and
/// fails the lookup while it stands for nothing.
#[derive(Debug, Default)]
struct Table(Mutex<Vec<IpAddr>>);

impl Table {
    fn set(&self, ips: &[IpAddr]) {
        *self.0.lock().expect("table lock") = ips.to_vec();
    }
}

impl Resolve for Table {
    fn resolve<'a>(&'a self, _host: &'a str, port: u16) -> Resolving<'a> {
        let ips = self.0.lock().expect("table lock").clone();
        Box::pin(async move {
            match ips.is_empty() {
                true => Err(std::io::Error::other("no such name")),
                false => Ok(ips
                    .into_iter()
                    .map(|ip| SocketAddr::new(ip, port))
                    .collect()),
            }
        })
    }
}

fn loopback(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

async fn registry(at: SocketAddr, id: &str, token: &str, peers: &[&str]) -> TestRegistry {
    TestRegistry::start_with(
        at,
        TestRegistryOptions {
            gateway_id: id.to_string(),
            ack_cluster_token: token.to_string(),
            peers: Some(peers.iter().map(|p| (*p).to_string()).collect()),
            ..TestRegistryOptions::default()
        },
    )
    .await
    .expect("a test registry")
}

/// Waits until `registry` has an open, registered connection.
async fn registered(registry: &TestRegistry) {
    registry
        .log()
        .wait_for(WAIT, |c| {
            c.iter().any(|c| c.end.is_none() && c.register().is_some())
        })
        .await
        .expect("the node registers");
}

#[tokio::test]
async fn a_node_registers_with_two_gateways_takes_the_union_of_their_peers_and_drains_to_both()
-> TestResult {
    let _guard = tracing_guard();
    let any = SocketAddr::new(loopback(1), 0);
    let g1 = registry(any, "g1", "", &["10.0.0.1:9000", "10.0.0.2:9000"]).await;
    let g2 = registry(any, "g2", "", &["10.0.0.2:9000", "10.0.0.3:9000"]).await;
    let entries = vec![g1.addr().to_string(), format!("http://{}", g2.addr())];
    let node = Arc::new(Idle::default());
    let mut gateways = Gateways::spawn(
        &entries,
        registration("s3cret"),
        node.clone(),
        options(Arc::new(Table::default())),
    )?;
    let mut left = gateways.take_gateways_left().expect("taken once");
    registered(&g1).await;
    registered(&g2).await;
    let all = ["10.0.0.1:9000", "10.0.0.2:9000", "10.0.0.3:9000"].map(String::from);
    let mut peers = gateways.peers();
    tokio::time::timeout(WAIT, peers.wait_for(|p| p.as_deref() == Some(&all[..]))).await??;
    assert_eq!(gateways.cluster_token().borrow().as_deref(), Some("s3cret"));
    let views = gateways.gateways();
    assert_eq!(views.len(), 2, "{views:?}");
    assert!(views.iter().all(|v| v.connected && !v.refused), "{views:?}");

    // The node drains: every gateway hears it.
    node.1.store(true, std::sync::atomic::Ordering::SeqCst);
    for g in [&g1, &g2] {
        g.log()
            .wait_for(WAIT, |c| {
                c.iter()
                    .any(|c| c.states().last().is_some_and(|s| s.draining))
            })
            .await?;
    }

    // g1 goes away: its stream's end names it, and its own peer leaves the union.
    g1.stop().await?;
    let gone = tokio::time::timeout(WAIT, left.recv()).await?;
    assert_eq!(
        gone,
        Some(GatewayLeft {
            gateway_id: "g1".into(),
            addr: entries[0].clone()
        })
    );
    tokio::time::timeout(WAIT, peers.wait_for(|p| p.as_deref() == Some(&all[1..]))).await??;

    // Stopping the node ends g2's stream cleanly, and says nothing of g2 leaving.
    gateways.shutdown().await;
    let conns = g2.log().connections();
    assert_eq!(conns.len(), 1);
    assert_eq!(conns[0].end, Some(ConnectionEnd::Finished));
    assert!(
        left.try_recv().is_err(),
        "the node's own stop is no gateway leaving"
    );
    Ok(())
}

#[tokio::test]
async fn a_name_for_several_gateways_gets_one_reporter_per_address_and_follows_changes()
-> TestResult {
    let _guard = tracing_guard();
    // Three registries on one port, one per loopback address (Linux routes 127/8 to lo).
    let g1 = registry(SocketAddr::new(loopback(1), 0), "g1", "", &["p1:1"]).await;
    let port = g1.addr().port();
    let g2 = registry(SocketAddr::new(loopback(2), port), "g2", "", &["p2:1"]).await;
    let g3 = registry(SocketAddr::new(loopback(3), port), "g3", "", &["p3:1"]).await;
    let table = Arc::new(Table::default());
    table.set(&[loopback(2), loopback(1)]);
    let gateways = Gateways::spawn(
        &[format!("pd-gateway-registry:{port}")],
        registration("s3cret"),
        Arc::new(Idle::default()),
        options(table.clone()),
    )?;
    registered(&g1).await;
    registered(&g2).await;
    let mut peers = gateways.peers();
    let two = ["p1:1", "p2:1"].map(String::from);
    tokio::time::timeout(WAIT, peers.wait_for(|p| p.as_deref() == Some(&two[..]))).await??;
    let addrs: Vec<String> = gateways.gateways().into_iter().map(|v| v.addr).collect();
    assert_eq!(
        addrs,
        [
            format!("pd-gateway-registry:{port} at 127.0.0.1:{port}"),
            format!("pd-gateway-registry:{port} at 127.0.0.2:{port}")
        ]
    );

    // A lookup that fails changes nothing.
    table.set(&[]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(gateways.gateways().len(), 2);

    // 127.0.0.3 appears and 127.0.0.1 goes: a reporter starts for the new one, the gone one's
    // stream ends cleanly (the gateway sees the node leave, not fail).
    table.set(&[loopback(2), loopback(3)]);
    registered(&g3).await;
    g1.log()
        .wait_for(WAIT, |c| {
            c.len() == 1 && c[0].end == Some(ConnectionEnd::Finished)
        })
        .await?;
    let connected_ids = || {
        let mut views = gateways.gateways();
        views.sort_by(|a, b| a.addr.cmp(&b.addr));
        views
            .iter()
            .map(|v| v.gateway_id.clone().filter(|_| v.connected))
            .collect::<Vec<_>>()
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    while connected_ids() != [Some("g2".to_string()), Some("g3".to_string())] {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            gateways.gateways()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let now = ["p2:1", "p3:1"].map(String::from);
    tokio::time::timeout(WAIT, peers.wait_for(|p| p.as_deref() == Some(&now[..]))).await??;
    assert_eq!(
        g2.log().connections().len(),
        1,
        "g2's reporter kept its stream"
    );
    gateways.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_gateway_minting_another_token_is_refused_and_the_first_token_stays() -> TestResult {
    let _guard = tracing_guard();
    let g1 = registry(SocketAddr::new(loopback(1), 0), "g1", "minted-1", &[]).await;
    // g2 comes up only once the node took g1's token: the order is the test's, not a race's.
    let g2_at = {
        let l = std::net::TcpListener::bind(SocketAddr::new(loopback(1), 0))?;
        l.local_addr()?
    };
    let gateways = Gateways::spawn(
        &[g1.addr().to_string(), g2_at.to_string()],
        registration(""),
        Arc::new(Idle::default()),
        options(Arc::new(Table::default())),
    )?;
    let mut token = gateways.cluster_token();
    tokio::time::timeout(WAIT, token.wait_for(|t| t.as_deref() == Some("minted-1"))).await??;
    let g2 = registry(g2_at, "g2", "minted-2", &[]).await;

    // The node drops g2 after its acknowledgement, and never comes back to it.
    g2.log()
        .wait_for(WAIT, |c| c.len() == 1 && c[0].end.is_some())
        .await?;
    let deadline = tokio::time::Instant::now() + WAIT;
    while !gateways.gateways().iter().any(|v| v.refused) {
        assert!(tokio::time::Instant::now() < deadline, "g2 not refused");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        g2.log().connections().len(),
        1,
        "the refused gateway is not retried"
    );
    assert_eq!(token.borrow().as_deref(), Some("minted-1"));
    let views = gateways.gateways();
    assert!(
        views
            .iter()
            .any(|v| v.gateway_id.as_deref() == Some("g1") && v.connected),
        "{views:?}"
    );
    // One gateway refused, one did not: the node goes on.
    let refused = tokio::time::timeout(Duration::from_millis(200), gateways.refused()).await;
    assert!(refused.is_err(), "refused while g1 serves it");
    gateways.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn the_node_is_refused_only_when_every_gateway_refused_it() -> TestResult {
    let _guard = tracing_guard();
    let refusing = |id: &str| TestRegistryOptions {
        gateway_id: id.to_string(),
        refuse: Some(tonic::Code::AlreadyExists),
        ..TestRegistryOptions::default()
    };
    let any = SocketAddr::new(loopback(1), 0);
    let g1 = TestRegistry::start_with(any, refusing("g1")).await?;
    let g2 = registry(any, "g2", "", &[]).await;
    let some = Gateways::spawn(
        &[g1.addr().to_string(), g2.addr().to_string()],
        registration("s3cret"),
        Arc::new(Idle::default()),
        options(Arc::new(Table::default())),
    )?;
    registered(&g2).await;
    g1.log()
        .wait_for(WAIT, |c| c.iter().any(|c| c.end.is_some()))
        .await?;
    let refused = tokio::time::timeout(Duration::from_millis(300), some.refused()).await;
    assert!(refused.is_err(), "g2 serves the node");
    some.shutdown().await;

    let g3 = TestRegistry::start_with(any, refusing("g3")).await?;
    let all = Gateways::spawn(
        &[g1.addr().to_string(), g3.addr().to_string()],
        registration("s3cret"),
        Arc::new(Idle::default()),
        options(Arc::new(Table::default())),
    )?;
    let why = tokio::time::timeout(WAIT, all.refused()).await?;
    assert!(matches!(*why, ReportError::Refused(_)), "{why:?}");
    assert!(all.gateways().iter().all(|v| v.refused));
    all.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn bad_entries_are_refused_before_anything_starts() {
    for entries in [
        vec![],
        vec!["no-port".to_string()],
        vec!["h:1".into(), "h:x".into()],
    ] {
        let err = Gateways::spawn(
            &entries,
            registration(""),
            Arc::new(Idle::default()),
            GatewaysOptions::default(),
        )
        .expect_err("refused");
        assert!(matches!(err, ReportError::InvalidGateway { .. }), "{err:?}");
    }
}

/// Under TLS a name's addresses are dialled, and the gateway's certificate is checked against
/// the name: a certificate naming only `pd-gateway-registry` is accepted at 127.0.0.1 when the
/// node was given the name, refused when it was given the address.
#[tokio::test]
async fn under_tls_the_certificate_must_name_the_name_not_the_address() -> TestResult {
    let _guard = tracing_guard();
    let dir = std::env::temp_dir().join(format!("pd-report-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/cluster-certs.sh"
    );
    let out = std::process::Command::new("bash")
        .arg(script)
        .arg(&dir)
        .args(["gateway=DNS:pd-gateway-registry", "node=DNS:node-a"])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let load = |name: &str| {
        pd_tls::ClusterTls::load(&pd_tls::TlsPaths {
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
            ca: dir.join("ca.pem"),
        })
    };
    let g = TestRegistry::start_with(
        SocketAddr::new(loopback(1), 0),
        TestRegistryOptions {
            gateway_id: "g-tls".into(),
            tls: Some(load("gateway")?),
            ..TestRegistryOptions::default()
        },
    )
    .await?;
    let port = g.addr().port();
    let table = Arc::new(Table::default());
    table.set(&[loopback(1)]);
    let mut opts = options(table);
    opts.reporter.tls = Some(load("node")?);

    let by_address = Gateways::spawn(
        &[g.addr().to_string()],
        registration("s3cret"),
        Arc::new(Idle::default()),
        opts.clone(),
    )?;
    let mut by_name = Gateways::spawn(
        &[format!("pd-gateway-registry:{port}")],
        registration("s3cret"),
        Arc::new(Idle::default()),
        opts,
    )?;
    let _left = by_name.take_gateways_left();
    registered(&g).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while !by_name.gateways().iter().any(|v| v.connected) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            by_name.gateways()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Dialled by address, the handshake fails: one registration only, the name's.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!by_address.gateways().iter().any(|v| v.connected));
    assert_eq!(g.log().connections().len(), 1);
    by_address.shutdown().await;
    by_name.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
