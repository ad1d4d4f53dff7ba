//! [`ModelSource`]: what `--model PATH` names — a Hugging Face directory, a GGUF file, or a
//! directory holding one GGUF file — and the model and tokenizer built from it.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use pd_tokenize::Tokenizer;

use crate::config::HfConfig;
use crate::error::ModelError;
use crate::gguf::{GgufFile, QuantPolicy};
use crate::llama::{Model, safetensors_files};

/// Files up to this size are hashed whole by [`ModelSource::fingerprint`]; larger ones are
/// sampled.
pub const FINGERPRINT_FULL_BYTES: u64 = 256 << 20;

/// Feeds `path`'s name, size and (sampled) bytes to `h`.
fn fingerprint_file(h: &mut xxhash_rust::xxh3::Xxh3, path: &Path) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    const CHUNK: u64 = 1 << 20;
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    h.update(name.unwrap_or_default().as_bytes());
    h.update(&len.to_le_bytes());
    let mut buf = vec![0u8; CHUNK as usize];
    let mut read_at = |h: &mut xxhash_rust::xxh3::Xxh3, at: u64, n: u64| -> std::io::Result<()> {
        file.seek(SeekFrom::Start(at))?;
        let n = n.min(len - at) as usize;
        file.read_exact(&mut buf[..n])?;
        h.update(&buf[..n]);
        Ok(())
    };
    if len <= FINGERPRINT_FULL_BYTES {
        let mut at = 0;
        while at < len {
            read_at(h, at, CHUNK)?;
            at += CHUNK;
        }
    } else {
        let last = len - CHUNK;
        for i in 0..=65u64 {
            // 0 (the head), 64 evenly spaced chunks, `last` (the tail).
            read_at(h, (last * i) / 65, CHUNK)?;
        }
    }
    Ok(())
}
use crate::weights::{SafetensorsWeights, check_weight_dtypes};

/// A model on disk, in one of the formats the engine reads.
#[derive(Debug)]
pub enum ModelSource {
    /// A Hugging Face directory: `config.json`, `*.safetensors`, tokenizer files.
    HfDir(PathBuf),
    /// A GGUF file (weights, config and tokenizer in one file); its header is read.
    Gguf(Box<GgufFile>),
}

