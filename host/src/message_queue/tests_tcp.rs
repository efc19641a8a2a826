//! Remote readers over TCP (`tcp/`), all on 127.0.0.1 with threads for
//! processes: mixed and all-remote queues, timeouts, lost connections,
//! shutdown, and hostile peers on either side of a connection.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use super::tests::small_ring;
use super::*;

const SEC: Option<Duration> = Some(Duration::from_secs(10));
const READY: Duration = Duration::from_secs(10);

/// The payload of message `seq`: sizes around and far beyond a chunk of
/// `chunk` bytes; bytes that depend on `seq`, so a mix-up shows.
fn payload(seq: u64, chunk: usize) -> Vec<u8> {
    let sizes = [
        1,
        7,
        chunk - 1,
        chunk,
        chunk + 1,
        3 * chunk + 5,
        0,
        64,
        70_000,
    ];
    let len = sizes[seq as usize % sizes.len()];
    (0..len)
        .map(|i| (seq as usize * 31 + i * 7) as u8)
        .collect()
}

/// An all-remote writer on loopback for `n` readers.
fn remote_writer(n: usize) -> MessageQueue {
    let ranks: Vec<usize> = (0..n).collect();
    MessageQueue::new_writer_with_remote(n, &ranks, "127.0.0.1", small_ring(4, 256)).unwrap()
}

/// A writer with one remote reader, connected and ready.
fn remote_pair() -> (MessageQueue, MessageQueue) {
    let writer = remote_writer(1);
    let reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).unwrap();
    writer.wait_until_ready(READY).unwrap();
    (writer, reader)
}

#[track_caller]
fn assert_lost<T: std::fmt::Debug>(
    result: Result<T, QueueError>,
    want_rank: usize,
    words: &[&str],
) -> String {
    match result {
        Err(err @ QueueError::ConnectionLost { rank, .. }) if rank == want_rank => {
            let text = err.to_string();
            for word in words {
                assert!(text.contains(word), "{word:?} missing from: {text}");
            }
            text
        }
        other => panic!("expected ConnectionLost for rank {want_rank}, got {other:?}"),
    }
}

#[test]
fn a_mixed_queue_delivers_every_message_in_order_to_local_and_remote_readers() {
    const CHUNK: usize = 256;
    const N: u64 = 200;
    let writer =
        MessageQueue::new_writer_with_remote(3, &[1], "127.0.0.1", small_ring(4, CHUNK)).unwrap();
    let handle = writer.export_handle();
    assert_eq!(handle.local_reader_ranks, [0, 2]);
    assert!(handle.shm.is_some());
    let addr = handle.remote_addr.clone().expect("a remote rank");
    assert!(
        addr.starts_with("127.0.0.1:") && !addr.ends_with(":0"),
        "{addr}"
    );
    let big: Vec<u32> = (0..1000).collect();
    let readers: Vec<_> = (0..3)
        .map(|rank| {
            let (h, big) = (handle.clone(), big.clone());
            thread::spawn(move || {
                let q = MessageQueue::create_from_handle(&h, rank).unwrap();
                assert_eq!(q.rank(), Some(rank));
                for seq in 0..N {
                    let got = q.dequeue_bytes(SEC).unwrap();
                    assert_eq!(got, payload(seq, CHUNK), "reader {rank}, message {seq}");
                }
                // Typed messages: inline and overflowing the chunk.
                assert_eq!(q.dequeue::<(String, u32)>(SEC).unwrap(), ("step".into(), 7));
                assert_eq!(q.dequeue::<Vec<u32>>(SEC).unwrap(), big);
                let len = q.dequeue_with(SEC, |bytes| bytes.len()).unwrap();
                assert_eq!(len, 3);
                assert!(matches!(q.dequeue_bytes(SEC), Err(QueueError::Shutdown)));
            })
        })
        .collect();
    writer.wait_until_ready(READY).unwrap();
    for seq in 0..N {
        writer.enqueue_bytes(&payload(seq, CHUNK), SEC).unwrap();
    }
    writer.enqueue(&("step", 7u32), SEC).unwrap();
    writer.enqueue(&big, SEC).unwrap();
    writer
        .enqueue_with(3, SEC, |buf| buf.copy_from_slice(b"abc"))
        .unwrap();
    writer.shutdown();
    readers.into_iter().for_each(|r| r.join().expect("reader"));
}

