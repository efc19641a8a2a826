//! `host bench`: prefill and single-stream decode speed on the configured
//! model, measured the way llama-bench's pp/tg tests are (fixed token counts,
//! several repetitions, the mean and spread reported). `host bench
//! throughput` measures batches through the whole engine instead.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::config::EngineConfig;
use crate::engine::startup;
use crate::kernels::{cpu_description, CpuKernels};
use crate::model_runner::ModelInput;
use crate::worker::Worker;

/// Flags of `host bench`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// Another benchmark than the default pp/tg test.
    #[command(subcommand)]
    pub mode: Option<BenchMode>,
    /// Prompt tokens of the prefill test (llama-bench's pp).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Generated tokens of the decode test (llama-bench's tg).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Tokens already in the context when each test starts (llama-bench's
    /// `-d`): the prompt is prefilled after them and decoding continues
    /// from them, so attention over a long context is measured too.
    #[arg(long, default_value_t = 0)]
    pub depth: usize,
    /// Measured repetitions of each test (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub repetitions: usize,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Afterwards, run each test once more timing every operation of the
    /// forward pass, and the thread pool's fork-join, and print where the
    /// time goes.
    #[arg(long)]
    pub profile: bool,
}

/// The benchmarks besides the default pp/tg test.
#[derive(Debug, Subcommand)]
pub enum BenchMode {
    /// Offline batch throughput through the engine (vLLM's `bench
    /// throughput`, llama.cpp's `llama-batched-bench`).
    Throughput(super::bench_throughput::ThroughputArgs),
}

/// One test's result.
#[derive(Debug, Serialize)]
struct TestResult {
    test: String,
    tokens: usize,
    tokens_per_s_mean: f64,
    tokens_per_s_stddev: f64,
    runs: Vec<f64>,
}

/// Runs `host bench`.
pub fn run(config: &EngineConfig, args: &BenchArgs) -> anyhow::Result<()> {
    if let Some(BenchMode::Throughput(t)) = &args.mode {
        return super::bench_throughput::run(config, t);
    }
    if args.prompt_tokens == 0 || args.gen_tokens == 0 || args.repetitions == 0 {
        bail!("--prompt-tokens, --gen-tokens and --repetitions must be at least 1");
    }
    // One worker in this process: a parallel layout would be measured as
    // one unsharded rank, under a wrong thread count, without a word.
    let p = &config.parallel;
    if p.tensor_parallel_size > 1 || p.data_parallel_size > 1 || p.nnodes > 1 {
        bail!(
            "host bench drives one model runner in this process, so it cannot measure \
             parallel.tensor_parallel_size = {}, data_parallel_size = {}, nnodes = {}; \
             use `host bench throughput` for tensor parallelism (it runs the engine and its \
             workers) or `host serve` with scripts/bench-serve.sh for data parallelism, \
             or set them to 1",
            p.tensor_parallel_size,
            p.data_parallel_size,
            p.nnodes
        );
    }
    // Whole-prompt prefill in one step, as llama-bench's pp test does.
    let mut config = config.clone();
    config.scheduler.max_num_batched_tokens = config
        .scheduler
        .max_num_batched_tokens
        .max(args.prompt_tokens);
    let mut session = startup::start(&config)?;
    let block_size = config.cache.block_size;
    let longest = args
        .gen_tokens
        .checked_add(1)
        .map(|tg| tg.max(args.prompt_tokens))
        .and_then(|n| n.checked_add(args.depth))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--depth plus --prompt-tokens or --gen-tokens overflows; keep them within max_model_len"
            )
        })?;
    let blocks = longest.div_ceil(block_size);
    if blocks > session.num_blocks {
        bail!(
            "the tests need {blocks} KV blocks but the cache has {}; raise --kv-cache-memory-bytes",
            session.num_blocks
        );
    }
    let vocab = session.worker.model_config()?.vocab_size as u32;
    let table: Vec<u32> = (0..blocks as u32).collect();
    // Fixed pseudo-random token ids: the speed does not depend on them.
    let tokens: Vec<u32> = (0..longest as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % vocab)
        .collect();

    let tests = Tests {
        tokens: &tokens,
        table: &table,
        depth: args.depth,
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
    };
    tests.fill_depth(&mut session.worker, config.scheduler.max_num_batched_tokens)?;
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for rep in 0..=args.repetitions {
        let pp = tests.prefill(&mut session.worker)?;
        let tg = tests.decode(&mut session.worker)?;
        if rep > 0 {
            prefill.push(pp);
            decode.push(tg);
        }
    }
    let results = [
        summarize(
            tests.name("pp", args.prompt_tokens),
            args.prompt_tokens,
            prefill,
        ),
        summarize(tests.name("tg", args.gen_tokens), args.gen_tokens, decode),
    ];
    let threads = match config.worker.num_threads {
        0 => startup::default_threads(),
        n => n,
    };
    let kernels = CpuKernels::active().name();
    let (cpu, flags) = cpu_description().unwrap_or_else(|| ("unknown CPU".into(), Vec::new()));
    println!(
        "cpu: {cpu} (flags: {}); kernels: {kernels}",
        flags.join(" ")
    );
    println!("| model | threads | test | tokens/s |");
    println!("| --- | ---: | --- | ---: |");
    for r in &results {
        println!(
            "| {} | {threads} | {} | {:.2} ± {:.2} |",
            config
                .model
                .path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy(),
            r.test,
            r.tokens_per_s_mean,
            r.tokens_per_s_stddev
        );
    }
    if args.profile {
        super::bench_profile::run(&mut session.worker, &tests, threads)?;
    }
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "model": config.model.path,
            "threads": threads,
            "cpu": cpu,
            "cpu_flags": flags,
            "kernels": kernels,
            "results": results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

