//! Sampling on the device, driven from the host: [`DeviceSampler`] applies a
//! step's sparse logit edits and samples every row where the logits already
//! are (`apply_sparse_bias`, `sample_rows` in kernels/sampling.cu), so only
//! the chosen ids cross to the host — one upload of the packed parameters,
//! two launches, one download, and that download is the only host sync.
//!
//! The device does what the CPU sampler does for a row without penalties,
//! min_tokens or logprobs (greedy, temperature, min-p, exact top-k, top-p,
//! a seeded draw); [`device_eligible`] says which requests those are, and
//! the worker samples on the device only when every row of a step is.

use cudarc::driver::{CudaSlice, PinnedHostSlice, PushKernelArg};

use super::device::{grid, Gpu, GpuError};
use crate::sampling::SamplingParams;

/// Words per row of the packed parameters (`RowParams` in sampling.cu).
const ROW_WORDS: usize = 8;
/// Words per sparse edit (`BiasEntry` in sampling.cu).
const BIAS_WORDS: usize = 3;
/// Threads per sampled row (`SAMPLE_THREADS` in sampling.cu).
const SAMPLE_THREADS: u32 = 1024;
/// Threads per block of `apply_sparse_bias`.
const BIAS_THREADS: u32 = 256;
/// Sparse edits per row the buffers first hold; they grow when a step has
/// more (rare, and it costs one reallocation).
const INITIAL_BIASES_PER_ROW: usize = 16;

/// One row's sampling parameters as the kernel reads them.
///
/// The kernel's "off" values: `temperature` below 1e-5 is greedy (the other
/// fields are then ignored), `top_k` ≤ 0 or ≥ vocab, `top_p` ≥ 1 and
/// `min_p` ≤ 0 disable their cut.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceRow {
    /// Softmax temperature; 0 for a greedy row.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (ties: lowest ids); 0 is off.
    pub top_k: i32,
    /// Nucleus mass; 1 is off.
    pub top_p: f32,
    /// Relative probability floor; 0 is off.
    pub min_p: f32,
    /// Keys the Philox stream: the request's seed, or a random one the
    /// worker drew once for an unseeded request.
    pub seed: u64,
    /// Position of the token being sampled: the Philox counter, so a seeded
    /// request draws the same noise whatever its batch.
    pub position: u32,
}

impl DeviceRow {
    /// The row for a request with `params` sampling the token at `position`
    /// of a model with `vocab` tokens. Greedy exactly when the CPU is
    /// ([`SamplingParams::is_greedy`]); top-k as the CPU's effective cut.
    pub fn from_params(
        params: &SamplingParams,
        seed: u64,
        position: u32,
        vocab: usize,
    ) -> DeviceRow {
        if params.is_greedy() {
            return DeviceRow {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed,
                position,
            };
        }
        DeviceRow {
            temperature: params.temperature,
            // effective_top_k is below vocab, which fits the kernel's int.
            top_k: params
                .effective_top_k(vocab)
                .map_or(0, |k| i32::try_from(k).unwrap_or(0)),
            top_p: params.top_p.min(1.0),
            min_p: params.min_p.max(0.0),
            seed,
            position,
        }
    }

    /// The row in `RowParams` layout.
    fn words(&self) -> [u32; ROW_WORDS] {
        [
            self.temperature.to_bits(),
            self.top_k as u32,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.position,
            0,
        ]
    }
}

/// One sparse logit edit: `logits[row][token] += value`; a value of -inf
/// bans the token. Edits of the same token add up, as on the CPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SparseBias {
    /// Row of the step's batch (index into the `rows` given to `sample`).
    pub row: u32,
    /// Token id, below the vocabulary size.
    pub token: u32,
    /// Finite bias, or -inf to ban.
    pub value: f32,
}

impl SparseBias {
    /// The edit in `BiasEntry` layout.
    fn words(&self) -> [u32; BIAS_WORDS] {
        [self.row, self.token, self.value.to_bits()]
    }
}