#[test]
fn missing_readers_are_named_by_rank_and_enqueue_waits_for_the_remote_ones() {
    let writer =
        MessageQueue::new_writer_with_remote(3, &[1], "127.0.0.1", small_ring(2, 64)).unwrap();
    let handle = writer.export_handle();
    // Nothing attached: rank 2 is the ring's slot 1, but is named as rank 2.
    let err = writer
        .wait_until_ready(Duration::from_millis(50))
        .unwrap_err();
    assert!(
        matches!(&err, QueueError::NotReady { missing, .. } if missing == &[0, 1, 2]),
        "{err}"
    );
    assert!(
        matches!(
            writer.enqueue_bytes(b"x", SEC),
            Err(QueueError::WrongRole(_))
        ),
        "enqueue must wait for wait_until_ready to accept the remote readers"
    );
    let _r0 = MessageQueue::create_from_handle(&handle, 0).unwrap();
    let _r1 = MessageQueue::create_from_handle(&handle, 1).unwrap();
    let err = writer
        .wait_until_ready(Duration::from_millis(50))
        .unwrap_err();
    assert!(
        matches!(&err, QueueError::NotReady { missing, .. } if missing == &[2]),
        "{err}"
    );
    assert!(matches!(
        MessageQueue::create_from_handle(&handle, 3),
        Err(QueueError::BadRank { rank: 3, .. })
    ));
    assert!(MessageQueue::new_writer_with_remote(2, &[2], "127.0.0.1", small_ring(2, 64)).is_err());
    assert!(
        MessageQueue::new_writer_with_remote(2, &[1, 1], "127.0.0.1", small_ring(2, 64)).is_err()
    );
    assert!(matches!(
        MessageQueue::new_writer_with_remote(2, &[1], "no such host", small_ring(2, 64)),
        Err(QueueError::InvalidConfig(_))
    ));
}

#[test]
fn an_all_remote_queue_carries_requests_and_responses() {
    const WORKERS: usize = 2;
    const CALLS: u32 = 50;
    let requests = remote_writer(WORKERS);
    let handle = requests.export_handle();
    assert_eq!(handle.shm, None);
    assert!(handle.local_reader_ranks.is_empty());
    let (handles_tx, handles_rx) = mpsc::channel();
    let workers: Vec<_> = (0..WORKERS)
        .map(|rank| {
            let (h, tx) = (handle.clone(), handles_tx.clone());
            thread::spawn(move || {
                let rpc = MessageQueue::create_from_handle(&h, rank).unwrap();
                let replies = remote_writer(1);
                tx.send((rank, replies.export_handle())).unwrap();
                replies.wait_until_ready(READY).unwrap();
                loop {
                    match rpc.dequeue::<(String, u32)>(SEC) {
                        Ok((method, x)) => {
                            assert_eq!(method, "square");
                            replies.enqueue(&(rank, x * x), SEC).unwrap();
                        }
                        Err(QueueError::Shutdown) => return,
                        Err(e) => panic!("worker {rank}: {e}"),
                    }
                }
            })
        })
        .collect();
    requests.wait_until_ready(READY).unwrap();
    let mut replies: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (rank, h) = handles_rx.recv_timeout(READY).unwrap();
            assert_eq!(h.shm, None);
            (rank, MessageQueue::create_from_handle(&h, 0).unwrap())
        })
        .collect();
    replies.sort_by_key(|(rank, _)| *rank);
    for x in 0..CALLS {
        requests.enqueue(&("square", x), SEC).unwrap();
        for (rank, q) in &replies {
            assert_eq!(q.dequeue::<(usize, u32)>(SEC).unwrap(), (*rank, x * x));
        }
    }
    requests.shutdown();
    workers.into_iter().for_each(|w| w.join().expect("worker"));
    // The workers dropped their reply writers: an orderly end.
    for (_, q) in &replies {
        assert!(matches!(q.dequeue_bytes(SEC), Err(QueueError::Shutdown)));
    }
}

#[test]
fn a_tcp_dequeue_times_out_with_a_clear_error_and_the_next_message_still_arrives() {
    let (writer, reader) = remote_pair();
    let start = Instant::now();
    let err = reader
        .dequeue_bytes(Some(Duration::from_millis(300)))
        .unwrap_err();
    let took = start.elapsed();
    match &err {
        QueueError::Timeout {
            rank: 0,
            seq: 0,
            writer_pid,
            ..
        } => assert_eq!(*writer_pid, std::process::id(), "from the welcome"),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
    writer.enqueue_bytes(b"late", SEC).unwrap();
    assert_eq!(reader.dequeue_bytes(SEC).unwrap(), b"late");
}

#[test]
fn a_writer_that_dies_leaves_its_tcp_reader_a_lost_connection_naming_the_address() {
    let (writer, reader) = remote_pair();
    let addr = writer.export_handle().remote_addr.unwrap();
    writer.enqueue_bytes(b"last words", SEC).unwrap();
    // A writer dropped while panicking has not finished: it closes the
    // sockets without a shutdown frame, as a killed process would.
    let crash = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _writer = writer;
        panic!("simulated crash of the writer (expected by this test)");
    }));
    assert!(crash.is_err());
    assert_eq!(reader.dequeue_bytes(SEC).unwrap(), b"last words");
    let text = assert_lost(
        reader.dequeue_bytes(SEC),
        0,
        &[&addr, "reader rank 0", "closed"],
    );
    assert!(text.contains("between frames"), "{text}");
    // It stays lost.
    assert_lost(reader.dequeue_bytes(SEC), 0, &[&addr]);
}

