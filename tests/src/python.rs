//! The unmodified `openai` Python package as a client: `tests/clients/openai_client.py` run by
//! the interpreter of a virtual environment that `scripts/python-env.sh` creates (outside the
//! repository, keyed by the package version).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::bins::workspace_root;

/// The Python interpreter that has the `openai` package.
///
/// `PD_TEST_PYTHON` when set (`scripts/test.sh` sets it by running `scripts/python-env.sh`);
/// otherwise, under `CI=true`, a panic (CI must provide it); otherwise `scripts/python-env.sh`
/// is run here (creating the environment the first time; needs the package index).
pub fn interpreter() -> PathBuf {
    if let Some(p) = std::env::var_os("PD_TEST_PYTHON").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "PD_TEST_PYTHON is not set under CI=true: run `export PD_TEST_PYTHON=$(scripts/python-env.sh)` \
         first (scripts/test.sh does)"
    );
    let script = workspace_root().join("scripts/python-env.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed ({}); set PD_TEST_PYTHON to a python that has the openai package",
        script.display(),
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = stdout
        .lines()
        .last()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| panic!("{} printed no interpreter path", script.display()));
    PathBuf::from(path)
}

/// Runs the `openai`-package client against `base_url` (e.g. `http://127.0.0.1:8080/v1`) with
/// the request `specs` (a JSON list, see `tests/clients/openai_client.py`) and returns its JSON
/// list of results. Blocking: call it from `spawn_blocking`.
pub fn run_client(python: &Path, base_url: &str, specs: &Value) -> Value {
    run_client_with_key(python, base_url, specs, None)
}

/// [`run_client`] with the SDK's `api_key` set to `key` (default: a key no test gateway asks
/// for).
pub fn run_client_with_key(
    python: &Path,
    base_url: &str,
    specs: &Value,
    key: Option<&str>,
) -> Value {
    let client = workspace_root().join("tests/clients/openai_client.py");
    let mut child = Command::new(python)
        .arg(&client)
        .arg(base_url)
        .env("PD_TEST_API_KEY", key.unwrap_or_default())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {} {}: {e}", python.display(), client.display()));
    {
        let mut stdin = child.stdin.take().expect("stdin is piped");
        stdin
            .write_all(specs.to_string().as_bytes())
            .expect("writing the request specs");
    }
    let out = child.wait_with_output().expect("waiting for the client");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the openai client failed ({}) against {base_url}:\n{stderr}",
        out.status
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "the openai client's output is not JSON ({e}):\n{}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// [`run_client`] against the node or gateway at `http` (`http://host:port`), on a blocking
/// thread; checks there is one result per spec and returns them.
pub async fn run_specs(python: &Path, http: &str, specs: &[Value]) -> Vec<Value> {
    run_specs_with_key(python, http, specs, None).await
}

/// [`run_specs`] with the SDK's `api_key` set to `key`.
pub async fn run_specs_with_key(
    python: &Path,
    http: &str,
    specs: &[Value],
    key: Option<&str>,
) -> Vec<Value> {
    let python = python.to_path_buf();
    let base = format!("{http}/v1");
    let list = Value::Array(specs.to_vec());
    let key = key.map(str::to_owned);
    let out = tokio::task::spawn_blocking(move || {
        run_client_with_key(&python, &base, &list, key.as_deref())
    })
    .await
    .expect("the client thread");
    let results = out.as_array().cloned().expect("a JSON list of results");
    assert_eq!(results.len(), specs.len(), "one result per spec");
    results
}
