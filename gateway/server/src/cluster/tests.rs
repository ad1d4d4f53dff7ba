//! The cluster view's tests: joins, views, open-request counting.

use super::*;
use std::sync::atomic::AtomicU32;

fn entry(conn: ConnId, engine_id: &str, model: &str, source: &'static str) -> NodeEntry {
    NodeEntry {
        conn,
        engine_id: engine_id.into(),
        epoch: 0,
        role: Role::Decode,
        model: model.into(),
        block_size: 16,
        http_addr: format!("127.0.0.1:{conn}").into(),
        kv_addr: "".into(),
        max_model_len: 2048,
        hash_key: 0,
        kv_bytes_per_token: 0,
        takes_prompt_token_ids: source == "registered",
        state: pb::NodeState::default(),
        hashes: HashSet::new(),
        draining: false,
        last_seen: Instant::now(),
        registered_at: SystemTime::now(),
        visible_from: Instant::now(),
        outbox: mpsc::channel(1).0,
        source,
        bearer: None,
        open: OpenRequests::default(),
        gone: CancellationToken::new(),
    }
}

/// `(waiting, running, remote)` of a report with `open` requests open now and `at_state`
/// open when the report came.
fn adjusted(report: (u64, u64, u64), at_state: u32, open: u32) -> (u32, u32, u32) {
    adjusted_reserved(report, at_state, open, 0)
}

/// [`adjusted`] with `reserved` decode phases reserved too.
fn adjusted_reserved(
    report: (u64, u64, u64),
    at_state: u32,
    open: u32,
    reserved: u32,
) -> (u32, u32, u32) {
    let o = OpenRequests {
        counts: Arc::new(Counts {
            open: AtomicU32::new(open),
            reserved: AtomicU32::new(reserved),
        }),
        at_state,
    };
    o.adjust(&pb::NodeState {
        waiting: report.0,
        running: report.1,
        waiting_remote_kv: report.2,
        ..pb::NodeState::default()
    })
}

#[test]
fn the_view_moves_a_report_on_by_the_requests_the_gateway_opened_and_closed() {
    // A burst: three routed since an idle report; they wait.
    assert_eq!(adjusted((0, 0, 0), 0, 3), (3, 0, 0));
    // A request ended since the report that showed it running: the node is idle.
    assert_eq!(adjusted((0, 1, 0), 1, 0), (0, 0, 0));
    // Two ended, one was parked for KV: running first, then the parked one.
    assert_eq!(adjusted((1, 1, 1), 2, 0), (1, 0, 0));
    // A report that does not show two requests the gateway has open there: never below
    // what is open.
    assert_eq!(adjusted((0, 0, 0), 2, 2), (2, 0, 0));
    // A decode node reserved during P's phase: waiting for remote KV, not work. (The
    // holder of a conversation, its last turn just ended, one turn reserved there.)
    assert_eq!(adjusted_reserved((0, 1, 0), 1, 0, 1), (0, 0, 1));
    assert_eq!(adjusted_reserved((0, 0, 0), 0, 0, 2), (0, 0, 2));
    // Load from elsewhere (other clients) stays.
    assert_eq!(adjusted((2, 3, 0), 0, 0), (2, 3, 0));
    assert_eq!(adjusted((2, 3, 0), 1, 2), (3, 3, 0));
}

#[test]
fn an_open_request_counts_until_its_guard_drops() {
    let r = NodeRef {
        conn: 7,
        engine_id: "d0".into(),
        epoch: 1,
        http_addr: "127.0.0.1:1".into(),
        bearer: None,
        counts: Arc::default(),
        gone: CancellationToken::new(),
    };
    let counts = |r: &NodeRef| {
        (
            r.counts.open.load(Ordering::Acquire),
            r.counts.reserved.load(Ordering::Acquire),
        )
    };
    let a = r.open();
    let b = r.open();
    assert_eq!((a.conn(), counts(&r)), (7, (2, 0)));
    drop(a);
    drop(b);
    assert_eq!(counts(&r), (0, 0));
    // A reservation counts apart until sent, then as open until dropped.
    let c = r.reserve();
    assert_eq!(counts(&r), (0, 1));
    let c = c.sent();
    assert_eq!(counts(&r), (1, 0));
    let c = c.sent();
    assert_eq!(counts(&r), (1, 0));
    drop(c);
    drop(r.reserve());
    assert_eq!(counts(&r), (0, 0));
}

