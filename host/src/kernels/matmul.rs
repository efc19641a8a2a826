//! [`matmul`]: choosing the kernel and splitting the rows between threads.

use std::cell::RefCell;
use std::ops::Range;

use super::cpu::CpuKernels;
use super::gemm::{gemm_panels, NR};
use super::gemv::gemv_rows;
use super::interleaved::AVX512_GROUP;
use super::quant::Q8Acts;
use super::weights::Packed;
use super::{OutPtr, ThreadPool, WeightMatrix};

thread_local! {
    /// The caller's quantized activations, reused across calls.
    static ACTS: RefCell<Q8Acts> = RefCell::new(Q8Acts::default());
}

/// Which kind of kernel computes a [`matmul_with`]: integer dot products or
/// the f32 GEMM (the CPU kernel family is another choice, [`CpuKernels`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPath {
    /// Quantized weights: the integer kernels at every batch size. Their
    /// result for a token does not depend on the other tokens of the batch
    /// (per-token 8-bit activations, exact integer block sums, a fixed
    /// accumulation order), so continuous batching, chunked prefill and
    /// preemption by recompute reproduce one-at-a-time outputs exactly.
    /// Choosing the GEMM for large batches broke that: a decode batched
    /// with a prefill got f32 arithmetic, alone 8-bit, and greedy outputs
    /// diverged at near-ties (tests/engine.rs). Float weights: the GEMM.
    Auto,
    /// Fused integer dequantize-dot kernels (quantized weights only; float
    /// weights use the GEMM).
    Integer,
    /// Dequantize 16-row panels to f32 and run the FMA microkernel.
    Gemm,
}

/// `out[t * rows + r] = sum_c W[r, c] * x[t * cols + c]` for every token
/// `t < n_tokens` (`x` is row-major `[n_tokens, cols]`, `out` is
/// `[n_tokens, rows]`), on all threads of `pool`.
///
/// Panics if `x` or `out` has the wrong length (a caller bug).
pub fn matmul(pool: &ThreadPool, w: &WeightMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    matmul_with(pool, w, x, n_tokens, out, MatmulPath::Auto);
}

/// [`matmul`] on the given [`MatmulPath`] (benchmarks and tests force one).
pub fn matmul_with(
    pool: &ThreadPool,
    w: &WeightMatrix,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    path: MatmulPath,
) {
    matmul_on(pool, w, x, n_tokens, out, path, CpuKernels::active());
}

/// [`matmul_with`] on the given CPU kernel family instead of the active one
/// (benchmarks compare the families in one run; tests check they agree).
///
/// Panics if this CPU cannot run `kernels` (see [`CpuKernels::available`]).
pub fn matmul_on(
    pool: &ThreadPool,
    w: &WeightMatrix,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    path: MatmulPath,
    kernels: CpuKernels,
) {
    assert!(
        kernels.is_supported(),
        "matmul_on: this CPU cannot run the {} kernels",
        kernels.name()
    );
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(
        x.len(),
        n_tokens * cols,
        "matmul: x must hold n_tokens * cols values"
    );
    assert_eq!(
        out.len(),
        n_tokens * rows,
        "matmul: out must hold n_tokens * rows values"
    );
    if n_tokens == 0 {
        return;
    }
    let out = OutPtr::new(out);
    let quantized = matches!(
        w.data,
        Packed::Q4 { .. }
            | Packed::Q4Interleaved { .. }
            | Packed::Q8 { .. }
            | Packed::Q8Interleaved { .. }
    );
    let integer = quantized && path != MatmulPath::Gemm;
    if integer {
        ACTS.with(|acts| {
            let mut acts = acts.borrow_mut();
            acts.quantize(pool, x, n_tokens, cols);
            let acts = &*acts;
            // Whole groups of interleaved rows, so no thread computes a
            // group that another also computes.
            let unit = AVX512_GROUP;
            pool.run(|i, n| gemv_rows(kernels, w, acts, n_tokens, split(rows, unit, i, n), out));
        });
    } else {
        let panels = rows.div_ceil(NR);
        pool.run(|i, n| gemm_panels(w, x, n_tokens, split(panels, 1, i, n), out, kernels));
    }
}

