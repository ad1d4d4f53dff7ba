//! KV pull bandwidth against `ucx_perftest -t ucp_get`, between two processes on this host.
//!
//! Run (release): `cargo bench -p pd-kv-transfer --bench pull [-- --block-bytes 65536 ...]`
//! (`--help` lists the knobs). Results are recorded in `BENCHMARKS.md` ("KV pull").
//!
//! For each size S (256 KiB, 2.25 MiB, 16 MiB by default):
//! - **Reference:** `ucx_perftest -p PORT` as a server, then
//!   `ucx_perftest 127.0.0.1 -p PORT -t ucp_get -s S -n N -f -v` as the client. Its last CSV row's
//!   `overall_bw` is in MB/s with MB = 2^20 (perftest divides bytes/s by 1024²: at 2.25 MiB,
//!   52.63 µs per get reads as 42752.87 MB/s = 44.8 GB/s), converted here to GB/s = 1e9 B/s.
//! - **Ours:** this binary re-runs itself as an owner process (env `PD_PULL_BENCH_OWNER=S`) that
//!   allocates S bytes with `MemoryRegion::allocate` (how the node's KV pool is allocated), fills
//!   a pattern, prints its worker address, rkey and base, and progresses its worker (napping
//!   when idle) until its stdin closes. The parent pulls the S bytes with `pull_blocks` into a region it also got from
//!   `MemoryRegion::allocate`, split into `--block-bytes` blocks in two layouts:
//!   - *scattered*: remote and local ids in two different seeded shuffles, so no run coalesces
//!     (S / block descriptors);
//!   - *coalesced*: identity order on both sides, one descriptor.
//!
//!   Each layout is pulled repeatedly (about `--budget-ms` per layout) after a warm-up; the
//!   table shows the median pull time as GB/s. The bytes are checked once per layout.
//! - **Submission:** 1000 shuffled 4 KiB blocks (a 4000 KiB pool); the median time to post all
//!   1000 gets, before the flush (`PullStats::post_time`). Goal: ≤ 100 µs.
//!
//! The endpoint's transports are printed, with a loud warning if RMA is TCP-emulated.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pd_kv_pool::BlockId;
use pd_kv_transfer::{PullSource, plan_ranges, pull_blocks};
use pd_ucx::{Context, Endpoint, MemoryRegion, RemoteKey, Worker, is_tcp_emulated_rma};

#[path = "support/perftest.rs"]
mod perftest;

use perftest::{BenchResult, Perftest, run_perftest};

/// Set (to the region size in bytes) in the owner child's environment.
const OWNER_ENV: &str = "PD_PULL_BENCH_OWNER";
/// Sizes compared with perftest by default: 256 KiB, 2.25 MiB, 16 MiB.
const DEFAULT_SIZES: [usize; 3] = [256 << 10, 2_359_296, 16 << 20];
/// The submission test: this many non-contiguous blocks of `SUBMIT_BLOCK` bytes.
const SUBMIT_BLOCKS: usize = 1000;
const SUBMIT_BLOCK: usize = 4 << 10;
/// The same with tiny blocks, to see the posting cost apart from the copies.
const SUBMIT_FLOOR_BLOCK: usize = 64;
/// Goals from the issue.
const GOAL_RATIO: f64 = 0.9;
const GOAL_POST_US: f64 = 100.0;

const USAGE: &str = "usage: cargo bench -p pd-kv-transfer --bench pull -- [--block-bytes N] \
[--sizes 262144,2359296,16777216] [--budget-ms N] [--repeat N] [--seed N] [--perftest PATH]";

/// Command-line knobs.
#[derive(Debug, Clone)]
struct Options {
    block_bytes: usize,
    sizes: Vec<usize>,
    /// Time spent per measured layout (perftest gets a similar byte budget).
    budget: Duration,
    /// Fixed repetitions instead of the budget.
    repeat: Option<usize>,
    seed: u64,
    perftest: String,
}