#[test]
fn a_remote_reader_that_dies_fails_the_writers_next_enqueues_naming_its_rank() {
    let writer = remote_writer(2);
    let handle = writer.export_handle();
    let r0 = MessageQueue::create_from_handle(&handle, 0).unwrap();
    let r1 = MessageQueue::create_from_handle(&handle, 1).unwrap();
    writer.wait_until_ready(READY).unwrap();
    drop(r1);
    // The first send may land in the kernel's buffer; the reset comes back
    // for a later one.
    let mut sent = 0;
    let text = loop {
        assert!(sent < 50, "50 sends to a closed connection all succeeded");
        let result = writer.enqueue_bytes(&[sent as u8; 100], SEC);
        sent += 1;
        if result.is_err() {
            break assert_lost(
                result,
                1,
                &["reader rank 1", "127.0.0.1:", "sending message"],
            );
        }
        thread::sleep(Duration::from_millis(10));
    };
    assert!(!text.contains("earlier"), "{text}");
    // The healthy reader got every message, the failing one included.
    for i in 0..sent {
        assert_eq!(r0.dequeue_bytes(SEC).unwrap(), [i as u8; 100]);
    }
    // Every later enqueue fails up front, before anyone gets the message.
    assert_lost(writer.enqueue_bytes(b"x", SEC), 1, &["earlier"]);
    assert!(matches!(
        r0.dequeue_bytes(Some(Duration::from_millis(100))),
        Err(QueueError::Timeout { .. })
    ));
}

#[test]
fn shutdown_reaches_a_tcp_reader_after_the_messages_before_it() {
    let (writer, reader) = remote_pair();
    for i in 0..3u8 {
        writer.enqueue_bytes(&[i], SEC).unwrap();
    }
    writer.shutdown();
    assert!(matches!(
        writer.enqueue_bytes(b"x", SEC),
        Err(QueueError::Shutdown)
    ));
    for i in 0..3u8 {
        assert_eq!(reader.dequeue_bytes(SEC).unwrap(), [i]);
    }
    assert!(matches!(
        reader.dequeue_bytes(SEC),
        Err(QueueError::Shutdown)
    ));
    assert!(matches!(
        reader.dequeue_bytes(SEC),
        Err(QueueError::Shutdown)
    ));

    // Dropping the writer is an orderly shutdown too.
    let (writer, reader) = remote_pair();
    drop(writer);
    assert!(matches!(
        reader.dequeue_bytes(SEC),
        Err(QueueError::Shutdown)
    ));

    // A reader's shutdown stops that reader.
    let (_writer, reader) = remote_pair();
    reader.shutdown();
    assert!(matches!(
        reader.dequeue_bytes(SEC),
        Err(QueueError::Shutdown)
    ));
}

/// A raw connection to `addr` that sends `bytes`.
fn raw_peer(addr: &str, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(bytes).unwrap();
    s
}

fn hello(magic: &[u8; 8], version: u32, rank: u64) -> Vec<u8> {
    let mut h = magic.to_vec();
    h.extend_from_slice(&version.to_le_bytes());
    h.extend_from_slice(&rank.to_le_bytes());
    h
}

/// What the writer told a refused raw peer (a REJECT frame's reason).
fn refusal(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = [0; 9];
    s.read_exact(&mut head).unwrap();
    assert_eq!(head[0], 3, "a REJECT frame");
    let len = u64::from_le_bytes(head[1..].try_into().unwrap()) as usize;
    assert!(len <= 1024);
    let mut reason = vec![0; len];
    s.read_exact(&mut reason).unwrap();
    String::from_utf8(reason).unwrap()
}

