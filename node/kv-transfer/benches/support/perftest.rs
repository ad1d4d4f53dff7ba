//! `ucx_perftest -t ucp_get` between two processes on this host: the transfer layer's reference,
//! shared by the benches that compare a pull with it (`pd-kv-transfer`'s `pull`, `pd-node`'s `pd`;
//! each includes this file with `#[path]`).

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The benches' error type.
pub type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Kills and reaps a perftest server that is still running when the measurement ends.
pub struct ServerGuard(Child);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

pub fn free_port() -> BenchResult<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Whether some socket listens on TCP `port` (any address), from `/proc/net/tcp{,6}`.
///
/// Not a connect probe: `ucx_perftest`'s server takes the first connection as its client, and a
/// probe that closes at once leaves it spinning instead of serving the real client.
pub fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|path| {
        std::fs::read_to_string(path).is_ok_and(|text| {
            text.lines().skip(1).any(|line| {
                let mut f = line.split_whitespace();
                let local = f.nth(1).unwrap_or("");
                let state = f.nth(1).unwrap_or("");
                state == "0A" && local.ends_with(&want)
            })
        })
    })
}

/// What one perftest client run reported.
#[derive(Debug, Clone, Copy)]
pub struct Perftest {
    pub iterations: usize,
    /// Average latency of one get, µs.
    pub overall_lat_us: f64,
    /// GB/s (1e9 B/s), converted from UCX's MB/s (2^20 B/s).
    pub gbps: f64,
}

/// Parses `-f -v` output: a CSV header line starting `iterations,` and rows after it; the last
/// complete row is the overall result.
pub fn parse_perftest(stdout: &str) -> BenchResult<Perftest> {
    let mut lines = stdout.lines().map(str::trim);
    let header: Vec<&str> = lines
        .by_ref()
        .find(|l| l.starts_with("iterations,"))
        .ok_or("no CSV header in ucx_perftest output")?
        .split(',')
        .collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .ok_or_else(|| format!("no {name} column in ucx_perftest output"))
    };
    let (it, lat, bw) = (col("iterations")?, col("overall_lat")?, col("overall_bw")?);
    let row: Vec<&str> = lines
        .filter(|l| !l.is_empty())
        .map(|l| l.split(',').map(str::trim).collect::<Vec<_>>())
        .rfind(|r| r.len() == header.len() && r[bw].parse::<f64>().is_ok())
        .ok_or("no result row in ucx_perftest output")?;
    let mb_per_s: f64 = row[bw].parse()?;
    Ok(Perftest {
        iterations: row[it].parse()?,
        overall_lat_us: row[lat].parse()?,
        gbps: mb_per_s * (1u64 << 20) as f64 / 1e9,
    })
}

/// Runs one perftest server/client pair for `size` bytes and `iterations` gets.
pub fn run_perftest(bin: &str, size: usize, iterations: usize) -> BenchResult<(Perftest, String)> {
    let port = free_port()?;
    let mut server = ServerGuard(
        Command::new(bin)
            .args(["-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start {bin} (apt install ucx-utils): {e}"))?,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !listening(port) {
        if let Some(status) = server.0.try_wait()? {
            return Err(format!("{bin} server exited before listening: {status}").into());
        }
        if Instant::now() > deadline {
            return Err(format!("{bin} server not listening on {port} after 10 s").into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let args = [
        "127.0.0.1".to_string(),
        "-p".to_string(),
        port.to_string(),
        "-t".to_string(),
        "ucp_get".to_string(),
        "-s".to_string(),
        size.to_string(),
        "-n".to_string(),
        iterations.to_string(),
        "-f".to_string(),
        "-v".to_string(),
    ];
    let command = format!("{bin} {}", args.join(" "));
    let out = Command::new(bin).args(&args).output()?;
    if !out.status.success() {
        return Err(format!(
            "{command} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let result = parse_perftest(&String::from_utf8_lossy(&out.stdout))?;
    // The server exits after its one test; the guard kills it if it lingers.
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.0.try_wait()?.is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok((result, command))
}
