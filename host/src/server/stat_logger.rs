//! The periodic stats lines of `host serve` (vLLM's `LoggingStatLogger`):
//! every `server.log_stats_interval_s` seconds, per engine, the prompt and
//! generation throughput over the interval, the running and waiting
//! requests, KV-cache usage and the prefix-cache hit rate, and, with
//! speculative decoding, how many drafts were kept and where. An operator
//! reads them in the log without scraping `/metrics`.
//!
//! Lines go to the `stats` log target at info level, which the default
//! filter shows (`RUST_LOG` replaces it); an idle engine logs once more
//! after its last busy interval and then stays quiet, as vLLM does.

use std::fmt::Write;
use std::time::{Duration, Instant};

use crate::engine::{EngineCoreClient, EngineStats, SpecDecodingStats};

/// The log target of the stats lines (the default log filter shows it).
pub(crate) const TARGET: &str = "stats";

/// Logs each engine's stats every `interval` until the runtime stops.
pub(crate) async fn run(client: EngineCoreClient, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    let mut logger = StatLogger::new(client.stats_by_rank().into_iter().map(|(s, _)| s));
    let mut last = Instant::now();
    loop {
        ticks.tick().await;
        let now = Instant::now();
        let stats = client.stats_by_rank().into_iter().map(|(s, _)| s);
        for line in logger.interval(stats, now - last) {
            tracing::info!(target: TARGET, "{line}");
        }
        last = now;
    }
}

/// Each engine's counters at the last interval's end, and whether it was
/// busy then.
#[derive(Debug, Default)]
pub(crate) struct StatLogger {
    prev: Vec<(EngineStats, bool)>,
}

impl StatLogger {
    /// A logger whose first interval starts at `stats` (one per engine).
    pub(crate) fn new(stats: impl Iterator<Item = EngineStats>) -> StatLogger {
        StatLogger {
            prev: stats.map(|s| (s, false)).collect(),
        }
    }

    /// The lines for an interval of `elapsed` ending at `stats` (one per
    /// engine, in rank order): nothing for an engine that made no tokens
    /// in this interval nor in the one before.
    pub(crate) fn interval(
        &mut self,
        stats: impl Iterator<Item = EngineStats>,
        elapsed: Duration,
    ) -> Vec<String> {
        let secs = elapsed.as_secs_f64().max(1e-3);
        let mut lines = Vec::new();
        for (rank, now) in stats.enumerate() {
            if self.prev.len() <= rank {
                self.prev.push((now.clone(), false));
                continue;
            }
            let (prev, was_busy) = &self.prev[rank];
            let busy = now.num_prompt_tokens > prev.num_prompt_tokens
                || now.num_generation_tokens > prev.num_generation_tokens;
            if busy || *was_busy {
                lines.push(engine_line(rank, prev, &now, secs));
                let spec = (now.scheduler.spec_decoding).since(&prev.scheduler.spec_decoding);
                if spec.num_drafts > 0 {
                    lines.push(spec_line(rank, &spec, secs));
                }
            }
            self.prev[rank] = (now, busy);
        }
        lines
    }
}

/// vLLM's engine line: throughputs over the interval, the request gauges,
/// KV-cache usage and the interval's prefix-cache hit rate.
fn engine_line(rank: usize, prev: &EngineStats, now: &EngineStats, secs: f64) -> String {
    let per_sec = |a: u64, b: u64| b.saturating_sub(a) as f64 / secs;
    let s = &now.scheduler;
    let (p, n) = (&prev.scheduler.prefix_cache, &s.prefix_cache);
    let queries = n.queries.saturating_sub(p.queries);
    let hits = n.hits.saturating_sub(p.hits);
    format!(
        "Engine {rank:03}: Avg prompt throughput: {:.1} tokens/s, \
         Avg generation throughput: {:.1} tokens/s, Running: {} reqs, Waiting: {} reqs, \
         KV cache usage: {:.1}%, Prefix cache hit rate: {:.1}%",
        per_sec(prev.num_prompt_tokens, now.num_prompt_tokens),
        per_sec(prev.num_generation_tokens, now.num_generation_tokens),
        s.num_running,
        s.num_waiting,
        100.0 * s.kv_cache_usage,
        percent(hits, queries),
    )
}

