//! Between steps: `sleep` frees device memory while the engine idles,
//! `wake_up` brings it back, `update_weights` changes named tensors (vLLM's
//! sleep mode and weight updates, as RLHF trainers drive them: sleep →
//! wake_up(weights) → update_weights → wake_up(kv_cache)).
//!
//! - Level 1 offloads the weights to host memory and drops the KV cache.
//! - Level 2 drops the prepared weights too. Unlike vLLM, waking from level
//!   2 prepares them again from the worker's own copy (the model file, plus
//!   every `update_weights` so far), so nothing has to be reloaded by hand.
//!
//! The KV cache comes back empty, so the engine forgets its cached prefixes
//! when it puts the workers to sleep.

use super::registry::Handler;
use super::{host_api, Worker, WorkerError};
use crate::step::RpcValue;

/// How deeply a worker sleeps (vLLM's `sleep(level)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepLevel {
    /// Weights offloaded to host memory, KV cache dropped.
    One,
    /// Weights and KV cache dropped.
    Two,
}

impl SleepLevel {
    /// Level 1 or 2; anything else is an error naming both.
    pub fn from_number(level: u64) -> Result<SleepLevel, WorkerError> {
        match level {
            1 => Ok(SleepLevel::One),
            2 => Ok(SleepLevel::Two),
            other => Err(WorkerError::Config(format!(
                "sleep level {other} does not exist; use 1 (offload the weights, drop the KV cache) \
                 or 2 (drop both)"
            ))),
        }
    }
}

/// What `wake_up` wakes (vLLM's tags); both when no tag is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WakeTags {
    /// The weights (`"weights"`).
    pub weights: bool,
    /// The KV cache (`"kv_cache"`).
    pub kv_cache: bool,
}

impl WakeTags {
    /// Everything.
    pub const ALL: WakeTags = WakeTags {
        weights: true,
        kv_cache: true,
    };

    /// Tags by name; an empty list means all, an unknown tag is an error
    /// naming the known ones.
    pub fn parse<S: AsRef<str>>(tags: &[S]) -> Result<WakeTags, WorkerError> {
        if tags.is_empty() {
            return Ok(WakeTags::ALL);
        }
        let mut out = WakeTags {
            weights: false,
            kv_cache: false,
        };
        for tag in tags {
            match tag.as_ref() {
                "weights" => out.weights = true,
                "kv_cache" => out.kv_cache = true,
                other => {
                    return Err(WorkerError::Config(format!(
                        "wake_up tag `{other}` is unknown; known tags: weights, kv_cache"
                    )))
                }
            }
        }
        Ok(out)
    }
}

/// What sleeps now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Asleep {
    /// The level it was put to sleep at.
    level: SleepLevel,
    /// Whether the weights still sleep.
    weights: bool,
    /// Whether the KV cache still sleeps.
    kv_cache: bool,
}

impl Asleep {
    /// What sleeps, for errors: `weights`, `kv_cache` or both.
    pub(super) fn what(&self) -> String {
        match (self.weights, self.kv_cache) {
            (true, true) => "weights and kv_cache".into(),
            (true, false) => "weights".into(),
            _ => "kv_cache".into(),
        }
    }
}

impl Worker {
    /// Frees device memory until [`Worker::wake_up`]: the KV cache always,
    /// and the weights (to host memory at level 1, dropped at level 2).
    /// Steps are refused while anything sleeps. Needs an empty batch: the
    /// engine sleeps only when no request is unfinished.
    pub fn sleep(&mut self, level: SleepLevel) -> Result<(), WorkerError> {
        if self.asleep.is_some() {
            return Err(WorkerError::Config(
                "sleep: the worker already sleeps; call wake_up first".into(),
            ));
        }
        if self.num_blocks == 0 {
            return Err(WorkerError::OutOfOrder {
                called: "sleep",
                missing: "initialize_from_config",
            });
        }
        if !self.input_batch.is_empty() {
            return Err(WorkerError::Config(format!(
                "sleep: {} requests are still in the batch; finish or abort them first",
                self.input_batch.len()
            )));
        }
        let runner = self.runner_mut("sleep")?;
        runner.free_kv_cache();
        match level {
            SleepLevel::One => runner.offload_weights()?,
            SleepLevel::Two => self.runner = None,
        }
        self.pending = None;
        self.asleep = Some(Asleep {
            level,
            weights: true,
            kv_cache: true,
        });
        tracing::info!(?level, "worker: asleep");
        Ok(())
    }

    /// Wakes what `tags` names; the weights first, since a KV cache needs
    /// a runner (its CUDA graphs are captured again). Waking what is awake
    /// does nothing.
    pub fn wake_up(&mut self, tags: WakeTags) -> Result<(), WorkerError> {
        let Some(mut asleep) = self.asleep else {
            return Ok(());
        };
        if tags.weights && asleep.weights {
            match asleep.level {
                SleepLevel::One => self.runner_mut("wake_up")?.restore_weights()?,
                SleepLevel::Two => {
                    let weights = self.weights.as_ref().ok_or(WorkerError::OutOfOrder {
                        called: "wake_up",
                        missing: "load_model",
                    })?;
                    self.runner = Some(self.prepare_runner(weights)?);
                }
            }
            asleep.weights = false;
        }
        if tags.kv_cache && asleep.kv_cache {
            if asleep.weights {
                return Err(WorkerError::Config(
                    "wake_up: the KV cache needs the weights awake; wake `weights` first (or both)"
                        .into(),
                ));
            }
            let num_blocks = self.num_blocks;
            let runner = self.runner_mut("wake_up")?;
            runner.initialize_kv_cache(num_blocks)?;
            runner.warm_up()?;
            asleep.kv_cache = false;
        }
        self.asleep = (asleep.weights || asleep.kv_cache).then_some(asleep);
        tracing::info!(asleep = ?self.asleep, "worker: woke up");
        Ok(())
    }

