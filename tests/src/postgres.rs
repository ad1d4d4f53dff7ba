//! A real PostgreSQL server (Debian's `postgresql` package) for the gateways' shared state:
//! a fresh cluster (`initdb`) in a test's directory, on a free loopback port, run as the
//! `postgres` user when the tests run as root (PostgreSQL refuses root).

use std::net::TcpListener;
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
    /// `postgres://pd@127.0.0.1:PORT/postgres`.
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
        let mut pg = PgServer {
            bin,
            data,
            dir: dir.to_owned(),
            port,
            proc: None,
            url: format!("postgres://pd@127.0.0.1:{port}/postgres"),
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
            .arg(&self.data)
            .args(["-c", "listen_addresses=127.0.0.1"]);
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
