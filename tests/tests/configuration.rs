//! `docs/configuration.md` is the binaries' own `--help`, word for word: every command and
//! subcommand of `pd-node` and `pd-gateway` (found by walking each help's `Commands:` list), one
//! `## <command>` heading and one ```` ```text ```` block each. When a flag changes and the file
//! does not, this test fails and names the command that rewrites the file:
//! `PD_BLESS=1 cargo test -p pd-cluster-tests --test cluster configuration`.
//!
//! The help is taken as a user without any of the binaries' environment variables set sees it:
//! every `PD_*` variable, and every variable clap shows as `[env: NAME=...]`, is removed from the
//! child's environment (otherwise the help prints their values), and `COLUMNS` is fixed. Lines
//! are compared without trailing spaces, which editors strip. No model, no network.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use pd_cluster_tests::bins;

/// The command that rewrites `docs/configuration.md` from the binaries.
const BLESS: &str = "PD_BLESS=1 cargo test -p pd-cluster-tests --test cluster configuration";

/// The terminal width the help is rendered for.
const COLUMNS: &str = "100";

/// What the file says before the first command, when it has nothing there yet.
const INTRO: &str = "# Configuration

Every command and flag of `pd-node` and `pd-gateway`, as their `--help` prints it (no
environment variable set). This file is generated: `tests/tests/configuration.rs` compares it
with the binaries' help and fails when they differ; rewrite it with

```sh
cargo build -p pd-node -p pd-gateway
PD_BLESS=1 cargo test -p pd-cluster-tests --test cluster configuration
```

Where a flag fits in a deployment: [operations.md](operations.md); the policy flags:
[policies.md](policies.md); the GPU build: [gpu.md](gpu.md).
";

/// `docs/configuration.md` in this workspace.
fn doc_path() -> PathBuf {
    bins::workspace_root().join("docs").join("configuration.md")
}

/// Each line without its trailing spaces, no trailing blank lines.
fn normalized(text: &str) -> String {
    let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    lines.join("\n").trim_end().to_owned()
}

/// The names clap shows as `[env: NAME=...]` in `help`.
fn env_names(help: &str) -> BTreeSet<String> {
    help.match_indices("[env: ")
        .filter_map(|(at, tag)| {
            let rest = &help[at + tag.len()..];
            rest.find('=').map(|end| rest[..end].to_owned())
        })
        .collect()
}

/// `bin args... --help` with the `PD_*` variables, `strip` and forced colour removed.
fn run_help(bin: &Path, args: &[String], strip: &BTreeSet<String>) -> String {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .arg("--help")
        .env("COLUMNS", COLUMNS)
        .env_remove("CLICOLOR_FORCE");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("PD_") {
            cmd.env_remove(&name);
        }
    }
    for name in strip {
        cmd.env_remove(name);
    }
    let out = cmd.output().expect("running a binary's --help");
    let shown = format!("{} {} --help", bin.display(), args.join(" "));
    assert!(
        out.status.success(),
        "{shown} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap_or_else(|e| panic!("{shown} printed non-UTF-8: {e}"))
}

/// One command's help as a user with none of its environment variables set sees it.
fn help(bin: &Path, args: &[String]) -> String {
    let first = run_help(bin, args, &BTreeSet::new());
    let named = env_names(&first);
    let text = if named.is_empty() {
        first
    } else {
        run_help(bin, args, &named)
    };
    normalized(&text)
}

/// The subcommands a help lists under `Commands:`, `help` left out.
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

