//! Runtime for `no_std` guest policies: a bump allocator and a panic handler.
//!
//! The gateway runs every call in a fresh instance, so a guest never needs to free memory:
//! this allocator only bumps a pointer (no allocator state to set up, no `free`), first
//! through the linear memory the module starts with, then through pages it grows. Without
//! `std` the component imports no WASI at all, which makes instantiating it, once per call,
//! several microseconds cheaper. A panic traps (`unreachable`); the host reports it as a trap
//! and falls back to its built-in policy.
//!
//! A guest links it with `use guest_rt as _;` and writes `#![no_std]` + `extern crate alloc;`.

#![no_std]

use core::alloc::{GlobalAlloc, Layout};
use core::arch::wasm32;
use core::cell::Cell;

const PAGE: usize = 65536;

/// Never frees; see the crate docs.
struct Bump {
    /// Next free byte; 0 until the first allocation.
    next: Cell<usize>,
}

// SAFETY: a wasm32 guest without threads runs one call at a time.
unsafe impl Sync for Bump {}

unsafe extern "C" {
    /// First byte after the module's data and stack (set by the linker).
    static __heap_base: u8;
}

unsafe impl GlobalAlloc for Bump {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let mut next = self.next.get();
        if next == 0 {
            next = &raw const __heap_base as usize;
        }
        let start = (next + layout.align() - 1) & !(layout.align() - 1);
        let Some(end) = start.checked_add(layout.size()) else {
            return core::ptr::null_mut();
        };
        let have = wasm32::memory_size(0) * PAGE;
        if end > have {
            let pages = (end - have).div_ceil(PAGE);
            if wasm32::memory_grow(0, pages) == usize::MAX {
                return core::ptr::null_mut();
            }
        }
        self.next.set(end);
        start as *mut u8
    }

    unsafe fn dealloc(&self, _ptr: *mut u8, _layout: Layout) {}
}

#[global_allocator]
static ALLOCATOR: Bump = Bump { next: Cell::new(0) };

/// The canonical ABI's allocator, through which the host passes lists and strings in (on
/// `wasm32-wasip2`, `std`'s libc would provide it).
///
/// # Safety
///
/// Called by the host per the canonical ABI: `old_ptr`/`old_len` describe an earlier
/// allocation or are 0, `align` is a power of two.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cabi_realloc(
    old_ptr: *mut u8,
    old_len: usize,
    align: usize,
    new_len: usize,
) -> *mut u8 {
    if new_len == 0 {
        return align as *mut u8;
    }
    // SAFETY: `align` is a nonzero power of two (canonical ABI).
    let layout = unsafe { Layout::from_size_align_unchecked(new_len, align) };
    // SAFETY: nonzero size.
    let ptr = unsafe { ALLOCATOR.alloc(layout) };
    if ptr.is_null() {
        wasm32::unreachable();
    }
    if old_len > 0 {
        // SAFETY: the old block is live (nothing is ever freed) and the new one is fresh.
        unsafe { core::ptr::copy_nonoverlapping(old_ptr, ptr, old_len.min(new_len)) };
    }
    ptr
}

#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    wasm32::unreachable()
}