impl Options {
    fn parse() -> BenchResult<Self> {
        let mut o = Options {
            block_bytes: 64 << 10,
            sizes: DEFAULT_SIZES.to_vec(),
            budget: Duration::from_millis(1000),
            repeat: None,
            seed: 1,
            perftest: "ucx_perftest".to_string(),
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = |name: &str| -> BenchResult<String> {
                Ok(args.next().ok_or_else(|| format!("{name} needs a value"))?)
            };
            let number = |name: &str, v: String| -> BenchResult<usize> {
                Ok(v.parse().map_err(|e| format!("{name} {v}: {e}"))?)
            };
            match arg.as_str() {
                // `cargo bench` passes `--bench` to every bench binary.
                "--bench" => {}
                "--block-bytes" => o.block_bytes = number(&arg, value(&arg)?)?,
                "--budget-ms" => {
                    o.budget = Duration::from_millis(number(&arg, value(&arg)?)? as u64);
                }
                "--repeat" => o.repeat = Some(number(&arg, value(&arg)?)?),
                "--seed" => o.seed = number(&arg, value(&arg)?)? as u64,
                "--perftest" => o.perftest = value(&arg)?,
                "--sizes" => {
                    let v = value(&arg)?;
                    o.sizes = v
                        .split(',')
                        .map(|s| s.trim().parse::<usize>())
                        .collect::<Result<_, _>>()
                        .map_err(|e| format!("--sizes {v}: {e}"))?;
                }
                "-h" | "--help" => {
                    println!("{USAGE}");
                    std::process::exit(0);
                }
                other => return Err(format!("unknown argument {other:?}\n{USAGE}").into()),
            }
        }
        if o.block_bytes == 0 || o.repeat == Some(0) {
            return Err("--block-bytes and --repeat must be positive".into());
        }
        if let Some(&s) = o
            .sizes
            .iter()
            .find(|&&s| s == 0 || !s.is_multiple_of(o.block_bytes))
        {
            return Err(format!(
                "size {s} is not a positive multiple of --block-bytes {}",
                o.block_bytes
            )
            .into());
        }
        Ok(o)
    }
}

// ---------------------------------------------------------------------------------------------
// Owner process
// ---------------------------------------------------------------------------------------------

/// Byte `i` of an owner's region: a multiplicative hash, so every block differs.
fn pattern(i: usize) -> u8 {
    ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> BenchResult<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return Err(format!("odd-length hex {s:?}").into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?))
        .collect()
}

/// The child side: serve `len` bytes of UCX-allocated memory until stdin closes.
fn run_owner(len: usize) -> BenchResult<()> {
    let ctx = Context::new()?;
    let worker = Worker::new(&ctx)?;
    let region = MemoryRegion::allocate(&ctx, len)?;
    if region.len() < len {
        return Err(format!("UCX allocated {} of {len} bytes", region.len()).into());
    }
    // SAFETY: `region` is `len` bytes of memory UCX allocated for us; nobody else has its key
    // yet, so nothing reads or writes it while this slice lives.
    let bytes = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), len) };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern(i);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "OWNER {} {} {:x} {len}",
        hex(&worker.address()?),
        hex(&region.rkey_pack()?),
        region.base()
    )?;
    out.flush()?;
    drop(out);

    // Gets from allocated memory are one-sided, but keep progressing so that an emulated path
    // (registered memory, TCP) would complete too, and endpoint closes can finish. After 1000
    // idle polls back off to 50 µs naps: spinning would take one of the two cores from the
    // puller (perftest's server sleeps during its get test too). An emulated path still
    // completes, only slower, and the transport report flags it.
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        stop2.store(true, Ordering::Relaxed);
    });
    // A safety net against an orphan spinning forever if the parent's pipe somehow stays open.
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut idle = 0u32;
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        if worker.progress() > 0 {
            idle = 0;
        } else if idle < 1000 {
            idle += 1;
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    Ok(())
}

/// An owner child as the parent sees it. Dropping it closes the child's stdin (so it exits on
/// its own), then kills it if it has not exited within a second.
struct Owner {
    child: Child,
    stdin: Option<ChildStdin>,
    address: Vec<u8>,
    rkey: Vec<u8>,
    base: u64,
    len: usize,
}

