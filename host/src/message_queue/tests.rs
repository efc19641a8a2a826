//! Thread-level tests of the queue; cross-process tests live in
//! `tests/message_queue.rs`.

use std::thread;
use std::time::{Duration, Instant};

use super::*;

const SEC: Option<Duration> = Some(Duration::from_secs(10));

pub(super) fn small_ring(n_chunks: usize, max_chunk_bytes: usize) -> QueueConfig {
    QueueConfig {
        n_chunks,
        max_chunk_bytes,
        ..QueueConfig::default()
    }
}

/// The payload of message `seq`: its length cycles through sizes around and
/// far beyond the chunk size; its bytes depend on `seq`, so a mix-up shows.
fn payload(seq: u64, chunk: usize) -> Vec<u8> {
    let sizes = [1, 7, chunk - 1, chunk, chunk + 1, 3 * chunk + 5, 0, 64];
    let len = sizes[seq as usize % sizes.len()];
    (0..len)
        .map(|i| (seq as usize * 31 + i * 7) as u8)
        .collect()
}

fn names_of(handle: &Handle) -> Vec<String> {
    let base = handle
        .shm
        .as_ref()
        .expect("local segment")
        .name
        .trim_start_matches('/')
        .to_string();
    shm_names()
        .into_iter()
        .filter(|n| n == &base || n.starts_with(&format!("{base}-")))
        .collect()
}

#[test]
fn every_message_reaches_every_reader_once_in_order_with_slow_and_fast_readers() {
    const CHUNK: usize = 256;
    const N: u64 = 1500;
    let writer = MessageQueue::new_writer(3, small_ring(4, CHUNK)).unwrap();
    let handle = writer.export_handle();
    let readers: Vec<_> = (0..3)
        .map(|rank| {
            let h = handle.clone();
            thread::spawn(move || {
                let q = MessageQueue::create_from_handle(&h, rank).unwrap();
                for seq in 0..N {
                    let got = q.dequeue_bytes(SEC).unwrap();
                    assert_eq!(got, payload(seq, CHUNK), "reader {rank}, message {seq}");
                    // Reader 2 is slow: it keeps the ring full now and then.
                    if rank == 2 && seq % 100 == 0 {
                        thread::sleep(Duration::from_millis(5));
                    }
                }
                assert!(matches!(q.dequeue_bytes(SEC), Err(QueueError::Shutdown)));
            })
        })
        .collect();
    writer.wait_until_ready(Duration::from_secs(10)).unwrap();
    assert!(
        names_of(&handle).is_empty(),
        "the name must be unlinked once all attached"
    );
    for seq in 0..N {
        writer.enqueue_bytes(&payload(seq, CHUNK), SEC).unwrap();
    }
    writer.shutdown();
    readers.into_iter().for_each(|r| r.join().expect("reader"));
    drop(writer);
    assert!(
        names_of(&handle).is_empty(),
        "overflow segments left: {:?}",
        names_of(&handle)
    );
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Rpc {
    method: String,
    args: Vec<u32>,
}

#[test]
fn typed_messages_round_trip_inline_and_through_overflow() {
    let writer = MessageQueue::new_writer(1, small_ring(2, 128)).unwrap();
    let reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).unwrap();
    let small = Rpc {
        method: "execute_model".into(),
        args: vec![1, 2, 3],
    };
    let big = Rpc {
        method: "load".into(),
        args: (0..10_000).collect(),
    };
    writer.enqueue(&small, SEC).unwrap();
    writer.enqueue(&big, SEC).unwrap();
    assert_eq!(reader.dequeue::<Rpc>(SEC).unwrap(), small);
    assert_eq!(reader.dequeue::<Rpc>(SEC).unwrap(), big);
}

#[test]
fn a_bad_frame_is_a_decode_error_and_the_stream_goes_on() {
    let writer = MessageQueue::new_writer(1, small_ring(2, 128)).unwrap();
    let reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).unwrap();
    writer.enqueue_bytes(&[0xff; 3], SEC).unwrap();
    writer.enqueue(&7u32, SEC).unwrap();
    assert!(matches!(
        reader.dequeue::<Rpc>(SEC),
        Err(QueueError::Decode { len: 3, .. })
    ));
    assert_eq!(reader.dequeue::<u32>(SEC).unwrap(), 7);
}

