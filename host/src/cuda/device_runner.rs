//! The GPU worker's device side (vLLM's `gpu_worker.py` around its
//! `GPUModelRunner`): [`GpuDevice`] is `init_device` (select the GPU, load
//! the kernels, take the memory snapshot); [`GpuRunner`] is the
//! [`DeviceRunner`] the engine's `Worker` drives — weights uploaded in
//! bf16, the KV budget from a profile run, CUDA graphs captured at warm-up,
//! sleep by offloading the weights to host memory; a step whose rows are
//! all device-eligible is sampled on the GPU ([`DeviceSampler`]), its
//! logits never downloaded.

use std::sync::Arc;

use super::device::{Gpu, GpuError};
use super::memory::{available_kv_cache_memory, KvBudget, MemoryProfile, MemorySnapshot};
use super::nvrtc;
use super::runner::GpuModelRunner;
use super::sampler::{device_eligible, DeviceRow, DeviceSampler};
use super::weights::{DeviceWeights, HostWeights};
use crate::config::CacheDtype;
use crate::model::{LlamaConfig, ModelWeights};
use crate::model_runner::{
    DeviceRunner, DeviceSampleRow, KvCacheBudget, KvCacheShape, KvDtype, Logits, ModelInput,
    RunnerConfig, RunnerError, SeqInput,
};

/// An opened GPU and the memory it had free before this worker allocated
/// anything.
pub struct GpuDevice {
    gpu: Arc<Gpu>,
    ordinal: usize,
    at_init: MemorySnapshot,
}

impl GpuDevice {
    /// Opens device `ordinal`, loads every kernel (compiled by NVRTC or
    /// from the PTX cache) and takes the memory snapshot.
    pub fn open(ordinal: usize) -> Result<GpuDevice, RunnerError> {
        let device = format!("cuda:{ordinal}");
        let err = |e: GpuError| device_error(&device, e);
        let gpu = Gpu::new(ordinal, &nvrtc::default_cache_dir()).map_err(err)?;
        let at_init = gpu.memory().map_err(err)?;
        tracing::info!(
            device,
            free_gib = at_init.free as f64 / GIB,
            total_gib = at_init.total as f64 / GIB,
            "worker: GPU device"
        );
        Ok(GpuDevice {
            gpu: Arc::new(gpu),
            ordinal,
            at_init,
        })
    }

    /// `cuda:N`.
    pub fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// A GPU error as the worker reports it, naming the device.
fn device_error(device: &str, e: GpuError) -> RunnerError {
    RunnerError::Device {
        device: device.to_string(),
        message: e.to_string(),
    }
}

/// The model on one GPU, as the worker drives it.
pub struct GpuRunner {
    gpu: Arc<Gpu>,
    name: String,
    at_init: MemorySnapshot,
    config: LlamaConfig,
    limits: RunnerConfig,
    max_num_seqs: usize,
    enforce_eager: bool,
    /// The runner; `None` while its weights sleep in `offloaded`.
    runner: Option<GpuModelRunner>,
    /// The weights in host memory during a level-1 sleep.
    offloaded: Option<HostWeights>,
    /// Blocks of the KV cache (0: none).
    num_blocks: usize,
    /// The device sampler; `None` while the weights sleep (it goes with
    /// everything else on the device).
    sampling: Option<DeviceSampler>,
}

/// The sampler's rows for a step whose sampled rows are `rows`: every
/// logits row up to the last sampled one, because the sampler reads row
/// `i` of the batch from row `i` of the logits; rows nobody samples (a
/// prefill chunk that does not reach the end of its prompt) get a greedy
/// filler whose token is dropped. `None` when a row is not
/// [`device_eligible`] or the step has more rows than `max_rows`.
fn sampler_rows(rows: &[DeviceSampleRow], vocab: usize, max_rows: usize) -> Option<Vec<DeviceRow>> {
    let n = rows.iter().map(|r| r.logits_row + 1).max()?;
    if n > max_rows || !rows.iter().all(|r| device_eligible(r.params)) {
        return None;
    }
    let filler = DeviceRow {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
        position: 0,
    };
    let mut out = vec![filler; n];
    for r in rows {
        out[r.logits_row] = DeviceRow::from_params(r.params, r.seed, r.position, vocab);
    }
    Some(out)
}

// SAFETY: the only field that is not `Send` is the captured CUDA graphs
// (cudarc's `CudaGraph` holds raw graph handles). CUDA allows a graph to be
// used from any thread as long as calls on it are serialized, and every use
// here goes through `&mut GpuRunner`, so one thread at a time; cudarc binds
// the context to the calling thread before each launch. The worker is
// created on one thread and stepped on another (the engine core's), never
// concurrently.
unsafe impl Send for GpuRunner {}

impl GpuRunner {
    /// Dequantizes and uploads `weights` to `device` in bf16 and allocates
    /// the activation buffers for `limits.max_num_batched_tokens`.
    pub fn load(
        device: &GpuDevice,
        weights: &ModelWeights,
        limits: RunnerConfig,
        max_num_seqs: usize,
        enforce_eager: bool,
    ) -> Result<GpuRunner, RunnerError> {
        if !matches!(limits.cache_dtype, CacheDtype::Auto | CacheDtype::Bfloat16) {
            return Err(RunnerError::Config(format!(
                "cache.cache_dtype = {:?}: the GPU runner stores its KV cache in bfloat16; set it to auto or bfloat16",
                limits.cache_dtype.name()
            )));
        }
        let name = device.name();
        let gpu = device.gpu.clone();
        let start = std::time::Instant::now();
        let on_device = DeviceWeights::upload(&gpu, weights).map_err(|e| device_error(&name, e))?;
        tracing::info!(
            device = name,
            gib = on_device.bytes() as f64 / GIB,
            seconds = start.elapsed().as_secs_f64(),
            "worker: weights on the GPU"
        );
        let mut this = GpuRunner {
            gpu,
            name,
            at_init: device.at_init,
            config: weights.config.clone(),
            limits,
            max_num_seqs,
            enforce_eager,
            runner: None,
            offloaded: None,
            num_blocks: 0,
            sampling: None,
        };
        this.runner = Some(this.runner_over(on_device)?);
        this.sampling = Some(this.device_sampling()?);
        Ok(this)
    }

