//! Logits-processor plugins, applied by the worker once per step over every
//! row it samples. Requests and their `extra_args` are announced once (when
//! they enter the batch), so per-step traffic is ids and two counters per row
//! plus the sparse edits that come back; the full logits never cross.
//!
//! Edits are validated whole before any is applied (rows in range, token ids
//! below the vocabulary, finite biases, parallel lists of equal length), so
//! a bad answer changes nothing. A fault (trap, overrun, invalid edits, an
//! error returned) is logged with the plugin's name and the instance is
//! recreated; then, under `on_error = "fallback"`, the step is sampled
//! without that plugin's edits, and under `"fail"` the step fails with the
//! error.

use super::bindings::processor::{Batch, LogitEdits, LogitsProcessorPlugin};
use super::instance::Sandboxed;
use super::live::{LiveRequests, Pending};
use super::{OnError, PluginError};

/// One row the worker is about to sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// The request's handle.
    pub id: u32,
    /// Tokens it generated so far.
    pub num_output_tokens: u32,
    /// The last token of its sequence.
    pub last_token: u32,
    /// Its row in the step's logits matrix.
    pub logits_row: usize,
}

/// One logits-processor plugin and what it has been told.
struct Processor {
    plugin: Sandboxed<LogitsProcessorPlugin>,
    /// Requests entered and left since its last call.
    pending: Pending,
    batch: Batch,
}

/// The configured logits processors, in order, with the live requests'
/// `extra_args`.
pub struct LogitsProcessors {
    processors: Vec<Processor>,
    on_error: OnError,
    live: LiveRequests,
}

impl std::fmt::Debug for LogitsProcessors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.processors.iter().map(|p| p.plugin.name()).collect();
        f.debug_struct("LogitsProcessors")
            .field("names", &names)
            .field("on_error", &self.on_error)
            .finish()
    }
}

fn empty_batch() -> Batch {
    Batch {
        added_ids: Vec::new(),
        added_extra_args: Vec::new(),
        removed_ids: Vec::new(),
        ids: Vec::new(),
        num_output_tokens: Vec::new(),
        last_tokens: Vec::new(),
        vocab_size: 0,
    }
}

impl LogitsProcessors {
    pub(super) fn new(
        plugins: Vec<Sandboxed<LogitsProcessorPlugin>>,
        on_error: OnError,
    ) -> LogitsProcessors {
        let processors = plugins
            .into_iter()
            .map(|plugin| Processor {
                plugin,
                pending: Pending::default(),
                batch: empty_batch(),
            })
            .collect();
        LogitsProcessors {
            processors,
            on_error,
            live: LiveRequests::default(),
        }
    }

    /// The plugins' qualified names, in application order.
    pub fn names(&self) -> Vec<&str> {
        self.processors.iter().map(|p| p.plugin.name()).collect()
    }

    /// A request entered the batch.
    pub fn add(&mut self, id: u32, extra_args: Option<&serde_json::Value>) {
        let pending = self.processors.iter_mut().map(|p| &mut p.pending);
        self.live.add(id, extra_args, pending);
    }

    /// A request left the batch.
    pub fn remove(&mut self, id: u32) {
        let pending = self.processors.iter_mut().map(|p| &mut p.pending);
        self.live.remove(id, pending);
    }

    /// Asks every processor for its edits to `rows` and applies them to
    /// `logits` (`[rows, vocab]`, row-major).
    pub fn apply(
        &mut self,
        rows: &[Row],
        logits: &mut [f32],
        vocab: usize,
    ) -> Result<(), PluginError> {
        for p in &mut self.processors {
            p.pending.resync(p.plugin.faults(), &self.live);
            let b = &mut p.batch;
            std::mem::swap(&mut b.added_ids, &mut p.pending.added_ids);
            std::mem::swap(&mut b.added_extra_args, &mut p.pending.added_extra_args);
            std::mem::swap(&mut b.removed_ids, &mut p.pending.removed_ids);
            b.ids.clear();
            b.num_output_tokens.clear();
            b.last_tokens.clear();
            b.ids.extend(rows.iter().map(|r| r.id));
            b.num_output_tokens
                .extend(rows.iter().map(|r| r.num_output_tokens));
            b.last_tokens.extend(rows.iter().map(|r| r.last_token));
            b.vocab_size = vocab as u32;
            let batch = &p.batch;
            let answer = p.plugin.call("process", |w, s| {
                w.engine_plugins_logits_processor().call_process(s, batch)
            });
            // Told: the lists go back (emptied) to be reused.
            std::mem::swap(&mut p.batch.added_ids, &mut p.pending.added_ids);
            std::mem::swap(
                &mut p.batch.added_extra_args,
                &mut p.pending.added_extra_args,
            );
            std::mem::swap(&mut p.batch.removed_ids, &mut p.pending.removed_ids);
            p.pending.clear();
            let result = match answer {
                Ok(Ok(edits)) => match validate(&edits, rows.len(), vocab) {
                    Ok(()) => {
                        apply_edits(&edits, rows, logits, vocab);
                        Ok(())
                    }
                    Err(why) => Err(p
                        .plugin
                        .fault("process", format!("returned invalid edits: {why}"))),
                },
                Ok(Err(message)) => Err(p
                    .plugin
                    .fault("process", format!("returned an error: {message}"))),
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                match self.on_error {
                    OnError::Fail => return Err(e),
                    OnError::Fallback => {
                        tracing::warn!("{e}; sampling this step without its edits")
                    }
                }
            }
        }
        Ok(())
    }
}

