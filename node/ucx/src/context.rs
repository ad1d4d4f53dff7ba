//! [`Context`]: one `ucp_context_h`, shared by workers and memory regions.

use std::ffi::CString;
use std::fmt;
use std::sync::Arc;

use ucx_sys as sys;

use crate::error::{Result, check};

/// Which UCP features a [`Context`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// One-sided put/get (`UCP_FEATURE_RMA`). Needed for KV pulls.
    pub rma: bool,
    /// Active messages (`UCP_FEATURE_AM`). Needed for control messages.
    pub am: bool,
    /// Event-driven progress (`UCP_FEATURE_WAKEUP`). Off by default: it can exclude transports
    /// that have no event support.
    pub wakeup: bool,
}

impl Default for Features {
    /// RMA and AM, no wakeup.
    fn default() -> Self {
        Features {
            rma: true,
            am: true,
            wakeup: false,
        }
    }
}

impl Features {
    fn bits(self) -> u64 {
        let mut bits = 0u64;
        if self.rma {
            bits |= u64::from(sys::UCP_FEATURE_RMA);
        }
        if self.am {
            bits |= u64::from(sys::UCP_FEATURE_AM);
        }
        if self.wakeup {
            bits |= u64::from(sys::UCP_FEATURE_WAKEUP);
        }
        bits
    }
}

pub(crate) struct ContextInner {
    pub(crate) handle: sys::ucp_context_h,
    pub(crate) features: Features,
}

// SAFETY: the context is created with `mt_workers_shared = 1`, which makes UCX guard the
// context-level calls we make from several threads (`ucp_mem_map`, `ucp_mem_unmap`,
// `ucp_rkey_pack`, `ucp_worker_create`) with its own lock. Worker-level calls never go through
// `ContextInner`.
unsafe impl Send for ContextInner {}
// SAFETY: see `Send` above; `&ContextInner` only exposes the handle to those thread-safe calls.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the handle came from a successful ucp_init and every worker and memory region
        // holds an `Arc<ContextInner>`, so none of them is alive when this runs.
        unsafe { sys::ucp_cleanup(self.handle) };
    }
}

/// A UCP application context (`ucp_context_h`): the transports and memory domains UCX found.
///
/// Cheap to clone (an `Arc`); `Send + Sync`. Workers and memory regions keep it alive. It reads
/// UCX's usual `UCX_*` environment variables (e.g. `UCX_TLS`) when created.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("handle", &self.inner.handle)
            .field("features", &self.inner.features)
            .finish()
    }
}

impl Context {
    /// A context with [`Features::default`] (RMA + AM).
    ///
    /// # Errors
    /// [`Error::Ucs`](crate::Error::Ucs) when `ucp_config_read` or `ucp_init` fails.
    pub fn new() -> Result<Self> {
        Self::with_features(Features::default())
    }

    /// A context with the given features. Requests use the `nbx` API with no user-reserved
    /// request space (`request_size = 0`).
    ///
    /// # Errors
    /// [`Error::Ucs`](crate::Error::Ucs) when `ucp_config_read` or `ucp_init` fails.
    pub fn with_features(features: Features) -> Result<Self> {
        Self::with_config(features, &[])
    }

