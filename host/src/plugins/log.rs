//! What plugins write to the host's log: the `logging` import
//! (`log(level, message)`, WIT 0.3) and the guest's stdout and stderr.
//!
//! Every line becomes one tracing event with target [`TARGET`], its
//! message prefixed with the plugin's qualified name
//! (`WARN plugin: acme:lifo: ...`), so `RUST_LOG=warn,plugin=info` shows a
//! plugin's info lines. stdout is logged at `info`, stderr at `warn`, line
//! by line (a line longer than [`MAX_LINE`] bytes is cut); control
//! characters are replaced, so a plugin cannot rewrite the operator's
//! terminal.
//!
//! A chatty plugin cannot flood the log: each plugin (all its instances and
//! both streams together) has a token bucket of [`BURST`] lines refilled at
//! [`LINES_PER_SECOND`]; lines over it are dropped and counted: the first
//! dropped line is announced, and the next line that passes (or the
//! plugin's unloading) is preceded by "suppressed N lines". A line the log
//! filter would not show costs no token.
//!
//! The stderr stream also remembers the last Rust panic message it saw
//! (`panicked at ...` and the line after it), so a trap that follows a
//! panic is reported with the panic's message ([`GuestOutput::take_panic`]).

use std::sync::{Arc, Mutex};
use std::time::Instant;

// `bytes::Bytes`, which wasmtime-wasi's streams take; hyper re-exports the
// same crate (one `bytes` in the build).
use hyper::body::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

use super::bindings::logging_v0_3 as wit;
use super::runtime::StoreState;

/// The tracing target of every plugin line (for `RUST_LOG=plugin=info`).
pub const TARGET: &str = "plugin";
/// Lines per second a plugin may log on average.
pub const LINES_PER_SECOND: f64 = 50.0;
/// Lines a plugin may log at once before the rate applies.
pub const BURST: f64 = 200.0;
/// Bytes of one line that are logged; the rest is cut.
pub const MAX_LINE: usize = 2048;

/// How important a line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// `trace`.
    Trace,
    /// `debug`.
    Debug,
    /// `info` (and stdout).
    Info,
    /// `warn` (and stderr).
    Warn,
    /// `error`.
    Error,
}

impl Level {
    /// Whether the log filter shows lines of this level from plugins.
    fn enabled(self) -> bool {
        match self {
            Level::Trace => tracing::enabled!(target: TARGET, tracing::Level::TRACE),
            Level::Debug => tracing::enabled!(target: TARGET, tracing::Level::DEBUG),
            Level::Info => tracing::enabled!(target: TARGET, tracing::Level::INFO),
            Level::Warn => tracing::enabled!(target: TARGET, tracing::Level::WARN),
            Level::Error => tracing::enabled!(target: TARGET, tracing::Level::ERROR),
        }
    }
}

/// One plugin's log: its name and its rate limit, shared by every
/// instance and stream of the plugin.
#[derive(Debug)]
pub struct PluginLog {
    name: String,
    bucket: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    refilled: Instant,
    suppressed: u64,
}

impl PluginLog {
    /// A log for the plugin `name` with a full bucket.
    pub fn new(name: &str) -> Arc<PluginLog> {
        Arc::new(PluginLog {
            name: name.to_string(),
            bucket: Mutex::new(Bucket {
                tokens: BURST,
                refilled: Instant::now(),
                suppressed: 0,
            }),
        })
    }

    /// The plugin's qualified name (or its file, before it is known).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Logs each line of `message` at `level`, within the rate limit.
    pub fn log(&self, level: Level, message: &str) {
        if !level.enabled() {
            return;
        }
        for line in message.lines() {
            self.line(level, line);
        }
    }