/// Whether a request can be sampled on the device: what the CPU sampler
/// does that the kernel does not rules it out.
///
/// - `logprobs` (any, even 0): the raw log-softmax of the sampled token and
///   the top alternatives are computed on the host from the unprocessed row;
/// - penalties (repetition, frequency, presence): they need the request's
///   token history, which lives on the host;
/// - `min_tokens` > 0: EOS and stop tokens are masked while the output is
///   short (the worker could send those as bans; it does not yet);
/// - `logit_bias`, `allowed_token_ids`, `bad_words`: the host applies them
///   (`sampling::token_filters`); bad words also need the output so far.
///
/// Everything else (temperature, top-k, top-p, min-p, the seed) the kernel
/// does; `extra_args` only matters to a sampler plugin, which the worker
/// runs on the host anyway.
pub fn device_eligible(params: &SamplingParams) -> bool {
    params.logprobs.is_none()
        && params.repetition_penalty == 1.0
        && params.frequency_penalty == 0.0
        && params.presence_penalty == 0.0
        && params.min_tokens == 0
        && params.logit_bias.is_empty()
        && params.allowed_token_ids.is_none()
        && params.bad_words_token_ids.is_empty()
}

/// Checks one step against the buffers and the logits before anything is
/// uploaded: a bad index would make the kernels write out of bounds.
fn check_step(
    max_rows: usize,
    logits_len: usize,
    vocab: usize,
    rows: &[DeviceRow],
    biases: &[SparseBias],
) -> Result<(), String> {
    if rows.len() > max_rows {
        return Err(format!(
            "{} rows in one step, but the device sampler was made for at most {max_rows}: \
             create it with max_rows >= the largest batch",
            rows.len()
        ));
    }
    if vocab == 0 || i32::try_from(vocab).is_err() {
        return Err(format!("vocabulary size {vocab} is not in 1..=i32::MAX"));
    }
    if logits_len < rows.len() * vocab {
        return Err(format!(
            "the logits hold {logits_len} values, fewer than {} rows x vocab {vocab}",
            rows.len()
        ));
    }
    for b in biases {
        if b.row as usize >= rows.len() || b.token as usize >= vocab {
            return Err(format!(
                "sparse bias at row {} token {} is outside the step's {} rows x vocab {vocab}",
                b.row,
                b.token,
                rows.len()
            ));
        }
        if !(b.value.is_finite() || b.value == f32::NEG_INFINITY) {
            return Err(format!(
                "sparse bias {} at row {} token {} is neither finite nor -inf (a ban)",
                b.value, b.row, b.token
            ));
        }
    }
    Ok(())
}

/// Writes `rows` at the start of `out` and `biases` from word
/// `max_rows * ROW_WORDS` on: the layout the kernels read.
fn pack(rows: &[DeviceRow], biases: &[SparseBias], max_rows: usize, out: &mut [u32]) {
    for (chunk, row) in out.chunks_exact_mut(ROW_WORDS).zip(rows) {
        chunk.copy_from_slice(&row.words());
    }
    let edits = &mut out[max_rows * ROW_WORDS..];
    for (chunk, bias) in edits.chunks_exact_mut(BIAS_WORDS).zip(biases) {
        chunk.copy_from_slice(&bias.words());
    }
}

/// Persistent device and pinned host buffers for sampling up to `max_rows`
/// rows per step (vLLM's GPU `Sampler` with its input buffers).
pub struct DeviceSampler {
    max_rows: usize,
    /// Sparse edits the buffers hold.
    bias_capacity: usize,
    /// The packed parameters on the device: rows, then edits.
    params: CudaSlice<u32>,
    /// Their pinned host copy, so the upload is asynchronous.
    staging: PinnedHostSlice<u32>,
    /// The chosen ids, one per row.
    ids: CudaSlice<i32>,
    /// Their host copy: pageable, so the copy returns only once the ids
    /// are here (the step's one sync), and reading them is plain memory
    /// (cudarc's pinned memory is write-combined, slow to read).
    ids_host: Vec<i32>,
}

impl DeviceSampler {
    /// Buffers for up to `max_rows` rows per step on `gpu`.
    pub fn new(gpu: &Gpu, max_rows: usize) -> Result<DeviceSampler, GpuError> {
        if max_rows == 0 {
            return Err(GpuError::Unsupported(
                "a device sampler needs max_rows >= 1 (the largest batch it samples)".into(),
            ));
        }
        let bias_capacity = max_rows * INITIAL_BIASES_PER_ROW;
        let (params, staging) = param_buffers(gpu, max_rows, bias_capacity)?;
        Ok(DeviceSampler {
            max_rows,
            bias_capacity,
            params,
            staging,
            ids: gpu.stream.alloc_zeros(max_rows)?,
            ids_host: vec![0; max_rows],
        })
    }

