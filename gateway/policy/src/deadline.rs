//! The wall-clock deadline of policy calls, without a clock ticking through idle time.
//!
//! wasmtime stops a running guest when the engine's epoch passes its store's deadline; someone
//! must advance the epoch. A thread that ticks on a period costs a wake-up per tick on cores
//! the nodes share (on a VM each wake-up is tens of µs of CPU), whether calls run or not. So
//! the `pd-policy-epoch` thread sleeps on a Linux `timerfd` instead, and the epoch advances
//! only when a call may have run past its deadline:
//!
//! - a call (or an instantiation) [`DeadlineClock::enter`]s with its deadline: the timer is
//!   armed for that instant unless it already fires sooner (a clock read and an atomic load;
//!   one `timerfd_settime` when it must arm). Nothing is woken;
//! - when the timer fires, the thread advances the epoch: each store running then calls its
//!   deadline callback, which traps the call if its own deadline has passed and lets it go on
//!   otherwise ([`past`]); while calls still run, the timer fires again [`RECHECK`] later.
//!
//! So a runaway call stops between its deadline and [`RECHECK`] after it (plus scheduling),
//! and a gateway with no calls has a thread asleep in `read`. Each firing also passes the
//! spare thread its wake-up (`spare.rs`), which the request path never does itself.
//!
//! This module owns the timer and its thread's loop; it does not touch stores or the engine
//! (the caller's `on_fire` does).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// While calls still run when the timer fires, it fires again this much later.
pub const RECHECK: Duration = Duration::from_micros(250);

/// `armed_at` when the timer is not armed.
const NOT_ARMED: u64 = u64::MAX;

/// Now on `CLOCK_MONOTONIC`, in ns: the timer's clock.
pub(crate) fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes only the `timespec` it is given; CLOCK_MONOTONIC exists on
    // every Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Whether a call whose deadline is `deadline_ns` ([`now_ns`]'s clock) has run past it.
pub(crate) fn past(deadline_ns: u64) -> bool {
    now_ns() >= deadline_ns
}

/// The timer, what it is armed for, and the calls in flight.
#[derive(Debug)]
pub(crate) struct DeadlineClock {
    timer: OwnedFd,
    /// When the timer fires next ([`now_ns`]'s clock), or [`NOT_ARMED`].
    armed_at: AtomicU64,
    /// Calls in flight.
    active: AtomicUsize,
    /// Orders the changes of `armed_at` with the `timerfd_settime` calls that make them true.
    arm: Mutex<()>,
    stop: AtomicBool,
}

