//! Where the binaries under test are: next to the test executable's profile directory
//! (`target/debug/deps/<test>-<hash>` → `target/debug/pd-node`), and the guest policies in
//! `${CARGO_TARGET_DIR:-target}/policies/*.wasm`.

use std::path::{Path, PathBuf};

/// The profile directory the test (or example) executable was built into (`.../target/debug`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let mut dir = exe
        .parent()
        .expect("the test executable lies in a directory")
        .to_path_buf();
    if dir.ends_with("deps") || dir.ends_with("examples") {
        dir.pop();
    }
    dir
}

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lies inside the workspace")
        .to_path_buf()
}

/// The binary `name` of this workspace; panics with the command that builds it when missing.
pub fn binary(name: &str) -> PathBuf {
    let path = profile_dir().join(name);
    assert!(
        path.is_file(),
        "{name} not found at {}: build it first with `cargo build -p pd-node -p pd-gateway` \
         (`cargo test --workspace` builds it too)",
        path.display()
    );
    path
}

/// `pd-node`; `PD_TEST_NODE_BIN` names another build's (to run today's tests against an older
/// node, as a test that must fail on the old code is shown to).
pub fn pd_node() -> PathBuf {
    match std::env::var_os("PD_TEST_NODE_BIN").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => binary("pd-node"),
    }
}

/// `pd-gateway`.
pub fn pd_gateway() -> PathBuf {
    binary("pd-gateway")
}

/// `pd-node-sim`, the node simulator (benchmarks; the cluster test `simulator` checks it
/// against a real gateway).
pub fn pd_node_sim() -> PathBuf {
    binary("pd-node-sim")
}

/// The guest policy `name` (`round-robin`, `trapping`, ...) built by `scripts/build-policies.sh`;
/// panics with that command when missing.
pub fn policy(name: &str) -> PathBuf {
    let mut roots = Vec::new();
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR").filter(|t| !t.is_empty()) {
        let t = PathBuf::from(t);
        roots.push(if t.is_absolute() {
            t
        } else {
            workspace_root().join(t)
        });
    }
    // `target/debug` → `target`; `target/<triple>/debug` → `target/<triple>`, then `target`.
    let profile = profile_dir();
    roots.extend(profile.ancestors().skip(1).take(2).map(Path::to_path_buf));
    for root in &roots {
        let path = root.join("policies").join(format!("{name}.wasm"));
        if path.is_file() {
            return path;
        }
    }
    panic!(
        "policy {name}.wasm not found under {roots:?}/policies: build the guest policies first \
         with `scripts/build-policies.sh`"
    );
}

/// A tool a script installs outside the repository (Envoy, vllm-router): the path in the
/// environment variable `var` when set (`scripts/test.sh` sets it), else what `script` (under
/// `scripts/`) prints once it has installed the tool; not under `CI=true`, which must set `var`.
pub fn installed_tool(var: &str, script: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{var} is not set under CI=true: run `export {var}=$(bash scripts/{script})` first (scripts/test.sh does)"
    );
    let script = workspace_root().join("scripts").join(script);
    let out = std::process::Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed", script.display());
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}
