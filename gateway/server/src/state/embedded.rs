//! The embedded state store: one redb file (`state.redb`) in `--state-dir`, ACID and crash-safe
//! (a commit is on disk when it returns), readable by one gateway process at a time. Calls run
//! on tokio's blocking pool.
//!
//! Tables: `meta` (schema version, the policy record, the cluster token, bytes of turns),
//! `turns` (id → JSON), `turns_by_time` ((stored ms, id) → bytes, for the sweep),
//! `components` (sha256 → bytes), `drains` (engine id → ms since the epoch).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Backend, PolicyRecord, SCHEMA_VERSION, StateError, TurnRecord, unix_ms};

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const TURNS: TableDefinition<&str, &[u8]> = TableDefinition::new("turns");
const TURNS_BY_TIME: TableDefinition<(u64, &str), u64> = TableDefinition::new("turns_by_time");
const COMPONENTS: TableDefinition<&str, &[u8]> = TableDefinition::new("components");
const DRAINS: TableDefinition<&str, u64> = TableDefinition::new("drains");

const SCHEMA_KEY: &str = "schema_version";
const POLICY_KEY: &str = "policy";
const TOKEN_KEY: &str = "cluster_token";
const TURN_BYTES_KEY: &str = "turn_bytes";

/// The file in `--state-dir`.
pub const FILE_NAME: &str = "state.redb";

/// The redb store ([module docs](self)).
#[derive(Clone)]
pub struct Embedded {
    db: Arc<Database>,
    path: PathBuf,
}

impl std::fmt::Debug for Embedded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedded")
            .field("path", &self.path)
            .finish()
    }
}

fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, StateError> {
    serde_json::from_slice(bytes).map_err(|source| StateError::Decode {
        key: key.to_owned(),
        source,
    })
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("state records serialize")
}

fn read_u64(bytes: Option<&[u8]>) -> u64 {
    bytes
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_le_bytes)
}

impl Embedded {
    /// Opens (or creates) `dir/state.redb`: the directory private (0700), the file 0600 (it
    /// may hold the cluster token). Checks the schema version.
    ///
    /// # Errors
    /// [`StateError::Backend`] when the directory or file cannot be made or opened (another
    /// gateway holding it included), [`StateError::TooNew`] for a store of a newer gateway.
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| StateError::backend(format!("creating {}: {e}", dir.display())))?;
        let path = dir.join(FILE_NAME);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| StateError::backend(format!("opening {}: {e}", path.display())))?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| StateError::backend(format!("{}: {e}", path.display())))?;
        drop(file);
        let db = Database::builder()
            .set_check_integrity_on_open(true)
            .create(&path)
            .map_err(|e| StateError::backend(format!("{}: {e}", path.display())))?;
        let store = Embedded {
            db: Arc::new(db),
            path,
        };
        store.check_schema()?;
        Ok(store)
    }

    /// Creates the tables, records the schema version of a new store, refuses a newer one.
    fn check_schema(&self) -> Result<(), StateError> {
        let w = self.db.begin_write().map_err(StateError::backend)?;
        {
            let mut meta = w.open_table(META).map_err(StateError::backend)?;
            let found = meta
                .get(SCHEMA_KEY)
                .map_err(StateError::backend)?
                .map(|v| decode::<u32>(SCHEMA_KEY, v.value()))
                .transpose()?;
            match found {
                Some(v) if v > SCHEMA_VERSION => {
                    return Err(StateError::TooNew {
                        found: v,
                        ours: SCHEMA_VERSION,
                    });
                }
                Some(_) => {}
                None => {
                    meta.insert(SCHEMA_KEY, encode(&SCHEMA_VERSION).as_slice())
                        .map_err(StateError::backend)?;
                }
            }
            for t in [TURNS, COMPONENTS] {
                w.open_table(t).map_err(StateError::backend)?;
            }
            w.open_table(TURNS_BY_TIME).map_err(StateError::backend)?;
            w.open_table(DRAINS).map_err(StateError::backend)?;
        }
        w.commit().map_err(StateError::backend)
    }

    /// Runs `f` on the blocking pool with the database.
    async fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Database) -> Result<R, StateError> + Send + 'static,
    ) -> Result<R, StateError> {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || f(&db))
            .await
            .map_err(StateError::backend)?
    }
}

