//! [`MemoryRegion`] (memory registered for RMA) and [`RemoteKey`] (a peer's region, unpacked).

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use ucx_sys as sys;

use crate::context::{Context, ContextInner};
use crate::error::{Error, Result, check};
use crate::worker::Worker;

/// Caller-owned memory registered with UCX (`ucp_mem_map` of an existing buffer), so peers can
/// read and write it with one-sided operations and local gets can land in it.
///
/// The region never allocates, moves or frees the memory: the owner (e.g. the engine's KV
/// pool) keeps it in place. Dropping the region unmaps it (`ucp_mem_unmap`); remote keys that
/// peers unpacked from [`MemoryRegion::rkey_pack`] stop being valid then, so keep the region
/// alive for as long as any peer may use its key. `Send + Sync`: mapping, packing and
/// unmapping are context-level calls that UCX locks (the context is `mt_workers_shared`).
pub struct MemoryRegion {
    pub(crate) memh: sys::ucp_mem_h,
    base: *mut u8,
    len: usize,
    ctx: Arc<ContextInner>,
}

// SAFETY: the handle is only used in context-level calls (`ucp_rkey_pack`, `ucp_mem_unmap`) that
// UCX serialises for an `mt_workers_shared` context, or passed as a hint to worker operations.
// The raw base pointer is never dereferenced by this type.
unsafe impl Send for MemoryRegion {}
// SAFETY: as for `Send`; `&MemoryRegion` exposes no interior mutation.
unsafe impl Sync for MemoryRegion {}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("base", &self.base)
            .field("len", &self.len)
            .finish()
    }
}

impl MemoryRegion {
    /// Registers `len` bytes at `base` with `ctx` for RMA.
    ///
    /// # Safety
    /// - `base..base+len` must be one allocation, valid for reads and writes, and must stay
    ///   allocated and in place until this region is dropped **and** every operation that
    ///   targets it has completed (requests complete before they are dropped; see
    ///   [`Request`](crate::Request)).
    /// - Peers holding the packed key, and local gets into the region, write the memory behind
    ///   Rust's back: the caller must not hold `&`/`&mut` references to bytes that an
    ///   outstanding operation or peer may write (synchronise through completions/flushes).
    ///
    /// # Errors
    /// [`Error::Ucs`] when `ucp_mem_map` fails (e.g. `len == 0`).
    pub unsafe fn map(ctx: &Context, base: *mut u8, len: usize) -> Result<Self> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            ),
            address: base.cast::<c_void>(),
            length: len,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: live context, initialised params with a matching mask, valid out-pointer; the
        // caller guarantees the memory itself.
        check("ucp_mem_map", unsafe {
            sys::ucp_mem_map(ctx.inner.handle, &params, &mut memh)
        })?;
        Ok(MemoryRegion {
            memh,
            base,
            len,
            ctx: Arc::clone(&ctx.inner),
        })
    }

    /// Allocates `len` bytes through UCX and registers them (`ucp_mem_map` with
    /// `UCP_MEM_MAP_ALLOCATE`); the memory is freed when the region is dropped.
    ///
    /// On UCX 1.13 this matters for speed: memory that UCX allocated comes from a shared-memory
    /// domain (posix/sysv), so peers on the same host read it with true one-sided gets, while
    /// gets from memory registered with [`MemoryRegion::map`] are emulated with active messages
    /// and need the owner's worker to progress. Contents start zeroed, and every page is touched
    /// here: a fresh shared-memory mapping faults each 4 KiB page in on first write, which would
    /// otherwise land in the first transfers (measured: a 2 MiB pull into untouched pages took
    /// ~3 ms instead of ~0.3 ms).
    ///
    /// # Errors
    /// [`Error::Ucs`] when `ucp_mem_map` or `ucp_mem_query` fails.
    pub fn allocate(ctx: &Context, len: usize) -> Result<Self> {
        Self::allocate_with(ctx, len, RemoteAccess::ReadWrite)
    }

    /// [`MemoryRegion::allocate`] with the access peers get: [`RemoteAccess::ReadOnly`] asks UCX
    /// (`UCP_MEM_MAP_PARAM_FIELD_PROT`) to let peers read but not write the region. Whether a
    /// transport enforces it is UCX's business: on UCX 1.13's shared-memory transports it is not
    /// enforced (see `tests/rma.rs::remote_read_only_is_asked_for_but_not_enforced_on_shm`).
    ///
    /// # Errors
    /// As [`MemoryRegion::allocate`].
    pub fn allocate_with(ctx: &Context, len: usize, access: RemoteAccess) -> Result<Self> {
        let remote = match access {
            RemoteAccess::ReadWrite => {
                sys::UCP_MEM_MAP_PROT_REMOTE_READ | sys::UCP_MEM_MAP_PROT_REMOTE_WRITE
            }
            RemoteAccess::ReadOnly => sys::UCP_MEM_MAP_PROT_REMOTE_READ,
        };
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_PROT,
            ),
            address: std::ptr::null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            prot: (sys::UCP_MEM_MAP_PROT_LOCAL_READ | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE | remote)
                as _,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: live context, initialised params with a matching mask, valid out-pointer; UCX
        // allocates the memory itself.
        check("ucp_mem_map", unsafe {
            sys::ucp_mem_map(ctx.inner.handle, &params, &mut memh)
        })?;
        let mut region = MemoryRegion {
            memh,
            base: std::ptr::null_mut(),
            len,
            ctx: Arc::clone(&ctx.inner),
        };
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: u64::from(sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH),
            ..Default::default()
        };
        // SAFETY: live memh, valid out-pointer.
        check("ucp_mem_query", unsafe {
            sys::ucp_mem_query(memh, &mut attr)
        })?;
        region.base = attr.address.cast::<u8>();
        region.len = attr.length.min(len);
        // SAFETY: UCX allocated `attr.length >= region.len` writable bytes at `base`; nothing else
        // refers to them yet.
        unsafe { std::ptr::write_bytes(region.base, 0, region.len) };
        Ok(region)
    }

    /// Start address of the region (what a peer passes as `remote_addr`, plus an offset).
    pub fn base(&self) -> u64 {
        self.base as u64
    }

    /// Start of the region as a pointer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never true for a mapped region; UCX rejects length 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Packs the remote key (`ucp_rkey_pack`): opaque bytes a peer turns into a [`RemoteKey`]
    /// with [`Endpoint::unpack_rkey`](crate::Endpoint::unpack_rkey).
    ///
    /// # Errors
    /// [`Error::Ucs`] when `ucp_rkey_pack` fails.
    pub fn rkey_pack(&self) -> Result<Vec<u8>> {
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: live context and memh, valid out-pointers.
        check("ucp_rkey_pack", unsafe {
            sys::ucp_rkey_pack(self.ctx.handle, self.memh, &mut buf, &mut size)
        })?;
        // SAFETY: UCX returned `size` readable bytes at `buf`.
        let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
        // SAFETY: `buf` came from ucp_rkey_pack and is released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(bytes)
    }

    /// Checks that `offset..offset+len` lies inside the region and returns its address.
    pub(crate) fn range(&self, offset: usize, len: usize) -> Result<*mut u8> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.base.wrapping_add(offset)),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: memh came from ucp_mem_map on this context and is unmapped once.
        let status = unsafe { sys::ucp_mem_unmap(self.ctx.handle, self.memh) };
        if status != sys::UCS_OK {
            tracing::warn!(
                status = crate::error::status_name(status),
                "ucp_mem_unmap failed"
            );
        }
    }
}

