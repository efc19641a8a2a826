//! `host bench --profile`: where a prefill's and a decoded token's time
//! goes. Runs each test once more with the runner timing every operation
//! of the forward pass, and measures the thread pool's fork-join alone (an
//! empty parallel section), to say what the synchronisation costs per
//! token besides the work.

use std::time::{Duration, Instant};

use anyhow::bail;

use super::bench::Tests;
use crate::kernels::{ThreadPool, SPIN_WINDOW};
use crate::model_runner::{Op, StepProfile};
use crate::worker::Worker;

/// Empty parallel sections timed for the fork-join cost.
const EMPTY_SECTIONS: u32 = 20_000;

/// Profiles one prefill and one decode run and prints the table.
pub(super) fn run(worker: &mut Worker, tests: &Tests<'_>, threads: usize) -> anyhow::Result<()> {
    if !worker.set_profiling(true)? {
        bail!("--profile: this device's runner does not time its operations (only the CPU's does)");
    }
    let pp_wall = Duration::from_secs_f64(tests.prompt_tokens as f64 / tests.prefill(worker)?);
    let pp = take(worker)?;
    let tg_wall = Duration::from_secs_f64(tests.gen_tokens as f64 / tests.decode(worker)?);
    let tg = take(worker)?;
    worker.set_profiling(false)?;
    let fork_join = empty_section(threads);

    let per_token = |d: Duration| d.as_secs_f64() * 1e6 / tests.gen_tokens as f64;
    let share = |d: Duration, of: Duration| 100.0 * d.as_secs_f64() / of.as_secs_f64();
    let (pp_name, tg_name) = (
        tests.name("pp", tests.prompt_tokens),
        tests.name("tg", tests.gen_tokens),
    );
    println!();
    println!("where the time goes ({pp_name}: one step; {tg_name}: µs per decoded token):");
    println!("| op | {pp_name} ms | % | {tg_name} µs/token | % | parallel sections/token |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for op in Op::ALL {
        if tg.calls(op) == 0 && pp.calls(op) == 0 {
            continue;
        }
        let sections = if op.is_parallel_section() {
            format!("{:.0}", tg.calls(op) as f64 / tests.gen_tokens as f64)
        } else {
            String::new()
        };
        println!(
            "| {} | {:.2} | {:.1} | {:.1} | {:.1} | {sections} |",
            op.name(),
            pp.time(op).as_secs_f64() * 1e3,
            share(pp.time(op), pp_wall),
            per_token(tg.time(op)),
            share(tg.time(op), tg_wall),
        );
    }
    for (what, pp_d, tg_d) in [
        ("all ops", pp.total(), tg.total()),
        (
            "outside ops",
            pp_wall.saturating_sub(pp.total()),
            tg_wall.saturating_sub(tg.total()),
        ),
        ("wall", pp_wall, tg_wall),
    ] {
        println!(
            "| {what} | {:.2} | {:.1} | {:.1} | {:.1} | |",
            pp_d.as_secs_f64() * 1e3,
            share(pp_d, pp_wall),
            per_token(tg_d),
            share(tg_d, tg_wall),
        );
    }
    let sections: u64 = Op::ALL
        .iter()
        .filter(|op| op.is_parallel_section())
        .map(|&op| tg.calls(op))
        .sum();
    let per_token_sections = sections as f64 / tests.gen_tokens as f64;
    let sync_us = per_token_sections * fork_join.as_secs_f64() * 1e6;
    println!(
        "\nthread pool: an empty parallel section on {threads} threads takes {:.2} µs (mean of \
         {EMPTY_SECTIONS}); decode runs {per_token_sections:.0} sections per token, so fork-join \
         alone is ≈ {sync_us:.0} µs ({:.1}% of a token's {:.0} µs)",
        fork_join.as_secs_f64() * 1e6,
        100.0 * sync_us / per_token(tg_wall),
        per_token(tg_wall),
    );
    Ok(())
}

/// The profile so far, with profiling restarted from zero.
fn take(worker: &mut Worker) -> anyhow::Result<StepProfile> {
    let profile = worker.profile().cloned().unwrap_or_default();
    worker.set_profiling(true)?;
    Ok(profile)
}

/// The mean time of an empty parallel section on a pool of `threads`.
///
/// Measured once the runner's own pool has parked: its workers spin for
/// [`SPIN_WINDOW`] after the last step, and on a machine with as many cores
/// as threads they would share the cores with this pool's and inflate the
/// figure several times over (1.27 µs against 0.26 µs on 2 vCPUs).
fn empty_section(threads: usize) -> Duration {
    std::thread::sleep(3 * SPIN_WINDOW);
    let pool = ThreadPool::new(threads);
    for _ in 0..1000 {
        pool.run(|_, _| {});
    }
    let t = Instant::now();
    for _ in 0..EMPTY_SECTIONS {
        pool.run(|_, _| {});
    }
    t.elapsed() / EMPTY_SECTIONS
}
