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
            start_time: proc_stat(pid).map_or(0, |s| s.start_time),
        }
    }

    /// Whether this process still runs. A zombie (killed, not yet reaped)
    /// counts as dead: it will never touch the queue again. So does a
    /// process whose start time differs from the recorded one (the pid was
    /// reused), and a pid no process can have (0, or beyond `pid_t`: a peer
    /// wrote garbage, and `kill` would address a process group instead).
    pub fn is_alive(&self) -> bool {
        let Ok(pid) = libc::pid_t::try_from(self.pid) else {
            return false;
        };
        if pid <= 0 {
            return false;
        }
        // SAFETY: kill with signal 0 only checks for existence and permission.
        let rc = unsafe { libc::kill(pid, 0) };
        if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
            return false;
        }
        match proc_stat(self.pid) {
            Some(stat) => {
                !matches!(stat.state, b'Z' | b'X')
                    && (self.start_time == 0 || stat.start_time == self.start_time)
            }
            // No /proc entry although kill succeeded: no /proc mounted; trust kill.
            None => rc == 0 || !std::path::Path::new("/proc/self").exists(),
        }
    }
}

/// The fields of `/proc/<pid>/stat` this module needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    /// The state letter (field 3): `R`, `S`, `Z`, ...
    state: u8,
    /// Field 22, `starttime`: clock ticks after boot at which the process started.
    start_time: u64,
}

/// Reads a process's state and start time from `/proc/<pid>/stat`.
fn proc_stat(pid: u32) -> Option<Stat> {
    // Bytes, not a String: the command name may be any bytes, UTF-8 or not.
    parse_stat(&std::fs::read(format!("/proc/{pid}/stat")).ok()?)
}

/// Parses the text of `/proc/<pid>/stat`. The command name (field 2) is in
/// parentheses and may itself contain spaces, parentheses and newlines, but
/// the kernel never puts a `)` after it, so the fields start after the last one.
fn parse_stat(text: &[u8]) -> Option<Stat> {
    let close = text.iter().rposition(|&b| b == b')')?;
    let mut fields = text[close + 1..]
        .split(|&b| b == b' ')
        .filter(|f| !f.is_empty());
    let state = match fields.next()? {
        [letter] => *letter,
        _ => return None,
    };
    // The iterator now stands at field 4, so field 22 is the 19th after it.
    let start = fields.nth(18)?;
    let start = std::str::from_utf8(start).ok()?.trim_end().parse().ok()?;
    Some(Stat {
        state,
        start_time: start,
    })
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

    /// A `/proc/<pid>/stat` line for command name `comm`, started at tick 98765.
    fn stat_line(comm: &[u8]) -> Vec<u8> {
        let mut line = b"4242 (".to_vec();
        line.extend_from_slice(comm);
        line.extend_from_slice(
            b") S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 12345 678 \
              18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n",
        );
        line
    }

    #[test]
    fn the_stat_parser_reads_after_the_last_parenthesis_whatever_the_command_name() {
        let want = Some(Stat {
            state: b'S',
            start_time: 98765,
        });
        for comm in [
            &b"host"[..],
            b"a b c",
            b") S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21",
            b"((x)",
            b"x) Z (",
            b"new\nline",
            b"",
            b"\xff\xfe not utf-8",
        ] {
            assert_eq!(
                parse_stat(&stat_line(comm)),
                want,
                "comm {:?}",
                String::from_utf8_lossy(comm)
            );
        }
    }

    #[test]
    fn a_truncated_or_garbled_stat_is_none_not_a_panic() {
        let full = stat_line(b"host");
        let field_22 = full.windows(5).position(|w| w == b"98765").unwrap();
        for cut in 0..=field_22 {
            assert_eq!(parse_stat(&full[..cut]), None, "prefix of {cut} bytes");
        }
        let shortest = b"1 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19";
        assert_eq!(parse_stat(shortest).map(|s| s.start_time), Some(19));
        for bad in [
            &b""[..],
            b")",
            b"1 (x)",
            b"1 (x) ",
            b"1 (x) SS 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19",
            b"1 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 -19",
            b"1 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 99999999999999999999999",
        ] {
            assert_eq!(parse_stat(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn pids_no_process_can_have_are_dead() {
        for pid in [0, u32::MAX, i32::MAX as u32 + 1] {
            assert!(!ProcessId { pid, start_time: 0 }.is_alive(), "pid {pid}");
        }
    }

    #[test]
    fn a_reaped_child_is_dead() {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let id = ProcessId {
            pid: child.id(),
            start_time: proc_stat(child.id()).map_or(0, |s| s.start_time),
        };
        child.wait().expect("wait");
        assert!(!id.is_alive());
    }
}