impl Owner {
    fn spawn(len: usize) -> BenchResult<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .env(OWNER_ENV, len.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().ok_or("owner has no stdout")?;
        // Construct the guard first so that an error below still reaps the child.
        let mut owner = Owner {
            child,
            stdin,
            address: Vec::new(),
            rkey: Vec::new(),
            base: 0,
            len: 0,
        };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("OWNER ") {
                    let _ = tx.send(rest.to_string());
                }
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| "owner process printed no OWNER line within 30 s")?;
        let f: Vec<&str> = line.split_whitespace().collect();
        let [address, rkey, base, got_len] = f[..] else {
            return Err(format!("bad OWNER line {line:?}").into());
        };
        owner.address = unhex(address)?;
        owner.rkey = unhex(rkey)?;
        owner.base = u64::from_str_radix(base, 16)?;
        owner.len = got_len.parse()?;
        if owner.len != len {
            return Err(format!("owner serves {} bytes, asked for {len}", owner.len).into());
        }
        Ok(owner)
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// ucx_perftest
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Our pull
// ---------------------------------------------------------------------------------------------

/// splitmix64: a small seeded generator for the shuffles.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn shuffled(&mut self, n: usize) -> Vec<BlockId> {
        let mut ids: Vec<BlockId> = (0..n as u32).map(BlockId).collect();
        for i in (1..n).rev() {
            ids.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
        ids
    }
}

/// Remote and local orders of `n` blocks that plan to exactly `n` descriptors (no pair of
/// neighbours is consecutive on both sides; reshuffles until so).
fn scattered(n: usize, block_bytes: usize, seed: u64) -> (Vec<BlockId>, Vec<BlockId>) {
    let mut rng = Rng(seed);
    loop {
        let remote = rng.shuffled(n);
        let local = rng.shuffled(n);
        if plan_ranges(&remote, &local, block_bytes).len() == n {
            return (remote, local);
        }
    }
}

fn identity(n: usize) -> Vec<BlockId> {
    (0..n as u32).map(BlockId).collect()
}

/// Medians (and the spread) of repeated pulls of one layout.
#[derive(Debug, Clone, Copy)]
struct Timing {
    reps: usize,
    descriptors: usize,
    bytes: usize,
    total: Duration,
    total_p10: Duration,
    total_p90: Duration,
    /// Sum of all repetitions, for a mean like perftest's `overall_bw`.
    total_sum: Duration,
    post: Duration,
}

impl Timing {
    /// From the median pull time.
    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.total.as_secs_f64() / 1e9
    }

    /// From the mean pull time (all bytes over all time).
    fn mean_gbps(&self) -> f64 {
        (self.bytes * self.reps) as f64 / self.total_sum.as_secs_f64() / 1e9
    }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// A connection to one owner: endpoint, unpacked key and a local region of the same size.
struct Link<'w> {
    // Fields drop in order: the key before its endpoint.
    rkey: RemoteKey<'w>,
    ep: Endpoint<'w>,
    dst: MemoryRegion,
    base: u64,
    len: usize,
}

impl<'w> Link<'w> {
    fn connect(ctx: &Context, worker: &'w Worker, owner: &Owner) -> BenchResult<Self> {
        let ep = worker.connect(&owner.address)?;
        let rkey = ep.unpack_rkey(&owner.rkey)?;
        let dst = MemoryRegion::allocate(ctx, owner.len)?;
        if dst.len() < owner.len {
            return Err(format!("UCX allocated {} of {} bytes", dst.len(), owner.len).into());
        }
        Ok(Link {
            ep,
            rkey,
            dst,
            base: owner.base,
            len: owner.len,
        })
    }

    fn source(&self) -> PullSource<'_, 'w> {
        PullSource {
            endpoint: &self.ep,
            rkey: &self.rkey,
            remote_base: self.base,
            remote_len: self.len,
        }
    }

    /// Fills the local region with a byte the pattern's checks will notice.
    fn clear(&self) {
        // SAFETY: no operation on `dst` is outstanding (every pull waits for its flush), and
        // `dst` holds at least `self.len` bytes.
        unsafe { std::ptr::write_bytes(self.dst.as_ptr(), 0x5A, self.len) };
    }

    /// Pulls once into a cleared region and checks that local block `local[k]` holds the
    /// owner's block `remote[k]`, byte for byte.
    fn pull_and_verify(
        &self,
        remote: &[BlockId],
        local: &[BlockId],
        block_bytes: usize,
    ) -> BenchResult<()> {
        self.clear();
        pull_blocks(&self.source(), &self.dst, remote, local, block_bytes)?;
        // SAFETY: the pull completed (flush waited), so nothing writes `dst` while we read it.
        let got = unsafe { std::slice::from_raw_parts(self.dst.as_ptr(), self.len) };
        for (&r, &l) in remote.iter().zip(local) {
            let block = &got[l.index() * block_bytes..][..block_bytes];
            let from = r.index() * block_bytes;
            if let Some(j) = (0..block_bytes).find(|&j| block[j] != pattern(from + j)) {
                return Err(format!(
                    "DATA MISMATCH: local block {} byte {j} is {:#04x}, remote block {} has {:#04x}",
                    l.0,
                    block[j],
                    r.0,
                    pattern(from + j)
                )
                .into());
            }
        }
        Ok(())
    }

