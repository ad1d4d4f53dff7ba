//! The host imports (`pd:policy/host`: `log`, `now-ns`, `config`, `node-name`) and the store
//! data they read ([`HostState`]).
//!
//! `now-ns` is deterministic: it reads the time the gateway recorded for the request, passed
//! with the call ([`crate::WasmPolicy::decide_at`]: `time_ms`, the decision record's `time-ms`)
//! and converted to nanoseconds, the same value for every read of one call. A replay passes
//! the record's `time-ms` again, so the guest reads what it read live. While the component is
//! instantiated, before any request, it reads 0. Only differences mean something (the WIT),
//! and a policy keeps no state between calls: within a call they are 0.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::sandbox::{INSTANTIATE_SEED, Limiter, WasiState, wasi_ctx};
use crate::epoch::Watch;
use crate::wit::{contract, host};
use host::Level;

/// Engine ids of a view's nodes (`names[i]` names `view.nodes[i]`), shared with the caller:
/// the host's `node-name` import reads them, nothing copies them per call.
pub type NodeNames = Arc<[Arc<str>]>;

/// Log lines a guest may write per call; later ones are dropped (the last kept line says so).
const MAX_LOG_LINES_PER_CALL: u32 = 32;

/// Bytes of a guest log line kept; the rest is cut.
const MAX_LOG_LINE: usize = 1024;

/// What the guest's host imports read: shared by all calls of one policy.
#[derive(Debug)]
pub(super) struct GuestMeta {
    pub(super) name: String,
    /// The first 12 hex digits of the component's sha256.
    pub(super) version: String,
    pub(super) config: BTreeMap<String, String>,
}

/// `now-ns` of a call the gateway recorded at `time_ms` (milliseconds since the Unix epoch):
/// the same instant in nanoseconds.
pub(crate) fn now_ns_at(time_ms: u64) -> u64 {
    time_ms.saturating_mul(1_000_000)
}

/// Store data of one call.
pub(super) struct HostState {
    guest: Arc<GuestMeta>,
    /// `names[i]` names `view.nodes[i]` (shared with the caller, never copied).
    names: NodeNames,
    /// What `now-ns` reads: 0 while instantiating, then the call's recorded time
    /// ([`now_ns_at`]).
    now_ns: u64,
    pub(super) limiter: Limiter,
    log_lines: u32,
    /// Seeds the WASI random generators: [`INSTANTIATE_SEED`] while the component is
    /// instantiated, then the request's `seq`.
    pub(super) seed: u64,
    /// The guest's WASI monotonic clock (ns), shared with its WASI context.
    pub(super) clock: Arc<AtomicU64>,
    /// What `clock` read when the instantiation ended: every call starts from it
    /// ([`HostState::begin_call`]), so a call in an instance reused across calls (a stateless
    /// policy: `engine/call.rs`) reads the clock a fresh instance would.
    clock_at_start: u64,
    /// Built on the guest's first WASI call: most policies never make one.
    pub(super) wasi: Option<WasiState>,
    /// The running call's (or instantiation's) deadline, which the store's epoch callback
    /// checks ([`Watch::expired`]).
    pub(super) watch: Watch,
}

impl HostState {
    /// The data of a store about to instantiate the component of `guest`: no node names,
    /// `now-ns` at 0, WASI randomness seeded with [`INSTANTIATE_SEED`], memories capped at
    /// `memory_limit`.
    pub(super) fn new(guest: Arc<GuestMeta>, memory_limit: usize) -> Self {
        HostState {
            guest,
            names: Arc::from([]),
            now_ns: 0,
            limiter: Limiter::new(memory_limit),
            log_lines: 0,
            seed: INSTANTIATE_SEED,
            clock: Arc::default(),
            clock_at_start: 0,
            wasi: None,
            watch: Watch::IDLE,
        }
    }

