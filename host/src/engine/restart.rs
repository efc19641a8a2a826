//! The restart budget: how many times something that died (the worker
//! group, the engine-core process) is replaced before the engine gives up.
//! A restart is allowed while fewer than `engine.max_restarts` happened
//! within the last `engine.restart_window_s`, so a rare fault is survived
//! forever while a crash loop spends the budget within seconds.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::config::RestartConfig;

/// The restarts taken within the sliding window.
#[derive(Debug)]
pub struct RestartBudget {
    max: u32,
    window: Duration,
    taken: VecDeque<Instant>,
}

impl RestartBudget {
    /// A full budget for `config`.
    pub fn new(config: &RestartConfig) -> RestartBudget {
        RestartBudget {
            max: config.max_restarts,
            window: Duration::try_from_secs_f64(config.restart_window_s).unwrap_or(Duration::MAX),
            taken: VecDeque::new(),
        }
    }

    /// Takes one restart at `now`: its number within the window (from 1),
    /// or, when the budget is spent, why not, naming the keys to change.
    pub fn take(&mut self, now: Instant) -> Result<u32, String> {
        while let Some(&first) = self.taken.front() {
            if now.saturating_duration_since(first) < self.window {
                break;
            }
            self.taken.pop_front();
        }
        if self.taken.len() >= self.max as usize {
            return Err(format!(
                "not restarted: {} restarts within the last {} s already \
                 (engine.max_restarts = {}, engine.restart_window_s = {})",
                self.taken.len(),
                self.window.as_secs_f64(),
                self.max,
                self.window.as_secs_f64()
            ));
        }
        self.taken.push_back(now);
        Ok(self.taken.len() as u32)
    }

    /// Restarts allowed within one window.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// The window's length.
    pub fn window(&self) -> Duration {
        self.window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(max: u32, window_s: f64) -> RestartBudget {
        RestartBudget::new(&RestartConfig {
            max_restarts: max,
            restart_window_s: window_s,
        })
    }

    #[test]
    fn the_budget_slides_with_the_window() {
        let mut b = budget(2, 10.0);
        let t0 = Instant::now();
        assert_eq!(b.take(t0), Ok(1));
        assert_eq!(b.take(t0 + Duration::from_secs(1)), Ok(2));
        let spent = b.take(t0 + Duration::from_secs(2)).unwrap_err();
        assert!(spent.contains("engine.max_restarts = 2"), "{spent}");
        // The first restart leaves the window at 10 s: one more is allowed,
        // and the refused attempt took nothing.
        assert_eq!(b.take(t0 + Duration::from_secs(10)), Ok(2));
        assert!(b.take(t0 + Duration::from_secs(10)).is_err());
    }

    #[test]
    fn zero_restarts_is_vllm_behaviour() {
        assert!(budget(0, 300.0).take(Instant::now()).is_err());
    }
}
