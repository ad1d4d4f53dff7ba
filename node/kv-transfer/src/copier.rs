//! Large copies shared between the calling thread and one helper thread.
//!
//! A pull from a peer's pool mapped into this process is a `memcpy` of KV the producer has just
//! written into blocks of ours that are not in any cache. One core moves such data at about half
//! the rate of the same copy between warm buffers; two cores, each copying part, move it at about
//! the warm rate (docs/bench-log/pd.md, "Two cores for the mapped copy"). [`Copier`] keeps one
//! helper thread asleep for that: a copy is cut into chunks, the helper is woken, and both threads
//! claim chunks from one counter until none are left. The caller never waits for the helper to
//! *start*: if the helper is slow to wake or the other core is busy, the caller copies every chunk
//! itself, so a copy never takes longer than one thread alone would, plus at most the one chunk the
//! helper is in the middle of.
//!
//! Where the helper runs matters: woken on an otherwise idle machine, Linux often places it on
//! the waker's own CPU, where the two threads take turns and the copy gains nothing (measured
//! here: the helper copied half the bytes and the copy took as long as on one thread). So on
//! Linux the helper's affinity excludes the CPU the copying thread is on (set again only when
//! that thread has moved; skipped when the process may use one CPU only).
//!
//! Waking the helper at the copy costs its wake-up (tens of µs on a VM) out of a copy of a
//! few hundred. A caller that knows a large copy is coming calls [`Copier::prepare`] first
//! (D does when a request with params arrives, before it waits for blocks): the helper wakes
//! then and waits for the copy on the CPU, yielding to any other thread that wants it, for at
//! most [`READY_SPIN`]; then it sleeps again.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Copies of fewer bytes run on the calling thread alone (waking the helper costs more).
pub const SHARED_COPY_MIN_BYTES: usize = 512 * 1024;

/// Bytes per claimed chunk: small enough to balance two threads, large enough that claiming is
/// free.
pub const CHUNK_BYTES: usize = 128 * 1024;

/// How long a helper woken by [`Copier::prepare`] waits on the CPU for the copy before it
/// sleeps again.
pub const READY_SPIN: std::time::Duration = std::time::Duration::from_millis(2);

/// One contiguous copy: `len` bytes from `src` to `dst`.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    /// Source of the bytes.
    pub src: *const u8,
    /// Destination of the bytes.
    pub dst: *mut u8,
    /// Byte count.
    pub len: usize,
}

// SAFETY: a `Span` is two addresses and a length; the contract of `Copier::copy` (valid,
// disjoint, not accessed by anyone else during the call) is what makes using them from the
// helper thread sound, and the caller does not return before the helper is done with them.
unsafe impl Send for Span {}
// SAFETY: as above; a shared `Span` is only read.
unsafe impl Sync for Span {}

/// The chunks of one copy and the two counters the threads share.
#[derive(Debug)]
struct Task {
    chunks: Vec<Span>,
    /// The next chunk to claim (may run past `chunks.len()`).
    next: AtomicUsize,
    /// Chunks copied.
    done: AtomicUsize,
    /// Bytes the helper copied (counted before `done`).
    by_helper: AtomicUsize,
}

