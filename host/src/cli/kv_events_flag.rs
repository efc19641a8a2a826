//! `--kv-events-config JSON`, vLLM's flag: the object's keys become
//! `kv_events.<key>` overrides, so the flag and the `[kv_events]` section
//! are one configuration (an unknown key is refused by its name).

use anyhow::{bail, Context};
use serde_json::Value;

/// The overrides `json` stands for.
pub fn overrides(json: &str) -> anyhow::Result<Vec<String>> {
    let value: Value = serde_json::from_str(json).context(
        "--kv-events-config is not JSON; give an object, e.g. '{\"enable_kv_cache_events\": true}'",
    )?;
    let Value::Object(fields) = value else {
        bail!(
            "--kv-events-config must be a JSON object, e.g. '{{\"enable_kv_cache_events\": true}}'"
        );
    };
    let mut out = Vec::with_capacity(fields.len());
    for (key, value) in fields {
        let toml = match value {
            // vLLM's way of saying "unset".
            Value::Null => continue,
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => n.to_string(),
            Value::String(s) => toml::Value::String(s).to_string(),
            other => bail!(
                "--kv-events-config: `{key}` must be a string, number or boolean, not {other}"
            ),
        };
        out.push(format!("kv_events.{key}={toml}"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::overrides;
    use crate::config::EngineConfig;

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
}
