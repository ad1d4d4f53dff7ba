//! `pd-gateway policy ...`: writing, testing and replaying policies here, and pushing them to a
//! running gateway's admin API.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use pd_gateway::cases;
use pd_gateway::replay;
use pd_gateway::template::{self, Lang};
use pd_policy::PolicySpec;

use crate::{engine_with_cache, parse_config};

#[derive(Args, Debug)]
pub(crate) struct AdminArgs {
    /// The gateway's admin API.
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    admin: String,
    /// Admin token (also PD_ADMIN_TOKEN).
    #[arg(long)]
    token: Option<String>,
    /// A file holding the admin token (as written by `serve`).
    #[arg(long)]
    token_file: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub(crate) enum PolicyCommand {
    /// Compile, smoke-test and install a policy on a running gateway.
    Push {
        /// The policy component.
        file: PathBuf,
        #[command(flatten)]
        admin: AdminArgs,
        /// Name shown in metrics and the admin API (default: the file's stem).
        #[arg(long)]
        name: Option<String>,
        /// Decision deadline, milliseconds (the push's smoke test refuses a policy that cannot
        /// decide within it).
        #[arg(long)]
        deadline_ms: Option<f64>,
        /// Memory a policy instance may use, MiB.
        #[arg(long)]
        memory_mib: Option<usize>,
        /// Fuel one decision may use.
        #[arg(long)]
        fuel: Option<u64>,
        /// Instances made ahead of requests (0 to 8; default: the gateway's --policy-spares).
        #[arg(long)]
        spares: Option<usize>,
        /// Configuration, KEY=VALUE (repeatable).
        #[arg(long)]
        config: Vec<String>,
        /// Declare the policy stateless before pushing it (a `pd:policy/stateless` custom
        /// section, which changes its sha256): the gateway then calls it in warm instances
        /// reused across calls. Only for a policy whose answer depends on nothing but its
        /// arguments and whose memory does not grow per call.
        #[arg(long)]
        stateless: bool,
    },
    /// Write a new policy from a template: source, build script, WIT, and test cases.
    New {
        /// The policy's language.
        #[arg(long, value_enum)]
        lang: Lang,
        /// The policy's name (a folder of this name is created).
        name: String,
        /// Where to create the folder.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Run a policy against recorded cases; non-zero exit on any mismatch.
    Test {
        /// The policy component (or native:NAME).
        file: String,
        /// A folder of cases (*.json, *.jsonl), or one case file.
        #[arg(long)]
        cases: PathBuf,
        /// Times each case runs (for the latency percentiles).
        #[arg(long, default_value_t = 10)]
        repeat: usize,
        #[command(flatten)]
        limits: LocalLimits,
    },
    /// Replay a decision log through another policy and report what changes.
    Replay {
        /// A decision log (JSONL, from --decision-log or GET /admin/decisions).
        log: PathBuf,
        /// The policy to replay (a component, or native:NAME).
        #[arg(long)]
        policy: String,
        /// Compare with this policy run on the same records instead of the recorded decisions.
        #[arg(long)]
        baseline: Option<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        limits: LocalLimits,
    },
    /// Print a running gateway's recent decisions (JSONL, for replay or test cases).
    Decisions {
        #[command(flatten)]
        admin: AdminArgs,
        /// How many (the latest).
        #[arg(long, default_value_t = 1000)]
        limit: usize,
    },
    /// Show the policy serving now.
    Show {
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Go back to the previous policy.
    Rollback {
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Run a policy against the live view and a sample request; installs nothing.
    DryRun {
        /// The policy component.
        file: PathBuf,
        #[command(flatten)]
        admin: AdminArgs,
        /// Prompt length of the sample request.
        #[arg(long, default_value_t = 64)]
        prompt_tokens: u32,
        /// Completions of the sample request.
        #[arg(long, default_value_t = 1)]
        n: u32,
        /// Model (default: the first live one).
        #[arg(long)]
        model: Option<String>,
    },
}

/// Limits of a policy run here (`policy test`, `policy replay`): as the gateway would.
#[derive(Args, Debug)]
pub(crate) struct LocalLimits {
    /// Decision deadline, milliseconds.
    #[arg(long, default_value_t = 1.0)]
    deadline_ms: f64,
    /// Memory a policy instance may use, MiB.
    #[arg(long, default_value_t = 16)]
    memory_mib: usize,
    /// Fuel one decision may use.
    #[arg(long, default_value_t = pd_policy::DEFAULT_FUEL)]
    fuel: u64,
    /// Configuration, KEY=VALUE (repeatable).
    #[arg(long)]
    config: Vec<String>,
}

impl LocalLimits {
    fn spec(&self) -> anyhow::Result<PolicySpec> {
        Ok(PolicySpec {
            config: parse_config(&self.config)?,
            deadline: Duration::from_secs_f64(self.deadline_ms / 1000.0),
            memory_limit: self.memory_mib << 20,
            fuel: self.fuel,
            ..PolicySpec::default()
        })
    }
}

fn admin_client(a: &AdminArgs) -> anyhow::Result<(reqwest::Client, String, String)> {
    let token = match (&a.token, &a.token_file) {
        (Some(t), _) => t.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading {}", f.display()))?
            .trim()
            .to_owned(),
        (None, None) => std::env::var("PD_ADMIN_TOKEN")
            .ok()
            .context("give --token, --token-file or PD_ADMIN_TOKEN")?,
    };
    Ok((
        reqwest::Client::new(),
        a.admin.trim_end_matches('/').to_owned(),
        token,
    ))
}

/// The commands that run here, without a gateway.
pub(crate) fn policy_local(cmd: PolicyCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        PolicyCommand::New { lang, name, dir } => {
            let folder = template::write(lang, &name, &dir)?;
            println!("{}", folder.display());
            eprintln!("{}", template::next_steps(lang, &folder));
            Ok(ExitCode::SUCCESS)
        }
        PolicyCommand::Test {
            file,
            cases: dir,
            repeat,
            limits,
        } => {
            let cases = cases::read_cases(&dir)?;
            let engine = engine_with_cache(pd_policy::default_cache_dir())?;
            let policy = cases::load_policy(&engine, &file, limits.spec()?)?;
            if let pd_policy::Installed::Wasm(w) = &policy {
                println!("{file}: pd:policy@{}", w.contract());
            }
            let report = cases::run_cases(&policy, &cases, repeat);
            print!("{report}");
            Ok(if report.failures() == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        PolicyCommand::Replay {
            log,
            policy,
            baseline,
            json,
            limits,
        } => {
            let records: Vec<pd_policy::Record> = cases::read_cases(&log)?
                .into_iter()
                .map(|c| c.record)
                .collect();
            let engine = engine_with_cache(pd_policy::default_cache_dir())?;
            let spec = limits.spec()?;
            let after = cases::load_policy(&engine, &policy, spec.clone())?;
            let before = baseline
                .map(|b| cases::load_policy(&engine, &b, spec))
                .transpose()?;
            let report = replay::replay(&records, &after, before.as_ref());
            if json {
                println!("{}", serde_json::to_string_pretty(&report.to_json())?);
            } else {
                print!("{report}");
            }
            Ok(ExitCode::SUCCESS)
        }
        remote => policy(remote).map(|()| ExitCode::SUCCESS),
    }
}

fn policy(cmd: PolicyCommand) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let (client, url, req) = match &cmd {
            PolicyCommand::Push {
                file,
                admin,
                name,
                deadline_ms,
                memory_mib,
                fuel,
                spares,
                config,
                stateless,
            } => {
                let (c, base, token) = admin_client(admin)?;
                let mut q: HashMap<String, String> = parse_config(config)?
                    .into_iter()
                    .map(|(k, v)| (format!("config.{k}"), v))
                    .collect();
                let stem = file.file_stem().map(|s| s.to_string_lossy().into_owned());
                if let Some(n) = name.clone().or(stem) {
                    q.insert("name".into(), n);
                }
                if let Some(d) = deadline_ms {
                    q.insert("deadline_ms".into(), d.to_string());
                }
                if let Some(m) = memory_mib {
                    q.insert("memory_mib".into(), m.to_string());
                }
                if let Some(f) = fuel {
                    q.insert("fuel".into(), f.to_string());
                }
                if let Some(n) = spares {
                    q.insert("spares".into(), n.to_string());
                }
                let mut bytes =
                    std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
                if *stateless {
                    bytes = pd_policy::declare_stateless(&bytes);
                }
                let url = format!("{base}/admin/policy");
                let req = c.put(&url).query(&q).bearer_auth(token).body(bytes);
                (c, url, req)
            }
            PolicyCommand::Show { admin } => {
                let (c, base, token) = admin_client(admin)?;
                let url = format!("{base}/admin/policy");
                let req = c.get(&url).bearer_auth(token);
                (c, url, req)
            }
            PolicyCommand::Decisions { admin, limit } => {
                let (c, base, token) = admin_client(admin)?;
                let url = format!("{base}/admin/decisions");
                let req = c
                    .get(&url)
                    .query(&[("limit", limit.to_string())])
                    .bearer_auth(token);
                let resp = req.send().await.with_context(|| format!("calling {url}"))?;
                let status = resp.status();
                let text = resp.text().await?;
                if !status.is_success() {
                    bail!("{url} answered {status}: {text}");
                }
                print!("{text}");
                return Ok(());
            }
            PolicyCommand::New { .. }
            | PolicyCommand::Test { .. }
            | PolicyCommand::Replay { .. } => bail!("runs locally, not against a gateway"),
            PolicyCommand::Rollback { admin } => {
                let (c, base, token) = admin_client(admin)?;
                let url = format!("{base}/admin/policy/rollback");
                let req = c.post(&url).bearer_auth(token);
                (c, url, req)
            }
            PolicyCommand::DryRun {
                file,
                admin,
                prompt_tokens,
                n,
                model,
            } => {
                let (c, base, token) = admin_client(admin)?;
                let mut q = vec![
                    ("prompt_tokens", prompt_tokens.to_string()),
                    ("n", n.to_string()),
                ];
                if let Some(m) = model {
                    q.push(("model", m.clone()));
                }
                let bytes =
                    std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
                let url = format!("{base}/admin/policy/dry-run");
                let req = c.post(&url).query(&q).bearer_auth(token).body(bytes);
                (c, url, req)
            }
        };
        drop(client);
        let resp = req.send().await.with_context(|| format!("calling {url}"))?;
        let status = resp.status();
        let text = resp.text().await?;
        let pretty = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or(text);
        println!("{pretty}");
        if !status.is_success() {
            bail!("{url} answered {status}");
        }
        Ok(())
    })
}
