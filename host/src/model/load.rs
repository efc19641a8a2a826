//! One entry point over the three loaders: pick the format from the path
//! (or take the caller's choice) and return checked [`ModelWeights`].

use std::path::{Path, PathBuf};

use thiserror::Error;

use super::dummy::{self, DummyError};
use super::gguf::{GgufError, GgufFile};
use super::safetensors::{self, SafetensorsError};
use super::{DType, LlamaConfig, ModelWeights};

/// Which loader to use: a configuration value, so it lives in the
/// `config` leaf module.
pub use crate::config::LoadFormat;

/// Why a model cannot be loaded.
#[derive(Debug, Error)]
pub enum ModelError {
    /// The GGUF loader failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The safetensors loader failed.
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    /// Dummy weights cannot be made.
    #[error(transparent)]
    Dummy(#[from] DummyError),
    /// The path is not a model in any format this engine reads.
    #[error("{} is not a model this engine can load: {reason}", path.display())]
    Unrecognized {
        /// The path given.
        path: PathBuf,
        /// What was expected instead.
        reason: String,
    },
}

/// Element type of dummy weights made by [`load`] (vLLM's default dtype
/// for today's checkpoints); call [`load_dummy`] to choose another.
pub const DEFAULT_DUMMY_DTYPE: DType = DType::BF16;

fn is_gguf(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Loads the model at `path` in `format`.
///
/// With [`LoadFormat::Dummy`], the config comes from [`dummy_config`] and
/// the weights are [`DEFAULT_DUMMY_DTYPE`] with seed 0.
pub fn load(path: &Path, format: LoadFormat) -> Result<ModelWeights, ModelError> {
    match format {
        LoadFormat::Gguf => Ok(GgufFile::open(path)?.load_weights()?),
        LoadFormat::Safetensors => Ok(safetensors::load_safetensors(path)?),
        LoadFormat::Dummy => load_dummy(&dummy_config(path)?, DEFAULT_DUMMY_DTYPE, 0),
        LoadFormat::Auto if is_gguf(path) => load(path, LoadFormat::Gguf),
        LoadFormat::Auto if path.join("config.json").is_file() => {
            load(path, LoadFormat::Safetensors)
        }
        LoadFormat::Auto => Err(ModelError::Unrecognized {
            path: path.into(),
            reason: if path.exists() {
                "expected a .gguf file or a directory holding config.json and .safetensors files"
                    .into()
            } else {
                "it does not exist".into()
            },
        }),
    }
}

/// The config for dummy weights named by `path`: a preset name (see
/// [`dummy::presets`]), a `config.json`, a directory holding one, or a
/// `.gguf` file (its metadata).
pub fn dummy_config(path: &Path) -> Result<LlamaConfig, ModelError> {
    if let Some(c) = path.to_str().and_then(dummy::preset) {
        return Ok(c);
    }
    if is_gguf(path) {
        return Ok(GgufFile::open(path)?.llama_config()?);
    }
    let json = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    if json.is_file() {
        return Ok(safetensors::read_config(&json)?);
    }
    let names: Vec<&str> = dummy::presets().into_iter().map(|(n, _)| n).collect();
    Err(ModelError::Unrecognized {
        path: path.into(),
        reason: format!(
            "dummy weights need a config: a preset ({}), a config.json, a directory \
             holding one, or a .gguf file",
            names.join(", ")
        ),
    })
}

/// Random weights of shape `config` in `dtype`, deterministic in `seed`.
pub fn load_dummy(
    config: &LlamaConfig,
    dtype: DType,
    seed: u64,
) -> Result<ModelWeights, ModelError> {
    Ok(dummy::dummy_weights(config, dtype, seed)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::writer::GgufWriter;

    #[test]
    fn auto_picks_the_format_from_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = dummy::preset("smollm2-135m").unwrap();
        config.num_hidden_layers = 1;
        config.vocab_size = 64;
        let w = dummy::dummy_weights(&config, DType::Q8_0, 5).unwrap();
        let gguf = dir.path().join("m.GGUF");
        std::fs::write(&gguf, GgufWriter::from_weights(&w).to_bytes()).unwrap();
        let got = load(&gguf, LoadFormat::Auto).unwrap();
        assert_eq!(
            got.layers[0].wq.storage.bytes(),
            w.layers[0].wq.storage.bytes()
        );
        assert_eq!(dummy_config(&gguf).unwrap(), config);

        let e = load(dir.path(), LoadFormat::Auto).unwrap_err().to_string();
        assert!(
            e.contains("expected a .gguf file or a directory holding config.json"),
            "{e}"
        );
        let e = load(&dir.path().join("nope"), LoadFormat::Auto)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
        let e = load(&gguf, LoadFormat::Safetensors)
            .unwrap_err()
            .to_string();
        assert!(e.contains("config.json is missing"), "{e}");
        let e = load(dir.path(), LoadFormat::Dummy).unwrap_err().to_string();
        assert!(e.contains("smollm2-135m, llama-3.2-1b"), "{e}");
    }

    #[test]
    fn dummy_configs_come_from_presets_and_config_json() {
        assert_eq!(
            dummy_config(Path::new("llama-3.1-8b")).unwrap().hidden_size,
            4096
        );
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 32
        });
        std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
        let w = load(dir.path(), LoadFormat::Dummy).unwrap();
        assert_eq!(
            (w.config.hidden_size, w.embed.dtype),
            (64, DEFAULT_DUMMY_DTYPE)
        );
        assert_eq!(
            dummy_config(&dir.path().join("config.json")).unwrap(),
            w.config
        );
    }
}
