//! A Hugging Face `config.json` of a llama-family model, read into a
//! [`LlamaConfig`] with the defaults of `transformers`' `LlamaConfig`.

use std::path::Path;

use serde_json::{Map, Value};

use super::SafetensorsError;
use crate::model::check;
use crate::model::LlamaConfig;

/// `model_type`s whose checkpoints use llama's tensor names and math.
const LLAMA_MODEL_TYPES: &[&str] = &["llama", "mistral"];

/// Reads and checks the llama config in `path` (a `config.json`).
pub fn read_config(path: &Path) -> Result<LlamaConfig, SafetensorsError> {
    let text = std::fs::read_to_string(path).map_err(|source| SafetensorsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let json: Value = serde_json::from_str(&text).map_err(|e| SafetensorsError::Config {
        path: path.to_path_buf(),
        key: "(file)".into(),
        reason: format!("is not valid JSON: {e}"),
    })?;
    let obj = json.as_object().ok_or_else(|| SafetensorsError::Config {
        path: path.to_path_buf(),
        key: "(file)".into(),
        reason: "is not a JSON object".into(),
    })?;
    parse(obj, path)
}

fn parse(obj: &Map<String, Value>, path: &Path) -> Result<LlamaConfig, SafetensorsError> {
    let err = |key: &str, reason: String| SafetensorsError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        reason,
    };
    // `null` counts as absent, as transformers treats it.
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let size = |key: &str, default: Option<usize>| -> Result<usize, SafetensorsError> {
        match get(key) {
            None => default.ok_or_else(|| err(key, "is missing".into())),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| err(key, format!("is {v}, expected a non-negative integer"))),
        }
    };
    let float = |key: &str, default: f32| -> Result<f32, SafetensorsError> {
        match get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| err(key, format!("is {v}, expected a number"))),
        }
    };
    let flag = |key: &str| -> Result<bool, SafetensorsError> {
        match get(key) {
            None => Ok(false),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| err(key, format!("is {v}, expected true or false"))),
        }
    };
    let model_type = get("model_type").and_then(Value::as_str).unwrap_or("");
    if !LLAMA_MODEL_TYPES.contains(&model_type) {
        return Err(err(
            "model_type",
            format!(
                "is {model_type:?}; this engine runs llama-family models ({LLAMA_MODEL_TYPES:?})"
            ),
        ));
    }
    for key in ["attention_bias", "mlp_bias"] {
        if flag(key)? {
            return Err(err(
                key,
                "is true, but this engine's llama has no bias terms".into(),
            ));
        }
    }
    if get("rope_scaling").is_some() {
        tracing::warn!(path = %path.display(), "rope_scaling is ignored");
    }
    let hidden_size = size("hidden_size", None)?;
    let num_attention_heads = size("num_attention_heads", None)?;
    if num_attention_heads == 0 {
        return Err(err(
            "num_attention_heads",
            "is 0; it must be positive".into(),
        ));
    }
    let head_dim = size("head_dim", Some(hidden_size / num_attention_heads))?;
    let config = LlamaConfig {
        vocab_size: size("vocab_size", None)?,
        hidden_size,
        intermediate_size: size("intermediate_size", None)?,
        num_hidden_layers: size("num_hidden_layers", None)?,
        num_attention_heads,
        num_key_value_heads: size("num_key_value_heads", Some(num_attention_heads))?,
        head_dim,
        rope_dim: head_dim,
        rope_theta: float("rope_theta", 10_000.0)?,
        rms_norm_eps: float("rms_norm_eps", 1e-6)?,
        max_position_embeddings: size("max_position_embeddings", Some(2048))?,
        tie_word_embeddings: flag("tie_word_embeddings")?,
    };
    check::validate_config(&config).map_err(|source| SafetensorsError::Shape {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn smollm2() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "vocab_size": 49152,
            "tie_word_embeddings": true, "head_dim": null, "rope_scaling": null
        })
    }

    fn parse_json(v: Value) -> Result<LlamaConfig, SafetensorsError> {
        parse(v.as_object().unwrap(), Path::new("/m/config.json"))
    }

    #[test]
    fn smollm2_config_parses_with_derived_head_dim() {
        let c = parse_json(smollm2()).unwrap();
        assert_eq!((c.head_dim, c.rope_dim, c.num_key_value_heads), (64, 64, 3));
        assert_eq!((c.rope_theta, c.rms_norm_eps), (100_000.0, 1e-5));
        assert!(c.tie_word_embeddings);
        assert_eq!(Some(c), crate::model::dummy::preset("smollm2-135m"));
    }

    #[test]
    fn defaults_follow_transformers() {
        let mut v = smollm2();
        for k in [
            "num_key_value_heads",
            "rope_theta",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
        ] {
            v.as_object_mut().unwrap().remove(k);
        }
        v["head_dim"] = json!(32);
        let c = parse_json(v).unwrap();
        assert_eq!(
            (c.num_key_value_heads, c.head_dim, c.rope_theta),
            (9, 32, 10_000.0)
        );
        assert_eq!((c.rms_norm_eps, c.max_position_embeddings), (1e-6, 2048));
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let cases = [
            ("hidden_size", json!(null), "`hidden_size` is missing"),
            (
                "vocab_size",
                json!("big"),
                "`vocab_size` is \"big\", expected a non-negative integer",
            ),
            (
                "rope_theta",
                json!([1]),
                "`rope_theta` is [1], expected a number",
            ),
            ("model_type", json!("gpt2"), "`model_type` is \"gpt2\""),
            ("attention_bias", json!(true), "`attention_bias` is true"),
            (
                "num_key_value_heads",
                json!(4),
                "num_key_value_heads (4) must divide",
            ),
        ];
        for (key, value, words) in cases {
            let mut v = smollm2();
            v[key] = value;
            let e = parse_json(v).unwrap_err().to_string();
            assert!(e.contains(words) && e.contains("/m/config.json"), "{e}");
        }
    }
}