/// The test models' byte tokenizer and its fingerprint.
fn byte_tokenizer(name: &str) -> (Arc<Tokenizer>, u64) {
    let dir = std::env::temp_dir().join(format!("pd-cluster-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    pd_tokenize::write_byte_level_tokenizer(&dir, 300).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let fp = tokenizer.fingerprint();
    (tokenizer, fp)
}

#[test]
fn one_model_one_kind_of_node_and_one_node_per_engine_id() {
    let (tokenizer, fp) = byte_tokenizer("one-kind");
    let c = Cluster::default();
    let join = |e: NodeEntry| {
        c.join(e, || Ok((tokenizer.clone(), fp)), fp)
            .map_err(|e| e.to_string())
    };

    join(entry(c.new_conn(), "d0", "m", "registered")).unwrap();
    // A static node of a model registered nodes serve would take away their token ids and
    // hash key: refused, naming both kinds.
    let err = join(entry(c.new_conn(), "s0", "m", "static")).unwrap_err();
    assert!(err.contains("all registered or all static"), "{err}");
    // A static node taking a registered node's engine id: refused (they would push each
    // other out on every scrape).
    let err = join(entry(c.new_conn(), "d0", "m2", "static")).unwrap_err();
    assert!(
        err.contains("engine id `d0` is taken by a registered node"),
        "{err}"
    );
    // Its own id and model: admitted; and the other way round is refused too.
    join(entry(c.new_conn(), "s0", "m2", "static")).unwrap();
    let err = join(entry(c.new_conn(), "d1", "m2", "registered")).unwrap_err();
    assert!(err.contains("served by static nodes"), "{err}");
    // The same registered engine again (a reconnect) replaces its old entry.
    let again = c.new_conn();
    join(entry(again, "d0", "m", "registered")).unwrap();
    let state = c.read();
    let ids: Vec<(ConnId, &str)> = state
        .nodes
        .values()
        .map(|n| (n.conn, &*n.engine_id))
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(ids.contains(&(again, "d0")), "{ids:?}");
    assert_eq!(state.models["m"].source, "registered");
    assert_eq!(state.models["m2"].source, "static");
}

/// A node's requests wait on it while it is out of the view; they end once it has been
/// gone past the grace period, unless the same process (engine id and epoch) came back. A
/// restarted process ends the old one's at once.
#[test]
fn requests_end_when_their_node_is_gone_for_good() {
    let (tokenizer, fp) = byte_tokenizer("gone");
    let c = Cluster::default();
    let join = |conn: ConnId, epoch: u64| {
        let mut e = entry(conn, "d0", "m", "registered");
        e.epoch = epoch;
        c.join(e, || Ok((tokenizer.clone(), fp)), fp).unwrap();
    };
    let node = |c: &Cluster| c.snapshot("m", &[]).nodes[0].clone();
    let never = Duration::from_secs(3600);

    let first = c.new_conn();
    join(first, 1);
    let r = node(&c);
    // It stalls and leaves the view; within the grace its requests go on waiting.
    assert!(c.leave(first, "silent"));
    assert_eq!(c.cut_departed(never), 0);
    assert!(!r.gone.is_cancelled());
    // The same process reconnects: past the grace nothing ends either.
    let second = c.new_conn();
    join(second, 1);
    assert_eq!(c.cut_departed(Duration::ZERO), 0);
    assert!(
        !r.gone.is_cancelled(),
        "the node came back: its requests go on"
    );
    // It leaves again and does not come back: past the grace its requests end, once.
    assert!(c.leave(second, "silent"));
    assert_eq!(c.cut_departed(Duration::ZERO), 1);
    assert!(r.gone.is_cancelled());
    assert_eq!(c.cut_departed(Duration::ZERO), 0);

    // Another process (another epoch) claiming the id while the first is in the view is
    // refused, naming both addresses; the first keeps it and its requests go on.
    let listed = c.new_conn();
    join(listed, 2);
    let before = node(&c);
    let mut other = entry(c.new_conn(), "d0", "m", "registered");
    other.epoch = 3;
    other.http_addr = "10.0.0.9:8000".into();
    let err = c
        .join(other, || Ok((tokenizer.clone(), fp)), fp)
        .unwrap_err();
    assert!(matches!(err, JoinError::EngineIdTaken { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("127.0.0.1:{listed}")) && text.contains("10.0.0.9:8000"),
        "{text}"
    );
    assert!(!before.gone.is_cancelled());
    assert_eq!(node(&c).conn, listed);
    // The same epoch under another model (a registrant that learned the epoch) is refused
    // too: a reconnect serves the model it served.
    let mut rogue = entry(c.new_conn(), "d0", "m-other", "registered");
    rogue.epoch = 2;
    let err = c
        .join(rogue, || Ok((tokenizer.clone(), fp)), fp)
        .unwrap_err();
    assert!(matches!(err, JoinError::EngineIdTaken { .. }), "{err}");
    assert!(!before.gone.is_cancelled());
    assert_eq!(node(&c).conn, listed);
    // Once it has left, a restart (another epoch) is admitted and ends the old process's
    // requests at once; the new process's are not touched.
    assert!(c.leave(listed, "stream ended"));
    join(c.new_conn(), 3);
    assert!(before.gone.is_cancelled());
    assert!(!node(&c).gone.is_cancelled());
}

/// A node's prefix cache holds at most one hash per block of its pool: a report of more (a
/// node that lies, or a gateway that missed removals) grows the gateway's memory no further.
#[test]
fn a_node_holds_no_more_hashes_than_its_pool_has_blocks() {
    let (tokenizer, fp) = byte_tokenizer("hash-cap");
    let c = Cluster::default();
    let conn = c.new_conn();
    let mut e = entry(conn, "d0", "m", "registered");
    e.state.total_blocks = 100;
    c.join(e, || Ok((tokenizer.clone(), fp)), fp).unwrap();
    let held = |c: &Cluster| c.read().nodes[&conn].hashes.len();
    assert!(c.blocks(
        conn,
        pb::BlockEvents {
            stored: (0..10_000).collect(),
            ..Default::default()
        }
    ));
    assert_eq!(held(&c), 100);
    // Removals make room again; a resync starts over.
    assert!(c.blocks(
        conn,
        pb::BlockEvents {
            removed: (0..10_000).collect(),
            stored: (20_000..20_050).collect(),
            ..Default::default()
        }
    ));
    assert_eq!(held(&c), 50);
    assert!(c.blocks(
        conn,
        pb::BlockEvents {
            resync: true,
            stored: (0..1_000).collect(),
            ..Default::default()
        }
    ));
    assert_eq!(held(&c), 100);
}

/// A model's first node brings its tokenizer, which can take long to parse: the parse runs
/// before the cluster's write lock is taken, so requests reading the view meanwhile are not
/// held up by it.
#[test]
fn a_first_nodes_tokenizer_is_parsed_outside_the_write_lock() {
    let (tokenizer, fp) = byte_tokenizer("parse-unlocked");
    let c = Cluster::default();
    let mut readable = None;
    c.join(
        entry(c.new_conn(), "d0", "m", "registered"),
        || {
            readable = Some(c.state.try_read().is_ok());
            Ok((tokenizer.clone(), fp))
        },
        fp,
    )
    .unwrap();
    assert_eq!(readable, Some(true), "the view was locked during the parse");
}

/// A model's tokenizer is replaced only when no node of it is left to disagree: a node with
/// another tokenizer is refused while one with the model's is in the view, and admitted (its
/// tokenizer now the model's) once that one left.
#[test]
fn a_models_tokenizer_changes_only_when_no_node_of_it_disagrees() {
    let (old, old_fp) = byte_tokenizer("old");
    // Another tokenizer, as far as the registry can tell: another fingerprint.
    let (new, new_fp) = (old.clone(), old_fp ^ 1);
    let c = Cluster::default();
    let first = c.new_conn();
    c.join(
        entry(first, "d0", "m", "registered"),
        || Ok((old.clone(), old_fp)),
        old_fp,
    )
    .unwrap();
    let err = c
        .join(
            entry(c.new_conn(), "d1", "m", "registered"),
            || Ok((new.clone(), new_fp)),
            new_fp,
        )
        .unwrap_err();
    assert!(matches!(err, JoinError::TokenizerDiffers { .. }), "{err}");
    assert!(c.leave(first, "stream ended"));
    c.join(
        entry(c.new_conn(), "d1", "m", "registered"),
        || Ok((new.clone(), new_fp)),
        new_fp,
    )
    .unwrap();
    // Now the old tokenizer is the odd one out.
    let err = c
        .join(
            entry(c.new_conn(), "d0", "m", "registered"),
            || Ok((old.clone(), old_fp)),
            old_fp,
        )
        .unwrap_err();
    assert!(matches!(err, JoinError::TokenizerDiffers { .. }), "{err}");
}
