//! The crate's one error type.

use std::ffi::CStr;

use ucx_sys::ucs_status_t;

/// Everything that can go wrong in `pd-ucx`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A UCX call returned an error status.
    #[error("{op} failed: UCX status {code} ({name})")]
    Ucs {
        /// The UCX function (or operation) that failed, e.g. `ucp_get_nbx`.
        op: &'static str,
        /// The raw `ucs_status_t` (negative).
        code: i8,
        /// `ucs_status_string(code)`, e.g. "Input/output error".
        name: &'static str,
    },
    /// A local range falls outside its memory region.
    #[error("range {offset}+{len} is outside the memory region of {region_len} bytes")]
    OutOfBounds {
        /// Offset into the region.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// A remote key was used with an endpoint other than the one it was unpacked for.
    #[error("remote key was unpacked for endpoint #{rkey_ep}, used with endpoint #{ep}")]
    RkeyEndpointMismatch {
        /// Serial of the endpoint the key belongs to.
        rkey_ep: u64,
        /// Serial of the endpoint it was used with.
        ep: u64,
    },
    /// The endpoint's peer failed (reported by UCX's error handler); the endpoint is unusable.
    #[error("endpoint #{ep} failed: UCX status {code} ({name})")]
    EndpointFailed {
        /// Serial of the failed endpoint.
        ep: u64,
        /// The raw `ucs_status_t` the error handler received.
        code: i8,
        /// `ucs_status_string(code)`.
        name: &'static str,
    },
    /// Packed remote-key bytes are too short for the memory-domain table they announce.
    #[error("packed remote key of {len} bytes is malformed or truncated")]
    MalformedRkey {
        /// Length of the bytes given.
        len: usize,
    },
    /// An active-message id already has a handler on this worker.
    #[error("active message id {0} already has a handler on this worker")]
    AmHandlerExists(u16),
    /// A UCX setting's name or value holds a NUL byte.
    #[error("a UCX setting holds a NUL byte")]
    Nul(#[from] std::ffi::NulError),
    /// Capturing UCX's printed output (memstream) failed.
    #[error("capturing UCX output: {0}")]
    Capture(#[source] std::io::Error),
}

impl Error {
    /// The UCS status code behind this error, if it came from UCX.
    pub fn status(&self) -> Option<i8> {
        match self {
            Error::Ucs { code, .. } | Error::EndpointFailed { code, .. } => Some(*code),
            _ => None,
        }
    }

    pub(crate) fn ucs(op: &'static str, status: ucs_status_t) -> Self {
        Error::Ucs {
            op,
            code: status,
            name: status_name(status),
        }
    }
}

/// `ucs_status_string(status)` as a `&'static str`.
pub fn status_name(status: ucs_status_t) -> &'static str {
    // SAFETY: ucs_status_string returns a pointer to a static, NUL-terminated string for every
    // status value (unknown values get a static "Unknown error" string).
    let s = unsafe { CStr::from_ptr(ucx_sys::ucs_status_string(status)) };
    s.to_str().unwrap_or("(non-UTF-8 status string)")
}

/// Turns a `ucs_status_t` from a blocking call into a `Result`.
pub(crate) fn check(op: &'static str, status: ucs_status_t) -> Result<()> {
    if status == ucx_sys::UCS_OK {
        Ok(())
    } else {
        Err(Error::ucs(op, status))
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
