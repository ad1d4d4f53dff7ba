//! Test-only guest: exercises every host import and reports everything it was given in a
//! rejection, so the host's tests check the host imports and the lowering of every field of
//! `request` and `view` end to end.
//!
//! Answers `reject { status: 400 + n % 100, message }`, where `message` is
//! `name0=<node-name(0)>;name_out=<node-name(len)>;greeting=<config("greeting")>;clock=<ok|backwards>`
//! then `;request=<fields>` and `;node=<fields>` per node, fields joined by `,` (`-` stands
//! for none; see `describe_request` and `describe_node`). Logs `config("log_lines")` lines
//! (default 4), cycling through the levels.

#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::{String, ToString};
use core::fmt::Write;
use guest_rt as _;

wit_bindgen::generate!({ world: "policy", path: "../../../wit" });

use pd::policy::host::{self, Level};
use pd::policy::types::{Api, Node, Rejection, Role, Route};

struct Echo;

export!(Echo);

impl Guest for Echo {
    fn decide(request: Request, view: View) -> Decision {
        let t0 = host::now_ns();
        let dash = |s: Option<String>| s.unwrap_or_else(|| "-".to_string());
        let name0 = dash(host::node_name(0));
        let name_out = dash(host::node_name(view.nodes.len() as u32));
        let greeting = dash(host::config("greeting"));
        let lines = host::config("log_lines")
            .and_then(|l| l.parse().ok())
            .unwrap_or(4u32);
        let levels = [Level::Debug, Level::Info, Level::Warn, Level::Error];
        for i in 0..lines {
            let line = format!(
                "echo: line {i} seq {} nodes {}",
                request.seq,
                view.nodes.len()
            );
            host::log(levels[i as usize % 4], &line);
        }
        let clock = if host::now_ns() >= t0 {
            "ok"
        } else {
            "backwards"
        };
        let mut message =
            format!("name0={name0};name_out={name_out};greeting={greeting};clock={clock}");
        describe_request(&mut message, &request);
        for node in &view.nodes {
            describe_node(&mut message, node);
        }
        let status = 400 + (request.n % 100) as u16;
        Decision {
            route: Route::Reject(Rejection { status, message }),
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

/// `;node=role,free,total,leased,waiting,running,waiting_remote_kv,draining,conv_tokens,conv_expiry`.
fn describe_node(out: &mut String, n: &Node) {
    let role = match n.role {
        Role::Prefill => "P",
        Role::Decode => "D",
        Role::Standalone => "S",
    };
    let _ = write!(
        out,
        ";node={role},{},{},{},{},{},{},{},{},{}",
        n.free_blocks,
        n.total_blocks,
        n.leased_blocks,
        n.waiting,
        n.running,
        n.waiting_remote_kv,
        n.draining,
        n.conversation_tokens,
        n.conversation_expiry_ms,
    );
}
