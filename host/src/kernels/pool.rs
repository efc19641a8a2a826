//! A fork-join thread pool tuned for many tiny parallel sections.
//!
//! A decode step runs ~210 matmuls of a few microseconds each, and on the
//! VMs we target waking a sleeping thread costs ~40 µs (an inter-processor
//! interrupt). So workers *spin* on an epoch counter while work is flowing —
//! always with `spin_loop` hints and periodic `yield_now`, so that other
//! runnable threads on a 2-core machine still get time — and only *park*
//! (a futex sleep) after [`SPIN_WINDOW`] without work, so an idle process
//! uses ~0% CPU.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::OutPtr;

/// How long a worker keeps spinning for new work before it parks.
///
/// Between the matmuls of one forward pass the gap is microseconds, and
/// between decode steps (sampling, scheduling, queue hops) well under a
/// millisecond, so a few milliseconds keeps workers hot for a running engine
/// while an idle one falls asleep almost at once.
pub const SPIN_WINDOW: Duration = Duration::from_millis(4);

/// Spin iterations between two `yield_now` calls (and clock reads).
const SPINS_PER_YIELD: u32 = 64;

/// The job of a parallel section: a closure borrowed by [`ThreadPool::run`].
type Job<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// State shared between the caller and the workers.
struct Shared {
    /// Incremented once per parallel section; workers wait for it to change.
    epoch: AtomicU64,
    /// Workers that have not finished the current section.
    pending: AtomicUsize,
    /// Points at the current section's [`Job`] on the stack of `run`; only
    /// dereferenced between the epoch bump and `pending` reaching zero, while
    /// `run` is still waiting and so keeps it alive.
    job: AtomicPtr<()>,
    /// Workers currently parked (or about to park).
    sleepers: AtomicUsize,
    /// Set once, on drop.
    shutdown: AtomicBool,
    /// The first panic payload raised by a worker in the current section.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// A pool of `num_threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    /// State shared with the workers.
    shared: Arc<Shared>,
    /// Worker handles, for unparking and joining.
    workers: Vec<JoinHandle<()>>,
    /// Serialises `run` calls made from several threads.
    run_lock: Mutex<()>,
}

