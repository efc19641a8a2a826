//! Sampler plugins: the worker hands the plugin, once per step, every row
//! it samples as the host's `k` most likely candidates (after the request's
//! min_tokens, penalties, logits processors and temperature) with one
//! uniform per row from the request's own seeded generator, and the plugin
//! answers one candidate position per row. The full logits never cross.
//!
//! Greedy requests (temperature 0) go through the plugin too, with their
//! candidates' logprobs at temperature 1: a sampler that wants greedy rows
//! to stay greedy picks position 0 for them (it sees `temperature` in
//! nothing but its candidates, so it decides by its own rules).
//!
//! An answer is validated whole (one position per row, each below `k`)
//! before any is used. A fault (trap, overrun, invalid answer, an error
//! returned) is logged with the plugin's name and the instance recreated;
//! the caller then samples those rows with the host's sampler
//! (`on_error = "fallback"`) or fails those requests (`"fail"`).

use super::bindings::sampler::{Candidates, SamplerPlugin as SamplerWorld};
use super::instance::Sandboxed;
use super::live::{extra_args_json, LiveRequests, Pending};
use super::{OnError, PluginError};

/// The configured sampler plugin and what it has been told.
pub struct SamplerPlugin {
    plugin: Sandboxed<SamplerWorld>,
    on_error: OnError,
    live: LiveRequests,
    pending: Pending,
    /// This step's rows (reused from step to step).
    batch: Candidates,
}

impl std::fmt::Debug for SamplerPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SamplerPlugin")
            .field("name", &self.plugin.name())
            .field("k", &self.batch.k)
            .field("on_error", &self.on_error)
            .finish()
    }
}

impl SamplerPlugin {
    pub(super) fn new(plugin: Sandboxed<SamplerWorld>, k: usize, on_error: OnError) -> Self {
        SamplerPlugin {
            plugin,
            on_error,
            live: LiveRequests::default(),
            pending: Pending::default(),
            batch: Candidates {
                added_ids: Vec::new(),
                added_extra_args: Vec::new(),
                removed_ids: Vec::new(),
                ids: Vec::new(),
                k: k as u32,
                token_ids: Vec::new(),
                logprobs: Vec::new(),
                uniforms: Vec::new(),
            },
        }
    }

    /// The plugin's qualified name.
    pub fn name(&self) -> &str {
        self.plugin.name()
    }

    /// Candidates per row (`plugins.sampler_top_k`).
    pub fn k(&self) -> usize {
        self.batch.k as usize
    }

    /// What a fault does to the step's rows.
    pub fn on_error(&self) -> OnError {
        self.on_error
    }

    /// Faults so far (each recreated the instance).
    pub fn faults(&self) -> u64 {
        self.plugin.faults()
    }

    /// A request entered the batch.
    pub fn add(&mut self, id: u32, extra_args: Option<&serde_json::Value>) {
        let json = extra_args_json(extra_args);
        self.live.add(id, json, std::iter::once(&mut self.pending));
    }

    /// A request left the batch.
    pub fn remove(&mut self, id: u32) {
        self.live.remove(id, std::iter::once(&mut self.pending));
    }

    /// Starts a step: no rows yet.
    pub fn clear_rows(&mut self) {
        let b = &mut self.batch;
        b.ids.clear();
        b.token_ids.clear();
        b.logprobs.clear();
        b.uniforms.clear();
    }

    /// Adds request `id`'s row: exactly `k` candidates `(token, logprob)`,
    /// most likely first, and its uniform in [0, 1).
    pub fn push_row(&mut self, id: u32, candidates: &[(u32, f32)], uniform: f32) {
        debug_assert_eq!(candidates.len(), self.k());
        let b = &mut self.batch;
        b.ids.push(id);
        b.token_ids.extend(candidates.iter().map(|c| c.0));
        b.logprobs.extend(candidates.iter().map(|c| c.1));
        b.uniforms.push(uniform);
    }

    /// Asks the plugin to choose among the rows pushed since
    /// [`Self::clear_rows`]; returns the chosen token of each row, in order.
    pub fn choose(&mut self) -> Result<Vec<u32>, PluginError> {
        // The sampler is told of every request.
        self.pending
            .resync(self.plugin.faults(), &self.live, |_| true);
        let b = &mut self.batch;
        std::mem::swap(&mut b.added_ids, &mut self.pending.added_ids);
        std::mem::swap(&mut b.added_extra_args, &mut self.pending.added_extra_args);
        std::mem::swap(&mut b.removed_ids, &mut self.pending.removed_ids);
        let batch = &self.batch;
        let answer = self.plugin.call("choose", batch.ids.len(), |w, s| {
            w.engine_plugins_sampler().call_choose(s, batch)
        });
        // Told (even a faulting instance is recreated and told afresh).
        let b = &mut self.batch;
        std::mem::swap(&mut b.added_ids, &mut self.pending.added_ids);
        std::mem::swap(&mut b.added_extra_args, &mut self.pending.added_extra_args);
        std::mem::swap(&mut b.removed_ids, &mut self.pending.removed_ids);
        self.pending.clear();
        match answer? {
            Ok(positions) => match validate(&positions, self.batch.ids.len(), self.k()) {
                Ok(()) => {
                    let k = self.k();
                    Ok(positions
                        .iter()
                        .enumerate()
                        .map(|(row, &p)| self.batch.token_ids[row * k + p as usize])
                        .collect())
                }
                Err(why) => Err(self
                    .plugin
                    .fault("choose", format!("returned an invalid choice: {why}"))),
            },
            Err(message) => Err(self
                .plugin
                .fault("choose", format!("returned an error: {message}"))),
        }
    }
}

/// One position per row, each below `k`.
fn validate(positions: &[u32], rows: usize, k: usize) -> Result<(), String> {
    if positions.len() != rows {
        return Err(format!(
            "{} positions for a batch of {rows} rows (one per row)",
            positions.len()
        ));
    }
    if let Some((row, p)) = positions
        .iter()
        .enumerate()
        .find(|&(_, &p)| p as usize >= k)
    {
        return Err(format!(
            "position {p} for row {row} is out of range ({k} candidates per row)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::validate;

    #[test]
    fn invalid_choices_are_named() {
        assert!(validate(&[0, 19], 2, 20).is_ok());
        assert!(validate(&[0], 2, 20).unwrap_err().contains("1 positions"));
        assert!(validate(&[0, 20], 2, 20)
            .unwrap_err()
            .contains("position 20 for row 1"));
    }
}
