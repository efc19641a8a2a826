//! How a party waits: spin with `sched_yield` while traffic flows, then sleep
//! on a futex in the shared segment once the wait has lasted `spin_window`.
//!
//! Spinning answers in well under a microsecond but burns a core; a futex
//! sleep costs nothing while idle but one wake-up (an inter-processor
//! interrupt, ~40 µs on a VM). Every spin iteration yields, because with one
//! writer and two readers on two cores pure spinning starves the party that
//! would make progress for whole time slices.

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Longest single futex sleep. Sleepers wake this often to check whether
/// their peer process died, which no futex wake would ever report.
pub const RECHECK_INTERVAL: Duration = Duration::from_millis(100);

/// A futex word plus a count of sleepers, so that a waker pays for the
/// `FUTEX_WAKE` system call only when someone actually sleeps.
#[repr(C, align(64))]
#[derive(Default)]
pub struct Doorbell {
    word: AtomicU32,
    sleepers: AtomicU32,
}

impl Doorbell {
    /// Wakes every sleeper. Call after publishing the state they wait for.
    pub fn ring(&self) {
        // Pairs with the fence in `sleep`: either the sleeper sees the new
        // state before sleeping, or this load sees the sleeper's increment.
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            self.word.fetch_add(1, Ordering::SeqCst);
            futex_wake(&self.word);
        }
    }

    /// Sleeps until rung or `timeout` passes, unless `awake()` already holds.
    fn sleep(&self, timeout: Duration, awake: &mut impl FnMut() -> bool) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let seen = self.word.load(Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !awake() {
            // Returns at once if `ring` bumped the word since we read it.
            futex_wait(&self.word, seen, timeout);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Why a wait ended without its condition becoming true.
#[derive(Debug, PartialEq, Eq)]
pub enum WaitEnd {
    /// The deadline passed.
    TimedOut,
    /// `check` asked to stop (shutdown, dead peer); carries its reason.
    Stopped,
}

/// Waits until `ready()` holds. Spins (yielding) for `spin_window`, then
/// sleeps on `bell`. `check` runs at every sleep recheck and whenever a
/// sleep ends; it returns `false` to abandon the wait.
pub fn wait_until(
    bell: &Doorbell,
    spin_window: Duration,
    timeout: Option<Duration>,
    mut ready: impl FnMut() -> bool,
    mut check: impl FnMut() -> bool,
) -> Result<(), WaitEnd> {
    if ready() {
        return Ok(());
    }
    let start = Instant::now();
    let deadline = timeout.map(|t| start + t);
    let mut last = start;
    loop {
        for _ in 0..SPINS_PER_CLOCK_READ {
            // SAFETY: sched_yield has no preconditions.
            unsafe { libc::sched_yield() };
            if ready() {
                return Ok(());
            }
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Err(WaitEnd::TimedOut);
        }
        // A few yields normally take a microsecond; if they took much longer,
        // other tasks want this core and each yield hands it away for a whole
        // time slice, so spinning only delays us: a futex wake-up (which the
        // scheduler favours) is then the faster path.
        let contended = now - last > CONTENDED_ROUND;
        last = now;
        if now - start < spin_window && !contended {
            continue;
        }
        if !check() {
            return Err(WaitEnd::Stopped);
        }
        let nap = deadline.map_or(RECHECK_INTERVAL, |d| (d - now).min(RECHECK_INTERVAL));
        bell.sleep(nap, &mut || ready() || !check());
        if ready() {
            return Ok(());
        }
    }
}

/// A spin round (`SPINS_PER_CLOCK_READ` yields) slower than this means the
/// core is contended; see `wait_until`.
const CONTENDED_ROUND: Duration = Duration::from_micros(50);

/// Yield-and-check rounds between two reads of the clock (a clock read
/// costs about as much as a `sched_yield`).
const SPINS_PER_CLOCK_READ: usize = 4;

#[cfg(target_os = "linux")]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 (in a shared mapping, hence no
    // FUTEX_PRIVATE_FLAG); `ts` outlives the call. Spurious returns (EINTR,
    // EAGAIN) are fine: every caller re-checks its condition.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        )
    };
}

#[cfg(target_os = "linux")]
fn futex_wake(word: &AtomicU32) {
    // SAFETY: as in `futex_wait`; FUTEX_WAKE only reads the address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        )
    };
}

/// Without futexes, sleeping degrades to short naps.
#[cfg(not(target_os = "linux"))]
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    if word.load(Ordering::SeqCst) == expected {
        std::thread::sleep(timeout.min(Duration::from_micros(200)));
    }
}

#[cfg(not(target_os = "linux"))]
fn futex_wake(_word: &AtomicU32) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn a_sleeper_is_woken_by_the_bell_long_before_its_recheck() {
        let bell = Arc::new(Doorbell::default());
        let flag = Arc::new(AtomicBool::new(false));
        let (b, f) = (bell.clone(), flag.clone());
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            let r = wait_until(
                &b,
                Duration::ZERO,
                Some(Duration::from_secs(5)),
                || f.load(Ordering::Acquire),
                || true,
            );
            (r, start.elapsed())
        });
        while bell.sleepers.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        flag.store(true, Ordering::Release);
        bell.ring();
        let (r, took) = t.join().expect("waiter");
        assert_eq!(r, Ok(()));
        assert!(took < Duration::from_secs(2), "woke after {took:?}");
    }

    #[test]
    fn timeouts_and_stops_end_the_wait() {
        let bell = Doorbell::default();
        let t = Duration::from_millis(30);
        assert_eq!(
            wait_until(&bell, Duration::from_millis(5), Some(t), || false, || true),
            Err(WaitEnd::TimedOut)
        );
        assert_eq!(
            wait_until(&bell, Duration::ZERO, None, || false, || false),
            Err(WaitEnd::Stopped)
        );
    }
}