/// vLLM's speculative-decoding line over the interval's counters `d`:
/// the mean tokens a verifying step yields (1 + kept drafts per step),
/// throughputs, and the fraction of steps that kept the draft at each
/// position.
fn spec_line(rank: usize, d: &SpecDecodingStats, secs: f64) -> String {
    let drafts = d.num_drafts as f64;
    let mut per_pos = String::new();
    for (i, &n) in d.num_accepted_tokens_per_pos.iter().enumerate() {
        let sep = if i == 0 { "" } else { ", " };
        let _ = write!(per_pos, "{sep}{:.3}", n as f64 / drafts);
    }
    format!(
        "Engine {rank:03}: SpecDecoding metrics: Mean acceptance length: {:.2}, \
         Accepted throughput: {:.2} tokens/s, Drafted throughput: {:.2} tokens/s, \
         Accepted: {} tokens, Drafted: {} tokens, Per-position acceptance rate: {per_pos}, \
         Avg Draft acceptance rate: {:.1}%",
        1.0 + d.num_accepted_tokens as f64 / drafts,
        d.num_accepted_tokens as f64 / secs,
        d.num_draft_tokens as f64 / secs,
        d.num_accepted_tokens,
        d.num_draft_tokens,
        percent(d.num_accepted_tokens, d.num_draft_tokens),
    )
}

/// `part / whole` in percent; 0 when `whole` is 0.
fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(prompt: u64, generated: u64, hits: u64, queries: u64) -> EngineStats {
        let mut s = EngineStats {
            num_prompt_tokens: prompt,
            num_generation_tokens: generated,
            ..Default::default()
        };
        s.scheduler.num_running = 2;
        s.scheduler.num_waiting = 1;
        s.scheduler.kv_cache_usage = 0.125;
        s.scheduler.prefix_cache.hits = hits;
        s.scheduler.prefix_cache.queries = queries;
        s
    }

    #[test]
    fn an_interval_reports_its_rates_and_an_idle_engine_goes_quiet() {
        let mut logger = StatLogger::new([stats(100, 10, 0, 100)].into_iter());
        let secs = Duration::from_secs(10);
        // 500 prompt tokens (300 of them found cached) and 250 generated
        // in 10 s.
        let lines = logger.interval([stats(600, 260, 300, 600)].into_iter(), secs);
        assert_eq!(
            lines,
            [
                "Engine 000: Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: \
              25.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, \
              Prefix cache hit rate: 60.0%"
            ]
        );
        // The interval after the last busy one is logged once (the rates
        // fall to 0), then nothing while idle.
        let idle = logger.interval([stats(600, 260, 300, 600)].into_iter(), secs);
        assert_eq!(idle.len(), 1);
        assert!(
            idle[0].contains("Avg generation throughput: 0.0 tokens/s"),
            "{idle:?}"
        );
        assert!(idle[0].contains("Prefix cache hit rate: 0.0%"), "{idle:?}");
        assert!(logger
            .interval([stats(600, 260, 300, 600)].into_iter(), secs)
            .is_empty());
        // Each data-parallel rank has its own line.
        let two = [stats(600, 270, 300, 600), stats(0, 5, 0, 0)];
        let lines = logger.interval(two.into_iter(), secs);
        assert_eq!(lines.len(), 1, "rank 1's first interval starts now");
        let two = [stats(600, 270, 300, 600), stats(0, 25, 0, 0)];
        let lines = logger.interval(two.into_iter(), Duration::from_secs(4));
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[1].starts_with("Engine 001: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s"), "{lines:?}");
    }

    #[test]
    fn the_speculative_line_reports_what_the_interval_kept() {
        let spec = |drafts: u64, drafted: u64, per_pos: [u64; 3]| {
            let mut s = stats(0, drafts, 0, 0);
            s.scheduler.spec_decoding = SpecDecodingStats {
                num_drafts: drafts,
                num_draft_tokens: drafted,
                num_accepted_tokens: per_pos.iter().sum(),
                num_accepted_tokens_per_pos: per_pos.to_vec(),
            };
            s
        };
        let mut logger = StatLogger::new([spec(10, 30, [5, 3, 1])].into_iter());
        // 20 steps verified 60 drafts and kept 16 + 10 + 4 = 30 of them in
        // 5 s: 20 kept at position 0 of 20 steps is 0.8, and so on.
        let after = spec(30, 90, [21, 13, 5]);
        let lines = logger.interval([after].into_iter(), Duration::from_secs(5));
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(
            lines[1],
            "Engine 000: SpecDecoding metrics: Mean acceptance length: 2.50, Accepted \
             throughput: 6.00 tokens/s, Drafted throughput: 12.00 tokens/s, Accepted: 30 tokens, \
             Drafted: 60 tokens, Per-position acceptance rate: 0.800, 0.500, 0.200, \
             Avg Draft acceptance rate: 50.0%"
        );
        // No drafts in an interval: no speculative line.
        let lines = logger.interval(
            [spec(30, 90, [21, 13, 5])].into_iter(),
            Duration::from_secs(5),
        );
        assert_eq!(lines.len(), 1, "{lines:?}");
    }
}
