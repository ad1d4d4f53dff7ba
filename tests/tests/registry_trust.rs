//! Who may join: a registry that listens beyond loopback does not start open (no cluster token)
//! unless the operator says so, since whoever registers a node receives users' prompts.

use std::process::Command;
use std::time::Duration;

use pd_cluster_tests::bins;
use pd_cluster_tests::process::{Proc, WorkDir};

fn gateway(dir: &WorkDir, registry_host: &str, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(bins::pd_gateway());
    cmd.args(["serve", "--port", "0", "--registry-port", "0"])
        .args(["--admin-port", "0", "--admin-token", "t"])
        .args(["--registry-host", registry_host])
        .args(extra)
        .env_remove("PD_CLUSTER_TOKEN");
    Proc::spawn("gateway", cmd, dir.path())
}

#[test]
fn a_registry_beyond_loopback_does_not_start_open() {
    let dir = WorkDir::new("registry-open");
    for host in ["0.0.0.0", "::"] {
        let mut gw = gateway(&dir, host, &[]);
        let status = gw.wait_exit(Duration::from_secs(20));
        assert!(
            status.is_some_and(|s| !s.success()),
            "{host}: an open registry started: {}",
            gw.log_tail(20)
        );
        let log = gw.log();
        assert!(
            log.contains("without a cluster token") && log.contains("--insecure-open-registry"),
            "{host}: {log}"
        );
    }
    // Loopback without a token (a one-machine demo), or beyond it when told, starts.
    for (host, extra) in [
        ("127.0.0.1", &[][..]),
        ("0.0.0.0", &["--insecure-open-registry"][..]),
    ] {
        let mut gw = gateway(&dir, host, extra);
        gw.wait_line("pd-gateway registry on ", Duration::from_secs(30));
        gw.kill_and_wait();
    }
}
