//! Active messages between two workers in one process: a round trip, a rendezvous-size
//! message, and a panicking handler.

use std::sync::{Arc, Mutex};

use crate::common::{pattern, progress_until, wait_both};
use pd_ucx::{Context, Error, Worker};

type Inbox = Arc<Mutex<Vec<(Vec<u8>, Vec<u8>)>>>;

fn inbox_handler(inbox: &Inbox) -> impl FnMut(&[u8], &[u8]) + Send + 'static {
    let inbox = Arc::clone(inbox);
    move |h: &[u8], d: &[u8]| inbox.lock().unwrap().push((h.to_vec(), d.to_vec()))
}

#[test]
fn round_trip() {
    let ctx = Context::new().unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    let at_a: Inbox = Arc::default();
    let at_b: Inbox = Arc::default();
    a.set_am_handler(1, inbox_handler(&at_a)).unwrap();
    b.set_am_handler(2, inbox_handler(&at_b)).unwrap();
    assert!(matches!(
        a.set_am_handler(1, |_, _| {}),
        Err(Error::AmHandlerExists(1))
    ));

    let b_to_a = b.connect(&a.address().unwrap()).unwrap();
    let a_to_b = a.connect(&b.address().unwrap()).unwrap();

    wait_both(
        b_to_a.am_send_nbx(1, b"ping-hdr", b"ping-data").unwrap(),
        &a,
    )
    .unwrap();
    progress_until(&a, &b, || !at_a.lock().unwrap().is_empty());
    let (h, d) = at_a.lock().unwrap().remove(0);
    assert_eq!((&h[..], &d[..]), (&b"ping-hdr"[..], &b"ping-data"[..]));

    // Reply with the request echoed in the data; an empty header is allowed.
    wait_both(a_to_b.am_send_nbx(2, b"", &d).unwrap(), &b).unwrap();
    progress_until(&a, &b, || !at_b.lock().unwrap().is_empty());
    let (h, d) = at_b.lock().unwrap().remove(0);
    assert!(h.is_empty());
    assert_eq!(&d[..], b"ping-data");

    wait_both(b_to_a.close().unwrap(), &a).unwrap();
    wait_both(a_to_b.close().unwrap(), &b).unwrap();
}

/// 1 MiB is far above the eager threshold (~8 KiB on shm), so UCX uses rendezvous and the
/// data arrives through `ucp_am_recv_data_nbx`.
#[test]
fn large_message_uses_rendezvous() {
    let ctx = Context::new().unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    let at_a: Inbox = Arc::default();
    a.set_am_handler(7, inbox_handler(&at_a)).unwrap();
    let ep = b.connect(&a.address().unwrap()).unwrap();
    let big = pattern(1 << 20, 42);
    let req = ep.am_send_nbx(7, b"big", &big).unwrap();
    progress_until(&a, &b, || at_a.lock().unwrap().len() == 1);
    wait_both(req, &a).unwrap();
    let (h, d) = at_a.lock().unwrap().remove(0);
    assert_eq!(&h[..], b"big");
    assert_eq!(d, big);
    wait_both(ep.close().unwrap(), &a).unwrap();
}

/// A panic inside a handler does not unwind through UCX; `progress` re-raises it.
#[test]
fn handler_panic_is_reraised_by_progress() {
    let ctx = Context::new().unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    a.set_am_handler(3, |_, _| panic!("handler boom")).unwrap();
    let ep = b.connect(&a.address().unwrap()).unwrap();
    let mut req = ep.am_send_nbx(3, b"x", b"y").unwrap();
    // Progress until the handler ran (its panic ends the loop), bounded by a deadline rather
    // than an iteration count, so a loaded machine does not make the test flaky.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        while std::time::Instant::now() < deadline {
            a.progress();
            b.progress();
        }
    }));
    let payload = caught.expect_err("the handler's panic should surface from progress");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"handler boom"));
    while req.poll().is_none() {
        b.progress();
    }
    drop(req);
    wait_both(ep.close().unwrap(), &a).unwrap();
}