/// Part `i` of `n` of `0..total`, in whole units of `unit` (the last unit
/// may be short), as equal as possible.
fn split(total: usize, unit: usize, i: usize, n: usize) -> Range<usize> {
    let units = total.div_ceil(unit);
    let at = |k: usize| (units * k / n * unit).min(total);
    at(i)..at(i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::gemv::gemv_rows_scalar;
    use crate::kernels::interleaved::AVX2_GROUP;
    use crate::kernels::testutil::{random_gguf_bytes, Rng};
    use crate::kernels::weights::tests::tensor;
    use crate::model::DType;

    /// `W x` in f64 from the dequantized weights.
    fn reference(w: &WeightMatrix, x: &[f32], n: usize) -> Vec<f32> {
        let mut row = vec![0f32; w.cols()];
        let mut out = vec![0f32; n * w.rows()];
        for r in 0..w.rows() {
            w.dequantize_row(r, &mut row);
            for t in 0..n {
                let xt = &x[t * w.cols()..(t + 1) * w.cols()];
                out[t * w.rows() + r] = row
                    .iter()
                    .zip(xt)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    /// `x` rounded through the integer path's 8-bit activation blocks.
    fn quantize_dequantize(x: &[f32], cols: usize) -> Vec<f32> {
        let n = x.len() / cols;
        let mut acts = Q8Acts::default();
        acts.quantize(&ThreadPool::new(1), x, n, cols);
        (0..n)
            .flat_map(|t| {
                let (q, (d, _)) = (acts.row_qs(t), acts.row_scales(t));
                q.iter()
                    .enumerate()
                    .map(move |(i, &v)| f32::from(v) * d[i / 32])
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Largest error relative to the output's RMS.
    fn rel_err(got: &[f32], want: &[f32]) -> f32 {
        let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32)
            .sqrt()
            .max(1e-12);
        got.iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0, f32::max)
            / rms
    }

    fn random_matrix(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> WeightMatrix {
        WeightMatrix::from_tensor(&tensor(
            dtype,
            rows,
            cols,
            random_gguf_bytes(rng, dtype, rows, cols),
        ))
        .unwrap()
    }

    #[test]
    fn split_covers_everything_evenly() {
        for (total, unit, n) in [
            (576, 8, 2),
            (49152, 8, 3),
            (7, 4, 2),
            (3, 1, 4),
            (36, 1, 2),
            (37, 8, 3),
        ] {
            let parts: Vec<_> = (0..n).map(|i| split(total, unit, i, n)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[n - 1].end, total);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].start % unit == 0);
            }
            let sizes: Vec<_> = parts.iter().map(|p| p.len().div_ceil(unit)).collect();
            assert!(
                sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
                "{sizes:?}"
            );
        }
    }

    #[test]
    fn every_dtype_and_batch_size_matches_the_reference() {
        let mut rng = Rng::new(5);
        let pools = [ThreadPool::new(1), ThreadPool::new(3)];
        for dtype in [
            DType::Q4_1,
            DType::Q4_0,
            DType::Q8_0,
            DType::F32,
            DType::F16,
            DType::BF16,
        ] {
            // Odd shapes: partial panels, a scale tail (5 blocks), a single
            // row, two column chunks (2080 > KC_MAX).
            for (rows, cols) in [(37, 160), (1, 32), (48, 576), (3, 2080)] {
                let w = random_matrix(&mut rng, dtype, rows, cols);
                for n in [1, 2, 3, 5, 15, 16, 23] {
                    let x = rng.normals(n * cols);
                    let want = reference(&w, &x, n);
                    let want_q8 = reference(&w, &quantize_dequantize(&x, cols), n);
                    for pool in &pools {
                        for path in [MatmulPath::Auto, MatmulPath::Integer, MatmulPath::Gemm] {
                            let mut got = vec![f32::NAN; n * rows];
                            matmul_with(pool, &w, &x, n, &mut got, path);
                            let integer = path != MatmulPath::Gemm && dtype.block_len() == 32;
                            // The integer path sees 8-bit activations: compare
                            // it with the reference on those exact values.
                            let want = if integer { &want_q8 } else { &want };
                            let err = rel_err(&got, want);
                            let tol = 1e-5;
                            let threads = pool.num_threads();
                            assert!(err < tol, "{dtype:?} {rows}x{cols} n={n} threads={threads} {path:?}: error {err}");
                        }
                    }
                }
            }
        }
    }

    /// Every kernel family this CPU has gives the scalar path's result bit
    /// for bit (so a token's logits do not depend on the CPU or a forced
    /// path), from the row-major layout and both interleaved ones (groups
    /// of 8 and 16 rows):
    /// random weights of every quantized type, the model's shapes (fused
    /// qkv and gate/up, o, down, a slice of the LM head's rows) and odd ones
    /// (1 and 5 blocks, a 9-block row with a 1-block tail, 65 blocks; row
    /// counts that leave a partial group), for 1 to 11 tokens
    /// (every tail of the 4-token tiles), AMX's 16-token tiles whole and with
    /// a tail, and prefill-size batches, split
    /// between two "threads" at a row inside a group.
    #[test]
    fn every_kernel_family_matches_scalar_bit_for_bit() {
        let mut rng = Rng::new(6);
        let shapes = [
            (9, 32),
            (37, 160),
            (20, 288),
            (3, 2080),
            (960, 576),
            (576, 576),
            (3072, 576),
            (576, 1536),
            (1024, 576),
        ];
        for dtype in [DType::Q4_1, DType::Q4_0, DType::Q8_0] {
            for (rows, cols) in shapes {
                let t = tensor(
                    dtype,
                    rows,
                    cols,
                    random_gguf_bytes(&mut rng, dtype, rows, cols),
                );
                // Scalar's layout is row after row; AVX2's interleaves rows.
                let layouts = [None, Some(AVX2_GROUP), Some(AVX512_GROUP)]
                    .map(|g| WeightMatrix::from_tensor_in(&t, g).unwrap());
                let big = if rows * cols <= 576 * 576 { 512 } else { 64 };
                // 16 and 33: AMX's smallest batch, and one past two tiles.
                for n in (1..=11).chain([16, 33, big]) {
                    let mut x = rng.normals(n * cols);
                    // A zero block (d = 0) and a large one (full-range quants).
                    x[..32].fill(0.0);
                    x[cols - 32..cols].iter_mut().for_each(|v| *v *= 1e3);
                    let mut acts = Q8Acts::default();
                    acts.quantize(&ThreadPool::new(1), &x, n, cols);
                    let mut want = vec![0f32; n * rows];
                    gemv_rows_scalar(&layouts[0], &acts, n, 0..rows, OutPtr::new(&mut want));
                    for (w, kernels) in layouts
                        .iter()
                        .flat_map(|w| CpuKernels::available().into_iter().map(move |k| (w, k)))
                    {
                        let mut got = vec![f32::NAN; n * rows];
                        // Two ranges, as two threads would split them.
                        let (a, b) = (0..rows / 3, rows / 3..rows);
                        gemv_rows(kernels, w, &acts, n, a, OutPtr::new(&mut got));
                        gemv_rows(kernels, w, &acts, n, b, OutPtr::new(&mut got));
                        let first = got
                            .iter()
                            .zip(&want)
                            .position(|(g, w)| g.to_bits() != w.to_bits());
                        let group = match w.data {
                            Packed::Q4Interleaved { group, .. }
                            | Packed::Q8Interleaved { group, .. } => group,
                            _ => 1,
                        };
                        assert!(
                            first.is_none(),
                            "{kernels:?} {dtype:?} {group}-row groups {rows}x{cols} n={n}: element {first:?} differs: {} vs {}",
                            got[first.unwrap()],
                            want[first.unwrap()]
                        );
                    }
                }
            }
        }
    }

    /// `matmul_on` gives the same bits on every family, whatever the threads:
    /// 13 tokens (the AMX family runs its VNNI kernel) and 40 (its tiles, on
    /// the pool's worker threads too, which must not die for want of the
    /// tile permission, as llama.cpp's AMX build does).
    #[test]
    fn matmul_on_every_family_and_pool_agrees() {
        let mut rng = Rng::new(9);
        let pools = [ThreadPool::new(1), ThreadPool::new(3)];
        for (dtype, n) in [
            (DType::Q4_1, 13),
            (DType::Q8_0, 13),
            (DType::Q4_1, 40),
            (DType::Q8_0, 40),
        ] {
            let (rows, cols) = (100, 576);
            let w = random_matrix(&mut rng, dtype, rows, cols);
            let x = rng.normals(n * cols);
            let mut want = vec![0f32; n * rows];
            matmul_on(
                &pools[0],
                &w,
                &x,
                n,
                &mut want,
                MatmulPath::Auto,
                CpuKernels::Scalar,
            );
            for (pool, kernels) in pools
                .iter()
                .flat_map(|p| CpuKernels::available().into_iter().map(move |k| (p, k)))
            {
                let mut got = vec![f32::NAN; n * rows];
                matmul_on(pool, &w, &x, n, &mut got, MatmulPath::Auto, kernels);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{kernels:?} {dtype:?} n={n}"
                );
            }
        }
    }

    /// Every family's microkernels give the portable kernel's bits: one
    /// token, 13 (two AVX2 tiles and a tail; an AVX-512 tile and a tail)
    /// and 27 (two AVX-512 tiles and a tail), quantized (the forced GEMM)
    /// and float.
    #[test]
    fn portable_gemm_matches_every_family_bit_for_bit() {
        let mut rng = Rng::new(8);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for dtype in [DType::Q4_1, DType::F32, DType::F16, DType::BF16] {
            for (rows, cols, n) in [(40, 96, 13), (64, 96, 1), (72, 160, 27)] {
                let w = random_matrix(&mut rng, dtype, rows, cols);
                let x = rng.normals(n * cols);
                let product = |kernels| {
                    let mut out = vec![f32::NAN; n * rows];
                    let panels = 0..rows.div_ceil(NR);
                    gemm_panels(&w, &x, n, panels, OutPtr::new(&mut out), kernels);
                    out
                };
                let portable = product(CpuKernels::Scalar);
                assert!(rel_err(&portable, &reference(&w, &x, n)) < 1e-5);
                for kernels in CpuKernels::available() {
                    assert_eq!(
                        bits(&product(kernels)),
                        bits(&portable),
                        "{kernels:?} {dtype:?} {rows}x{cols} n={n}"
                    );
                }
            }
        }
    }

    /// Float weights: every token of a batch gets the bits it gets alone
    /// from the portable kernel on one thread, whatever the batch (one
    /// token: the decode's side-by-side panels; more: the 6-token tiles,
    /// the 12-token AVX-512 ones and their tails), the family and the
    /// threads. Shapes: whole and partial panels, groups of four panels
    /// with and without leftovers, two column chunks (2080 > `KC_MAX`).
    #[test]
    fn float_weights_give_each_token_its_bits_alone_on_every_family() {
        let mut rng = Rng::new(10);
        let pools = [ThreadPool::new(1), ThreadPool::new(3)];
        let n = 27;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (rows, cols) in [(37, 160), (128, 96), (100, 64), (3, 2080), (80, 2080)] {
                let w = random_matrix(&mut rng, dtype, rows, cols);
                let x = rng.normals(n * cols);
                let product = |pool, kernels, batch: usize| {
                    let mut out = vec![f32::NAN; n * rows];
                    for t0 in (0..n).step_by(batch) {
                        let m = batch.min(n - t0);
                        let (x, out) = (
                            &x[t0 * cols..][..m * cols],
                            &mut out[t0 * rows..][..m * rows],
                        );
                        matmul_on(pool, &w, x, m, out, MatmulPath::Auto, kernels);
                    }
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                let alone = product(&pools[0], CpuKernels::Scalar, 1);
                for (pool, kernels) in pools
                    .iter()
                    .flat_map(|p| CpuKernels::available().into_iter().map(move |k| (p, k)))
                {
                    for batch in [1, 2, 6, 7, 13, 27] {
                        assert!(
                            product(pool, kernels, batch) == alone,
                            "{dtype:?} {rows}x{cols} {kernels:?} threads={} batch={batch}",
                            pool.num_threads()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn empty_batch_is_a_no_op() {
        let w = random_matrix(&mut Rng::new(7), DType::Q4_1, 4, 32);
        matmul(&ThreadPool::new(2), &w, &[], 0, &mut []);
    }
}