    /// The most rows one step may have.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Samples one token for each of `rows`, row `i` from row `i` of
    /// `logits` (`[rows.len(), vocab]` f32 on `gpu`'s stream, at least that
    /// long), after adding `biases`. Sampled rows are left scaled by
    /// 1/temperature and the biases stay applied.
    ///
    /// Queued after whatever is on the stream (the forward pass); returns
    /// when the ids are on the host.
    pub fn sample(
        &mut self,
        gpu: &Gpu,
        logits: &mut CudaSlice<f32>,
        vocab: usize,
        rows: &[DeviceRow],
        biases: &[SparseBias],
    ) -> Result<Vec<u32>, GpuError> {
        check_step(self.max_rows, logits.len(), vocab, rows, biases)
            .map_err(|e| GpuError::Unsupported(format!("device sampling: {e}")))?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        if biases.len() > self.bias_capacity {
            let capacity = biases.len().next_power_of_two();
            (self.params, self.staging) = param_buffers(gpu, self.max_rows, capacity)?;
            self.bias_capacity = capacity;
        }
        // Waits only for the previous step's upload of the same buffer.
        pack(rows, biases, self.max_rows, self.staging.as_mut_slice()?);
        let s = &gpu.stream;
        // cudarc copies a pinned slice whole: the unused tail too (a few KB
        // at the initial 16 edits per row), one copy all the same.
        s.memcpy_htod(&self.staging, &mut self.params)?;
        let (n, vocab_i) = (rows.len(), vocab as i32);
        if !biases.is_empty() {
            let entries = self.params.slice(self.max_rows * ROW_WORDS..);
            let count = biases.len() as i32;
            let mut b = s.launch_builder(gpu.func("apply_sparse_bias"));
            b.arg(&mut *logits).arg(&vocab_i).arg(&entries).arg(&count);
            // SAFETY: the arguments match the kernel's; check_step kept
            // every entry inside the logits.
            unsafe {
                b.launch(grid(
                    (biases.len() as u32).div_ceil(BIAS_THREADS),
                    BIAS_THREADS,
                ))
            }?;
        }
        let row_params = self.params.slice(..n * ROW_WORDS);
        let mut b = s.launch_builder(gpu.func("sample_rows"));
        b.arg(&mut self.ids)
            .arg(&mut *logits)
            .arg(&vocab_i)
            .arg(&row_params);
        // SAFETY: one block per row, each inside the logits (check_step).
        unsafe { b.launch(grid(n as u32, SAMPLE_THREADS)) }?;
        let ids = &mut self.ids_host[..n];
        s.memcpy_dtoh(&self.ids.slice(..n), ids)?;
        ids.iter()
            .enumerate()
            .map(|(row, &id)| {
                u32::try_from(id)
                    .ok()
                    .filter(|&t| (t as usize) < vocab)
                    .ok_or_else(|| {
                        GpuError::Unsupported(format!(
                            "sample_rows chose id {id} for row {row} of vocab {vocab} (a kernel bug)"
                        ))
                    })
            })
            .collect()
    }
}

