//! `pd-gateway policy new`: a new policy folder from a template, in any supported language.
//!
//! A template is the repository's least-loaded example in that language (the same source the
//! cross-language test checks), with everything needed to build and test it away from the
//! repository: the language's build script (and `tools.sh`, the shared installers, for Go and
//! C), the WIT contract in `wit/policy.wit` (`pd:policy@1.0.0`), the least-loaded test cases
//! in `cases/`, and a README. Its cases fail a policy that answers "the first node", so an author who breaks the
//! logic finds out.
//!
//! Every file is compiled into the binary (`include_str!`): the template is always the one
//! this gateway was built with.

use std::path::{Path, PathBuf};

/// A policy language.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    /// Rust (`cargo`, target `wasm32-wasip2`).
    Rust,
    /// Python (`componentize-py`).
    Python,
    /// JavaScript (`componentize-js`).
    Js,
    /// Go (`wit-bindgen go`, wasip1 + the reactor adapter).
    Go,
    /// C (clang + wasi-libc, `wit-bindgen c`).
    C,
}

/// Why a template could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The name cannot name a folder and a package.
    #[error(
        "policy name `{0}`: use 1 to 64 lowercase ASCII letters, digits and '-', starting with a letter"
    )]
    BadName(String),
    /// The folder exists.
    #[error("{0} already exists")]
    Exists(PathBuf),
    /// Writing failed.
    #[error("{path}: {source}")]
    Io {
        /// What was written.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// The contract, `pd:policy@1.0.0`, the same for every language.
const WIT: &str = include_str!("../../../wit/policy.wit");
const TOOLS: &str = include_str!("../../../policies/tools.sh");

/// The least-loaded cases, shared by every language's template.
const CASES: [(&str, &str); 4] = [
    (
        "split-spreads-nothing-onto-busy-nodes.json",
        include_str!(
            "../../../policies/cases/least-loaded/split-spreads-nothing-onto-busy-nodes.json"
        ),
    ),
    (
        "whole-ties-go-to-free-blocks-then-index.json",
        include_str!(
            "../../../policies/cases/least-loaded/whole-ties-go-to-free-blocks-then-index.json"
        ),
    ),
    (
        "draining-only-when-the-whole-role-drains.json",
        include_str!(
            "../../../policies/cases/least-loaded/draining-only-when-the-whole-role-drains.json"
        ),
    ),
    (
        "reject-without-a-pair-or-a-standalone-node.json",
        include_str!(
            "../../../policies/cases/least-loaded/reject-without-a-pair-or-a-standalone-node.json"
        ),
    ),
];

/// The language's own files: (path in the folder, contents, executable).
fn sources(lang: Lang) -> Vec<(&'static str, &'static str, bool)> {
    match lang {
        Lang::Rust => vec![
            (
                "Cargo.toml",
                include_str!("../../../policies/templates/rust/Cargo.toml.template"),
                false,
            ),
            (
                "src/lib.rs",
                include_str!("../../../policies/templates/rust/src/lib.rs"),
                false,
            ),
            (
                "build.sh",
                include_str!("../../../policies/templates/rust/build.sh"),
                true,
            ),
        ],
        Lang::Python => vec![
            (
                "app.py",
                include_str!("../../../policies/python/least-loaded/app.py"),
                false,
            ),
            (
                "build.sh",
                include_str!("../../../policies/python/build.sh"),
                true,
            ),
        ],
        Lang::Js => vec![
            (
                "policy.js",
                include_str!("../../../policies/js/least-loaded/policy.js"),
                false,
            ),
            (
                "build.sh",
                include_str!("../../../policies/js/build.sh"),
                true,
            ),
        ],
        Lang::Go => vec![
            (
                "least_loaded.go",
                include_str!("../../../policies/go/least-loaded/least_loaded.go"),
                false,
            ),
            (
                "build.sh",
                include_str!("../../../policies/go/build.sh"),
                true,
            ),
            ("tools.sh", TOOLS, false),
        ],
        Lang::C => vec![
            (
                "policy.c",
                include_str!("../../../policies/c/least-loaded/policy.c"),
                false,
            ),
            (
                "build.sh",
                include_str!("../../../policies/c/build.sh"),
                true,
            ),
            ("tools.sh", TOOLS, false),
        ],
    }
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// Writes the `lang` template for policy `name` into `dir/name`; returns that folder.
///
/// # Errors
///
/// [`TemplateError::BadName`], [`TemplateError::Exists`] when the folder exists (nothing is
/// overwritten), [`TemplateError::Io`] when a file cannot be written.
pub fn write(lang: Lang, name: &str, dir: &Path) -> Result<PathBuf, TemplateError> {
    if !valid_name(name) {
        return Err(TemplateError::BadName(name.to_string()));
    }
    let folder = dir.join(name);
    if folder.exists() {
        return Err(TemplateError::Exists(folder));
    }
    let mut files: Vec<(String, String, bool)> = sources(lang)
        .into_iter()
        .map(|(p, c, x)| (p.to_string(), c.replace("{{name}}", name), x))
        .collect();
    files.push(("wit/policy.wit".into(), WIT.into(), false));
    files.extend(
        CASES
            .iter()
            .map(|(p, c)| (format!("cases/{p}"), (*c).to_string(), false)),
    );
    files.push(("README.md".into(), readme(lang, name), false));
    for (path, contents, executable) in files {
        let path = folder.join(path);
        let io = |source| TemplateError::Io {
            path: path.clone(),
            source,
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        std::fs::write(&path, contents).map_err(io)?;
        if executable {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).map_err(io)?;
        }
    }
    Ok(folder)
}

/// What to do next, for the terminal.
pub fn next_steps(lang: Lang, folder: &Path) -> String {
    let f = folder.display();
    format!(
        "created {f} ({lang:?}, least-loaded to start from)\n\
         build:  bash {f}/build.sh {f} {f}/policy.wasm\n\
         test:   pd-gateway policy test {f}/policy.wasm --cases {f}/cases{limits}\n\
         push:   pd-gateway policy push {f}/policy.wasm --admin http://127.0.0.1:8081 --token-file FILE{limits}",
        limits = limits(lang)
    )
}

/// Flags an interpreted guest needs (it runs a language runtime in each fresh instance).
fn limits(lang: Lang) -> &'static str {
    match lang {
        Lang::Python | Lang::Js => " --deadline-ms 20 --fuel 1000000000 --memory-mib 64",
        Lang::Go => " --deadline-ms 10 --fuel 200000000 --memory-mib 64",
        Lang::Rust | Lang::C => "",
    }
}

fn readme(lang: Lang, name: &str) -> String {
    format!(
        "# {name}: a routing policy for pd-gateway ({lang:?})\n\n\
         Started from the least-loaded template. The contract is `wit/policy.wit` (every field of\n\
         the request, the view and the decision, with units); the gateway calls `decide` once per\n\
         request in a fresh instance.\n\n\
         ```sh\n\
         bash build.sh . {name}.wasm                                  # toolchain installed once, cached\n\
         pd-gateway policy test {name}.wasm --cases cases{limits}     # every case must pass\n\
         pd-gateway policy push {name}.wasm --admin http://127.0.0.1:8081 --token-file FILE{limits}\n\
         ```\n\n\
         `cases/` holds recorded (request, view, expected decision) cases in the gateway's record\n\
         format; they fail a policy that answers \"the first node\". Add your own, or record real\n\
         ones with `pd-gateway policy decisions` (JSONL: a `.jsonl` file in `cases/` is read line\n\
         by line), and see what your policy changes on real traffic with\n\
         `pd-gateway policy replay decisions.jsonl --policy {name}.wasm`.\n",
        limits = limits(lang)
    )
}
