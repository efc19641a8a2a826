//! [`DeviceRunner`]: what the worker needs of a model runner, whatever
//! device it computes on — the CPU runner here, the CUDA runner in
//! `crate::cuda` — so one `Worker` drives both through the same lifecycle.

use super::{
    CpuModelRunner, KvCacheShape, Logits, LogitsSink, LogitsSpan, ModelInput, RunnerConfig,
    RunnerError, StepProfile,
};
use crate::model::{LlamaConfig, ModelWeights};
use crate::sampling::SamplingParams;

/// How much memory the KV cache may take (vLLM's `kv_cache_memory_bytes`
/// and `gpu_memory_utilization`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvCacheBudget {
    /// Exactly this many bytes, when set.
    pub bytes: Option<usize>,
    /// Otherwise, on a GPU: the fraction of the device the engine may use.
    pub gpu_memory_utilization: f64,
    /// The most sequences a step schedules (`scheduler.max_num_seqs`): with
    /// `max_model_len`, all the KV cache the engine can ever have in use.
    pub max_num_seqs: usize,
}

/// One row a step samples where its logits are, described without naming
/// a device: the worker builds these, a runner that samples on its device
/// turns them into its own row format.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceSampleRow<'a> {
    /// The request's sampling parameters.
    pub params: &'a SamplingParams,
    /// Keys the request's random stream: its seed, or a random one drawn
    /// once for an unseeded request, so it is the same at every step.
    pub seed: u64,
    /// Position of the token being sampled (the draw's counter, so a
    /// seeded request's draw does not depend on its batch).
    pub position: u32,
    /// Which row of the step's logits (its sequence index in the input).
    pub logits_row: usize,
}

/// A model runner as the worker drives it. Every method but
/// [`DeviceRunner::execute_model`] is a lifecycle step; the worker checks
/// their order, the runner checks its own state (e.g. no KV cache).
pub trait DeviceRunner: Send {
    /// The device, for logs and errors (`cpu`, `cuda:0`).
    fn device_name(&self) -> String;

    /// The model's hyper-parameters (this rank's shard under tensor
    /// parallelism).
    fn model_config(&self) -> &LlamaConfig;

    /// The step limits.
    fn runner_config(&self) -> RunnerConfig;

    /// The KV cache's dimensions.
    fn kv_cache_shape(&self) -> KvCacheShape;

    /// Bytes one KV block takes across all layers, K and V, in the element
    /// type this runner stores (the engine divides the budget by it).
    fn bytes_per_block(&self) -> usize;

    /// Blocks in the KV cache; 0 while none is allocated.
    fn num_kv_blocks(&self) -> usize;

    /// Bytes the KV cache may take: an explicit budget as is, or (GPU)
    /// what the device has left after a profile run at the largest step.
    fn determine_available_memory(&mut self, budget: &KvCacheBudget) -> Result<usize, RunnerError>;

    /// Allocates (or replaces) the KV cache with `num_blocks` blocks.
    fn initialize_kv_cache(&mut self, num_blocks: usize) -> Result<(), RunnerError>;

    /// Frees the KV cache (sleep, shutdown); `initialize_kv_cache` brings it
    /// back, empty.
    fn free_kv_cache(&mut self);

    /// Runs one small step so first-touch costs are paid before the first
    /// request, and (GPU) captures the decode CUDA graphs. Needs the KV
    /// cache; the dummy step writes K/V into the first blocks, which is
    /// harmless because every sequence writes a slot before reading it.
    fn warm_up(&mut self) -> Result<(), RunnerError>;

    /// Runs one step: writes the K/V of every token of `input` into the
    /// cache and returns the logits of each sequence's last query token.
    fn execute_model(&mut self, input: &ModelInput) -> Result<Logits, RunnerError>;

    /// Whether [`DeviceRunner::execute_model_with_spans`] computes the
    /// logits of other tokens than the last (prompt logprobs). The default:
    /// no (the GPU runner); the worker then fails the requests that ask
    /// for them, with a message that says so, and serves the others.
    fn computes_span_logits(&self) -> bool {
        false
    }

    /// Runs one step like [`DeviceRunner::execute_model`] and also hands
    /// the logits of each of `spans`' query tokens to `sink`, in order, as
    /// `(span index, row within the span, logits row)`. Only called when
    /// [`DeviceRunner::computes_span_logits`]; the default refuses.
    fn execute_model_with_spans(
        &mut self,
        input: &ModelInput,
        spans: &[LogitsSpan],
        sink: &mut LogitsSink<'_>,
    ) -> Result<Logits, RunnerError> {
        if spans.is_empty() {
            return self.execute_model(input);
        }
        let _ = sink;
        Err(RunnerError::Unsupported(format!(
            "{} does not compute logits of prompt tokens (prompt logprobs)",
            self.device_name()
        )))
    }

