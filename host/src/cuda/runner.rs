//! [`GpuModelRunner`]: the llama forward pass on one GPU over a paged bf16
//! KV cache, for a flattened batch that mixes prefill chunks and decodes —
//! the same inputs and outputs as the CPU runner, so the two are compared
//! directly (tests/gpu_runner.rs).
//!
//! A pure decode batch replays a CUDA graph captured for its padded size
//! (vLLM's piecewise-free "full" decode graphs): the step's metadata is
//! uploaded in one copy into persistent buffers at fixed addresses, then the
//! graph launches every kernel of the step at once. Any other batch runs
//! the same launches eagerly ([`forward::Model::run`]).

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};

use super::attention::{PagedAttention, StepShape};
use super::device::{Gpu, GpuError};
use super::forward::{Activations, DeviceKvCache, Model};
use super::graphs::{capture_sizes, decode_graph_size};
use super::metadata::AttentionMetadata;
use super::weights::DeviceWeights;
use crate::model::LlamaConfig;
use crate::model_runner::{Logits, ModelInput};

/// The captured decode graphs and the inputs they read.
struct DecodeGraphs {
    /// Captured batch sizes, ascending.
    sizes: Vec<usize>,
    /// One graph per size, same order.
    graphs: Vec<CudaGraph>,
    /// The packed step metadata every graph reads (sized for the largest).
    inputs: CudaSlice<i32>,
    /// Block-table width: `ceil(max_model_len / block_size)`.
    width: usize,
}

/// The GPU model runner of a llama-family model.
pub struct GpuModelRunner {
    model: Model,
    block_size: usize,
    max_model_len: usize,
    kv: Option<DeviceKvCache>,
    graphs: Option<DecodeGraphs>,
    enforce_eager: bool,
}

impl GpuModelRunner {
    /// A runner over `weights` already on the device.
    pub fn new(
        gpu: &Gpu,
        config: LlamaConfig,
        weights: DeviceWeights,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        block_size: usize,
    ) -> Result<GpuModelRunner, GpuError> {
        if max_num_batched_tokens == 0 || block_size == 0 || max_model_len == 0 {
            return Err(GpuError::Unsupported(
                "max_num_batched_tokens, max_model_len and block_size must be at least 1".into(),
            ));
        }
        let attn = PagedAttention::new(gpu, &config, block_size)?;
        let act = Activations::new(gpu, &config, max_num_batched_tokens)?;
        Ok(GpuModelRunner {
            model: Model {
                config,
                weights,
                act,
                attn,
            },
            block_size,
            max_model_len,
            kv: None,
            graphs: None,
            enforce_eager: false,
        })
    }

    /// The model's hyper-parameters.
    pub fn model_config(&self) -> &LlamaConfig {
        &self.model.config
    }

    /// The weights on the device (to offload them while asleep).
    pub fn weights(&self) -> &DeviceWeights {
        &self.model.weights
    }