impl ThreadPool {
    /// Starts a pool of `num_threads` threads, counting the caller (so
    /// `num_threads - 1` workers are spawned; 0 is treated as 1).
    pub fn new(num_threads: usize) -> ThreadPool {
        let num_threads = num_threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            panic: Mutex::new(None),
        });
        let workers = (1..num_threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("kernel-pool-{index}"))
                    .spawn(move || worker_loop(&shared, index, num_threads))
                    .expect("spawning a kernel pool thread (out of threads or memory)")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            run_lock: Mutex::new(()),
        }
    }

    /// Number of threads that execute a parallel section, the caller included.
    pub fn num_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(thread_index, num_threads)` on every thread (the caller is
    /// thread 0) and returns when all calls have returned.
    ///
    /// A panic in any call is re-raised here after every thread has finished.
    /// Calls from several threads are serialised; calling `run` from inside
    /// a section of the same pool deadlocks, so `f` must not do that.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, f: F) {
        let n = self.num_threads();
        if n == 1 {
            f(0, 1);
            return;
        }
        let _serial = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        *self.shared.panic.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let job: Job<'_> = &f;
        self.shared
            .job
            .store(&job as *const Job<'_> as *mut (), Ordering::Relaxed);
        self.shared.pending.store(n - 1, Ordering::Release);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        if self.shared.sleepers.load(Ordering::SeqCst) > 0 {
            for w in &self.workers {
                w.thread().unpark();
            }
        }
        // The guard waits for the workers even if `f` panics here, so `job`
        // outlives every use of it.
        let guard = WaitGuard(&self.shared);
        f(0, n);
        drop(guard);
        if let Some(payload) = self
            .shared
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            panic::resume_unwind(payload);
        }
    }

    /// Calls `f(t, row)` for every `width`-wide row `t` of `out`. Once `out`
    /// holds `ROWS_PARALLEL_MIN_VALUES` (16K) values or more, the rows are split
    /// between the threads in contiguous runs, one section; fewer run on
    /// the calling thread alone, where a fork-join would cost what they do.
    ///
    /// Panics if `out` is not whole rows (a caller bug), or as [`run`](Self::run).
    pub fn for_each_row<F: Fn(usize, &mut [f32]) + Sync>(
        &self,
        out: &mut [f32],
        width: usize,
        f: F,
    ) {
        assert!(
            width > 0 && out.len().is_multiple_of(width),
            "for_each_row: {} values are not rows of {width}",
            out.len()
        );
        let rows = out.len() / width;
        if out.len() < ROWS_PARALLEL_MIN_VALUES || self.num_threads() == 1 {
            for (t, row) in out.chunks_exact_mut(width).enumerate() {
                f(t, row);
            }
            return;
        }
        let out = OutPtr::new(out);
        self.run(|i, n| {
            for t in rows * i / n..rows * (i + 1) / n {
                // SAFETY: row `t < rows` lies inside `out`, and thread `i`
                // alone touches rows `rows * i / n .. rows * (i + 1) / n`.
                let row =
                    unsafe { std::slice::from_raw_parts_mut(out.ptr().add(t * width), width) };
                f(t, row);
            }
        });
    }
}

/// Values below which [`ThreadPool::for_each_row`] stays on the calling
/// thread: a few microseconds of row-wise work, several fork-joins' worth.
/// A decode's row (576 to 1,536 values for SmolLM2) stays serial; a
/// prefill's or a batch's rows are split.
pub(crate) const ROWS_PARALLEL_MIN_VALUES: usize = 16 * 1024;

/// Waits for the workers of the current section, also when the caller's own
/// share panics (the workers still borrow the closure).
struct WaitGuard<'a>(&'a Shared);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.0.pending.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(SPINS_PER_YIELD) {
                thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("num_threads", &self.num_threads())
            .finish()
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for w in &self.workers {
            w.thread().unpark();
        }
        for w in self.workers.drain(..) {
            // A worker never panics outside `catch_unwind`; ignore the result.
            let _ = w.join();
        }
    }
}

/// The body of worker `index`: wait for a new epoch, run the job, repeat.
fn worker_loop(shared: &Shared, index: usize, n: usize) {
    // Not a load: a section (or the shutdown) may be published before this
    // thread first runs, and it must still see that as new.
    let mut seen = 0;
    loop {
        seen = wait_for_epoch(shared, seen);
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: `run` stored a valid `Job` before publishing the epoch we
        // acquired, and keeps it alive until `pending` reaches zero, which
        // happens only after this call returns.
        let job = unsafe { *(shared.job.load(Ordering::Relaxed) as *const Job<'_>) };
        let result = panic::catch_unwind(AssertUnwindSafe(|| job(index, n)));
        if let Err(payload) = result {
            let mut slot = shared.panic.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(payload);
        }
        shared.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Spins (yielding periodically) until `epoch != seen`, parking after
/// [`SPIN_WINDOW`] of inactivity; returns the new epoch.
fn wait_for_epoch(shared: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let now = shared.epoch.load(Ordering::Acquire);
        if now != seen {
            return now;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(SPINS_PER_YIELD) {
            std::hint::spin_loop();
            continue;
        }
        thread::yield_now();
        if start.elapsed() < SPIN_WINDOW {
            continue;
        }
        // Announce the sleep before the final check, so that `run` either sees
        // the sleeper (and unparks it) or we see its new epoch.
        shared.sleepers.fetch_add(1, Ordering::SeqCst);
        while shared.epoch.load(Ordering::SeqCst) == seen {
            thread::park();
        }
        shared.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_thread_runs_once_per_section() {
        for threads in 1..=4 {
            let pool = ThreadPool::new(threads);
            assert_eq!(pool.num_threads(), threads);
            for _ in 0..200 {
                let hits: Vec<AtomicU32> = (0..threads).map(|_| AtomicU32::new(0)).collect();
                pool.run(|i, n| {
                    assert_eq!(n, threads);
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn for_each_row_visits_every_row_once_with_its_index() {
        for threads in 1..=3 {
            let pool = ThreadPool::new(threads);
            // Serial (a few rows), and split unevenly (16,384 and more).
            for (rows, width) in [(3usize, 5usize), (1, ROWS_PARALLEL_MIN_VALUES), (67, 576)] {
                let mut out = vec![-1f32; rows * width];
                pool.for_each_row(&mut out, width, |t, row| {
                    assert_eq!(row.len(), width);
                    for v in row.iter_mut() {
                        *v += 1.0 + t as f32;
                    }
                });
                for (t, row) in out.chunks_exact(width).enumerate() {
                    assert!(
                        row.iter().all(|&v| v == t as f32),
                        "row {t} of {rows} on {threads} threads"
                    );
                }
            }
        }
    }

    #[test]
    fn run_returns_only_after_all_work_is_done() {
        let pool = ThreadPool::new(3);
        let total = AtomicUsize::new(0);
        for round in 1..=100 {
            pool.run(|i, _| {
                // Uneven work so that the caller usually finishes first.
                let mut acc = 0usize;
                for k in 0..(i * 2000) {
                    acc = acc.wrapping_add(std::hint::black_box(k));
                }
                std::hint::black_box(acc);
                total.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(total.load(Ordering::Relaxed), round * 3);
        }
    }

    #[test]
    fn workers_wake_up_after_parking() {
        let pool = ThreadPool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        thread::sleep(SPIN_WINDOW * 3);
        pool.run(|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn worker_panic_is_reraised_and_pool_stays_usable() {
        let pool = ThreadPool::new(2);
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            pool.run(|i, _| {
                if i == 1 {
                    panic!("boom in worker");
                }
            })
        }));
        let payload = result.expect_err("the worker's panic must reach the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"boom in worker"));
        let count = AtomicUsize::new(0);
        pool.run(|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn concurrent_callers_are_serialised() {
        let pool = Arc::new(ThreadPool::new(2));
        let count = Arc::new(AtomicUsize::new(0));
        let callers: Vec<_> = (0..3)
            .map(|_| {
                let (pool, count) = (Arc::clone(&pool), Arc::clone(&count));
                thread::spawn(move || {
                    for _ in 0..100 {
                        pool.run(|_, _| {
                            count.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
        assert_eq!(count.load(Ordering::Relaxed), 3 * 100 * 2);
    }
}
