//! [`Worker`]: a `ucp_worker_h` in single-thread mode, plus its active-message handlers.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::panic::{self, AssertUnwindSafe};

use ucx_sys as sys;

use crate::context::{Context, ContextInner};
use crate::endpoint::{Endpoint, EndpointOptions};
use crate::error::{Error, Result, check};
use crate::request::Request;
use std::sync::Arc;

/// An active-message handler: called with the message's header and data bytes.
type AmHandler = Box<dyn FnMut(&[u8], &[u8]) + Send>;

/// Per-id handler state; boxed so UCX can hold a stable pointer to it as the callback `arg`.
struct AmSlot {
    id: u16,
    handler: RefCell<AmHandler>,
    /// Back-pointer to the worker's shared state, for rendezvous messages and panics.
    shared: *const Shared,
}

/// A rendezvous active message whose data is still to be fetched (`ucp_am_recv_data_nbx`).
struct PendingRndv {
    slot: *const AmSlot,
    header: Vec<u8>,
    data: Vec<u8>,
    /// The UCX data descriptor; null once the receive was started.
    desc: *mut c_void,
    /// Final status of the receive, set by the completion callback.
    done: Cell<Option<sys::ucs_status_t>>,
}

/// State the UCX callbacks reach through raw pointers; boxed so its address is stable.
struct Shared {
    /// Rendezvous messages announced during progress, to receive once progress returns.
    // Boxed: UCX holds each entry's address as callback `user_data` while the Vec may grow.
    #[allow(clippy::vec_box)]
    rndv: RefCell<Vec<Box<PendingRndv>>>,
    /// A panic caught inside a handler, re-raised by the next [`Worker::progress`].
    panic: RefCell<Option<Box<dyn Any + Send>>>,
}

/// A UCP worker (`ucp_worker_h`) created in single-thread mode (`UCS_THREAD_MODE_SINGLE`).
///
/// All communication happens through a worker: endpoints, remote keys and requests borrow it,
/// and UCX completes their operations only inside [`Worker::progress`].
///
/// **Threading.** A single-thread-mode worker takes no locks, so two threads must never use it
/// at once: `Worker` is `Send` (create it anywhere, move it to the thread that will drive it)
/// but not `Sync`, and everything that uses it ([`Endpoint`], [`RemoteKey`](crate::RemoteKey),
/// [`Request`]) borrows it, which pins them to that thread and guarantees they are closed or
/// destroyed before the worker is. Keep UCX progress off async reactors: drive the worker from a
/// dedicated thread.
pub struct Worker {
    pub(crate) handle: sys::ucp_worker_h,
    ctx: Arc<ContextInner>,
    shared: Box<Shared>,
    // Boxed: UCX holds each slot's address as the handler `arg` while the Vec may grow.
    #[allow(clippy::vec_box)]
    slots: RefCell<Vec<Box<AmSlot>>>,
    next_ep_serial: Cell<u64>,
    /// `!Sync`: see the type docs.
    _not_sync: PhantomData<Cell<()>>,
}

// SAFETY: a single-thread-mode UCX worker may be used from any one thread at a time; moving it
// between threads is fine. `Worker` is `!Sync` and everything that touches the handle borrows
// the `Worker`, so no other thread can reach it after a move. Handlers are required to be `Send`.
unsafe impl Send for Worker {}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("handle", &self.handle)
            .field("am_handlers", &self.slots.borrow().len())
            .finish()
    }
}

