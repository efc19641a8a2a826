//! Launching paged attention (kernels/attention.cu): one pass, or split-K
//! (flash-decoding) when a decode step's grid would leave most SMs idle.
//!
//! A decode step has one block per (sequence, KV head): batch 1 of an
//! 8-KV-head model fills 8 of an H200's 132 SMs and reads its whole context
//! through them. Split-K cuts each sequence's keys into [`num_splits`]
//! ranges, one block each, that leave f32 partials (max, sum, output) in a
//! workspace; `paged_attention_reduce` merges them by log-sum-exp.

use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};

use super::device::{Gpu, GpuError};
use crate::model::LlamaConfig;

/// Query rows per attention block (ATTN_ROWS in attention.cu).
const ATTN_ROWS: usize = 16;
/// Threads per attention block (ATTN_WARPS * 32 in attention.cu).
const ATTN_THREADS: u32 = 128;
/// Largest head the attention kernel holds (ATTN_MAX_DIM).
const ATTN_MAX_DIM: usize = 128;
/// Fewest keys a split reads: below this the partials and the merge cost
/// more than the parallelism gains (four 32-key tiles).
pub const MIN_KEYS_PER_SPLIT: usize = 128;
/// Most splits of one sequence (bounds the merge's loop).
pub const MAX_SPLITS: usize = 64;

/// How many key ranges each sequence of a decode step is split into: 1
/// when `num_seqs × num_kv_heads × row_tiles` blocks already make two waves
/// of `sm_count` SMs, else enough splits for about two waves, each of at
/// least [`MIN_KEYS_PER_SPLIT`] of `max_seq_len` keys, at most
/// [`MAX_SPLITS`].
///
/// Inside a CUDA graph the grid is baked at capture, so the runner passes
/// `max_model_len` as `max_seq_len` there: the count is fixed per captured
/// size, and the kernel cuts each sequence by its own length at run time
/// (so a short sequence's ranges are short, not empty). Eagerly it passes
/// the step's longest context.
pub fn num_splits(
    num_seqs: usize,
    num_kv_heads: usize,
    row_tiles: usize,
    max_seq_len: usize,
    sm_count: usize,
) -> usize {
    let blocks = num_seqs * num_kv_heads * row_tiles;
    let target = 2 * sm_count;
    if blocks == 0 || blocks >= target {
        return 1;
    }
    target
        .div_ceil(blocks)
        .min(max_seq_len.div_ceil(MIN_KEYS_PER_SPLIT))
        .clamp(1, MAX_SPLITS)
}

/// Rows (split, token) the split-K workspace needs for any step: splitting
/// happens only below `2 × sm_count` blocks and brings them to under twice
/// that, so `splits × num_seqs × num_kv_heads < 4 × sm_count`.
pub fn workspace_rows(num_kv_heads: usize, sm_count: usize) -> usize {
    (4 * sm_count).div_ceil(num_kv_heads.max(1))
}

/// The sizes of one step's attention launch.
#[derive(Clone, Copy, Debug)]
pub struct StepShape {
    /// Tokens of the step (padding included).
    pub num_tokens: usize,
    /// Sequences of the step (padding included).
    pub num_seqs: usize,
    /// Longest query (1 for a decode step).
    pub max_query_len: usize,
    /// Block-table row width.
    pub width: usize,
    /// Bound on every sequence's length ([`num_splits`]' `max_seq_len`).
    pub max_seq_len: usize,
}

/// One model's paged attention on one GPU: its shapes, the SM count and
/// the split-K workspace (allocated once, so a captured graph reads it at a
/// fixed address).
pub struct PagedAttention {
    num_heads: i32,
    num_kv_heads: i32,
    head_dim: i32,
    block_size: i32,
    sm_count: usize,
    /// Partial outputs, f32 `[rows, num_heads, head_dim]`.
    part_out: CudaSlice<f32>,
    /// Partial (max, sum), f32 `[rows, num_heads, 2]`.
    part_ml: CudaSlice<f32>,
    /// Rows (split, token) of the workspace.
    rows: usize,
}

impl PagedAttention {
    /// Checks that the kernels support `c`'s heads and allocates the
    /// workspace for the device's SM count.
    pub fn new(gpu: &Gpu, c: &LlamaConfig, block_size: usize) -> Result<Self, GpuError> {
        if c.head_dim > ATTN_MAX_DIM
            || !c.head_dim.is_multiple_of(32)
            || c.num_key_value_heads == 0
            || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
        {
            return Err(GpuError::Unsupported(format!(
                "head_dim {} with {} query / {} KV heads: the attention kernel needs head_dim a \
                 multiple of 32 up to {ATTN_MAX_DIM} and whole GQA groups",
                c.head_dim, c.num_attention_heads, c.num_key_value_heads
            )));
        }
        let sm_count = gpu.ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        let sm_count = usize::try_from(sm_count).unwrap_or(1).max(1);
        let rows = workspace_rows(c.num_key_value_heads, sm_count);
        let heads = c.num_attention_heads;
        Ok(PagedAttention {
            num_heads: heads as i32,
            num_kv_heads: c.num_key_value_heads as i32,
            head_dim: c.head_dim as i32,
            block_size: block_size as i32,
            sm_count,
            part_out: gpu.stream.alloc_zeros(rows * heads * c.head_dim)?,
            part_ml: gpu.stream.alloc_zeros(rows * heads * 2)?,
            rows,
        })
    }

    /// Bytes of the split-K workspace.
    pub fn workspace_bytes(&self) -> u64 {
        (self.part_out.num_bytes() + self.part_ml.num_bytes()) as u64
    }

