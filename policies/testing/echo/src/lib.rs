//! Test-only guest: exercises every host import and reports what it saw in a rejection, so
//! the host's tests can check `log`, `now-ns`, `config` and `node-name` end to end.
//!
//! Answers `reject { status: 400 + n % 100, message }` where `message` is
//! `name0=<node-name(0)>;name_out=<node-name(len)>;greeting=<config("greeting")>;clock=<ok|backwards>`
//! (`-` stands for none). Logs one line at each level.

wit_bindgen::generate!({ world: "policy", path: "../../../wit" });

use pd::policy::host::{self, Level};
use pd::policy::types::{Rejection, Route};

struct Echo;

export!(Echo);

impl Guest for Echo {
    fn decide(request: Request, view: View) -> Decision {
        let t0 = host::now_ns();
        let dash = |s: Option<String>| s.unwrap_or_else(|| "-".to_string());
        let name0 = dash(host::node_name(0));
        let name_out = dash(host::node_name(view.nodes.len() as u32));
        let greeting = dash(host::config("greeting"));
        for level in [Level::Debug, Level::Info, Level::Warn, Level::Error] {
            host::log(level, &format!("echo: seq {} nodes {}", request.seq, view.nodes.len()));
        }
        let clock = if host::now_ns() >= t0 { "ok" } else { "backwards" };
        let message = format!("name0={name0};name_out={name_out};greeting={greeting};clock={clock}");
        let status = 400 + (request.n % 100) as u16;
        Decision { route: Route::Reject(Rejection { status, message }), reverse_pull: None }
    }
}