    /// Runs one step like [`DeviceRunner::execute_model`] but samples
    /// `rows` where the logits are, so they never leave the device:
    /// returns one token per row, in `rows`' order. `None` (without
    /// running anything) when this runner cannot sample on its device or
    /// not these rows; the worker then runs `execute_model` and samples on
    /// the host. The default: never (the CPU runner, whose logits already
    /// are on the host).
    fn execute_and_sample(
        &mut self,
        _input: &ModelInput,
        _rows: &[DeviceSampleRow],
    ) -> Option<Result<Vec<u32>, RunnerError>> {
        None
    }

    /// Prepares again what the tensor `name` of `weights` feeds, after it
    /// changed (vLLM's `update_weights`).
    fn reload_weight(&mut self, weights: &ModelWeights, name: &str) -> Result<(), RunnerError>;

    /// Sleep level 1: moves the weights out of device memory into host
    /// memory. A CPU runner's weights already live there: nothing to do.
    fn offload_weights(&mut self) -> Result<(), RunnerError>;

    /// Wakes what [`DeviceRunner::offload_weights`] put to sleep.
    fn restore_weights(&mut self) -> Result<(), RunnerError>;

    /// Starts (from zero) or stops timing each operation of the following
    /// steps; `false` when this runner cannot (the default).
    fn set_profiling(&mut self, _on: bool) -> bool {
        false
    }

    /// The time per operation since profiling started, if it is on.
    fn profile(&self) -> Option<&StepProfile> {
        None
    }
}

impl DeviceRunner for CpuModelRunner {
    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn model_config(&self) -> &LlamaConfig {
        CpuModelRunner::model_config(self)
    }

    fn runner_config(&self) -> RunnerConfig {
        CpuModelRunner::runner_config(self)
    }

    fn kv_cache_shape(&self) -> KvCacheShape {
        CpuModelRunner::kv_cache_shape(self)
    }

    fn bytes_per_block(&self) -> usize {
        CpuModelRunner::kv_cache_shape(self).bytes_per_block()
    }

    fn num_kv_blocks(&self) -> usize {
        self.kv_cache().map_or(0, |c| c.num_blocks())
    }

    /// The explicit budget, or else what `max_num_seqs` sequences of
    /// `max_model_len` tokens fill, at most `cache.kv_cache_memory_bytes`'
    /// CPU default: host memory is not profiled (vLLM's CPU worker also
    /// takes a fixed KV-cache space), and a small configuration should not
    /// hold memory it can never use.
    fn determine_available_memory(&mut self, budget: &KvCacheBudget) -> Result<usize, RunnerError> {
        if let Some(bytes) = budget.bytes {
            return Ok(bytes);
        }
        let limits = CpuModelRunner::runner_config(self);
        let usable = limits
            .max_model_len
            .div_ceil(limits.block_size)
            .saturating_mul(budget.max_num_seqs)
            .saturating_mul(self.bytes_per_block());
        Ok(usable.min(crate::config::DEFAULT_CPU_KV_CACHE_BYTES as usize))
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize) -> Result<(), RunnerError> {
        CpuModelRunner::initialize_kv_cache(self, num_blocks)
    }

    fn free_kv_cache(&mut self) {
        CpuModelRunner::free_kv_cache(self);
    }

    fn warm_up(&mut self) -> Result<(), RunnerError> {
        let limits = CpuModelRunner::runner_config(self);
        let block_size = limits.block_size;
        let n = 8
            .min(limits.max_num_batched_tokens)
            .min(self.num_kv_blocks() * block_size)
            .min(limits.max_model_len);
        if n == 0 {
            return Err(RunnerError::NoKvCache);
        }
        let blocks = (0..n.div_ceil(block_size) as u32).collect();
        CpuModelRunner::execute_model(self, &ModelInput::single(&vec![0; n], 0, blocks))?;
        Ok(())
    }

    fn execute_model(&mut self, input: &ModelInput) -> Result<Logits, RunnerError> {
        CpuModelRunner::execute_model(self, input)
    }

    fn computes_span_logits(&self) -> bool {
        true
    }

    fn execute_model_with_spans(
        &mut self,
        input: &ModelInput,
        spans: &[LogitsSpan],
        sink: &mut LogitsSink<'_>,
    ) -> Result<Logits, RunnerError> {
        CpuModelRunner::execute_model_with_spans(self, input, spans, sink)
    }

    fn reload_weight(&mut self, weights: &ModelWeights, name: &str) -> Result<(), RunnerError> {
        CpuModelRunner::reload_weight(self, weights, name)
    }

    fn offload_weights(&mut self) -> Result<(), RunnerError> {
        Ok(())
    }

    fn restore_weights(&mut self) -> Result<(), RunnerError> {
        Ok(())
    }

    fn set_profiling(&mut self, on: bool) -> bool {
        CpuModelRunner::set_profiling(self, on);
        true
    }

    fn profile(&self) -> Option<&StepProfile> {
        CpuModelRunner::profile(self)
    }
}
