//! Test-only guest on `pd:policy@0.2.0`: reports every column of the view it was given in a
//! rejection, so the host's tests check that each column (rates and the conversation
//! included) reaches a 0.2.0 guest at the right index.
//!
//! Answers `reject { status: 400 + n % 100, message }`, where `message` is
//! `name0=<node-name(0)>;seq=<seq>` then one `;<column>=<values>` per list of the view, in
//! the WIT's order (values in Rust's `{:?}` list form; roles as P/D/S), then
//! `;conversation=<node>,<tokens>,<expiry-ms>` or `;conversation=-`, then
//! `;kv_bytes_per_token=<n>`.

#![no_std]

extern crate alloc;

use alloc::format;
use alloc::vec::Vec;
use core::fmt::Write;
use guest_rt as _;

wit_bindgen::generate!({
    world: "pd:policy/policy@0.2.0",
    path: "../../../wit/0.2.0",
    generate_all,
});

use pd::policy0_1_0::host;
use pd::policy0_1_0::types::{Rejection, Role, Route};

struct EchoColumns;

export!(EchoColumns);

impl Guest for EchoColumns {
    fn decide(request: Request, view: View) -> Decision {
        let name0 = host::node_name(0).unwrap_or_else(|| "-".into());
        let roles: Vec<&str> = view
            .roles
            .iter()
            .map(|r| match r {
                Role::Prefill => "P",
                Role::Decode => "D",
                Role::Standalone => "S",
            })
            .collect();
        let mut m = format!("name0={name0};seq={};roles={roles:?}", request.seq);
        let columns: [(&str, &[u32]); 10] = [
            ("free", &view.free_blocks),
            ("total", &view.total_blocks),
            ("leased", &view.leased_blocks),
            ("waiting", &view.waiting),
            ("running", &view.running),
            ("remote", &view.waiting_remote_kv),
            ("draining", &view.draining),
            ("prefill_tps", &view.prefill_tokens_per_s),
            ("pull_mbps", &view.pull_mb_per_s),
            ("prefix", &request.prefix_blocks),
        ];
        for (name, values) in columns {
            let _ = write!(m, ";{name}={values:?}");
        }
        match view.conversation {
            Some(h) => {
                let _ = write!(m, ";conversation={},{},{}", h.node, h.tokens, h.expiry_ms);
            }
            None => m.push_str(";conversation=-"),
        }
        let _ = write!(m, ";kv_bytes_per_token={}", view.kv_bytes_per_token);
        let status = 400 + (request.n % 100) as u16;
        Decision {
            route: Route::Reject(Rejection { status, message: m }),
            reverse_pull: None,
        }
    }
}
