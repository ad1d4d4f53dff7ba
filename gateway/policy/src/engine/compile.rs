//! Compiling a component once: an in-memory cache of compiled components, by sha256 of their
//! bytes, in front of the engine's on-disk cache (`precompiled.rs`), in front of compiling.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use wasmtime::Engine;
use wasmtime::component::Component;

use crate::PolicyError;
use crate::precompiled::DiskCache;

/// Compiled components kept in memory, by sha256 of their bytes.
const COMPILE_CACHE_ENTRIES: usize = 16;

/// Where a loaded policy's machine code came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompiledFrom {
    /// Compiled by this load.
    Compiled,
    /// The engine's in-memory cache (the same bytes were loaded before by this process).
    Memory,
    /// The on-disk cache (compiled by an earlier load, maybe by an earlier process).
    Disk,
}

/// The engine's compiled components: the last [`COMPILE_CACHE_ENTRIES`] in memory, all of them
/// on disk when the engine has a cache directory.
pub(super) struct CompileCache {
    memory: Mutex<Vec<([u8; 32], Component)>>,
    disk: Option<DiskCache>,
}

impl CompileCache {
    pub(super) fn new(disk: Option<DiskCache>) -> Self {
        CompileCache {
            memory: Mutex::new(Vec::new()),
            disk,
        }
    }

    /// The on-disk cache directory, if any.
    pub(super) fn disk_dir(&self) -> Option<&Path> {
        self.disk.as_ref().map(DiskCache::dir)
    }

    /// The component of `wasm` (whose sha256 is `digest`, `sha256` in hex), from memory, else
    /// from disk, else compiled now (and kept in both); `name` names the policy in errors and
    /// logs.
    ///
    /// # Errors
    ///
    /// [`PolicyError::Compile`] when `wasm` is not a valid component.
    pub(super) fn get(
        &self,
        engine: &Engine,
        name: &str,
        digest: [u8; 32],
        sha256: &str,
        wasm: &[u8],
    ) -> Result<(Component, CompiledFrom), PolicyError> {
        let cached = |cache: &Vec<([u8; 32], Component)>| {
            cache
                .iter()
                .find(|(d, _)| *d == digest)
                .map(|(_, c)| c.clone())
        };
        if let Some(c) = cached(&self.memory()) {
            return Ok((c, CompiledFrom::Memory));
        }
        let compile_err = |e: wasmtime::Error| PolicyError::Compile {
            name: name.to_string(),
            source: e.into_boxed_dyn_error(),
        };
        let started = Instant::now();
        let (component, from) = match &self.disk {
            Some(disk) => match disk.load(engine, sha256) {
                Some(c) => (c, CompiledFrom::Disk),
                None => (
                    disk.compile_and_store(engine, sha256, wasm)
                        .map_err(compile_err)?,
                    CompiledFrom::Compiled,
                ),
            },
            None => (
                Component::new(engine, wasm).map_err(compile_err)?,
                CompiledFrom::Compiled,
            ),
        };
        tracing::debug!(policy = %name, ?from, elapsed = ?started.elapsed(), "policy compiled");
        let mut cache = self.memory();
        if cached(&cache).is_none() {
            if cache.len() >= COMPILE_CACHE_ENTRIES {
                cache.remove(0);
            }
            cache.push((digest, component.clone()));
        }
        Ok((component, from))
    }

    fn memory(&self) -> MutexGuard<'_, Vec<([u8; 32], Component)>> {
        // The cache holds no invariant a panic could break: use it even if poisoned.
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }
}
