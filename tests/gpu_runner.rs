//! Device check, part 2 (needs a CUDA GPU; `--features cuda`): the GPU
//! runner against the CPU runner on the default model, CUDA-graph replay
//! against eager decode steps, then Llama-3.1-8B-shaped dummy weights
//! decoding at batch 1 / 64 / 256 (eager and with graphs) and an 8k-token
//! prefill, printed beside the HBM roofline measured in the same run.
//! Run by scripts/gpu-check.sh (`--nocapture` shows the table).

use std::sync::Arc;
use std::time::Instant;

use host::config::CacheDtype;
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

/// The default model's weights. GPU_CHECK_MODEL names the model file where
/// the repository's cache is not at hand (the device machine); `dummy` uses
/// SmolLM2-shaped random Q4_1 weights, the same load and dequant path
/// without the file.
fn default_weights() -> model::ModelWeights {
    let path = std::env::var("GPU_CHECK_MODEL")
        .unwrap_or_else(|_| e2e::default_model().display().to_string());
    if path == "dummy" {
        let c = model::dummy::preset("smollm2-135m").unwrap();
        model::dummy::dummy_weights(&c, model::DType::Q4_1, 1).unwrap()
    } else {
        model::load(std::path::Path::new(&path), LoadFormat::Auto).unwrap_or_else(|e| {
            panic!("model {path}: {e}; set GPU_CHECK_MODEL to the .gguf (or to `dummy`)")
        })
    }
}

/// Relative L2 distance of `got` from `want`.
fn rel_error(got: &[f32], want: &[f32]) -> f64 {
    let (num, den) = got
        .iter()
        .zip(want)
        .fold((0.0f64, 0.0f64), |(a, b), (g, w)| {
            (a + f64::from(g - w).powi(2), b + f64::from(*w).powi(2))
        });
    (num / den).sqrt()
}