    /// A context with the given features and UCX settings on top of the `UCX_*` environment:
    /// `(name, value)` pairs named as in the environment without the `UCX_` prefix, e.g.
    /// `("NET_DEVICES", "lo")`. A setting here wins over the environment's.
    ///
    /// # Errors
    /// [`Error::Ucs`](crate::Error::Ucs) when `ucp_config_read`, `ucp_config_modify` (an
    /// unknown name or a bad value) or `ucp_init` fails; [`Error::Nul`](crate::Error::Nul)
    /// for a name or value with a NUL byte.
    pub fn with_config(features: Features, settings: &[(&str, &str)]) -> Result<Self> {
        let settings = settings
            .iter()
            .map(|(k, v)| Ok((CString::new(*k)?, CString::new(*v)?)))
            .collect::<Result<Vec<_>>>()?;
        let name = CString::new("pd-ucx").expect("no NUL in literal");
        let params = sys::ucp_params_t {
            field_mask: u64::from(
                sys::UCP_PARAM_FIELD_FEATURES
                    | sys::UCP_PARAM_FIELD_REQUEST_SIZE
                    | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED
                    | sys::UCP_PARAM_FIELD_NAME,
            ),
            features: features.bits(),
            request_size: 0,
            mt_workers_shared: 1,
            name: name.as_ptr(),
            ..Default::default()
        };
        let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
        // SAFETY: null prefix and file mean "UCX_ prefix, no file"; `config` is a valid out-ptr.
        check("ucp_config_read", unsafe {
            sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config)
        })?;
        for (key, value) in &settings {
            // SAFETY: `config` is live (from ucp_config_read); both strings are NUL-terminated
            // and UCX copies them.
            let modified = check("ucp_config_modify", unsafe {
                sys::ucp_config_modify(config, key.as_ptr(), value.as_ptr())
            });
            if let Err(e) = modified {
                // SAFETY: `config` came from ucp_config_read and is not used after this.
                unsafe { sys::ucp_config_release(config) };
                return Err(e);
            }
        }
        let mut handle: sys::ucp_context_h = std::ptr::null_mut();
        // As for workers (`Worker::new`): an interface that vanishes while UCX lists them fails
        // the call with "No such device" (-14); a race, tried again a few times.
        let mut status;
        let mut tries = 0u64;
        loop {
            // SAFETY: `params` is fully initialised with a matching field mask, `config` is
            // live and `handle` is a valid out-pointer. `name` outlives the call (UCX copies it).
            status = unsafe { sys::ucp_init(&params, config, &mut handle) };
            if status != -14 || tries >= 5 {
                break;
            }
            tries += 1;
            std::thread::sleep(std::time::Duration::from_millis(20 * tries));
        }
        // SAFETY: `config` came from ucp_config_read and is not used after this.
        unsafe { sys::ucp_config_release(config) };
        check("ucp_init", status)?;
        Ok(Context {
            inner: Arc::new(ContextInner { handle, features }),
        })
    }

    /// The features this context was created with.
    pub fn features(&self) -> Features {
        self.inner.features
    }

    /// Whether this UCX can register memory of an NVIDIA GPU (`ucp_context_query`'s memory
    /// types include `UCS_MEMORY_TYPE_CUDA`): built with CUDA support and a driver present.
    /// Debian's UCX cannot.
    ///
    /// # Errors
    /// [`Error::Ucs`](crate::Error::Ucs) when the query fails.
    pub fn registers_cuda_memory(&self) -> Result<bool> {
        Ok(self.memory_types()? & (1u64 << sys::UCS_MEMORY_TYPE_CUDA) != 0)
    }

    /// The memory types UCX can register, one bit per `ucs_memory_type` (bit 0: host).
    ///
    /// # Errors
    /// [`Error::Ucs`](crate::Error::Ucs) when the query fails.
    pub fn memory_types(&self) -> Result<u64> {
        let mut attr = sys::ucp_context_attr_t {
            field_mask: u64::from(sys::UCP_ATTR_FIELD_MEMORY_TYPES),
            ..Default::default()
        };
        // SAFETY: live handle; `attr` names the one field UCX fills.
        check("ucp_context_query", unsafe {
            sys::ucp_context_query(self.inner.handle, &mut attr)
        })?;
        Ok(attr.memory_types)
    }

    /// `ucp_context_print_info` captured as text: the transports and memory domains UCX
    /// selected for this context.
    ///
    /// # Errors
    /// [`Error::Capture`](crate::Error::Capture) when the memstream cannot be opened.
    pub fn print_info(&self) -> Result<String> {
        crate::transport::capture(|file| {
            // SAFETY: the handle is live (we hold the Arc) and `file` is an open FILE*.
            unsafe { sys::ucp_context_print_info(self.inner.handle, file) }
        })
    }
}

/// The version of the UCX library loaded at run time, as `(major, minor, release)`.
pub fn library_version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three valid out-pointers.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}