    /// A model runner over weights already on the device.
    fn runner_over(&self, weights: DeviceWeights) -> Result<GpuModelRunner, RunnerError> {
        let mut r = GpuModelRunner::new(
            &self.gpu,
            self.config.clone(),
            weights,
            self.limits.max_num_batched_tokens,
            self.limits.max_model_len,
            self.limits.block_size,
        )
        .map_err(|e| self.error(e))?;
        r.set_enforce_eager(self.enforce_eager);
        Ok(r)
    }

    /// The device sampler's buffers, for up to `max_num_seqs` rows.
    fn device_sampling(&self) -> Result<DeviceSampler, RunnerError> {
        DeviceSampler::new(&self.gpu, self.max_num_seqs).map_err(|e| self.error(e))
    }

    fn error(&self, e: GpuError) -> RunnerError {
        device_error(&self.name, e)
    }

    /// Hands memory freed on the stream back to the device. cudarc frees
    /// stream-ordered (`cuMemFreeAsync`); the device's memory pool returns
    /// what it holds at the next synchronisation, so sleep and the profile
    /// run free for real only after one.
    fn release_freed(&self) {
        if let Err(e) = self.gpu.stream.synchronize() {
            tracing::warn!(device = self.name, error = %e, "worker: synchronising after a free failed");
        }
    }

    /// The runner, unless its weights sleep.
    fn awake(&mut self) -> Result<&mut GpuModelRunner, RunnerError> {
        let name = self.name.clone();
        self.runner.as_mut().ok_or_else(|| RunnerError::Device {
            device: name,
            message: "the weights are offloaded (asleep); wake them up first".into(),
        })
    }

    /// One prefill of `tokens` dummy tokens, split into sequences no longer
    /// than `max_model_len`, each over its own blocks from block 0.
    fn dummy_input(&self, tokens: usize) -> ModelInput {
        let (len, bs) = (self.limits.max_model_len.max(1), self.limits.block_size);
        let mut input = ModelInput::default();
        let mut left = tokens;
        let mut first_block = 0u32;
        while left > 0 {
            let n = left.min(len);
            let blocks = n.div_ceil(bs) as u32;
            input.token_ids.extend(std::iter::repeat_n(0, n));
            input.positions.extend(0..n as u32);
            input.seqs.push(SeqInput {
                query_len: n,
                context_len: n,
                block_table: (first_block..first_block + blocks).collect(),
            });
            first_block += blocks;
            left -= n;
        }
        input
    }
}

/// Frees everything on the device and waits until it is given back (a
/// level-2 sleep or shutdown drops the runner).
impl Drop for GpuRunner {
    fn drop(&mut self) {
        self.runner = None;
        self.sampling = None;
        self.release_freed();
    }
}

impl DeviceRunner for GpuRunner {
    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn model_config(&self) -> &LlamaConfig {
        &self.config
    }

    fn runner_config(&self) -> RunnerConfig {
        self.limits
    }

    fn kv_cache_shape(&self) -> KvCacheShape {
        KvCacheShape {
            num_layers: self.config.num_hidden_layers,
            num_kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
            block_size: self.limits.block_size,
            dtype: KvDtype::Bf16,
        }
    }