/// Removes turn `id` from both turn tables; returns its bytes.
fn remove_turn(
    turns: &mut redb::Table<&str, &[u8]>,
    by_time: &mut redb::Table<(u64, &str), u64>,
    id: &str,
) -> Result<u64, StateError> {
    let Some(old) = turns.remove(id).map_err(StateError::backend)? else {
        return Ok(0);
    };
    let bytes = old.value().len() as u64;
    if let Ok(t) = decode::<TurnRecord>(id, old.value()) {
        by_time
            .remove((t.stored_unix_ms, id))
            .map_err(StateError::backend)?;
    }
    Ok(bytes)
}

fn add_turn_bytes(meta: &mut redb::Table<&str, &[u8]>, delta: i64) -> Result<(), StateError> {
    let now = read_u64(
        meta.get(TURN_BYTES_KEY)
            .map_err(StateError::backend)?
            .as_ref()
            .map(|v| v.value()),
    );
    let next = now.saturating_add_signed(delta);
    meta.insert(TURN_BYTES_KEY, next.to_le_bytes().as_slice())
        .map_err(StateError::backend)?;
    Ok(())
}

#[async_trait]
impl Backend for Embedded {
    fn describe(&self) -> String {
        format!("embedded {}", self.path.display())
    }

    async fn put_turn(&self, id: &str, turn: &TurnRecord) -> Result<(), StateError> {
        let (id, bytes, stored) = (id.to_owned(), encode(turn), turn.stored_unix_ms);
        self.run(move |db| {
            let w = db.begin_write().map_err(StateError::backend)?;
            {
                let mut turns = w.open_table(TURNS).map_err(StateError::backend)?;
                let mut by_time = w.open_table(TURNS_BY_TIME).map_err(StateError::backend)?;
                let mut meta = w.open_table(META).map_err(StateError::backend)?;
                let old = remove_turn(&mut turns, &mut by_time, &id)?;
                turns
                    .insert(id.as_str(), bytes.as_slice())
                    .map_err(StateError::backend)?;
                by_time
                    .insert((stored, id.as_str()), bytes.len() as u64)
                    .map_err(StateError::backend)?;
                add_turn_bytes(&mut meta, bytes.len() as i64 - old as i64)?;
            }
            w.commit().map_err(StateError::backend)
        })
        .await
    }

    async fn turn(&self, id: &str) -> Result<Option<TurnRecord>, StateError> {
        let id = id.to_owned();
        self.run(move |db| {
            let r = db.begin_read().map_err(StateError::backend)?;
            let turns = r.open_table(TURNS).map_err(StateError::backend)?;
            turns
                .get(id.as_str())
                .map_err(StateError::backend)?
                .map(|v| decode(&id, v.value()))
                .transpose()
        })
        .await
    }

    async fn delete_turns(&self, ids: &[String]) -> Result<(), StateError> {
        if ids.is_empty() {
            return Ok(());
        }
        let ids = ids.to_vec();
        self.run(move |db| {
            let w = db.begin_write().map_err(StateError::backend)?;
            {
                let mut turns = w.open_table(TURNS).map_err(StateError::backend)?;
                let mut by_time = w.open_table(TURNS_BY_TIME).map_err(StateError::backend)?;
                let mut meta = w.open_table(META).map_err(StateError::backend)?;
                let mut freed = 0u64;
                for id in &ids {
                    freed += remove_turn(&mut turns, &mut by_time, id)?;
                }
                add_turn_bytes(&mut meta, -(freed as i64))?;
            }
            w.commit().map_err(StateError::backend)
        })
        .await
    }

    async fn sweep_turns(&self, unix_ms: u64, max_bytes: u64) -> Result<u64, StateError> {
        self.run(move |db| {
            let w = db.begin_write().map_err(StateError::backend)?;
            let mut gone = 0u64;
            {
                let mut turns = w.open_table(TURNS).map_err(StateError::backend)?;
                let mut by_time = w.open_table(TURNS_BY_TIME).map_err(StateError::backend)?;
                let mut meta = w.open_table(META).map_err(StateError::backend)?;
                let mut held = read_u64(
                    meta.get(TURN_BYTES_KEY)
                        .map_err(StateError::backend)?
                        .as_ref()
                        .map(|v| v.value()),
                );
                let mut freed = 0u64;
                loop {
                    let first = by_time.first().map_err(StateError::backend)?.map(|(k, _)| {
                        let (at, id) = k.value();
                        (at, id.to_owned())
                    });
                    let Some((at, id)) = first else { break };
                    if at >= unix_ms && held <= max_bytes {
                        break;
                    }
                    by_time
                        .remove((at, id.as_str()))
                        .map_err(StateError::backend)?;
                    let bytes = turns
                        .remove(id.as_str())
                        .map_err(StateError::backend)?
                        .map_or(0, |v| v.value().len() as u64);
                    held = held.saturating_sub(bytes);
                    freed += bytes;
                    gone += 1;
                }
                add_turn_bytes(&mut meta, -(freed as i64))?;
            }
            w.commit().map_err(StateError::backend)?;
            Ok(gone)
        })
        .await
    }

