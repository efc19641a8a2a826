//! Sampling flags shared by the commands that generate text; each maps to a
//! field of vLLM's `SamplingParams`.

use clap::Args;

use crate::sampling::SamplingParams;

/// Per-request sampling flags.
#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Fewest tokens to generate before EOS or a stop may end the output.
    #[arg(long)]
    pub min_tokens: Option<u32>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the smallest set of tokens with this much probability.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens; 0 disables.
    #[arg(long)]
    pub top_k: Option<i32>,
    /// Drop tokens less likely than min_p times the most likely one.
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Divide (or multiply, when negative) the logits of tokens already seen.
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Subtract from the logits of tokens already generated.
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    /// Subtract, per occurrence, from the logits of tokens already generated.
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    /// Seed of the sampler: the same seed gives the same text.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this string appears (repeatable); it is not printed.
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Stop when this token id is generated (repeatable).
    #[arg(long = "stop-token-id", value_name = "ID")]
    pub stop_token_ids: Vec<u32>,
    /// Keep generating after the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    /// The flags over vLLM's defaults, validated.
    pub fn to_params(&self) -> anyhow::Result<SamplingParams> {
        let mut p = SamplingParams {
            max_tokens: self.max_tokens,
            ..SamplingParams::default()
        };
        let set = |dst: &mut f32, v: Option<f32>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut p.temperature, self.temperature);
        set(&mut p.top_p, self.top_p);
        set(&mut p.min_p, self.min_p);
        set(&mut p.repetition_penalty, self.repetition_penalty);
        set(&mut p.presence_penalty, self.presence_penalty);
        set(&mut p.frequency_penalty, self.frequency_penalty);
        if let Some(k) = self.top_k {
            p.top_k = k;
        }
        if let Some(n) = self.min_tokens {
            p.min_tokens = n;
        }
        p.seed = self.seed;
        p.stop = self.stop.clone();
        p.stop_token_ids = self.stop_token_ids.clone();
        p.ignore_eos = self.ignore_eos;
        p.validate()?;
        Ok(p)
    }
}