    /// K and V in bf16.
    fn bytes_per_block(&self) -> usize {
        self.kv_cache_shape().bytes_per_block()
    }

    fn num_kv_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The profile run: one step of `max_num_batched_tokens` tokens over a
    /// temporary KV cache just large enough, then the snapshot; vLLM's
    /// rule over it (`memory.rs`), or the explicit budget as is.
    fn determine_available_memory(&mut self, budget: &KvCacheBudget) -> Result<usize, RunnerError> {
        let tokens = self.limits.max_num_batched_tokens;
        let input = self.dummy_input(tokens);
        let blocks = input
            .seqs
            .iter()
            .map(|s| s.block_table.len())
            .sum::<usize>();
        let gpu = self.gpu.clone();
        let runner = self.awake()?;
        let run = (|| {
            runner.initialize_kv_cache(&gpu, blocks)?;
            runner.forward(&gpu, &input)?;
            gpu.stream.synchronize()?;
            runner.free_kv_cache();
            // Frees are stream-ordered: the pool gives the memory back at
            // the next synchronisation, and the snapshot must not count it.
            gpu.stream.synchronize()?;
            gpu.memory()
        })();
        runner.free_kv_cache();
        let after = run.map_err(|e| device_error(&self.name, e))?;
        let runner = self.runner.as_ref().expect("awake above");
        let profile = MemoryProfile {
            before: self.at_init,
            weights: runner.weight_bytes(),
            activation_peak: runner.activation_bytes(),
            after,
        };
        let budget = match budget.bytes {
            Some(b) => KvBudget::Bytes(b as u64),
            None => KvBudget::Utilization(budget.gpu_memory_utilization),
        };
        let bytes = available_kv_cache_memory(budget, &profile)
            .map_err(|e| RunnerError::Config(e.to_string()))?;
        tracing::info!(
            device = self.name,
            kv_gib = bytes as f64 / GIB,
            ?profile,
            "worker: memory profile"
        );
        usize::try_from(bytes)
            .map_err(|_| RunnerError::Config("the KV budget overflows usize".into()))
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize) -> Result<(), RunnerError> {
        let (gpu, name) = (self.gpu.clone(), self.name.clone());
        let bytes = num_blocks.saturating_mul(self.bytes_per_block());
        self.awake()?
            .initialize_kv_cache(&gpu, num_blocks)
            .map_err(|e| RunnerError::KvAlloc {
                num_blocks,
                bytes,
                reason: format!("{name}: {e}"),
            })?;
        self.num_blocks = num_blocks;
        Ok(())
    }

    fn free_kv_cache(&mut self) {
        if let Some(r) = self.runner.as_mut() {
            r.free_kv_cache();
        }
        self.num_blocks = 0;
        self.release_freed();
    }

    /// A dummy step, then the decode CUDA graphs (unless `enforce_eager`).
    fn warm_up(&mut self) -> Result<(), RunnerError> {
        if self.num_blocks == 0 {
            return Err(RunnerError::NoKvCache);
        }
        let n = 8
            .min(self.limits.max_num_batched_tokens)
            .min(self.num_blocks * self.limits.block_size)
            .min(self.limits.max_model_len);
        let input = self.dummy_input(n);
        let (gpu, max_num_seqs) = (self.gpu.clone(), self.max_num_seqs);
        let name = self.name.clone();
        let runner = self.awake()?;
        let err = |e| device_error(&name, e);
        runner.forward(&gpu, &input).map_err(err)?;
        let start = std::time::Instant::now();
        let sizes = runner.capture_graphs(&gpu, max_num_seqs).map_err(err)?;
        tracing::info!(
            device = name,
            graphs = sizes.len(),
            largest = sizes.last().copied().unwrap_or(0),
            seconds = start.elapsed().as_secs_f64(),
            "worker: CUDA graphs captured"
        );
        Ok(())
    }

    fn execute_model(&mut self, input: &ModelInput) -> Result<Logits, RunnerError> {
        let gpu = self.gpu.clone();
        let name = self.name.clone();
        self.awake()?
            .execute_model(&gpu, input)
            .map_err(|e| device_error(&name, e))
    }