/// A call in flight ([`DeadlineClock::enter`]); its deadline is `deadline_ns`.
#[derive(Debug)]
pub(crate) struct Active<'a> {
    clock: &'a DeadlineClock,
    /// The call's deadline, on [`now_ns`]'s clock.
    pub(crate) deadline_ns: u64,
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.clock.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl DeadlineClock {
    /// A new, unarmed timer.
    ///
    /// # Errors
    /// The kernel refuses a `timerfd` (too many open files).
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: `timerfd_create` takes no pointers; a negative result is an error.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            // SAFETY: `fd` is a descriptor just created, owned by nothing else.
            timer: unsafe { OwnedFd::from_raw_fd(fd) },
            armed_at: AtomicU64::new(NOT_ARMED),
            active: AtomicUsize::new(0),
            arm: Mutex::new(()),
            stop: AtomicBool::new(false),
        })
    }

    /// A call with wall-clock budget `deadline` starts now; it ends when the guard drops.
    pub(crate) fn enter(&self, deadline: Duration) -> Active<'_> {
        self.active.fetch_add(1, Ordering::SeqCst);
        let budget = u64::try_from(deadline.as_nanos()).unwrap_or(u64::MAX);
        let deadline_ns = now_ns().saturating_add(budget);
        // Both SeqCst with the firing thread's reset and its look at `active`: either this
        // load sees the reset (and arms), or the firing thread sees this call (and re-arms).
        if self.armed_at.load(Ordering::SeqCst) > deadline_ns {
            self.arm_at(deadline_ns);
        }
        Active {
            clock: self,
            deadline_ns,
        }
    }

    /// Arms the timer for `at` unless it fires sooner already.
    fn arm_at(&self, at: u64) {
        let _guard = self.arm.lock().unwrap_or_else(|e| e.into_inner());
        if self.armed_at.load(Ordering::SeqCst) <= at {
            return;
        }
        self.armed_at.store(at, Ordering::SeqCst);
        self.settime(at);
    }

    /// Sets the timer to fire at `at` (`CLOCK_MONOTONIC` ns; a time past fires at once).
    fn settime(&self, at: u64) {
        let value = libc::timespec {
            tv_sec: (at / 1_000_000_000) as libc::time_t,
            tv_nsec: (at % 1_000_000_000) as libc::c_long,
        };
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            // All zero would disarm the timer: fire at the first nanosecond instead.
            it_value: if at == 0 {
                libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 1,
                }
            } else {
                value
            },
        };
        // SAFETY: `spec` is a valid `itimerspec`; the old value is not asked for (null). It
        // cannot fail on a valid timerfd with a normalized `timespec`.
        unsafe {
            libc::timerfd_settime(
                self.timer.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
    }

    /// The `pd-policy-epoch` thread's loop: waits for the timer, then `on_fire` (advance the
    /// epoch, pass wake-ups on); re-arms while calls run. Returns after [`DeadlineClock::stop`].
    pub(crate) fn run(&self, mut on_fire: impl FnMut()) {
        let mut expirations = [0u8; 8];
        while !self.stop.load(Ordering::SeqCst) {
            // SAFETY: reads at most 8 bytes into an 8-byte buffer.
            let n = unsafe {
                libc::read(
                    self.timer.as_raw_fd(),
                    expirations.as_mut_ptr().cast(),
                    expirations.len(),
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!(error = %e, "policy deadline timer failed: only fuel bounds policy calls now");
                return;
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            {
                let _guard = self.arm.lock().unwrap_or_else(|e| e.into_inner());
                self.armed_at.store(NOT_ARMED, Ordering::SeqCst);
            }
            on_fire();
            if self.active.load(Ordering::SeqCst) > 0 {
                self.arm_at(now_ns().saturating_add(RECHECK.as_nanos() as u64));
            }
        }
    }

    /// Ends [`DeadlineClock::run`] (the timer fires at once).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _guard = self.arm.lock().unwrap_or_else(|e| e.into_inner());
        self.armed_at.store(0, Ordering::SeqCst);
        self.settime(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicU32;
    use std::time::Instant;

    fn started(clock: &Arc<DeadlineClock>) -> (Arc<AtomicU32>, std::thread::JoinHandle<()>) {
        let fired = Arc::new(AtomicU32::new(0));
        let (c, f) = (clock.clone(), fired.clone());
        let t = std::thread::spawn(move || {
            c.run(|| {
                f.fetch_add(1, Ordering::SeqCst);
            })
        });
        (fired, t)
    }

    #[test]
    fn fires_past_a_running_call_s_deadline_and_rechecks_until_it_ends() {
        let clock = Arc::new(DeadlineClock::new().unwrap());
        let (fired, thread) = started(&clock);
        let call = clock.enter(Duration::from_millis(5));
        assert!(!past(call.deadline_ns));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(fired.load(Ordering::SeqCst), 0, "not before the deadline");
        let t = Instant::now();
        while fired.load(Ordering::SeqCst) < 3 {
            assert!(t.elapsed() < Duration::from_secs(10), "fired and rechecked");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(past(call.deadline_ns));
        drop(call);
        // Once no call runs, it stops firing.
        std::thread::sleep(Duration::from_millis(5));
        let settled = fired.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            fired.load(Ordering::SeqCst),
            settled,
            "no firing without calls"
        );
        clock.stop();
        thread.join().unwrap();
    }

    #[test]
    fn an_earlier_deadline_rearms_a_later_one_does_not() {
        let clock = DeadlineClock::new().unwrap();
        let long = clock.enter(Duration::from_secs(60));
        let armed = clock.armed_at.load(Ordering::SeqCst);
        assert_eq!(armed, long.deadline_ns);
        let short = clock.enter(Duration::from_millis(1));
        assert_eq!(clock.armed_at.load(Ordering::SeqCst), short.deadline_ns);
        let _later = clock.enter(Duration::from_secs(30));
        assert_eq!(
            clock.armed_at.load(Ordering::SeqCst),
            short.deadline_ns,
            "a later deadline leaves the sooner firing"
        );
        assert_eq!(clock.active.load(Ordering::SeqCst), 3);
    }
}
