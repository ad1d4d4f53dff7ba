//! What a gateway with `--state-dir` brings back at start: the minted cluster token, the
//! policy slot, the operator's drains; and the sweep that keeps stored responses within their
//! age and bytes.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use pd_gateway::cluster::Cluster;
use pd_gateway::state::policy::{self, file_sha256};
use pd_gateway::state::{self as st, State};
use pd_policy::{Installed, PolicyEngine, PolicySlot};
use tracing::{info, warn};

/// How often stored responses past their age or the store's bytes are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// A runtime for the start's few calls (the control runtime does not exist yet).
fn block_on<F: std::future::Future>(f: F) -> anyhow::Result<F::Output> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("a runtime to read the state store")?;
    Ok(rt.block_on(f))
}

/// The embedded store in `dir`, or the shared one at `url` (over TLS trusting `ca` when given),
/// if either is given.
pub(crate) fn open(
    dir: Option<&Path>,
    url: Option<&str>,
    ca: Option<&Path>,
) -> anyhow::Result<Option<State>> {
    let tls = ca
        .map(|ca| {
            pd_tls::client_trusting(ca)
                .map(|c| st::pg_tls::Rustls(std::sync::Arc::new(c)))
                .with_context(|| format!("--state-tls-ca {}", ca.display()))
        })
        .transpose()?;
    let state: State = match (dir, url) {
        (Some(dir), _) => std::sync::Arc::new(
            st::embedded::Embedded::open(dir)
                .with_context(|| format!("--state-dir {}", dir.display()))?,
        ),
        (None, Some(url)) => std::sync::Arc::new(
            block_on(st::postgres::Postgres::connect(url, tls))?
                .context("--state-url: connecting to the shared state store")?,
        ),
        (None, None) => return Ok(None),
    };
    info!(store = %state.describe(), "state store open");
    Ok(Some(state))
}

/// The cluster token: the one the store keeps, else `minted` (kept from now on).
pub(crate) fn cluster_token(state: &State, minted: String) -> anyhow::Result<String> {
    block_on(state.cluster_token(&minted))?.context("reading the minted cluster token")
}

/// The operator's drains, into the cluster.
pub(crate) fn drains(state: &State, cluster: &Cluster) -> anyhow::Result<()> {
    let drains = block_on(state.drains())?.context("reading the drains")?;
    if !drains.is_empty() {
        info!(engine_ids = ?drains, "restored the operator's drains");
    }
    cluster.restore_drains(drains);
    Ok(())
}

/// The slot to serve: the stored one, unless `--policy` names a file whose content differs
/// from what it was at the last save (the file changed while the gateway was down: it serves,
/// as a change while running would have installed it), or the stored policy no longer loads.
/// `flags` is what the command line alone would serve.
pub(crate) fn slot(
    keeper: &policy::PolicyKeeper,
    engine: &PolicyEngine,
    flags: Installed,
    file: Option<&Path>,
) -> anyhow::Result<PolicySlot> {
    let state = keeper.state();
    block_on(async {
        let Some(record) = state.policy().await.context("reading the stored policy")? else {
            return Ok(PolicySlot::new(flags));
        };
        let file_now = file_sha256(file);
        if file.is_some() && file_now != record.file_sha256 {
            info!(
                stored = record.generation,
                "--policy changed since the stored policy was saved: the file serves"
            );
            let previous = policy::load(state, engine, &record.current).await.ok();
            let bytes = file.and_then(|f| std::fs::read(f).ok());
            if let Err(e) = keeper.save(&flags, previous.as_ref(), bytes).await {
                warn!(error = %e, "the file's policy is not saved in the state store");
            }
            return Ok(PolicySlot::restored(flags, previous));
        }
        match policy::restore(state, engine, &record).await {
            Ok((current, previous)) => {
                info!(
                    policy = %current.name(),
                    version = %current.version(),
                    generation = record.generation,
                    "restored the stored policy"
                );
                keeper.set_applied(record.generation);
                Ok(PolicySlot::restored(current, previous))
            }
            Err(e) => {
                warn!(error = %e, "the stored policy is not restored: the command line's serves");
                Ok(PolicySlot::new(flags))
            }
        }
    })?
}

/// Forgets stored responses older than `ttl`, then the oldest past `max_bytes`, every minute.
pub(crate) async fn sweep(state: State, ttl: Duration, max_bytes: u64) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    loop {
        tick.tick().await;
        let before = st::unix_ms().saturating_sub(ttl.as_millis() as u64);
        match state.sweep_turns(before, max_bytes).await {
            Ok(0) => {}
            Ok(n) => info!(turns = n, "swept stored responses"),
            Err(e) => warn!(error = %e, "sweeping stored responses failed"),
        }
    }
}
