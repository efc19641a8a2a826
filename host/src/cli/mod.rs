//! The `host` command line: one binary for every job (serve, generate,
//! bench, config); with no subcommand it serves. Flags that shape the engine
//! are turned into config overrides, so a flag and a TOML key always mean the
//! same thing.

mod bench;
mod bench_profile;
mod bench_throughput;
mod generate;
mod json_flag;
mod launcher_env;
mod plugin;
mod plugin_build;
mod plugin_new;
mod plugins_in_use;
mod sampling_args;
mod serve;
mod shipped_plugins;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::config::EngineConfig;

/// A vLLM V1-style LLM inference engine with WebAssembly plugins.
#[derive(Debug, Parser)]
#[command(name = "host", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    engine: EngineArgs,
    /// What to do; none serves the OpenAI-compatible API.
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API (the default with no subcommand).
    Serve(serve::ServeArgs),
    /// Generate text for one prompt, streamed to stdout as it is produced.
    Generate(generate::GenerateArgs),
    /// Measure prefill and single-stream decode speed on the configured model.
    Bench(bench::BenchArgs),
    /// Inspect the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// List, inspect, create and build WebAssembly plugins.
    #[command(subcommand)]
    Plugin(plugin::PluginCommand),
    /// A worker process of the `mp` executor (started by the engine, which
    /// writes its bootstrap on stdin).
    #[command(hide = true)]
    Worker,
    /// The engine-core process (started by an engine client, which writes
    /// its bootstrap on stdin).
    #[command(hide = true)]
    EngineCore,
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Print the effective configuration (file + flags + defaults, and the
    /// node place a launcher's environment gives `serve`) as TOML.
    Show,
}

/// Flags that override the configuration file; each names its TOML key.
#[derive(Debug, Args)]
struct EngineArgs {
    /// TOML configuration file (see docs/config.md).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Override any config key, e.g. `--set scheduler.max_num_seqs=64` (repeatable).
    #[arg(long = "set", global = true, value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Model file or directory [model.path].
    #[arg(long, global = true, value_name = "PATH")]
    model: Option<PathBuf>,
    /// auto | gguf | safetensors | dummy [model.load_format].
    #[arg(long, global = true)]
    load_format: Option<String>,
    /// The chat template: a Jinja file, or the template itself
    /// [model.chat_template].
    #[arg(long, global = true, value_name = "FILE|TEMPLATE")]
    chat_template: Option<String>,
    /// Longest prompt + output; 0 = the model's context [model.max_model_len].
    #[arg(long, global = true)]
    max_model_len: Option<usize>,
    /// Token budget per engine step [scheduler.max_num_batched_tokens].
    #[arg(long, global = true)]
    max_num_batched_tokens: Option<usize>,
    /// Most sequences per engine step [scheduler.max_num_seqs].
    #[arg(long, global = true)]
    max_num_seqs: Option<usize>,
    /// Tokens per KV block [cache.block_size].
    #[arg(long, global = true)]
    block_size: Option<usize>,
    /// KV-cache memory, in bytes (default on the CPU: what max_num_seqs
    /// sequences of max_model_len tokens fill, at most 256 MiB; on a GPU:
    /// what gpu_memory_utilization leaves) [cache.kv_cache_memory_bytes].
    #[arg(long, global = true)]
    kv_cache_memory_bytes: Option<u64>,
    /// KV-cache element type: auto (f32 on the CPU, bf16 on a GPU),
    /// float32, float16 or bfloat16 [cache.cache_dtype].
    #[arg(long, global = true, value_name = "DTYPE")]
    kv_cache_dtype: Option<String>,
    /// Compute threads; 0 = every core [worker.num_threads].
    #[arg(long, global = true)]
    num_threads: Option<usize>,
    /// A WebAssembly plugin component to make known (repeatable); appended
    /// to [plugins.paths].
    #[arg(long = "plugin", global = true, value_name = "FILE.wasm")]
    plugins: Vec<PathBuf>,
    /// KV-cache events for routers, as vLLM's JSON object, e.g.
    /// '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    /// [kv_events].
    #[arg(long, global = true, value_name = "JSON")]
    kv_events_config: Option<String>,
    /// Speculative decoding by n-gram lookup, as vLLM's JSON object, e.g.
    /// '{"method": "ngram", "num_speculative_tokens": 4}' [speculative].
    #[arg(long, global = true, value_name = "JSON")]
    speculative_config: Option<String>,
    /// Engine cores behind the API server [parallel.data_parallel_size].
    #[arg(long, global = true)]
    data_parallel_size: Option<usize>,
    /// Engine cores this machine runs; the others run under `serve
    /// --headless` on other machines [parallel.data_parallel_size_local].
    #[arg(long, global = true)]
    data_parallel_size_local: Option<usize>,
    /// The first engine-core rank a headless machine runs
    /// [parallel.data_parallel_start_rank].
    #[arg(long, global = true)]
    data_parallel_start_rank: Option<usize>,
    /// Machines the workers span [parallel.nnodes].
    #[arg(long, global = true)]
    nnodes: Option<usize>,
    /// This machine's rank among them; above 0 it runs workers only
    /// [parallel.node_rank].
    #[arg(long, global = true)]
    node_rank: Option<usize>,
    /// Node 0's address, reachable from every node [parallel.master_addr].
    #[arg(long, global = true, value_name = "HOST")]
    master_addr: Option<String>,
    /// The port node 0 waits for the other nodes on [parallel.master_port].
    #[arg(long, global = true)]
    master_port: Option<u16>,
}

