//! Shared helpers for the loopback tests: two workers in one process, each test with its own.
#![allow(dead_code)]

use pd_ucx::{Context, MemoryRegion, Request, Worker};

/// A byte pattern that differs per offset and per seed.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .rotate_left(u32::from(seed) % 31) as u8
                ^ seed
        })
        .collect()
}

/// Polls `req` while progressing both workers (a same-thread pair needs the peer progressed
/// too, e.g. for wireup or active messages).
pub fn wait_both(mut req: Request<'_>, other: &Worker) -> pd_ucx::Result<()> {
    loop {
        if let Some(r) = req.poll() {
            return r;
        }
        req.worker().progress();
        other.progress();
    }
}

/// Progresses both workers until `done()` or a 10 s deadline.
pub fn progress_until(a: &Worker, b: &Worker, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out progressing workers"
        );
        a.progress();
        b.progress();
    }
}

/// A heap buffer registered with UCX; the buffer outlives the region (field order).
pub struct Mapped {
    pub region: MemoryRegion,
    pub buf: Box<[u8]>,
}

impl Mapped {
    pub fn new(ctx: &Context, contents: Vec<u8>) -> Self {
        let mut buf: Box<[u8]> = contents.into();
        // SAFETY: the Box's heap allocation neither moves nor is freed while `region` lives
        // (fields drop in declaration order, region first), and tests read `buf` only after
        // the operations that write it have completed.
        let region =
            unsafe { MemoryRegion::map(ctx, buf.as_mut_ptr(), buf.len()) }.expect("ucp_mem_map");
        Mapped { region, buf }
    }

    /// Reads the buffer through a raw pointer (RMA may have written it behind Rust's back).
    pub fn snapshot(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.buf.len()];
        // SAFETY: region memory is valid for `len` bytes; no operation is in flight.
        unsafe { std::ptr::copy_nonoverlapping(self.region.as_ptr(), out.as_mut_ptr(), out.len()) };
        out
    }
}
