//! The TCP all-reduce through its hub on 127.0.0.1, ranks on threads:
//! sums bit-identical on every rank, to the shared-memory group and to a
//! plain sum in rank order; a mismatch, a rank hanging up or stalling is an
//! error on every rank, never a hang; hostile connections do not hurt the
//! hub.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use super::all_reduce::{AllReduceError, AllReduceOwner};
use super::tcp::{TcpAllReduceGroup, TcpAllReduceHandle, TcpAllReduceHub, TCP_CHUNK_FLOATS};
use super::{GroupHandle, TpGroup, DEFAULT_SLOT_FLOATS};

const TIMEOUT: Duration = Duration::from_secs(20);

/// A small deterministic generator (xorshift), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Floats of assorted magnitudes and signs, so sums round.
    fn floats(&mut self, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| {
                let r = self.next();
                let unit = (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                unit * [1e-3, 1.0, 3.7, 1e3][(r & 3) as usize]
            })
            .collect()
    }
}

/// Rank `rank`'s inputs for every round.
fn inputs(rank: usize, lengths: &[usize]) -> Vec<Vec<f32>> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((rank as u64 + 1) * 0x1234_5678));
    lengths.iter().map(|&len| rng.floats(len)).collect()
}

/// Runs every round on `world` threads, each attaching with `attach`; the
/// results' bits per rank.
fn run_group<G, F>(world: usize, lengths: &[usize], attach: F) -> Vec<Vec<Vec<u32>>>
where
    F: Fn(usize) -> G + Send + Sync + 'static,
    G: FnMut(&mut [f32]) -> Result<(), AllReduceError>,
{
    let attach = Arc::new(attach);
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let attach = attach.clone();
            let lengths = lengths.to_vec();
            thread::spawn(move || {
                let mut reduce = attach(rank);
                inputs(rank, &lengths)
                    .into_iter()
                    .map(|mut data| {
                        reduce(&mut data).expect("all-reduce");
                        data.iter().map(|v| v.to_bits()).collect()
                    })
                    .collect()
            })
        })
        .collect();
    ranks.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn tcp_sums_are_bit_identical_across_ranks_to_shm_and_to_a_plain_sum() {
    const WORLD: usize = 3;
    let lengths = [
        300_000,
        1,
        0,
        576,
        TCP_CHUNK_FLOATS,
        TCP_CHUNK_FLOATS + 1,
        300_000,
        17,
    ];
    let hub = TcpAllReduceHub::start(WORLD, "127.0.0.1", TIMEOUT).unwrap();
    let handle = GroupHandle::Tcp(hub.handle());
    let tcp = run_group(WORLD, &lengths, move |rank| {
        let g = TpGroup::attach(&handle, rank).unwrap();
        assert!(matches!(g, TpGroup::Tcp(_)));
        assert_eq!((g.rank(), g.world_size()), (rank, WORLD));
        move |d: &mut [f32]| g.all_reduce_sum(d)
    });
    assert_eq!(hub.failure(), None);

    let owner = AllReduceOwner::create(WORLD, DEFAULT_SLOT_FLOATS, TIMEOUT).unwrap();
    let handle = GroupHandle::Shm(owner.handle().clone());
    let shm = run_group(WORLD, &lengths, move |rank| {
        let g = TpGroup::attach(&handle, rank).unwrap();
        move |d: &mut [f32]| g.all_reduce_sum(d)
    });

    let per_rank: Vec<_> = (0..WORLD).map(|r| inputs(r, &lengths)).collect();
    let reference: Vec<Vec<u32>> = (0..lengths.len())
        .map(|round| {
            let mut out = per_rank[0][round].clone();
            for rank in &per_rank[1..] {
                for (o, v) in out.iter_mut().zip(&rank[round]) {
                    *o += v;
                }
            }
            out.iter().map(|v| v.to_bits()).collect()
        })
        .collect();
    for rank in 0..WORLD {
        assert!(
            tcp[rank] == reference,
            "tcp rank {rank} differs from the reference"
        );
        assert!(
            shm[rank] == reference,
            "shm rank {rank} differs from the reference"
        );
    }
    // The inputs round: the sum in another order would differ somewhere.
    let reversed: Vec<u32> = (0..lengths[0])
        .map(|i| (per_rank[2][0][i] + per_rank[1][0][i] + per_rank[0][0][i]).to_bits())
        .collect();
    assert_ne!(reversed, reference[0], "the test inputs never round");
}

