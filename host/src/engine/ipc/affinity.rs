//! Pinning data-parallel engine cores: each engine-core process (and the
//! worker processes it starts, which inherit the mask) runs on its own share
//! of the cores this server may use, so the ranks do not contend for the
//! same caches and a rank's `worker.num_threads = 0` means its share.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// The cores this process may run on, in order.
pub(super) fn allowed_cores() -> io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is the empty set; the call writes at most
    // `size_of::<cpu_set_t>()` bytes into it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `CPU_ISSET` reads the set within its bounds.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// The share of `allowed` that rank `rank` of `size` runs on: contiguous
/// and equal (within one core); with fewer cores than ranks, ranks share
/// one core each, round robin.
pub(super) fn cores_for_rank(allowed: &[usize], rank: usize, size: usize) -> Vec<usize> {
    if size <= 1 || allowed.is_empty() {
        return allowed.to_vec();
    }
    if allowed.len() < size {
        return vec![allowed[rank % allowed.len()]];
    }
    let (start, end) = (
        rank * allowed.len() / size,
        (rank + 1) * allowed.len() / size,
    );
    allowed[start..end].to_vec()
}

/// Makes `command`'s process start on `cores` only.
pub(super) fn pin(command: &mut Command, cores: &[usize]) {
    // SAFETY: as in `allowed_cores`; the set is built here, before the
    // fork, so the child only makes one system call.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cores.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: sched_setaffinity is async-signal-safe and touches only the
    // set, which the closure owns.
    unsafe {
        command.pre_exec(move || {
            let size = std::mem::size_of::<libc::cpu_set_t>();
            if libc::sched_setaffinity(0, size, &set) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_split_the_cores_without_overlap() {
        let allowed: Vec<usize> = (0..10).collect();
        let shares: Vec<Vec<usize>> = (0..3).map(|r| cores_for_rank(&allowed, r, 3)).collect();
        assert_eq!(shares.concat(), allowed, "every core once, in order");
        assert!(shares.iter().all(|s| (3..=4).contains(&s.len())));
        assert_eq!(cores_for_rank(&allowed, 0, 1), allowed);
        // More ranks than cores: one core each, shared.
        assert_eq!(cores_for_rank(&[4, 6], 2, 3), vec![4]);
    }

    #[test]
    fn a_pinned_child_sees_only_its_cores() {
        let allowed = allowed_cores().unwrap();
        let first = allowed[0];
        let mut command = Command::new("sh");
        command.args(["-c", "grep Cpus_allowed_list /proc/self/status"]);
        pin(&mut command, &[first]);
        let out = command.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.split_whitespace().last(),
            Some(first.to_string().as_str()),
            "{text}"
        );
    }
}