#[test]
fn a_full_ring_names_the_reader_that_is_behind() {
    let writer = MessageQueue::new_writer(2, small_ring(2, 64)).unwrap();
    let handle = writer.export_handle();
    let fast = MessageQueue::create_from_handle(&handle, 0).unwrap();
    let _slow = MessageQueue::create_from_handle(&handle, 1).unwrap();
    for seq in 0..2u8 {
        writer.enqueue_bytes(&[seq], SEC).unwrap();
        assert_eq!(fast.dequeue_bytes(SEC).unwrap(), [seq]);
    }
    let err = writer
        .enqueue_bytes(&[2], Some(Duration::from_millis(50)))
        .unwrap_err();
    match &err {
        QueueError::Full {
            seq: 2,
            oldest: 0,
            behind,
            ..
        } => {
            assert_eq!(
                behind,
                &[ReaderLag {
                    rank: 1,
                    pid: Some(std::process::id()),
                    alive: true
                }]
            );
        }
        other => panic!("expected Full, got {other:?}"),
    }
    assert!(err.to_string().contains("reader 1"), "{err}");
}

#[test]
fn a_reader_that_never_attached_is_reported_as_such() {
    let writer = MessageQueue::new_writer(2, small_ring(1, 64)).unwrap();
    let reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).unwrap();
    writer.enqueue_bytes(b"x", SEC).unwrap();
    reader.dequeue_bytes(SEC).unwrap();
    match writer.enqueue_bytes(b"y", Some(Duration::from_millis(20))) {
        Err(QueueError::Full { behind, .. }) => assert_eq!(
            behind,
            [ReaderLag {
                rank: 1,
                pid: None,
                alive: true
            }]
        ),
        other => panic!("expected Full, got {other:?}"),
    }
    let err = writer
        .wait_until_ready(Duration::from_millis(20))
        .unwrap_err();
    assert!(
        matches!(err, QueueError::NotReady { ref missing, .. } if missing == &[1]),
        "{err}"
    );
}

#[test]
fn dequeue_times_out_with_a_clear_error() {
    let writer = MessageQueue::new_writer(1, QueueConfig::default()).unwrap();
    let reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).unwrap();
    let start = Instant::now();
    let err = reader
        .dequeue_bytes(Some(Duration::from_millis(300)))
        .unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(
            err,
            QueueError::Timeout {
                rank: 0,
                seq: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
}

#[test]
fn shutdown_wakes_a_sleeping_reader_and_a_blocked_writer() {
    let writer = MessageQueue::new_writer(1, small_ring(1, 64)).unwrap();
    let handle = writer.export_handle();
    let reader = MessageQueue::create_from_handle(&handle, 0).unwrap();
    // The reader sleeps on the futex (its spin window is long past) ...
    let t = thread::spawn(move || {
        let start = Instant::now();
        (reader.dequeue_bytes(None), start.elapsed())
    });
    thread::sleep(Duration::from_millis(50));
    writer.shutdown();
    let (r, took) = t.join().expect("reader");
    assert!(matches!(r, Err(QueueError::Shutdown)), "{r:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(matches!(
        writer.enqueue_bytes(b"late", SEC),
        Err(QueueError::Shutdown)
    ));

    // ... and a writer blocked on a full ring is woken by a reader's shutdown.
    let writer = MessageQueue::new_writer(1, small_ring(1, 64)).unwrap();
    let reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).unwrap();
    writer.enqueue_bytes(b"fills the ring", SEC).unwrap();
    let t = thread::spawn(move || writer.enqueue_bytes(b"blocked", None));
    thread::sleep(Duration::from_millis(50));
    reader.shutdown();
    assert!(matches!(
        t.join().expect("writer"),
        Err(QueueError::Shutdown)
    ));
}