#[test]
fn one_rank_and_many_rounds_work() {
    let hub = TcpAllReduceHub::start(1, "127.0.0.1:0", TIMEOUT).unwrap();
    let g = TcpAllReduceGroup::connect(&hub.handle(), 0).unwrap();
    for round in 0..200 {
        let mut data = vec![round as f32; 10];
        g.all_reduce_sum(&mut data).unwrap();
        assert_eq!(data, vec![round as f32; 10]);
    }
    let hub = TcpAllReduceHub::start(2, "127.0.0.1", TIMEOUT).unwrap();
    let h = hub.handle();
    let t = thread::spawn(move || {
        let g = TcpAllReduceGroup::connect(&h, 1).unwrap();
        for round in 0..500 {
            let mut data = vec![round as f32, 1.0];
            g.all_reduce_sum(&mut data).unwrap();
            assert_eq!(data, vec![2.0 * round as f32, 2.0]);
        }
    });
    let g = TcpAllReduceGroup::connect(&hub.handle(), 0).unwrap();
    for round in 0..500 {
        let mut data = vec![round as f32, 1.0];
        g.all_reduce_sum(&mut data).unwrap();
        assert_eq!(data, vec![2.0 * round as f32, 2.0]);
    }
    t.join().unwrap();
}

#[test]
fn mismatched_lengths_are_an_error_on_every_rank() {
    let hub = TcpAllReduceHub::start(3, "127.0.0.1", TIMEOUT).unwrap();
    let start = Instant::now();
    let ranks: Vec<_> = (0..3)
        .map(|rank| {
            let h = hub.handle();
            thread::spawn(move || {
                let g = TcpAllReduceGroup::connect(&h, rank).unwrap();
                // Rank 1 contributes one float more (and several chunks).
                let len = if rank == 1 { 300_001 } else { 300_000 };
                let first = g.all_reduce_sum(&mut vec![1.0; len]);
                let second = g.all_reduce_sum(&mut [1.0; 4]);
                (first, second)
            })
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    for (rank, (first, second)) in results.into_iter().enumerate() {
        let err = first.unwrap_err();
        let (other, theirs, mine) = if rank == 1 {
            (0, 300_000, 300_001)
        } else {
            (1, 300_001, 300_000)
        };
        assert_eq!(
            err,
            AllReduceError::Mismatch {
                rank: other,
                theirs,
                me: rank,
                mine
            }
        );
        assert!(
            matches!(second, Err(AllReduceError::Broken { .. })),
            "{second:?}"
        );
    }
    assert!(hub.failure().unwrap().contains("different lengths"));
}

#[test]
fn an_empty_call_against_a_non_empty_one_is_a_mismatch() {
    let hub = TcpAllReduceHub::start(2, "127.0.0.1", TIMEOUT).unwrap();
    let h = hub.handle();
    let t = thread::spawn(move || {
        let g = TcpAllReduceGroup::connect(&h, 1).unwrap();
        g.all_reduce_sum(&mut [])
    });
    let g = TcpAllReduceGroup::connect(&hub.handle(), 0).unwrap();
    let mine = g.all_reduce_sum(&mut [1.0; 3]).unwrap_err();
    assert!(
        matches!(
            mine,
            AllReduceError::Mismatch {
                rank: 1,
                theirs: 0,
                me: 0,
                mine: 3
            }
        ),
        "{mine}"
    );
    assert!(matches!(
        t.join().unwrap(),
        Err(AllReduceError::Mismatch { .. })
    ));
}

/// Ranks 0 and 2 run rounds, then rank 1 goes away (dropped, or its
/// socket closed without a word as a crashed process's is) while rank 0 is
/// in a call and before rank 2's: both fail well before their timeout,
/// naming the hub and rank 1. The hub's recorded failure, if any.
fn peer_goes_away(clean: bool) -> Option<String> {
    // Long timeout: the others must not wait for it.
    let hub = TcpAllReduceHub::start(3, "127.0.0.1", Duration::from_secs(60)).unwrap();
    let addr = hub.handle().addr;
    let barrier = Arc::new(Barrier::new(3));
    let ranks: Vec<_> = [0, 2]
        .into_iter()
        .map(|rank| {
            let (h, barrier) = (hub.handle(), barrier.clone());
            thread::spawn(move || {
                let g = TcpAllReduceGroup::connect(&h, rank).unwrap();
                if clean {
                    for _ in 0..5 {
                        g.all_reduce_sum(&mut vec![1.0; 1000]).unwrap();
                    }
                }
                barrier.wait();
                if rank == 2 {
                    thread::sleep(Duration::from_millis(300));
                }
                let start = Instant::now();
                let err = g.all_reduce_sum(&mut vec![1.0; 1000]).unwrap_err();
                (rank, err, start.elapsed())
            })
        })
        .collect();
    if clean {
        let g = TcpAllReduceGroup::connect(&hub.handle(), 1).unwrap();
        for _ in 0..5 {
            g.all_reduce_sum(&mut vec![1.0; 1000]).unwrap();
        }
        barrier.wait();
        thread::sleep(Duration::from_millis(100));
        drop(g);
    } else {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(&hello(3, 1)).unwrap();
        s.read_exact(&mut [0u8; 24]).unwrap();
        barrier.wait();
        thread::sleep(Duration::from_millis(100));
        drop(s);
    }
    for t in ranks {
        let (rank, err, elapsed) = t.join().unwrap();
        assert!(
            elapsed < Duration::from_secs(2),
            "rank {rank} noticed after {elapsed:?}"
        );
        assert!(
            matches!(err, AllReduceError::Disconnected { .. }),
            "rank {rank}: {err}"
        );
        let msg = err.to_string();
        assert!(msg.contains(&addr), "rank {rank}: {msg}");
        assert!(msg.contains("rank 1 "), "rank {rank}: {msg}");
    }
    hub.failure()
}

#[test]
fn a_rank_dropped_mid_run_stops_the_others_at_once_naming_the_hub() {
    assert_eq!(peer_goes_away(true), None);
}

#[test]
fn a_rank_hanging_up_without_a_word_fails_the_others_at_once() {
    let failure = peer_goes_away(false).unwrap();
    assert!(failure.contains("rank 1 disconnected"), "{failure}");
}

#[test]
fn dropping_the_hub_fails_the_ranks_at_once() {
    let hub = TcpAllReduceHub::start(2, "127.0.0.1", Duration::from_secs(60)).unwrap();
    let h = hub.handle();
    let g0 = TcpAllReduceGroup::connect(&h, 0).unwrap();
    let _g1 = TcpAllReduceGroup::connect(&h, 1).unwrap();
    let t = thread::spawn(move || {
        let start = Instant::now();
        (g0.all_reduce_sum(&mut [1.0; 8]), start.elapsed())
    });
    thread::sleep(Duration::from_millis(100));
    drop(hub);
    let (res, elapsed) = t.join().unwrap();
    let err = res.unwrap_err();
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    assert!(err.to_string().contains(&h.addr), "{err}");
}

#[test]
fn a_rank_that_never_calls_times_out_and_the_others_stop() {
    let timeout = Duration::from_millis(300);
    let hub = TcpAllReduceHub::start(3, "127.0.0.1", timeout).unwrap();
    let h = hub.handle();
    let g0 = TcpAllReduceGroup::connect(&h, 0).unwrap();
    let _g1 = TcpAllReduceGroup::connect(&h, 1).unwrap();
    let g2 = TcpAllReduceGroup::connect(&h, 2).unwrap();
    let t = thread::spawn(move || {
        // Rank 2 arrives late and with a long wait still ahead: rank 0's
        // giving up must stop it.
        thread::sleep(Duration::from_millis(100));
        g2.all_reduce_sum(&mut [1.0; 4])
    });
    let start = Instant::now();
    let err = g0.all_reduce_sum(&mut [1.0; 4]).unwrap_err();
    let elapsed = start.elapsed();
    assert!(
        elapsed >= timeout && elapsed < timeout + Duration::from_secs(2),
        "{elapsed:?}"
    );
    assert!(
        matches!(&err, AllReduceError::HubTimeout { me: 0, hub, .. } if hub == &h.addr),
        "{err}"
    );
    assert!(err.to_string().contains(&h.addr), "{err}");
    let other = t.join().unwrap().unwrap_err();
    assert!(
        matches!(
            other,
            AllReduceError::Broken { rank: 0 } | AllReduceError::HubTimeout { .. }
        ),
        "{other}"
    );
    // Broken for good.
    assert!(matches!(
        g0.all_reduce_sum(&mut [1.0; 4]),
        Err(AllReduceError::Broken { .. })
    ));
}

/// A raw hello.
fn hello(world: u64, rank: u64) -> Vec<u8> {
    let mut h = b"hosttcp1".to_vec();
    h.extend_from_slice(&world.to_le_bytes());
    h.extend_from_slice(&rank.to_le_bytes());
    h
}

/// Sends `bytes` and reads what comes back until the hub hangs up.
fn poke(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(Shutdown::Write);
    let mut back = Vec::new();
    let _ = s.read_to_end(&mut back);
    back
}

#[test]
fn hostile_connections_do_not_hurt_the_hub() {
    let hub = TcpAllReduceHub::start(2, "127.0.0.1", TIMEOUT).unwrap();
    let h = hub.handle();
    // Garbage, a short hello, then an immediate hang-up.
    assert!(poke(&h.addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").is_empty());
    assert!(poke(&h.addr, b"hosttcp1").is_empty());
    drop(TcpStream::connect(&h.addr).unwrap());
    // Out of range and wrong world size: refused with a status, then closed.
    let back = poke(&h.addr, &hello(2, 7));
    assert_eq!(back.len(), 24);
    assert_eq!(back[8], 2);
    assert_eq!(poke(&h.addr, &hello(5, 0))[8], 1);
    assert_eq!(poke(&h.addr, &hello(u64::MAX, u64::MAX))[8], 1);
    // The API refuses the same.
    let bad = TcpAllReduceHandle {
        world_size: 3,
        ..h.clone()
    };
    let err = TcpAllReduceGroup::connect(&bad, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("refused rank 0") && err.contains("2 ranks"),
        "{err}"
    );
    // A duplicate rank.
    let g0 = TcpAllReduceGroup::connect(&h, 0).unwrap();
    let err = TcpAllReduceGroup::connect(&h, 0).err().unwrap().to_string();
    assert!(err.contains("already connected"), "{err}");
    assert!(TcpAllReduceGroup::connect(&h, 2).is_err());
    // The real ranks still work.
    let h1 = h.clone();
    let t = thread::spawn(move || {
        let g1 = TcpAllReduceGroup::connect(&h1, 1).unwrap();
        let mut d = [2.0f32; 3];
        g1.all_reduce_sum(&mut d).map(|()| d)
    });
    let mut d = [1.0f32; 3];
    g0.all_reduce_sum(&mut d).unwrap();
    assert_eq!(d, [3.0; 3]);
    assert_eq!(t.join().unwrap().unwrap(), [3.0; 3]);
    assert_eq!(hub.failure(), None);
}

#[test]
fn a_rank_sending_an_oversized_frame_breaks_the_group_without_allocating() {
    let hub = TcpAllReduceHub::start(2, "127.0.0.1", TIMEOUT).unwrap();
    let h = hub.handle();
    let g0 = TcpAllReduceGroup::connect(&h, 0).unwrap();
    // A raw "rank 1" announcing an enormous frame.
    let mut s = TcpStream::connect(&h.addr).unwrap();
    s.write_all(&hello(2, 1)).unwrap();
    let mut ack = [0u8; 24];
    s.read_exact(&mut ack).unwrap();
    assert_eq!(ack[8], 0);
    let mut frame = (u64::MAX - 1).to_le_bytes().to_vec();
    frame.extend_from_slice(&(u64::MAX - 1).to_le_bytes());
    s.write_all(&frame).unwrap();
    let start = Instant::now();
    let err = g0.all_reduce_sum(&mut [1.0; 4]).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(err.to_string().contains(&h.addr), "{err}");
    assert!(
        hub.failure().unwrap().contains("malformed frame"),
        "{:?}",
        hub.failure()
    );
}

#[test]
fn bad_parameters_are_refused() {
    assert!(TcpAllReduceHub::start(0, "127.0.0.1", TIMEOUT).is_err());
    assert!(TcpAllReduceHub::start(65, "127.0.0.1", TIMEOUT).is_err());
    assert!(TcpAllReduceHub::start(2, "127.0.0.1", Duration::ZERO).is_err());
    assert!(TcpAllReduceHub::start(2, "127.0.0.1:notaport", TIMEOUT).is_err());
    let hub = TcpAllReduceHub::start(2, "[::1]", TIMEOUT);
    if let Ok(hub) = hub {
        assert!(hub.handle().addr.starts_with("[::1]:"));
    }
    let hub = TcpAllReduceHub::start(2, "localhost:0", TIMEOUT).unwrap();
    let err = TcpAllReduceGroup::connect(&hub.handle(), 2)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("rank 2 does not exist"), "{err}");
    // Nothing listening: refused after the bounded retry, naming the address.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let handle = TcpAllReduceHandle {
        addr: addr.clone(),
        world_size: 2,
        timeout: TIMEOUT,
    };
    let start = Instant::now();
    let err = TcpAllReduceGroup::connect(&handle, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(start.elapsed() < Duration::from_secs(15));
    assert!(
        err.contains(&addr) && err.contains("cannot connect"),
        "{err}"
    );
}

#[test]
fn handles_round_trip_through_serde() {
    let h = GroupHandle::Tcp(TcpAllReduceHandle {
        addr: "10.0.0.1:4000".into(),
        world_size: 4,
        timeout: Duration::from_millis(1500),
    });
    let back: GroupHandle = serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
    assert_eq!(back, h);
    assert_eq!(back.world_size(), 4);
}
