//! The Kubernetes manifests of `examples/k8s`, rendered by `scripts/k8s-check.sh --render`, read
//! as a kubelet reads them to start a Deployment's pod: its container's command and args, its
//! env (literal values, Secret and ConfigMap keys, downward-API fields filled in for the pod,
//! `envFrom`), `$(VAR)` references expanded, and paths under its volume mounts mapped to
//! directories of the test. The harness starts exactly that on a host, so the manifests and
//! what the tests run cannot drift apart. Not modelled: images (the workspace's binaries run),
//! the security context (processes run as the test's user), probes and resources (but
//! `limits.cpu`, read through `resourceFieldRef`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::bins::workspace_root;

/// The documents of one rendered overlay.
#[derive(Debug)]
pub struct Rendered {
    docs: Vec<Value>,
}

/// What the kubelet knows of a pod when it starts it.
#[derive(Debug, Clone)]
pub struct Pod<'a> {
    /// `metadata.name`.
    pub name: &'a str,
    /// `status.podIP`.
    pub ip: String,
    /// CPUs `limits.cpu` is read as (the kubelet rounds a fractional limit up).
    pub cpus: u32,
    /// Where each volume (by name) lies in the test: its mount path maps there.
    pub volumes: BTreeMap<String, PathBuf>,
}

/// A container ready to start: program (the image's command), arguments and environment.
#[derive(Debug, Clone)]
pub struct Launch {
    /// `command[0]`.
    pub program: String,
    /// `command[1..]` then `args`, expanded and mapped.
    pub args: Vec<String>,
    /// The container's environment, in order.
    pub env: Vec<(String, String)>,
}

