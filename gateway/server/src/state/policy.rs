//! The policy slot as stored: what an install or rollback saves ([`record_of`]), and the slot
//! a start rebuilds from it ([`restore`]).

use std::time::Duration;

use pd_policy::{Installed, PolicyEngine, PolicySpec};

use super::{PolicyEntry, PolicyRecord, State, StateError, unix_ms};

/// What a stored policy could not be brought back as.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The store did not answer.
    #[error(transparent)]
    State(#[from] StateError),
    /// The record names a component the store does not hold.
    #[error("the stored policy's component {0} is missing from the state store")]
    MissingComponent(String),
    /// The stored component no longer loads (a gateway that refuses what an earlier one took).
    #[error("the stored policy {name} ({sha256}) does not load: {error}")]
    Load {
        /// Its name.
        name: String,
        /// Its sha256.
        sha256: String,
        /// Why.
        error: pd_policy::PolicyError,
    },
}

/// `p` as a record entry.
pub fn entry_of(p: &Installed) -> PolicyEntry {
    match p {
        Installed::Native { name } => PolicyEntry::Native { name: name.clone() },
        Installed::Wasm(w) => {
            let spec = w.spec();
            PolicyEntry::Wasm {
                sha256: w.sha256().to_owned(),
                name: spec.name.clone(),
                config: spec.config.clone(),
                deadline_us: spec.deadline.as_micros() as u64,
                memory_limit: spec.memory_limit,
                fuel: spec.fuel,
                spares: spec.spares,
            }
        }
    }
}

/// The record of a slot serving `current` with `previous` as its rollback target (its
/// generation is the store's to assign).
pub fn record_of(
    current: &Installed,
    previous: Option<&Installed>,
    file_sha256: Option<String>,
) -> PolicyRecord {
    PolicyRecord {
        generation: 0,
        current: entry_of(current),
        previous: previous.map(entry_of),
        saved_unix_ms: unix_ms(),
        file_sha256,
    }
}

/// The policy `entry` names, loaded (its component read from `state`).
///
/// # Errors
/// [`RestoreError`] when the component is missing or does not load.
pub async fn load(
    state: &State,
    engine: &PolicyEngine,
    entry: &PolicyEntry,
) -> Result<Installed, RestoreError> {
    match entry {
        PolicyEntry::Native { name } => Ok(Installed::Native { name: name.clone() }),
        PolicyEntry::Wasm {
            sha256,
            name,
            config,
            deadline_us,
            memory_limit,
            fuel,
            spares,
        } => {
            let bytes = state
                .component(sha256)
                .await?
                .ok_or_else(|| RestoreError::MissingComponent(sha256.clone()))?;
            let spec = PolicySpec {
                name: name.clone(),
                config: config.clone(),
                deadline: Duration::from_micros(*deadline_us),
                memory_limit: *memory_limit,
                fuel: *fuel,
                spares: *spares,
            };
            let engine = engine.clone();
            let loaded = tokio::task::spawn_blocking(move || engine.load(&bytes, spec))
                .await
                .map_err(StateError::backend)?;
            loaded
                .map(Installed::Wasm)
                .map_err(|error| RestoreError::Load {
                    name: name.clone(),
                    sha256: sha256.clone(),
                    error,
                })
        }
    }
}

/// The slot's two policies as `record` stores them. A rollback target that no longer loads is
/// dropped (logged): the serving policy matters, the target is a convenience.
///
/// # Errors
/// [`RestoreError`] when the serving policy cannot be brought back.
pub async fn restore(
    state: &State,
    engine: &PolicyEngine,
    record: &PolicyRecord,
) -> Result<(Installed, Option<Installed>), RestoreError> {
    let current = load(state, engine, &record.current).await?;
    let previous = match &record.previous {
        Some(p) => match load(state, engine, p).await {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(error = %e, "the stored rollback target is not restored");
                None
            }
        },
        None => None,
    };
    Ok((current, previous))
}

/// Saves the policy slot to the state store at every install and rollback, one at a time
/// ([`PolicyKeeper::lock`] is held across the save and the slot's change, so the store and the
/// slot change in the same order).
#[derive(Debug, Clone)]
pub struct PolicyKeeper {
    state: State,
    /// The `--policy` file, whose sha256 each record notes ([`PolicyRecord::file_sha256`]).
    file: Option<std::path::PathBuf>,
    lock: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// The generation the slot serves now (saved here, or applied from the store).
    applied: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl PolicyKeeper {
    /// A keeper saving to `state`, noting `file`'s content in each record.
    pub fn new(state: State, file: Option<std::path::PathBuf>) -> Self {
        Self {
            state,
            file,
            lock: std::sync::Arc::default(),
            applied: std::sync::Arc::default(),
        }
    }

    /// The store this keeper saves to.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// The generation the slot serves now.
    pub fn applied(&self) -> u64 {
        self.applied.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records that the slot serves `generation` now.
    pub fn set_applied(&self, generation: u64) {
        self.applied
            .store(generation, std::sync::atomic::Ordering::Release);
    }

    /// Held from before a save to after the slot changed.
    pub async fn lock(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.lock.clone().lock_owned().await
    }

    /// Saves a slot serving `current` with `previous` as its rollback target; `component` is
    /// `current`'s bytes when it was just pushed.
    ///
    /// # Errors
    /// [`StateError`] when the store does not answer: the caller leaves the slot as it was.
    pub async fn save(
        &self,
        current: &Installed,
        previous: Option<&Installed>,
        component: Option<Vec<u8>>,
    ) -> Result<u64, StateError> {
        let record = record_of(current, previous, file_sha256(self.file.as_deref()));
        let components: Vec<(String, Vec<u8>)> = match (current.sha256(), component) {
            (Some(sha), Some(bytes)) => vec![(sha.to_owned(), bytes)],
            _ => Vec::new(),
        };
        let generation = self.state.put_policy(&record, &components).await?;
        self.set_applied(generation);
        Ok(generation)
    }
}

/// The hex sha256 of `file`'s content; none without a file or when it cannot be read.
pub fn file_sha256(file: Option<&std::path::Path>) -> Option<String> {
    use sha2::Digest;
    let bytes = std::fs::read(file?).ok()?;
    Some(hex::encode(sha2::Sha256::digest(&bytes)))
}
