//! `host generate`: one prompt in and its text streamed out as it is
//! generated, or a JSONL batch in and a JSONL file of completions out — both
//! through the engine core.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;

use super::sampling_args::SamplingArgs;
use super::shipped_plugins::{asks_for_structured_output, structured_outputs_unavailable};
use crate::config::EngineConfig;
use crate::engine::{GenerateRequest, Llm, Prompt};
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatMessage;

/// Flags of `host generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The prompt text.
    #[arg(long, required_unless_present = "input", conflicts_with = "input")]
    pub prompt: Option<String>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A system message for `--chat`.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// A JSONL file of requests, one per line: `{"prompt": "…"}` or
    /// `{"messages": [{"role": "user", "content": "…"}]}`, plus any sampling
    /// parameter (`"max_tokens": 32`, `"temperature": 0`, …), `"priority"`,
    /// `"prediction"` (text the answer is expected to repeat, verified as
    /// speculative drafts; needs `--speculative-config`) and `"cache_salt"`
    /// (the prompt shares the prefix cache only with prompts of its salt).
    #[arg(long, value_name = "FILE", requires = "output")]
    pub input: Option<PathBuf>,
    /// Where `--input`'s completions go, one JSON line per request, in order;
    /// a request with `"n"` above 1 gets `{"choices": [...]}`, its `n`
    /// completions (seeded ones with seed, seed + 1, …, as in vLLM).
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// One line of a `--input` file. Fields other than the prompt, the
/// priority, the prediction and the cache salt are sampling parameters; an
/// unknown one is refused by name.
#[derive(Debug, Deserialize)]
struct InputLine {
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    priority: i32,
    /// Text the answer is expected to repeat (a predicted output).
    prediction: Option<String>,
    /// vLLM's `cache_salt`: the prompt shares prefix-cache blocks only with
    /// prompts of the same salt.
    cache_salt: Option<String>,
    #[serde(flatten)]
    params: serde_json::Map<String, serde_json::Value>,
}

/// Runs `host generate`.
pub fn run(config: &EngineConfig, args: &GenerateArgs) -> anyhow::Result<()> {
    let params = args.sampling.to_params()?;
    match (&args.prompt, &args.input, &args.output) {
        (Some(prompt), None, _) => run_one(config, args, prompt, params),
        (None, Some(input), Some(output)) => run_batch(config, input, output, &params),
        _ => bail!("give either --prompt, or --input with --output"),
    }
}

fn run_one(
    config: &EngineConfig,
    args: &GenerateArgs,
    text: &str,
    params: SamplingParams,
) -> anyhow::Result<()> {
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.as_str()));
        }
        messages.push(ChatMessage::new("user", text));
        Prompt::Chat(messages)
    } else {
        Prompt::Text(text.to_string())
    };
    let mut llm = Llm::new(config)?;
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    let results = llm.generate(
        &[GenerateRequest::new(prompt, params)],
        |_, delta| {
            if let Err(e) = out.write_all(delta.as_bytes()).and_then(|()| out.flush()) {
                write_err.get_or_insert(e);
            }
        },
        |_, _| {},
    )?;
    if let Some(e) = write_err {
        return Err(e).context("writing to stdout");
    }
    writeln!(out)?;
    let completion = results
        .into_iter()
        .next()
        .expect("one request")
        .map_err(anyhow::Error::msg)?;
    tracing::info!(
        prompt_tokens = completion.num_prompt_tokens,
        generated = completion.token_ids.len(),
        finish = %completion.finish.finish_reason,
        "generate: done"
    );
    Ok(())
}

fn run_batch(
    config: &EngineConfig,
    input: &PathBuf,
    output: &PathBuf,
    defaults: &SamplingParams,
) -> anyhow::Result<()> {
    let file = std::fs::File::open(input)
        .with_context(|| format!("cannot open --input {}", input.display()))?;
    let mut requests = Vec::new();
    // How many engine requests (choices) each line became, in order.
    let mut choices = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", input.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", input.display(), n + 1);
        let parsed: InputLine =
            serde_json::from_str(&line).with_context(|| format!("{}: not a request", at()))?;
        let request = to_request(parsed, defaults).with_context(at)?;
        let constrained = asks_for_structured_output(request.params.extra_args.as_ref());
        if let Some(why) = constrained
            .then(|| structured_outputs_unavailable(config))
            .flatten()
        {
            bail!("{}: asks for structured output, but {why}", at());
        }
        let n = request.params.n;
        let max_n = config.server.max_n;
        if n > max_n {
            bail!(
                "{}: n = {n} is more choices than server.max_n ({max_n}) allows; \
                 raise it with --set server.max_n={n}",
                at()
            );
        }
        // As the server does: `n` choices are `n` engine requests.
        requests.extend((0..n).map(|i| GenerateRequest {
            params: request.params.child(i),
            ..request.clone()
        }));
        choices.push(n as usize);
    }
    let mut llm = Llm::new(config)?;
    let bar = ProgressBar::new(requests.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} completions ({elapsed}, eta {eta})")
            .expect("static template"),
    );
    let results = llm.generate(
        &requests,
        |_, _| {},
        |done, _| bar.set_position(done as u64),
    )?;
    bar.finish_and_clear();
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(output)
            .with_context(|| format!("cannot create --output {}", output.display()))?,
    );
    let mut refused = 0;
    let mut results = results.iter();
    for n in choices {
        let mut values = Vec::with_capacity(n);
        for result in results.by_ref().take(n) {
            values.push(match result {
                Ok(completion) => serde_json::to_value(completion)?,
                Err(error) => {
                    refused += 1;
                    serde_json::json!({ "error": error })
                }
            });
        }
        let line = match values.len() {
            1 => values.swap_remove(0),
            _ => serde_json::json!({ "choices": values }),
        };
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    let stats = llm.stats();
    eprintln!(
        "{} completions ({refused} refused or failed), {} prompt and {} generated tokens, prefix-cache hit rate {:.1}%",
        requests.len(),
        stats.num_prompt_tokens,
        stats.num_generation_tokens,
        100.0 * stats.scheduler.prefix_cache.hit_rate()
    );
    Ok(())
}

/// A JSONL line as a request: its sampling fields over the command line's.
fn to_request(line: InputLine, defaults: &SamplingParams) -> anyhow::Result<GenerateRequest> {
    let prompt = match (line.prompt, line.messages) {
        (Some(text), None) => Prompt::Text(text),
        (None, Some(messages)) => Prompt::Chat(messages),
        _ => bail!("give exactly one of \"prompt\" or \"messages\""),
    };
    let mut params = serde_json::to_value(defaults)?;
    let fields = params
        .as_object_mut()
        .expect("SamplingParams serialises to an object");
    fields.extend(line.params);
    let params: SamplingParams =
        serde_json::from_value(params).context("invalid sampling parameters")?;
    params.validate()?;
    if line.cache_salt.as_deref() == Some("") {
        bail!("\"cache_salt\" must not be empty; leave it out to share the prefix cache with unsalted prompts");
    }
    Ok(GenerateRequest {
        priority: line.priority,
        prediction: line.prediction,
        cache_salt: line.cache_salt,
        ..GenerateRequest::new(prompt, params)
    })
}
