//! `/metrics`: Prometheus text format under vLLM's metric names, so
//! dashboards and autoscalers written for vLLM work unchanged.
//!
//! Gauges and token counters come from the engine core's counters
//! (`EngineStats`, totals over every engine-core process when one was
//! replaced), the engine-core restarts from the client that replaced it
//! (`EngineCoreRestarts`); the latency histograms are measured here in the server,
//! from the arrival times of each request's outputs (`RequestMetrics`),
//! with vLLM's bucket boundaries.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use crate::config::CacheDtype;
use crate::engine::ipc::EngineCoreRestarts;
use crate::engine::{EngineStats, RequestMetrics};

/// `vllm:time_to_first_token_seconds` buckets (vLLM 0.x, 22 boundaries).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// `vllm:inter_token_latency_seconds` buckets (19 boundaries).
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// `vllm:e2e_request_latency_seconds` buckets (21 boundaries).
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative Prometheus histogram.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (non-cumulative), plus the `+Inf` overflow at the end.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    fn observe(&mut self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
    }

    /// The series under `labels` (the family's HELP and TYPE lines are
    /// the caller's).
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c;
            let le = self
                .bounds
                .get(i)
                .map_or("+Inf".to_string(), |b| format!("{b:?}"));
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

/// What the server measured itself.
#[derive(Debug)]
struct Measured {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    /// Finished requests by `finished_reason`.
    success: BTreeMap<String, u64>,
}

/// The server's metrics: histograms it measures, rendered together with the
/// engine cores' counters; every series once per data-parallel rank (the
/// `engine` label, as in vLLM).
#[derive(Debug)]
pub struct Metrics {
    model_name: String,
    /// `cache.cache_dtype`, as configured (`cache_config_info` shows it).
    cache_dtype: CacheDtype,
    /// By rank.
    measured: Vec<Mutex<Measured>>,
}

/// One metric family's header.
fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

impl Metrics {
    /// Empty metrics for the model served as `model_name` (a label on every
    /// series, as in vLLM) by `num_ranks` data-parallel engine cores whose
    /// KV caches hold `cache_dtype`.
    pub fn new(model_name: &str, num_ranks: usize, cache_dtype: CacheDtype) -> Metrics {
        let measured = (0..num_ranks.max(1)).map(|_| {
            Mutex::new(Measured {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
                success: ["stop", "length", "abort"]
                    .iter()
                    .map(|r| (r.to_string(), 0))
                    .collect(),
            })
        });
        Metrics {
            model_name: model_name.to_string(),
            cache_dtype,
            measured: measured.collect(),
        }
    }

    fn measured(&self, rank: usize) -> std::sync::MutexGuard<'_, Measured> {
        let m = &self.measured[rank.min(self.measured.len() - 1)];
        // A panic while holding the lock cannot leave the counters torn
        // beyond one observation; keep serving them.
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records inter-token latencies of a request rank `rank` served, as
    /// they arrive.
    pub fn observe_itl(&self, rank: usize, latencies_s: &[f64]) {
        let mut m = self.measured(rank);
        for &v in latencies_s {
            m.itl.observe(v);
        }
    }

    /// Records a finished request of rank `rank`: its time to first token,
    /// end-to-end latency and finish reason.
    pub fn observe_finished(&self, rank: usize, metrics: &RequestMetrics, finish_reason: &str) {
        let mut m = self.measured(rank);
        if let Some(t) = metrics.time_to_first_token_s {
            m.ttft.observe(t);
        }
        if let Some(t) = metrics.e2e_latency_s {
            m.e2e.observe(t);
        }
        *m.success.entry(finish_reason.to_string()).or_default() += 1;
    }

