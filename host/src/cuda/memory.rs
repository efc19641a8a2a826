//! How much device memory the KV cache gets (vLLM's
//! `determine_available_memory`), as plain arithmetic over the snapshots the
//! GPU worker takes, so it is tested without a GPU.
//!
//! vLLM's rule: the engine may use `gpu_memory_utilization × total`; from that
//! it subtracts what the model needs outside the KV cache — the weights, the
//! activation peak measured by a profile run at `max_num_batched_tokens`, and
//! memory other allocations (cuBLAS workspaces, the CUDA context) took during
//! that run. An explicit `kv_cache_memory_bytes` replaces the rule.

use thiserror::Error;

/// Device memory as the driver reports it (`cuMemGetInfo`), in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// Free bytes.
    pub free: u64,
    /// Total bytes.
    pub total: u64,
}

impl MemorySnapshot {
    /// Bytes in use by anyone (this process and others).
    pub fn used(&self) -> u64 {
        self.total.saturating_sub(self.free)
    }
}

/// What the profile run measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryProfile {
    /// At `init_device`, before this worker allocated anything.
    pub before: MemorySnapshot,
    /// Bytes of the weights on the device.
    pub weights: u64,
    /// Bytes of the activation buffers. The runner allocates them once,
    /// for the largest step, and holds them, so `after` includes them.
    pub activation_peak: u64,
    /// After the profile run (its temporary KV cache freed again).
    pub after: MemorySnapshot,
}

/// How the KV-cache budget is set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBudget {
    /// A fraction of the device's total memory for the whole engine.
    Utilization(f64),
    /// Exactly this many bytes for the KV cache.
    Bytes(u64),
}

/// Why no KV cache fits.
#[derive(Debug, Error, PartialEq)]
pub enum MemoryError {
    /// The utilization is not in (0, 1].
    #[error("gpu_memory_utilization = {0} must be in (0, 1]")]
    BadUtilization(f64),
    /// Other processes already use more than the engine may leave them.
    #[error(
        "free device memory at start-up ({free_gib:.2} GiB) is less than the requested \
         gpu_memory_utilization ({utilization}) of {total_gib:.2} GiB; lower \
         gpu_memory_utilization or free the device"
    )]
    NotEnoughFree {
        /// Free GiB at init.
        free_gib: f64,
        /// The requested fraction.
        utilization: f64,
        /// Total GiB.
        total_gib: f64,
    },
    /// The model alone needs more than the budget.
    #[error(
        "the model needs {needed_gib:.2} GiB outside the KV cache (weights {weights_gib:.2}, \
         activation peak {activation_gib:.2}, other {other_gib:.2}) but the budget is \
         {budget_gib:.2} GiB; raise gpu_memory_utilization or lower max_num_batched_tokens"
    )]
    ModelTooLarge {
        /// Everything outside the KV cache.
        needed_gib: f64,
        /// Weights.
        weights_gib: f64,
        /// Activation peak.
        activation_gib: f64,
        /// Other allocations during the profile run.
        other_gib: f64,
        /// The budget.
        budget_gib: f64,
    },
}

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes available for the KV cache.
pub fn available_kv_cache_memory(
    budget: KvBudget,
    profile: &MemoryProfile,
) -> Result<u64, MemoryError> {
    let utilization = match budget {
        KvBudget::Bytes(bytes) => return Ok(bytes),
        KvBudget::Utilization(u) if u > 0.0 && u <= 1.0 => u,
        KvBudget::Utilization(u) => return Err(MemoryError::BadUtilization(u)),
    };
    let total = profile.before.total;
    let requested = (total as f64 * utilization) as u64;
    if profile.before.free < requested {
        return Err(MemoryError::NotEnoughFree {
            free_gib: profile.before.free as f64 / GIB,
            utilization,
            total_gib: total as f64 / GIB,
        });
    }
    // What this worker holds after the profile run beyond its weights and
    // activation buffers: memory the run made others take (cuBLAS's
    // workspaces, the driver's lazily loaded modules).
    let grown = profile.after.used().saturating_sub(profile.before.used());
    let other = grown.saturating_sub(profile.weights + profile.activation_peak);
    let needed = profile.weights + profile.activation_peak + other;
    requested
        .checked_sub(needed)
        .filter(|&left| left > 0)
        .ok_or(MemoryError::ModelTooLarge {
            needed_gib: needed as f64 / GIB,
            weights_gib: profile.weights as f64 / GIB,
            activation_gib: profile.activation_peak as f64 / GIB,
            other_gib: other as f64 / GIB,
            budget_gib: requested as f64 / GIB,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    fn profile() -> MemoryProfile {
        // An H200-sized device with 1 GiB used by another process, 16 GiB of
        // weights, a 3 GiB activation peak and 0.5 GiB of context/workspace.
        MemoryProfile {
            before: MemorySnapshot {
                free: 140 * G,
                total: 141 * G,
            },
            weights: 16 * G,
            activation_peak: 3 * G,
            after: MemorySnapshot {
                free: 140 * G - 16 * G - 3 * G - G / 2,
                total: 141 * G,
            },
        }
    }

    #[test]
    fn utilization_leaves_the_rest_after_weights_activations_and_workspace() {
        let got = available_kv_cache_memory(KvBudget::Utilization(0.9), &profile()).unwrap();
        // 0.9 × 141 GiB = 126.9 GiB, minus 16 + 3 + 0.5 GiB.
        let want = (141.0 * 0.9 * GIB) as u64 - (16 * G + 3 * G + G / 2);
        assert_eq!(got, want);
    }

    #[test]
    fn explicit_bytes_are_returned_as_is() {
        let got = available_kv_cache_memory(KvBudget::Bytes(5 * G), &profile()).unwrap();
        assert_eq!(got, 5 * G);
    }

    #[test]
    fn refusals_name_the_knob_to_turn() {
        let e = available_kv_cache_memory(KvBudget::Utilization(1.5), &profile()).unwrap_err();
        assert!(e.to_string().contains("(0, 1]"), "{e}");
        // 140 free of 141: asking for all of it cannot be met.
        let e = available_kv_cache_memory(KvBudget::Utilization(1.0), &profile()).unwrap_err();
        assert!(
            e.to_string().contains("lower gpu_memory_utilization"),
            "{e}"
        );
        // A budget of 0.1 × 141 = 14.1 GiB cannot hold 16 GiB of weights.
        let e = available_kv_cache_memory(KvBudget::Utilization(0.1), &profile()).unwrap_err();
        assert!(matches!(e, MemoryError::ModelTooLarge { .. }), "{e}");
        assert!(
            e.to_string().contains("raise gpu_memory_utilization"),
            "{e}"
        );
    }
}
