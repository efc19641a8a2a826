//! Logging from a plugin into the host's log.
//!
//! Each line goes to the host's log (target `plugin`, filtered by the
//! host's `RUST_LOG`, e.g. `RUST_LOG=warn,plugin=info`), prefixed with the
//! plugin's qualified name, and is rate-limited per plugin by the host.
//! Logging never fails and never traps.
//!
//! ```ignore
//! plugin_sdk::info!("admitted {} of {} waiting requests", n, queue.ids.len());
//! plugin_sdk::log::warn("option `mass` is 0; using 0.9");
//! ```
//!
//! Built against `engine:plugins@0.4.0` this calls the host's `log`
//! import. With the `wit-0-2` feature (no `log` import), and in native unit
//! tests, the line is written to stderr instead (`LEVEL message`), which
//! the host also captures into its log, at `warn`.
//!
//! `println!` and `eprintln!` work too: the host logs a plugin's stdout at
//! `info` and its stderr at `warn`, line by line.

/// The bindings of the `plugin-imports` world (`logging`), shared by every
/// kind's bindings.
#[cfg(not(feature = "wit-0-2"))]
#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "wit/v0.4.0",
        world: "engine:plugins/plugin-imports@0.4.0",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
}

/// How important a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Very detailed tracing.
    Trace,
    /// Debugging detail.
    Debug,
    /// Normal operation.
    Info,
    /// Something unexpected that the plugin worked around.
    Warn,
    /// Something failed.
    Error,
}

impl Level {
    /// The level's name in capitals, as the host's log prints it.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Trace => "TRACE",
            Level::Debug => "DEBUG",
            Level::Info => "INFO",
            Level::Warn => "WARN",
            Level::Error => "ERROR",
        }
    }
}

/// Logs `message` at `level` (see the module documentation).
pub fn log(level: Level, message: &str) {
    #[cfg(all(target_arch = "wasm32", not(feature = "wit-0-2")))]
    {
        use bindings::engine::plugins::logging as wit;
        let level = match level {
            Level::Trace => wit::Level::Trace,
            Level::Debug => wit::Level::Debug,
            Level::Info => wit::Level::Info,
            Level::Warn => wit::Level::Warn,
            Level::Error => wit::Level::Error,
        };
        wit::log(level, message);
    }
    #[cfg(not(all(target_arch = "wasm32", not(feature = "wit-0-2"))))]
    eprintln!("{} {message}", level.as_str());
}

/// Logs `message` at [`Level::Trace`].
pub fn trace(message: &str) {
    log(Level::Trace, message)
}

/// Logs `message` at [`Level::Debug`].
pub fn debug(message: &str) {
    log(Level::Debug, message)
}

/// Logs `message` at [`Level::Info`].
pub fn info(message: &str) {
    log(Level::Info, message)
}

/// Logs `message` at [`Level::Warn`].
pub fn warn(message: &str) {
    log(Level::Warn, message)
}

/// Logs `message` at [`Level::Error`].
pub fn error(message: &str) {
    log(Level::Error, message)
}

/// Logs a `format!`-style message at [`Level::Trace`](crate::log::Level::Trace).
#[macro_export]
macro_rules! trace {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Trace, &::std::format!($($arg)*)) };
}

/// Logs a `format!`-style message at [`Level::Debug`](crate::log::Level::Debug).
#[macro_export]
macro_rules! debug {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Debug, &::std::format!($($arg)*)) };
}

/// Logs a `format!`-style message at [`Level::Info`](crate::log::Level::Info).
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Info, &::std::format!($($arg)*)) };
}

/// Logs a `format!`-style message at [`Level::Warn`](crate::log::Level::Warn).
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Warn, &::std::format!($($arg)*)) };
}

/// Logs a `format!`-style message at [`Level::Error`](crate::log::Level::Error).
#[macro_export]
macro_rules! error {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Error, &::std::format!($($arg)*)) };
}