    /// The weights on the device, mutably (to update named tensors).
    pub fn weights_mut(&mut self) -> &mut DeviceWeights {
        &mut self.model.weights
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> u64 {
        self.model.weights.bytes()
    }

    /// Bytes of the activation buffers and the split-K workspace (the
    /// activation peak: they are sized for the largest step and never
    /// grow). The graphs' input buffer, allocated at capture, is extra.
    pub fn activation_bytes(&self) -> u64 {
        self.model.act.bytes() + self.model.attn.workspace_bytes()
    }

    /// Bytes one KV block takes across all layers (K and V, bf16).
    pub fn bytes_per_block(&self) -> usize {
        let c = &self.model.config;
        2 * 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim
    }

    /// Allocates (or replaces) the KV cache with `num_blocks` blocks. The
    /// captured graphs baked the old cache's address, so they are dropped:
    /// call [`capture_graphs`](Self::capture_graphs) again after.
    pub fn initialize_kv_cache(&mut self, gpu: &Gpu, num_blocks: usize) -> Result<(), GpuError> {
        self.clear_graphs();
        self.kv = None;
        let c = &self.model.config;
        let layer_len = num_blocks * self.block_size * c.num_key_value_heads * c.head_dim;
        let total = layer_len * c.num_hidden_layers;
        self.kv = Some(DeviceKvCache {
            num_blocks,
            k: gpu.stream.alloc_zeros(total)?,
            v: gpu.stream.alloc_zeros(total)?,
            layer_len,
        });
        Ok(())
    }

    /// Drops the KV cache (sleep, shutdown, or before a resize) and the
    /// graphs that read it.
    pub fn free_kv_cache(&mut self) {
        self.clear_graphs();
        self.kv = None;
    }

    /// vLLM's `enforce_eager`: with `true` every step runs eagerly and the
    /// captured graphs are dropped; [`capture_graphs`](Self::capture_graphs)
    /// then captures nothing.
    pub fn set_enforce_eager(&mut self, enforce_eager: bool) {
        self.enforce_eager = enforce_eager;
        if enforce_eager {
            self.clear_graphs();
        }
    }

    /// The captured decode batch sizes, ascending (empty: every step eager).
    pub fn graph_sizes(&self) -> &[usize] {
        self.graphs.as_ref().map_or(&[], |g| &g.sizes)
    }

    /// Drops the captured graphs and their input buffer (sleep, shutdown,
    /// KV-cache resize).
    pub fn clear_graphs(&mut self) {
        self.graphs = None;
    }

    /// Captures one CUDA graph per decode batch size of
    /// [`capture_sizes`]`(max_num_seqs)` (capped at
    /// `max_num_batched_tokens`), largest first as vLLM does, each after a
    /// warm-up run of the same size (so lazy module loading and cuBLAS's
    /// kernel choice happen outside the capture). Needs the KV cache, whose
    /// address the graphs bake. Returns the captured sizes.
    ///
    /// Warm-up and capture run an all-padding batch: every slot −1 and every
    /// length 0, so they neither write nor read the cache.
    pub fn capture_graphs(
        &mut self,
        gpu: &Gpu,
        max_num_seqs: usize,
    ) -> Result<Vec<usize>, GpuError> {
        self.clear_graphs();
        if self.enforce_eager {
            return Ok(Vec::new());
        }
        let kv = self.kv.as_mut().ok_or_else(|| {
            GpuError::Unsupported(
                "allocate the KV cache (initialize_kv_cache) before capturing CUDA graphs: \
                 they bake its address"
                    .into(),
            )
        })?;
        let sizes = capture_sizes(max_num_seqs.min(self.model.act.tokens));
        let Some(&largest) = sizes.last() else {
            return Ok(Vec::new());
        };
        let width = self.max_model_len.div_ceil(self.block_size);
        let empty = ModelInput::default();
        let padding = |p: usize| {
            AttentionMetadata::build_fixed(&empty, self.block_size, p, width)
                .map_err(|e| GpuError::Unsupported(e.to_string()))
        };
        let mut inputs = gpu
            .stream
            .alloc_zeros::<i32>(padding(largest)?.layout().size())?;
        let s = &gpu.stream;
        let mut graphs = Vec::with_capacity(sizes.len());
        for &p in sizes.iter().rev() {
            let meta = padding(p)?;
            let layout = meta.layout();
            s.memcpy_htod(&meta.pack(&empty), &mut inputs)?;
            let shape = StepShape {
                num_tokens: p,
                num_seqs: p,
                max_query_len: 1,
                width,
                max_seq_len: self.max_model_len,
            };
            self.model.run(gpu, kv, &inputs, layout, &shape)?;
            s.synchronize()?;
            // Thread-local: an unsafe call (a synchronous allocation) from
            // this thread fails the capture instead of silently breaking
            // it; other threads' CUDA work is not affected.
            s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let ran = self.model.run(gpu, kv, &inputs, layout, &shape);
            // End the capture whatever happened, so the stream stays usable.
            // (The graph allocates nothing, so auto-free has no effect; the
            // 12.8 bindings have no zero flag.)
            let graph = s.end_capture(
                CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            );
            ran?;
            graphs.push(graph?.ok_or_else(|| {
                GpuError::Unsupported(format!("capturing decode batch {p} recorded no graph"))
            })?);
        }
        graphs.reverse();
        self.graphs = Some(DecodeGraphs {
            sizes: sizes.clone(),
            graphs,
            inputs,
            width,
        });
        Ok(sizes)
    }

    /// Runs one step and returns each sequence's last-token logits.
    pub fn execute_model(&mut self, gpu: &Gpu, input: &ModelInput) -> Result<Logits, GpuError> {
        let (ns, vocab) = (input.seqs.len(), self.model.config.vocab_size);
        let logits = self.forward(gpu, input)?;
        let data = gpu.stream.memcpy_dtov(&logits.slice(..ns * vocab))?;
        Ok(Logits {
            num_seqs: ns,
            vocab_size: vocab,
            data,
        })
    }

    /// The forward pass; the logits stay on the device (for device
    /// sampling): rows `0..input.seqs.len()` of the returned buffer.
    pub fn forward(
        &mut self,
        gpu: &Gpu,
        input: &ModelInput,
    ) -> Result<&mut CudaSlice<f32>, GpuError> {
        let kv = self.kv.as_mut().ok_or_else(|| {
            GpuError::Unsupported(
                "the KV cache is not allocated; call initialize_kv_cache first".into(),
            )
        })?;
        let limits = crate::model_runner::InputLimits {
            vocab_size: self.model.config.vocab_size,
            max_model_len: self.max_model_len,
            max_num_batched_tokens: self.model.act.tokens,
            num_blocks: kv.num_blocks,
            block_size: self.block_size,
        };
        input
            .validate(&limits)
            .map_err(|e| GpuError::Unsupported(e.to_string()))?;
        let s = &gpu.stream;
        if let Some(g) = &mut self.graphs {
            if let Some(p) = decode_graph_size(&g.sizes, input) {
                let pad = p - input.seqs.len();
                let meta = AttentionMetadata::build_fixed(input, self.block_size, pad, g.width)
                    .map_err(|e| GpuError::Unsupported(e.to_string()))?;
                let packed = meta.pack(input);
                if packed.len() > g.inputs.len() {
                    return Err(GpuError::Unsupported(format!(
                        "decode batch {p} packs {} metadata entries, more than the {} the \
                         graphs were captured with (recapture after changing the limits)",
                        packed.len(),
                        g.inputs.len()
                    )));
                }
                s.memcpy_htod(&packed, &mut g.inputs)?;
                let at = g.sizes.partition_point(|&x| x < p);
                g.graphs[at].launch()?;
                return Ok(&mut self.model.act.logits);
            }
        }
        let meta = AttentionMetadata::build(input, self.block_size, 0);
        let step = s.memcpy_stod(&meta.pack(input))?;
        let shape = StepShape {
            num_tokens: input.token_ids.len(),
            num_seqs: input.seqs.len(),
            max_query_len: meta.max_query_len,
            width: meta.max_blocks,
            max_seq_len: input.seqs.iter().map(|q| q.context_len).max().unwrap_or(0),
        };
        self.model.run(gpu, kv, &step, meta.layout(), &shape)?;
        Ok(&mut self.model.act.logits)
    }
}
