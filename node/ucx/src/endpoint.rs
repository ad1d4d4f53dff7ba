//! [`Endpoint`]: a connection from a [`Worker`] to a remote worker, with RMA and AM sends.

use std::cell::Cell;
use std::ffi::c_void;
use std::fmt;
use std::time::{Duration, Instant};

use ucx_sys as sys;

use crate::error::{Error, Result, check, status_name};
use crate::memory::{MemoryRegion, RemoteKey};
use crate::request::Request;
use crate::transport::TransportReport;
use crate::worker::Worker;

/// Options for [`Worker::connect_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointOptions {
    /// Ask UCX for peer-failure handling (`UCP_ERR_HANDLING_MODE_PEER`): a dead peer fails
    /// outstanding operations with an error instead of hanging them, and marks the endpoint
    /// failed ([`Error::EndpointFailed`]). UCX may pick different transports in this mode (it
    /// needs ones that can detect failures). Default: off.
    pub peer_error_handling: bool,
    /// How long dropping the endpoint progresses the worker waiting for its flush-close
    /// (which needs the peer to progress too) before releasing the close request unfinished.
    /// Default: 5 s.
    pub close_timeout: Duration,
}

impl Default for EndpointOptions {
    fn default() -> Self {
        EndpointOptions {
            peer_error_handling: false,
            close_timeout: Duration::from_secs(5),
        }
    }
}

/// Error-handler state; boxed so UCX can hold a stable pointer to it.
struct EpState {
    failed: Cell<Option<sys::ucs_status_t>>,
    close_timeout: Duration,
}

/// One local→remote connection (`ucp_ep_h`), created from the remote worker's address bytes.
///
/// Borrows its [`Worker`] (so it stays on the worker's thread and is closed before the worker
/// is destroyed). Dropping it closes it in flush mode (`ucp_ep_close_nbx`), progressing the
/// worker until the close completes (at most [`EndpointOptions::close_timeout`]).
///
/// Operations come in three shapes:
/// - `*_nbx` return a [`Request`] to poll or wait on;
/// - `post_*` fire and forget: the request handle is released at once, and a later
///   [`Endpoint::flush`] completes after them. This is how to pull ~1000 KV blocks with one
///   completion: `post_get` each block, then `flush().wait()`;
/// - blocking helpers (`get`, `put`) for tests and small transfers.
pub struct Endpoint<'w> {
    handle: sys::ucp_ep_h,
    worker: &'w Worker,
    serial: u64,
    state: Box<EpState>,
}

impl fmt::Debug for Endpoint<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("serial", &self.serial)
            .field("handle", &self.handle)
            .field("failed", &self.state.failed.get().map(status_name))
            .finish()
    }
}

unsafe extern "C" fn ep_error_handler(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    // SAFETY: `arg` is the endpoint's boxed EpState, alive until the endpoint is closed.
    let state = unsafe { &*arg.cast::<EpState>() };
    state.failed.set(Some(status));
}

impl<'w> Endpoint<'w> {
    pub(crate) fn create(
        worker: &'w Worker,
        serial: u64,
        remote_address: &[u8],
        opts: EndpointOptions,
    ) -> Result<Self> {
        let state = Box::new(EpState {
            failed: Cell::new(None),
            close_timeout: opts.close_timeout,
        });
        let mut params = sys::ucp_ep_params_t {
            field_mask: u64::from(sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS),
            address: remote_address.as_ptr().cast(),
            ..Default::default()
        };
        if opts.peer_error_handling {
            params.field_mask |= u64::from(
                sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            );
            params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler = sys::ucp_err_handler_t {
                cb: Some(ep_error_handler),
                arg: (&*state as *const EpState).cast_mut().cast(),
            };
        }
        let mut handle: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: live worker; `params.address` points to the caller's address bytes for the
        // duration of the call (UCX unpacks it during ucp_ep_create); the error-handler arg is
        // a Box kept in the Endpoint until it is closed.
        check("ucp_ep_create", unsafe {
            sys::ucp_ep_create(worker.handle, &params, &mut handle)
        })?;
        Ok(Endpoint {
            handle,
            worker,
            serial,
            state,
        })
    }

