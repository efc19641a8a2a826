//! The checks a configuration passes once it parsed: ranges, names that
//! must exist, and keys that must agree with each other.

use super::*;

/// The most engine cores one API server starts (`parallel.data_parallel_size`):
/// each is a process that loads the model, and past a few per machine they
/// only share the same cores.
pub const MAX_DATA_PARALLEL_SIZE: usize = 64;

/// The executor backends known to this build.
pub const EXECUTOR_BACKENDS: &[&str] = &["uni", "mp"];

/// Why `worker.cls = "gpu"` cannot run in this build (one without the
/// `cuda` feature), or `None` when it can. Whether a GPU is visible is the
/// worker's question (`worker::proc::worker_device`), asked at start-up:
/// the configuration probes no device.
fn gpu_worker_refusal() -> Option<String> {
    (!cfg!(feature = "cuda")).then(|| {
        "is `gpu` but this host was built without CUDA; rebuild with \
         `cargo build --features cuda`, or use `auto` / `cpu`"
            .to_string()
    })
}

/// The built-in worker classes (`worker.cls`).
pub const WORKER_CLASSES: &[&str] = &["auto", "cpu", "gpu"];

impl EngineConfig {
    /// The `[parallel]` node keys: a multi-node group shards one model over
    /// `mp` workers, at least one rank per node, behind one engine core.
    fn validate_nodes(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        let p = &self.parallel;
        if !(1..=MAX_NODES).contains(&p.nnodes) {
            return invalid(
                "parallel.nnodes",
                format!("must be between 1 and {MAX_NODES}, got {}", p.nnodes),
            );
        }
        if p.node_rank >= p.nnodes {
            return invalid(
                "parallel.node_rank",
                format!(
                    "is {}, but node ranks run from 0 to nnodes - 1 ({})",
                    p.node_rank,
                    p.nnodes - 1
                ),
            );
        }
        // A headless node (rank > 0) runs what node 0's configuration says;
        // only node 0's must describe a group that can span the nodes.
        if p.nnodes == 1 || p.node_rank > 0 {
            return Ok(());
        }
        let nnodes = p.nnodes;
        if p.distributed_executor_backend != "mp" {
            return invalid(
                "parallel.nnodes",
                format!(
                    "is {nnodes}, which runs workers on other machines: set \
                     parallel.distributed_executor_backend = \"mp\""
                ),
            );
        }
        if p.tensor_parallel_size < nnodes {
            return invalid(
                "parallel.nnodes",
                format!(
                    "is {nnodes}, but tensor_parallel_size is {}: every node needs at least \
                     one rank, so use at most {} nodes or more ranks",
                    p.tensor_parallel_size, p.tensor_parallel_size
                ),
            );
        }
        if p.data_parallel_size > 1 {
            return invalid(
                "parallel.nnodes",
                format!(
                    "is {nnodes} with data_parallel_size {}: nnodes spreads one engine's \
                     workers over machines; to spread the engine cores instead, set \
                     data_parallel_size_local (docs/scale-out.md)",
                    p.data_parallel_size
                ),
            );
        }
        if p.master_addr.trim().is_empty() {
            return invalid(
                "parallel.master_addr",
                "is empty: give node 0's address, reachable from every node".into(),
            );
        }
        if p.master_port == 0 {
            return invalid(
                "parallel.master_port",
                "is 0: the other nodes must know the port, so name one".into(),
            );
        }
        Ok(())
    }

    /// The `[parallel]` keys that spread data-parallel engine cores over
    /// machines: each machine runs a contiguous run of ranks, the API
    /// server's machine the first.
    fn validate_data_parallel_nodes(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        let p = &self.parallel;
        let dp = p.data_parallel_size;
        let ranks = p.local_data_parallel_ranks();
        let local = ranks.len();
        if local == 0 || ranks.end > dp {
            return invalid(
                "parallel.data_parallel_size_local",
                format!(
                    "is {local} from start rank {}, but data_parallel_size is {dp}: a machine \
                     runs 1 or more ranks, all below data_parallel_size",
                    p.data_parallel_start_rank
                ),
            );
        }
        if local < dp {
            if p.master_addr.trim().is_empty() {
                return invalid(
                    "parallel.master_addr",
                    "is empty: give the API server's address, reachable from every machine".into(),
                );
            }
            if p.master_port == 0 {
                return invalid(
                    "parallel.master_port",
                    "is 0: the other machines must know the port, so name one".into(),
                );
            }
        }
        Ok(())
    }

