//! `{{name}}`: a scheduling policy for the `host` engine.
//!
//! Once per engine step the host hands the policy its waiting queue as
//! parallel columns (position `i` of every list is the same request) and
//! asks in which order to try to admit them; when KV-cache blocks run out
//! it asks which running request to preempt. This one serves the newest
//! request first (last come, first served) and preempts the request that
//! has computed the fewest tokens, so the least work is thrown away.
//!
//! Build: `host plugin build` (or `cargo build --release --target
//! wasm32-wasip2`). Load: `host --plugin <the .wasm it prints> generate
//! --prompt "Hello"` (`scheduler.policy = "auto"` picks the one policy given
//! by `--plugin`).

use plugin_sdk::policy::{Metadata, RunningBatch, SchedulingPolicy, WaitingQueue};

/// The policy. One value lives per plugin instance; the host calls it from
/// one thread, once per step.
pub struct Policy {
    /// Steps seen, to show state kept across calls.
    steps: u64,
}

impl SchedulingPolicy for Policy {
    /// The qualified name the configuration refers to
    /// (`scheduler.policy = "{{name}}"`), the plugin's own version, and the
    /// options it accepts (shown by `host plugin inspect`).
    fn metadata() -> Metadata {
        Metadata::new("{{name}}", env!("CARGO_PKG_VERSION"))
    }

    /// Called once per instance with the options JSON object from
    /// `[plugins.options."{{name}}"]` (`{}` when none). An error refuses
    /// the configuration and the engine does not start, naming the plugin.
    fn new(options: &str) -> Result<Self, String> {
        let options: serde_json::Value =
            serde_json::from_str(options).map_err(|e| format!("options are not JSON: {e}"))?;
        if options.as_object().is_some_and(|o| !o.is_empty()) {
            return Err(format!("{{name}} takes no options, got {options}"));
        }
        // Goes to the host's log as `INFO plugin: {{name}}: started: ...` (shown
        // with RUST_LOG=warn,plugin=info); `println!` works too.
        plugin_sdk::info!("started: newest request first");
        Ok(Policy { steps: 0 })
    }

    /// Positions in `queue` to try to admit, in order; positions left out
    /// wait this step. Each must be below `queue.ids.len()` and appear once,
    /// or the host falls back to first come, first served for the step.
    fn order_waiting(&mut self, queue: &WaitingQueue) -> Vec<u32> {
        self.steps += 1;
        (0..queue.ids.len() as u32).rev().collect()
    }

    /// The position in `running` (never empty) of the request to preempt;
    /// `None` lets the host preempt the most recently admitted one.
    fn pick_victim(&mut self, running: &RunningBatch) -> Option<u32> {
        (0..running.ids.len() as u32).min_by_key(|&i| running.num_computed_tokens[i as usize])
    }
}

// Exports `Policy` as the component's `engine:plugins/scheduling-policy`.
plugin_sdk::export_policy!(Policy);

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(n: u32) -> WaitingQueue {
        WaitingQueue {
            ids: (100..100 + n).collect(),
            prompt_lens: vec![10; n as usize],
            priorities: vec![0; n as usize],
            arrival_times: (0..n).map(f64::from).collect(),
        }
    }

    #[test]
    fn newest_first() {
        let mut p = Policy::new("{}").unwrap();
        assert_eq!(p.order_waiting(&queue(4)), [3, 2, 1, 0]);
        assert!(p.order_waiting(&queue(0)).is_empty());
    }

    #[test]
    fn preempts_the_least_computed() {
        let running = RunningBatch {
            ids: vec![7, 8, 9],
            priorities: vec![0; 3],
            arrival_times: vec![0.0; 3],
            num_computed_tokens: vec![50, 3, 20],
        };
        assert_eq!(Policy::new("{}").unwrap().pick_victim(&running), Some(1));
    }

    #[test]
    fn options_are_refused() {
        assert!(Policy::new(r#"{"x": 1}"#).is_err());
        assert!(Policy::new("not json").is_err());
    }
}
