//! A pull across two real processes: this test binary re-runs itself as a child peer that maps
//! a buffer and prints its worker address, rkey and base address; the parent pulls the buffer
//! with posted gets and one flush and checks a checksum.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pd_ucx::{Context, MemoryRegion, Worker, is_tcp_emulated_rma};

const CHILD_ENV: &str = "PD_UCX_PEER_CHILD";
const LEN: usize = 8 << 20;
const CHUNK: usize = 64 << 10;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// FNV-1a 64.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The child side. Ignored in normal runs; the parent runs it with `--ignored` and the env var.
#[test]
#[ignore = "child process of cross_process_pull"]
fn peer_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let ctx = Context::new().unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let mut buf: Vec<u8> = (0..LEN)
        .map(|i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7])
        .collect();
    // SAFETY: `buf` is neither moved nor freed until after `region` is dropped at the end of
    // this function, and nothing else touches it while peers read it.
    let region = unsafe { MemoryRegion::map(&ctx, buf.as_mut_ptr(), buf.len()) }.unwrap();
    println!(
        "PEER {} {} {:x} {} {:x}",
        hex(&worker.address().unwrap()),
        hex(&region.rkey_pack().unwrap()),
        region.base(),
        region.len(),
        checksum(&buf)
    );
    std::io::stdout().flush().unwrap();

    // Serve (gets from registered memory need this side to progress) until stdin closes.
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        stop2.store(true, Ordering::Relaxed);
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        worker.progress();
    }
    drop(region);
    drop(buf);
}

/// Kills and reaps the child when the test ends, pass or fail.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn cross_process_pull() {
    let mut child = ChildGuard(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "cross_process::peer_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest prints "test cross_process::peer_child ... " on the same line first.
            if let Some((_, rest)) = line.split_once("PEER ") {
                let _ = tx.send(rest.to_string());
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("child printed no PEER line");
    let f: Vec<&str> = line.split_whitespace().collect();
    let (addr, rkey, base) = (
        unhex(f[0]),
        unhex(f[1]),
        u64::from_str_radix(f[2], 16).unwrap(),
    );
    let (len, want): (usize, u64) = (
        f[3].parse().unwrap(),
        u64::from_str_radix(f[4], 16).unwrap(),
    );
    assert_eq!(len, LEN);

    let ctx = Context::new().unwrap();
    let worker = Worker::new(&ctx).unwrap();
    let dst = MemoryRegion::allocate(&ctx, len).unwrap();
    let ep = worker.connect(&addr).unwrap();
    let rkey = ep.unpack_rkey(&rkey).unwrap();
    let start = Instant::now();
    for off in (0..len).step_by(CHUNK) {
        ep.post_get(&dst, off, CHUNK.min(len - off), base + off as u64, &rkey)
            .unwrap();
    }
    ep.flush().unwrap().wait().unwrap();
    let elapsed = start.elapsed();

    let mut got = vec![0u8; len];
    // SAFETY: all gets into `dst` completed (flush), and `dst` is `len` bytes.
    unsafe { std::ptr::copy_nonoverlapping(dst.as_ptr(), got.as_mut_ptr(), len) };
    assert_eq!(
        checksum(&got),
        want,
        "checksum mismatch after pulling {len} bytes"
    );

    let report = ep.transport_report().unwrap();
    eprintln!(
        "pulled {} MiB in {elapsed:?} over {:?} (rma lanes {:?}, tcp-emulated: {})",
        len >> 20,
        report.transports(),
        report.rma_transports(),
        is_tcp_emulated_rma(&report)
    );
    assert!(!report.lanes.is_empty());

    drop(rkey);
    drop(ep);
    // Closing stdin lets the child exit on its own; the guard kills it otherwise.
    drop(child.0.stdin.take());
}
