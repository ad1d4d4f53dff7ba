//! Test-only guest: allocates (and touches) memory until it runs out when asked to (see
//! `misbehave`), else answers validly. The host must stop it with its memory limit.

#![no_std]

extern crate alloc;

use alloc::string::ToString;
use alloc::vec;
use alloc::vec::Vec;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../../wit" });

use pd::policy::types::{Rejection, Route};

struct Hungry;

export!(Hungry);

impl Guest for Hungry {
    fn decide(request: Request, view: View) -> Decision {
        if misbehave(&request) {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                let chunk = vec![0xA5u8; 1 << 20];
                hoard.push(core::hint::black_box(chunk));
            }
        }
        valid(&view)
    }
}

/// A valid decision for any view: every node as a whole-request candidate, or 503 when none.
fn valid(view: &View) -> Decision {
    let route = if view.free_blocks.is_empty() {
        Route::Reject(Rejection {
            status: 503,
            message: "no nodes".to_string(),
        })
    } else {
        Route::Whole((0..view.free_blocks.len() as u32).collect())
    };
    Decision {
        route,
        reverse_pull: None,
    }
}

/// Misbehave when `request.n == 7`, or on every call when the policy's config has `mode=always`
/// (then the gateway's load-time smoke test must refuse it).
fn misbehave(request: &Request) -> bool {
    request.n == 7 || pd::policy::host::config("mode").as_deref() == Some("always")
}