#[test]
fn hostile_connections_are_refused_with_a_reason_and_do_not_keep_real_readers_out() {
    let writer = remote_writer(2);
    let handle = writer.export_handle();
    let addr = handle.remote_addr.clone().unwrap();
    let mut garbage = raw_peer(&addr, &[0xAB; 20]);
    let mut out_of_range = raw_peer(&addr, &hello(b"hostmqT1", HANDLE_VERSION, 7));
    let mut huge_rank = raw_peer(&addr, &hello(b"hostmqT1", HANDLE_VERSION, u64::MAX));
    let mut old_build = raw_peer(&addr, &hello(b"hostmqT1", 1, 0));
    let silent = raw_peer(&addr, b"hostm");
    let r0 = MessageQueue::create_from_handle(&handle, 0).unwrap();
    // Long enough for the silent peer's hello deadline (2 s) to pass.
    let start = Instant::now();
    let err = writer
        .wait_until_ready(Duration::from_millis(2500))
        .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    let QueueError::NotReady {
        missing, rejected, ..
    } = &err
    else {
        panic!("expected NotReady, got {err:?}");
    };
    assert_eq!(missing, &[1]);
    let text = err.to_string();
    for (peer, words) in [
        (&garbage, "not the reader magic"),
        (&out_of_range, "rank 7"),
        (&huge_rank, "rank 18446744073709551615"),
        (&old_build, "version 1"),
        (&silent, "sent 5 of the 20 hello bytes"),
    ] {
        let peer = peer.local_addr().unwrap().to_string();
        assert!(
            rejected
                .iter()
                .any(|r| r.contains(&peer) && r.contains(words)),
            "{peer}: {words:?} missing from {text}"
        );
    }
    assert!(refusal(&mut garbage).contains("magic"));
    assert!(refusal(&mut out_of_range).contains("rank 7"));
    assert!(refusal(&mut huge_rank).contains("0..2"));
    assert!(refusal(&mut old_build).contains("same build"));

    // A second connection for a rank already taken is refused, and a real
    // reader that tries it hears why.
    let mut duplicate = raw_peer(&addr, &hello(b"hostmqT1", HANDLE_VERSION, 0));
    let err = writer
        .wait_until_ready(Duration::from_millis(300))
        .unwrap_err();
    assert!(err.to_string().contains("already connected"), "{err}");
    assert!(refusal(&mut duplicate).contains("already connected"));
    let twin = MessageQueue::create_from_handle(&handle, 0).unwrap();
    let r1 = MessageQueue::create_from_handle(&handle, 1).unwrap();
    writer.wait_until_ready(READY).unwrap();
    writer.enqueue_bytes(b"ok", SEC).unwrap();
    assert_eq!(r0.dequeue_bytes(SEC).unwrap(), b"ok");
    assert_eq!(r1.dequeue_bytes(SEC).unwrap(), b"ok");
    // The twin was left in the closed listener's backlog, or refused.
    assert!(matches!(
        twin.dequeue_bytes(SEC),
        Err(QueueError::ConnectionLost { rank: 0, .. })
    ));
}

#[test]
fn a_reader_refused_by_the_writer_says_why() {
    // Rank 1 never connects, so the writer keeps listening and sees the twin.
    let writer = remote_writer(2);
    let handle = writer.export_handle();
    let _first = MessageQueue::create_from_handle(&handle, 0).unwrap();
    let _ = writer.wait_until_ready(Duration::from_millis(200));
    let twin = MessageQueue::create_from_handle(&handle, 0).unwrap();
    let _ = writer.wait_until_ready(Duration::from_millis(200));
    assert_lost(
        twin.dequeue_bytes(SEC),
        0,
        &["the writer refused reader rank 0", "already connected"],
    );
}

/// A fake writer: a listener, and the handle that points readers at it.
fn fake_writer() -> (TcpListener, Handle) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let handle = Handle {
        version: HANDLE_VERSION,
        n_readers: 1,
        local_reader_ranks: Vec::new(),
        shm: None,
        remote_addr: Some(listener.local_addr().unwrap().to_string()),
    };
    (listener, handle)
}

/// Accepts the reader, checks its hello and welcomes it.
fn accept_reader(listener: &TcpListener) -> TcpStream {
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = [0; 20];
    s.read_exact(&mut got).unwrap();
    assert_eq!(got.to_vec(), hello(b"hostmqT1", HANDLE_VERSION, 0));
    s.write_all(&frame(2, &4242u32.to_le_bytes())).unwrap();
    s
}

fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

