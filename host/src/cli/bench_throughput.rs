//! `host bench throughput`: offline batch throughput through the whole
//! engine (scheduler, KV cache, executor, sampling), measured the way vLLM's
//! `bench throughput` and llama.cpp's `llama-batched-bench` are: N requests
//! of fixed prompt and output lengths, all submitted at once, timed from the
//! first submission to the last token.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use clap::Args;
use serde::Serialize;

use crate::config::EngineConfig;
use crate::engine::{GenerateRequest, Llm, Prompt};
use crate::sampling::SamplingParams;

/// Flags of `host bench throughput`.
#[derive(Debug, Args)]
pub struct ThroughputArgs {
    /// Requests in the batch.
    #[arg(long, default_value_t = 64)]
    pub num_prompts: usize,
    /// Prompt tokens of each request (distinct pseudo-random ids, so the
    /// prefix cache finds nothing to share).
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Tokens each request generates (EOS is ignored).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Also write the result as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// The measured figures.
#[derive(Debug, Serialize)]
struct Throughput {
    num_prompts: usize,
    input_len: usize,
    output_len: usize,
    elapsed_s: f64,
    requests_per_s: f64,
    /// Prompt and generated tokens per second (llama-batched-bench's `S`).
    total_tokens_per_s: f64,
    /// Generated tokens per second.
    output_tokens_per_s: f64,
}

/// Runs `host bench throughput`.
pub fn run(config: &EngineConfig, args: &ThroughputArgs) -> anyhow::Result<()> {
    if args.num_prompts == 0 || args.input_len == 0 || args.output_len == 0 {
        bail!("--num-prompts, --input-len and --output-len must be at least 1");
    }
    let mut config = config.clone();
    // Every request in flight at once, as the peers run them.
    config.scheduler.max_num_seqs = config.scheduler.max_num_seqs.max(args.num_prompts);
    let mut llm = Llm::new(&config)?;
    let vocab = llm.tokenizer().vocab_size() as u64;
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: u32::try_from(args.output_len)?,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let requests: Vec<GenerateRequest> = (0..args.num_prompts as u64)
        .map(|r| {
            let ids = (0..args.input_len as u64)
                .map(|i| ((r * 7919 + i).wrapping_mul(2_654_435_761) >> 7) % vocab)
                .map(|t| t as u32)
                .collect();
            GenerateRequest::new(Prompt::Tokens(ids), params.clone())
        })
        .collect();
    let started = Instant::now();
    let results = llm.generate(&requests, |_, _| {}, |_, _| {})?;
    let elapsed_s = started.elapsed().as_secs_f64();
    for (i, r) in results.iter().enumerate() {
        match r {
            Ok(c) if c.token_ids.len() == args.output_len => {}
            Ok(c) => bail!(
                "request {i} generated {} tokens, not {}",
                c.token_ids.len(),
                args.output_len
            ),
            Err(e) => bail!("request {i} was refused: {e}"),
        }
    }
    let n = args.num_prompts as f64;
    let t = Throughput {
        num_prompts: args.num_prompts,
        input_len: args.input_len,
        output_len: args.output_len,
        elapsed_s,
        requests_per_s: n / elapsed_s,
        total_tokens_per_s: n * (args.input_len + args.output_len) as f64 / elapsed_s,
        output_tokens_per_s: n * args.output_len as f64 / elapsed_s,
    };
    println!("| requests | input | output | seconds | req/s | total tok/s | output tok/s |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    println!(
        "| {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.1} |",
        t.num_prompts,
        t.input_len,
        t.output_len,
        t.elapsed_s,
        t.requests_per_s,
        t.total_tokens_per_s,
        t.output_tokens_per_s
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&t)? + "\n")
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}