    /// Pulls `remote` → `local` after a warm-up, `repeat` times or for about `budget`.
    fn time(
        &self,
        remote: &[BlockId],
        local: &[BlockId],
        block_bytes: usize,
        budget: Duration,
        repeat: Option<usize>,
    ) -> BenchResult<Timing> {
        let src = self.source();
        let warm = Instant::now();
        for _ in 0..5 {
            pull_blocks(&src, &self.dst, remote, local, block_bytes)?;
        }
        let one = warm.elapsed() / 5;
        let reps = repeat.unwrap_or_else(|| {
            (budget.as_secs_f64() / one.as_secs_f64().max(1e-9)).clamp(20.0, 20_000.0) as usize
        });
        let mut totals = Vec::with_capacity(reps);
        let mut posts = Vec::with_capacity(reps);
        let mut last = None;
        for _ in 0..reps {
            let s = pull_blocks(&src, &self.dst, remote, local, block_bytes)?;
            totals.push(s.total_time);
            posts.push(s.post_time);
            last = Some(s);
        }
        let last = last.ok_or("no repetitions")?;
        let total_sum = totals.iter().sum();
        totals.sort_unstable();
        posts.sort_unstable();
        Ok(Timing {
            reps,
            descriptors: last.descriptors,
            bytes: last.bytes,
            total: quantile(&totals, 0.5),
            total_p10: quantile(&totals, 0.1),
            total_p90: quantile(&totals, 0.9),
            total_sum,
            post: quantile(&posts, 0.5),
        })
    }
}

