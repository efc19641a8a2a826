//! Kernel benchmarks: every matmul shape of SmolLM2-135M (Q4_1 layers, the
//! Q8_0 tied LM head) at decode (1 token) and prefill (512 tokens), the
//! integer-vs-GEMM crossover, the per-row kernels, the thread pool's
//! fork-join overhead, and whole-model matmul estimates:
//!
//! - `model/decode_matmuls`: one token through 30 layers x (q, k, v, o,
//!   gate, up, down) + the LM head, each layer with its *own* weights
//!   (~96 MB, like the real model, so caches do not flatter decode);
//! - `model/pp512_matmuls`: 512 tokens through the same 210 layer matmuls
//!   plus the LM head for the last token (what llama-bench's pp512 computes).
//!
//! - `attention/*`: attention's tile kernels over one 128-key chunk of
//!   16-row tiles for the three query heads that share a KV head, K and V
//!   in f32 and in f16 (the `scores` and the weighted `values` passes).
//! - `memory/read_96MiB`: the machine's read bandwidth on the same threads,
//!   the ceiling decode's weight streaming is measured against.
//! - `float/*`: the float GEMM of a prefill (512 tokens, the fused gate/up
//!   shape, bf16 and f32 weights) on the AVX2 family and the active one,
//!   in multiply-adds per second, and `fma/peak`: the FMA peak of the same
//!   threads (independent register-only chains), the ceiling it is read
//!   against.
//! - `families/*`: the quantized matmuls on one thread with each CPU kernel
//!   family this machine has (scalar, AVX2, AVX-512 VNNI) in the same run,
//!   each on the weight layout it wants, at decode (1 token) and prefill (64
//!   and 512 tokens) sizes.
//!
//! Run: `cargo bench -p host --bench kernels` (add a filter such as
//! `-- model/` to run one group). Threads: `KERNEL_BENCH_THREADS`, default
//! all cores (`families` always uses one). The other groups use the active
//! family (`HOST_CPU_KERNELS` forces one).

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use host::kernels::{
    axpy_rows, dot_rows_scaled, matmul, matmul_on, matmul_with, rms_norm, silu_mul, softmax_parts,
    CpuKernels, HeadsLayout, KvElem, MatmulPath, ThreadPool, WeightMatrix,
};
use host::model::{DType, Storage, Tensor};

/// Hidden size, FFN size, KV width, vocabulary and layers of SmolLM2-135M.
const HIDDEN: usize = 576;
const FFN: usize = 1536;
const KV: usize = 192;
const VOCAB: usize = 49152;
const LAYERS: usize = 30;

/// The per-layer matmul shapes `(name, rows, cols)` in forward order.
const LAYER_SHAPES: [(&str, usize, usize); 7] = [
    ("q", HIDDEN, HIDDEN),
    ("k", KV, HIDDEN),
    ("v", KV, HIDDEN),
    ("o", HIDDEN, HIDDEN),
    ("gate", FFN, HIDDEN),
    ("up", FFN, HIDDEN),
    ("down", HIDDEN, FFN),
];

/// Deterministic pseudo-random bytes (xorshift64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    fn floats(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit() * 2.0 - 1.0).collect()
    }
}

/// A `rows x cols` matrix of `dtype` in GGUF block layout with random quants
/// and realistic (small, positive) scales, in the active family's layout.
fn weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> WeightMatrix {
    WeightMatrix::from_tensor(&tensor(rng, dtype, rows, cols)).expect("valid bench tensor")
}

