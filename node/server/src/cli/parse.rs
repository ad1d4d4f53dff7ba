//! Parsers of `pd-node serve`'s values (sizes, dtypes, layouts, GGUF weight policies).

/// Parses `--gguf-weights`.
pub(super) fn parse_gguf_weights(s: &str) -> Result<pd_model::gguf::QuantPolicy, String> {
    use pd_model::gguf::QuantPolicy;
    match s {
        "fast" => Ok(QuantPolicy::Fast),
        "candle-kernels" => Ok(QuantPolicy::CandleKernels),
        "as-stored" => Ok(QuantPolicy::AsStored),
        "dense" => Ok(QuantPolicy::Dense),
        _ => Err(format!(
            "unknown --gguf-weights {s:?}: fast, candle-kernels, as-stored or dense"
        )),
    }
}

/// Parses `--kv-cache-dtype`: `f32`, `f16` or `bf16`.
///
/// # Errors
/// A message naming the accepted values.
pub fn parse_kv_dtype(input: &str) -> Result<pd_kv_pool::KvDtype, String> {
    use pd_kv_pool::KvDtype;
    [KvDtype::F32, KvDtype::F16, KvDtype::BF16]
        .into_iter()
        .find(|d| d.as_str() == input)
        .ok_or_else(|| format!("`{input}` is not a KV dtype: use f32, f16 or bf16"))
}

/// Parses `--dtype`: `auto`, `f32`, `f16` or `bf16` (and their long names).
///
/// # Errors
/// A message naming the accepted values.
pub fn parse_model_dtype(input: &str) -> Result<pd_engine::ModelDtype, String> {
    pd_engine::ModelDtype::parse(input)
        .ok_or_else(|| format!("`{input}` is not a model dtype: use auto, f32, f16 or bf16"))
}

/// Parses `--kv-layout`: `hnd` or `nhd`.
///
/// # Errors
/// A message naming the accepted values.
pub fn parse_kv_layout(input: &str) -> Result<pd_kv_pool::KvOrder, String> {
    pd_kv_pool::KvOrder::parse(input)
        .ok_or_else(|| format!("`{input}` is not a KV layout: use hnd or nhd"))
}

/// Parses a byte size: `1048576`, `256MiB`, `1GiB`, `512k`, `1.5G`, `500MB`.
/// Binary units (`KiB`, `MiB`, `GiB`, `TiB` and the bare `K`, `M`, `G`, `T`) are powers of
/// 1024; `KB`, `MB`, `GB`, `TB` are powers of 1000.
///
/// # Errors
/// A message naming the input when it is not a size.
pub fn parse_size(input: &str) -> Result<usize, String> {
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let multiplier: u64 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "unknown size unit in {input:?} (use B, KiB, MiB, GiB, KB, MB, GB)"
            ));
        }
    };
    let bytes = if let Ok(n) = number.parse::<u64>() {
        n.checked_mul(multiplier)
    } else {
        let f: f64 = number
            .parse()
            .map_err(|_| format!("not a size: {input:?}"))?;
        let bytes = f * multiplier as f64;
        (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
    };
    bytes
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| format!("size out of range: {input:?}"))
}
