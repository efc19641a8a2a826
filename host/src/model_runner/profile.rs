//! Where a forward pass's time goes: wall time per operation, summed over
//! the steps run while profiling is on (`host bench --profile`). Off, the
//! runner only tests an `Option` per operation.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// The operations of a forward pass the profile times, in step order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Token embedding rows.
    Embed,
    /// RMSNorm before attention.
    AttnNorm,
    /// The fused Q/K/V projection.
    QkvProj,
    /// Rotary embedding of Q and K.
    Rope,
    /// Writing K/V into the paged cache.
    StoreKv,
    /// Paged attention.
    Attention,
    /// The attention output projection.
    OutProj,
    /// The tensor-parallel all-reduces (none on one rank).
    AllReduce,
    /// The residual additions.
    Residual,
    /// RMSNorm before the MLP.
    FfnNorm,
    /// The fused gate/up projection.
    GateUpProj,
    /// SwiGLU.
    SiluMul,
    /// The MLP down projection.
    DownProj,
    /// The final RMSNorm of each sequence's last token.
    FinalNorm,
    /// The output projection to the vocabulary.
    LmHead,
}

impl Op {
    /// Every operation, in step order.
    pub const ALL: [Op; 15] = [
        Op::Embed,
        Op::AttnNorm,
        Op::QkvProj,
        Op::Rope,
        Op::StoreKv,
        Op::Attention,
        Op::OutProj,
        Op::AllReduce,
        Op::Residual,
        Op::FfnNorm,
        Op::GateUpProj,
        Op::SiluMul,
        Op::DownProj,
        Op::FinalNorm,
        Op::LmHead,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embed",
            Op::AttnNorm => "attn_norm",
            Op::QkvProj => "qkv_proj",
            Op::Rope => "rope",
            Op::StoreKv => "store_kv",
            Op::Attention => "attention",
            Op::OutProj => "o_proj",
            Op::AllReduce => "all_reduce",
            Op::Residual => "residual_add",
            Op::FfnNorm => "ffn_norm",
            Op::GateUpProj => "gate_up_proj",
            Op::SiluMul => "silu_mul",
            Op::DownProj => "down_proj",
            Op::FinalNorm => "final_norm",
            Op::LmHead => "lm_head",
        }
    }

    /// Whether it runs as a parallel section of the thread pool (one
    /// fork-join per call).
    pub fn is_parallel_section(self) -> bool {
        matches!(
            self,
            Op::QkvProj | Op::Attention | Op::OutProj | Op::GateUpProj | Op::DownProj | Op::LmHead
        )
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Time and calls per [`Op`], summed over the profiled steps.
#[derive(Clone, Debug, Default)]
pub struct StepProfile {
    nanos: [Cell<u64>; Op::ALL.len()],
    calls: [Cell<u64>; Op::ALL.len()],
    steps: Cell<u64>,
}

impl StepProfile {
    /// The time spent in `op`.
    pub fn time(&self, op: Op) -> Duration {
        Duration::from_nanos(self.nanos[op.index()].get())
    }

    /// How many times `op` ran.
    pub fn calls(&self, op: Op) -> u64 {
        self.calls[op.index()].get()
    }

    /// Forward passes profiled.
    pub fn steps(&self) -> u64 {
        self.steps.get()
    }

    /// The time of every op together.
    pub fn total(&self) -> Duration {
        Op::ALL.iter().map(|&op| self.time(op)).sum()
    }

    pub(super) fn add(&self, op: Op, took: Duration) {
        let i = op.index();
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.nanos[i].set(self.nanos[i].get().saturating_add(nanos));
        self.calls[i].set(self.calls[i].get() + 1);
    }

    pub(super) fn count_step(&self) {
        self.steps.set(self.steps.get() + 1);
    }
}

/// A stopwatch over consecutive operations: each [`Laps::lap`] charges the
/// time since the previous one to an op. Does nothing without a profile.
pub(super) struct Laps<'a> {
    profile: Option<&'a StepProfile>,
    since: Option<Instant>,
}

impl<'a> Laps<'a> {
    /// Starts timing, if `profile` is on.
    pub fn start(profile: Option<&'a StepProfile>) -> Laps<'a> {
        Laps {
            profile,
            since: profile.map(|_| Instant::now()),
        }
    }

    /// Charges the time since the last lap to `op`.
    pub fn lap(&mut self, op: Op) {
        if let (Some(p), Some(since)) = (self.profile, self.since.as_mut()) {
            let now = Instant::now();
            p.add(op, now - *since);
            *since = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_charge_consecutive_time_to_each_op() {
        let profile = StepProfile::default();
        let mut laps = Laps::start(Some(&profile));
        std::thread::sleep(Duration::from_millis(20));
        laps.lap(Op::QkvProj);
        laps.lap(Op::Rope);
        std::thread::sleep(Duration::from_millis(10));
        laps.lap(Op::QkvProj);
        assert_eq!(profile.calls(Op::QkvProj), 2);
        assert_eq!(profile.calls(Op::Rope), 1);
        assert!(profile.time(Op::QkvProj) >= Duration::from_millis(30));
        assert!(profile.time(Op::Rope) < Duration::from_millis(10));
        assert_eq!(
            profile.total(),
            profile.time(Op::QkvProj) + profile.time(Op::Rope)
        );

        let mut off = Laps::start(None);
        off.lap(Op::Embed);
    }

    #[test]
    fn ops_are_listed_once_in_index_order() {
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(op.index(), i, "{op:?}");
        }
    }
}
