//! The clock that advances the engine's epoch, so that wasmtime stops a policy call that runs
//! past its wall-clock deadline.
//!
//! Each store checks its own call's deadline whenever the epoch advances (its epoch callback:
//! [`past`]), so deadlines are exact to the tick whatever the tick schedule. The
//! `pd-policy-epoch` thread advances it every [`TICK`] while a call runs, every [`DOZE`] in
//! the gaps between calls, and not at all once [`LINGER`] passed without a call: it then
//! sleeps on a Linux `timerfd`. While it ticks or dozes, a call starts with two atomic adds, a
//! clock read and a load: no syscall, no wake-up. A call that finds it asleep arms the timer
//! for its own deadline (one `timerfd_settime`, unless the timer fires sooner already) and
//! wakes nothing: the thread wakes at that deadline, advances the epoch, and ticks again.
//!
//! Measured on the 2-core VM (docs/bench-log/gateway.md, "The epoch thread asleep"): a futex wake
//! of the sleeping thread cost a call ~50 µs; a `timerfd_settime` costs 2.5–6 µs there (a VM exit
//! to reprogram the timer), which is why calls do not arm the timer while the thread is awake, in
//! place of ticking (that cut the thread's CPU 8–10× but put the syscall on every call's path). A
//! call starting in a doze sees its first tick up to [`DOZE`] late; a runaway call stops at most
//! [`TICK`] after its deadline once the thread ticks. Each advance also passes the spare thread its
//! wake-up (`spare.rs`), which the request path never does itself.
//!
//! This module owns the thread's loop and the timer; it does not touch stores or the engine
//! (the caller's `on_tick` does).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// The epoch's period while a call runs (and right after one started).
pub const TICK: Duration = Duration::from_micros(250);

/// The epoch's period in the gaps between calls (while one ran within [`LINGER`]).
const DOZE: Duration = Duration::from_millis(1);

/// How long the thread dozes after the last call before it sleeps on its timer.
const LINGER: Duration = Duration::from_millis(50);

/// `armed_at` when the timer is not armed.
const NOT_ARMED: u64 = u64::MAX;

/// Now on `CLOCK_MONOTONIC`, in ns: the timer's clock.
pub(crate) fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// `clock` now, in ns.
fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes only the `timespec` it is given; both clocks this module
    // reads (CLOCK_MONOTONIC, the calling thread's CPU clock) exist on every Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Whether a call whose deadline is `deadline_ns` ([`now_ns`]'s clock) has run past it.
#[cfg(test)]
pub(crate) fn past(deadline_ns: u64) -> bool {
    now_ns() >= deadline_ns
}

/// CPU time the calling thread has run, in ns (`CLOCK_THREAD_CPUTIME_ID`: a syscall, ~0.7 µs
/// on the VM, so read only on an epoch tick, never on every call).
pub(crate) fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// A call past its wall-clock deadline may run on to this many deadlines while its thread
/// waits for a core ([`Watch`]).
pub(crate) const DESCHEDULED_GRACE: u32 = 10;

/// CPU time over which a call's pace (fuel per ns of its thread's CPU) is measured before it
/// is trusted.
const PACE_WINDOW_NS: u64 = 50_000;

/// One call's deadline as its store's epoch callback checks it, on the call's own thread.
///
/// The deadline is wall-clock time, but a thread that waits for a core (a loaded host) runs out of
/// wall time without computing: on the 2-core VM a 5 µs decision once took 4.6 ms, and the fallback
/// that decided instead knew nothing of the conversation it broke (docs/bench-log/multi-turn.md,
/// "Reservations are not work"). So past the deadline a call stops when it has *computed* for a
/// deadline, estimated from its fuel: the fuel it burned since it started, at the pace it burns
/// fuel per ns of its thread's CPU time, measured from its first tick on (the thread's CPU clock is
/// a ~0.7 µs syscall here, so a call that ends before a tick never reads it). A runaway burns fuel
/// at its pace and stops at the deadline (plus a tick when its first tick came late); a call that
/// waited for a core burned little and runs on, up to [`DESCHEDULED_GRACE`] deadlines.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Watch {
    /// The deadline ([`now_ns`]'s clock).
    deadline_ns: u64,
    /// Past this the call stops whatever its thread did.
    cap_ns: u64,
    /// The deadline as CPU time.
    budget_ns: u64,
    /// Fuel left when the call started.
    fuel_at_start: u64,
    /// (thread CPU ns, fuel left) at the call's first tick.
    mark: Option<(u64, u64)>,
}