    /// The Prometheus text exposition of everything, given each rank's
    /// counters and engine-core restarts.
    pub fn render(&self, ranks: &[(EngineStats, EngineCoreRestarts)]) -> String {
        let model = escape(&self.model_name);
        let labels: Vec<String> = (0..ranks.len().max(self.measured.len()))
            .map(|rank| format!("model_name=\"{model}\",engine=\"{rank}\""))
            .collect();
        let mut out = String::with_capacity(8 << 10);
        type Gauge = fn(&EngineStats) -> f64;
        let gauges: [(&str, &str, Gauge); 3] = [
            (
                "vllm:num_requests_running",
                "Requests in the running batch.",
                |s| s.scheduler.num_running as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Requests waiting to be scheduled.",
                |s| s.scheduler.num_waiting as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage; 1 means 100 percent.",
                |s| s.scheduler.kv_cache_usage,
            ),
        ];
        for (name, help, value) in gauges {
            header(&mut out, name, "gauge", help);
            for ((stats, _), labels) in ranks.iter().zip(&labels) {
                let _ = writeln!(out, "{name}{{{labels}}} {}", value(stats));
            }
        }
        // vLLM's info gauge, which routers (GAIE's model-server protocol)
        // read the block size from: its labels carry the values.
        header(
            &mut out,
            "vllm:cache_config_info",
            "gauge",
            "Information of the KV cache's configuration.",
        );
        for ((stats, _), labels) in ranks.iter().zip(&labels) {
            let c = stats.scheduler.cache_config;
            let _ = writeln!(
                out,
                "vllm:cache_config_info{{{labels},block_size=\"{}\",num_gpu_blocks=\"{}\",\
                 enable_prefix_caching=\"{}\",cache_dtype=\"{}\"}} 1",
                c.block_size,
                c.num_blocks,
                if c.enable_prefix_caching {
                    "True"
                } else {
                    "False"
                },
                self.cache_dtype.name()
            );
        }
        type Counter = fn(&EngineStats, &EngineCoreRestarts) -> u64;
        let counters: [(&str, &str, Counter); 12] = [
            (
                "vllm:prompt_tokens_total",
                "Prompt tokens admitted.",
                |s, _| s.num_prompt_tokens,
            ),
            (
                "vllm:generation_tokens_total",
                "Tokens generated.",
                |s, _| s.num_generation_tokens,
            ),
            (
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                |s, _| s.scheduler.prefix_cache.queries,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache.",
                |s, _| s.scheduler.prefix_cache.hits,
            ),
            ("vllm:num_preemptions_total", "Preemptions.", |s, _| {
                s.scheduler.num_preemptions
            }),
            (
                "vllm:spec_decode_num_drafts_total",
                "Decode steps of a request that verified draft tokens.",
                |s, _| s.scheduler.spec_decoding.num_drafts,
            ),
            (
                "vllm:spec_decode_num_draft_tokens_total",
                "Draft tokens verified.",
                |s, _| s.scheduler.spec_decoding.num_draft_tokens,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens_total",
                "Draft tokens kept.",
                |s, _| s.scheduler.spec_decoding.num_accepted_tokens,
            ),
            (
                "vllm:engine_core_restarts_total",
                "Engine-core processes started to replace a dead one.",
                |_, r| r.restarts,
            ),
            (
                "vllm:engine_core_replayed_requests_total",
                "Unfinished requests resubmitted to a restarted engine-core process.",
                |_, r| r.replayed_requests,
            ),
            (
                "vllm:worker_restarts_total",
                "Worker groups started to replace a dead one.",
                |s, _| s.num_worker_restarts,
            ),
            (
                "vllm:worker_replayed_requests_total",
                "Requests replayed by recompute on a restarted worker group.",
                |s, _| s.num_worker_replayed_requests,
            ),
        ];
        for (name, help, value) in counters {
            header(&mut out, name, "counter", help);
            for ((stats, restarts), labels) in ranks.iter().zip(&labels) {
                let _ = writeln!(out, "{name}{{{labels}}} {}", value(stats, restarts));
            }
        }
        // One series per draft position (none with speculative decoding
        // off): how often the draft there was kept.
        let name = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
        header(
            &mut out,
            name,
            "counter",
            "Draft tokens kept, per position in the draft.",
        );
        for ((stats, _), labels) in ranks.iter().zip(&labels) {
            let per_pos = &stats.scheduler.spec_decoding.num_accepted_tokens_per_pos;
            for (position, n) in per_pos.iter().enumerate() {
                let _ = writeln!(out, "{name}{{{labels},position=\"{position}\"}} {n}");
            }
        }
        // Not a vLLM metric (vLLM has no plugins); named alike so one
        // dashboard reads both. One series per plugin in use.
        let name = "vllm:plugin_faults_total";
        header(
            &mut out,
            name,
            "counter",
            "Plugin faults (trap, overrun, error) recovered from by recreating the instance.",
        );
        for ((stats, _), labels) in ranks.iter().zip(&labels) {
            for (plugin, n) in &stats.plugin_faults {
                let plugin = escape(plugin);
                let _ = writeln!(out, "{name}{{{labels},plugin=\"{plugin}\"}} {n}");
            }
        }
        let measured: Vec<_> = (0..self.measured.len()).map(|r| self.measured(r)).collect();
        let name = "vllm:request_success_total";
        header(
            &mut out,
            name,
            "counter",
            "Finished requests by finish reason.",
        );
        for (m, labels) in measured.iter().zip(&labels) {
            for (reason, n) in &m.success {
                let _ = writeln!(
                    out,
                    "{name}{{{labels},finished_reason=\"{}\"}} {n}",
                    escape(reason)
                );
            }
        }
        type Pick = fn(&Measured) -> &Histogram;
        let histograms: [(&str, &str, Pick); 3] = [
            (
                "vllm:time_to_first_token_seconds",
                "Time to first token.",
                |m| &m.ttft,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Time between output tokens.",
                |m| &m.itl,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "End-to-end request latency.",
                |m| &m.e2e,
            ),
        ];
        for (name, help, pick) in histograms {
            header(&mut out, name, "histogram", help);
            for (m, labels) in measured.iter().zip(&labels) {
                pick(m).render(&mut out, name, labels);
            }
        }
        out
    }
}

