//! [`Request`]: an in-flight non-blocking operation, completed by progressing its worker.

use std::ffi::c_void;
use std::fmt;

use ucx_sys as sys;

use crate::error::{Error, Result};
use crate::worker::Worker;

/// A non-blocking UCX operation (`get`, `put`, `flush`, `am_send`, ...).
///
/// UCX completes it only while its [`Worker`] is progressed: call [`Request::wait`], or poll
/// [`Request::poll`] between calls to [`Worker::progress`].
///
/// Dropping a `Request` that has not completed **blocks**, progressing the worker until it
/// completes, because the operation may still read or write the memory it was given. (Leaking a
/// `Request` with `mem::forget` skips that wait; memory a leaked operation targets must then be
/// kept alive until the endpoint or worker is flushed.)
#[must_use = "a Request completes only while its worker progresses; dropping it blocks until it does"]
pub struct Request<'a> {
    op: &'static str,
    /// The UCX request handle; null once the operation completed and the handle was freed.
    ptr: *mut c_void,
    /// Final status once known.
    status: Option<sys::ucs_status_t>,
    worker: &'a Worker,
    /// Memory the operation uses (a source buffer, an endpoint's error-handler state), owned
    /// here so a leaked request cannot dangle.
    _keep: Option<Box<dyn std::any::Any>>,
}

impl fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("op", &self.op)
            .field("in_flight", &!self.ptr.is_null())
            .field("status", &self.status)
            .finish()
    }
}

impl<'a> Request<'a> {
    /// Wraps the `ucs_status_ptr_t` an `_nbx` call returned: an error pointer is an `Err`, null
    /// is an already-completed request, anything else an in-flight handle.
    pub(crate) fn from_status_ptr(
        op: &'static str,
        worker: &'a Worker,
        ptr: sys::ucs_status_ptr_t,
        keep: Option<Box<dyn std::any::Any>>,
    ) -> Result<Self> {
        if sys::UCS_PTR_IS_ERR(ptr) {
            return Err(Error::ucs(op, sys::UCS_PTR_RAW_STATUS(ptr)));
        }
        let (ptr, status) = if ptr.is_null() {
            (std::ptr::null_mut(), Some(sys::UCS_OK))
        } else {
            (ptr, None)
        };
        Ok(Request {
            op,
            ptr,
            status,
            worker,
            _keep: keep,
        })
    }

    /// The worker that completes this request.
    pub fn worker(&self) -> &'a Worker {
        self.worker
    }

    /// The name of the UCX call that started this request.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Checks for completion without progressing the worker: `None` while in flight, else the
    /// operation's result.
    ///
    /// # Errors
    /// The operation's failure status as [`Error::Ucs`].
    pub fn poll(&mut self) -> Option<Result<()>> {
        if self.status.is_none() {
            // SAFETY: `ptr` is a live request handle (non-null while status is None).
            let status = unsafe { sys::ucp_request_check_status(self.ptr) };
            if status == sys::UCS_INPROGRESS {
                return None;
            }
            // SAFETY: the request completed; free it exactly once and forget the handle.
            unsafe { sys::ucp_request_free(self.ptr) };
            self.ptr = std::ptr::null_mut();
            self.status = Some(status);
        }
        let status = self.status.expect("set above");
        Some(if status == sys::UCS_OK {
            Ok(())
        } else {
            Err(Error::ucs(self.op, status))
        })
    }

    /// Whether the operation has completed (successfully or not).
    pub fn is_complete(&mut self) -> bool {
        self.poll().is_some()
    }

    /// Progresses the worker until the operation completes.
    ///
    /// # Errors
    /// The operation's failure status as [`Error::Ucs`].
    pub fn wait(mut self) -> Result<()> {
        loop {
            if let Some(result) = self.poll() {
                return result;
            }
            self.worker.progress();
        }
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        while self.poll().is_none() {
            self.worker.progress();
        }
    }
}
