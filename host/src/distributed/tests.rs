//! The all-reduce across threads and across real processes (this test
//! binary re-executed on one test, with `AR_ROLE` selecting the child's
//! part): exact sums, bit-identical on every rank, and a dead or missing
//! peer is an error naming it, never a hang.

use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::all_reduce::{AllReduceError, AllReduceGroup, AllReduceHandle, AllReduceOwner};

const TIMEOUT: Duration = Duration::from_secs(20);

/// Rank `rank`'s contribution to round `round`: small integers, so every
/// sum is exact in f32 and the expectation does not depend on order.
fn contribution(rank: usize, round: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 7919 + round * 31 + i * 13) % 1000) as f32 - 500.0)
        .collect()
}

/// The lengths of successive rounds: empty, tiny, exactly one slot, and
/// several slots (chunked into rounds of `slot`).
fn length(round: usize, slot: usize) -> usize {
    [1, 0, slot, slot + 1, 3 * slot + 7, 5][round % 6]
}

/// Runs `rounds` all-reduces as `rank` and checks each against the sum of
/// every rank's contribution computed here; returns the results' bits.
fn run_rank(group: &AllReduceGroup, world: usize, rounds: usize, slot: usize) -> Vec<u32> {
    let mut bits = Vec::new();
    for round in 0..rounds {
        let len = length(round, slot);
        let mut data = contribution(group.rank(), round, len);
        group.all_reduce_sum(&mut data).expect("all-reduce");
        let want: Vec<f32> = (0..len)
            .map(|i| (0..world).map(|r| contribution(r, round, len)[i]).sum())
            .collect();
        assert_eq!(data, want, "rank {} round {round}", group.rank());
        bits.extend(data.iter().map(|v| v.to_bits()));
    }
    bits
}

#[test]
fn threads_get_the_exact_sum_bit_identical_on_every_rank() {
    const SLOT: usize = 100;
    for world in [1, 2, 3, 4] {
        let owner = AllReduceOwner::create(world, SLOT, TIMEOUT).unwrap();
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let h = owner.handle().clone();
                thread::spawn(move || {
                    let g = AllReduceGroup::attach(&h, rank).unwrap();
                    run_rank(&g, world, 300, SLOT)
                })
            })
            .collect();
        let results: Vec<Vec<u32>> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(results.iter().all(|r| r == &results[0]), "world {world}");
    }
}

#[test]
fn non_integer_sums_are_bit_identical_across_ranks() {
    // Values whose sum rounds: every rank must still agree bit for bit,
    // because each sums the slots in rank order.
    let owner = AllReduceOwner::create(3, 64, TIMEOUT).unwrap();
    let ranks: Vec<_> = (0..3)
        .map(|rank| {
            let h = owner.handle().clone();
            thread::spawn(move || {
                let g = AllReduceGroup::attach(&h, rank).unwrap();
                let mut data: Vec<f32> = (0..200).map(|i| 0.1 * (i + rank) as f32 / 3.0).collect();
                g.all_reduce_sum(&mut data).unwrap();
                data.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            })
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0], results[2]);
    let want: Vec<u32> = (0..200)
        .map(|i| {
            let v = |r: usize| 0.1 * (i + r) as f32 / 3.0;
            (v(0) + v(1) + v(2)).to_bits()
        })
        .collect();
    assert_eq!(results[0], want);
}

#[test]
fn a_peer_that_never_arrives_times_out_naming_it_and_breaks_the_group() {
    let owner = AllReduceOwner::create(2, 16, Duration::from_millis(300)).unwrap();
    let g0 = AllReduceGroup::attach(owner.handle(), 0).unwrap();
    let _g1 = AllReduceGroup::attach(owner.handle(), 1).unwrap();
    let start = Instant::now();
    let err = g0.all_reduce_sum(&mut [1.0; 4]).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(&err, AllReduceError::Timeout { me: 0, missing, .. } if missing == &[1]),
        "{err}"
    );
    assert!(err.to_string().contains("rank(s) [1]"), "{err}");
    // The group is now out of step: the next call says so at once.
    assert_eq!(
        _g1.all_reduce_sum(&mut [1.0; 4]).unwrap_err(),
        AllReduceError::Broken { rank: 1 }
    );
}

