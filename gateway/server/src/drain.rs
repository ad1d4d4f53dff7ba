//! Shutting down without cutting answers: what the gateway does between `SIGTERM` and its exit.
//!
//! pingora's own graceful shutdown stops accepting connections at the signal, waits its grace
//! period whatever is open, then drops every task still running. For an LLM gateway, whose
//! answers stream for seconds or minutes, that cuts the streams of a rolling restart. So the
//! gateway counts the requests it is serving ([`Drain::enter`], one guard per request), gives
//! pingora a grace period of `--drain-timeout`, and on `SIGTERM` ([`exit_when_drained`]):
//!
//! 1. marks itself draining (`/health` answers 503 to a request already on its way; pingora
//!    closes the listener and idle keep-alive connections, so a new probe is refused instead);
//! 2. while pingora has closed the listener, lets the open requests finish;
//! 3. runs the caller's last step (the decision log's writer empties its queue) and exits with
//!    status 0 as soon as none is open, or lets pingora end them at the deadline.
//!
//! A second signal exits at once. This module does not touch pingora's server or the nodes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tracing::{info, warn};

/// How often [`exit_when_drained`] looks at the open requests.
const POLL: Duration = Duration::from_millis(20);
/// How long no request must be open before a draining gateway exits.
const SETTLE: Duration = Duration::from_millis(100);

/// Whether the gateway is draining, and how many requests it is serving.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    open: AtomicUsize,
}

/// One request being served; dropping it (however the request ends) closes it.
#[derive(Debug)]
pub struct Open<'a>(&'a Drain);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drain {
    /// A request starts; it counts as open until the guard drops.
    pub fn enter(&self) -> Open<'_> {
        self.open.fetch_add(1, Ordering::AcqRel);
        Open(self)
    }

    /// Requests being served now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Marks the gateway as draining (idempotent).
    pub fn begin(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether [`Drain::begin`] was called.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}

/// Waits for `SIGTERM`, then drains (see the module docs), runs `before_exit` and exits the
/// process once no request is open; pingora itself ends what is left at `timeout`. A second
/// `SIGTERM` or a ctrl-c exits at once. Run it on a runtime other than pingora's (which stops
/// its own tasks).
pub async fn exit_when_drained(drain: &Drain, timeout: Duration, before_exit: impl FnOnce()) {
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        warn!("cannot listen for SIGTERM: a SIGTERM stops the gateway without draining");
        return;
    };
    term.recv().await;
    drain.begin();
    info!(
        open = drain.open(),
        timeout_s = timeout.as_secs_f64(),
        "SIGTERM: draining; no new connections, open requests finish (a second signal exits at once)"
    );
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        warn!("second signal: exiting without draining");
        std::process::exit(1);
    });
    // A connection pingora accepted just before the signal may not have reached the proxy yet:
    // none must be open for a moment in a row.
    let mut quiet_since = None;
    let mut before_exit = Some(before_exit);
    loop {
        if drain.open() > 0 {
            quiet_since = None;
        } else if quiet_since
            .get_or_insert_with(std::time::Instant::now)
            .elapsed()
            >= SETTLE
        {
            info!("drained: no request open; exiting");
            if let Some(f) = before_exit.take() {
                f();
            }
            std::process::exit(0);
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_open_while_its_guard_lives() {
        let d = Drain::default();
        assert!(!d.is_draining());
        let a = d.enter();
        let b = d.enter();
        assert_eq!(d.open(), 2);
        drop(a);
        assert_eq!(d.open(), 1);
        d.begin();
        assert!(d.is_draining());
        drop(b);
        assert_eq!(d.open(), 0);
    }
}
