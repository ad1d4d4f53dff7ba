//! The on-disk cache of compiled policies: a push or a restart does not compile the same
//! component twice (a Python or JavaScript guest takes seconds to compile).
//!
//! One file per (component, engine): `<dir>/<sha256 of the component>-<engine hash>.cwasm`,
//! where the engine hash is [`Engine::precompile_compatibility_hash`] (wasmtime's version, the
//! target and every setting that changes compiled code). Loading a file is `unsafe` in wasmtime
//! (its bytes are executed as machine code), so the cache trusts only a directory that is ours
//! and private: owned by the gateway's user, mode 0700 (made so when this process creates it;
//! refused otherwise), and files in it that are regular files owned by us. A file that wasmtime
//! refuses anyway (another build) is compiled again and replaced.

use std::fs;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use wasmtime::Engine;
use wasmtime::component::Component;

/// The default cache directory: `$PD_CACHE_DIR/policy-cache`, else
/// `$XDG_CACHE_HOME/pd-serve/policy-cache`, else `~/.cache/pd-serve/policy-cache` (the same
/// cache root as the project's scripts); `None` without any of those variables.
pub fn default_cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let base = env("PD_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("pd-serve")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/pd-serve")))?;
    Some(base.join("policy-cache"))
}

/// A private directory of precompiled components.
#[derive(Debug)]
pub(crate) struct DiskCache {
    dir: PathBuf,
    /// [`Engine::precompile_compatibility_hash`], folded into 64 bits.
    engine_hash: u64,
}

/// Why a cache directory is not used.
#[derive(Debug, thiserror::Error)]
pub enum CacheDirError {
    /// It could not be created or read.
    #[error("policy cache {dir}: {source}")]
    Io {
        /// The directory.
        dir: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// It is not a directory owned by this user with mode 0700.
    #[error(
        "policy cache {dir} is not private (owner uid {uid}, mode {mode:o}): it must be a directory owned by uid {me} with mode 700"
    )]
    NotPrivate {
        /// The directory.
        dir: PathBuf,
        /// Its owner.
        uid: u32,
        /// Its permission bits.
        mode: u32,
        /// This process's user.
        me: u32,
    },
}

fn my_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

impl DiskCache {
    /// Opens `dir`, creating it (and its parents) with mode 0700 when missing.
    pub(crate) fn open(dir: &Path, engine: &Engine) -> Result<Self, CacheDirError> {
        let io = |source| CacheDirError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        if !dir.exists() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io)?;
            // `mode` is filtered by the umask; say it again.
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io)?;
        }
        let meta = fs::symlink_metadata(dir).map_err(io)?;
        let mode = meta.mode() & 0o777;
        if !meta.is_dir() || meta.uid() != my_uid() || mode & 0o077 != 0 {
            return Err(CacheDirError::NotPrivate {
                dir: dir.to_path_buf(),
                uid: meta.uid(),
                mode,
                me: my_uid(),
            });
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        Ok(DiskCache {
            dir: dir.to_path_buf(),
            engine_hash: h.finish(),
        })
    }

    /// The directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, sha256: &str) -> PathBuf {
        self.dir
            .join(format!("{sha256}-{:016x}.cwasm", self.engine_hash))
    }

    /// The component compiled earlier from bytes with this sha256, if the cache holds a file
    /// this engine accepts.
    pub(crate) fn load(&self, engine: &Engine, sha256: &str) -> Option<Component> {
        let path = self.path(sha256);
        let meta = fs::symlink_metadata(&path).ok()?;
        if !meta.is_file() || meta.uid() != my_uid() {
            tracing::warn!(path = %path.display(), "policy cache: not a regular file of ours; ignored");
            return None;
        }
        // Read, not mapped: a mapped file truncated under us would fault at any later call.
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "policy cache: unreadable entry");
                return None;
            }
        };
        // SAFETY: the bytes are a regular file owned by this user in a directory only this
        // user can write (checked in `open`), and only `compile_and_store` writes such files,
        // from `Engine::precompile_component` of this engine's configuration. wasmtime checks
        // the header (version, target, settings) and refuses bytes of another configuration.
        match unsafe { Component::deserialize(engine, &bytes) } {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "policy cache: stale entry; compiling again");
                let _ = fs::remove_file(&path);
                None
            }
        }
    }

    /// Compiles `wasm` and stores the result; returns the component. A failure to write the
    /// file is logged and does not fail the compile.
    pub(crate) fn compile_and_store(
        &self,
        engine: &Engine,
        sha256: &str,
        wasm: &[u8],
    ) -> wasmtime::Result<Component> {
        let compiled = engine.precompile_component(wasm)?;
        // SAFETY: `compiled` was produced just now by this engine's `precompile_component`.
        let component = unsafe { Component::deserialize(engine, &compiled)? };
        let path = self.path(sha256);
        let tmp = self
            .dir
            .join(format!(".{sha256}-{}.tmp", std::process::id()));
        let written = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| {
                f.write_all(&compiled)?;
                f.sync_all()
            })
            .and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            tracing::warn!(path = %path.display(), error = %e, "policy cache: could not store the compiled policy");
        }
        Ok(component)
    }
}