/// The pp and tg tests' inputs.
pub(super) struct Tests<'a> {
    tokens: &'a [u32],
    table: &'a [u32],
    /// Tokens in the context before each test.
    pub depth: usize,
    /// Prompt tokens of the prefill test.
    pub prompt_tokens: usize,
    /// Tokens of the decode test.
    pub gen_tokens: usize,
}

impl Tests<'_> {
    /// A test's name as llama-bench prints it: `pp512`, or `pp512 @ d4096`
    /// with a context before it.
    pub fn name(&self, kind: &str, tokens: usize) -> String {
        match self.depth {
            0 => format!("{kind}{tokens}"),
            d => format!("{kind}{tokens} @ d{d}"),
        }
    }

    /// Writes the context's `depth` tokens into the KV cache, in steps of
    /// at most `step_tokens`; the tests then only ever overwrite what
    /// follows it.
    fn fill_depth(&self, worker: &mut Worker, step_tokens: usize) -> anyhow::Result<()> {
        for start in (0..self.depth).step_by(step_tokens.max(1)) {
            let end = (start + step_tokens).min(self.depth);
            let input = ModelInput::single(&self.tokens[start..end], start, self.table.to_vec());
            worker.execute_model_input(&input)?;
        }
        Ok(())
    }

    /// One prefill of the prompt in one step, after the context; tokens
    /// per second.
    pub fn prefill(&self, worker: &mut Worker) -> anyhow::Result<f64> {
        let (start, n) = (self.depth, self.prompt_tokens);
        let input = ModelInput::single(&self.tokens[start..start + n], start, self.table.to_vec());
        let t = Instant::now();
        worker.execute_model_input(&input)?;
        Ok(n as f64 / t.elapsed().as_secs_f64())
    }

    /// Decodes one token per step after the context; tokens per second.
    pub fn decode(&self, worker: &mut Worker) -> anyhow::Result<f64> {
        let t = Instant::now();
        for i in self.depth..self.depth + self.gen_tokens {
            let input = ModelInput::single(&self.tokens[i..=i], i, self.table.to_vec());
            worker.execute_model_input(&input)?;
        }
        Ok(self.gen_tokens as f64 / t.elapsed().as_secs_f64())
    }
}

fn summarize(test: String, tokens: usize, runs: Vec<f64>) -> TestResult {
    let n = runs.len() as f64;
    let mean = runs.iter().sum::<f64>() / n;
    let var = runs.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    TestResult {
        test,
        tokens,
        tokens_per_s_mean: mean,
        tokens_per_s_stddev: var.sqrt(),
        runs,
    }
}