#[track_caller]
fn assert_corrupt<T: std::fmt::Debug>(result: Result<T, QueueError>, words: &[&str]) {
    match result {
        Err(err @ QueueError::Corrupt { .. }) => {
            let text = err.to_string();
            for word in words {
                assert!(text.contains(word), "{word:?} missing from: {text}");
            }
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn a_huge_frame_length_is_corrupt_before_anything_is_allocated() {
    let (listener, handle) = fake_writer();
    let reader = MessageQueue::create_from_handle(&handle, 0).unwrap();
    let mut s = accept_reader(&listener);
    s.write_all(&frame(0, b"fine")).unwrap();
    assert_eq!(reader.dequeue_bytes(SEC).unwrap(), b"fine");
    let mut head = vec![0u8];
    head.extend_from_slice(&(1u64 << 60).to_le_bytes());
    s.write_all(&head).unwrap();
    let start = Instant::now();
    assert_corrupt(
        reader.dequeue_bytes(SEC),
        &["frame length 1152921504606846976", "tcp://127.0.0.1:"],
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    // The stream is desynchronised for good.
    assert_corrupt(reader.dequeue_bytes(SEC), &["frame length"]);
}

#[test]
fn every_bad_frame_from_a_writer_is_an_error_not_a_panic_or_a_hang() {
    let cases: [(&[u8], &str); 5] = [
        (&frame(9, b""), "frame kind 9"),
        (&frame(1, b"x"), "frame length 1 for kind 1"),
        (&frame(2, b"12345"), "frame length 5 for kind 2"),
        (&frame(3, &[b'r'; 2000]), "frame length 2000 for kind 3"),
        (&frame(2, &4242u32.to_le_bytes()), "a second welcome"),
    ];
    for (bytes, words) in cases {
        let (listener, handle) = fake_writer();
        let reader = MessageQueue::create_from_handle(&handle, 0).unwrap();
        let mut s = accept_reader(&listener);
        s.write_all(bytes).unwrap();
        match reader.dequeue_bytes(SEC) {
            Err(err @ QueueError::Corrupt { .. }) if err.to_string().contains(words) => {}
            other => panic!("{words:?}: got {other:?}"),
        }
    }
    // A message before the welcome, and a welcome naming pid 0.
    for (bytes, words) in [
        (frame(0, b"hi"), "before the writer's welcome"),
        (frame(2, &[0; 4]), "pid 0"),
    ] {
        let (listener, handle) = fake_writer();
        let reader = MessageQueue::create_from_handle(&handle, 0).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(&bytes).unwrap();
        assert_corrupt(reader.dequeue_bytes(SEC), &[words]);
    }
}

#[test]
fn a_frame_cut_by_a_timeout_resumes_and_one_cut_by_the_writer_is_a_lost_connection() {
    let (listener, handle) = fake_writer();
    let reader = MessageQueue::create_from_handle(&handle, 0).unwrap();
    let mut s = accept_reader(&listener);
    let whole = frame(0, b"split across two dequeues");
    s.write_all(&whole[..5]).unwrap();
    assert!(matches!(
        reader.dequeue_bytes(Some(Duration::from_millis(100))),
        Err(QueueError::Timeout {
            writer_pid: 4242,
            ..
        })
    ));
    s.write_all(&whole[5..15]).unwrap();
    assert!(matches!(
        reader.dequeue_bytes(Some(Duration::from_millis(100))),
        Err(QueueError::Timeout { .. })
    ));
    s.write_all(&whole[15..]).unwrap();
    assert_eq!(
        reader.dequeue_bytes(SEC).unwrap(),
        b"split across two dequeues"
    );
    // A gigabyte claimed, ten bytes sent, then the writer is gone: the
    // reader reports where the stream broke (and held one growth step).
    let mut head = vec![0u8];
    head.extend_from_slice(&(1u64 << 30).to_le_bytes());
    s.write_all(&head).unwrap();
    s.write_all(&[7; 10]).unwrap();
    drop(s);
    assert_lost(
        reader.dequeue_bytes(SEC),
        0,
        &["10 of 1073741824 payload bytes", "closed the connection"],
    );
}

#[test]
fn a_damaged_or_unreachable_remote_addr_is_a_clear_error() {
    let (listener, mut handle) = fake_writer();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    handle.remote_addr = Some("not an address".into());
    assert!(matches!(
        MessageQueue::create_from_handle(&handle, 0),
        Err(QueueError::Corrupt { .. })
    ));
    handle.remote_addr = Some(addr.clone());
    let start = Instant::now();
    let err = MessageQueue::create_from_handle(&handle, 0).err().unwrap();
    let took = start.elapsed();
    assert_lost(
        Err::<(), _>(err),
        0,
        &[&addr, "could not connect to the writer within"],
    );
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(8),
        "{took:?}"
    );
}