/// Escapes a Prometheus label value.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{PrefixCacheStats, SchedulerStats};

    #[test]
    fn vllm_bucket_counts() {
        // vLLM's lists have 22, 19 and 21 boundaries; a dashboard's `le`
        // thresholds must line up with them.
        assert_eq!(
            (TTFT_BUCKETS.len(), ITL_BUCKETS.len(), E2E_BUCKETS.len()),
            (22, 19, 21)
        );
        for b in [TTFT_BUCKETS, ITL_BUCKETS, E2E_BUCKETS] {
            assert!(b.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn histogram_is_cumulative_with_inf() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.1, 0.5, 3.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "a=\"b\"");
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.1\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"1.0\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_sum{a=\"b\"} 3.65\n"), "{out}");
        assert!(out.contains("x_count{a=\"b\"} 4\n"), "{out}");
    }

    #[test]
    fn renders_vllm_series() {
        let m = Metrics::new("m\"x", 2, CacheDtype::Float16);
        let rm = RequestMetrics {
            time_to_first_token_s: Some(0.2),
            inter_token_latencies_s: vec![],
            e2e_latency_s: Some(1.2),
        };
        m.observe_finished(0, &rm, "length");
        m.observe_itl(0, &[0.02, 0.03]);
        m.observe_finished(1, &rm, "stop");
        let stats = EngineStats {
            scheduler: SchedulerStats {
                num_running: 3,
                num_waiting: 2,
                kv_cache_usage: 0.25,
                prefix_cache: PrefixCacheStats {
                    requests: 1,
                    queries: 10,
                    hits: 4,
                },
                num_preemptions: 1,
                num_policy_fallbacks: 0,
                cache_config: crate::engine::CacheConfigInfo {
                    block_size: 16,
                    num_blocks: 364,
                    enable_prefix_caching: true,
                },
                spec_decoding: crate::engine::SpecDecodingStats {
                    num_drafts: 2,
                    num_draft_tokens: 7,
                    num_accepted_tokens: 5,
                    num_accepted_tokens_per_pos: vec![2, 2, 1],
                },
            },
            num_prompt_tokens: 100,
            num_generation_tokens: 50,
            last_step: Default::default(),
            num_worker_restarts: 2,
            num_worker_replayed_requests: 7,
            plugin_faults: [("test:policy".into(), 3), ("a\"b".into(), 0)].into(),
        };
        let restarts = EngineCoreRestarts {
            restarts: 1,
            replayed_requests: 16,
        };
        let rank1 = EngineStats {
            num_prompt_tokens: 7,
            ..stats.clone()
        };
        let text = m.render(&[(stats, restarts), (rank1, EngineCoreRestarts::default())]);
        // The text format wants each family's lines together, once headed.
        for family in [
            "vllm:prompt_tokens_total",
            "vllm:plugin_faults_total",
            "vllm:time_to_first_token_seconds",
        ] {
            let heads = text.matches(&format!("# TYPE {family} ")).count();
            assert_eq!(heads, 1, "{family} headed {heads} times");
        }
        let labels = "model_name=\"m\\\"x\",engine=\"0\"";
        let rank1 = "model_name=\"m\\\"x\",engine=\"1\"";
        for line in [
            format!("vllm:prompt_tokens_total{{{rank1}}} 7"),
            format!("vllm:engine_core_restarts_total{{{rank1}}} 0"),
            format!("vllm:request_success_total{{{rank1},finished_reason=\"stop\"}} 1"),
            format!("vllm:request_success_total{{{rank1},finished_reason=\"length\"}} 0"),
            format!("vllm:num_requests_running{{{labels}}} 3"),
            format!(
                "vllm:cache_config_info{{{labels},block_size=\"16\",num_gpu_blocks=\"364\",\
                 enable_prefix_caching=\"True\",cache_dtype=\"float16\"}} 1"
            ),
            format!("vllm:num_requests_waiting{{{labels}}} 2"),
            format!("vllm:kv_cache_usage_perc{{{labels}}} 0.25"),
            format!("vllm:prompt_tokens_total{{{labels}}} 100"),
            format!("vllm:generation_tokens_total{{{labels}}} 50"),
            format!("vllm:prefix_cache_hits_total{{{labels}}} 4"),
            format!("vllm:engine_core_restarts_total{{{labels}}} 1"),
            format!("vllm:engine_core_replayed_requests_total{{{labels}}} 16"),
            format!("vllm:worker_restarts_total{{{labels}}} 2"),
            format!("vllm:worker_replayed_requests_total{{{labels}}} 7"),
            format!("vllm:spec_decode_num_drafts_total{{{labels}}} 2"),
            format!("vllm:spec_decode_num_draft_tokens_total{{{labels}}} 7"),
            format!("vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 5"),
            format!(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position=\"0\"}} 2"
            ),
            format!(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position=\"2\"}} 1"
            ),
            format!(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total{{{rank1},position=\"1\"}} 2"
            ),
            format!("vllm:plugin_faults_total{{{labels},plugin=\"test:policy\"}} 3"),
            format!("vllm:plugin_faults_total{{{rank1},plugin=\"a\\\"b\"}} 0"),
            format!("vllm:request_success_total{{{labels},finished_reason=\"length\"}} 1"),
            format!("vllm:request_success_total{{{labels},finished_reason=\"stop\"}} 0"),
            format!("vllm:time_to_first_token_seconds_bucket{{{labels},le=\"0.25\"}} 1"),
            format!("vllm:time_to_first_token_seconds_bucket{{{labels},le=\"0.1\"}} 0"),
            format!("vllm:inter_token_latency_seconds_count{{{labels}}} 2"),
            format!("vllm:e2e_request_latency_seconds_sum{{{labels}}} 1.2"),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing `{line}` in\n{text}"
            );
        }
        assert!(
            !text.contains("position=\"3\""),
            "a position past num_speculative_tokens"
        );
    }
}
