//! `engine:shortest-prompt-first`: admits the waiting request with the
//! shortest prompt first (shortest-job-first by the only length known at
//! admission), ties in arrival order; preempts the running request that has
//! computed the fewest tokens, so the least work is thrown away.
//!
//! Option `max_wait_s` (default 0 = off) bounds starvation: a request that
//! has waited longer than that relative to the newest arrival goes first.

use plugin_sdk::policy::{Metadata, RunningBatch, SchedulingPolicy, WaitingQueue};

/// The policy and its one option.
#[derive(Debug)]
pub struct ShortestPromptFirst {
    max_wait_s: f64,
}

impl SchedulingPolicy for ShortestPromptFirst {
    fn metadata() -> Metadata {
        Metadata::new("engine:shortest-prompt-first", env!("CARGO_PKG_VERSION")).option(
            "max_wait_s",
            "seconds a request may wait (relative to the newest arrival) before it is admitted first; 0 disables",
            "0",
        )
    }

    fn new(options: &str) -> Result<Self, String> {
        Ok(ShortestPromptFirst {
            max_wait_s: parse_max_wait(options)?,
        })
    }

    fn order_waiting(&mut self, q: &WaitingQueue) -> Vec<u32> {
        let newest = q
            .arrival_times
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        let starved =
            |i: usize| self.max_wait_s > 0.0 && newest - q.arrival_times[i] > self.max_wait_s;
        let mut order: Vec<u32> = (0..q.ids.len() as u32).collect();
        // Stable: equal keys keep arrival order.
        order.sort_by_key(|&i| (!starved(i as usize), q.prompt_lens[i as usize]));
        order
    }

    fn pick_victim(&mut self, r: &RunningBatch) -> Option<u32> {
        // The latest admitted among those with the least computed work.
        (0..r.ids.len() as u32)
            .rev()
            .min_by_key(|&i| r.num_computed_tokens[i as usize])
    }
}

/// Reads `max_wait_s` from the options object without a JSON dependency:
/// the only accepted forms are `{}` and `{"max_wait_s": <number>}`.
fn parse_max_wait(options: &str) -> Result<f64, String> {
    let body = options
        .trim()
        .trim_start_matches('{')
        .trim_end_matches('}')
        .trim();
    if body.is_empty() {
        return Ok(0.0);
    }
    let value = body
        .strip_prefix("\"max_wait_s\"")
        .and_then(|rest| rest.trim_start().strip_prefix(':'))
        .ok_or_else(|| format!("unknown options {options}; the only option is max_wait_s"))?;
    let v: f64 = value
        .trim()
        .parse()
        .map_err(|_| format!("max_wait_s must be a number, got {}", value.trim()))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("max_wait_s must be a finite number >= 0, got {v}"))
    }
}

plugin_sdk::export_policy!(ShortestPromptFirst);

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(lens: &[u32], arrivals: &[f64]) -> WaitingQueue {
        WaitingQueue {
            ids: (0..lens.len() as u32).collect(),
            prompt_lens: lens.to_vec(),
            priorities: vec![0; lens.len()],
            arrival_times: arrivals.to_vec(),
        }
    }

    #[test]
    fn shortest_first_ties_by_arrival() {
        let mut p = ShortestPromptFirst::new("{}").unwrap();
        assert_eq!(
            p.order_waiting(&queue(&[30, 5, 12, 5], &[0.0, 1.0, 2.0, 3.0])),
            vec![1, 3, 2, 0]
        );
    }

    #[test]
    fn starved_requests_go_first() {
        let mut p = ShortestPromptFirst::new(r#"{"max_wait_s": 10}"#).unwrap();
        assert_eq!(
            p.order_waiting(&queue(&[30, 5, 12], &[0.0, 11.0, 12.0])),
            vec![0, 1, 2]
        );
    }

    #[test]
    fn bad_options_are_named() {
        assert!(ShortestPromptFirst::new(r#"{"max_wait": 1}"#)
            .unwrap_err()
            .contains("max_wait_s"));
        assert!(ShortestPromptFirst::new(r#"{"max_wait_s": -1}"#)
            .unwrap_err()
            .contains(">= 0"));
    }

    #[test]
    fn victim_has_least_computed_work() {
        let r = RunningBatch {
            ids: vec![7, 8, 9],
            priorities: vec![0; 3],
            arrival_times: vec![0.0; 3],
            num_computed_tokens: vec![40, 3, 3],
        };
        assert_eq!(
            ShortestPromptFirst::new("{}").unwrap().pick_victim(&r),
            Some(2)
        );
    }
}