/// The tensor behind [`weight`].
fn tensor(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Tensor {
    let blocks = rows * cols / 32;
    let mut bytes = Vec::with_capacity(dtype.bytes_for(rows * cols).expect("whole blocks"));
    for _ in 0..blocks {
        bytes.extend(f16::from_f32(0.001 + 0.01 * rng.unit()).to_le_bytes());
        if dtype == DType::Q4_1 {
            bytes.extend(f16::from_f32(-0.05 * rng.unit()).to_le_bytes());
        }
        let quants = if dtype == DType::Q8_0 { 32 } else { 16 };
        bytes.extend((0..quants).map(|_| rng.next() as u8));
    }
    tensor_of(dtype, rows, cols, bytes)
}

/// A `rows x cols` bench tensor of `dtype` holding `bytes`.
fn tensor_of(dtype: DType, rows: usize, cols: usize, bytes: Vec<u8>) -> Tensor {
    Tensor {
        name: "bench".into(),
        dtype,
        shape: vec![rows, cols],
        storage: Storage::Owned(Arc::new(bytes)),
    }
}

fn threads() -> usize {
    std::env::var("KERNEL_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Every shape at 1 and 512 tokens; throughput in weight bytes (decode) or
/// tokens (prefill).
fn shapes(c: &mut Criterion) {
    let pool = ThreadPool::new(threads());
    let mut rng = Rng(0x5EED);
    let mut group = c.benchmark_group("matmul");
    let mut all: Vec<(&str, DType, usize, usize)> = LAYER_SHAPES
        .iter()
        .map(|&(n, r, k)| (n, DType::Q4_1, r, k))
        .collect();
    all.push(("lm_head", DType::Q8_0, VOCAB, HIDDEN));
    for (name, dtype, rows, cols) in all {
        let w = weight(&mut rng, dtype, rows, cols);
        for n in [1usize, 512] {
            if name == "lm_head" && n == 512 {
                continue;
            }
            let x = rng.floats(n * cols);
            let mut out = vec![0f32; n * rows];
            if n == 1 {
                group.throughput(Throughput::Bytes(
                    dtype.bytes_for(rows * cols).unwrap_or(0) as u64
                ));
            } else {
                group.throughput(Throughput::Elements(n as u64));
            }
            group.bench_function(
                BenchmarkId::new(format!("{name}_{rows}x{cols}_{dtype:?}"), n),
                |b| b.iter(|| matmul(&pool, &w, &x, n, &mut out)),
            );
        }
    }
    group.finish();
}

/// Both kernel families over a range of batch sizes: the price of using the
/// batch-invariant integer kernels for prefill too (see `MatmulPath::Auto`).
fn crossover(c: &mut Criterion) {
    let pool = ThreadPool::new(threads());
    let mut rng = Rng(0xC055);
    let w = weight(&mut rng, DType::Q4_1, FFN, HIDDEN);
    let mut group = c.benchmark_group("crossover_1536x576_Q4_1");
    for n in [2usize, 4, 8, 12, 16, 24, 32, 64] {
        let x = rng.floats(n * HIDDEN);
        let mut out = vec![0f32; n * FFN];
        group.throughput(Throughput::Elements(n as u64));
        for (label, path) in [("integer", MatmulPath::Integer), ("gemm", MatmulPath::Gemm)] {
            group.bench_function(BenchmarkId::new(label, n), |b| {
                b.iter(|| matmul_with(&pool, &w, &x, n, &mut out, path))
            });
        }
    }
    group.finish();
}

/// Each available kernel family on the model's quantized shapes, one thread.
/// Scalar runs at 1 token only: it is the reference, not a contender, and
/// would take seconds per prefill call.
fn families(c: &mut Criterion) {
    let pool = ThreadPool::new(1);
    let mut rng = Rng(0xFA31);
    let shapes = [
        ("q", DType::Q4_1, HIDDEN, HIDDEN),
        ("gate", DType::Q4_1, FFN, HIDDEN),
        ("down", DType::Q4_1, HIDDEN, FFN),
        ("lm_head", DType::Q8_0, VOCAB, HIDDEN),
    ];
    let mut group = c.benchmark_group("families");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for (name, dtype, rows, cols) in shapes {
        let t = tensor(&mut rng, dtype, rows, cols);
        // The LM head runs for the last token of a prefill only.
        let sizes: &[usize] = if name == "lm_head" {
            &[1]
        } else {
            // 16: the smallest batch the AMX family runs on tiles.
            &[1, 16, 64, 512]
        };
        for &n in sizes {
            let x = rng.floats(n * cols);
            let mut out = vec![0f32; n * rows];
            group.throughput(Throughput::Elements(n as u64));
            for kernels in CpuKernels::available() {
                if kernels == CpuKernels::Scalar && n > 1 {
                    continue;
                }
                // Each family in the layout it wants (AVX2: interleaved rows).
                let w = WeightMatrix::from_tensor_for(&t, kernels).expect("valid bench tensor");
                let id = format!("{name}_{rows}x{cols}_{dtype:?}/{n}");
                group.bench_function(BenchmarkId::new(id, kernels.name()), |b| {
                    b.iter(|| matmul_on(&pool, &w, &x, n, &mut out, MatmulPath::Auto, kernels))
                });
            }
        }
    }
    group.finish();
}

/// Attention's tile kernels as a decode step calls them for one chunk of
/// one KV head: 128 keys in tiles of 16 (the block size), three query
/// heads (SmolLM2's 9 over 3 KV heads), head width 64; the data stays in
/// L1/L2, so these time the arithmetic, not the memory.
fn attention(c: &mut Criterion) {
    const KEYS: usize = 128;
    const TILE: usize = 16;
    const HEADS: usize = 3;
    const HD: usize = 64;
    fn run<E: KvElem>(c: &mut Criterion, name: &str, widen: impl Fn(f32) -> E) {
        let mut rng = Rng(0xA77E);
        let q = rng.floats(HEADS * HD);
        let k: Vec<E> = rng.floats(KEYS * HD).into_iter().map(&widen).collect();
        let v: Vec<E> = rng.floats(KEYS * HD).into_iter().map(&widen).collect();
        let p = rng.floats(HEADS * KEYS);
        let mut scores = vec![0f32; HEADS * KEYS];
        let mut out = vec![0f32; HEADS * HD];
        let mut group = c.benchmark_group("attention");
        group.throughput(Throughput::Elements((HEADS * KEYS) as u64));
        let layout = HeadsLayout {
            heads: HEADS,
            keys: TILE,
            head_dim: HD,
            score_stride: KEYS,
            head_stride: HD,
        };
        group.bench_function(format!("scores_{name}"), |b| {
            b.iter(|| {
                for (t, k) in k.chunks_exact(TILE * HD).enumerate() {
                    dot_rows_scaled(layout, &q, k, 0.125, &mut scores[t * TILE..]);
                }
            })
        });
        group.bench_function(format!("values_{name}"), |b| {
            b.iter(|| {
                for (t, v) in v.chunks_exact(TILE * HD).enumerate() {
                    axpy_rows(layout, &p[t * TILE..], v, &mut out);
                }
            })
        });
        group.finish();
    }
    run(c, "f32", |x| x);
    run(c, "f16", f16::from_f32);
}

/// All matmuls of the model, with 30 distinct layers of weights.
fn model(c: &mut Criterion) {
    let pool = ThreadPool::new(threads());
    let mut rng = Rng(0x0DE1);
    let layers: Vec<Vec<WeightMatrix>> = (0..LAYERS)
        .map(|_| {
            LAYER_SHAPES
                .iter()
                .map(|&(_, r, k)| weight(&mut rng, DType::Q4_1, r, k))
                .collect()
        })
        .collect();
    let lm_head = weight(&mut rng, DType::Q8_0, VOCAB, HIDDEN);
    let mut group = c.benchmark_group("model");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(20));
    for n in [1usize, 512] {
        let x_hidden = rng.floats(n * HIDDEN);
        let x_ffn = rng.floats(n * FFN);
        let mut out = vec![0f32; n * FFN.max(HIDDEN)];
        let mut logits = vec![0f32; VOCAB];
        group.throughput(Throughput::Elements(n as u64));
        let name = if n == 1 {
            "decode_matmuls"
        } else {
            "pp512_matmuls"
        };
        group.bench_function(name, |b| {
            b.iter(|| {
                for layer in &layers {
                    for w in layer {
                        let x = if w.cols() == FFN { &x_ffn } else { &x_hidden };
                        matmul(&pool, w, x, n, &mut out[..n * w.rows()]);
                    }
                }
                matmul(&pool, &lm_head, &x_hidden[..HIDDEN], 1, &mut logits);
            })
        });
    }
    group.finish();
}

/// The per-row kernels at the model's sizes, and the pool's fork-join cost.
fn small(c: &mut Criterion) {
    let mut rng = Rng(0x5A11);
    let mut group = c.benchmark_group("row_kernels");
    let (x, w) = (rng.floats(HIDDEN), rng.floats(HIDDEN));
    let mut out = vec![0f32; HIDDEN];
    group.bench_function("rms_norm_576", |b| {
        b.iter(|| rms_norm(&x, &w, 1e-5, &mut out))
    });
    let (gate, up) = (rng.floats(FFN), rng.floats(FFN));
    let mut g = vec![0f32; FFN];
    group.bench_function("silu_mul_1536", |b| b.iter(|| silu_mul(&gate, &up, &mut g)));
    let scores = rng.floats(128);
    let mut s = scores.clone();
    group.bench_function("softmax_parts_128", |b| {
        b.iter(|| {
            s.copy_from_slice(&scores);
            softmax_parts(&mut s)
        })
    });
    group.finish();
    let pool = ThreadPool::new(threads());
    c.bench_function("pool/run_empty", |b| {
        b.iter(|| {
            pool.run(|i, n| {
                std::hint::black_box((i, n));
            })
        })
    });
}

/// The machine's read bandwidth on the pool's threads: each thread sums its
/// share of a 96 MiB buffer (about the model's weights, past any L3 of
/// these machines' slices), so decode's GB/s have a ceiling to be read
/// against. Throughput in bytes: criterion prints GB/s.
fn bandwidth(c: &mut Criterion) {
    const BYTES: usize = 96 << 20;
    let pool = ThreadPool::new(threads());
    let buffer: Vec<u64> = (0..BYTES as u64 / 8).collect();
    let mut group = c.benchmark_group("memory");
    group
        .sample_size(20)
        .throughput(Throughput::Bytes(BYTES as u64));
    group.bench_function("read_96MiB", |b| {
        b.iter(|| {
            pool.run(|i, n| {
                let part = &buffer[buffer.len() * i / n..buffer.len() * (i + 1) / n];
                // Eight independent sums, so the adds never wait on each other.
                let mut sums = [0u64; 8];
                for chunk in part.chunks_exact(8) {
                    for (s, &v) in sums.iter_mut().zip(chunk) {
                        *s = s.wrapping_add(v);
                    }
                }
                std::hint::black_box(sums);
            })
        })
    });
    group.finish();
}

/// Float weights as a checkpoint stores them: `rows x cols` random values
/// in `dtype` (F32 or BF16), kept in the GEMM's panels.
fn float_weight(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> WeightMatrix {
    let values = rng.floats(rows * cols);
    let bytes: Vec<u8> = match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        other => panic!("float_weight makes F32 or BF16 weights, not {other:?}"),
    };
    WeightMatrix::from_tensor(&tensor_of(dtype, rows, cols, bytes)).expect("valid bench tensor")
}

/// A float checkpoint's prefill GEMM, the fused gate/up shape at 512
/// tokens, on AVX2 and on the active family (the AVX-512 tiles where it
/// has them). Throughput in multiply-adds: criterion's Gelem/s is GMAC/s.
fn float_gemm(c: &mut Criterion) {
    let pool = ThreadPool::new(threads());
    let mut rng = Rng(0xF10A7);
    let (rows, cols, n) = (2 * FFN, HIDDEN, 512);
    let x = rng.floats(n * cols);
    let mut out = vec![0f32; n * rows];
    let mut group = c.benchmark_group("float");
    group
        .sample_size(20)
        .throughput(Throughput::Elements((rows * cols * n) as u64));
    for dtype in [DType::BF16, DType::F32] {
        let w = float_weight(&mut rng, dtype, rows, cols);
        let mut families = vec![CpuKernels::Avx2, CpuKernels::active()];
        families.dedup();
        for kernels in families.into_iter().filter(|k| k.is_supported()) {
            let id = format!("{dtype:?}_gate_up_pp512/{}", kernels.name());
            group.bench_function(id, |b| {
                b.iter(|| matmul_on(&pool, &w, &x, n, &mut out, MatmulPath::Auto, kernels))
            });
        }
    }
    group.finish();
}

/// The FMA peak of the pool's threads: each runs twelve independent chains
/// of register-only multiply-adds, 16 lanes wide with AVX-512 F, else 8
/// with AVX2 and FMA (none elsewhere). Throughput in multiply-adds.
fn fma_peak(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;

        const STEPS: usize = 1 << 20;
        #[target_feature(enable = "avx512f,fma")]
        unsafe fn chains16() -> f32 {
            let (m, a) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            let mut acc = [_mm512_set1_ps(1.0); 12];
            for _ in 0..STEPS {
                for acc in acc.iter_mut() {
                    *acc = _mm512_fmadd_ps(*acc, m, a);
                }
            }
            acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn chains8() -> f32 {
            let (m, a) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
            let mut acc = [_mm256_set1_ps(1.0); 12];
            for _ in 0..STEPS {
                for acc in acc.iter_mut() {
                    *acc = _mm256_fmadd_ps(*acc, m, a);
                }
            }
            let mut lanes = [0f32; 8];
            acc.iter().fold(0.0, |s, &v| {
                _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                s + lanes.iter().sum::<f32>()
            })
        }
        let (lanes, chains): (usize, unsafe fn() -> f32) = if is_x86_feature_detected!("avx512f") {
            (16, chains16)
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            (8, chains8)
        } else {
            return;
        };
        let pool = ThreadPool::new(threads());
        let macs = STEPS * 12 * lanes * pool.num_threads();
        let mut group = c.benchmark_group("fma");
        group
            .sample_size(20)
            .throughput(Throughput::Elements(macs as u64));
        group.bench_function("peak", |b| {
            // SAFETY: the CPU has the features `chains` needs (checked).
            b.iter(|| {
                pool.run(|_, _| {
                    std::hint::black_box(unsafe { chains() });
                })
            })
        });
        group.finish();
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = c;
}

criterion_group!(
    benches, small, attention, shapes, crossover, families, model, bandwidth, float_gemm, fma_peak
);
criterion_main!(benches);