#[test]
fn readers_drain_what_was_sent_before_shutdown() {
    let writer = MessageQueue::new_writer(1, small_ring(4, 64)).unwrap();
    let reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).unwrap();
    writer.enqueue_bytes(b"a", SEC).unwrap();
    writer.enqueue_bytes(b"b", SEC).unwrap();
    drop(writer);
    assert_eq!(reader.dequeue_bytes(SEC).unwrap(), b"a");
    assert_eq!(reader.dequeue_bytes(SEC).unwrap(), b"b");
    assert!(matches!(
        reader.dequeue_bytes(SEC),
        Err(QueueError::Shutdown)
    ));
}

#[test]
fn misuse_is_a_clear_error() {
    assert!(matches!(
        MessageQueue::new_writer(0, QueueConfig::default()),
        Err(QueueError::InvalidConfig(_))
    ));
    assert!(matches!(
        MessageQueue::new_writer(65, QueueConfig::default()),
        Err(QueueError::InvalidConfig(_))
    ));
    assert!(matches!(
        MessageQueue::new_writer(1, small_ring(0, 64)),
        Err(QueueError::InvalidConfig(_))
    ));
    assert!(matches!(
        MessageQueue::new_writer(1, small_ring(2, 0)),
        Err(QueueError::InvalidConfig(_))
    ));
    let writer = MessageQueue::new_writer(2, QueueConfig::default()).unwrap();
    let handle = writer.export_handle();
    let reader = MessageQueue::create_from_handle(&handle, 0).unwrap();
    assert!(matches!(
        MessageQueue::create_from_handle(&handle, 0),
        Err(QueueError::AlreadyAttached { rank: 0, .. })
    ));
    assert!(matches!(
        MessageQueue::create_from_handle(&handle, 2),
        Err(QueueError::BadRank { rank: 2, .. })
    ));
    assert!(matches!(
        writer.dequeue_bytes(SEC),
        Err(QueueError::WrongRole(_))
    ));
    assert!(matches!(
        reader.enqueue_bytes(b"x", SEC),
        Err(QueueError::WrongRole(_))
    ));
    let mut remote = handle.clone();
    remote.local_reader_ranks = vec![0];
    // Rank 1 is now remote; an address that is not ip:port is a damaged handle.
    remote.remote_addr = Some("tcp://10.0.0.2:5555".into());
    assert!(matches!(
        MessageQueue::create_from_handle(&remote, 1),
        Err(QueueError::Corrupt { .. })
    ));
    let mut future = handle.clone();
    future.version += 1;
    assert!(matches!(
        MessageQueue::create_from_handle(&future, 1),
        Err(QueueError::Unsupported(_))
    ));
    let mut lying = handle.clone();
    lying.shm.as_mut().unwrap().n_chunks += 1;
    assert!(matches!(
        MessageQueue::create_from_handle(&lying, 1),
        Err(QueueError::Corrupt { .. })
    ));
}

#[test]
fn the_handle_survives_serialisation() {
    let writer = MessageQueue::new_writer(2, QueueConfig::default()).unwrap();
    let handle = writer.export_handle();
    let json = serde_json::to_string(&handle).unwrap();
    let back: Handle = serde_json::from_str(&json).unwrap();
    assert_eq!(back, handle);
    assert_eq!(decode::<Handle>(&encode(&handle).unwrap()).unwrap(), handle);
}

#[test]
fn dropping_the_writer_removes_every_name_including_unread_overflow() {
    let writer = MessageQueue::new_writer(2, small_ring(4, 64)).unwrap();
    let handle = writer.export_handle();
    let reader = MessageQueue::create_from_handle(&handle, 0).unwrap();
    writer.enqueue_bytes(&[1; 1000], SEC).unwrap();
    assert_eq!(
        names_of(&handle).len(),
        2,
        "main segment (reader 1 missing) and one overflow segment"
    );
    assert_eq!(reader.dequeue_bytes(SEC).unwrap(), vec![1; 1000]);
    drop(writer);
    assert!(
        names_of(&handle).is_empty(),
        "left: {:?}",
        names_of(&handle)
    );
}
