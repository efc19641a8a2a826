//! The scheduling-policy seam: narrow, batch-level hooks called at most once
//! per step (ordering the waiting queue) or once per preemption (choosing a
//! victim), over columnar views. A later change plugs WebAssembly policies in
//! behind the same trait, so the views are plain slices that copy cheaply
//! across the boundary, and every answer is validated: an invalid one falls
//! back to FCFS for that call and is counted in the scheduler's stats.

use super::SchedulerError;

/// The waiting queue as columns; position `i` in every slice is the same
/// request, and positions are in arrival order (preempted requests first,
/// as vLLM's FCFS queue puts them back at the front).
#[derive(Debug, Clone, Copy)]
pub struct WaitingView<'a> {
    /// Request handles (`ReqHandle.0`).
    pub ids: &'a [u32],
    /// Prompt lengths in tokens.
    pub prompt_lens: &'a [u32],
    /// Priorities (lower value = served first, vLLM's convention).
    pub priorities: &'a [i32],
    /// Arrival times in the engine's seconds.
    pub arrival_times: &'a [f64],
}

impl WaitingView<'_> {
    /// Number of waiting requests.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// The running batch as columns, in running order (earliest admitted first).
#[derive(Debug, Clone, Copy)]
pub struct RunningView<'a> {
    /// Request handles (`ReqHandle.0`).
    pub ids: &'a [u32],
    /// Priorities (lower value = more important).
    pub priorities: &'a [i32],
    /// Arrival times in the engine's seconds.
    pub arrival_times: &'a [f64],
    /// Tokens already computed (what preempting would throw away).
    pub num_computed_tokens: &'a [u32],
}

impl RunningView<'_> {
    /// Number of running requests.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when nothing runs.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// A scheduling policy: decides admission order and preemption victims.
pub trait SchedulingPolicy: Send {
    /// The qualified name, e.g. `builtin:fcfs`.
    fn name(&self) -> &str;

    /// Writes into `out` (empty on entry) the positions in `view` to try to
    /// admit, in order. Positions left out are not admitted this step. Each
    /// position must be `< view.len()` and appear at most once.
    fn order_waiting(&mut self, view: &WaitingView<'_>, out: &mut Vec<u32>);

    /// The position in `view` (non-empty) of the request to preempt when KV
    /// blocks run out. It may be the request being scheduled, which then
    /// waits. `None` or an out-of-range position means "use FCFS" (the last).
    fn pick_victim(&mut self, view: &RunningView<'_>) -> Option<u32>;

    /// A fault the engine must not run on after (a plugin policy under
    /// `plugins.on_error = "fail"`), naming the plugin; the built-ins never
    /// fail.
    fn failure(&self) -> Option<&str> {
        None
    }

    /// Faults recovered from so far (a plugin policy's traps, overruns and
    /// errors, each answered by FCFS for that step); `None` for a policy
    /// that cannot fault, as the built-ins.
    fn faults(&self) -> Option<u64> {
        None
    }
}

/// First come, first served: admit in queue order, preempt the most recently
/// admitted request (vLLM's default).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fcfs;

impl SchedulingPolicy for Fcfs {
    fn name(&self) -> &str {
        "builtin:fcfs"
    }

    fn order_waiting(&mut self, view: &WaitingView<'_>, out: &mut Vec<u32>) {
        out.extend(0..view.len() as u32);
    }

    fn pick_victim(&mut self, view: &RunningView<'_>) -> Option<u32> {
        (view.len() as u32).checked_sub(1)
    }
}

/// Priority scheduling: admit by (priority, arrival time) ascending, preempt
/// the running request with the largest (priority, arrival time). Because
/// arrival time is the original one, a preempted request keeps its place
/// among later arrivals (vLLM bug #41951 does not arise).
#[derive(Debug, Clone, Default)]
pub struct Priority {
    /// Reused sort keys, so ordering allocates nothing per step.
    keys: Vec<u128>,
    /// The queue (handles) and order of the previous call: an overloaded
    /// engine sees the same queue for many steps, and a handle's priority
    /// and arrival never change, so the sort is skipped when it repeats.
    last_ids: Vec<u32>,
    last_order: Vec<u32>,
}

/// One integer whose order is (priority, arrival time, position): sorting
/// plain integers is several times faster than a three-way comparator.
fn priority_key(priority: i32, arrival: f64, pos: usize) -> u128 {
    let p = (priority as u32) ^ 0x8000_0000;
    let bits = arrival.to_bits();
    // IEEE-754 bits made monotonic: flip negatives, set the sign of positives.
    let a = if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    };
    (u128::from(p) << 96) | (u128::from(a) << 32) | pos as u128
}

impl SchedulingPolicy for Priority {
    fn name(&self) -> &str {
        "builtin:priority"
    }

    fn order_waiting(&mut self, view: &WaitingView<'_>, out: &mut Vec<u32>) {
        if view.ids == self.last_ids.as_slice() {
            out.extend_from_slice(&self.last_order);
            return;
        }
        self.keys.clear();
        let cols = view.priorities.iter().zip(view.arrival_times);
        self.keys
            .extend(cols.enumerate().map(|(i, (&p, &t))| priority_key(p, t, i)));
        self.keys.sort_unstable();
        out.extend(self.keys.iter().map(|&k| k as u32));
        self.last_ids.clear();
        self.last_ids.extend_from_slice(view.ids);
        self.last_order.clear();
        self.last_order.extend_from_slice(out);
    }

