//! Test-only guest on `pd:policy@0.3.0`: reports every list of the view it was given in a
//! rejection, so the host's tests check that each one (the role lists, rates and the
//! conversation included) reaches a 0.3.0 guest at the right index; with the config key
//! `answer` set to `mismatched-split`, answers a split whose `children` is shorter than its
//! `decode`, which the host must treat as an invalid decision.
//!
//! Answers `reject { status: 400 + n % 100, message }`, where `message` is
//! `name0=<node-name(0)>;seq=<seq>` then one `;<list>=<values>` per list of the view, in the
//! WIT's order (values in Rust's `{:?}` list form), then the request's `prefix` blocks, then
//! `;conversation=<node>,<tokens>,<expiry-ms>` or `;conversation=-`, then
//! `;kv_bytes_per_token=<n>`.

#![no_std]

extern crate alloc;

use alloc::format;
use core::fmt::Write;
use guest_rt as _;

wit_bindgen::generate!({
    world: "pd:policy/policy@0.3.0",
    path: "../../../wit/0.3.0",
    generate_all,
});

use pd::policy0_1_0::host;
use pd::policy0_1_0::types::Rejection;
use pd::policy0_3_0::cluster::{Route, Split};

struct EchoV3;

export!(EchoV3);

impl Guest for EchoV3 {
    fn decide(request: Request, view: View) -> Decision {
        if host::config("answer").as_deref() == Some("mismatched-split")
            && let (Some(&p), Some(&d)) = (view.prefill.first(), view.decode.first())
        {
            return Decision {
                route: Route::Split(Split {
                    prefill: alloc::vec![p],
                    decode: alloc::vec![d, d],
                    children: alloc::vec![request.n.max(1)],
                }),
                reverse_pull: None,
            };
        }
        let name0 = host::node_name(0).unwrap_or_else(|| "-".into());
        let mut m = format!("name0={name0};seq={}", request.seq);
        let lists: [(&str, &[u32]); 13] = [
            ("prefill", &view.prefill),
            ("decode", &view.decode),
            ("standalone", &view.standalone),
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
        for (name, values) in lists {
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
