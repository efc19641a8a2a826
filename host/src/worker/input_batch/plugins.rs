//! The batch's plugins: the logits processors and the sampler, told as
//! requests enter and leave (in `prepare`), run once per step over all the
//! rows they see, and their faults counted for `/metrics`.

use super::{record, request_mut, BatchError, InputBatch, StepPlan};
use crate::model_runner::Logits;
use crate::plugins::{LogitsProcessors, OnError, PluginError, Row, SamplerPlugin};
use crate::sampling::PreparedRow;
use crate::step::{ModelRunnerOutput, ReqHandle};

impl InputBatch {
    /// Installs a sampler plugin; it learns of requests from the next
    /// `prepare` on (call it before the first step).
    pub fn set_sampler(&mut self, sampler: SamplerPlugin) {
        self.sampler = Some(sampler);
        self.faults_reported.clear();
    }

    /// Installs logits-processor plugins; they learn of requests from the
    /// next `prepare` on (call it before the first step).
    pub fn set_processors(&mut self, processors: LogitsProcessors) {
        self.processors = Some(processors);
        self.faults_reported.clear();
    }

    /// The plugins' faults since the last call, by qualified name: each
    /// plugin whose count moved, and every plugin at the first call after
    /// one was installed (with 0 if it has not faulted). Empty, without
    /// allocating, in the common step.
    pub fn take_plugin_faults(&mut self) -> Vec<(String, u64)> {
        let processors = self.processors.iter().flat_map(|p| p.faults());
        let sampler = self.sampler.iter().map(|s| (s.name(), s.faults()));
        let mut moved = Vec::new();
        for (i, (name, total)) in processors.chain(sampler).enumerate() {
            let seen = self.faults_reported.get(i).copied();
            if seen == Some(total) {
                continue;
            }
            moved.push((name.to_string(), total - seen.unwrap_or(0)));
            match self.faults_reported.get_mut(i) {
                Some(seen) => *seen = total,
                None => self.faults_reported.push(total),
            }
        }
        moved
    }

    /// Lets the logits processors edit the rows `plan` samples, once for the
    /// whole step. The requests a processor fails (0.4) fail here, through
    /// `plan`'s failures, and are not sampled; `Err` fails the whole step
    /// (an older processor's fault under `on_error = "fail"`).
    pub fn apply_processors(
        &mut self,
        plan: &mut StepPlan,
        logits: &mut Logits,
    ) -> Result<(), PluginError> {
        let Some(processors) = self.processors.as_mut() else {
            return Ok(());
        };
        self.processor_rows.clear();
        for (row, &(h, samples)) in plan.rows.iter().enumerate() {
            let Some(req) = self.requests.get(h.index()).and_then(Option::as_ref) else {
                continue;
            };
            if samples {
                self.processor_rows.push(Row {
                    id: h.0,
                    num_output_tokens: req.sampler.num_output_tokens() as u32,
                    last_token: req.token_ids.last().copied().unwrap_or(0),
                    logits_row: row,
                });
            }
        }
        if self.processor_rows.is_empty() {
            return Ok(());
        }
        let requests = &self.requests;
        // A request's output so far, re-announced to a recreated processor.
        let outputs = |id: u32| {
            requests
                .get(id as usize)
                .and_then(Option::as_ref)
                .map_or(&[][..], |r| &r.token_ids[r.prompt_len..])
        };
        let failed = processors.apply(
            &self.processor_rows,
            &mut logits.data,
            logits.vocab_size,
            outputs,
        )?;
        for (id, why) in failed {
            let h = ReqHandle(id);
            self.fail(std::iter::once(h));
            plan.failed.push((h, why));
        }
        Ok(())
    }

    /// [`Self::sample`] with the sampler plugin choosing each row's token
    /// among the host's top-k candidates, in one call for the whole step.
    /// On a fault the rows are sampled by the host (`on_error = "fallback"`)
    /// or their requests fail (`"fail"`).
    pub(super) fn sample_with_plugin(
        &mut self,
        plan: &StepPlan,
        logits: &mut Logits,
    ) -> Result<ModelRunnerOutput, BatchError> {
        let vocab = logits.vocab_size;
        let Some(plugin) = self.sampler.as_mut() else {
            return Ok(ModelRunnerOutput::default());
        };
        plugin.clear_rows();
        let mut rows: Vec<(ReqHandle, usize, PreparedRow, f64)> =
            Vec::with_capacity(plan.rows.len());
        let mut candidates = Vec::with_capacity(plugin.k());
        for (row, &(h, samples)) in plan.rows.iter().enumerate() {
            if !samples {
                continue;
            }
            let req = request_mut(&mut self.requests, h)?;
            if req.failed {
                // Failed by a logits processor this step.
                continue;
            }
            let logits_row = &mut logits.data[row * vocab..(row + 1) * vocab];
            let prepared = req.sampler.prepare(logits_row, &req.params);
            req.sampler
                .top_candidates(logits_row, &req.params, plugin.k(), &mut candidates);
            // A vocabulary smaller than k: repeat the last candidate, so every
            // row has exactly k as the contract says.
            while candidates.len() < plugin.k() {
                candidates.push(*candidates.last().unwrap_or(&(0, f32::NEG_INFINITY)));
            }
            let u = req.sampler.next_uniform();
            // Rounding to f32 may reach 1.0; the contract says [0, 1).
            plugin.push_row(h.0, &candidates, (u as f32).min(1.0 - f32::EPSILON / 2.0));
            rows.push((h, row, prepared, u));
        }
        let mut out = ModelRunnerOutput {
            sampled: Vec::with_capacity(rows.len()),
            logprobs: Vec::with_capacity(rows.len()),
            ..ModelRunnerOutput::default()
        };
        if rows.is_empty() {
            return Ok(out);
        }
        let chosen = match plugin.choose() {
            Ok(tokens) => Some(tokens),
            Err(e) => match plugin.on_error() {
                OnError::Fallback => {
                    tracing::warn!("{e}; the host samples this step's rows");
                    None
                }
                OnError::Fail => {
                    self.fail(rows.iter().map(|r| r.0));
                    return Ok(ModelRunnerOutput::failed(
                        rows.iter().map(|r| r.0),
                        &e.to_string(),
                    ));
                }
            },
        };
        for (i, (h, row, prepared, u)) in rows.into_iter().enumerate() {
            let req = self.get_mut(h)?;
            let logits_row = &logits.data[row * vocab..(row + 1) * vocab];
            let token = match &chosen {
                Some(tokens) => tokens[i],
                None => req.sampler.choose(logits_row, &req.params, Some(u)),
            };
            let sampled = req.sampler.finish(logits_row, token, prepared);
            record(&mut out, h, req, sampled);
        }
        Ok(out)
    }
}