/// The packed-parameter buffers for `max_rows` rows and `bias_capacity`
/// edits: on the device, and pinned (zeroed) on the host.
fn param_buffers(
    gpu: &Gpu,
    max_rows: usize,
    bias_capacity: usize,
) -> Result<(CudaSlice<u32>, PinnedHostSlice<u32>), GpuError> {
    let words = max_rows * ROW_WORDS + bias_capacity * BIAS_WORDS;
    // SAFETY: zeroed before anything reads it.
    let mut staging = unsafe { gpu.ctx.alloc_pinned::<u32>(words) }?;
    staging.as_mut_slice()?.fill(0);
    Ok((gpu.stream.alloc_zeros(words)?, staging))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: i32, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_rows_follow_the_cpus_rule_and_drop_the_cuts() {
        for t in [0.0, 9e-6] {
            let row = DeviceRow::from_params(&params(t, 5, 0.5, 0.2), 7, 3, 100);
            assert_eq!(
                row,
                DeviceRow {
                    temperature: 0.0,
                    top_k: 0,
                    top_p: 1.0,
                    min_p: 0.0,
                    seed: 7,
                    position: 3
                }
            );
        }
        // 1e-5 itself is sampled, on the CPU and here.
        assert_eq!(
            DeviceRow::from_params(&params(1e-5, 0, 1.0, 0.0), 0, 0, 100).temperature,
            1e-5
        );
    }

    #[test]
    fn top_k_is_the_cpus_effective_cut_and_off_is_zero() {
        let k =
            |top_k, vocab| DeviceRow::from_params(&params(0.8, top_k, 1.0, 0.0), 1, 0, vocab).top_k;
        assert_eq!(k(5, 100), 5);
        assert_eq!(k(99, 100), 99);
        // The whole vocabulary or more keeps everything: off.
        assert_eq!(k(100, 100), 0);
        assert_eq!(k(1000, 100), 0);
        assert_eq!(k(0, 100), 0);
        assert_eq!(k(-1, 100), 0);
        let row = DeviceRow::from_params(&params(0.8, 0, 0.9, 0.05), 1, 0, 100);
        assert_eq!((row.temperature, row.top_p, row.min_p), (0.8, 0.9, 0.05));
    }

    #[test]
    fn rows_and_edits_pack_in_the_kernels_layout() {
        let row = DeviceRow {
            temperature: 0.5,
            top_k: -1,
            top_p: 0.25,
            min_p: 0.125,
            seed: 0x0123_4567_89ab_cdef,
            position: 42,
        };
        let bias = SparseBias {
            row: 1,
            token: 9,
            value: f32::NEG_INFINITY,
        };
        let max_rows = 3;
        let mut out = vec![u32::MAX; max_rows * ROW_WORDS + 2 * BIAS_WORDS];
        pack(&[row, row], &[bias], max_rows, &mut out);
        let want_row = [
            0x3f00_0000,
            0xffff_ffff,
            0x3e80_0000,
            0x3e00_0000,
            0x89ab_cdef,
            0x0123_4567,
            42,
            0,
        ];
        assert_eq!(out[..ROW_WORDS], want_row);
        assert_eq!(out[ROW_WORDS..2 * ROW_WORDS], want_row);
        // The third row's slot is not written; edits start after max_rows.
        assert!(out[2 * ROW_WORDS..3 * ROW_WORDS]
            .iter()
            .all(|&w| w == u32::MAX));
        assert_eq!(out[3 * ROW_WORDS..3 * ROW_WORDS + 3], [1, 9, 0xff80_0000]);
    }

    #[test]
    fn device_eligibility_excludes_what_only_the_cpu_does() {
        let base = SamplingParams::default();
        assert!(device_eligible(&base));
        // Seeds, truncations, greedy, stop strings, extra_args: the device's.
        assert!(device_eligible(&SamplingParams {
            seed: Some(3),
            top_k: 20,
            top_p: 0.9,
            min_p: 0.1,
            temperature: 0.0,
            stop: vec!["x".into()],
            extra_args: Some(serde_json::json!({"a": 1})),
            ..base.clone()
        }));
        let not = [
            SamplingParams {
                logprobs: Some(0),
                ..base.clone()
            },
            SamplingParams {
                logprobs: Some(5),
                ..base.clone()
            },
            SamplingParams {
                repetition_penalty: 1.1,
                ..base.clone()
            },
            SamplingParams {
                frequency_penalty: 0.5,
                ..base.clone()
            },
            SamplingParams {
                presence_penalty: -0.5,
                ..base.clone()
            },
            SamplingParams {
                min_tokens: 1,
                ..base.clone()
            },
            SamplingParams {
                logit_bias: vec![(3, 1.0)],
                ..base.clone()
            },
            SamplingParams {
                allowed_token_ids: Some(vec![3]),
                ..base.clone()
            },
            SamplingParams {
                bad_words_token_ids: vec![vec![3]],
                ..base.clone()
            },
        ];
        for p in &not {
            assert!(!device_eligible(p), "{p:?}");
        }
    }

    #[test]
    fn a_step_outside_the_buffers_or_the_logits_is_refused_by_name() {
        let row = DeviceRow::from_params(&SamplingParams::default(), 0, 0, 10);
        let ok = |row: u32, token: u32, value: f32| SparseBias { row, token, value };
        assert!(check_step(
            2,
            20,
            10,
            &[row, row],
            &[ok(1, 9, -1.0), ok(0, 0, f32::NEG_INFINITY)]
        )
        .is_ok());
        let err = |r: Result<(), String>| r.unwrap_err();
        assert!(err(check_step(1, 20, 10, &[row, row], &[])).contains("at most 1"));
        assert!(
            err(check_step(2, 19, 10, &[row, row], &[])).contains("fewer than 2 rows x vocab 10")
        );
        assert!(err(check_step(2, 20, 0, &[], &[])).contains("vocabulary size 0"));
        assert!(err(check_step(2, 20, 10, &[row, row], &[ok(2, 0, 1.0)])).contains("row 2 token 0"));
        assert!(
            err(check_step(2, 20, 10, &[row, row], &[ok(0, 10, 1.0)])).contains("row 0 token 10")
        );
        for bad in [f32::NAN, f32::INFINITY] {
            assert!(err(check_step(2, 20, 10, &[row, row], &[ok(0, 1, bad)]))
                .contains("neither finite nor -inf"));
        }
    }
}