/// `(command, help)` for `name` and all its subcommands, depth first, in the help's order.
fn walk(bin: &Path, name: &str, args: Vec<String>, into: &mut Vec<(String, String)>) {
    let text = help(bin, &args);
    let subs = subcommands(&text);
    let command = std::iter::once(name.to_owned())
        .chain(args.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ");
    into.push((command, text));
    for sub in subs {
        let mut next = args.clone();
        next.push(sub);
        walk(bin, name, next, into);
    }
}

/// Every command of both binaries with its help, as built in this workspace.
fn generated() -> Vec<(String, String)> {
    let mut all = Vec::new();
    for name in ["pd-node", "pd-gateway"] {
        walk(&bins::binary(name), name, Vec::new(), &mut all);
    }
    all
}

/// The file's intro (everything before the first `## `) and its `(command, block)` pairs.
fn documented(doc: &str) -> (String, Vec<(String, String)>) {
    let mut intro = String::new();
    let mut sections = Vec::new();
    let mut lines = doc.lines();
    let mut heading = None;
    while let Some(line) = lines.next() {
        if let Some(command) = line.strip_prefix("## ") {
            heading = Some(command.trim().to_owned());
            continue;
        }
        match heading.take() {
            None => {
                intro.push_str(line);
                intro.push('\n');
            }
            Some(command) if line.trim().is_empty() => heading = Some(command),
            Some(command) => {
                let block = if line.trim() == "```text" {
                    let body: Vec<&str> =
                        lines.by_ref().take_while(|l| l.trim() != "```").collect();
                    normalized(&body.join("\n"))
                } else {
                    format!("(no ```text block under this heading; found {line:?})")
                };
                sections.push((command, block));
            }
        }
    }
    if let Some(command) = heading {
        sections.push((command, "(no ```text block under this heading)".to_owned()));
    }
    (intro, sections)
}

/// The whole file for `sections`, under `intro`.
fn render(intro: &str, sections: &[(String, String)]) -> String {
    let mut doc = intro.trim_end().to_owned();
    doc.push('\n');
    for (command, text) in sections {
        write!(doc, "\n## {command}\n\n```text\n{text}\n```\n").expect("writing to a String");
    }
    doc
}

/// What differs between the file and the binaries, one line per command.
fn differences(documented: &[(String, String)], generated: &[(String, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (command, text) in generated {
        match documented.iter().find(|(c, _)| c == command) {
            None => out.push(format!("`{command}`: not in the file")),
            Some((_, doc)) if doc != text => {
                let want: Vec<&str> = text.lines().collect();
                let got: Vec<&str> = doc.lines().collect();
                let at = (0..want.len().max(got.len()))
                    .find(|&i| want.get(i) != got.get(i))
                    .unwrap_or(0);
                let (line, want, got) = (
                    at + 1,
                    want.get(at).copied().unwrap_or("(end)"),
                    got.get(at).copied().unwrap_or("(end)"),
                );
                out.push(format!(
                    "`{command}`: line {line} of its help is {want:?}, the file has {got:?}"
                ));
            }
            Some(_) => {}
        }
    }
    for (command, _) in documented {
        if !generated.iter().any(|(c, _)| c == command) {
            out.push(format!("`{command}`: in the file, but no such command"));
        }
    }
    let order = |s: &[(String, String)]| s.iter().map(|(c, _)| c.clone()).collect::<Vec<_>>();
    if out.is_empty() && order(documented) != order(generated) {
        out.push("the commands are in another order than the binaries list them".to_owned());
    }
    out
}

#[test]
fn configuration_md_is_the_binaries_help() {
    let path = doc_path();
    let generated = generated();
    assert!(
        generated.iter().any(|(c, _)| c == "pd-node serve")
            && generated.iter().any(|(c, _)| c == "pd-gateway serve"),
        "the walk missed a `serve` command: {:?}",
        generated.iter().map(|(c, _)| c).collect::<Vec<_>>()
    );
    let existing = std::fs::read_to_string(&path).unwrap_or_default();
    let (intro, documented) = documented(&existing);

    if std::env::var_os("PD_BLESS").is_some_and(|v| v == "1") {
        let intro = if intro.trim().is_empty() {
            INTRO
        } else {
            &intro
        };
        std::fs::write(&path, render(intro, &generated))
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        eprintln!(
            "rewrote {} from {} commands' help",
            path.display(),
            generated.len()
        );
        return;
    }

    let diff = differences(&documented, &generated);
    assert!(
        diff.is_empty(),
        "{} does not match the binaries' --help (built by `cargo build -p pd-node -p pd-gateway`):\n  \
         {}\nRegenerate it with `{BLESS}` and commit the result.",
        path.display(),
        diff.join("\n  ")
    );
}

#[test]
fn the_help_is_read_without_the_environments_values() {
    let help = "  --engine-id <ID>\n      [env: PD_ENGINE_ID=node-7]\n  --x\n      [env: OTHER=]\n";
    assert_eq!(
        env_names(help),
        BTreeSet::from(["PD_ENGINE_ID".to_owned(), "OTHER".to_owned()])
    );
    let list = "Usage: x <COMMAND>\n\nCommands:\n  serve  Serve\n  policy  Manage\n  help  Print\n\nOptions:\n  -h\n";
    assert_eq!(subcommands(list), ["serve", "policy"]);
    let sections = vec![
        ("x".to_owned(), "Usage: x\n\nOptions:".to_owned()),
        ("x serve".to_owned(), "a\n\nb".to_owned()),
    ];
    let doc = render(INTRO, &sections);
    let (intro, parsed) = documented(&doc);
    assert_eq!(parsed, sections);
    assert_eq!(intro.trim_end(), INTRO.trim_end());
    assert!(differences(&parsed, &sections).is_empty());
    let changed = vec![
        sections[0].clone(),
        ("x serve".to_owned(), "a\n\nc".to_owned()),
    ];
    assert_eq!(
        differences(&parsed, &changed),
        ["`x serve`: line 3 of its help is \"c\", the file has \"b\""]
    );
}
