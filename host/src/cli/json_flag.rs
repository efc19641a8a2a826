//! vLLM's flags that take a JSON object for a whole section,
//! `--kv-events-config` and `--speculative-config`: the object's keys
//! become `<section>.<key>` overrides, so the flag and the TOML section are
//! one configuration (an unknown key is refused by its name).

use anyhow::{bail, Context};
use serde_json::Value;

/// A flag whose JSON object fills one configuration section.
pub struct JsonFlag {
    /// The flag, e.g. `--kv-events-config`.
    pub flag: &'static str,
    /// The TOML section its keys belong to.
    pub section: &'static str,
    /// A valid value, shown when the flag's value is not an object.
    pub example: &'static str,
}

/// `--kv-events-config` [kv_events].
pub const KV_EVENTS: JsonFlag = JsonFlag {
    flag: "--kv-events-config",
    section: "kv_events",
    example: r#"{"enable_kv_cache_events": true}"#,
};

/// `--speculative-config` [speculative].
pub const SPECULATIVE: JsonFlag = JsonFlag {
    flag: "--speculative-config",
    section: "speculative",
    example: r#"{"method": "ngram", "num_speculative_tokens": 4}"#,
};

impl JsonFlag {
    /// The overrides `json` stands for.
    pub fn overrides(&self, json: &str) -> anyhow::Result<Vec<String>> {
        let JsonFlag {
            flag,
            section,
            example,
        } = self;
        let value: Value = serde_json::from_str(json)
            .with_context(|| format!("{flag} is not JSON; give an object, e.g. '{example}'"))?;
        let Value::Object(fields) = value else {
            bail!("{flag} must be a JSON object, e.g. '{example}'");
        };
        let mut out = Vec::with_capacity(fields.len());
        for (key, value) in fields {
            let toml = match value {
                // vLLM's way of saying "unset".
                Value::Null => continue,
                Value::Bool(b) => b.to_string(),
                Value::Number(n) => n.to_string(),
                Value::String(s) => toml::Value::String(s).to_string(),
                other => bail!("{flag}: `{key}` must be a string, number or boolean, not {other}"),
            };
            out.push(format!("{section}.{key}={toml}"));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::{KV_EVENTS, SPECULATIVE};
    use crate::config::EngineConfig;

    fn overrides(json: &str) -> anyhow::Result<Vec<String>> {
        KV_EVENTS.overrides(json)
    }

    #[test]
    fn the_flag_is_the_kv_events_section() {
        let o = overrides(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq",
                "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": null, "buffer_steps": 7}"#,
        )
        .unwrap();
        let c = EngineConfig::load(None, &o).unwrap();
        assert!(c.kv_events.enabled());
        assert_eq!(c.kv_events.endpoint, "tcp://127.0.0.1:5557");
        assert_eq!(c.kv_events.replay_endpoint, None);
        assert_eq!(c.kv_events.buffer_steps, 7);
    }

    #[test]
    fn what_is_not_understood_is_named() {
        let e = overrides("[1]").unwrap_err().to_string();
        assert!(e.contains("JSON object"), "{e}");
        let o = overrides(r#"{"hwm": 10}"#).unwrap();
        let e = EngineConfig::load(None, &o).unwrap_err().to_string();
        assert!(e.contains("hwm"), "{e}");
        let o = overrides(r#"{"endpoint": "localhost:1"}"#).unwrap();
        let e = EngineConfig::load(None, &o).unwrap_err().to_string();
        assert!(e.contains("kv_events.endpoint"), "{e}");
    }

    #[test]
    fn the_speculative_flag_is_the_speculative_section() {
        let json = r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}"#;
        let c = EngineConfig::load(None, &SPECULATIVE.overrides(json).unwrap()).unwrap();
        assert!(c.speculative.enabled());
        assert_eq!(c.speculative.num_speculative_tokens, 3);
        // vLLM: an unset minimum follows the maximum.
        assert_eq!(
            (c.speculative.lookup_min(), c.speculative.lookup_max()),
            (4, 4)
        );
        let o = SPECULATIVE.overrides(r#"{"method": "eagle"}"#).unwrap();
        let e = EngineConfig::load(None, &o).unwrap_err().to_string();
        assert!(
            e.contains("speculative.method") && e.contains("ngram"),
            "{e}"
        );
        let o = SPECULATIVE
            .overrides(
                r#"{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}"#,
            )
            .unwrap();
        let e = EngineConfig::load(None, &o).unwrap_err().to_string();
        assert!(e.contains("prompt_lookup_min"), "{e}");
        let o = SPECULATIVE
            .overrides(r#"{"num_speculative_tokens": 1000}"#)
            .unwrap();
        let e = EngineConfig::load(None, &o).unwrap_err().to_string();
        assert!(e.contains("at most 32"), "{e}");
        let e = SPECULATIVE.overrides("4").unwrap_err().to_string();
        assert!(
            e.contains("--speculative-config") && e.contains("num_speculative_tokens"),
            "{e}"
        );
    }
}
