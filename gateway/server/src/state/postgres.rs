//! The shared state store: PostgreSQL (`--state-url postgres://…`), for several gateways at
//! once. Chosen over Redis because what it keeps must survive: a commit is on disk (fsync)
//! before it returns, where Redis's default snapshots lose the last minutes; a push's
//! generation is assigned in one atomic statement; `LISTEN`/`NOTIFY` tells every replica of a
//! change when it commits; and operators already back it up and run it highly available.
//!
//! Tables (created at connect, `pd_` prefixed): `pd_meta` (schema version, cluster token),
//! `pd_policy` (one row: generation, record), `pd_components` (sha256 → bytes: those the policy
//! names, and those added in the last hour, which a replica's push in flight may name), `pd_turns`
//! (id, stored ms, bytes, record), `pd_drains` (engine id). Every change other replicas must
//! apply is announced on the channel [`CHANNEL`] ([`Change`]).
//!
//! One connection serves calls (re-made when it breaks; each call bounded by [`CALL_TIMEOUT`]),
//! another listens ([`Postgres::listen`], re-made with backoff; after a gap it announces
//! [`Change::Resync`], as notifications may have been missed).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::{Mutex, broadcast};
use tokio_postgres::{AsyncMessage, Client, Config, NoTls};
use tracing::{info, warn};

use super::pg_tls::Rustls;
use super::{Backend, Change, PolicyRecord, SCHEMA_VERSION, StateError, TurnRecord};

/// A connection's messages (notifications, and the end of the connection); polling them drives
/// the connection.
type Messages = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<AsyncMessage, tokio_postgres::Error>> + Send>,
>;

/// Connects, over TLS when `tls` is given (what `sslmode` then asks for).
async fn open(
    config: &Config,
    tls: Option<&Rustls>,
) -> Result<(Client, Messages), tokio_postgres::Error> {
    match tls {
        None => {
            let (c, mut conn) = config.connect(NoTls).await?;
            Ok((
                c,
                Box::pin(futures::stream::poll_fn(move |cx| conn.poll_message(cx))),
            ))
        }
        Some(t) => {
            let (c, mut conn) = config.connect(t.clone()).await?;
            Ok((
                c,
                Box::pin(futures::stream::poll_fn(move |cx| conn.poll_message(cx))),
            ))
        }
    }
}

/// The notification channel.
pub const CHANNEL: &str = "pd_state";
/// How long one call to the store may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a component nothing names is kept (a replica's push may be about to name it).
const COMPONENT_GRACE_MS: i64 = 3_600_000;
/// The longest notification payload sent (PostgreSQL's limit is 8000 bytes).
const MAX_PAYLOAD: usize = 7000;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS pd_meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS pd_policy (id int PRIMARY KEY CHECK (id = 1), generation bigint NOT NULL, record bytea NOT NULL);
CREATE TABLE IF NOT EXISTS pd_components (sha256 text PRIMARY KEY, bytes bytea NOT NULL, added_ms bigint NOT NULL);
CREATE TABLE IF NOT EXISTS pd_turns (id text PRIMARY KEY, stored_ms bigint NOT NULL, bytes bigint NOT NULL, record bytea NOT NULL);
CREATE INDEX IF NOT EXISTS pd_turns_stored_ms ON pd_turns (stored_ms);
CREATE TABLE IF NOT EXISTS pd_drains (engine_id text PRIMARY KEY, since_ms bigint NOT NULL);
";

/// The PostgreSQL store ([module docs](self)).
pub struct Postgres {
    config: Config,
    /// TLS to the database (`--state-tls-ca`); none: plain.
    tls: Option<Rustls>,
    /// Where it is, for logs (no password).
    target: String,
    /// One connection for the requests' calls (turns), one for everything else (the policy
    /// and its components, drains, sweeps): a 17 MiB component written must not hold up the
    /// turn a request waits on (statements on one connection run one after another).
    clients: [Mutex<Option<Arc<Client>>>; 2],
    changes: broadcast::Sender<Change>,
}

