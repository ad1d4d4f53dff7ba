//! Test-only guest built with `std`, so it imports WASI (as a Go guest always does): it reports
//! what the host's WASI shows a policy, for the host's tests of the locked-down context.
//!
//! Answers `reject { status: 418, message }` with message
//! `wall=<ns since the epoch>;mono=<first>,<second>;rand=<u64>;env=<count>;args=<count>;fs=<ok|err>;file=<ok|err>`:
//! the wall clock, two reads of the monotonic clock, a number from WASI randomness (the keys
//! std's `RandomState` draws), the environment's and arguments' sizes, and whether the root
//! directory can be listed and a file created.

use std::hash::{BuildHasher, RandomState};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

wit_bindgen::generate!({ world: "policy", path: "../../../wit" });

use pd::policy::types::{Rejection, Route};

struct Probe;

export!(Probe);

impl Guest for Probe {
    fn decide(_request: Request, _view: View) -> Decision {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(u128::MAX, |d| d.as_nanos());
        let t0 = Instant::now();
        let t1 = Instant::now();
        let rand = RandomState::new().hash_one(0u8);
        let env = std::env::vars_os().count();
        let args = std::env::args_os().count();
        let ok = |b: bool| if b { "ok" } else { "err" };
        let fs = ok(std::fs::read_dir("/").is_ok());
        let file = ok(std::fs::write("probe.txt", b"x").is_ok());
        let mono = t1.duration_since(t0).as_nanos();
        Decision {
            route: Route::Reject(Rejection {
                status: 418,
                message: format!(
                    "wall={wall};mono={mono};rand={rand};env={env};args={args};fs={fs};file={file}"
                ),
            }),
            reverse_pull: None,
        }
    }
}