    async fn policy(&self) -> Result<Option<PolicyRecord>, StateError> {
        self.run(|db| {
            let r = db.begin_read().map_err(StateError::backend)?;
            let meta = r.open_table(META).map_err(StateError::backend)?;
            meta.get(POLICY_KEY)
                .map_err(StateError::backend)?
                .map(|v| decode(POLICY_KEY, v.value()))
                .transpose()
        })
        .await
    }

    async fn put_policy(
        &self,
        record: &PolicyRecord,
        components: &[(String, Vec<u8>)],
    ) -> Result<u64, StateError> {
        let (record, components) = (record.clone(), components.to_vec());
        self.run(move |db| {
            let w = db.begin_write().map_err(StateError::backend)?;
            let generation;
            {
                let mut stored = w.open_table(COMPONENTS).map_err(StateError::backend)?;
                for (sha, bytes) in &components {
                    if stored
                        .get(sha.as_str())
                        .map_err(StateError::backend)?
                        .is_none()
                    {
                        stored
                            .insert(sha.as_str(), bytes.as_slice())
                            .map_err(StateError::backend)?;
                    }
                }
                let mut meta = w.open_table(META).map_err(StateError::backend)?;
                let last = meta
                    .get(POLICY_KEY)
                    .map_err(StateError::backend)?
                    .map(|v| decode::<PolicyRecord>(POLICY_KEY, v.value()))
                    .transpose()?;
                generation = last.map_or(1, |l| l.generation + 1);
                let record = PolicyRecord {
                    generation,
                    ..record
                };
                meta.insert(POLICY_KEY, encode(&record).as_slice())
                    .map_err(StateError::backend)?;
                // Only what the slot can serve is kept.
                let keep = record.components();
                stored
                    .retain(|sha, _| keep.contains(&sha))
                    .map_err(StateError::backend)?;
            }
            w.commit().map_err(StateError::backend)?;
            Ok(generation)
        })
        .await
    }

    async fn component(&self, sha256: &str) -> Result<Option<Vec<u8>>, StateError> {
        let sha = sha256.to_owned();
        self.run(move |db| {
            let r = db.begin_read().map_err(StateError::backend)?;
            let t = r.open_table(COMPONENTS).map_err(StateError::backend)?;
            Ok(t.get(sha.as_str())
                .map_err(StateError::backend)?
                .map(|v| v.value().to_vec()))
        })
        .await
    }

    async fn drains(&self) -> Result<Vec<String>, StateError> {
        self.run(|db| {
            let r = db.begin_read().map_err(StateError::backend)?;
            let t = r.open_table(DRAINS).map_err(StateError::backend)?;
            let mut out = Vec::new();
            for e in t.iter().map_err(StateError::backend)? {
                let (k, _) = e.map_err(StateError::backend)?;
                out.push(k.value().to_owned());
            }
            Ok(out)
        })
        .await
    }

    async fn set_drain(&self, engine_id: &str, on: bool) -> Result<(), StateError> {
        let id = engine_id.to_owned();
        self.run(move |db| {
            let w = db.begin_write().map_err(StateError::backend)?;
            {
                let mut t = w.open_table(DRAINS).map_err(StateError::backend)?;
                if on {
                    t.insert(id.as_str(), unix_ms())
                        .map_err(StateError::backend)?;
                } else {
                    t.remove(id.as_str()).map_err(StateError::backend)?;
                }
            }
            w.commit().map_err(StateError::backend)
        })
        .await
    }

    async fn cluster_token(&self, minted: &str) -> Result<String, StateError> {
        let minted = minted.to_owned();
        self.run(move |db| {
            let w = db.begin_write().map_err(StateError::backend)?;
            let token = {
                let mut meta = w.open_table(META).map_err(StateError::backend)?;
                let stored = meta
                    .get(TOKEN_KEY)
                    .map_err(StateError::backend)?
                    .map(|v| String::from_utf8_lossy(v.value()).into_owned());
                match stored {
                    Some(t) if !t.is_empty() => t,
                    _ => {
                        meta.insert(TOKEN_KEY, minted.as_bytes())
                            .map_err(StateError::backend)?;
                        minted
                    }
                }
            };
            w.commit().map_err(StateError::backend)?;
            Ok(token)
        })
        .await
    }
}

#[cfg(test)]
mod tests;
