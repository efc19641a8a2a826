//! Overload control for engine requests (`server.max_waiting_requests`):
//! the server counts the engine requests it queued that have not produced
//! their first output yet (waiting to be scheduled, or in their prefill),
//! and refuses an HTTP request that would take the count past the cap with
//! 429 at once, so a flood never becomes an unbounded queue.
//!
//! The count lives here rather than in the engine's stats, so admitting a
//! request costs an atomic add instead of a round trip, and a burst cannot
//! slip past the cap between two stats updates. Each slot is held by a
//! [`WaitPermit`], released when its request's first output is read or when
//! the permit is dropped (an error, a refusal, a client that went away):
//! no path can leak a slot.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::error::ApiError;

/// The cap and the count of engine requests waiting for their first output.
pub struct Admission {
    waiting: Arc<AtomicUsize>,
    cap: usize,
}

impl Admission {
    /// At most `cap` engine requests waiting at once.
    pub fn new(cap: usize) -> Admission {
        Admission {
            waiting: Arc::new(AtomicUsize::new(0)),
            cap,
        }
    }

    /// Reserves `n` slots (one per choice of every prompt of an HTTP
    /// request), all or none: 429 if they would take the count past the cap,
    /// 400 if they never could (a retry would be refused forever).
    pub fn admit(&self, n: usize) -> Result<WaitPermit, ApiError> {
        if n > self.cap {
            return Err(ApiError::bad_request(
                None,
                format!(
                    "this request needs {n} engine requests (prompts × n), more than \
                     server.max_waiting_requests = {} lets wait at once; send fewer prompts or \
                     choices per request, or raise the limit",
                    self.cap
                ),
            ));
        }
        let reserved = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |waiting| {
                waiting.checked_add(n).filter(|&total| total <= self.cap)
            });
        match reserved {
            Ok(_) => Ok(WaitPermit {
                waiting: Arc::clone(&self.waiting),
                held: n,
            }),
            Err(waiting) => Err(ApiError::too_many_requests(format!(
                "the server is overloaded: {waiting} engine requests are waiting to be scheduled \
                 and this request adds {n}, past server.max_waiting_requests = {}; retry later \
                 (see Retry-After) or raise the limit",
                self.cap
            ))),
        }
    }

    /// Engine requests waiting now.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }
}

/// Slots of [`Admission`] held by one HTTP request's engine requests; what
/// is still held when it drops is given back.
#[must_use = "dropping the permit releases its slots at once"]
pub struct WaitPermit {
    waiting: Arc<AtomicUsize>,
    held: usize,
}

impl WaitPermit {
    /// Gives back one slot: an engine request produced its first output (or
    /// was refused), so it no longer waits.
    pub fn release_one(&mut self) {
        if self.held > 0 {
            self.held -= 1;
            self.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for WaitPermit {
    fn drop(&mut self) {
        if self.held > 0 {
            self.waiting.fetch_sub(self.held, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_cap_all_or_none_and_gives_slots_back() {
        let admission = Admission::new(4);
        let mut three = admission.admit(3).expect("3 of 4");
        let refused = admission.admit(2).err().expect("3 + 2 > 4");
        assert_eq!(refused.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
        assert!(
            refused.message.contains("server.max_waiting_requests = 4"),
            "{}",
            refused.message
        );
        assert_eq!(admission.waiting(), 3, "a refusal reserves nothing");
        let one = admission.admit(1).expect("3 + 1 = 4");
        three.release_one();
        assert_eq!(admission.waiting(), 3);
        drop(three);
        assert_eq!(admission.waiting(), 1, "the two still held go back on drop");
        drop(one);
        assert_eq!(admission.waiting(), 0);
        let never = admission
            .admit(5)
            .err()
            .expect("more than the cap never fits");
        assert_eq!(
            never.status,
            axum::http::StatusCode::BAD_REQUEST,
            "retrying cannot help"
        );
        assert!(admission.admit(usize::MAX).is_err(), "no overflow");
        assert_eq!(admission.waiting(), 0);
        let all = admission.admit(4).expect("exactly the cap fits");
        let busy = admission.admit(1).err().expect("full");
        assert_eq!(busy.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
        drop(all);
        assert_eq!(admission.waiting(), 0);
    }

    #[test]
    fn releasing_more_than_held_does_not_underflow() {
        let admission = Admission::new(2);
        let mut p = admission.admit(1).unwrap();
        p.release_one();
        p.release_one();
        drop(p);
        assert_eq!(admission.waiting(), 0);
    }
}