#[test]
fn mismatched_lengths_are_an_error_not_garbage() {
    let owner = AllReduceOwner::create(2, 16, TIMEOUT).unwrap();
    let h = owner.handle().clone();
    let t = thread::spawn(move || {
        let g = AllReduceGroup::attach(&h, 1).unwrap();
        g.all_reduce_sum(&mut [1.0; 3])
    });
    let g0 = AllReduceGroup::attach(owner.handle(), 0).unwrap();
    let mine = g0.all_reduce_sum(&mut [1.0; 4]);
    let theirs = t.join().unwrap();
    let errs = [mine.unwrap_err(), theirs.unwrap_err()];
    assert!(
        errs.iter()
            .any(|e| matches!(e, AllReduceError::Mismatch { .. })),
        "{errs:?}"
    );
}

#[test]
fn bad_ranks_and_handles_are_refused() {
    let owner = AllReduceOwner::create(2, 16, TIMEOUT).unwrap();
    let err = AllReduceGroup::attach(owner.handle(), 2)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("rank 2 does not exist"), "{err}");
    let _g = AllReduceGroup::attach(owner.handle(), 0).unwrap();
    let err = AllReduceGroup::attach(owner.handle(), 0)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("attached twice"), "{err}");
    let wrong = AllReduceHandle {
        slot_floats: 17,
        ..owner.handle().clone()
    };
    let err = AllReduceGroup::attach(&wrong, 1).err().unwrap().to_string();
    assert!(err.contains("disagrees") || err.contains("needs"), "{err}");
    assert!(AllReduceOwner::create(0, 16, TIMEOUT).is_err());
}

// ---- across processes ----

const CHILD_TEST: &str = "distributed::tests::child_rank";
const ROUNDS: usize = 200;
const SLOT: usize = 64;

/// Starts this test binary as rank `rank` of the group `handle` describes.
fn spawn_rank(handle: &AllReduceHandle, rank: usize, role: &str) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args([CHILD_TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env("AR_ROLE", role)
        .env("AR_RANK", rank.to_string())
        .env("AR_HANDLE", serde_json::to_string(handle).unwrap())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn child rank")
}

/// Waits for a child, killing it past `timeout`.
fn wait_or_kill(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("child rank still running after {timeout:?}");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// The child's part (does nothing when run as an ordinary test).
#[test]
fn child_rank() {
    let Ok(role) = std::env::var("AR_ROLE") else {
        return;
    };
    let rank: usize = std::env::var("AR_RANK").unwrap().parse().unwrap();
    let handle: AllReduceHandle =
        serde_json::from_str(&std::env::var("AR_HANDLE").unwrap()).unwrap();
    let g = AllReduceGroup::attach(&handle, rank).unwrap();
    match role.as_str() {
        "sum" => {
            run_rank(&g, handle.world_size, ROUNDS, SLOT);
        }
        // Attach, then die without ever arriving.
        "die" => std::process::exit(3),
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn processes_get_the_exact_sum() {
    let owner = AllReduceOwner::create(3, SLOT, TIMEOUT).unwrap();
    let mut children: Vec<Child> = (1..3)
        .map(|r| spawn_rank(owner.handle(), r, "sum"))
        .collect();
    let g0 = AllReduceGroup::attach(owner.handle(), 0).unwrap();
    run_rank(&g0, 3, ROUNDS, SLOT);
    for c in &mut children {
        assert!(wait_or_kill(c, TIMEOUT).success());
    }
}

#[test]
fn a_dead_peer_process_is_an_error_naming_its_rank_not_a_hang() {
    let owner = AllReduceOwner::create(2, SLOT, Duration::from_secs(30)).unwrap();
    let mut child = spawn_rank(owner.handle(), 1, "die");
    let g0 = AllReduceGroup::attach(owner.handle(), 0).unwrap();
    let pid = child.id();
    assert_eq!(wait_or_kill(&mut child, TIMEOUT).code(), Some(3));
    let start = Instant::now();
    let err = g0.all_reduce_sum(&mut [1.0; 8]).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "noticed after {:?}",
        start.elapsed()
    );
    assert_eq!(err, AllReduceError::PeerDead { rank: 1, pid });
    assert!(err.to_string().contains("rank 1"), "{err}");
}