fn size_label(bytes: usize) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 20 {
        format!("{:.2} MiB", bytes as f64 / f64::from(1 << 20))
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// One row of the summary table.
struct Row {
    size: usize,
    perftest: Perftest,
    scattered: Timing,
    coalesced: Timing,
}

fn print_transports(ep: &Endpoint<'_>) -> BenchResult<()> {
    let report = ep.transport_report()?;
    println!(
        "transports: {:?} (rma lanes: {:?})",
        report.transports(),
        report.rma_transports()
    );
    // UCX's own summary of how gets are done (protocol per size range).
    for line in report.raw.lines().map(|l| l.trim_start_matches('#').trim()) {
        if line.starts_with("get") || line.starts_with("rma_bw") || line.contains("rkey_ptr") {
            println!("  {line}");
        }
    }
    if is_tcp_emulated_rma(&report) {
        println!();
        println!("!!! WARNING: RMA IS TCP-EMULATED on this endpoint: pulls run over tcp, !!!");
        println!("!!! expect ~0.4 GB/s. Check UCX_TLS and the owner's memory registration. !!!");
        println!();
    }
    Ok(())
}

fn main() -> BenchResult<()> {
    if let Some(size) = std::env::var_os(OWNER_ENV) {
        let size: usize = size.to_string_lossy().parse()?;
        return run_owner(size);
    }
    let opts = Options::parse()?;
    let shown: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    println!(
        "command: cargo bench -p pd-kv-transfer --bench pull{}{}",
        if shown.is_empty() { "" } else { " -- " },
        shown.join(" ")
    );
    let (major, minor, release) = pd_ucx::library_version();
    println!(
        "UCX {major}.{minor}.{release}; block {} B; budget {:?} per layout; UCX_TLS={}",
        opts.block_bytes,
        opts.budget,
        std::env::var("UCX_TLS").unwrap_or_else(|_| "(unset)".into())
    );

    // Other work on the host skews everything here; say how much there was.
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        println!(
            "{} cores, load average {}",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    let ctx = Context::new()?;
    let worker = Worker::new(&ctx)?;
    let mut rows = Vec::new();
    for (i, &size) in opts.sizes.iter().enumerate() {
        println!();
        println!("== {} ({size} B) ==", size_label(size));
        // About 16 GiB of gets per size: 0.2-1 s at perftest's speeds here.
        let iterations = ((16usize << 30) / size).clamp(100, 100_000);
        let (perftest, command) = run_perftest(&opts.perftest, size, iterations)?;
        println!("{command}");
        println!(
            "  perftest: {} iterations, {:.2} µs/get, {:.2} GB/s",
            perftest.iterations, perftest.overall_lat_us, perftest.gbps
        );

        let owner = Owner::spawn(size)?;
        let link = Link::connect(&ctx, &worker, &owner)?;
        let n = size / opts.block_bytes;
        let (remote, local) = scattered(n, opts.block_bytes, opts.seed.wrapping_add(i as u64));
        let ids = identity(n);
        link.pull_and_verify(&remote, &local, opts.block_bytes)?;
        link.pull_and_verify(&ids, &ids, opts.block_bytes)?;
        if i == 0 {
            print_transports(&link.ep)?;
        }
        let sc = link.time(&remote, &local, opts.block_bytes, opts.budget, opts.repeat)?;
        let co = link.time(&ids, &ids, opts.block_bytes, opts.budget, opts.repeat)?;
        for (name, t) in [("scattered", &sc), ("coalesced", &co)] {
            println!(
                "  ours {name}: {} descriptors, {} pulls, median {:.2} µs (p10 {:.2}, p90 {:.2}), \
                 post {:.2} µs, {:.2} GB/s = {:.2}× perftest (mean {:.2} GB/s = {:.2}×)",
                t.descriptors,
                t.reps,
                us(t.total),
                us(t.total_p10),
                us(t.total_p90),
                us(t.post),
                t.gbps(),
                t.gbps() / perftest.gbps,
                t.mean_gbps(),
                t.mean_gbps() / perftest.gbps
            );
        }
        drop(link);
        drop(owner);
        rows.push(Row {
            size,
            perftest,
            scattered: sc,
            coalesced: co,
        });
    }

    // The 4 KiB run is the goal; the 64 B run shows the posting cost without the copies
    // (shared-memory gets are copied inside `ucp_get_nbx`, so post time includes them).
    let mut submit = None;
    for block in [SUBMIT_BLOCK, SUBMIT_FLOOR_BLOCK] {
        println!();
        println!("== submission: {SUBMIT_BLOCKS} non-contiguous {block} B blocks ==");
        let owner = Owner::spawn(SUBMIT_BLOCKS * block)?;
        let link = Link::connect(&ctx, &worker, &owner)?;
        let (remote, local) = scattered(SUBMIT_BLOCKS, block, opts.seed ^ 0x5EED);
        link.pull_and_verify(&remote, &local, block)?;
        let t = link.time(&remote, &local, block, opts.budget, opts.repeat)?;
        println!(
            "  {} descriptors, {} pulls: median post {:.1} µs ({:.0} ns/get), median total \
             {:.1} µs ({:.2} GB/s)",
            t.descriptors,
            t.reps,
            us(t.post),
            us(t.post) * 1e3 / t.descriptors as f64,
            us(t.total),
            t.gbps()
        );
        drop(link);
        drop(owner);
        submit.get_or_insert(t);
    }
    let submit = submit.ok_or("no submission run")?;

    println!();
    println!(
        "| size | perftest GB/s | ours scattered GB/s (descriptors) | ratio | ours coalesced GB/s | ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.2} | {:.2} ({}) | {:.2} | {:.2} | {:.2} |",
            size_label(r.size),
            r.perftest.gbps,
            r.scattered.gbps(),
            r.scattered.descriptors,
            r.scattered.gbps() / r.perftest.gbps,
            r.coalesced.gbps(),
            r.coalesced.gbps() / r.perftest.gbps
        );
    }
    println!();
    println!(
        "post time, {SUBMIT_BLOCKS} × {} KiB non-contiguous: {:.1} µs (goal ≤ {GOAL_POST_US} µs: {})",
        SUBMIT_BLOCK >> 10,
        us(submit.post),
        if us(submit.post) <= GOAL_POST_US {
            "met"
        } else {
            "NOT met"
        }
    );
    for r in rows.iter().filter(|r| r.size >= 2_359_296) {
        let ratio = r.scattered.gbps() / r.perftest.gbps;
        println!(
            "{}: scattered {ratio:.2}× perftest (goal ≥ {GOAL_RATIO}×: {})",
            size_label(r.size),
            if ratio >= GOAL_RATIO {
                "met"
            } else {
                "NOT met"
            }
        );
    }
    Ok(())
}