impl Worker {
    /// Creates a single-thread-mode worker on `ctx`.
    ///
    /// # Errors
    /// [`Error::Ucs`] when `ucp_worker_create` fails.
    pub fn new(ctx: &Context) -> Result<Self> {
        /// `UCS_ERR_NO_DEVICE`.
        const NO_DEVICE: i8 = -14;
        /// Attempts after the first when interfaces vanish under UCX's feet.
        const WORKER_CREATE_TRIES: u64 = 5;
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut handle: sys::ucp_worker_h = std::ptr::null_mut();
        // UCX lists the network interfaces when it makes a worker; one that disappears meanwhile
        // (a container's veth on a busy machine) fails the whole call with "No such device".
        // That is a race, not a missing device: try again a few times.
        let mut tries = 0;
        loop {
            // SAFETY: the context handle is live (we keep its Arc), params are initialised with
            // a matching field mask and `handle` is a valid out-pointer.
            let created = check("ucp_worker_create", unsafe {
                sys::ucp_worker_create(ctx.inner.handle, &params, &mut handle)
            });
            match created {
                Err(e) if e.status() == Some(NO_DEVICE) && tries < WORKER_CREATE_TRIES => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(20 * tries));
                }
                other => break other?,
            }
        }
        Ok(Worker {
            handle,
            ctx: Arc::clone(&ctx.inner),
            shared: Box::new(Shared {
                rndv: RefCell::new(Vec::new()),
                panic: RefCell::new(None),
            }),
            slots: RefCell::new(Vec::new()),
            next_ep_serial: Cell::new(1),
            _not_sync: PhantomData,
        })
    }

    /// The context this worker was created on (kept alive by the worker).
    pub fn context(&self) -> Context {
        Context {
            inner: Arc::clone(&self.ctx),
        }
    }

    /// Runs one round of UCX progress (`ucp_worker_progress`) and returns how many events it
    /// processed. Active-message handlers run inside this call.
    ///
    /// # Panics
    /// Re-raises a panic that an active-message handler raised during this or an earlier call.
    pub fn progress(&self) -> u32 {
        let n = self.progress_no_unwind();
        if let Some(payload) = self.shared.panic.borrow_mut().take() {
            panic::resume_unwind(payload);
        }
        n
    }

    /// Blocks until the worker has something to progress (`ucp_worker_wait`: arms the worker's
    /// event fd and sleeps on it), instead of polling. Call [`Worker::progress`] until it returns
    /// 0 first; events that arrived meanwhile make this return at once.
    ///
    /// # Errors
    /// [`Error::Ucs`] — e.g. `UNSUPPORTED` when the context was created without
    /// [`crate::Features::wakeup`].
    pub fn wait_for_events(&self) -> Result<()> {
        // SAFETY: the handle is live; `&self` on a `!Sync` worker means we are its only user.
        check("ucp_worker_wait", unsafe {
            sys::ucp_worker_wait(self.handle)
        })
    }

    /// `progress` without re-raising handler panics (used from `Drop` impls).
    pub(crate) fn progress_no_unwind(&self) -> u32 {
        // SAFETY: the handle is live; `&self` on a `!Sync` worker means we are its only user.
        let n = unsafe { sys::ucp_worker_progress(self.handle) };
        self.drive_rndv();
        n
    }

    /// The worker's address (`ucp_worker_get_address`): opaque bytes a peer passes to
    /// [`Worker::connect`].
    ///
    /// # Errors
    /// [`Error::Ucs`] when UCX cannot produce the address.
    pub fn address(&self) -> Result<Vec<u8>> {
        let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live handle, valid out-pointers.
        check("ucp_worker_get_address", unsafe {
            sys::ucp_worker_get_address(self.handle, &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `addr`.
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: `addr` came from ucp_worker_get_address on this worker and is released once.
        unsafe { sys::ucp_worker_release_address(self.handle, addr) };
        Ok(bytes)
    }

    /// Connects to a remote worker given its [`Worker::address`] bytes, with
    /// [`EndpointOptions::default`].
    ///
    /// # Errors
    /// [`Error::Ucs`] when `ucp_ep_create` fails (e.g. malformed address, no common transport).
    pub fn connect(&self, remote_address: &[u8]) -> Result<Endpoint<'_>> {
        self.connect_with(remote_address, EndpointOptions::default())
    }

    /// Connects to a remote worker with explicit options.
    ///
    /// # Errors
    /// As [`Worker::connect`].
    pub fn connect_with(
        &self,
        remote_address: &[u8],
        opts: EndpointOptions,
    ) -> Result<Endpoint<'_>> {
        let serial = self.next_ep_serial.get();
        self.next_ep_serial.set(serial + 1);
        Endpoint::create(self, serial, remote_address, opts)
    }

    /// Flushes every endpoint of this worker (`ucp_worker_flush_nbx`): the request completes once
    /// all operations posted before it have completed remotely.
    ///
    /// # Errors
    /// [`Error::Ucs`] when the flush cannot be started.
    pub fn flush(&self) -> Result<Request<'_>> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live handle; an all-zero param (empty op_attr_mask) is valid.
        let ptr = unsafe { sys::ucp_worker_flush_nbx(self.handle, &param) };
        Request::from_status_ptr("ucp_worker_flush_nbx", self, ptr, None)
    }

    /// Registers `handler` for active messages with `id` (`ucp_worker_set_am_recv_handler`).
    ///
    /// The handler runs inside [`Worker::progress`] with the message header and data; it must
    /// not block, and it cannot call back into this worker (it is `'static + Send`; hand work
    /// to the progress loop through a channel). Small messages are delivered straight from
    /// UCX's buffers; large (rendezvous) ones are received into a buffer first and delivered by
    /// a later `progress` call. A panic in the handler is caught and re-raised by `progress`.
    ///
    /// # Errors
    /// [`Error::AmHandlerExists`] if `id` already has a handler; [`Error::Ucs`] if UCX refuses
    /// (e.g. the context lacks the AM feature).
    pub fn set_am_handler<F>(&self, id: u16, handler: F) -> Result<()>
    where
        F: FnMut(&[u8], &[u8]) + Send + 'static,
    {
        if self.slots.borrow().iter().any(|s| s.id == id) {
            return Err(Error::AmHandlerExists(id));
        }
        let slot = Box::new(AmSlot {
            id,
            handler: RefCell::new(Box::new(handler)),
            shared: &*self.shared,
        });
        let param = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            ),
            id: u32::from(id),
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(am_recv_trampoline),
            arg: (&*slot as *const AmSlot).cast_mut().cast(),
        };
        // SAFETY: live handle; `arg` points into a Box we keep in `self.slots` until the worker
        // is destroyed, so it outlives every callback.
        check("ucp_worker_set_am_recv_handler", unsafe {
            sys::ucp_worker_set_am_recv_handler(self.handle, &param)
        })?;
        self.slots.borrow_mut().push(slot);
        Ok(())
    }

    /// `ucp_worker_print_info` captured as text.
    ///
    /// # Errors
    /// [`Error::Capture`] when the memstream cannot be opened.
    pub fn print_info(&self) -> Result<String> {
        crate::transport::capture(|file| {
            // SAFETY: live handle, open FILE*.
            unsafe { sys::ucp_worker_print_info(self.handle, file) }
        })
    }

    /// Starts receives for rendezvous messages announced during progress, and delivers the
    /// ones whose data has arrived.
    fn drive_rndv(&self) {
        if self.shared.rndv.borrow().is_empty() {
            return;
        }
        let mut pending = std::mem::take(&mut *self.shared.rndv.borrow_mut());
        for p in pending.iter_mut() {
            if p.desc.is_null() {
                continue;
            }
            let desc = std::mem::replace(&mut p.desc, std::ptr::null_mut());
            let param = sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
                cb: sys::ucp_request_param_t__bindgen_ty_1 {
                    recv_am: Some(am_rndv_done),
                },
                user_data: (&**p as *const PendingRndv).cast_mut().cast(),
                ..Default::default()
            };
            // SAFETY: `desc` is the rendezvous descriptor UCX gave the AM callback (which
            // returned UCS_INPROGRESS to keep it); `p.data` has the announced length and lives in
            // a Box that stays in `shared.rndv` until `done` is set; the callback only touches it.
            let ptr = unsafe {
                sys::ucp_am_recv_data_nbx(
                    self.handle,
                    desc,
                    p.data.as_mut_ptr().cast(),
                    p.data.len(),
                    &param,
                )
            };
            if ptr.is_null() {
                p.done.set(Some(sys::UCS_OK));
            } else if sys::UCS_PTR_IS_ERR(ptr) {
                p.done.set(Some(sys::UCS_PTR_RAW_STATUS(ptr)));
            }
        }
        pending.retain(|p| {
            let Some(status) = p.done.get() else {
                return true;
            };
            // SAFETY: `slot` points into a Box held in `self.slots` for the worker's life.
            let slot = unsafe { &*p.slot };
            if status == sys::UCS_OK {
                call_handler(slot, &p.header, &p.data);
            } else {
                tracing::warn!(
                    am_id = slot.id,
                    status = crate::error::status_name(status),
                    "rendezvous active message receive failed"
                );
            }
            false
        });
        self.shared.rndv.borrow_mut().extend(pending);
    }
}