    fn line(&self, level: Level, line: &str) {
        let suppressed = {
            let mut b = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let elapsed = now.duration_since(b.refilled).as_secs_f64();
            b.tokens = (b.tokens + elapsed * LINES_PER_SECOND).min(BURST);
            b.refilled = now;
            if b.tokens < 1.0 {
                b.suppressed += 1;
                if b.suppressed == 1 {
                    drop(b);
                    tracing::warn!(
                        target: TARGET,
                        "{}: logs faster than {LINES_PER_SECOND} lines/s ({BURST} at once); dropping its lines until it slows down",
                        self.name
                    );
                }
                return;
            }
            b.tokens -= 1.0;
            std::mem::take(&mut b.suppressed)
        };
        let name = &self.name;
        if suppressed > 0 {
            tracing::warn!(
                target: TARGET,
                "{name}: suppressed {suppressed} lines (a plugin may log {LINES_PER_SECOND} lines/s, {BURST} at once)"
            );
        }
        let line = clean(line);
        match level {
            Level::Trace => tracing::trace!(target: TARGET, "{name}: {line}"),
            Level::Debug => tracing::debug!(target: TARGET, "{name}: {line}"),
            Level::Info => tracing::info!(target: TARGET, "{name}: {line}"),
            Level::Warn => tracing::warn!(target: TARGET, "{name}: {line}"),
            Level::Error => tracing::error!(target: TARGET, "{name}: {line}"),
        }
    }
}

impl Drop for PluginLog {
    fn drop(&mut self) {
        let b = self.bucket.get_mut().unwrap_or_else(|e| e.into_inner());
        if b.suppressed > 0 {
            tracing::warn!(target: TARGET, "{}: suppressed {} lines", self.name, b.suppressed);
        }
    }
}

/// `line` cut to [`MAX_LINE`] bytes (at a character boundary), control
/// characters but tabs replaced.
fn clean(line: &str) -> String {
    let mut end = line.len().min(MAX_LINE);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    let mut out: String = line[..end]
        .chars()
        .map(|c| {
            if c.is_control() && c != '\t' {
                '\u{fffd}'
            } else {
                c
            }
        })
        .collect();
    if end < line.len() {
        out.push_str(&format!(" ... ({} more bytes cut)", line.len() - end));
    }
    out
}

/// A guest's stdout or stderr: complete lines go to the plugin's log.
#[derive(Debug)]
struct Lines {
    log: Arc<PluginLog>,
    level: Level,
    /// The current line, until its newline comes.
    partial: Vec<u8>,
    /// The latest Rust panic seen on this stream, and whether its message
    /// (the line after `panicked at`) is still to come.
    panic: Option<String>,
    panic_open: bool,
}

impl Lines {
    fn write(&mut self, mut bytes: &[u8]) {
        while let Some(nl) = bytes.iter().position(|&b| b == b'\n') {
            self.partial.extend_from_slice(&bytes[..nl]);
            self.flush_line();
            bytes = &bytes[nl + 1..];
        }
        self.partial.extend_from_slice(bytes);
        if self.partial.len() > MAX_LINE {
            self.flush_line();
        }
    }

    fn flush_line(&mut self) {
        let line = String::from_utf8_lossy(&self.partial).into_owned();
        self.partial.clear();
        if self.level == Level::Warn {
            if self.panic_open {
                if let Some(p) = self.panic.as_mut() {
                    p.push(' ');
                    p.push_str(line.trim());
                }
                self.panic_open = false;
            } else if let Some(at) = line.find("panicked at ") {
                self.panic = Some(line[at..].trim_end_matches(':').to_string());
                self.panic_open = true;
            }
        }
        self.log.log(self.level, &line);
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        if !self.partial.is_empty() {
            self.flush_line();
        }
    }
}

/// One stream of one store, shared by every handle the guest opens on it.
#[derive(Debug, Clone)]
pub struct GuestStream(Arc<Mutex<Lines>>);

impl GuestStream {
    fn new(log: Arc<PluginLog>, level: Level) -> GuestStream {
        GuestStream(Arc::new(Mutex::new(Lines {
            log,
            level,
            partial: Vec::new(),
            panic: None,
            panic_open: false,
        })))
    }

