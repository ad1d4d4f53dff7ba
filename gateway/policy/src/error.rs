//! The crate's error type.

use std::time::Duration;

use crate::InvalidDecision;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a policy could not be built, loaded, or could not decide.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// wasmtime rejected the engine configuration, or the epoch thread did not start.
    #[error("building the policy engine failed")]
    Engine {
        /// wasmtime's error.
        #[source]
        source: BoxError,
    },
    /// The spec asks for a memory limit above what the host's pool holds.
    #[error("memory limit {requested} bytes exceeds the host's maximum of {max}")]
    MemoryLimitTooLarge {
        /// The spec's `memory_limit`.
        requested: usize,
        /// [`crate::MAX_MEMORY_LIMIT`].
        max: usize,
    },
    /// The spec asks for more spare instances than the host keeps per policy.
    #[error("spares {requested} exceeds the host's maximum of {max}")]
    TooManySpares {
        /// The spec's `spares`.
        requested: usize,
        /// [`crate::MAX_SPARES`].
        max: usize,
    },
    /// The on-disk cache directory cannot be used.
    #[error(transparent)]
    CacheDir(#[from] crate::CacheDirError),
    /// The bytes are not a valid WebAssembly component.
    #[error("policy {name}: compiling the component failed")]
    Compile {
        /// The spec's name.
        name: String,
        /// wasmtime's error.
        #[source]
        source: BoxError,
    },
    /// The component does not fit the `pd:policy/policy` world (missing export, unknown
    /// import, wrong types), or, per call, no pool slot was free.
    #[error("policy {name}: instantiating the component failed")]
    Instantiate {
        /// The spec's name.
        name: String,
        /// wasmtime's error.
        #[source]
        source: BoxError,
    },
    /// A load-time smoke-test call failed; the policy was not loaded.
    #[error("policy {name}: smoke test `{case}` failed")]
    SmokeTest {
        /// The spec's name.
        name: String,
        /// What failed: `instantiate` (a first instance), or a synthetic call (`n=1`, `n=3`;
        /// asked again of a policy that declares itself stateless: [`PolicyError::NotStateless`]).
        case: &'static str,
        /// How it failed.
        #[source]
        source: Box<PolicyError>,
    },
    /// The guest trapped (panic, `unreachable`, out-of-bounds access, stack overflow, …).
    #[error("policy trapped: {trap}")]
    Trap {
        /// The trap code.
        trap: wasmtime::Trap,
        /// The full error with its wasm backtrace, for logs.
        detail: String,
    },
    /// The call ran past its deadline (epoch interruption).
    #[error("policy ran past its deadline of {deadline:?}")]
    Timeout {
        /// The spec's deadline.
        deadline: Duration,
    },
    /// The call used up its fuel.
    #[error("policy ran out of fuel ({fuel} units)")]
    OutOfFuel {
        /// The spec's fuel budget.
        fuel: u64,
    },
    /// The guest tried to grow a memory past its limit.
    #[error("policy hit its memory limit of {limit} bytes (tried to grow a memory to {desired})")]
    MemoryLimit {
        /// The limit (the spec's, or the memory's own declared maximum if lower).
        limit: usize,
        /// The size the memory tried to grow to.
        desired: usize,
    },
    /// The call failed without a trap; for example the guest's answer could not be read
    /// (a string that is not UTF-8, an out-of-range variant).
    #[error("policy call failed")]
    Call {
        /// wasmtime's error.
        #[source]
        source: BoxError,
    },
    /// The guest answered a decision that breaks the contract's rules.
    #[error("policy answered an invalid decision: {0}")]
    Invalid(#[from] InvalidDecision),
    /// A component that declares itself stateless ([`crate::STATELESS_SECTION`]) answered a
    /// smoke-test case differently when asked again in the same instance.
    #[error(
        "the component declares itself stateless but answered the same call differently the \
         second time: {first:?}, then {again:?}"
    )]
    NotStateless {
        /// The first answer.
        first: Box<crate::Decision>,
        /// The answer to the same call, in the same instance, later.
        again: Box<crate::Decision>,
    },
    /// No native policy has this name.
    #[error("no native policy is named {name:?} (known: least-loaded, round-robin, prefix-aware)")]
    UnknownNative {
        /// The name asked for.
        name: String,
    },
    /// [`crate::PolicySlot::rollback`] with no previous policy.
    #[error("no previous policy to roll back to")]
    NothingToRollBack,
}

/// The [`PolicyError::reason`] labels a decision call can fail with (a pool slot not free, a
/// trap, the deadline, fuel, memory, an unreadable answer, a decision breaking the contract):
/// the gateway starts its failure and fallback counters at 0 for each.
pub const CALL_FAILURE_REASONS: [&str; 7] = [
    "instantiate",
    "trap",
    "timeout",
    "out_of_fuel",
    "memory",
    "call",
    "invalid_decision",
];

impl PolicyError {
    /// A short, fixed label for metrics: `engine`, `memory_limit_too_large`, `compile`,
    /// `instantiate`, `smoke_test`, `trap`, `timeout`, `out_of_fuel`, `memory`, `call`,
    /// `invalid_decision`, `not_stateless`, `unknown_native`, `nothing_to_roll_back`.
    pub fn reason(&self) -> &'static str {
        match self {
            PolicyError::Engine { .. } => "engine",
            PolicyError::CacheDir(_) => "cache_dir",
            PolicyError::MemoryLimitTooLarge { .. } => "memory_limit_too_large",
            PolicyError::TooManySpares { .. } => "too_many_spares",
            PolicyError::Compile { .. } => "compile",
            PolicyError::Instantiate { .. } => "instantiate",
            PolicyError::SmokeTest { .. } => "smoke_test",
            PolicyError::Trap { .. } => "trap",
            PolicyError::Timeout { .. } => "timeout",
            PolicyError::OutOfFuel { .. } => "out_of_fuel",
            PolicyError::MemoryLimit { .. } => "memory",
            PolicyError::Call { .. } => "call",
            PolicyError::Invalid(_) => "invalid_decision",
            PolicyError::NotStateless { .. } => "not_stateless",
            PolicyError::UnknownNative { .. } => "unknown_native",
            PolicyError::NothingToRollBack => "nothing_to_roll_back",
        }
    }
}