/// The runner against the CPU runner. Decode steps of one sequence run
/// eagerly here (no graphs captured); over the model's 3 KV heads the
/// decodes of the 129- and 300-token prompts go through split-K attention
/// (2 and 3 splits on 132 SMs), so the greedy comparison checks
/// flash-decoding end to end too.
#[test]
fn gpu_runner_matches_the_cpu_runner_on_the_default_model() {
    let g = gpu();
    let weights = default_weights();
    let c = weights.config.clone();
    let (max_tokens, max_len) = (512, 1024);
    let pool = Arc::new(ThreadPool::new(
        std::thread::available_parallelism().map_or(4, |n| n.get()),
    ));
    let limits = RunnerConfig {
        max_num_batched_tokens: max_tokens,
        max_model_len: max_len,
        block_size: BLOCK,
        cache_dtype: CacheDtype::Auto,
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
        assert!(
            got.data.iter().all(|v| v.is_finite()),
            "prompt {n}: non-finite GPU logit"
        );
        let rel = rel_error(&got.data, &want.data);
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

/// `count` decodes, sequence `s` at its next position `lens[s]` over its own
/// `per_seq` blocks.
fn decode_batch(lens: &[usize], count: usize, per_seq: usize, vocab: usize) -> ModelInput {
    let mut input = ModelInput::default();
    for (s, &len) in lens.iter().enumerate().take(count) {
        input.token_ids.push(((s * 7919 + 3) % vocab) as u32);
        input.positions.push(len as u32);
        input.seqs.push(SeqInput {
            query_len: 1,
            context_len: len + 1,
            block_table: (s * per_seq..(s + 1) * per_seq).map(|b| b as u32).collect(),
        });
    }
    input
}

/// CUDA-graph replay against eager execution on the default model: decode
/// batches of 1, 3 and 17 sequences (3 and 17 replay the graphs of 4 and
/// 24, with padding rows) give the logits the same step gives eagerly. Each
/// decode writes its own new slot before reading it and reads only the
/// prefilled ones otherwise, so the steps do not disturb each other.
#[test]
fn graph_replay_matches_eager_decode_on_the_default_model() {
    let g = gpu();
    let weights = default_weights();
    let c = weights.config.clone();
    let (max_tokens, max_len) = (2048, 1024);
    let dw = DeviceWeights::upload(&g, &weights).unwrap();
    let mut r = GpuModelRunner::new(&g, c.clone(), dw, max_tokens, max_len, BLOCK).unwrap();
    let err = r.capture_graphs(&g, 32).unwrap_err().to_string();
    assert!(err.contains("initialize_kv_cache"), "{err}");
    let per_seq = max_len / BLOCK;
    let nseq = 17;
    r.initialize_kv_cache(&g, nseq * per_seq).unwrap();
    // Prefill 17 prompts of 5..213 tokens in one (eager) step.
    let lens: Vec<usize> = (0..nseq).map(|s| 5 + 13 * s).collect();
    let mut prefill = ModelInput::default();
    for (s, &len) in lens.iter().enumerate() {
        for p in 0..len {
            prefill
                .token_ids
                .push(((p * 104_729 + s * 31) % (c.vocab_size - 17) + 17) as u32);
            prefill.positions.push(p as u32);
        }
        prefill.seqs.push(SeqInput {
            query_len: len,
            context_len: len,
            block_table: (s * per_seq..(s + 1) * per_seq).map(|b| b as u32).collect(),
        });
    }
    r.execute_model(&g, &prefill).unwrap();
    let batches = [1usize, 3, 17];
    let eager: Vec<_> = batches
        .iter()
        .map(|&b| {
            r.execute_model(&g, &decode_batch(&lens, b, per_seq, c.vocab_size))
                .unwrap()
        })
        .collect();
    let sizes = r.capture_graphs(&g, 32).unwrap();
    assert_eq!(sizes, vec![1, 2, 4, 8, 16, 24, 32]);
    assert_eq!(r.graph_sizes(), &sizes[..]);
    for (&b, want) in batches.iter().zip(&eager) {
        let got = r
            .execute_model(&g, &decode_batch(&lens, b, per_seq, c.vocab_size))
            .unwrap();
        assert_eq!(got.num_seqs, b);
        for row in 0..b {
            let (gr, wr) = (got.row(row), want.row(row));
            assert!(
                gr.iter().all(|v| v.is_finite()),
                "batch {b} row {row}: non-finite"
            );
            let rel = rel_error(gr, wr);
            eprintln!("decode batch {b}, row {row}: graph vs eager relative error {rel:.2e}");
            // Equal up to summation order: the graph's split-K count follows
            // max_model_len, eager's the step's longest context.
            assert!(
                rel < 1e-3,
                "batch {b} row {row}: graph logits differ from eager by {rel:.3e} >= 1e-3"
            );
            assert_eq!(
                argmax(gr),
                argmax(wr),
                "batch {b} row {row}: greedy token differs"
            );
        }
    }
    // A prefill step after capture runs eagerly and still matches.
    let again = r.execute_model(&g, &prefill).unwrap();
    assert!(again.data.iter().all(|v| v.is_finite()));
    r.set_enforce_eager(true);
    assert!(r.graph_sizes().is_empty());
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
    // Decode at position ctx - 1 over a cache of ctx tokens per sequence.
    let lens = vec![ctx - 1; max_batch];
    let batches = [1usize, 64, 256];
    let step_time = |r: &mut GpuModelRunner, input: &ModelInput| {
        let logits = r.execute_model(&g, input).unwrap();
        assert!(
            logits.data.iter().all(|v| v.is_finite()),
            "batch {}: non-finite logits",
            input.seqs.len()
        );
        let reps = 20;
        let t = Instant::now();
        for _ in 0..reps {
            r.forward(&g, input).unwrap();
        }
        g.stream.synchronize().unwrap();
        t.elapsed().as_secs_f64() / reps as f64
    };
    let inputs: Vec<ModelInput> = batches
        .iter()
        .map(|&b| decode_batch(&lens, b, per_seq, c.vocab_size))
        .collect();
    let eager: Vec<f64> = inputs.iter().map(|i| step_time(&mut r, i)).collect();
    let t = Instant::now();
    let sizes = r.capture_graphs(&g, max_batch).unwrap();
    println!(
        "captured {} decode graphs (1..{max_batch}) in {:.2} s",
        sizes.len(),
        t.elapsed().as_secs_f64()
    );
    println!(
        "| step | tokens | eager (ms) | CUDA graph (ms) | bytes/step (GB) | roofline (ms) | % of roofline (graph) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for ((&batch, input), eager) in batches.iter().zip(&inputs).zip(eager) {
        let graph = step_time(&mut r, input);
        let bytes = weight_bytes + batch as f64 * ctx as f64 * kv_token_bytes;
        let roof = bytes / bw;
        println!(
            "| decode, batch {batch} | {batch} | {:.3} | {:.3} | {:.2} | {:.3} | {:.0}% |",
            eager * 1e3,
            graph * 1e3,
            bytes / 1e9,
            roof * 1e3,
            100.0 * roof / graph
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
        "| prefill 8k | {prefill} | {:.1} | - | {:.2} | {:.3} | {:.0} tok/s, {:.0} TFLOP/s (GEMMs) |",
        step * 1e3,
        weight_bytes / 1e9,
        weight_bytes / bw * 1e3,
        prefill as f64 / step,
        flops / step / 1e12
    );
}
