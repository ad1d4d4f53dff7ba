//! A real PostgreSQL server (Debian's `postgresql` package) for the gateways' shared state:
//! a fresh cluster (`initdb`) in a test's directory, on a free loopback port, run as the
//! `postgres` user when the tests run as root (PostgreSQL refuses root).

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::Proc;

/// A running PostgreSQL server; stopped (fast shutdown) and started again on the same data
/// and port as a test needs.
#[derive(Debug)]
pub struct PgServer {
    bin: PathBuf,
    data: PathBuf,
    dir: PathBuf,
    port: u16,
    proc: Option<Proc>,
    /// Extra `postgres` settings (`-c` pairs).
    settings: Vec<String>,
    /// `postgres://pd@ADDR:PORT/postgres` (ADDR: `127.0.0.1`, or the address it was started on).
    pub url: String,
}

/// The newest installed server's `bin` directory.
fn pg_bin() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed (scripts/setup.sh installs Debian's `postgresql`)")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|b| b.join("postgres").exists())
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL server binary")
}

fn is_root() -> bool {
    // SAFETY: getuid(2) has no preconditions.
    unsafe { libc::getuid() == 0 }
}

/// `cmd` run as `postgres` when we are root.
fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg(program);
        c
    } else {
        Command::new(program)
    }
}

impl PgServer {
    /// Makes a cluster under `dir` and starts it.
    pub fn start(dir: &Path) -> Self {
        Self::start_with(dir, None, None)
    }

    /// [`PgServer::start`] also listening on `addr` (the test's address on a [`crate::hosts::Net`]),
    /// trusting the hosts' subnet: the store of gateways on harness hosts. [`PgServer::url`]
    /// names `addr`.
    pub fn start_on(dir: &Path, addr: Ipv4Addr) -> Self {
        Self::start_with(dir, None, Some(addr))
    }

    /// [`PgServer::start`] with TLS on, its certificate and key `certs/postgres.pem` and
    /// `certs/postgres.key` (as `scripts/cluster-certs.sh` mints them).
    pub fn start_tls(dir: &Path, certs: &Path) -> Self {
        Self::start_with(dir, Some(certs), None)
    }

    fn start_with(dir: &Path, certs: Option<&Path>, on: Option<Ipv4Addr>) -> Self {
        let bin = pg_bin();
        let data = dir.join("pg-data");
        std::fs::create_dir_all(&data).expect("creating the data directory");
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&data)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "chown postgres {}", data.display());
        }
        let out = as_postgres(&bin.join("initdb"))
            .args(["-D"])
            .arg(&data)
            .args(["-U", "pd", "-A", "trust", "--no-sync", "-E", "UTF8"])
            .output()
            .expect("running initdb");
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").expect("a free port");
            l.local_addr().expect("its address").port()
        };
        let mut settings = vec!["listen_addresses=127.0.0.1".to_owned()];
        if let Some(addr) = on {
            let [a, b, _, _] = addr.octets();
            let hba = data.join("pg_hba.conf");
            let mut text = std::fs::read_to_string(&hba).expect("reading pg_hba.conf");
            text.push_str(&format!("host all all {a}.{b}.0.0/16 trust\n"));
            std::fs::write(&hba, text).expect("writing pg_hba.conf");
            settings = vec![format!("listen_addresses=127.0.0.1,{addr}")];
        }
        if let Some(certs) = certs {
            // The server reads them as its own user, the key private to it.
            for (from, to) in [
                ("postgres.pem", "server.crt"),
                ("postgres.key", "server.key"),
            ] {
                let to = data.join(to);
                std::fs::copy(certs.join(from), &to).expect("copying the server's certificate");
                let ok = Command::new("chmod").arg("0600").arg(&to).status();
                assert!(ok.is_ok_and(|s| s.success()));
                if is_root() {
                    let ok = Command::new("chown")
                        .arg("postgres:postgres")
                        .arg(&to)
                        .status();
                    assert!(ok.is_ok_and(|s| s.success()));
                }
            }
            settings.extend([
                "ssl=on".into(),
                "ssl_cert_file=server.crt".into(),
                "ssl_key_file=server.key".into(),
            ]);
        }
        let mut pg = PgServer {
            bin,
            data,
            dir: dir.to_owned(),
            port,
            proc: None,
            settings,
            url: format!(
                "postgres://pd@{}:{port}/postgres",
                on.map_or("127.0.0.1".to_owned(), |a| a.to_string())
            ),
        };
        pg.resume();
        pg
    }

    /// Starts the server (again) and waits until it accepts connections.
    pub fn resume(&mut self) {
        assert!(self.proc.is_none(), "PostgreSQL is running already");
        let mut cmd = as_postgres(&self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(&self.data)
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.data);
        for setting in &self.settings {
            cmd.args(["-c", setting]);
        }
        self.proc = Some(Proc::spawn("postgres", cmd, &self.dir));
        let start = Instant::now();
        loop {
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "PostgreSQL did not start: {}",
                self.proc
                    .as_ref()
                    .map(|p| p.log_tail(30))
                    .unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs `sql` with `psql` as the test's user; its output, unaligned, tuples only.
    pub fn query(&self, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "pd",
                "-d",
                "postgres",
            ])
            .args(["-A", "-t", "-c", sql])
            .env("PGSSLMODE", "disable")
            .output()
            .expect("running psql");
        assert!(
            out.status.success(),
            "psql: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Stops the server (fast shutdown: clients are disconnected) and waits for its exit.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal(libc::SIGINT);
            assert!(
                p.wait_exit(Duration::from_secs(30)).is_some(),
                "PostgreSQL did not stop"
            );
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.stop();
    }
}