impl Watch {
    /// No call running: the callback lets everything run (nothing runs).
    pub(crate) const IDLE: Watch = Watch {
        deadline_ns: u64::MAX,
        cap_ns: u64::MAX,
        budget_ns: u64::MAX,
        fuel_at_start: 0,
        mark: None,
    };

    /// A call that started with `active`, a budget of `deadline` and `fuel` left.
    pub(crate) fn new(active: &Active<'_>, deadline: Duration, fuel: u64) -> Watch {
        let budget_ns = u64::try_from(deadline.as_nanos()).unwrap_or(u64::MAX);
        Watch {
            deadline_ns: active.deadline_ns,
            cap_ns: active
                .deadline_ns
                .saturating_add(budget_ns.saturating_mul(u64::from(DESCHEDULED_GRACE - 1))),
            budget_ns,
            fuel_at_start: fuel,
            mark: None,
        }
    }

    /// At an epoch tick seen by the call, on its thread, with `fuel` left: whether it must
    /// stop now.
    pub(crate) fn expired(&mut self, fuel: u64) -> bool {
        self.expired_at(now_ns(), thread_cpu_ns, fuel)
    }

    /// [`Watch::expired`] at wall time `now`, reading the thread's CPU time with `cpu`.
    fn expired_at(&mut self, now: u64, cpu: impl Fn() -> u64, fuel: u64) -> bool {
        let Some((cpu0, fuel0)) = self.mark else {
            // The call's first tick: its pace is measured from here.
            self.mark = Some((cpu(), fuel));
            return now >= self.cap_ns;
        };
        if now < self.deadline_ns {
            return false;
        }
        if now >= self.cap_ns {
            return true;
        }
        let (ran, burned) = (cpu().saturating_sub(cpu0), fuel0.saturating_sub(fuel));
        if ran < PACE_WINDOW_NS || burned == 0 {
            return false;
        }
        // CPU ns the whole call computed: its fuel at its pace (u128: no overflow).
        let used = u128::from(self.fuel_at_start.saturating_sub(fuel)) * u128::from(ran)
            / u128::from(burned);
        used >= u128::from(self.budget_ns)
    }
}

/// The thread's state as calls see it, and the timer that wakes it from its sleep.
#[derive(Debug)]
pub(crate) struct EpochClock {
    timer: OwnedFd,
    /// When the timer fires next ([`now_ns`]'s clock), or [`NOT_ARMED`].
    armed_at: AtomicU64,
    /// Calls in flight.
    active: AtomicUsize,
    /// Calls ever started: the thread sleeps only after [`LINGER`] without a new one.
    started: AtomicU64,
    /// The thread sleeps on its timer (or is about to): a starting call arms the timer.
    asleep: AtomicBool,
    /// Orders the changes of `armed_at` with the `timerfd_settime` calls that make them true.
    arm: Mutex<()>,
    stop: AtomicBool,
}

