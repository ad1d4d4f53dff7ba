//! Test-only guest: names node index 999 (outside any test view) when asked to (see
//! `misbehave`), else answers validly. The host's `validate` must catch it.

#![no_std]

extern crate alloc;

use alloc::string::ToString;
use alloc::vec;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../../wit" });

use pd::policy::types::{Rejection, Route};

struct Lying;

export!(Lying);

impl Guest for Lying {
    fn decide(request: Request, view: View) -> Decision {
        if misbehave(&request) {
            return Decision {
                route: Route::Whole(vec![999]),
                reverse_pull: None,
            };
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
