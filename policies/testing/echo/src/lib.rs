//! Test-only guest: exercises every host import and reports everything it was given in a
//! rejection, so the host's tests check the host imports and the lowering of every field of
//! `request` and of every list of `view` (the role lists, the rates and the conversation
//! included) end to end, at the right index.
//!
//! Answers `reject { status: 400 + n % 100, message }`, where `message` is
//! `name0=<node-name(0)>;name_out=<node-name(nodes)>;greeting=<config("greeting")>;clock=<ok|backwards>`
//! then `;request=<fields>` (joined by `,`, `-` for none; see `describe_request`), then one
//! `;<list>=<values>` per list of the view in the WIT's order (values in Rust's `{:?}` list
//! form), then `;conversation=<node>,<tokens>,<expiry-ms>` or `;conversation=-`, then
//! `;kv_bytes_per_token=<n>`. Logs `config("log_lines")` lines (default 4), cycling through
//! the levels.
//!
//! With the config key `answer` set to `mismatched-split`, answers a split whose `children`
//! is shorter than its `decode` instead, which the host must treat as an invalid decision.

#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec;
use core::fmt::Write;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../../wit" });

use pd::policy::host::{self, Level};
use pd::policy::types::{Api, Rejection, Route, Split};

struct Echo;

export!(Echo);

impl Guest for Echo {
    fn decide(request: Request, view: View) -> Decision {
        if host::config("answer").as_deref() == Some("mismatched-split")
            && let (Some(&p), Some(&d)) = (view.prefill.first(), view.decode.first())
        {
            return Decision {
                route: Route::Split(Split {
                    prefill: vec![p],
                    decode: vec![d, d],
                    children: vec![request.n.max(1)],
                }),
                reverse_pull: None,
            };
        }
        let t0 = host::now_ns();
        let nodes = view.free_blocks.len();
        let dash = |s: Option<String>| s.unwrap_or_else(|| "-".to_string());
        let name0 = dash(host::node_name(0));
        let name_out = dash(host::node_name(nodes as u32));
        let greeting = dash(host::config("greeting"));
        let lines = host::config("log_lines")
            .and_then(|l| l.parse().ok())
            .unwrap_or(4u32);
        let levels = [Level::Debug, Level::Info, Level::Warn, Level::Error];
        for i in 0..lines {
            let line = format!("echo: line {i} seq {} nodes {nodes}", request.seq);
            host::log(levels[i as usize % 4], &line);
        }
        let clock = if host::now_ns() >= t0 {
            "ok"
        } else {
            "backwards"
        };
        let mut m = format!("name0={name0};name_out={name_out};greeting={greeting};clock={clock}");
        describe_request(&mut m, &request);
        let lists: [(&str, &[u32]); 12] = [
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

/// `;request=seq,api,prompt_tokens,block_size,[hashes],[prefix],n,max_tokens,stream,key`.
fn describe_request(out: &mut String, r: &Request) {
    let api = match r.api {
        Api::ChatCompletions => "chat",
        Api::Completions => "completions",
        Api::Responses => "responses",
    };
    let _ = write!(
        out,
        ";request={},{api},{},{},{:?},{:?},{},{},{},{}",
        r.seq,
        r.prompt_tokens,
        r.block_size,
        r.block_hashes,
        r.prefix_blocks,
        r.n,
        r.max_tokens.map_or("-".to_string(), |m| m.to_string()),
        r.stream,
        r.conversation_key.as_deref().unwrap_or("-"),
    );
}