impl Rendered {
    /// Overlay `overlay` (`cpu`, `gpu`): `$PD_K8S_RENDERED/<overlay>.json` when set (the test
    /// script renders once), else rendered now into `dir` by `scripts/k8s-check.sh --render`.
    pub fn load(overlay: &str, dir: &Path) -> Self {
        let from = match std::env::var_os("PD_K8S_RENDERED").filter(|d| !d.is_empty()) {
            Some(d) => PathBuf::from(d),
            None => {
                let out = dir.join("k8s");
                let script = workspace_root().join("scripts/k8s-check.sh");
                let status = Command::new("bash")
                    .arg(&script)
                    .arg("--render")
                    .arg(&out)
                    .status()
                    .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
                assert!(status.success(), "{} failed: {status}", script.display());
                out
            }
        };
        let path = from.join(format!("{overlay}.json"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let docs: Vec<Value> = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not a JSON list: {e}", path.display()));
        Self { docs }
    }

    /// The document of `kind` named `name`.
    pub fn doc(&self, kind: &str, name: &str) -> &Value {
        self.docs
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in the rendered manifests"))
    }

    /// Key `key` of Secret `name` (`stringData`, else base64-free `data` is not read).
    pub fn secret(&self, name: &str, key: &str) -> String {
        let s = self.doc("Secret", name);
        s["stringData"][key]
            .as_str()
            .unwrap_or_else(|| panic!("Secret {name} has no stringData key {key}"))
            .to_owned()
    }

    fn config_map(&self, name: &str) -> &serde_json::Map<String, Value> {
        self.doc("ConfigMap", name)["data"]
            .as_object()
            .unwrap_or_else(|| panic!("ConfigMap {name} has no data"))
    }

    /// The first container of Deployment `deployment`, as the kubelet starts it in `pod`.
    pub fn launch(&self, deployment: &str, pod: &Pod<'_>) -> Launch {
        let spec = &self.doc("Deployment", deployment)["spec"]["template"]["spec"];
        let c = &spec["containers"][0];
        let mut env: Vec<(String, String)> = Vec::new();
        for from in c["envFrom"].as_array().into_iter().flatten() {
            let name = from["configMapRef"]["name"]
                .as_str()
                .expect("envFrom names a ConfigMap");
            for (k, v) in self.config_map(name) {
                env.push((k.clone(), v.as_str().unwrap_or_default().to_owned()));
            }
        }
        for e in c["env"].as_array().into_iter().flatten() {
            let name = e["name"].as_str().expect("env name").to_owned();
            let value = match (&e["value"], &e["valueFrom"]) {
                (Value::String(v), _) => expand(v, &env),
                (_, from) if from.is_object() => self.value_from(from, pod),
                _ => String::new(),
            };
            env.push((name, value));
        }
        let mounts: Vec<(String, PathBuf)> = c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| {
                let at = m["mountPath"].as_str()?.to_owned();
                let dir = pod.volumes.get(m["name"].as_str()?)?.clone();
                Some((at, dir))
            })
            .collect();
        let map = |s: String| map_path(&s, &mounts);
        for (_, v) in &mut env {
            *v = map(std::mem::take(v));
        }
        let words: Vec<String> = c["command"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(c["args"].as_array().into_iter().flatten())
            .map(|w| map(expand(w.as_str().expect("a string argument"), &env)))
            .collect();
        let (program, args) = words.split_first().expect("a command");
        Launch {
            program: program.clone(),
            args: args.to_vec(),
            env,
        }
    }

    fn value_from(&self, from: &Value, pod: &Pod<'_>) -> String {
        if let Some(f) = from["fieldRef"]["fieldPath"].as_str() {
            return match f {
                "metadata.name" => pod.name.to_owned(),
                "status.podIP" => pod.ip.clone(),
                other => panic!("the harness fills no downward-API field {other}"),
            };
        }
        if let Some(r) = from["resourceFieldRef"]["resource"].as_str() {
            assert_eq!(r, "limits.cpu", "the harness fills no resource {r}");
            return pod.cpus.to_string();
        }
        if let Some(s) = from.get("secretKeyRef") {
            return self.secret(
                s["name"].as_str().expect("a Secret name"),
                s["key"].as_str().expect("a key"),
            );
        }
        if let Some(m) = from.get("configMapKeyRef") {
            let key = m["key"].as_str().expect("a key");
            let data = self.config_map(m["name"].as_str().expect("a ConfigMap name"));
            return data[key].as_str().unwrap_or_default().to_owned();
        }
        panic!("the harness does not read valueFrom {from}")
    }
}

/// `$(VAR)` replaced by `VAR`'s value in `env` (the kubelet's expansion; `$$` escapes,
/// unknown names stay as written).
fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("$$") {
            out.push('$');
            rest = t;
        } else if let Some((name, after)) = tail
            .strip_prefix("$(")
            .and_then(|t| t.split_once(')'))
            .filter(|(n, _)| env.iter().any(|(k, _)| k == n))
        {
            let value = env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v);
            out.push_str(value.map_or("", String::as_str));
            rest = after;
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// `s` with a leading mount path replaced by the directory it maps to.
fn map_path(s: &str, mounts: &[(String, PathBuf)]) -> String {
    for (at, dir) in mounts {
        if s == at {
            return dir.display().to_string();
        }
        if let Some(rest) = s.strip_prefix(&format!("{at}/")) {
            return dir.join(rest).display().to_string();
        }
    }
    s.to_owned()
}

impl Launch {
    /// The value of `name` in its environment.
    pub fn env(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Gives `cmd` (the container's program, already named) this container's arguments and
    /// the environment the kubelet gives it (and `PATH`), nothing of the test's own.
    pub fn apply(&self, cmd: &mut Command) {
        cmd.args(&self.args).env_clear();
        cmd.env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        );
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_as_the_kubelet_does() {
        let env = vec![
            ("A".to_owned(), "1".to_owned()),
            ("B".to_owned(), "x".to_owned()),
        ];
        assert_eq!(
            expand("--a=$(A) $(B)$(C) $$(A) $", &env),
            "--a=1 x$(C) $(A) $"
        );
        let mounts = vec![("/models".to_owned(), PathBuf::from("/tmp/m"))];
        assert_eq!(map_path("/models/x.gguf", &mounts), "/tmp/m/x.gguf");
        assert_eq!(map_path("/modelsx", &mounts), "/modelsx");
    }
}