/// A call in flight ([`EpochClock::enter`]); its deadline is `deadline_ns`.
#[derive(Debug)]
pub(crate) struct Active<'a> {
    clock: &'a EpochClock,
    /// The call's deadline, on [`now_ns`]'s clock.
    pub(crate) deadline_ns: u64,
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.clock.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl EpochClock {
    /// A new clock; its thread runs [`EpochClock::run`].
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
            started: AtomicU64::new(0),
            asleep: AtomicBool::new(false),
            arm: Mutex::new(()),
            stop: AtomicBool::new(false),
        })
    }

    /// A call with wall-clock budget `deadline` starts now; it ends when the guard drops.
    pub(crate) fn enter(&self, deadline: Duration) -> Active<'_> {
        self.active.fetch_add(1, Ordering::SeqCst);
        self.started.fetch_add(1, Ordering::SeqCst);
        let budget = u64::try_from(deadline.as_nanos()).unwrap_or(u64::MAX);
        let deadline_ns = now_ns().saturating_add(budget);
        // SeqCst with the thread's `asleep` store and its last look at `started`: either this
        // call sees it asleep (and arms the timer), or the thread sees this call (and ticks).
        if self.asleep.load(Ordering::SeqCst) && self.armed_at.load(Ordering::SeqCst) > deadline_ns
        {
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
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            // All zero would disarm the timer: 0 fires at the first nanosecond instead.
            it_value: libc::timespec {
                tv_sec: (at / 1_000_000_000) as libc::time_t,
                tv_nsec: (at % 1_000_000_000).max(u64::from(at == 0)) as libc::c_long,
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

    /// Sleeps until the timer fires (a call armed it, or [`EpochClock::stop`] did); `false`
    /// when it cannot wait on it.
    fn wait_for_timer(&self) -> bool {
        let mut expirations = [0u8; 8];
        loop {
            // SAFETY: reads at most 8 bytes into an 8-byte buffer.
            let n = unsafe {
                libc::read(
                    self.timer.as_raw_fd(),
                    expirations.as_mut_ptr().cast(),
                    expirations.len(),
                )
            };
            if n >= 0 {
                let _guard = self.arm.lock().unwrap_or_else(|e| e.into_inner());
                self.armed_at.store(NOT_ARMED, Ordering::SeqCst);
                return true;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::error!(error = %e, "the policy epoch timer failed: the epoch now ticks through idle time");
                return false;
            }
        }
    }

    /// The `pd-policy-epoch` thread's loop: `on_tick` (advance the epoch, pass wake-ups on) at
    /// every tick, as the module docs say. Returns after [`EpochClock::stop`].
    pub(crate) fn run(&self, mut on_tick: impl FnMut()) {
        let mut seen = self.started.load(Ordering::SeqCst);
        let mut idle = Duration::ZERO;
        let mut period = TICK;
        let mut timer_works = true;
        while !self.stop.load(Ordering::SeqCst) {
            std::thread::sleep(period);
            on_tick();
            let started = self.started.load(Ordering::SeqCst);
            if started != seen || self.active.load(Ordering::SeqCst) != 0 {
                seen = started;
                idle = Duration::ZERO;
                period = TICK;
                continue;
            }
            idle += period;
            period = DOZE;
            if idle < LINGER || !timer_works {
                continue;
            }
            // Publish `asleep` before the last look at `started` (both SeqCst): a call either
            // sees it and arms the timer, or its `started` increment is seen here.
            self.asleep.store(true, Ordering::SeqCst);
            if self.started.load(Ordering::SeqCst) == seen
                && self.active.load(Ordering::SeqCst) == 0
            {
                timer_works = self.wait_for_timer();
                // A call's deadline (or the stop): check the calls now.
                on_tick();
            }
            self.asleep.store(false, Ordering::SeqCst);
            seen = self.started.load(Ordering::SeqCst);
            idle = Duration::ZERO;
            period = TICK;
        }
    }

    /// Ends [`EpochClock::run`] (a sleeping thread's timer fires at once).
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

    /// A watch of a 1 ms deadline at wall time 0 (the cap at 10 ms), with 10^9 fuel at the
    /// start.
    fn watch() -> Watch {
        Watch {
            deadline_ns: 1_000_000,
            cap_ns: 10_000_000,
            budget_ns: 1_000_000,
            fuel_at_start: 1_000_000_000,
            mark: None,
        }
    }

    /// Fuel left after burning `ns` of CPU at 1 fuel per ns.
    fn left(ns: u64) -> u64 {
        1_000_000_000 - ns
    }

    #[test]
    fn past_the_deadline_a_call_stops_once_it_computed_for_one() {
        let ms = 1_000_000;
        // A runaway: it computes all the time; first tick at 0.25 ms.
        let mut w = watch();
        assert!(!w.expired_at(ms / 4, || 5 * ms, left(ms / 4)));
        assert!(!w.expired_at(ms / 2, || 5 * ms + ms / 4, left(ms / 2)));
        assert!(w.expired_at(ms, || 5 * ms + 3 * ms / 4, left(ms)));
        // Off its core for 4 ms from its first tick: 0.35 ms computed, it runs on...
        let mut w = watch();
        assert!(!w.expired_at(ms / 4, || 5 * ms, left(ms / 4)));
        assert!(!w.expired_at(4 * ms, || 5 * ms + ms / 10, left(ms / 4 + ms / 10)));
        // ...until it computed for the deadline...
        assert!(!w.expired_at(5 * ms, || 5 * ms + ms / 2, left(3 * ms / 4)));
        assert!(w.expired_at(6 * ms, || 5 * ms + 3 * ms / 4, left(ms)));
        // ...and never past the cap.
        let mut w = watch();
        assert!(!w.expired_at(ms / 4, || 0, left(0)));
        assert!(w.expired_at(10 * ms, || 0, left(0)));
        // Off its core from the start until past the deadline, then 2 ms of work left: its
        // first tick marks, and it computes on at its pace until it has used its 1 ms.
        let mut w = watch();
        assert!(!w.expired_at(30 * ms / 10, || 7 * ms, left(ms / 10)));
        assert!(!w.expired_at(31 * ms / 10, || 7 * ms + ms / 10, left(2 * ms / 10)));
        assert!(!w.expired_at(38 * ms / 10, || 7 * ms + 8 * ms / 10, left(9 * ms / 10)));
        assert!(w.expired_at(39 * ms / 10, || 7 * ms + 9 * ms / 10, left(ms)));
        // A runaway whose first tick came at its deadline (the epoch thread slept): it stops
        // a tick later.
        let mut w = watch();
        assert!(!w.expired_at(ms, || 0, left(ms)));
        assert!(w.expired_at(ms + ms / 4, || ms / 4, left(ms + ms / 4)));
        // The idle watch never stops anything.
        let mut idle = Watch::IDLE;
        assert!(!idle.expired_at(u64::MAX - 1, || u64::MAX, 0));
        assert!(!idle.expired_at(u64::MAX - 1, || u64::MAX, 0));
    }

    fn started(clock: &Arc<EpochClock>) -> (Arc<AtomicU32>, std::thread::JoinHandle<()>) {
        let ticks = Arc::new(AtomicU32::new(0));
        let (c, t) = (clock.clone(), ticks.clone());
        let thread = std::thread::spawn(move || {
            c.run(|| {
                t.fetch_add(1, Ordering::SeqCst);
            })
        });
        (ticks, thread)
    }

    fn eventually(what: &str, f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(10), "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Idle, the thread sleeps on its timer; a call arms it for its deadline (no wake-up
    /// before), the thread wakes then, ticks while the call runs, and sleeps again after.
    #[test]
    fn sleeps_when_idle_and_wakes_at_a_call_s_deadline() {
        let clock = Arc::new(EpochClock::new().unwrap());
        let (ticks, thread) = started(&clock);
        eventually("asleep after the linger", || {
            clock.asleep.load(Ordering::SeqCst)
        });
        let asleep_at = ticks.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            ticks.load(Ordering::SeqCst),
            asleep_at,
            "no tick while asleep"
        );

        let call = clock.enter(Duration::from_millis(30));
        assert_eq!(
            clock.armed_at.load(Ordering::SeqCst),
            call.deadline_ns,
            "armed"
        );
        std::thread::sleep(Duration::from_millis(10));
        let ticked = ticks.load(Ordering::SeqCst);
        // (On a machine so loaded that this thread slept past the deadline, the wake-up is due.)
        if !past(call.deadline_ns) {
            assert_eq!(ticked, asleep_at, "no wake-up before the deadline");
        }
        eventually("woken at the deadline, ticking", || {
            ticks.load(Ordering::SeqCst) >= asleep_at + 3
        });
        assert!(past(call.deadline_ns), "woken at the deadline, not before");
        drop(call);
        eventually("asleep again", || clock.asleep.load(Ordering::SeqCst));
        clock.stop();
        thread.join().unwrap();
    }

    /// While the thread ticks or dozes, calls arm nothing; an earlier deadline re-arms a
    /// sleeping thread's timer, a later one does not.
    #[test]
    fn calls_arm_the_timer_only_while_the_thread_sleeps() {
        let clock = EpochClock::new().unwrap();
        let awake = clock.enter(Duration::from_millis(1));
        assert_eq!(clock.armed_at.load(Ordering::SeqCst), NOT_ARMED);
        drop(awake);
        clock.asleep.store(true, Ordering::SeqCst);
        let long = clock.enter(Duration::from_secs(60));
        assert_eq!(clock.armed_at.load(Ordering::SeqCst), long.deadline_ns);
        let short = clock.enter(Duration::from_millis(1));
        assert_eq!(clock.armed_at.load(Ordering::SeqCst), short.deadline_ns);
        let _later = clock.enter(Duration::from_secs(30));
        assert_eq!(clock.armed_at.load(Ordering::SeqCst), short.deadline_ns);
        assert_eq!(clock.active.load(Ordering::SeqCst), 3);
    }
}
