//! `{{name}}`: a logits processor for the `host` engine.
//!
//! Once per engine step the host hands the processor every row about to be
//! sampled (one per request) and applies the sparse edits it returns (bans
//! and biases) before penalties and sampling. The full logits never cross:
//! a processor decides from each request's `extra_args` (announced once,
//! when the request enters the batch), its output length and last token.
//!
//! This one bans, for each request, the token ids listed in its
//! `extra_args` as `{"ban": [id, ...]}` (requests without it are left
//! alone), and may bias every request with option `bias`
//! (`{"token": id, "value": v}`).
//!
//! Build: `host plugin build`. Load: `host --plugin <the .wasm> --set
//! 'plugins.logits_processors=["{{name}}"]' generate --input requests.jsonl
//! --output out.jsonl`, with lines like
//! `{"prompt": "Hello", "extra_args": {"ban": [42]}}`.

use std::collections::BTreeMap;

use plugin_sdk::logits_processor::{Batch, Edits, EditsExt, LogitsProcessor, Metadata};

/// The processor: what each live request asked for, by request id.
pub struct Processor {
    /// Banned token ids per request (only requests that ask).
    bans: BTreeMap<u32, Vec<u32>>,
    /// Option `bias`: a token and the value added to its logit, every row.
    bias: Option<(u32, f32)>,
}

/// The `ban` list of one request's `extra_args` JSON (`null` when none).
pub fn parse_bans(extra_args: &str) -> Result<Vec<u32>, String> {
    let v: serde_json::Value =
        serde_json::from_str(extra_args).map_err(|e| format!("extra_args are not JSON: {e}"))?;
    let Some(list) = v.get("ban") else {
        return Ok(Vec::new());
    };
    let ids = list
        .as_array()
        .ok_or("extra_args.ban must be a list of token ids")?;
    ids.iter()
        .map(|id| {
            id.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| format!("extra_args.ban holds {id}, not a token id"))
        })
        .collect()
}

impl LogitsProcessor for Processor {
    /// Name (`plugins.logits_processors = ["{{name}}"]`), version, options.
    fn metadata() -> Metadata {
        Metadata::new("{{name}}", env!("CARGO_PKG_VERSION")).option(
            "bias",
            "a token id and a finite value added to its logit in every row: {\"token\": id, \"value\": v}",
            "null",
        )
    }

    /// Reads the options JSON object (`{}` when none); an error refuses
    /// the configuration.
    fn new(options: &str) -> Result<Self, String> {
        let options: serde_json::Value =
            serde_json::from_str(options).map_err(|e| format!("options are not JSON: {e}"))?;
        let bias = match options.get("bias") {
            None | Some(serde_json::Value::Null) => None,
            Some(b) => {
                let token = b["token"].as_u64().and_then(|t| u32::try_from(t).ok());
                let value = b["value"].as_f64().filter(|v| v.is_finite());
                match (token, value) {
                    (Some(t), Some(v)) => Some((t, v as f32)),
                    _ => {
                        return Err(format!(
                            "option bias must be {{\"token\": id, \"value\": v}}, got {b}"
                        ))
                    }
                }
            }
        };
        plugin_sdk::info!("started (bias {bias:?})");
        Ok(Processor {
            bans: BTreeMap::new(),
            bias,
        })
    }

    /// This step's edits. `batch.added_ids` / `added_extra_args` announce
    /// new requests once, `batch.removed_ids` those that left; rows are
    /// positions in `batch.ids`. Token ids must be below `batch.vocab_size`.
    fn process(&mut self, batch: &Batch) -> Result<Edits, String> {
        for id in &batch.removed_ids {
            self.bans.remove(id);
        }
        for (id, args) in batch.added_ids.iter().zip(&batch.added_extra_args) {
            let bans = parse_bans(args).map_err(|e| format!("request {id}: {e}"))?;
            if !bans.is_empty() {
                self.bans.insert(*id, bans);
            }
        }
        let mut edits = Edits::none();
        for (row, id) in batch.ids.iter().enumerate() {
            for &token in self.bans.get(id).into_iter().flatten() {
                if token < batch.vocab_size {
                    edits.ban(row as u32, token);
                }
            }
            if let Some((token, value)) = self.bias.filter(|(t, _)| *t < batch.vocab_size) {
                edits.bias(row as u32, token, value);
            }
        }
        Ok(edits)
    }
}

// Exports `Processor` as the component's `engine:plugins/logits-processor`.
plugin_sdk::export_logits_processor!(Processor);

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(added: &[(u32, &str)], ids: &[u32]) -> Batch {
        Batch {
            added_ids: added.iter().map(|a| a.0).collect(),
            added_extra_args: added.iter().map(|a| a.1.to_string()).collect(),
            removed_ids: Vec::new(),
            ids: ids.to_vec(),
            num_output_tokens: vec![0; ids.len()],
            last_tokens: vec![0; ids.len()],
            vocab_size: 1000,
        }
    }

    #[test]
    fn bans_only_what_each_request_asks() {
        let mut p = Processor::new("{}").unwrap();
        let e = p
            .process(&batch(&[(1, r#"{"ban": [5, 7]}"#), (2, "null")], &[1, 2]))
            .unwrap();
        assert_eq!((e.ban_rows, e.ban_tokens), (vec![0, 0], vec![5, 7]));
        // Announced once, remembered by id while the request lives.
        let e = p.process(&batch(&[], &[2, 1])).unwrap();
        assert_eq!((e.ban_rows, e.ban_tokens), (vec![1, 1], vec![5, 7]));
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(parse_bans(r#"{"ban": [-1]}"#).is_err());
        assert!(Processor::new(r#"{"bias": {"token": 1}}"#).is_err());
    }
}
