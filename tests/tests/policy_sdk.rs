//! The policy author's tools, run as an author runs them (the `pd-gateway` binary):
//!
//! 1. `policy test`: every shipped build passes its policy's cases (`policies/cases/`), in every
//!    language; a deliberately wrong expectation fails with a non-zero exit naming the case.
//! 2. `policy new`: each language's template builds with its own `build.sh` and passes its own
//!    cases; the Rust one with its ranking removed ("return the first node") fails them.
//! 3. `policy replay`: a decision log recorded from a 2P+2D cluster (served by round-robin)
//!    replays exactly through the round-robin guest, and prefix-aware (Rust and Python builds,
//!    which agree) reuses more cached prefix tokens on it than round-robin.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use pd_cluster_tests::bins;
use pd_cluster_tests::cluster::{ADMIN_TOKEN, ClusterSpec, TestCluster, args};
use pd_cluster_tests::openai::{self, Api};
use pd_cluster_tests::process::WorkDir;
use serde_json::Value;

/// Limits for interpreted guests (as `policy new` suggests), with room for a loaded machine.
const SLOW_GUEST: [&str; 6] = [
    "--deadline-ms",
    "500",
    "--fuel",
    "1000000000",
    "--memory-mib",
    "64",
];
/// Limits for compiled guests, with room for a loaded machine.
const FAST_GUEST: [&str; 2] = ["--deadline-ms", "100"];

fn limits(lang: &str) -> &'static [&'static str] {
    match lang {
        "python" | "js" | "go" => &SLOW_GUEST,
        _ => &FAST_GUEST,
    }
}