impl ModelSource {
    /// Finds the model at `path`: a GGUF file (by its magic bytes, whatever its name); a directory with `config.json` (Hugging
    /// Face); or a directory without `config.json` holding exactly one `*.gguf` file.
    ///
    /// # Errors
    /// [`ModelError::NoModel`] when `path` is none of these (naming the GGUF files when there
    /// are several); GGUF header errors from [`GgufFile::open`].
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let no_model = |why: String| ModelError::NoModel {
            path: path.to_path_buf(),
            why,
        };
        if path.is_file() {
            return if is_gguf(path)? {
                Ok(Self::Gguf(Box::new(GgufFile::open(path)?)))
            } else {
                Err(no_model(
                    "a file must be a GGUF model (it does not start with \"GGUF\"); otherwise \
                     give a directory"
                        .into(),
                ))
            };
        }
        if !path.is_dir() {
            return Err(no_model("no such file or directory".into()));
        }
        if path.join("config.json").exists() {
            return Ok(Self::HfDir(path.to_path_buf()));
        }
        let rd = std::fs::read_dir(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut ggufs: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "gguf"))
            .collect();
        ggufs.sort();
        match ggufs.as_slice() {
            [one] => Ok(Self::Gguf(Box::new(GgufFile::open(one)?))),
            [] => Err(no_model(
                "neither config.json (Hugging Face) nor a *.gguf file".into(),
            )),
            many => Err(no_model(format!(
                "several GGUF files ({}); name one",
                many.iter()
                    .filter_map(|p| p.file_name())
                    .map(|n| n.to_string_lossy())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// A fingerprint of the weights and tokenizer (16 hex digits): two nodes whose fingerprints
    /// differ must never read each other's KV, whatever their served names say.
    ///
    /// xxh3-64 over, per file in a fixed order (GGUF: the file; Hugging Face: `config.json`,
    /// the tokenizer files, every `*.safetensors` by name), its name, its size and its bytes —
    /// all of them up to [`FINGERPRINT_FULL_BYTES`], beyond that the first and last MiB and
    /// 64 evenly spaced MiB (a different checkpoint differs in every tensor).
    ///
    /// # Errors
    /// [`ModelError::Io`] when a file cannot be read.
    pub fn fingerprint(&self) -> Result<String, ModelError> {
        let files: Vec<PathBuf> = match self {
            Self::Gguf(g) => vec![g.path().to_path_buf()],
            Self::HfDir(dir) => {
                let mut files: Vec<PathBuf> = [
                    "config.json",
                    "tokenizer.json",
                    "tokenizer_config.json",
                    "vocab.json",
                    "merges.txt",
                ]
                .iter()
                .map(|f| dir.join(f))
                .filter(|p| p.is_file())
                .collect();
                files.extend(safetensors_files(dir)?);
                files
            }
        };
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for path in &files {
            fingerprint_file(&mut h, path).map_err(|source| ModelError::Io {
                path: path.clone(),
                source,
            })?;
        }
        Ok(format!("{:016x}", h.digest()))
    }

    /// The name clients use by default: the directory's name, or the GGUF file's name without
    /// `.gguf`.
    pub fn default_name(&self) -> String {
        let name = match self {
            Self::HfDir(dir) => dir.file_name(),
            Self::Gguf(g) => g.path().file_stem(),
        };
        name.map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    }

    /// Loads the model onto `device`, computing in f32 (GGUF weights as
    /// [`QuantPolicy::default`] decides).
    ///
    /// # Errors
    /// Names the unsupported architecture, weight type, missing file or tensor.
    pub fn load_model(&self, device: &Device) -> Result<Model, ModelError> {
        self.load_model_with(device, QuantPolicy::default())
    }

    /// [`ModelSource::load_model`], with GGUF weights held as `policy` says (ignored for
    /// safetensors).
    ///
    /// # Errors
    /// As [`ModelSource::load_model`].
    pub fn load_model_with(
        &self,
        device: &Device,
        policy: QuantPolicy,
    ) -> Result<Model, ModelError> {
        self.load_model_as(device, policy, DType::F32)
    }

    /// [`ModelSource::load_model_with`], computing in `dtype`: f32, or f16/bf16 for a Hugging
    /// Face directory (weights converted at load, activations in that dtype; attention reads
    /// f32 and logits are f32).
    ///
    /// # Errors
    /// As [`ModelSource::load_model`]; [`ModelError::UnsupportedDtype`] for a GGUF file with a
    /// dtype other than f32 (its projections run on f32 kernels).
    pub fn load_model_as(
        &self,
        device: &Device,
        policy: QuantPolicy,
        dtype: DType,
    ) -> Result<Model, ModelError> {
        match self {
            Self::HfDir(dir) => {
                let cfg = HfConfig::from_dir(dir)?.resolve()?;
                let files = safetensors_files(dir)?;
                check_weight_dtypes(&files)?;
                let weights = SafetensorsWeights::open(&files, device, dtype)?;
                Model::from_weights(cfg, &weights, device)
            }
            Self::Gguf(_) if dtype != DType::F32 => Err(ModelError::UnsupportedDtype(format!(
                "{} as the compute dtype of a GGUF model: its weights compute in f32 \
                 (serve a Hugging Face directory to compute in f16 or bf16)",
                dtype.as_str()
            ))),
            Self::Gguf(g) => {
                let cfg = g.config()?;
                let weights = g.weights(&cfg, device, policy)?;
                let model = Model::from_weights(cfg, &weights, device)?;
                tracing::info!(
                    file = %g.path().display(),
                    weights = %weights.summary(),
                    "GGUF weights loaded (stored type→held as ×tensors)"
                );
                Ok(model)
            }
        }
    }

    /// The dtype the checkpoint stores its weights in (`torch_dtype` in config.json: `f32`,
    /// `f16` or `bf16`); `None` for GGUF or when config.json does not say.
    ///
    /// # Errors
    /// An unreadable config.json.
    pub fn stored_dtype(&self) -> Result<Option<DType>, ModelError> {
        let Self::HfDir(dir) = self else {
            return Ok(None);
        };
        Ok(match HfConfig::from_dir(dir)?.torch_dtype.as_deref() {
            Some("float32") => Some(DType::F32),
            Some("float16") => Some(DType::F16),
            Some("bfloat16") => Some(DType::BF16),
            _ => None,
        })
    }

    /// The model's tokenizer and chat template: the directory's tokenizer files, or the one
    /// the GGUF metadata describes (built through its `tokenizer.json` form, see
    /// [`pd_tokenize::GgufVocab`]).
    ///
    /// # Errors
    /// Tokenizer files missing or invalid; a GGUF tokenizer that is not supported, named.
    pub fn tokenizer(&self) -> Result<Tokenizer, ModelError> {
        Ok(match self {
            Self::HfDir(dir) => Tokenizer::from_dir(dir)?,
            Self::Gguf(g) => Tokenizer::from_gguf_vocab(&g.vocab()?)?,
        })
    }
}

/// Whether the file starts with GGUF's magic bytes.
fn is_gguf(path: &Path) -> Result<bool, ModelError> {
    use std::io::Read;
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(io)?;
    match f.read_exact(&mut magic) {
        Ok(()) => Ok(&magic == b"GGUF"),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(io(e)),
    }
}