    /// The forward pass, then [`DeviceSampler::sample`] on its logits: the
    /// ids are the step's only download.
    fn execute_and_sample(
        &mut self,
        input: &ModelInput,
        rows: &[DeviceSampleRow],
    ) -> Option<Result<Vec<u32>, RunnerError>> {
        let vocab = self.config.vocab_size;
        let sampling = self.sampling.as_mut()?;
        let rows_of_step = sampler_rows(rows, vocab, sampling.max_rows())?;
        let (gpu, name) = (&self.gpu, &self.name);
        let Some(runner) = self.runner.as_mut() else {
            return Some(Err(RunnerError::Device {
                device: name.clone(),
                message: "the weights are offloaded (asleep); wake them up first".into(),
            }));
        };
        let run = (|| {
            // The sampler scales its rows in place: the runner's logits
            // buffer is rewritten by the next step anyway.
            let logits = runner.forward(gpu, input)?;
            let ids = sampling.sample(gpu, logits, vocab, &rows_of_step, &[])?;
            Ok(rows.iter().map(|r| ids[r.logits_row]).collect())
        })();
        Some(run.map_err(|e| device_error(name, e)))
    }

    fn reload_weight(&mut self, weights: &ModelWeights, name: &str) -> Result<(), RunnerError> {
        let gpu = self.gpu.clone();
        let device = self.name.clone();
        self.awake()?
            .weights_mut()
            .reload(&gpu, weights, name)
            .map_err(|e| device_error(&device, e))
    }

    /// Copies the weights to host memory and frees everything on the
    /// device (weights, activations, graphs; the worker dropped the KV
    /// cache first).
    fn offload_weights(&mut self) -> Result<(), RunnerError> {
        let Some(runner) = self.runner.take() else {
            return Ok(());
        };
        match runner.weights().download(&self.gpu) {
            Ok(host) => {
                tracing::info!(
                    device = self.name,
                    gib = host.bytes() as f64 / GIB,
                    "worker: weights offloaded"
                );
                self.offloaded = Some(host);
                drop(runner);
                self.sampling = None;
                self.release_freed();
                Ok(())
            }
            Err(e) => {
                self.runner = Some(runner);
                Err(self.error(e))
            }
        }
    }

    fn restore_weights(&mut self) -> Result<(), RunnerError> {
        let Some(host) = self.offloaded.as_ref() else {
            return Ok(());
        };
        let weights = host.upload(&self.gpu).map_err(|e| self.error(e))?;
        self.runner = Some(self.runner_over(weights)?);
        self.sampling = Some(self.device_sampling()?);
        self.offloaded = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::sampling::SamplingParams;

    fn row(
        params: &SamplingParams,
        seed: u64,
        position: u32,
        logits_row: usize,
    ) -> DeviceSampleRow<'_> {
        DeviceSampleRow {
            params,
            seed,
            position,
            logits_row,
        }
    }

    #[test]
    fn a_step_of_eligible_rows_goes_to_the_device_with_greedy_fillers_between() {
        let random = SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.9,
            seed: Some(3),
            ..Default::default()
        };
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        // Logits row 1 is a prefill chunk nobody samples.
        let rows = [row(&random, 3, 17, 0), row(&greedy, 99, 5, 2)];
        let out = sampler_rows(&rows, 1000, 4).expect("every row is device-eligible");
        assert_eq!(out.len(), 3);
        assert_eq!(out[0], DeviceRow::from_params(&random, 3, 17, 1000));
        assert_eq!(
            (
                out[0].temperature,
                out[0].top_k,
                out[0].seed,
                out[0].position
            ),
            (0.7, 20, 3, 17)
        );
        assert_eq!((out[1].temperature, out[2].temperature), (0.0, 0.0));
        assert_eq!((out[2].seed, out[2].position), (99, 5));
    }

    #[test]
    fn one_ineligible_row_or_too_many_rows_send_the_step_to_the_host() {
        let plain = SamplingParams::default();
        for odd in [
            SamplingParams {
                logprobs: Some(0),
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: 0.5,
                ..Default::default()
            },
            SamplingParams {
                min_tokens: 2,
                ..Default::default()
            },
        ] {
            let rows = [row(&plain, 1, 4, 0), row(&odd, 2, 4, 1)];
            assert!(sampler_rows(&rows, 1000, 4).is_none(), "{odd:?}");
        }
        let rows = [row(&plain, 1, 4, 0), row(&plain, 2, 4, 4)];
        assert!(
            sampler_rows(&rows, 1000, 4).is_none(),
            "logits row 4 of at most 4 rows"
        );
        assert!(sampler_rows(&rows, 1000, 5).is_some());
        assert!(sampler_rows(&[], 1000, 4).is_none(), "nothing to sample");
    }

    #[test]
    fn opening_a_gpu_that_is_not_there_names_the_device_and_the_reason() {
        if super::super::device::device_count() > 0 {
            // A machine with a GPU: the device check (scripts/gpu-check.sh)
            // covers opening it.
            return;
        }
        let e = GpuDevice::open(0).err().expect("no GPU here").to_string();
        assert!(e.contains("cuda:0") && e.contains("no CUDA GPU"), "{e}");
    }
}