fn gateway(args: &[&str]) -> Output {
    Command::new(bins::pd_gateway())
        .args(args)
        .output()
        .expect("running pd-gateway")
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

fn cases_dir(policy: &str) -> PathBuf {
    bins::workspace_root().join("policies/cases").join(policy)
}

/// (language, policy) of every shipped build.
const BUILDS: [(&str, &str); 10] = [
    ("rust", "least-loaded"),
    ("rust", "prefix-aware"),
    ("rust", "round-robin"),
    ("python", "least-loaded"),
    ("python", "prefix-aware"),
    ("js", "least-loaded"),
    ("js", "prefix-aware"),
    ("go", "least-loaded"),
    ("c", "least-loaded"),
    ("native", "least-loaded"),
];

#[test]
fn every_shipped_build_passes_its_cases_and_a_wrong_expectation_fails() {
    for (lang, policy) in BUILDS {
        let file = match lang {
            "native" => format!("native:{policy}"),
            "rust" => path(&bins::policy(policy)).to_owned(),
            _ => path(&bins::policy(&format!("{lang}/{policy}"))).to_owned(),
        };
        let cases = cases_dir(policy);
        let mut a = vec!["policy", "test", &file, "--cases", path(&cases)];
        a.extend_from_slice(limits(lang));
        let out = gateway(&a);
        assert!(out.status.success(), "{lang} {policy}: {}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains(", 0 failed;"), "{stdout}");
        eprintln!("{lang}/{policy}: {}", stdout.lines().last().unwrap_or(""));
    }

    // One expectation made wrong: the test fails, names that case, and passes the others.
    let dir = WorkDir::new("policy-test-wrong");
    for entry in std::fs::read_dir(cases_dir("least-loaded")).expect("cases") {
        let p = entry.expect("entry").path();
        let mut body = std::fs::read_to_string(&p).expect("case");
        if p.ends_with("whole-ties-go-to-free-blocks-then-index.json") {
            let right = "\"whole\": [3, 2, 4, 1, 0]";
            assert!(body.contains(right), "{body}");
            body = body.replace(right, "\"whole\": [0, 1, 2, 3, 4]");
        }
        std::fs::write(dir.path().join(p.file_name().expect("name")), body).expect("write");
    }
    let wasm = bins::policy("least-loaded");
    let mut a = vec!["policy", "test", path(&wasm), "--cases", path(dir.path())];
    a.extend_from_slice(&FAST_GUEST);
    let out = gateway(&a);
    assert!(
        !out.status.success(),
        "a wrong expectation passed: {}",
        text(&out)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("FAIL  whole-ties-go-to-free-blocks-then-index.json"),
        "{stdout}"
    );
    assert!(stdout.contains("4 cases, 3 passed, 1 failed"), "{stdout}");
}

#[test]
fn templates_build_and_pass_their_own_cases_in_every_language() {
    let dir = WorkDir::new("policy-templates");
    for lang in ["rust", "python", "js", "go", "c"] {
        let name = format!("my-{lang}-policy");
        let out = gateway(&[
            "policy",
            "new",
            "--lang",
            lang,
            "--dir",
            path(dir.path()),
            &name,
        ]);
        assert!(out.status.success(), "new {lang}: {}", text(&out));
        let folder = dir.path().join(&name);
        let wasm = dir.path().join(format!("{name}.wasm"));
        build(&folder, &wasm);
        let out = test_cases(&wasm, &folder, lang);
        assert!(out.status.success(), "{lang} template: {}", text(&out));
        // Every language's template is on the one contract.
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(": pd:policy@1.0.0\n"),
            "{lang} template: {}",
            text(&out)
        );
        // A second `new` of the same name overwrites nothing.
        let again = gateway(&[
            "policy",
            "new",
            "--lang",
            lang,
            "--dir",
            path(dir.path()),
            &name,
        ]);
        assert!(!again.status.success(), "{}", text(&again));
    }

    // The template's cases catch a policy that answers "the first node": the Rust template
    // with its ranking removed (candidates left in index order) fails them.
    let folder = dir.path().join("my-rust-policy");
    let lib = folder.join("src/lib.rs");
    let source = std::fs::read_to_string(&lib).expect("lib.rs");
    let sort = "    keyed.sort_unstable();\n";
    assert!(
        source.contains(sort),
        "the template's ranking moved: {source}"
    );
    std::fs::write(&lib, source.replace(sort, "")).expect("write");
    let wasm = dir.path().join("first-node.wasm");
    build(&folder, &wasm);
    let out = test_cases(&wasm, &folder, "rust");
    assert!(
        !out.status.success(),
        "a first-node policy passed the template's cases: {}",
        text(&out)
    );
}

fn build(folder: &Path, wasm: &Path) {
    let out = Command::new("bash")
        .arg(folder.join("build.sh"))
        .args([folder, wasm])
        .output()
        .expect("running build.sh");
    assert!(out.status.success(), "{}: {}", folder.display(), text(&out));
    assert!(wasm.is_file());
}

fn test_cases(wasm: &Path, folder: &Path, lang: &str) -> Output {
    let cases = folder.join("cases");
    let mut a = vec!["policy", "test", path(wasm), "--cases", path(&cases)];
    a.extend_from_slice(limits(lang));
    gateway(&a)
}

/// A distinct document per conversation, long enough for several full blocks.
fn document(i: usize) -> String {
    format!(
        "Document {i}. {}",
        (0..40)
            .map(|w| format!("w{}x{}", i * 7 + w, w % 5))
            .collect::<Vec<_>>()
            .join(" ")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_log_replays_and_prefix_aware_reuses_more_than_round_robin() {
    const DOCS: usize = 8;
    let c = TestCluster::start(
        "policy-replay",
        ClusterSpec {
            prefill: 2,
            decode: 2,
            gateway_args: args(&[
                "--native-policy",
                "round-robin",
                "--decision-log-every",
                "1",
            ]),
            ..ClusterSpec::default()
        },
    )
    .await;
    // Each document is asked about twice in a row: round-robin sends the second question to
    // the other prefill node, which does not hold the document; prefix-aware would not.
    let api = Api::Completions;
    for i in 0..DOCS {
        for q in ["Summarise it.", "Who wrote it?"] {
            let body = api.body(&format!("{} {q}", document(i)), 2);
            openai::send(&c.client, &c.gateway.http, api, &body, None)
                .await
                .ok();
            // Let the nodes' block events reach the gateway's view before the next request.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    let dir = WorkDir::new("policy-replay-log");
    let log = dir.path().join("decisions.jsonl");
    let out = gateway(&[
        "policy",
        "decisions",
        "--admin",
        &c.gateway.admin,
        "--token",
        ADMIN_TOKEN,
    ]);
    assert!(out.status.success(), "{}", text(&out));
    std::fs::write(&log, &out.stdout).expect("write the log");
    let records = String::from_utf8_lossy(&out.stdout).lines().count();
    assert_eq!(records, 2 * DOCS, "one record per request");

    let replay = |policy: String, lang: &str| -> Value {
        let mut a = vec![
            "policy",
            "replay",
            path(&log),
            "--policy",
            &policy,
            "--json",
        ];
        a.extend_from_slice(limits(lang));
        let out = gateway(&a);
        assert!(out.status.success(), "replay {policy}: {}", text(&out));
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)))
    };
    let rr = replay(path(&bins::policy("round-robin")).to_owned(), "rust");
    let pa = replay(path(&bins::policy("prefix-aware")).to_owned(), "rust");
    let pa_py = replay(
        path(&bins::policy("python/prefix-aware")).to_owned(),
        "python",
    );
    eprintln!("round-robin: {rr}\nprefix-aware: {pa}");
    // The recorded decisions were native round-robin's: the guest reproduces every one.
    assert_eq!(rr["same"], records as u64, "{rr}");
    assert_eq!(rr["after"]["failures"], 0, "{rr}");
    let tokens = |v: &Value| v["after"]["prefix_tokens"].as_u64().expect("prefix_tokens");
    assert_eq!(
        tokens(&rr),
        rr["before"]["prefix_tokens"].as_u64().expect("recorded")
    );
    assert!(
        tokens(&pa) > tokens(&rr),
        "prefix-aware reuses {} prefix tokens, round-robin {}",
        tokens(&pa),
        tokens(&rr)
    );
    // The same policy in Python decides the same on real traffic.
    assert_eq!(
        pa_py["after"]["prefix_tokens"],
        pa["after"]["prefix_tokens"]
    );
    assert_eq!(pa_py["same"], pa["same"]);
}
