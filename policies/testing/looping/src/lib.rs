//! Test-only guest: loops forever when asked to (see `misbehave`), else answers validly.
//! The host must stop it with its fuel budget or its epoch deadline. With `request.n == 8` it
//! first computes for `request.seq` rounds, then answers: a call that takes as long as a test
//! needs.

#![no_std]

extern crate alloc;

use alloc::string::ToString;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../../wit" });

use pd::policy::types::{Rejection, Route};

struct Looping;

export!(Looping);

impl Guest for Looping {
    fn decide(request: Request, view: View) -> Decision {
        if misbehave(&request) {
            let mut x = request.seq;
            loop {
                x = core::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
        if request.n == 8 {
            let mut x = request.seq;
            for _ in 0..request.seq {
                x = core::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
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