    /// A number unique among this worker's endpoints.
    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// The worker this endpoint belongs to.
    pub fn worker(&self) -> &'w Worker {
        self.worker
    }

    /// `Err` if UCX's error handler reported this endpoint failed (peer error handling only).
    ///
    /// # Errors
    /// [`Error::EndpointFailed`] with the status the handler received.
    pub fn check_alive(&self) -> Result<()> {
        match self.state.failed.get() {
            None => Ok(()),
            Some(code) => Err(Error::EndpointFailed {
                ep: self.serial,
                code,
                name: status_name(code),
            }),
        }
    }

    fn check_rkey(&self, rkey: &RemoteKey<'_>) -> Result<()> {
        self.check_alive()?;
        if rkey.ep_serial == self.serial {
            Ok(())
        } else {
            Err(Error::RkeyEndpointMismatch {
                rkey_ep: rkey.ep_serial,
                ep: self.serial,
            })
        }
    }

    /// Unpacks a peer's packed remote key ([`MemoryRegion::rkey_pack`] bytes) for this endpoint.
    ///
    /// `ucp_ep_rkey_unpack` takes no length and trusts the bytes, so this first walks the
    /// packed memory-domain table (UCX 1.13 layout: `u64` md map, `u8` memory type, then one
    /// `u8`-length-prefixed key per md) and rejects bytes that would make UCX read past the end.
    /// That check is about memory safety only; take keys from authenticated peers.
    ///
    /// # Errors
    /// [`Error::MalformedRkey`] for truncated bytes; [`Error::Ucs`] when UCX rejects them.
    pub fn unpack_rkey(&self, packed: &[u8]) -> Result<RemoteKey<'w>> {
        check_packed_rkey(packed)?;
        let mut rkey: sys::ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: live endpoint; `packed` is readable for the call; valid out-pointer.
        check("ucp_ep_rkey_unpack", unsafe {
            sys::ucp_ep_rkey_unpack(self.handle, packed.as_ptr().cast(), &mut rkey)
        })?;
        Ok(RemoteKey::new(rkey, self.serial))
    }

    fn region_param(region: &MemoryRegion) -> sys::ucp_request_param_t {
        sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_MEMH,
            memh: region.memh,
            ..Default::default()
        }
    }

    /// Non-blocking get of `len` bytes from `remote_addr` (in the peer region behind `rkey`)
    /// into `len` bytes at `dst_offset` of the local `dst` region (`ucp_get_nbx`).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::RkeyEndpointMismatch`], [`Error::EndpointFailed`], or
    /// [`Error::Ucs`] when UCX fails to post.
    pub fn get_nbx<'a>(
        &'a self,
        dst: &'a MemoryRegion,
        dst_offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey<'_>,
    ) -> Result<Request<'a>> {
        self.check_rkey(rkey)?;
        let ptr = dst.range(dst_offset, len)?;
        let param = Self::region_param(dst);
        // SAFETY: live endpoint and rkey (checked to belong to it); `ptr..ptr+len` lies inside a
        // mapped region whose owner promised (MemoryRegion::map) to keep it valid until every
        // operation on it completes; the returned Request borrows the region.
        let status = unsafe {
            sys::ucp_get_nbx(
                self.handle,
                ptr.cast(),
                len,
                remote_addr,
                rkey.handle,
                &param,
            )
        };
        Request::from_status_ptr("ucp_get_nbx", self.worker, status, None)
    }

    /// Posts a get like [`Endpoint::get_nbx`] but releases the request handle at once: the get
    /// still runs, and a later [`Endpoint::flush`] (or [`Worker::flush`]) completes only after
    /// it. Errors of an individual get surface as the flush's error or a failed endpoint.
    ///
    /// # Errors
    /// As [`Endpoint::get_nbx`] (posting errors only).
    pub fn post_get(
        &self,
        dst: &MemoryRegion,
        dst_offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey<'_>,
    ) -> Result<()> {
        self.check_rkey(rkey)?;
        let ptr = dst.range(dst_offset, len)?;
        let param = Self::region_param(dst);
        // SAFETY: as in `get_nbx`; completion is awaited by the caller's flush, and the region's
        // owner keeps the memory valid until then (MemoryRegion::map contract).
        let status = unsafe {
            sys::ucp_get_nbx(
                self.handle,
                ptr.cast(),
                len,
                remote_addr,
                rkey.handle,
                &param,
            )
        };
        release_posted("ucp_get_nbx", status)
    }

    /// Non-blocking get into raw memory (`ucp_get_nbx`).
    ///
    /// # Safety
    /// `dst..dst+len` must be valid for writes, and not read or written by anyone else, until
    /// the returned request completes (dropping the request waits for completion, but leaking
    /// it does not).
    ///
    /// # Errors
    /// As [`Endpoint::get_nbx`].
    pub unsafe fn get_nbx_raw(
        &self,
        dst: *mut u8,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey<'_>,
    ) -> Result<Request<'w>> {
        self.check_rkey(rkey)?;
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live endpoint and rkey; the caller guarantees `dst`.
        let status = unsafe {
            sys::ucp_get_nbx(
                self.handle,
                dst.cast(),
                len,
                remote_addr,
                rkey.handle,
                &param,
            )
        };
        Request::from_status_ptr("ucp_get_nbx", self.worker, status, None)
    }

    /// Blocking get into a local slice: posts the get and progresses this endpoint's worker
    /// until it completes.
    ///
    /// On UCX 1.13 a get from peer memory that was *registered* ([`MemoryRegion::map`]) is
    /// emulated with active messages and completes only while the peer's worker progresses
    /// too (another thread or process); memory the peer got from [`MemoryRegion::allocate`] is
    /// read one-sidedly over shared memory on the same host.
    ///
    /// # Errors
    /// As [`Endpoint::get_nbx`], plus the get's own failure.
    pub fn get(&self, dst: &mut [u8], remote_addr: u64, rkey: &RemoteKey<'_>) -> Result<()> {
        // SAFETY: `dst` is exclusively borrowed for this whole call and the request is waited
        // on (not leaked) before we return.
        let req = unsafe { self.get_nbx_raw(dst.as_mut_ptr(), dst.len(), remote_addr, rkey)? };
        req.wait()
    }

    /// Non-blocking put of `len` bytes at `src_offset` of the local `src` region to
    /// `remote_addr` (`ucp_put_nbx`). Zero-copy.
    ///
    /// # Errors
    /// As [`Endpoint::get_nbx`].
    pub fn put_nbx_region<'a>(
        &'a self,
        src: &'a MemoryRegion,
        src_offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey<'_>,
    ) -> Result<Request<'a>> {
        self.check_rkey(rkey)?;
        let ptr = src.range(src_offset, len)?;
        let param = Self::region_param(src);
        // SAFETY: live endpoint and rkey; the source range lies inside a mapped region kept
        // valid by its owner until the operation completes; the Request borrows the region.
        let status = unsafe {
            sys::ucp_put_nbx(
                self.handle,
                ptr.cast_const().cast(),
                len,
                remote_addr,
                rkey.handle,
                &param,
            )
        };
        Request::from_status_ptr("ucp_put_nbx", self.worker, status, None)
    }

    /// Non-blocking put of a copy of `src` to `remote_addr` (`ucp_put_nbx`). The request owns
    /// the copy, so `src` may be reused at once.
    ///
    /// # Errors
    /// As [`Endpoint::get_nbx`].
    pub fn put_nbx(
        &self,
        src: &[u8],
        remote_addr: u64,
        rkey: &RemoteKey<'_>,
    ) -> Result<Request<'w>> {
        self.check_rkey(rkey)?;
        let copy: Box<[u8]> = src.into();
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live endpoint and rkey; `copy` is heap memory owned by the returned Request
        // (moving the Box does not move its contents), so it outlives the operation, and a
        // leaked Request leaks it too.
        let status = unsafe {
            sys::ucp_put_nbx(
                self.handle,
                copy.as_ptr().cast(),
                copy.len(),
                remote_addr,
                rkey.handle,
                &param,
            )
        };
        Request::from_status_ptr("ucp_put_nbx", self.worker, status, Some(Box::new(copy)))
    }

    /// Blocking put of `src` to `remote_addr`.
    ///
    /// # Errors
    /// As [`Endpoint::put_nbx`], plus the put's own failure.
    pub fn put(&self, src: &[u8], remote_addr: u64, rkey: &RemoteKey<'_>) -> Result<()> {
        self.put_nbx(src, remote_addr, rkey)?.wait()
    }

    /// Flushes this endpoint (`ucp_ep_flush_nbx`): the request completes once every operation
    /// posted on it before the flush has completed at the remote side.
    ///
    /// # Errors
    /// [`Error::EndpointFailed`], or [`Error::Ucs`] when the flush cannot be started.
    pub fn flush(&self) -> Result<Request<'w>> {
        self.check_alive()?;
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live endpoint; zeroed param is valid.
        let status = unsafe { sys::ucp_ep_flush_nbx(self.handle, &param) };
        Request::from_status_ptr("ucp_ep_flush_nbx", self.worker, status, None)
    }

    /// Sends an active message (`ucp_am_send_nbx`) with `id`, `header` and `data`, delivered to
    /// the handler the peer registered with [`Worker::set_am_handler`]. Header and data are
    /// copied into the request, so the slices may be reused at once.
    ///
    /// # Errors
    /// [`Error::EndpointFailed`], or [`Error::Ucs`] when UCX fails to post.
    pub fn am_send_nbx(&self, id: u16, header: &[u8], data: &[u8]) -> Result<Request<'w>> {
        self.check_alive()?;
        let mut buf = Vec::with_capacity(header.len() + data.len());
        buf.extend_from_slice(header);
        buf.extend_from_slice(data);
        let buf: Box<[u8]> = buf.into();
        let (hdr, body) = buf.split_at(header.len());
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live endpoint; header and body point into `buf`, heap memory owned by the
        // returned Request until the send completes (and leaked with it if it is leaked).
        let status = unsafe {
            sys::ucp_am_send_nbx(
                self.handle,
                u32::from(id),
                hdr.as_ptr().cast(),
                hdr.len(),
                body.as_ptr().cast(),
                body.len(),
                &param,
            )
        };
        Request::from_status_ptr("ucp_am_send_nbx", self.worker, status, Some(Box::new(buf)))
    }

    /// Which transports and devices this endpoint's lanes use, parsed from
    /// `ucp_ep_print_info`. Lanes are chosen during wireup, so progress the worker (e.g. finish
    /// one operation or a flush) before asking if you want the final configuration.
    ///
    /// # Errors
    /// [`Error::Capture`] when the memstream cannot be opened.
    pub fn transport_report(&self) -> Result<TransportReport> {
        let raw = crate::transport::capture(|file| {
            // SAFETY: live endpoint, open FILE*.
            unsafe { sys::ucp_ep_print_info(self.handle, file) }
        })?;
        Ok(TransportReport::parse(&raw))
    }
}

