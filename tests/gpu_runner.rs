//! Device check, part 2 (needs a CUDA GPU; `--features cuda`): the GPU
//! runner against the CPU runner on the default model, then Llama-3.1-8B-
//! shaped dummy weights decoding at batch 1 / 64 / 256 and an 8k-token
//! prefill, printed beside the HBM roofline measured in the same run.
//! Run by scripts/gpu-check.sh (`--nocapture` shows the table).

use std::sync::Arc;
use std::time::Instant;

use host::cuda::device::Gpu;
use host::cuda::runner::GpuModelRunner;
use host::cuda::weights::DeviceWeights;
use host::kernels::{MatmulPath, ThreadPool};
use host::model::{self, LoadFormat};
use host::model_runner::{CpuModelRunner, ModelInput, RunnerConfig, SeqInput};

fn gpu() -> Gpu {
    let dir = std::env::temp_dir().join("host-gpu-check-ptx");
    Gpu::new(0, &dir).unwrap_or_else(|e| panic!("device check needs a CUDA GPU: {e}"))
}

const BLOCK: usize = 16;

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(0, |b, (i, v)| if *v > row[b] { i } else { b }) as u32
}

/// Five prompts of token ids (fixed, varied lengths, inside the vocabulary).
fn prompts() -> Vec<Vec<u32>> {
    [7usize, 23, 64, 129, 300]
        .iter()
        .enumerate()
        .map(|(p, &len)| {
            (0..len)
                .map(|i| ((i * 7919 + p * 104_729) % 49_000 + 17) as u32)
                .collect()
        })
        .collect()
}

#[test]
fn gpu_runner_matches_the_cpu_runner_on_the_default_model() {
    let g = gpu();
    // GPU_CHECK_MODEL names the model file where the repository's cache is
    // not at hand (the device machine); `dummy` uses SmolLM2-shaped random
    // Q4_1 weights, the same load and dequant path without the file.
    let path = std::env::var("GPU_CHECK_MODEL")
        .unwrap_or_else(|_| e2e::default_model().display().to_string());
    let weights = if path == "dummy" {
        let c = model::dummy::preset("smollm2-135m").unwrap();
        model::dummy::dummy_weights(&c, model::DType::Q4_1, 1).unwrap()
    } else {
        model::load(std::path::Path::new(&path), LoadFormat::Auto).unwrap_or_else(|e| {
            panic!("model {path}: {e}; set GPU_CHECK_MODEL to the .gguf (or to `dummy`)")
        })
    };
    let c = weights.config.clone();
    let (max_tokens, max_len) = (512, 1024);
    let pool = Arc::new(ThreadPool::new(
        std::thread::available_parallelism().map_or(4, |n| n.get()),
    ));
    let limits = RunnerConfig {
        max_num_batched_tokens: max_tokens,
        max_model_len: max_len,
        block_size: BLOCK,
        matmul_path: MatmulPath::Auto,
    };
    let mut cpu = CpuModelRunner::new(&weights, pool, limits).unwrap();
    let dw = DeviceWeights::upload(&g, &weights).unwrap();
    let mut gpu_r = GpuModelRunner::new(&g, c.clone(), dw, max_tokens, max_len, BLOCK).unwrap();
    let blocks = max_len / BLOCK;
    cpu.initialize_kv_cache(blocks).unwrap();
    gpu_r.initialize_kv_cache(&g, blocks).unwrap();
    for (n, prompt) in prompts().iter().enumerate() {
        let table: Vec<u32> = (0..blocks as u32).collect();
        let first = ModelInput::single(prompt, 0, table.clone());
        let want = cpu.execute_model(&first).unwrap();
        let got = gpu_r.execute_model(&g, &first).unwrap();
        let (num, den) =
            got.data
                .iter()
                .zip(&want.data)
                .fold((0.0f64, 0.0f64), |(a, b), (g, w)| {
                    assert!(g.is_finite(), "prompt {n}: non-finite GPU logit");
                    (a + f64::from(g - w).powi(2), b + f64::from(*w).powi(2))
                });
        let rel = (num / den).sqrt();
        eprintln!(
            "prompt {n} ({} tokens): first-token logits relative error {rel:.2e}",
            prompt.len()
        );
        assert!(
            rel < 1e-2,
            "prompt {n}: first-token logits relative error {rel:.3e} >= 1e-2"
        );
        // 32 greedy tokens, each runner feeding back its own choice.
        let (mut tc, mut tg) = (argmax(want.row(0)), argmax(got.row(0)));
        let (mut out_c, mut out_g) = (vec![tc], vec![tg]);
        for step in 0..31 {
            let pos = prompt.len() + step;
            let ic = ModelInput::single(&[tc], pos, table.clone());
            let ig = ModelInput::single(&[tg], pos, table.clone());
            tc = argmax(cpu.execute_model(&ic).unwrap().row(0));
            tg = argmax(gpu_r.execute_model(&g, &ig).unwrap().row(0));
            out_c.push(tc);
            out_g.push(tg);
        }
        assert_eq!(
            out_g, out_c,
            "prompt {n}: greedy tokens differ (GPU left, CPU right)"
        );
    }
}