impl Task {
    /// Claims and copies chunks until none are left.
    ///
    /// # Safety
    /// Each chunk as [`Copier::copy`] requires, for as long as any is unclaimed or in progress.
    unsafe fn work(&self, helper: bool) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(c) = self.chunks.get(i) else { return };
            // SAFETY: per this function's contract; each index is claimed by one thread only.
            unsafe { std::ptr::copy_nonoverlapping(c.src, c.dst, c.len) };
            if helper {
                self.by_helper.fetch_add(c.len, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    task: Mutex<Option<Arc<Task>>>,
    /// Set with `task` (under its lock) for a helper waiting on the CPU, cleared when taken.
    posted: AtomicBool,
    /// A copy is coming ([`Copier::prepare`]): the sleeping helper wakes and waits on the CPU.
    prepared: AtomicBool,
    wake: Condvar,
    stop: AtomicBool,
    /// The helper's kernel thread id (0 until it has started).
    tid: AtomicI32,
}

/// A helper thread that takes part in large copies; dropping it stops the thread. Several
/// threads may copy through one copier at once: the helper takes part in one copy at a time,
/// and the others run on their callers alone.
#[derive(Debug)]
pub struct Copier {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// The CPU the helper's affinity currently leaves out (-1: none yet).
    kept_off: AtomicI32,
}

impl Copier {
    /// Starts the helper thread (`pd-kv-copy`), asleep until a copy needs it.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn spawn() -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("pd-kv-copy".into())
            .spawn(move || helper(&s))?;
        Ok(Self {
            shared,
            thread: Some(thread),
            kept_off: AtomicI32::new(-1),
        })
    }

    /// A copier without a helper: every copy runs on the calling thread (where a thread cannot
    /// be spawned).
    pub fn alone() -> Self {
        Self {
            shared: Arc::new(Shared::default()),
            thread: None,
            kept_off: AtomicI32::new(-1),
        }
    }

    /// Keeps the helper off the CPU this thread runs on (see the module's doc).
    #[cfg(target_os = "linux")]
    fn keep_helper_off_this_cpu(&self) {
        // SAFETY: no arguments; returns the CPU or -1.
        let me = unsafe { libc::sched_getcpu() };
        let tid = self.shared.tid.load(Ordering::Acquire);
        if me < 0 || tid <= 0 || self.kept_off.load(Ordering::Relaxed) == me {
            return;
        }
        // SAFETY: an all-zero `cpu_set_t` is a valid empty set; the calls get its exact size
        // and only read or write that set.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            if libc::sched_getaffinity(0, size, &mut set) != 0 {
                return;
            }
            libc::CPU_CLR(me as usize, &mut set);
            if libc::CPU_COUNT(&set) == 0 {
                return;
            }
            if libc::sched_setaffinity(tid, size, &set) != 0 {
                return;
            }
        }
        self.kept_off.store(me, Ordering::Relaxed);
    }

    #[cfg(not(target_os = "linux"))]
    fn keep_helper_off_this_cpu(&self) {}

    /// Says a copy of `bytes` is coming: when it will be shared, the helper wakes now and
    /// waits for it on the CPU for at most [`READY_SPIN`] (see the module's doc). Cheap when
    /// the helper is already up.
    pub fn prepare(&self, bytes: usize) {
        if bytes < SHARED_COPY_MIN_BYTES || self.thread.is_none() {
            return;
        }
        if !self.shared.prepared.swap(true, Ordering::AcqRel) {
            let _guard = lock(&self.shared.task);
            self.shared.wake.notify_one();
        }
    }

    /// Copies every span; returns once all bytes are in place, with the bytes the helper copied.
    /// Spans totalling at least [`SHARED_COPY_MIN_BYTES`] are shared with the helper in chunks
    /// of [`CHUNK_BYTES`].
    ///
    /// # Safety
    /// For the whole call, each span's `src` must be valid for reads and its `dst` valid for
    /// writes of `len` bytes, no destination may overlap another span's source or destination,
    /// and nothing else may access the destinations.
    pub unsafe fn copy(&self, spans: &[Span]) -> usize {
        let total: usize = spans.iter().map(|s| s.len).sum();
        if total < SHARED_COPY_MIN_BYTES || self.thread.is_none() {
            for s in spans {
                // SAFETY: per this function's contract.
                unsafe { std::ptr::copy_nonoverlapping(s.src, s.dst, s.len) };
            }
            return 0;
        }
        let task = Arc::new(Task {
            chunks: chunks(spans, CHUNK_BYTES),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            by_helper: AtomicUsize::new(0),
        });
        {
            let mut slot = lock(&self.shared.task);
            if slot.is_some() {
                // Another thread's copy has the helper: copy alone.
                drop(slot);
                for s in spans {
                    // SAFETY: per this function's contract.
                    unsafe { std::ptr::copy_nonoverlapping(s.src, s.dst, s.len) };
                }
                return 0;
            }
            self.keep_helper_off_this_cpu();
            *slot = Some(Arc::clone(&task));
            self.shared.posted.store(true, Ordering::Release);
        }
        self.shared.wake.notify_one();
        // SAFETY: per this function's contract.
        unsafe { task.work(false) };
        // Every chunk is claimed; wait for those the helper is still copying (at most one).
        let mut spins = 0u32;
        while task.done.load(Ordering::Acquire) < task.chunks.len() {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // A helper that has not looked yet finds nothing to take.
        let mut slot = lock(&self.shared.task);
        if slot.as_ref().is_some_and(|t| Arc::ptr_eq(t, &task)) {
            slot.take();
            self.shared.posted.store(false, Ordering::Release);
        }
        drop(slot);
        task.by_helper.load(Ordering::Relaxed)
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _guard = lock(&self.shared.task);
            self.shared.wake.notify_one();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Locks `m`; a poisoned lock is taken anyway (what it guards holds no invariant a panic breaks).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn helper(shared: &Shared) {
    #[cfg(target_os = "linux")]
    // SAFETY: no arguments; returns this thread's id.
    shared
        .tid
        .store(unsafe { libc::gettid() }, Ordering::Release);
    loop {
        let task = {
            let mut slot = lock(&shared.task);
            loop {
                if shared.stop.load(Ordering::Acquire) {
                    return;
                }
                if let Some(t) = slot.take() {
                    shared.posted.store(false, Ordering::Release);
                    break t;
                }
                if shared.prepared.load(Ordering::Acquire) {
                    drop(slot);
                    ready(shared);
                    shared.prepared.store(false, Ordering::Release);
                    slot = lock(&shared.task);
                    continue;
                }
                slot = shared
                    .wake
                    .wait(slot)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        // SAFETY: the caller of `Copier::copy` keeps every chunk valid until `done` counts all
        // of them, and a chunk is only touched after claiming it; once all are claimed this
        // touches nothing.
        unsafe { task.work(true) };
    }
}

/// A prepared helper's wait on the CPU: until a copy is posted, the copier stops, or
/// [`READY_SPIN`] has passed. It yields between looks, so a thread that wants this CPU gets it.
fn ready(shared: &Shared) {
    let until = std::time::Instant::now() + READY_SPIN;
    let mut looks = 0u32;
    while !shared.posted.load(Ordering::Acquire) && !shared.stop.load(Ordering::Acquire) {
        looks += 1;
        if looks.is_multiple_of(64) {
            if std::time::Instant::now() >= until {
                return;
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// `spans` cut into pieces of at most `chunk` bytes, in order.
fn chunks(spans: &[Span], chunk: usize) -> Vec<Span> {
    let mut out = Vec::with_capacity(spans.iter().map(|s| s.len.div_ceil(chunk)).sum());
    for s in spans {
        let mut off = 0;
        while off < s.len {
            let len = chunk.min(s.len - off);
            out.push(Span {
                src: s.src.wrapping_add(off),
                dst: s.dst.wrapping_add(off),
                len,
            });
            off += len;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random runs of `src` copied into shuffled places of `dst` through the copier equal the same
    /// runs copied one by one, for totals below and above the sharing threshold, and bytes
    /// outside the runs stay untouched.
    #[test]
    fn shared_copies_equal_plain_copies() {
        let copier = Copier::spawn().unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(runs, run_bytes) in &[
            (3usize, 1000usize),
            (9, 64 * 1024),
            (40, 100_003),
            (2, 3 << 20),
        ] {
            let src: Vec<u8> = (0..runs * run_bytes).map(|_| rng.random()).collect();
            let mut order: Vec<usize> = (0..runs).collect();
            for i in (1..runs).rev() {
                order.swap(i, rng.random_range(0..=i));
            }
            let mut got = vec![0xAAu8; (runs + 1) * run_bytes];
            let mut want = got.clone();
            let spans: Vec<Span> = order
                .iter()
                .enumerate()
                .map(|(i, &j)| Span {
                    src: src[j * run_bytes..].as_ptr(),
                    dst: got[(i + 1) * run_bytes..].as_mut_ptr(),
                    len: run_bytes,
                })
                .collect();
            // SAFETY: every span lies inside `src` / `got`; destinations are disjoint.
            let helped = unsafe { copier.copy(&spans) };
            assert!(helped <= runs * run_bytes);
            for (i, &j) in order.iter().enumerate() {
                want[(i + 1) * run_bytes..(i + 2) * run_bytes]
                    .copy_from_slice(&src[j * run_bytes..(j + 1) * run_bytes]);
            }
            assert!(got == want, "{runs} runs of {run_bytes} bytes");
        }
    }

    #[test]
    fn chunks_cover_each_span_in_order_and_within_the_size() {
        let a = [0u8; 10];
        let mut b = [0u8; 10];
        let spans = [
            Span {
                src: a.as_ptr(),
                dst: b.as_mut_ptr(),
                len: 7,
            },
            Span {
                src: a[7..].as_ptr(),
                dst: b[7..].as_mut_ptr(),
                len: 3,
            },
        ];
        let c = chunks(&spans, 3);
        let lens: Vec<usize> = c.iter().map(|s| s.len).collect();
        assert_eq!(lens, [3, 3, 1, 3]);
        assert_eq!(c[2].src, a[6..].as_ptr());
        assert_eq!(c[3].dst as *const u8, b[7..].as_ptr());
    }

    /// Many copies back to back, some while the helper may still be finishing the last one's
    /// claim loop, and a drop right after: every copy is complete when `copy` returns.
    #[test]
    fn back_to_back_copies_are_each_complete_on_return() {
        let copier = Copier::spawn().unwrap();
        let n = SHARED_COPY_MIN_BYTES * 2 + 17;
        let mut dst = vec![0u8; n];
        let mut helped = 0;
        for round in 0..200u32 {
            let src = vec![(round % 251) as u8 + 1; n];
            let span = Span {
                src: src.as_ptr(),
                dst: dst.as_mut_ptr(),
                len: n,
            };
            // SAFETY: both buffers are `n` bytes and distinct.
            helped += unsafe { copier.copy(&[span]) };
            assert!(
                dst.iter().all(|&b| b == (round % 251) as u8 + 1),
                "round {round}"
            );
            // Give the helper time to go back to sleep in some rounds, none in others.
            if round % 2 == 0 {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
        // The helper took part (a copy it slept through is the caller's alone, so this counts
        // over many copies, not one).
        assert!(helped > 0, "the helper copied nothing in 200 copies");
        assert!(helped < 200 * n, "the caller copied nothing");
        drop(copier);
    }

    /// Copies announced with `prepare` — some right away, some after the helper gave up
    /// waiting, some after a too-small announcement — are each complete on return, and a
    /// prepared helper does not keep the copier from stopping.
    #[test]
    fn prepared_copies_are_complete_and_a_prepared_helper_stops() {
        let copier = Copier::spawn().unwrap();
        let n = SHARED_COPY_MIN_BYTES * 3;
        let mut dst = vec![0u8; n];
        for round in 0..60u32 {
            copier.prepare(if round % 5 == 0 { 10 } else { n });
            match round % 3 {
                0 => {}
                1 => std::thread::sleep(std::time::Duration::from_micros(300)),
                _ => std::thread::sleep(READY_SPIN + std::time::Duration::from_millis(1)),
            }
            let src = vec![(round % 200) as u8 + 3; n];
            let span = Span {
                src: src.as_ptr(),
                dst: dst.as_mut_ptr(),
                len: n,
            };
            // SAFETY: both buffers are `n` bytes and distinct.
            unsafe { copier.copy(&[span]) };
            assert!(
                dst.iter().all(|&b| b == (round % 200) as u8 + 3),
                "round {round}"
            );
        }
        copier.prepare(n);
        drop(copier);
    }
}