    /// The component's instantiation in this store ended: calls start the WASI monotonic
    /// clock from where it is now, and memory growth counts from here ([`Limiter::worn`]).
    pub(super) fn instantiated(&mut self) {
        self.clock_at_start = self.clock.load(Ordering::Relaxed);
        self.limiter.instantiated();
    }

    /// The instance is about to serve request `seq`, whose view's nodes `names` names, which
    /// the gateway took at `time_ms` (what `now-ns` reads, in ns). A WASI context built while
    /// instantiating is rebuilt, its randomness seeded with `seq` (its resources carry on),
    /// and the monotonic clock set back to where the instantiation left it, so a decision
    /// draws the same bytes and reads the same times whether its instance was made ahead,
    /// just now, or served calls before (a reused instance).
    pub(super) fn begin_call(&mut self, seq: u64, names: NodeNames, time_ms: u64) {
        self.names = names;
        self.seed = seq;
        self.now_ns = now_ns_at(time_ms);
        self.log_lines = 0;
        self.clock.store(self.clock_at_start, Ordering::Relaxed);
        if let Some(w) = &mut self.wasi {
            w.ctx = wasi_ctx(seq, self.clock.clone());
        }
    }
}

impl contract::Host for HostState {}

impl host::Host for HostState {
    fn log(&mut self, level: Level, mut message: String) {
        self.log_lines += 1;
        if self.log_lines > MAX_LOG_LINES_PER_CALL {
            return;
        }
        if message.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push('…');
        }
        if self.log_lines == MAX_LOG_LINES_PER_CALL {
            message.push_str(" (log limit reached: further lines of this call are dropped)");
        }
        let (policy, version) = (&self.guest.name, &self.guest.version);
        match level {
            Level::Debug => {
                tracing::debug!(target: "pd_policy::guest", %policy, %version, "{message}")
            }
            Level::Info => {
                tracing::info!(target: "pd_policy::guest", %policy, %version, "{message}")
            }
            Level::Warn => {
                tracing::warn!(target: "pd_policy::guest", %policy, %version, "{message}")
            }
            Level::Error => {
                tracing::error!(target: "pd_policy::guest", %policy, %version, "{message}")
            }
        }
    }

    fn now_ns(&mut self) -> u64 {
        #[cfg(test)]
        tests::NOW_READS.with(|r| r.borrow_mut().push(self.now_ns));
        self.now_ns
    }

    fn config(&mut self, key: String) -> Option<String> {
        self.guest.config.get(&key).cloned()
    }

    fn node_name(&mut self, index: u32) -> Option<String> {
        self.names.get(index as usize).map(|n| n.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::path::PathBuf;
    use std::time::Duration;

    use super::*;
    use crate::wit::host::Host as _;
    use crate::{
        Api, Installed, Measured, Node, PolicyEngine, PolicySpec, Record, Request, Role, View,
    };

    thread_local! {
        /// Every value `now-ns` answered a guest on this thread, in order.
        pub(super) static NOW_READS: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    }

    /// What `now-ns` answered this thread's guests since the last time this was asked.
    fn now_reads() -> Vec<u64> {
        NOW_READS.with(|r| std::mem::take(&mut *r.borrow_mut()))
    }

    /// When the gateway took the request in these tests, in ms since the Unix epoch.
    const TIME_MS: u64 = 1_763_880_000_123;

    fn request() -> Request {
        Request {
            seq: 7,
            api: Api::ChatCompletions,
            prompt_tokens: 40,
            block_size: 16,
            block_hashes: vec![1, 2],
            prefix_blocks: vec![1],
            n: 1,
            max_tokens: Some(16),
            stream: false,
            conversation_key: None,
        }
    }

    fn view() -> View {
        View {
            nodes: vec![Node {
                role: Role::Standalone,
                free_blocks: 10,
                total_blocks: 16,
                leased_blocks: 0,
                waiting: 0,
                running: 0,
                waiting_remote_kv: 0,
                draining: false,
                conversation_tokens: 0,
                conversation_expiry_ms: 0,
            }],
        }
    }

    fn names() -> NodeNames {
        Arc::from([Arc::from("s0")])
    }

    /// `record` as the decision log writes it and `policy replay` reads it back.
    fn logged_and_read_back(record: &Record) -> Record {
        let line = serde_json::to_string(&record.to_json()).expect("json");
        Record::from_json(&serde_json::from_str(&line).expect("parse")).expect("record")
    }

    /// The host import itself: it answers the call's recorded time, whatever real time does,
    /// and a store set up from the call's record answers the same.
    #[test]
    fn now_ns_answers_the_recorded_time_of_the_call() {
        let guest = Arc::new(GuestMeta {
            name: "t".to_string(),
            version: "000000000000".to_string(),
            config: BTreeMap::new(),
        });
        let mut live = HostState::new(guest.clone(), 1 << 20);
        assert_eq!(live.now_ns(), 0, "while instantiating, before any request");
        live.begin_call(7, names(), TIME_MS);
        let seen = live.now_ns();
        assert_eq!(seen, TIME_MS * 1_000_000);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(
            live.now_ns(),
            seen,
            "real time does not move it within a call"
        );

        let mut record = Record::new(
            request(),
            view(),
            crate::native::least_loaded(&request(), &view()),
        );
        record.time_ms = Some(TIME_MS);
        let back = logged_and_read_back(&record);
        let mut replay = HostState::new(guest, 1 << 20);
        replay.begin_call(back.request.seq, names(), back.time_ms.expect("time-ms"));
        assert_eq!(replay.now_ns(), seen);
        assert_eq!(now_ns_at(u64::MAX), u64::MAX, "saturates");
    }

    /// The built guest component `name` (as `tests/common::wasm` finds it).
    fn guest_wasm(name: &str) -> Vec<u8> {
        let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let dir = match (
            std::env::var_os("PD_POLICIES_DIR"),
            std::env::var_os("CARGO_TARGET_DIR"),
        ) {
            (Some(d), _) => PathBuf::from(d),
            (None, Some(t)) => workspace.join(t).join("policies"),
            (None, None) => workspace.join("target/policies"),
        };
        let path = dir.join(format!("{name}.wasm"));
        std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "guest policy {} is missing ({e}): run scripts/build-policies.sh first \
                 (or point PD_POLICIES_DIR at its output)",
                path.display()
            )
        })
    }

    /// A guest that calls `now-ns` (`policies/testing/echo`, twice per call) reads the time
    /// passed with the call, and, replayed from the call's record, the same again.
    #[test]
    fn a_guest_reads_the_recorded_time_live_and_in_replay() {
        let engine = PolicyEngine::new().expect("engine");
        let spec = PolicySpec {
            name: "echo".to_string(),
            deadline: Duration::from_secs(10),
            ..PolicySpec::default()
        };
        let policy = engine.load(&guest_wasm("echo"), spec).expect("load");
        assert!(
            now_reads().iter().all(|&t| t == 0),
            "the smoke test's calls read 0"
        );

        let live = policy
            .decide_at(&request(), &view(), &Measured::default(), &names(), TIME_MS)
            .expect("decide");
        let live_reads = now_reads();
        assert_eq!(
            live_reads,
            [TIME_MS * 1_000_000; 2],
            "echo reads now-ns twice"
        );

        let mut record = Record::new(request(), view(), live.clone());
        record.time_ms = Some(TIME_MS);
        let back = logged_and_read_back(&record);
        let installed = Installed::Wasm(policy);
        let time_ms = back.time_ms.unwrap_or(0);
        let replayed = installed
            .decide_at(&back.request, &back.view, &back.measured, &names(), time_ms)
            .expect("replay");
        assert_eq!(replayed, live);
        assert_eq!(
            now_reads(),
            live_reads,
            "the replay reads what the call read"
        );

        // No time recorded (a hand-written case): 0, every time.
        installed
            .decide(&request(), &view(), &Measured::default(), &names())
            .expect("decide");
        assert_eq!(now_reads(), [0; 2]);
    }
}