    /// The split count of a step: [`num_splits`] for a decode step, 1 for
    /// one with a prefill chunk (its row tiles already fill the GPU).
    pub fn splits(&self, shape: &StepShape) -> usize {
        if shape.max_query_len != 1 {
            return 1;
        }
        let group = (self.num_heads / self.num_kv_heads) as usize;
        num_splits(
            shape.num_seqs,
            self.num_kv_heads as usize,
            group.div_ceil(ATTN_ROWS),
            shape.max_seq_len,
            self.sm_count,
        )
    }

    /// Attention of one layer: `out` (bf16 `[tokens, heads × head_dim]`)
    /// from the RoPE'd queries in `qkv` and the layer's cache `k` / `v`,
    /// through the step's device metadata. Its grid depends only on `shape`.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        out: &mut CudaSlice<u16>,
        qkv: &CudaSlice<u16>,
        k: &CudaView<u16>,
        v: &CudaView<u16>,
        tables: &CudaView<i32>,
        query_start: &CudaView<i32>,
        seq_lens: &CudaView<i32>,
        shape: &StepShape,
    ) -> Result<(), GpuError> {
        let s = &gpu.stream;
        let (nh, nkv, hd, bs) = (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        );
        let stride = (nh + 2 * nkv) * hd;
        let width = shape.width as i32;
        let scale = 1.0f32 / (hd as f32).sqrt();
        let row_tiles = (shape.max_query_len * (nh / nkv) as usize).div_ceil(ATTN_ROWS) as u32;
        let splits = self.splits(shape);
        let grid = |z: usize| LaunchConfig {
            grid_dim: (row_tiles, nkv as u32, z as u32),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        if splits == 1 {
            let mut b = s.launch_builder(gpu.func("paged_attention"));
            b.arg(out).arg(qkv).arg(k).arg(v).arg(tables);
            b.arg(query_start).arg(seq_lens).arg(&width).arg(&stride);
            b.arg(&nh).arg(&nkv).arg(&hd).arg(&bs).arg(&scale);
            unsafe { b.launch(grid(shape.num_seqs)) }?;
            return Ok(());
        }
        if splits * shape.num_tokens > self.rows {
            return Err(GpuError::Unsupported(format!(
                "split-K needs {splits} x {} workspace rows but has {} (a bug in num_splits' bound)",
                shape.num_tokens, self.rows
            )));
        }
        let (ns, nt) = (splits as i32, shape.num_tokens as i32);
        let mut b = s.launch_builder(gpu.func("paged_attention_split"));
        b.arg(&mut self.part_out)
            .arg(&mut self.part_ml)
            .arg(&ns)
            .arg(&nt);
        b.arg(qkv)
            .arg(k)
            .arg(v)
            .arg(tables)
            .arg(query_start)
            .arg(seq_lens);
        b.arg(&width)
            .arg(&stride)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&bs);
        b.arg(&scale);
        unsafe { b.launch(grid(shape.num_seqs * splits)) }?;
        let mut b = s.launch_builder(gpu.func("paged_attention_reduce"));
        b.arg(out)
            .arg(&self.part_out)
            .arg(&self.part_ml)
            .arg(&ns)
            .arg(&nt);
        b.arg(&nh).arg(&hd);
        let reduce = LaunchConfig {
            grid_dim: (nt as u32, nh as u32, 1),
            block_dim: (ATTN_MAX_DIM as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { b.launch(reduce) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// H200: 132 SMs.
    const SMS: usize = 132;

    #[test]
    fn a_full_grid_is_not_split() {
        // 64 decodes x 8 KV heads = 512 blocks, about 4 waves.
        assert_eq!(num_splits(64, 8, 1, 8192, SMS), 1);
        assert_eq!(num_splits(33, 8, 1, 100_000, SMS), 1);
        assert_eq!(num_splits(0, 8, 1, 8192, SMS), 1);
    }

    #[test]
    fn batch_one_long_context_splits_to_about_two_waves() {
        // 8 blocks: ceil(264 / 8) = 33 splits = 264 blocks.
        assert_eq!(num_splits(1, 8, 1, 8192, SMS), 33);
        // 4 decodes: 32 blocks -> 9 splits.
        assert_eq!(num_splits(4, 8, 1, 8192, SMS), 9);
        // One KV head: capped at MAX_SPLITS.
        assert_eq!(num_splits(1, 1, 1, 1 << 20, SMS), MAX_SPLITS);
    }

    #[test]
    fn short_contexts_get_at_most_one_split_per_128_keys() {
        assert_eq!(num_splits(1, 8, 1, 100, SMS), 1);
        assert_eq!(num_splits(1, 8, 1, 129, SMS), 2);
        assert_eq!(num_splits(1, 8, 1, 1024, SMS), 8);
    }

    #[test]
    fn the_workspace_bound_holds_for_every_step() {
        for sms in [1, 16, 78, 114, 132] {
            for kv in [1, 2, 4, 8, 32] {
                for tiles in [1, 2] {
                    for len in [1, 127, 128, 1000, 8192, 131_072] {
                        for seqs in 1..600 {
                            let s = num_splits(seqs, kv, tiles, len, sms);
                            assert!((1..=MAX_SPLITS).contains(&s));
                            assert!(s == 1 || s * seqs <= workspace_rows(kv, sms),
                                "{seqs} seqs x {kv} kv x {tiles} tiles, len {len}, {sms} SMs: {s} splits");
                            assert!(s == 1 || (s - 1) * MIN_KEYS_PER_SPLIT < len);
                        }
                    }
                }
            }
        }
    }
}