/// Which connection a call takes ([`Postgres::clients`]).
#[derive(Debug, Clone, Copy)]
enum Lane {
    Turns = 0,
    Admin = 1,
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres")
            .field("target", &self.target)
            .finish()
    }
}

fn pg(e: tokio_postgres::Error) -> StateError {
    StateError::backend(e)
}

fn decode<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, StateError> {
    serde_json::from_slice(bytes).map_err(|source| StateError::Decode {
        key: key.to_owned(),
        source,
    })
}

/// What a notification's payload announces.
fn parse(payload: &str) -> Option<Change> {
    match payload.split_once(':') {
        Some(("turns", ids)) => Some(Change::Turns(
            ids.split('\n')
                .filter(|i| !i.is_empty())
                .map(str::to_owned)
                .collect(),
        )),
        _ => match payload {
            "policy" => Some(Change::Policy),
            "drains" => Some(Change::Drains),
            _ => None,
        },
    }
}

impl Postgres {
    /// Connects to `url` (a libpq URL or `key=value` string; with `tls`, TLS as its `sslmode`
    /// says, `prefer` by default), creates the tables, checks the schema version.
    ///
    /// # Errors
    /// [`StateError`] when the URL does not parse, the server does not answer, or a newer
    /// gateway wrote the store.
    pub async fn connect(url: &str, tls: Option<Rustls>) -> Result<Self, StateError> {
        let mut config: Config = url
            .parse()
            .map_err(|e| StateError::backend(format!("--state-url: {e}")))?;
        config.connect_timeout(CALL_TIMEOUT);
        let target = format!(
            "postgres {:?}:{:?}/{}",
            config.get_hosts(),
            config.get_ports(),
            config.get_dbname().unwrap_or("")
        );
        let store = Postgres {
            config,
            tls,
            target,
            clients: [Mutex::new(None), Mutex::new(None)],
            changes: broadcast::channel(1024).0,
        };
        let c = store.client(Lane::Admin).await?;
        timed(c.batch_execute(SCHEMA)).await?;
        timed(c.execute(
            "INSERT INTO pd_meta (key, value) VALUES ('schema_version', $1) ON CONFLICT DO NOTHING",
            &[&SCHEMA_VERSION.to_string()],
        ))
        .await?;
        let found = timed(c.query_one(
            "SELECT value FROM pd_meta WHERE key = 'schema_version'",
            &[],
        ))
        .await?;
        let found: u32 = found.get::<_, String>(0).parse().unwrap_or(u32::MAX);
        if found > SCHEMA_VERSION {
            return Err(StateError::TooNew {
                found,
                ours: SCHEMA_VERSION,
            });
        }
        Ok(store)
    }

    /// The calls' connection, made again when it broke.
    async fn client(&self, lane: Lane) -> Result<Arc<Client>, StateError> {
        let mut slot = self.clients[lane as usize].lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let (client, mut messages) = timed(open(&self.config, self.tls.as_ref())).await?;
        tokio::spawn(async move {
            while let Some(m) = messages.next().await {
                if let Err(e) = m {
                    warn!(error = %e, "state store connection ended");
                    return;
                }
            }
        });
        let client = Arc::new(client);
        *slot = Some(client.clone());
        Ok(client)
    }

    /// Announces `payload` to every gateway listening (this one included).
    async fn notify(&self, c: &Client, payload: &str) -> Result<(), StateError> {
        timed(c.execute("SELECT pg_notify($1, $2)", &[&CHANNEL, &payload]))
            .await
            .map(|_| ())
    }