    fn pick_victim(&mut self, view: &RunningView<'_>) -> Option<u32> {
        let cols = view.priorities.iter().zip(view.arrival_times);
        cols.enumerate()
            .map(|(i, (&p, &t))| priority_key(p, t, i))
            .max()
            .map(|k| k as u32)
    }
}

/// The built-in policy names.
pub const BUILTIN_POLICIES: [&str; 2] = ["builtin:fcfs", "builtin:priority"];

/// Resolves a built-in policy by qualified name (vLLM's bare `fcfs` and
/// `priority` are accepted too).
pub fn builtin_policy(name: &str) -> Result<Box<dyn SchedulingPolicy>, SchedulerError> {
    match name {
        "builtin:fcfs" | "fcfs" => Ok(Box::new(Fcfs)),
        "builtin:priority" | "priority" => Ok(Box::<Priority>::default()),
        _ => Err(SchedulerError::UnknownPolicy {
            name: name.to_string(),
            known: BUILTIN_POLICIES.join(", "),
        }),
    }
}

/// True when `order` lists distinct positions below `n`. `seen` is scratch
/// space reused across calls.
pub(super) fn is_valid_order(order: &[u32], n: usize, seen: &mut Vec<bool>) -> bool {
    seen.clear();
    seen.resize(n, false);
    order.iter().all(|&p| {
        let p = p as usize;
        p < n && !std::mem::replace(&mut seen[p], true)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting<'a>(ids: &'a [u32], prio: &'a [i32], t: &'a [f64]) -> WaitingView<'a> {
        WaitingView {
            ids,
            prompt_lens: ids,
            priorities: prio,
            arrival_times: t,
        }
    }

    #[test]
    fn fcfs_keeps_queue_order_and_preempts_last() {
        let v = waiting(&[7, 3, 9], &[0, 0, 0], &[3.0, 1.0, 2.0]);
        let mut out = Vec::new();
        Fcfs.order_waiting(&v, &mut out);
        assert_eq!(out, vec![0, 1, 2]);
        let r = RunningView {
            ids: &[1, 2],
            priorities: &[0, 0],
            arrival_times: &[0.0, 1.0],
            num_computed_tokens: &[5, 5],
        };
        assert_eq!(Fcfs.pick_victim(&r), Some(1));
    }

    #[test]
    fn priority_orders_by_priority_then_arrival() {
        let v = waiting(&[10, 11, 12, 13], &[1, 0, 1, 0], &[0.0, 5.0, -1.0, 2.0]);
        let mut out = Vec::new();
        let mut p = Priority::default();
        p.order_waiting(&v, &mut out);
        assert_eq!(out, vec![3, 1, 2, 0]);
        // The same queue again reuses the order; a changed one is re-sorted.
        out.clear();
        p.order_waiting(&v, &mut out);
        assert_eq!(out, vec![3, 1, 2, 0]);
        let v2 = waiting(&[11, 12, 13], &[0, 1, 0], &[5.0, -1.0, 2.0]);
        out.clear();
        p.order_waiting(&v2, &mut out);
        assert_eq!(out, vec![2, 0, 1]);
        let r = RunningView {
            ids: &[1, 2, 3],
            priorities: &[0, 2, 2],
            arrival_times: &[9.0, 1.0, 0.5],
            num_computed_tokens: &[1, 1, 1],
        };
        assert_eq!(
            Priority::default().pick_victim(&r),
            Some(1),
            "worst priority, latest arrival"
        );
    }

    #[test]
    fn priority_keys_order_like_the_tuple_comparison() {
        let prios = [i32::MIN, -3, -1, 0, 1, 7, i32::MAX];
        let times = [f64::NEG_INFINITY, -2.5, -0.0, 0.0, 1e-300, 3.25, 1e300];
        let mut items = Vec::new();
        for (a, &p) in prios.iter().enumerate() {
            for (b, &t) in times.iter().enumerate() {
                items.push((p, t, a * times.len() + b));
            }
        }
        for x in &items {
            for y in &items {
                let expected = x.0.cmp(&y.0).then(x.1.total_cmp(&y.1)).then(x.2.cmp(&y.2));
                let got = priority_key(x.0, x.1, x.2).cmp(&priority_key(y.0, y.1, y.2));
                assert_eq!(got, expected, "{x:?} vs {y:?}");
            }
        }
    }

    #[test]
    fn builtin_names_resolve_and_unknown_lists_known() {
        assert_eq!(
            builtin_policy("builtin:fcfs").unwrap().name(),
            "builtin:fcfs"
        );
        assert_eq!(
            builtin_policy("priority").unwrap().name(),
            "builtin:priority"
        );
        let err = builtin_policy("builtin:lifo").err().unwrap().to_string();
        assert!(
            err.contains("builtin:lifo") && err.contains("builtin:fcfs, builtin:priority"),
            "{err}"
        );
    }

    #[test]
    fn order_validation_rejects_duplicates_and_out_of_range() {
        let mut seen = Vec::new();
        assert!(is_valid_order(&[2, 0], 3, &mut seen));
        assert!(is_valid_order(&[], 3, &mut seen));
        assert!(!is_valid_order(&[0, 0], 3, &mut seen));
        assert!(!is_valid_order(&[3], 3, &mut seen));
    }
}
