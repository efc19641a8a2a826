//! The epoch ticker behind every plugin call's deadline: a thread that
//! advances wasmtime's epoch every [`TICK`] while plugin calls happen and
//! parks when they stop.
//!
//! A busy engine calls a plugin every step, a few milliseconds apart. Waking
//! a parked thread on each call costs a futex syscall and often a context
//! switch on the caller's core, which measured several times the hook
//! itself. So the ticker lingers: it keeps ticking for [`LINGER`] after the
//! last call ends, and a call only wakes it when it has actually parked. An
//! idle engine still goes quiet after the linger.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::Duration;

/// Period of the epoch ticker; deadlines are whole ticks.
pub(crate) const TICK: Duration = Duration::from_millis(1);

/// How long the ticker keeps ticking after the last call before it parks.
const LINGER: Duration = Duration::from_millis(50);

/// What the calling threads and the ticker thread share.
#[derive(Default)]
struct Shared {
    /// Calls in flight.
    in_flight: AtomicUsize,
    /// The ticker has parked (or is about to) and must be woken.
    parked: AtomicBool,
}

/// Advances an epoch every [`TICK`] while calls are in flight or were
/// recently.
pub(crate) struct Ticker {
    shared: Arc<Shared>,
    thread: Thread,
}

impl Ticker {
    /// Starts the thread; `tick` advances the epoch.
    pub(crate) fn start(tick: impl Fn() + Send + 'static) -> std::io::Result<Ticker> {
        let shared = Arc::new(Shared {
            parked: AtomicBool::new(true),
            ..Shared::default()
        });
        let state = shared.clone();
        let linger_ticks = (LINGER.as_millis() / TICK.as_millis()) as u32;
        let handle = std::thread::Builder::new()
            .name("plugin-epoch".into())
            .spawn(move || {
                let mut idle_ticks = linger_ticks;
                loop {
                    if idle_ticks >= linger_ticks {
                        // Publish the intent to park, then look again: a call
                        // that began meanwhile either is seen here or sees
                        // `parked` and unparks us (both are SeqCst). Park
                        // until a call is in flight: `park` also returns for
                        // a stale token, left by a call that unparked us
                        // while we were still ticking, and spuriously.
                        state.parked.store(true, Ordering::SeqCst);
                        while state.in_flight.load(Ordering::SeqCst) == 0 {
                            std::thread::park();
                        }
                        state.parked.store(false, Ordering::SeqCst);
                        idle_ticks = 0;
                    }
                    std::thread::sleep(TICK);
                    tick();
                    if state.in_flight.load(Ordering::Acquire) == 0 {
                        idle_ticks += 1;
                    } else {
                        idle_ticks = 0;
                    }
                }
            })?;
        Ok(Ticker {
            shared,
            thread: handle.thread().clone(),
        })
    }

    /// Runs `f` (one call into a guest) with the ticker running.
    pub(crate) fn during<R>(&self, f: impl FnOnce() -> R) -> R {
        self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
        if self.shared.parked.load(Ordering::SeqCst) {
            self.thread.unpark();
        }
        let result = f();
        self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::time::Instant;

    fn counting() -> (Ticker, Arc<AtomicU64>) {
        let ticks = Arc::new(AtomicU64::new(0));
        let t = ticks.clone();
        let ticker = Ticker::start(move || {
            t.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        (ticker, ticks)
    }

    /// Waits (up to 10 s) until `cond` holds.
    fn eventually(what: &str, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "timed out waiting until {what}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn ticks_during_a_call_then_parks_and_wakes_for_the_next() {
        let (ticker, ticks) = counting();
        assert_eq!(
            ticks.load(Ordering::Relaxed),
            0,
            "parked before the first call"
        );
        ticker.during(|| {
            eventually("the epoch advances during a call", || {
                ticks.load(Ordering::Relaxed) >= 3
            })
        });
        eventually("the ticker parks after the linger", || {
            ticker.shared.parked.load(Ordering::SeqCst)
        });
        let parked_at = ticks.load(Ordering::Relaxed);
        std::thread::sleep(LINGER * 2);
        assert_eq!(
            ticks.load(Ordering::Relaxed),
            parked_at,
            "a parked ticker does not tick"
        );
        ticker.during(|| {
            eventually("a call wakes a parked ticker", || {
                ticks.load(Ordering::Relaxed) >= parked_at + 3
            })
        });
    }

    #[test]
    fn a_wake_up_sent_while_ticking_does_not_restart_the_ticker_later() {
        let (ticker, ticks) = counting();
        ticker.during(|| {
            eventually("the ticker runs", || ticks.load(Ordering::Relaxed) >= 3);
            // What a call does when it starts just as the ticker reported
            // parked but before it parked: a token that outlives the call.
            ticker.thread.unpark();
        });
        let call_ended_at = ticks.load(Ordering::Relaxed);
        // One linger is 50 ticks; a ticker woken by the stale token would
        // linger a second time, 100 in all, given the time to.
        std::thread::sleep(LINGER * 6);
        let after = ticks.load(Ordering::Relaxed) - call_ended_at;
        assert!(
            after <= 60,
            "{after} ticks after the last call: the stale wake-up restarted the ticker"
        );
    }

    #[test]
    fn calls_from_many_threads_never_strand_a_call_without_ticks() {
        let (ticker, ticks) = counting();
        let ticker = Arc::new(ticker);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (ticker, ticks) = (ticker.clone(), ticks.clone());
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        let seen = ticks.load(Ordering::Relaxed);
                        ticker.during(|| {
                            eventually("every call sees the epoch move", || {
                                ticks.load(Ordering::Relaxed) > seen
                            })
                        });
                        std::thread::sleep(Duration::from_millis(7 * (seen % 11)));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