/// Bounds-checks the md table of a packed rkey (UCX 1.13 `ucp_rkey_pack` layout).
fn check_packed_rkey(packed: &[u8]) -> Result<()> {
    let bad = || Error::MalformedRkey { len: packed.len() };
    let md_map = packed.get(..8).ok_or_else(bad)?;
    let md_map = u64::from_ne_bytes(md_map.try_into().map_err(|_| bad())?);
    let mut pos = 9usize; // md map + memory type
    if packed.len() < pos {
        return Err(bad());
    }
    for _ in 0..md_map.count_ones() {
        let size = usize::from(*packed.get(pos).ok_or_else(bad)?);
        pos += 1 + size;
        if pos > packed.len() {
            return Err(bad());
        }
    }
    Ok(())
}

/// Releases the handle of a fire-and-forget operation (`post_*`).
fn release_posted(op: &'static str, status: sys::ucs_status_ptr_t) -> Result<()> {
    if sys::UCS_PTR_IS_ERR(status) {
        return Err(Error::ucs(op, sys::UCS_PTR_RAW_STATUS(status)));
    }
    if !status.is_null() {
        // SAFETY: an in-flight request handle; ucp_request_free lets it complete internally.
        unsafe { sys::ucp_request_free(status) };
    }
    Ok(())
}

