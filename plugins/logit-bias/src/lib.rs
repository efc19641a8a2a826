//! `engine:logit-bias`: OpenAI's `logit_bias` and a banned-token list, per
//! request, driven by `extra_args`:
//!
//! ```json
//! {"banned_token_ids": [42, 7], "logit_bias": {"198": 5.0, "13": -2.5}}
//! ```
//!
//! Requests without these keys are left alone. Biases must lie in
//! [-100, 100] (OpenAI's range); a bias of -100 bans the token, like
//! OpenAI's API.

use std::collections::BTreeMap;

use plugin_sdk::logits_processor::{Batch, Edits, EditsExt, LogitsProcessor, Metadata};
use serde_json::Value;

/// What one request asked for.
#[derive(Debug, Default, Clone, PartialEq)]
struct Rule {
    banned: Vec<u32>,
    bias: Vec<(u32, f32)>,
}

/// Rules of the live requests that have any (a `BTreeMap`: the sandbox has
/// no randomness, which `HashMap`'s default hasher would need).
#[derive(Debug, Default)]
pub struct LogitBias {
    rules: BTreeMap<u32, Rule>,
}

/// Parses one request's `extra_args`; the error names the key.
fn parse_rule(json: &str) -> Result<Option<Rule>, String> {
    let v: Value =
        serde_json::from_str(json).map_err(|e| format!("extra_args is not JSON: {e}"))?;
    let mut rule = Rule::default();
    if let Some(list) = v.get("banned_token_ids") {
        let list = list
            .as_array()
            .ok_or("extra_args.banned_token_ids must be a list of token ids")?;
        for id in list {
            let id = id.as_u64().and_then(|i| u32::try_from(i).ok());
            rule.banned
                .push(id.ok_or("extra_args.banned_token_ids must hold non-negative integers")?);
        }
    }
    if let Some(map) = v.get("logit_bias") {
        let map = map
            .as_object()
            .ok_or("extra_args.logit_bias must be an object {\"token_id\": bias}")?;
        for (key, value) in map {
            let id: u32 = key
                .parse()
                .map_err(|_| format!("extra_args.logit_bias key {key:?} is not a token id"))?;
            let bias = value.as_f64().filter(|b| (-100.0..=100.0).contains(b));
            let bias = bias.ok_or_else(|| {
                format!("extra_args.logit_bias[{key:?}] must be a number in [-100, 100]")
            })?;
            if bias <= -100.0 {
                rule.banned.push(id);
            } else {
                rule.bias.push((id, bias as f32));
            }
        }
    }
    Ok((!rule.banned.is_empty() || !rule.bias.is_empty()).then_some(rule))
}

impl LogitsProcessor for LogitBias {
    fn metadata() -> Metadata {
        Metadata::new("engine:logit-bias", env!("CARGO_PKG_VERSION"))
    }

    fn new(_options: &str) -> Result<Self, String> {
        Ok(LogitBias::default())
    }

    fn process(&mut self, batch: &Batch) -> Result<Edits, String> {
        for id in &batch.removed_ids {
            self.rules.remove(id);
        }
        for (&id, args) in batch.added_ids.iter().zip(&batch.added_extra_args) {
            match parse_rule(args).map_err(|e| format!("request {id}: {e}"))? {
                Some(rule) => self.rules.insert(id, rule),
                None => self.rules.remove(&id),
            };
        }
        let mut edits = Edits::none();
        for (row, id) in batch.ids.iter().enumerate() {
            let Some(rule) = self.rules.get(id) else {
                continue;
            };
            for &t in rule.banned.iter().filter(|&&t| t < batch.vocab_size) {
                edits.ban(row as u32, t);
            }
            for &(t, b) in rule.bias.iter().filter(|&&(t, _)| t < batch.vocab_size) {
                edits.bias(row as u32, t, b);
            }
        }
        Ok(edits)
    }
}

plugin_sdk::export_logits_processor!(LogitBias);

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(added: &[(u32, &str)], removed: &[u32], ids: &[u32]) -> Batch {
        Batch {
            added_ids: added.iter().map(|a| a.0).collect(),
            added_extra_args: added.iter().map(|a| a.1.to_string()).collect(),
            removed_ids: removed.to_vec(),
            ids: ids.to_vec(),
            num_output_tokens: vec![0; ids.len()],
            last_tokens: vec![0; ids.len()],
            vocab_size: 100,
        }
    }

    #[test]
    fn bans_and_biases_follow_each_request() {
        let mut p = LogitBias::new("{}").unwrap();
        let args = r#"{"banned_token_ids": [5, 500], "logit_bias": {"9": 2.5, "8": -100}}"#;
        let e = p
            .process(&batch(&[(1, args), (2, "null")], &[], &[2, 1]))
            .unwrap();
        assert_eq!(
            (e.ban_rows, e.ban_tokens),
            (vec![1, 1], vec![5, 8]),
            "500 >= vocab is dropped"
        );
        assert_eq!(
            (e.bias_rows, e.bias_tokens, e.bias_values),
            (vec![1], vec![9], vec![2.5])
        );
        let e = p.process(&batch(&[], &[1], &[2])).unwrap();
        assert!(e.ban_rows.is_empty() && e.bias_rows.is_empty());
    }

    #[test]
    fn bad_arguments_name_the_key() {
        let mut p = LogitBias::new("{}").unwrap();
        let err = p
            .process(&batch(&[(3, r#"{"logit_bias": {"x": 1}}"#)], &[], &[3]))
            .unwrap_err();
        assert!(err.contains("request 3") && err.contains("\"x\""), "{err}");
        let err = p
            .process(&batch(&[(3, r#"{"logit_bias": {"1": 101}}"#)], &[], &[3]))
            .unwrap_err();
        assert!(err.contains("[-100, 100]"), "{err}");
    }
}