/// What peers may do to a region ([`MemoryRegion::allocate_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteAccess {
    /// Peers may read and write it (UCX's default).
    ReadWrite,
    /// Peers may only read it.
    ReadOnly,
}

/// A peer's memory region key, unpacked for one endpoint (`ucp_ep_rkey_unpack`); destroyed on
/// drop (`ucp_rkey_destroy`).
///
/// Borrows the worker (UCX returns rkeys to worker-owned pools). Use it only with the endpoint
/// it was unpacked for: other endpoints reject it with [`Error::RkeyEndpointMismatch`].
pub struct RemoteKey<'w> {
    pub(crate) handle: sys::ucp_rkey_h,
    pub(crate) ep_serial: u64,
    _worker: PhantomData<&'w Worker>,
}

impl fmt::Debug for RemoteKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteKey")
            .field("handle", &self.handle)
            .field("endpoint", &self.ep_serial)
            .finish()
    }
}

impl RemoteKey<'_> {
    pub(crate) fn new(handle: sys::ucp_rkey_h, ep_serial: u64) -> Self {
        RemoteKey {
            handle,
            ep_serial,
            _worker: PhantomData,
        }
    }

    /// Serial number of the endpoint this key belongs to.
    pub fn endpoint_serial(&self) -> u64 {
        self.ep_serial
    }

    /// Populates this process's page tables for `len` bytes of the peer's memory at `remote_addr`
    /// when [`RemoteKey::local_ptr`] maps it (`madvise(MADV_POPULATE_READ)`), so later reads take
    /// no page faults. Returns `Ok(false)` when the memory is not mapped here. Touches nothing from
    /// user space: memory unmapped meanwhile makes it fail, not crash, so it may run on any thread
    /// while the key lives (pass it [`RemoteKey::local_ptr`]'s address and call [`populate`]).
    ///
    /// # Errors
    /// The `madvise` error.
    pub fn populate(&self, remote_addr: u64, len: usize) -> std::io::Result<bool> {
        match self.local_ptr(remote_addr) {
            Some(ptr) => populate(ptr, len).map(|()| true),
            None => Ok(false),
        }
    }

    /// Where the peer's address `remote_addr` is mapped into this process (`ucp_rkey_ptr`), when
    /// the key's transport maps peer memory directly (shared memory on one host); `None`
    /// otherwise. The mapping lives as long as this key.
    pub fn local_ptr(&self, remote_addr: u64) -> Option<*const u8> {
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: live rkey handle; `ptr` is a valid out-pointer. UCX only computes an address.
        let status = unsafe { sys::ucp_rkey_ptr(self.handle, remote_addr, &mut ptr) };
        (status == sys::UCS_OK && !ptr.is_null()).then_some(ptr.cast_const().cast())
    }
}

impl Drop for RemoteKey<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_ep_rkey_unpack and is destroyed once; the worker it
        // belongs to outlives `'w`.
        unsafe { sys::ucp_rkey_destroy(self.handle) };
    }
}

/// `madvise(MADV_POPULATE_READ)` over the pages covering `ptr..ptr+len`: faults them in without
/// reading them from user space (an unmapped range is an error, not a crash).
///
/// # Errors
/// The `madvise` error (e.g. `ENOMEM` for an unmapped range).
pub fn populate(ptr: *const u8, len: usize) -> std::io::Result<()> {
    const PAGE: usize = 4096;
    let start = (ptr as usize) & !(PAGE - 1);
    let end = (ptr as usize).saturating_add(len).next_multiple_of(PAGE);
    // SAFETY: madvise reads no memory from user space and changes no contents; on a range that
    // is not mapped it returns an error.
    let rc = unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_READ,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