/// Calls a handler, catching a panic so it cannot unwind through UCX's C frames.
fn call_handler(slot: &AmSlot, header: &[u8], data: &[u8]) {
    let Ok(mut handler) = slot.handler.try_borrow_mut() else {
        tracing::error!(
            am_id = slot.id,
            "active message handler re-entered; message dropped"
        );
        return;
    };
    let result = panic::catch_unwind(AssertUnwindSafe(|| (handler)(header, data)));
    if let Err(payload) = result {
        // SAFETY: `shared` points to the worker's boxed state, alive while handlers can run.
        let shared = unsafe { &*slot.shared };
        shared.panic.borrow_mut().get_or_insert(payload);
    }
}

/// `ucp_am_recv_callback_t` for every registered id; `arg` is the `AmSlot`.
unsafe extern "C" fn am_recv_trampoline(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the AmSlot registered in `set_am_handler`, alive for the worker's life.
    let slot = unsafe { &*arg.cast::<AmSlot>() };
    let header: &[u8] = if header_length == 0 || header.is_null() {
        &[]
    } else {
        // SAFETY: UCX passes `header_length` readable bytes, valid during the callback.
        unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }
    };
    // SAFETY: UCX passes a valid param pointer for the duration of the callback.
    let recv_attr = unsafe { (*param).recv_attr };
    if recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 {
        // Data is still at the sender: keep the descriptor and receive it after progress returns
        // (ucp_am_recv_data_nbx from outside the callback, as UCX's examples do).
        // SAFETY: `shared` is the worker's boxed state.
        let shared = unsafe { &*slot.shared };
        shared.rndv.borrow_mut().push(Box::new(PendingRndv {
            slot,
            header: header.to_vec(),
            data: vec![0u8; length],
            desc: data,
            done: Cell::new(None),
        }));
        return sys::UCS_INPROGRESS;
    }
    let data: &[u8] = if length == 0 || data.is_null() {
        &[]
    } else {
        // SAFETY: eager data: `length` readable bytes at `data`, valid during the callback.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }
    };
    call_handler(slot, header, data);
    sys::UCS_OK
}

/// `ucp_am_recv_data_nbx_callback_t`: marks a rendezvous receive done and frees its request.
unsafe extern "C" fn am_rndv_done(
    request: *mut c_void,
    status: sys::ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the boxed PendingRndv, alive until `done` is observed.
    let pending = unsafe { &*user_data.cast::<PendingRndv>() };
    pending.done.set(Some(status));
    // SAFETY: the request completed (we are in its callback) and nobody else frees it.
    unsafe { sys::ucp_request_free(request) };
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Release rendezvous descriptors whose receive never started.
        for p in self.shared.rndv.borrow_mut().iter_mut() {
            if !p.desc.is_null() {
                // SAFETY: an unconsumed descriptor from the AM callback, released once.
                unsafe { sys::ucp_am_data_release(self.handle, p.desc) };
                p.desc = std::ptr::null_mut();
            }
        }
        // SAFETY: endpoints, remote keys and requests borrow the worker, so none is alive now.
        // Slots and pending receives are dropped after this, so no callback sees freed state.
        // `self.ctx` (the context) is dropped after this body, so it outlives the worker.
        unsafe { sys::ucp_worker_destroy(self.handle) };
    }
}
