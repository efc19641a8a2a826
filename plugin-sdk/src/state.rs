//! The one plugin instance a component holds. A component instance is
//! single-threaded, so a thread-local cell is the whole synchronisation.
//! The export macros are its only users.

use std::any::Any;
use std::cell::RefCell;

thread_local! {
    static INSTANCE: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Replaces the instance (called by `init`).
pub fn set<T: 'static>(value: T) {
    INSTANCE.with(|cell| *cell.borrow_mut() = Some(Box::new(value)));
}

/// Runs `f` on the instance. Panics (a trap the host reports by the
/// plugin's name) when the host calls a hook before `init`, which the host
/// never does.
pub fn with<T: 'static, R>(f: impl FnOnce(&mut T) -> R) -> R {
    INSTANCE.with(|cell| {
        let mut slot = cell.borrow_mut();
        let value = slot
            .as_mut()
            .and_then(|b| b.downcast_mut::<T>())
            .expect("a hook was called before init");
        f(value)
    })
}
