//! Process identity and the names of shared segments, so that segments of a
//! dead owner can be recognised and unlinked by anyone.
//!
//! A segment is named `/hostmq-<pid>-<start time>-<counter>-<random>`
//! (overflow segments append `-o<seq>`). The pid together with the process's
//! start time (field 22 of `/proc/<pid>/stat`) identifies the owner even if the
//! pid is later reused, so a sweeper never unlinks a live queue's name.

use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

/// Prefix of every segment name this module creates (without the leading `/`).
pub const NAME_PREFIX: &str = "hostmq-";

/// A process, identified by pid and start time (clock ticks since boot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessId {
    /// The process id.
    pub pid: u32,
    /// Its start time, or 0 where `/proc` is unavailable.
    pub start_time: u64,
}

impl ProcessId {
    /// The calling process.
    pub fn current() -> ProcessId {
        let pid = std::process::id();
        ProcessId {
            pid,
            start_time: proc_stat(pid).map_or(0, |s| s.1),
        }
    }

    /// Whether this process still runs. A zombie (killed, not yet reaped)
    /// counts as dead: it will never touch the queue again.
    pub fn is_alive(&self) -> bool {
        // SAFETY: kill with signal 0 only checks for existence and permission.
        let rc = unsafe { libc::kill(self.pid as libc::pid_t, 0) };
        if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
            return false;
        }
        match proc_stat(self.pid) {
            Some((state, start)) => {
                !matches!(state, 'Z' | 'X') && (self.start_time == 0 || start == self.start_time)
            }
            // No /proc entry although kill succeeded: no /proc mounted; trust kill.
            None => rc == 0 || !std::path::Path::new("/proc/self").exists(),
        }
    }
}

/// Reads a process's state letter and start time from `/proc/<pid>/stat`.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let rest = &text[text.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    let state = fields.next()?.chars().next()?;
    // `rest` starts at field 3, so field 22 is the 20th after it.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// A fresh, unique name for a queue segment owned by `owner`.
pub fn fresh_name(owner: ProcessId) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "/{NAME_PREFIX}{}-{}-{n}-{nanos:x}",
        owner.pid, owner.start_time
    )
}

/// The name of the overflow segment that carries message `seq` of queue `base`.
pub fn overflow_name(base: &str, seq: u64) -> String {
    format!("{base}-o{seq}")
}

/// Parses the owner out of a segment name (with or without the leading `/`).
pub fn owner_of(name: &str) -> Option<ProcessId> {
    let rest = name.trim_start_matches('/').strip_prefix(NAME_PREFIX)?;
    let mut parts = rest.split('-');
    let pid = parts.next()?.parse().ok()?;
    let start_time = parts.next()?.parse().ok()?;
    Some(ProcessId { pid, start_time })
}

/// Removes a segment's name; its memory is freed once the last mapping goes.
/// A name that is already gone is not an error: several parties race to unlink.
pub fn unlink(name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: `c` is a valid NUL-terminated string for the call's duration.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// Unlinks every segment in `/dev/shm` whose name starts with `prefix`
/// (a queue's own name, so that its overflow segments go with it).
pub fn unlink_with_prefix(prefix: &str) {
    let prefix = prefix.trim_start_matches('/');
    for name in shm_names() {
        if name == prefix || name.starts_with(&format!("{prefix}-")) {
            unlink(&format!("/{name}"));
        }
    }
}

/// Unlinks the segments of every queue whose owner process is gone, and
/// returns how many it removed. Called when a writer is created, so a crash
/// leaks at most until the next queue is made on the machine.
pub fn sweep_dead_owners() -> usize {
    let mut removed = 0;
    for name in shm_names() {
        if let Some(owner) = owner_of(&name) {
            if !owner.is_alive() {
                unlink(&format!("/{name}"));
                removed += 1;
            }
        }
    }
    removed
}

/// The names of this module's segments currently in `/dev/shm`.
pub fn shm_names() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(NAME_PREFIX))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_process_is_alive_and_parsed_back_from_its_names() {
        let me = ProcessId::current();
        assert!(me.is_alive());
        assert!(
            me.start_time > 0,
            "/proc/self/stat should give a start time"
        );
        let name = fresh_name(me);
        assert_eq!(owner_of(&name), Some(me));
        assert_eq!(owner_of(&overflow_name(&name, 7)), Some(me));
        assert_ne!(fresh_name(me), name);
    }

    #[test]
    fn a_reused_pid_with_another_start_time_is_dead() {
        let me = ProcessId::current();
        let impostor = ProcessId {
            pid: me.pid,
            start_time: me.start_time + 1,
        };
        assert!(!impostor.is_alive());
    }

    #[test]
    fn a_reaped_child_is_dead() {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let id = ProcessId {
            pid: child.id(),
            start_time: proc_stat(child.id()).map_or(0, |s| s.1),
        };
        child.wait().expect("wait");
        assert!(!id.is_alive());
    }
}