    /// Whether anything sleeps.
    pub fn is_sleeping(&self) -> bool {
        self.asleep.is_some()
    }

    /// Replaces named tensors with new values, each given in full as f32
    /// (re-quantized to the tensor's own type), and prepares again what
    /// reads them; the next step uses them. Every name, size and value is
    /// checked before anything changes. Needs the weights awake.
    pub fn update_weights(&mut self, updates: &[(String, Vec<f32>)]) -> Result<(), WorkerError> {
        if self.asleep.is_some_and(|a| a.weights) {
            return Err(WorkerError::Asleep {
                called: "update_weights",
                what: "weights".into(),
            });
        }
        let (Some(weights), Some(runner)) = (self.weights.as_mut(), self.runner.as_deref_mut())
        else {
            return Err(WorkerError::OutOfOrder {
                called: "update_weights",
                missing: "load_model",
            });
        };
        for (name, values) in updates {
            host_api::check_update(weights, name, values).map_err(WorkerError::UpdateWeights)?;
        }
        for (name, values) in updates {
            host_api::update_weight(weights, runner, name, values)
                .map_err(WorkerError::UpdateWeights)?;
        }
        Ok(())
    }

    /// Refuses a step while anything sleeps.
    pub(super) fn check_awake(&self, called: &'static str) -> Result<(), WorkerError> {
        match &self.asleep {
            Some(a) => Err(WorkerError::Asleep {
                called,
                what: a.what(),
            }),
            None => Ok(()),
        }
    }
}

/// The worker methods of this module, for the registry: `sleep` (a level,
/// default 1), `wake_up` (a list of tags, default all), `is_sleeping`, and
/// `update_weights` (a JSON object of name → every value, row-major).
pub(super) fn methods() -> Vec<(&'static str, Handler)> {
    vec![
        (
            "sleep",
            Box::new(|w, a| {
                let level = match a {
                    RpcValue::Unit => 1,
                    RpcValue::Count(n) => n,
                    RpcValue::Json(text) => serde_json::from_str::<u64>(&text).map_err(|_| {
                        anyhow::anyhow!("sleep expects a level, 1 or 2; got {text}")
                    })?,
                    other => anyhow::bail!("sleep expects a level, 1 or 2; got {}", other.kind()),
                };
                w.sleep(SleepLevel::from_number(level)?)?;
                Ok(RpcValue::Unit)
            }),
        ),
        (
            "wake_up",
            Box::new(|w, a| {
                let tags: Vec<String> = match a {
                    RpcValue::Unit => Vec::new(),
                    RpcValue::Json(text) => serde_json::from_str::<Option<Vec<String>>>(&text)
                        .map_err(|_| {
                            anyhow::anyhow!(
                                "wake_up expects a list of tags, e.g. [\"weights\"]; got {text}"
                            )
                        })?
                        .unwrap_or_default(),
                    other => anyhow::bail!("wake_up expects a list of tags, got {}", other.kind()),
                };
                w.wake_up(WakeTags::parse(&tags)?)?;
                Ok(RpcValue::Unit)
            }),
        ),
        (
            "is_sleeping",
            Box::new(|w, a| match a {
                RpcValue::Unit => Ok(RpcValue::Json(w.is_sleeping().to_string())),
                other => anyhow::bail!("is_sleeping takes no argument, got {}", other.kind()),
            }),
        ),
        (
            "update_weights",
            Box::new(|w, a| {
                let RpcValue::Json(text) = a else {
                    anyhow::bail!(
                        "update_weights expects a JSON object of name -> values, got {}",
                        a.kind()
                    );
                };
                let updates: std::collections::BTreeMap<String, Vec<f32>> =
                    serde_json::from_str(&text).map_err(|e| {
                        anyhow::anyhow!(
                        "update_weights expects a JSON object of name -> list of finite numbers \
                             (JSON has no NaN or infinity): {e}"
                    )
                    })?;
                let updates: Vec<(String, Vec<f32>)> = updates.into_iter().collect();
                w.update_weights(&updates)?;
                Ok(RpcValue::Unit)
            }),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_tags_name_what_exists() {
        assert_eq!(SleepLevel::from_number(1).unwrap(), SleepLevel::One);
        assert_eq!(SleepLevel::from_number(2).unwrap(), SleepLevel::Two);
        let e = SleepLevel::from_number(3).unwrap_err().to_string();
        assert!(e.contains("level 3") && e.contains("use 1"), "{e}");
        assert_eq!(WakeTags::parse::<&str>(&[]).unwrap(), WakeTags::ALL);
        let w = WakeTags::parse(&["weights"]).unwrap();
        assert!(w.weights && !w.kv_cache);
        let e = WakeTags::parse(&["weights", "kv"]).unwrap_err().to_string();
        assert!(e.contains("`kv`") && e.contains("weights, kv_cache"), "{e}");
    }

    #[test]
    fn sleep_needs_a_kv_cache() {
        let mut w = Worker::new(super::super::WorkerConfig::for_unit_tests()).unwrap();
        let e = w.sleep(SleepLevel::One).unwrap_err().to_string();
        assert!(e.contains("needs initialize_from_config"), "{e}");
        // Nothing sleeps: waking is a no-op.
        w.wake_up(WakeTags::ALL).unwrap();
        assert!(!w.is_sleeping());
    }
}