impl EngineArgs {
    /// The flags as `key=value` overrides, after the `--set` ones so a
    /// dedicated flag wins.
    fn overrides(&self) -> Vec<String> {
        let mut out = self.overrides.clone();
        let mut push = |key: &str, value: Option<String>| {
            if let Some(v) = value {
                out.push(format!("{key}={v}"));
            }
        };
        // Paths and names are quoted so TOML never reinterprets them.
        let quoted = |s: &str| toml::Value::String(s.to_string()).to_string();
        push(
            "model.path",
            self.model.as_ref().map(|p| quoted(&p.to_string_lossy())),
        );
        push("model.load_format", self.load_format.as_deref().map(quoted));
        push(
            "model.chat_template",
            self.chat_template.as_deref().map(quoted),
        );
        push(
            "model.max_model_len",
            self.max_model_len.map(|v| v.to_string()),
        );
        push(
            "scheduler.max_num_batched_tokens",
            self.max_num_batched_tokens.map(|v| v.to_string()),
        );
        push(
            "scheduler.max_num_seqs",
            self.max_num_seqs.map(|v| v.to_string()),
        );
        push("cache.block_size", self.block_size.map(|v| v.to_string()));
        push(
            "cache.kv_cache_memory_bytes",
            self.kv_cache_memory_bytes.map(|v| v.to_string()),
        );
        push(
            "cache.cache_dtype",
            self.kv_cache_dtype.as_deref().map(quoted),
        );
        push(
            "worker.num_threads",
            self.num_threads.map(|v| v.to_string()),
        );
        push(
            "parallel.data_parallel_size",
            self.data_parallel_size.map(|v| v.to_string()),
        );
        push(
            "parallel.data_parallel_size_local",
            self.data_parallel_size_local.map(|v| v.to_string()),
        );
        push(
            "parallel.data_parallel_start_rank",
            self.data_parallel_start_rank.map(|v| v.to_string()),
        );
        push("parallel.nnodes", self.nnodes.map(|v| v.to_string()));
        push("parallel.node_rank", self.node_rank.map(|v| v.to_string()));
        push(
            "parallel.master_addr",
            self.master_addr.as_deref().map(quoted),
        );
        push(
            "parallel.master_port",
            self.master_port.map(|v| v.to_string()),
        );
        out
    }

    /// The configuration: file, then these flags, then `more` (a
    /// subcommand's own overrides).
    fn load(&self, more: &[String]) -> anyhow::Result<EngineConfig> {
        let mut overrides = self.overrides();
        if let Some(json) = &self.kv_events_config {
            overrides.extend(json_flag::KV_EVENTS.overrides(json)?);
        }
        if let Some(json) = &self.speculative_config {
            overrides.extend(json_flag::SPECULATIVE.overrides(json)?);
        }
        overrides.extend_from_slice(more);
        let mut config = EngineConfig::load(self.config.as_deref(), &overrides)?;
        config.plugins.paths.extend(self.plugins.iter().cloned());
        Ok(config)
    }
}

/// Runs the command line and returns the process exit code.
pub fn main() -> ExitCode {
    init_tracing();
    let cli = Cli::parse();
    let command = cli
        .command
        .unwrap_or_else(|| Command::Serve(serve::ServeArgs::default()));
    let more = match &command {
        Command::Serve(args) => args.overrides(),
        _ => Vec::new(),
    };
    // Only a server takes its node place from a launcher (one command line
    // then serves every node of a group); `config show` shows what it would.
    let serving = matches!(command, Command::Serve(_) | Command::Config(_));
    let kernels = crate::kernels::CpuKernels::from_env().map_err(anyhow::Error::msg);
    let loaded = kernels.and_then(|_| match command {
        // Worker and engine-core processes get their configuration from
        // their parent, already resolved.
        Command::Worker | Command::EngineCore => cli.engine.load(&more),
        _ => cli.engine.load(&more).and_then(|mut config| {
            if let Some(place) = serving
                .then(|| launcher_env::apply(&mut config))
                .transpose()?
                .flatten()
            {
                tracing::info!(?place, "node place from the launcher's environment");
            }
            shipped_plugins::resolve(&mut config)?;
            Ok(config)
        }),
    });
    let result = loaded.and_then(|config| match command {
        Command::Serve(args) => serve::run(&config, &args),
        Command::Generate(args) => generate::run(&config, &args),
        Command::Bench(args) => bench::run(&config, &args),
        Command::Plugin(command) => plugin::run(&config, &command),
        Command::Config(ConfigCommand::Show) => {
            print!("{}", config.to_toml());
            Ok(())
        }
        Command::Worker => crate::worker::proc::run(),
        Command::EngineCore => crate::engine::ipc::run(),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr, filtered by `RUST_LOG` (default: warnings, and the
/// server's periodic stats lines).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        let stats = crate::server::STATS_LOG_TARGET;
        tracing_subscriber::EnvFilter::new(format!("warn,{stats}=info"))
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