impl<'w> Endpoint<'w> {
    fn close_param(&self) -> sys::ucp_request_param_t {
        let mut param = sys::ucp_request_param_t::default();
        if self.state.failed.get().is_some() {
            // A failed endpoint cannot flush; UCX requires force mode.
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        param
    }

    /// Closes the endpoint in flush mode (`ucp_ep_close_nbx`) and returns the close request,
    /// for callers that drive progress themselves (e.g. both ends of a pair on one thread).
    /// Dropping an endpoint does the same but waits for the close itself.
    ///
    /// # Errors
    /// [`Error::Ucs`] when the close cannot be started (the endpoint is released anyway).
    pub fn close(self) -> Result<Request<'w>> {
        let param = self.close_param();
        self.close_with(param)
    }

    /// Closes the endpoint in force mode (`UCP_EP_CLOSE_FLAG_FORCE`): outstanding operations
    /// are cancelled locally, without waiting for the peer. This is how to give up on a peer
    /// that stopped answering; once the returned request completes, none of this endpoint's
    /// operations writes local memory any more.
    ///
    /// # Errors
    /// [`Error::Ucs`] when the close cannot be started (the endpoint is released anyway).
    pub fn close_force(self) -> Result<Request<'w>> {
        self.close_with(sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        })
    }

    fn close_with(self, param: sys::ucp_request_param_t) -> Result<Request<'w>> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so its state Box is moved out exactly once.
        let state: Box<EpState> = unsafe { std::ptr::read(&this.state) };
        // SAFETY: live endpoint, closed exactly once (Drop will not run for `this`).
        let status = unsafe { sys::ucp_ep_close_nbx(this.handle, &param) };
        // The error handler may fire until the close completes: the request keeps its state.
        Request::from_status_ptr("ucp_ep_close_nbx", this.worker, status, Some(state))
    }
}

