//! Child processes under test and the scratch directory they share.
//!
//! A [`Proc`]'s stdout is read line by line on a thread (the servers print their addresses
//! there); its stderr (the logs) goes to `<workdir>/<name>.log`. Dropping a `Proc` sends it
//! `SIGCONT` (a stopped child would ignore nothing but could not exit cleanly otherwise) and
//! `SIGKILL`, then reaps it. When a test panics, every `Proc` dropped during the unwind prints
//! the tail of its log, so a failure shows what the servers said.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// A scratch directory, removed on drop unless the test failed (then its path is printed, with
/// the logs in it).
#[derive(Debug)]
pub struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    /// A fresh directory under the system temp dir, named after `name` and this process.
    pub fn new(name: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "pd-cluster-{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        Self { path }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("cluster test failed; logs kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// A running child process, killed on drop.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
    lines: Receiver<String>,
    exited: Option<ExitStatus>,
    /// The child is a wrapper (`unshare --fork`) whose own child is the program: signals go
    /// to that one.
    contained: bool,
}

impl Proc {
    /// Spawns `cmd` with stdout piped to a line reader and stderr to `<dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, dir: &Path) -> Self {
        let log = dir.join(format!("{name}.log"));
        let err = File::create(&log).unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name} ({cmd:?}): {e}"));
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, lines) = channel();
        std::thread::Builder::new()
            .name(format!("{name}-stdout"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning a reader thread");
        Self {
            name: name.to_owned(),
            child,
            log,
            lines,
            exited: None,
            contained: false,
        }
    }

    /// [`Proc::spawn`] for a command that forks the program it runs and waits for it
    /// (`unshare --fork --kill-child`, [`crate::hosts::Host::container`]): [`Proc::signal`]
    /// signals the program; killing the wrapper kills it.
    pub fn spawn_contained(name: &str, cmd: Command, dir: &Path) -> Self {
        let mut p = Self::spawn(name, cmd, dir);
        p.contained = true;
        p
    }

    /// The pid signals go to: the child's, or, when contained, its first child's (waited for).
    fn target(&self) -> libc::pid_t {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid fits pid_t");
        if !self.contained {
            return pid;
        }
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default();
            if let Some(c) = children
                .split_whitespace()
                .next()
                .and_then(|c| c.parse().ok())
            {
                return c;
            }
            assert!(
                Instant::now() < until,
                "{}: the contained program did not start",
                self.name
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Its name in logs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Reads stdout until a line starting with `prefix` and returns the rest of it. Panics (with
    /// the log's tail) if the process exits first or `timeout` passes. Blocks the thread: call it
    /// while starting a cluster, before anything else runs.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.trim_end().strip_prefix(prefix) {
                        return rest.to_owned();
                    }
                }
                Err(RecvTimeoutError::Timeout) => panic!(
                    "{} printed no `{prefix}` line within {timeout:?}; its log:\n{}",
                    self.name,
                    self.log_tail(60)
                ),
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait().ok();
                    self.exited = status;
                    panic!(
                        "{} exited ({status:?}) before printing `{prefix}`; its log:\n{}",
                        self.name,
                        self.log_tail(60)
                    );
                }
            }
        }
    }

    /// Sends `signal` (a `libc::SIG*`) to the process.
    pub fn signal(&self, signal: i32) {
        let pid = self.target();
        // SAFETY: kill(2) with a pid this struct spawned and has not reaped (reaping happens
        // only in `kill_and_wait` and `drop`, which take `&mut self`), so it names our child
        // (or, contained, the child of our child, which lives as long as it does).
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(
            rc,
            0,
            "kill({pid}, {signal}) on {}: {}",
            self.name,
            std::io::Error::last_os_error()
        );
        if signal == libc::SIGSTOP {
            // `kill` only queues it: on a busy machine the other threads run on until the one
            // that takes it has been scheduled and stopped them. Return once all have.
            let until = Instant::now() + Duration::from_secs(20);
            while !all_threads_stopped(pid) {
                assert!(Instant::now() < until, "{} did not stop", self.name);
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// `SIGKILL`, then reap. Idempotent.
    pub fn kill_and_wait(&mut self) -> ExitStatus {
        if let Some(s) = self.exited {
            return s;
        }
        let _ = self.child.kill();
        let status = self.child.wait().expect("reaping a child");
        self.exited = Some(status);
        status
    }

    /// Waits up to `timeout` for the process to exit by itself (reaping it); its status, or
    /// `None` if it is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + timeout;
        while !self.has_exited() {
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.exited
    }

    /// Whether the process has exited (reaping it if so).
    pub fn has_exited(&mut self) -> bool {
        if self.exited.is_some() {
            return true;
        }
        match self.child.try_wait() {
            Ok(Some(s)) => {
                self.exited = Some(s);
                true
            }
            _ => false,
        }
    }

    /// The path of its stderr log.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The whole log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of its log (reads at most the last 64 KiB).
    pub fn log_tail(&self, lines: usize) -> String {
        let Ok(mut f) = File::open(&self.log) else {
            return String::new();
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 << 10)));
        let mut text = String::new();
        let _ = f.read_to_string(&mut text);
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited.is_none() {
            // (A contained program dies with its wrapper, stopped or not: `--kill-child`.)
            let pid = match self.contained {
                true => 0,
                false => libc::pid_t::try_from(self.child.id()).unwrap_or(0),
            };
            if pid > 0 {
                // SAFETY: our own child, not yet reaped (see `signal`). A stopped process is
                // continued so it dies now rather than when someone resumes it.
                unsafe {
                    libc::kill(pid, libc::SIGCONT);
                }
            }
            self.kill_and_wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "----- {} ({}) log tail -----\n{}\n-----",
                self.name,
                self.log.display(),
                self.log_tail(40)
            );
        }
    }
}

/// Bytes that arrived on TCP connections to local `port` and that their owner has not read
/// (`/proc/net/tcp{,6}`: connections whose local port is `port`, not LISTEN, summed rx_queue).
/// A stopped server's pending requests show up here, including connections still in its accept
/// queue; 0 where `/proc` is not there.
pub fn unread_tcp_bytes(port: u16) -> u64 {
    let mut total = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl, local_address, rem_address, st, tx_queue:rx_queue, ...; st 0A = LISTEN.
            if f.len() < 5 || f[3] == "0A" {
                continue;
            }
            let local_port = f[1]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port != Some(port) {
                continue;
            }
            total += f[4]
                .split(':')
                .nth(1)
                .and_then(|q| u64::from_str_radix(q, 16).ok())
                .unwrap_or(0);
        }
    }
    total
}

/// Whether every thread of `pid` is in the stopped state (`T` in `/proc/<pid>/task/*/stat`).
fn all_threads_stopped(pid: libc::pid_t) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
            // The state follows the parenthesised command name.
            stat[stat.rfind(')').map_or(0, |i| i + 2)..].starts_with('T')
        })
    })
}