/// Device-to-device copy bandwidth (read + write bytes per second) of a
/// 2 GiB buffer: the practical HBM ceiling the roofline uses.
fn copy_bandwidth(g: &Gpu) -> f64 {
    let n = 1usize << 30; // u16 elements: 2 GiB
    let src = g.stream.alloc_zeros::<u16>(n).unwrap();
    let mut dst = g.stream.alloc_zeros::<u16>(n).unwrap();
    g.stream.memcpy_dtod(&src, &mut dst).unwrap();
    g.stream.synchronize().unwrap();
    let t = Instant::now();
    let reps = 10;
    for _ in 0..reps {
        g.stream.memcpy_dtod(&src, &mut dst).unwrap();
    }
    g.stream.synchronize().unwrap();
    (2 * 2 * n * reps) as f64 / t.elapsed().as_secs_f64()
}

#[test]
fn llama_8b_shape_decode_and_prefill_against_the_hbm_roofline() {
    let g = gpu();
    let c = model::dummy::preset("llama-3.1-8b").unwrap();
    let bw = copy_bandwidth(&g);
    let ctx = 1024usize;
    let max_batch = 256usize;
    let prefill = 8192usize;
    let dw = DeviceWeights::random(&g, &c, 7).unwrap();
    let weight_bytes = dw.bytes() as f64;
    let mut r = GpuModelRunner::new(&g, c.clone(), dw, prefill, prefill, BLOCK).unwrap();
    let per_seq = ctx.div_ceil(BLOCK);
    let blocks = (max_batch * per_seq).max(prefill / BLOCK);
    r.initialize_kv_cache(&g, blocks).unwrap();
    let kv_token_bytes = (2 * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim) as f64;
    println!(
        "HBM copy bandwidth {:.0} GB/s; weights {:.2} GB",
        bw / 1e9,
        weight_bytes / 1e9
    );
    println!(
        "| step | tokens | time/step (ms) | bytes/step (GB) | roofline (ms) | % of roofline |"
    );
    println!("|---|---|---|---|---|---|");
    for batch in [1usize, 64, 256] {
        // Decode at position ctx - 1 over a cache of ctx tokens per sequence.
        let mut input = ModelInput::default();
        for s in 0..batch {
            input.token_ids.push((s * 31 % c.vocab_size) as u32);
            input.positions.push(ctx as u32 - 1);
            let table = (s * per_seq..(s + 1) * per_seq).map(|b| b as u32).collect();
            input.seqs.push(SeqInput {
                query_len: 1,
                context_len: ctx,
                block_table: table,
            });
        }
        r.execute_model(&g, &input).unwrap();
        let reps = 20;
        let t = Instant::now();
        for _ in 0..reps {
            r.forward(&g, &input).unwrap();
        }
        g.stream.synchronize().unwrap();
        let step = t.elapsed().as_secs_f64() / reps as f64;
        let logits = r.execute_model(&g, &input).unwrap();
        assert!(
            logits.data.iter().all(|v| v.is_finite()),
            "batch {batch}: non-finite logits"
        );
        let bytes = weight_bytes + batch as f64 * ctx as f64 * kv_token_bytes;
        let roof = bytes / bw;
        println!(
            "| decode, batch {batch} | {batch} | {:.3} | {:.2} | {:.3} | {:.0}% |",
            step * 1e3,
            bytes / 1e9,
            roof * 1e3,
            100.0 * roof / step
        );
    }
    let tokens: Vec<u32> = (0..prefill)
        .map(|i| (i * 7 % c.vocab_size) as u32)
        .collect();
    let input = ModelInput::single(&tokens, 0, (0..(prefill / BLOCK) as u32).collect());
    r.execute_model(&g, &input).unwrap();
    let t = Instant::now();
    let logits = r.execute_model(&g, &input).unwrap();
    let step = t.elapsed().as_secs_f64();
    assert!(
        logits.data.iter().all(|v| v.is_finite()),
        "prefill: non-finite logits"
    );
    let flops = 2.0 * weight_bytes / 2.0 * prefill as f64;
    println!(
        "| prefill 8k | {prefill} | {:.1} | {:.2} | {:.3} | {:.0} tok/s, {:.0} TFLOP/s (GEMMs) |",
        step * 1e3,
        weight_bytes / 1e9,
        weight_bytes / bw * 1e3,
        prefill as f64 / step,
        flops / step / 1e12
    );
}