impl Drop for Endpoint<'_> {
    fn drop(&mut self) {
        let param = self.close_param();
        // SAFETY: live endpoint, closed exactly once here.
        let status = unsafe { sys::ucp_ep_close_nbx(self.handle, &param) };
        if sys::UCS_PTR_IS_ERR(status) {
            tracing::debug!(
                ep = self.serial,
                status = status_name(sys::UCS_PTR_RAW_STATUS(status)),
                "ucp_ep_close_nbx failed"
            );
            return;
        }
        if status.is_null() {
            return;
        }
        let deadline = Instant::now() + self.state.close_timeout;
        loop {
            // SAFETY: `status` is the live close request.
            let s = unsafe { sys::ucp_request_check_status(status) };
            if s != sys::UCS_INPROGRESS || Instant::now() >= deadline {
                if s == sys::UCS_INPROGRESS {
                    tracing::warn!(
                        ep = self.serial,
                        "endpoint close timed out; releasing request"
                    );
                    // The handler may still fire: keep its state alive for the worker's life.
                    std::mem::forget(std::mem::replace(
                        &mut self.state,
                        Box::new(EpState {
                            failed: Cell::new(None),
                            close_timeout: Duration::ZERO,
                        }),
                    ));
                }
                // SAFETY: release the close request once; UCX finishes it internally if needed.
                unsafe { sys::ucp_request_free(status) };
                return;
            }
            self.worker.progress_no_unwind();
        }
    }
}
