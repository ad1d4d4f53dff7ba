//! The cluster's mutual TLS in tests: a CA and a certificate per process, minted by
//! `scripts/cluster-certs.sh` (openssl), as an operator mints them.

use std::path::{Path, PathBuf};

/// A cluster CA in a directory, and the certificates it issued there.
#[derive(Debug)]
pub struct Certs {
    dir: PathBuf,
}

impl Certs {
    /// A new CA in `dir`, and a client certificate for the test process (`tester`).
    pub fn new(dir: &Path) -> Self {
        let certs = Self {
            dir: dir.to_owned(),
        };
        certs.mint("tester", &["DNS:tester".to_owned()]);
        certs
    }

    /// Issues `name`'s certificate naming `sans` (`IP:…`, `DNS:…`).
    pub fn mint(&self, name: &str, sans: &[String]) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/cluster-certs.sh");
        let out = std::process::Command::new("bash")
            .arg(script)
            .arg(&self.dir)
            .arg(format!("{name}={}", sans.join(",")))
            .output()
            .expect("running scripts/cluster-certs.sh");
        assert!(
            out.status.success(),
            "cluster-certs.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The names a process's certificate carries: its host's address (loopback's when it runs
    /// here) and `more`.
    pub fn names(host_addr: Option<&str>, more: &[String]) -> Vec<String> {
        let mut names = match host_addr {
            Some(a) => vec![format!("IP:{a}")],
            None => vec!["IP:127.0.0.1".to_owned(), "DNS:localhost".to_owned()],
        };
        names.extend(more.iter().cloned());
        names
    }

    /// `--tls-cert`, `--tls-key`, `--tls-ca` of `name`.
    pub fn flags(&self, name: &str) -> Vec<String> {
        let path = |f: String| self.dir.join(f).display().to_string();
        vec![
            "--tls-cert".into(),
            path(format!("{name}.pem")),
            "--tls-key".into(),
            path(format!("{name}.key")),
            "--tls-ca".into(),
            path("ca.pem".into()),
        ]
    }

    /// `--client-tls-cert`, `--client-tls-key` of `name` (the gateway's client-facing TLS).
    pub fn client_flags(&self, name: &str) -> Vec<String> {
        let path = |f: String| self.dir.join(f).display().to_string();
        vec![
            "--client-tls-cert".into(),
            path(format!("{name}.pem")),
            "--client-tls-key".into(),
            path(format!("{name}.key")),
        ]
    }

    /// `name`'s identity, loaded as the binaries load it.
    pub fn identity(&self, name: &str) -> pd_tls::ClusterTls {
        pd_tls::ClusterTls::load(&pd_tls::TlsPaths {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}.key")),
            ca: self.dir.join("ca.pem"),
        })
        .expect("loading a minted identity")
    }

    /// An HTTP client holding the test process's certificate (the nodes' API requires one).
    pub fn client(&self) -> reqwest::Client {
        let config = (*self.identity("tester").client_config()).clone();
        reqwest::Client::builder()
            .use_preconfigured_tls(config)
            .build()
            .expect("a TLS client")
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}
