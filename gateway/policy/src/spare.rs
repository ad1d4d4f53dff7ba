//! Spare instances: the work of making and unmaking a decision's store, moved off the request
//! path onto the `pd-policy-spare` thread.
//!
//! A decision runs in a fresh store (see `engine/call.rs`). Instantiating the component into
//! that store and dropping the store afterwards (which resets its pooled memory) were about
//! 60% of a decision's host time, and all of an interpreted guest's runtime start-up
//! (docs/bench-log/policy-decisions.md, "Spare instances").
//! Neither depends on the request. So each loaded policy keeps a few stores (`PolicySpec::spares`)
//! instantiated and never called, and a call takes one when it is there (else it instantiates
//! inline, as before); the used store goes back here to be dropped. Every call still runs in a
//! store that has seen exactly one instantiation and no other call.
//!
//! The request path never wakes this thread: it queues its work under an uncontended lock and
//! raises a flag; the epoch thread (`epoch.rs`), awake anyway while calls come (every 250 µs
//! during a call, every 1 ms in the gaps, and at the deadline of a call that found it asleep),
//! passes the wake-up on ([`SpareWorker::pass_wake`]). A futex wake per call on the request
//! path cost more than the epoch thread's own work (docs/bench-log/gateway.md).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};

/// Used stores that may wait for the spare thread; beyond that a call drops its own.
const MAX_QUEUED_USED: usize = 4;

/// A policy that can top up its spares (called on the spare thread).
pub(crate) trait Refill: Send + Sync {
    /// Instantiates until the policy holds as many spares as its spec asks, or an
    /// instantiation fails (the next call asks again).
    fn refill(&self);
}

/// The queue between request threads and the spare thread. `S` is a used store (dropped on
/// the spare thread), `P` the policy type.
pub(crate) struct SpareWorker<P: Refill, S: Send> {
    work: Mutex<Work<P, S>>,
    wake: Condvar,
    /// Work was queued since the epoch thread last passed a wake-up on.
    wanted: AtomicBool,
    stop: AtomicBool,
}

struct Work<P, S> {
    refill: Vec<Weak<P>>,
    used: Vec<S>,
}

impl<P, S> Work<P, S> {
    fn is_empty(&self) -> bool {
        self.refill.is_empty() && self.used.is_empty()
    }
}

impl<P: Refill + 'static, S: Send + 'static> SpareWorker<P, S> {
    /// Starts the spare thread. It ends after [`SpareWorker::stop`].
    ///
    /// # Errors
    /// The thread cannot be spawned.
    pub(crate) fn start() -> std::io::Result<Arc<Self>> {
        let worker = Arc::new(SpareWorker {
            work: Mutex::new(Work {
                refill: Vec::new(),
                used: Vec::new(),
            }),
            wake: Condvar::new(),
            wanted: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let w = worker.clone();
        // Not joined: the last reference to the engine may drop on this very thread (it holds
        // a policy while refilling it); it ends on its own once `stop` is set.
        std::thread::Builder::new()
            .name("pd-policy-spare".to_string())
            .spawn(move || w.run())?;
        Ok(worker)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Work<P, S>> {
        // The queue holds no invariant a panic could break.
        self.work.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// On the request path, after a call: `used` is dropped and `policy`'s spares topped up
    /// on the spare thread, once the epoch thread passes the wake-up on. No wake-up here. When
    /// [`MAX_QUEUED_USED`] stores already wait (calls come faster than the epoch ticks),
    /// `used` is dropped here instead, so waiting stores never exhaust the pool.
    pub(crate) fn recycle(&self, used: S, policy: &Arc<P>) {
        let mut work = self.lock();
        let inline = if work.used.len() < MAX_QUEUED_USED {
            work.used.push(used);
            None
        } else {
            Some(used)
        };
        if !work
            .refill
            .iter()
            .any(|p| std::ptr::eq(p.as_ptr(), Arc::as_ptr(policy)))
        {
            work.refill.push(Arc::downgrade(policy));
        }
        drop(work);
        self.wanted.store(true, Ordering::Release);
        drop(inline);
    }

    /// Off the request path (a policy was loaded): top up `policy`'s spares now.
    pub(crate) fn refill_now(&self, policy: &Arc<P>) {
        self.lock().refill.push(Arc::downgrade(policy));
        self.wake.notify_one();
    }

    /// Called by the epoch thread at every tick: wakes the spare thread if work was queued.
    pub(crate) fn pass_wake(&self) {
        if self.wanted.load(Ordering::Acquire) && self.wanted.swap(false, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    /// Ends the spare thread (queued stores are dropped with the worker).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _guard = self.lock();
        self.wake.notify_one();
    }

    fn run(&self) {
        loop {
            let Work { refill, used } = {
                let guard = self.lock();
                let mut work = self
                    .wake
                    .wait_while(guard, |w| {
                        w.is_empty() && !self.stop.load(Ordering::Acquire)
                    })
                    .unwrap_or_else(|e| e.into_inner());
                if self.stop.load(Ordering::Acquire) {
                    return;
                }
                // Drained, not replaced: the queue keeps its capacity, so a call's push does
                // not allocate on the request path.
                Work {
                    refill: work.refill.drain(..).collect(),
                    used: work.used.drain(..).collect(),
                }
            };
            drop(used);
            for policy in refill {
                if let Some(p) = policy.upgrade() {
                    p.refill();
                }
            }
        }
    }
}