/// Checks every edit before any is applied.
fn validate(e: &LogitEdits, rows: usize, vocab: usize) -> Result<(), String> {
    if e.ban_rows.len() != e.ban_tokens.len() {
        return Err(format!(
            "{} ban rows but {} ban tokens",
            e.ban_rows.len(),
            e.ban_tokens.len()
        ));
    }
    if e.bias_rows.len() != e.bias_tokens.len() || e.bias_rows.len() != e.bias_values.len() {
        return Err("bias-rows, bias-tokens and bias-values differ in length".into());
    }
    let all_rows = e.ban_rows.iter().chain(&e.bias_rows);
    if let Some(r) = all_rows.copied().find(|&r| r as usize >= rows) {
        return Err(format!("row {r} is out of range (batch of {rows})"));
    }
    let all_tokens = e.ban_tokens.iter().chain(&e.bias_tokens);
    if let Some(t) = all_tokens.copied().find(|&t| t as usize >= vocab) {
        return Err(format!(
            "token id {t} is not below the vocabulary size {vocab}"
        ));
    }
    if let Some(v) = e.bias_values.iter().find(|v| !v.is_finite()) {
        return Err(format!("bias {v} is not finite (ban the token instead)"));
    }
    Ok(())
}

fn apply_edits(e: &LogitEdits, rows: &[Row], logits: &mut [f32], vocab: usize) {
    for (&r, &t) in e.ban_rows.iter().zip(&e.ban_tokens) {
        logits[rows[r as usize].logits_row * vocab + t as usize] = f32::NEG_INFINITY;
    }
    for ((&r, &t), &v) in e.bias_rows.iter().zip(&e.bias_tokens).zip(&e.bias_values) {
        logits[rows[r as usize].logits_row * vocab + t as usize] += v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edits(ban: &[(u32, u32)], bias: &[(u32, u32, f32)]) -> LogitEdits {
        LogitEdits {
            ban_rows: ban.iter().map(|b| b.0).collect(),
            ban_tokens: ban.iter().map(|b| b.1).collect(),
            bias_rows: bias.iter().map(|b| b.0).collect(),
            bias_tokens: bias.iter().map(|b| b.1).collect(),
            bias_values: bias.iter().map(|b| b.2).collect(),
        }
    }

    #[test]
    fn edits_land_on_the_rows_logits_row() {
        let rows = [Row {
            id: 9,
            num_output_tokens: 0,
            last_token: 0,
            logits_row: 2,
        }];
        let mut logits = vec![0.0f32; 3 * 4];
        let e = edits(&[(0, 1)], &[(0, 3, 2.5)]);
        validate(&e, 1, 4).unwrap();
        apply_edits(&e, &rows, &mut logits, 4);
        assert_eq!(&logits[8..], &[0.0, f32::NEG_INFINITY, 0.0, 2.5]);
        assert!(logits[..8].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn invalid_edits_are_named() {
        assert!(validate(&edits(&[(1, 0)], &[]), 1, 4)
            .unwrap_err()
            .contains("row 1"));
        assert!(validate(&edits(&[(0, 4)], &[]), 1, 4)
            .unwrap_err()
            .contains("token id 4"));
        assert!(validate(&edits(&[], &[(0, 1, f32::NAN)]), 1, 4)
            .unwrap_err()
            .contains("not finite"));
        let mut e = edits(&[(0, 1)], &[]);
        e.ban_tokens.push(2);
        assert!(validate(&e, 1, 4).is_err());
    }
}