    /// Checks ranges and names that serde cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        if self.scheduler.max_num_seqs == 0 {
            return invalid("scheduler.max_num_seqs", "must be at least 1".into());
        }
        if self.scheduler.max_num_batched_tokens == 0 {
            return invalid(
                "scheduler.max_num_batched_tokens",
                "must be at least 1".into(),
            );
        }
        if !(1..=1024).contains(&self.cache.block_size) {
            return invalid(
                "cache.block_size",
                format!("must be in 1..=1024, got {}", self.cache.block_size),
            );
        }
        if self.cache.kv_cache_memory_bytes == Some(0) {
            return invalid(
                "cache.kv_cache_memory_bytes",
                "must be more than 0 (or unset for the default)".into(),
            );
        }
        let utilization = self.cache.gpu_memory_utilization;
        if !(utilization > 0.0 && utilization <= 1.0) {
            return invalid(
                "cache.gpu_memory_utilization",
                format!("must be in (0, 1], got {utilization}"),
            );
        }
        self.kv_events.validate()?;
        self.speculative.validate()?;
        if self.speculative.enabled() && self.worker.cls == "gpu" {
            return invalid(
                "speculative.num_speculative_tokens",
                "speculative decoding runs on the CPU worker only (the GPU runner does not \
                 return the logits of draft positions yet): set it to 0 or use worker.cls = \"cpu\""
                    .into(),
            );
        }
        if self.parallel.tensor_parallel_size == 0 {
            return invalid("parallel.tensor_parallel_size", "must be at least 1".into());
        }
        let dp = self.parallel.data_parallel_size;
        if !(1..=MAX_DATA_PARALLEL_SIZE).contains(&dp) {
            return invalid(
                "parallel.data_parallel_size",
                format!("must be between 1 and {MAX_DATA_PARALLEL_SIZE}, got {dp}"),
            );
        }
        if self.parallel.data_parallel_rank >= dp {
            return invalid(
                "parallel.data_parallel_rank",
                format!(
                    "is {}, but ranks run from 0 to data_parallel_size - 1 ({})",
                    self.parallel.data_parallel_rank,
                    dp - 1
                ),
            );
        }
        if dp > 1 && !self.server.engine_core_process {
            return invalid(
                "parallel.data_parallel_size",
                format!(
                    "is {dp}, which runs each engine core in its own process: \
                     set server.engine_core_process = true"
                ),
            );
        }
        self.validate_nodes()?;
        self.validate_data_parallel_nodes()?;
        let seconds = [
            (
                "parallel.worker_start_timeout_s",
                self.parallel.worker_start_timeout_s,
            ),
            (
                "parallel.worker_shutdown_timeout_s",
                self.parallel.worker_shutdown_timeout_s,
            ),
            (
                "parallel.execute_model_timeout_s",
                self.parallel.execute_model_timeout_s,
            ),
            ("engine.restart_window_s", self.engine.restart_window_s),
        ];
        if let Some((key, v)) = seconds
            .into_iter()
            .find(|(_, v)| !(v.is_finite() && *v > 0.0 && *v < 1e9))
        {
            return invalid(
                key,
                format!("must be a positive number of seconds, got {v}"),
            );
        }
        let backend = &self.parallel.distributed_executor_backend;
        if !EXECUTOR_BACKENDS.contains(&backend.as_str()) {
            return invalid(
                "parallel.distributed_executor_backend",
                format!(
                    "is `{backend}`; known backends: {}",
                    EXECUTOR_BACKENDS.join(", ")
                ),
            );
        }
        // Whether the size divides the model's heads is checked where the
        // model is loaded (`model::shard`), since it needs the model's config.
        if self.parallel.tensor_parallel_size > 1 && backend != "mp" {
            return invalid(
                "parallel.tensor_parallel_size",
                format!(
                    "is {}, which needs one worker process per rank: set \
                     parallel.distributed_executor_backend = \"mp\" (it is `{backend}`)",
                    self.parallel.tensor_parallel_size
                ),
            );
        }
        let server_sizes = [
            ("server.max_body_bytes", self.server.max_body_bytes),
            ("server.max_n", self.server.max_n as usize),
            ("server.max_prompts", self.server.max_prompts),
            ("server.max_prompt_bytes", self.server.max_prompt_bytes),
            ("server.max_messages", self.server.max_messages),
            (
                "server.max_waiting_requests",
                self.server.max_waiting_requests,
            ),
            ("server.max_connections", self.server.max_connections),
        ];
        if let Some((key, _)) = server_sizes.into_iter().find(|(_, v)| *v == 0) {
            return invalid(key, "must be more than 0".into());
        }
        let server_seconds = [
            (
                "server.header_read_timeout_s",
                self.server.header_read_timeout_s,
            ),
            (
                "server.body_read_timeout_s",
                self.server.body_read_timeout_s,
            ),
            (
                "server.idle_connection_timeout_s",
                self.server.idle_connection_timeout_s,
            ),
            (
                "server.log_stats_interval_s",
                self.server.log_stats_interval_s,
            ),
        ];
        if let Some((key, v)) = server_seconds
            .into_iter()
            .find(|(_, v)| !(v.is_finite() && *v > 0.0 && *v < 1e9))
        {
            return invalid(
                key,
                format!("must be a positive number of seconds, got {v}"),
            );
        }
        if self.server.log_stats_interval_s < 0.01 {
            return invalid(
                "server.log_stats_interval_s",
                format!(
                    "must be at least 0.01 seconds, got {}",
                    self.server.log_stats_interval_s
                ),
            );
        }
        if !WORKER_CLASSES.contains(&self.worker.cls.as_str()) {
            return invalid(
                "worker.cls",
                format!(
                    "is `{}`; known worker classes: {}",
                    self.worker.cls,
                    WORKER_CLASSES.join(", ")
                ),
            );
        }
        if self.worker.cls == "gpu" {
            if let Some(why) = gpu_worker_refusal() {
                return invalid("worker.cls", why);
            }
            if self.parallel.tensor_parallel_size > 1 {
                return invalid(
                    "parallel.tensor_parallel_size",
                    "must be 1 with the GPU worker (tensor parallelism runs on CPU workers only); \
                     set worker.cls = \"cpu\" or tensor_parallel_size = 1"
                        .into(),
                );
            }
        }
        Ok(())
    }
}