    /// Listens for changes until the process ends, reconnecting with backoff; sends each to
    /// [`Backend::changes`]' receivers.
    async fn listen_forever(self: Arc<Self>) {
        let mut delay = Duration::from_millis(100);
        let mut first = true;
        loop {
            match open(&self.config, self.tls.as_ref()).await {
                Ok((client, messages)) => {
                    let (tx, mut rx) = futures::channel::mpsc::unbounded();
                    let driver = messages.map(Ok).forward(tx);
                    let driver = tokio::spawn(driver);
                    match client.batch_execute(&format!("LISTEN {CHANNEL}")).await {
                        Ok(()) => {
                            info!(store = %self.target, "listening for state changes");
                            delay = Duration::from_millis(100);
                            if !first {
                                let _ = self.changes.send(Change::Resync);
                            }
                            first = false;
                            use futures::StreamExt;
                            while let Some(m) = rx.next().await {
                                match m {
                                    Ok(AsyncMessage::Notification(n)) => {
                                        if let Some(change) = parse(n.payload()) {
                                            let _ = self.changes.send(change);
                                        }
                                    }
                                    Ok(_) => {}
                                    Err(e) => {
                                        warn!(error = %e, "state store listener broke");
                                        break;
                                    }
                                }
                            }
                        }
                        Err(e) => warn!(error = %e, "LISTEN failed"),
                    }
                    driver.abort();
                }
                Err(e) => warn!(error = %e, store = %self.target, "state store unreachable"),
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }
}

use futures::StreamExt as _;

/// `f` within [`CALL_TIMEOUT`].
async fn timed<T>(
    f: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, StateError> {
    match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(r) => r.map_err(pg),
        Err(_) => Err(StateError::backend(format!(
            "no answer within {CALL_TIMEOUT:?}"
        ))),
    }
}

#[async_trait]
impl Backend for Postgres {
    fn describe(&self) -> String {
        self.target.clone()
    }

    fn changes(&self) -> Option<broadcast::Receiver<Change>> {
        Some(self.changes.subscribe())
    }

    fn listener(self: Arc<Self>) -> Option<BoxFuture<'static, ()>> {
        Some(self.listen_forever().boxed())
    }

    async fn put_turn(&self, id: &str, turn: &TurnRecord) -> Result<(), StateError> {
        let record = serde_json::to_vec(turn).expect("state records serialize");
        let c = self.client(Lane::Turns).await?;
        timed(c.execute(
            "INSERT INTO pd_turns (id, stored_ms, bytes, record) VALUES ($1, $2, $3, $4)
             ON CONFLICT (id) DO UPDATE SET stored_ms = $2, bytes = $3, record = $4",
            &[
                &id,
                &(turn.stored_unix_ms as i64),
                &(record.len() as i64),
                &record,
            ],
        ))
        .await
        .map(|_| ())
    }

    async fn turn(&self, id: &str) -> Result<Option<TurnRecord>, StateError> {
        let c = self.client(Lane::Turns).await?;
        let row = timed(c.query_opt("SELECT record FROM pd_turns WHERE id = $1", &[&id])).await?;
        row.map(|r| decode(id, r.get::<_, &[u8]>(0))).transpose()
    }

    async fn delete_turns(&self, ids: &[String]) -> Result<(), StateError> {
        if ids.is_empty() {
            return Ok(());
        }
        let c = self.client(Lane::Turns).await?;
        timed(c.execute("DELETE FROM pd_turns WHERE id = ANY($1)", &[&ids])).await?;
        // Other replicas may hold them in memory.
        let mut payload = String::from("turns:");
        for id in ids {
            if payload.len() + id.len() + 1 > MAX_PAYLOAD {
                self.notify(&c, &payload).await?;
                payload.truncate("turns:".len());
            }
            payload.push_str(id);
            payload.push('\n');
        }
        self.notify(&c, &payload).await
    }

    async fn sweep_turns(&self, unix_ms: u64, max_bytes: u64) -> Result<u64, StateError> {
        let c = self.client(Lane::Admin).await?;
        let old = timed(c.execute(
            "DELETE FROM pd_turns WHERE stored_ms < $1",
            &[&(unix_ms as i64)],
        ))
        .await?;
        let over = timed(c.execute(
            // SUM of a bigint is a numeric: cast back, so that $1 is a bigint.
            "DELETE FROM pd_turns WHERE id IN (SELECT id FROM (SELECT id, (SUM(bytes) OVER
             (ORDER BY stored_ms DESC, id))::bigint AS kept FROM pd_turns) t WHERE kept > $1)",
            &[&(max_bytes.min(i64::MAX as u64) as i64)],
        ))
        .await?;
        Ok(old + over)
    }

    async fn policy(&self) -> Result<Option<PolicyRecord>, StateError> {
        let c = self.client(Lane::Admin).await?;
        let row = timed(c.query_opt("SELECT generation, record FROM pd_policy WHERE id = 1", &[]))
            .await?;
        row.map(|r| {
            let mut rec: PolicyRecord = decode("policy", r.get::<_, &[u8]>(1))?;
            rec.generation = r.get::<_, i64>(0) as u64;
            Ok(rec)
        })
        .transpose()
    }

    async fn put_policy(
        &self,
        record: &PolicyRecord,
        components: &[(String, Vec<u8>)],
    ) -> Result<u64, StateError> {
        let c = self.client(Lane::Admin).await?;
        let now = super::unix_ms() as i64;
        for (sha, bytes) in components {
            timed(c.execute(
                "INSERT INTO pd_components (sha256, bytes, added_ms) VALUES ($1, $2, $3)
                 ON CONFLICT (sha256) DO UPDATE SET added_ms = $3",
                &[sha, bytes, &now],
            ))
            .await?;
        }
        let bytes = serde_json::to_vec(record).expect("state records serialize");
        // The generation is the store's: one past the stored one, in one statement, so two
        // replicas saving at once get two generations and the later one is what all serve.
        let row = timed(c.query_one(
            "INSERT INTO pd_policy (id, generation, record) VALUES (1, 1, $1)
             ON CONFLICT (id) DO UPDATE SET generation = pd_policy.generation + 1, record = $1
             RETURNING generation",
            &[&bytes],
        ))
        .await?;
        self.notify(&c, "policy").await?;
        // Components nothing serves any more go, once no push in flight can name them.
        let keep: Vec<String> = record.components().into_iter().map(str::to_owned).collect();
        timed(c.execute(
            "DELETE FROM pd_components WHERE sha256 <> ALL($1) AND added_ms < $2",
            &[&keep, &(now - COMPONENT_GRACE_MS)],
        ))
        .await?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    async fn component(&self, sha256: &str) -> Result<Option<Vec<u8>>, StateError> {
        let c = self.client(Lane::Admin).await?;
        let row = timed(c.query_opt(
            "SELECT bytes FROM pd_components WHERE sha256 = $1",
            &[&sha256],
        ))
        .await?;
        Ok(row.map(|r| r.get::<_, Vec<u8>>(0)))
    }

    async fn drains(&self) -> Result<Vec<String>, StateError> {
        let c = self.client(Lane::Admin).await?;
        let rows =
            timed(c.query("SELECT engine_id FROM pd_drains ORDER BY engine_id", &[])).await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect())
    }

    async fn set_drain(&self, engine_id: &str, on: bool) -> Result<(), StateError> {
        let c = self.client(Lane::Admin).await?;
        if on {
            timed(c.execute(
                "INSERT INTO pd_drains (engine_id, since_ms) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                &[&engine_id, &(super::unix_ms() as i64)],
            ))
            .await?;
        } else {
            timed(c.execute("DELETE FROM pd_drains WHERE engine_id = $1", &[&engine_id])).await?;
        }
        self.notify(&c, "drains").await
    }

    async fn cluster_token(&self, minted: &str) -> Result<String, StateError> {
        let c = self.client(Lane::Admin).await?;
        timed(c.execute(
            "INSERT INTO pd_meta (key, value) VALUES ('cluster_token', $1) ON CONFLICT DO NOTHING",
            &[&minted],
        ))
        .await?;
        let row = timed(c.query_one("SELECT value FROM pd_meta WHERE key = 'cluster_token'", &[]))
            .await?;
        Ok(row.get(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_parse() {
        assert!(matches!(parse("policy"), Some(Change::Policy)));
        assert!(matches!(parse("drains"), Some(Change::Drains)));
        match parse("turns:a\nb\n") {
            Some(Change::Turns(ids)) => assert_eq!(ids, ["a", "b"]),
            other => panic!("{other:?}"),
        }
        assert!(parse("other").is_none());
    }
}