    fn lines(&self) -> std::sync::MutexGuard<'_, Lines> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl IsTerminal for GuestStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestStream {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        // Only the p2 stream above is used (the sandbox links WASI p2);
        // anything else gets an empty sink.
        Box::new(tokio::io::sink())
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for GuestStream {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.lines().write(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        // Lines are logged when complete; a flush does not end a line
        // (Rust's std flushes after every write).
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 * 1024)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for GuestStream {
    async fn ready(&mut self) {}
}

/// A store's stdout and stderr.
#[derive(Debug, Clone)]
pub struct GuestOutput {
    log: Arc<PluginLog>,
    /// Logged at `info`.
    pub stdout: GuestStream,
    /// Logged at `warn`.
    pub stderr: GuestStream,
}

impl GuestOutput {
    /// Both streams of one store of the plugin whose log is `log`.
    pub fn new(log: Arc<PluginLog>) -> GuestOutput {
        GuestOutput {
            stdout: GuestStream::new(log.clone(), Level::Info),
            stderr: GuestStream::new(log.clone(), Level::Warn),
            log,
        }
    }

    /// The plugin's log (what the `logging` import writes to).
    pub fn log(&self) -> &PluginLog {
        &self.log
    }

    /// The latest panic the guest reported on stderr (`panicked at
    /// src/lib.rs:3:5: message`), forgotten once taken.
    pub fn take_panic(&self) -> Option<String> {
        let mut lines = self.stderr.lines();
        lines.panic_open = false;
        lines.panic.take()
    }
}

impl wit::Host for StoreState {
    fn log(&mut self, level: wit::Level, message: String) {
        let level = match level {
            wit::Level::Trace => Level::Trace,
            wit::Level::Debug => Level::Debug,
            wit::Level::Info => Level::Info,
            wit::Level::Warn => Level::Warn,
            wit::Level::Error => Level::Error,
        };
        self.output().log().log(level, &message);
    }
}

impl super::bindings::logging_v0_4::Host for StoreState {
    fn log(&mut self, level: super::bindings::logging_v0_4::Level, message: String) {
        use super::bindings::logging_v0_4::Level as L;
        // The same levels as 0.3's, by another type.
        let level = match level {
            L::Trace => wit::Level::Trace,
            L::Debug => wit::Level::Debug,
            L::Info => wit::Level::Info,
            L::Warn => wit::Level::Warn,
            L::Error => wit::Level::Error,
        };
        wit::Host::log(self, level, message)
    }
}

/// Links the `logging` import (0.3, 0.4) into `linker`.
pub fn add_to_linker(linker: &mut wasmtime::component::Linker<StoreState>) -> wasmtime::Result<()> {
    use wasmtime::component::HasSelf;
    wit::add_to_linker::<StoreState, HasSelf<StoreState>>(linker, |s| s)?;
    super::bindings::logging_v0_4::add_to_linker::<StoreState, HasSelf<StoreState>>(linker, |s| s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_cut_and_cleaned() {
        assert_eq!(clean("a\tb\x1b[2Jc"), "a\tb\u{fffd}[2Jc");
        let long = "é".repeat(MAX_LINE);
        let cut = clean(&long);
        assert!(cut.starts_with(&"é".repeat(MAX_LINE / 2)));
        assert!(cut.ends_with(&format!("({} more bytes cut)", MAX_LINE)));
    }

    #[test]
    fn the_bucket_drops_lines_over_the_burst() {
        let log = PluginLog::new("test:chatty");
        let passed = (0..(BURST as usize + 50))
            .filter(|_| {
                let before = log.bucket.lock().unwrap().suppressed;
                log.line(Level::Error, "x");
                log.bucket.lock().unwrap().suppressed == before
            })
            .count();
        // A few tokens may refill while the loop runs.
        assert!(
            (BURST as usize..BURST as usize + 10).contains(&passed),
            "{passed}"
        );
        assert!(log.bucket.lock().unwrap().suppressed >= 40);
    }

    #[test]
    fn a_panic_on_stderr_is_remembered() {
        let out = GuestOutput::new(PluginLog::new("test:p"));
        let mut s = out.stderr.clone();
        for piece in [
            "\nthread '<unnamed>' panicked at src/lib.rs:3:5:\n",
            "boom",
            "\nnote: run with `RUST_BACKTRACE=1`\n",
        ] {
            OutputStream::write(&mut s, Bytes::copy_from_slice(piece.as_bytes())).unwrap();
        }
        assert_eq!(
            out.take_panic().as_deref(),
            Some("panicked at src/lib.rs:3:5 boom")
        );
        assert_eq!(out.take_panic(), None);
    }
}
