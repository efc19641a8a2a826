//! `engine:priority`: vLLM's priority scheduling as a plugin. Admits waiting
//! requests by priority (a lower value is more important, vLLM's convention),
//! ties in arrival order; preempts the least important running request, the
//! latest arrival among equals. `builtin:priority` does the same natively;
//! this is its reference implementation against the WIT contract.

use plugin_sdk::policy::{Metadata, RunningBatch, SchedulingPolicy, WaitingQueue};

/// The policy; it has no options.
#[derive(Debug)]
pub struct Priority;

impl SchedulingPolicy for Priority {
    fn metadata() -> Metadata {
        Metadata::new("engine:priority", env!("CARGO_PKG_VERSION"))
    }

    fn new(options: &str) -> Result<Self, String> {
        match options.trim() {
            "" | "{}" => Ok(Priority),
            other => Err(format!("engine:priority takes no options, got {other}")),
        }
    }

    fn order_waiting(&mut self, q: &WaitingQueue) -> Vec<u32> {
        let mut order: Vec<u32> = (0..q.ids.len() as u32).collect();
        order.sort_by(|&a, &b| {
            let (a, b) = (a as usize, b as usize);
            q.priorities[a]
                .cmp(&q.priorities[b])
                .then(q.arrival_times[a].total_cmp(&q.arrival_times[b]))
        });
        order
    }

    fn pick_victim(&mut self, r: &RunningBatch) -> Option<u32> {
        (0..r.ids.len() as u32).max_by(|&a, &b| {
            let (a, b) = (a as usize, b as usize);
            r.priorities[a]
                .cmp(&r.priorities[b])
                .then(r.arrival_times[a].total_cmp(&r.arrival_times[b]))
        })
    }
}

plugin_sdk::export_policy!(Priority);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_important_first_ties_by_arrival() {
        let q = WaitingQueue {
            ids: vec![10, 11, 12, 13, 14],
            prompt_lens: vec![5; 5],
            priorities: vec![3, 1, 2, 0, 1],
            arrival_times: vec![0.0, 1.0, 2.0, 3.0, 0.5],
        };
        assert_eq!(Priority.order_waiting(&q), vec![3, 4, 1, 2, 0]);
    }

    #[test]
    fn victim_is_the_least_important_latest_arrival() {
        let r = RunningBatch {
            ids: vec![7, 8, 9, 10],
            priorities: vec![0, 2, 2, 1],
            arrival_times: vec![3.0, 1.0, 2.0, 4.0],
            num_computed_tokens: vec![10; 4],
        };
        assert_eq!(Priority.pick_victim(&r), Some(2));
    }

    #[test]
    fn options_are_refused() {
        assert!(Priority::new("{}").is_ok());
        assert!(Priority::new(r#"{"x": 1}"#)
            .unwrap_err()
            .contains("no options"));
    }
}
