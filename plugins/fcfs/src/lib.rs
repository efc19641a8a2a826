//! `engine:fcfs`: first come, first served, as a plugin. The reference
//! policy: the built-in `builtin:fcfs` does the same, so the two are
//! compared by the benchmark and must schedule identically.

use plugin_sdk::policy::{Metadata, SchedulingPolicy, WaitingQueue};

/// Admits in queue order; lets the host preempt the latest admitted.
pub struct Fcfs;

impl SchedulingPolicy for Fcfs {
    fn metadata() -> Metadata {
        Metadata::new("engine:fcfs", env!("CARGO_PKG_VERSION"))
    }

    fn new(_options: &str) -> Result<Self, String> {
        Ok(Fcfs)
    }

    fn order_waiting(&mut self, queue: &WaitingQueue) -> Vec<u32> {
        (0..queue.ids.len() as u32).collect()
    }
}

plugin_sdk::export_policy!(Fcfs);
