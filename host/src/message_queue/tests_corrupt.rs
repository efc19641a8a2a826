//! A corrupt or hostile peer. Each test writes garbage into one field of a
//! live segment through the raw mapping, as another process could, and
//! checks that the other end answers promptly with [`QueueError::Corrupt`]
//! naming the queue and the field, and never panics or reads out of bounds.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::layout::{Blob, KIND_INLINE, KIND_OVERFLOW};
use super::process::{self, ProcessId};
use super::*;

const SHORT: Option<Duration> = Some(Duration::from_millis(300));
const SEC: Option<Duration> = Some(Duration::from_secs(10));

/// A writer and its one attached reader over a ring of `n_chunks` chunks.
fn pair(n_chunks: usize, max_chunk_bytes: usize) -> (MessageQueue, MessageQueue) {
    let config = QueueConfig {
        n_chunks,
        max_chunk_bytes,
        ..QueueConfig::default()
    };
    let writer = MessageQueue::new_writer(1, config).unwrap();
    let reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).unwrap();
    (writer, reader)
}

/// Asserts that `result` failed with `Corrupt` about `q`'s segment and that
/// the message names the queue and contains every one of `words`.
#[track_caller]
fn assert_corrupt<T>(result: Result<T, QueueError>, q: &MessageQueue, words: &[&str]) {
    let name = q.segment().name();
    match result {
        Err(err @ QueueError::Corrupt { .. }) => {
            let text = err.to_string();
            assert!(
                text.contains(&format!("message queue `{name}` is corrupt")),
                "{text}"
            );
            for word in words {
                assert!(text.contains(word), "{word:?} missing from: {text}");
            }
        }
        Err(other) => panic!("expected Corrupt naming {name}, got {other:?}"),
        Ok(_) => panic!("expected Corrupt naming {name}, got Ok"),
    }
}

#[test]
fn an_inline_length_beyond_the_chunk_is_named_and_the_fixed_chunk_still_reads() {
    let (writer, reader) = pair(2, 64);
    writer.enqueue_bytes(b"hello", SEC).unwrap();
    let len = &writer.segment().meta(0).len;
    for bad in [65, 9_000_000, u64::MAX] {
        len.store(bad, Ordering::Relaxed);
        assert_corrupt(
            reader.dequeue_bytes(SEC),
            &reader,
            &[
                &format!("chunk 0 claims {bad} bytes but a chunk holds 64"),
                "writer",
            ],
        );
    }
    // The error consumed nothing: once the value is sane the message reads.
    len.store(5, Ordering::Relaxed);
    assert_eq!(reader.dequeue_bytes(SEC).unwrap(), b"hello");
}

#[test]
fn an_unknown_kind_is_named() {
    let (writer, reader) = pair(2, 64);
    writer.enqueue_bytes(b"x", SEC).unwrap();
    writer.segment().meta(0).kind.store(7, Ordering::Relaxed);
    assert_corrupt(reader.dequeue_bytes(SEC), &reader, &["chunk 0 has kind 7"]);
}

#[test]
fn an_overflow_length_beyond_its_segment_is_named() {
    let (writer, reader) = pair(2, 64);
    writer.enqueue_bytes(&[3; 1000], SEC).unwrap();
    let meta = writer.segment().meta(0);
    assert_eq!(meta.kind.load(Ordering::Relaxed), KIND_OVERFLOW);
    for bad in [1_000_000, u64::MAX - 10, u64::MAX] {
        meta.len.store(bad, Ordering::Relaxed);
        assert_corrupt(
            reader.dequeue_bytes(SEC),
            &reader,
            &[&format!("claims a {bad}-byte overflow message"), "-o0`"],
        );
    }
    meta.len.store(1000, Ordering::Relaxed);
    assert_eq!(reader.dequeue_bytes(SEC).unwrap(), vec![3; 1000]);
}

#[test]
fn a_garbage_open_count_on_an_overflow_segment_does_not_overflow() {
    let (writer, reader) = pair(2, 64);
    writer.enqueue_bytes(&[4; 500], SEC).unwrap();
    let name = process::overflow_name(writer.segment().name(), 0);
    let blob = Blob::open(writer.segment().name(), &name, 500).unwrap();
    blob.opened().store(u32::MAX, Ordering::Relaxed);
    assert_eq!(reader.dequeue_bytes(SEC).unwrap(), vec![4; 500]);
}

#[test]
fn a_sequence_number_that_skips_ahead_is_an_error_not_a_wrong_message() {
    let (writer, reader) = pair(4, 64);
    writer.enqueue_bytes(b"first", SEC).unwrap();
    for bad in [2, 5, u64::MAX] {
        writer
            .segment()
            .meta(0)
            .written
            .store(bad, Ordering::Relaxed);
        assert_corrupt(
            reader.dequeue_bytes(SEC),
            &reader,
            &[
                &format!("chunk 0's sequence number is {bad}"),
                "skipped ahead",
            ],
        );
    }
}

#[test]
fn a_sequence_number_that_goes_backwards_is_an_error_not_a_hang() {
    let (writer, reader) = pair(2, 64);
    for seq in 0..3u8 {
        writer.enqueue_bytes(&[seq], SEC).unwrap();
        assert_eq!(reader.dequeue_bytes(SEC).unwrap(), [seq]);
    }
    // The reader now waits for message 3 in chunk 1, which holds message 1
    // (sequence number 2) until the writer sends.
    let written = &writer.segment().meta(1).written;
    assert_eq!(written.load(Ordering::Relaxed), 2);
    for bad in [1, 0] {
        written.store(bad, Ordering::Relaxed);
        let start = Instant::now();
        assert_corrupt(
            reader.dequeue_bytes(SEC),
            &reader,
            &[&format!("sequence number is {bad} where reader 0 expects 4 (message 3) or, until it is sent, 2")],
        );
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }
}

#[test]
fn a_bad_header_is_refused_on_attach_field_by_field() {
    let writer = MessageQueue::new_writer(1, QueueConfig::default()).unwrap();
    let handle = writer.export_handle();
    let h = writer.segment().header();
    let magic = h.magic.swap(0xdead_beef, Ordering::Relaxed);
    assert_corrupt(
        MessageQueue::create_from_handle(&handle, 0),
        &writer,
        &["magic is 0x00000000deadbeef"],
    );
    h.magic.store(magic, Ordering::Relaxed);
    let n_readers = h.n_readers.swap(40, Ordering::Relaxed);
    assert_corrupt(
        MessageQueue::create_from_handle(&handle, 0),
        &writer,
        &["the header says n_readers = 40 but the handle says 1"],
    );
    h.n_readers.store(n_readers, Ordering::Relaxed);
    let n_chunks = h.n_chunks.swap(u32::MAX, Ordering::Relaxed);
    assert_corrupt(
        MessageQueue::create_from_handle(&handle, 0),
        &writer,
        &[&format!("n_chunks = {} but the handle says 8", u32::MAX)],
    );
    h.n_chunks.store(n_chunks, Ordering::Relaxed);
    let bytes = h.max_chunk_bytes.swap(u64::MAX, Ordering::Relaxed);
    assert_corrupt(
        MessageQueue::create_from_handle(&handle, 0),
        &writer,
        &["max_chunk_bytes = 18446744073709551615"],
    );
    h.max_chunk_bytes.store(bytes, Ordering::Relaxed);
    MessageQueue::create_from_handle(&handle, 0).expect("the repaired header attaches");
}

#[test]
fn a_bad_handle_is_refused_before_anything_is_mapped() {
    let writer = MessageQueue::new_writer(1, QueueConfig::default()).unwrap();
    let handle = writer.export_handle();
    let with = |edit: &dyn Fn(&mut ShmHandle)| {
        let mut h = handle.clone();
        edit(h.shm.as_mut().unwrap());
        MessageQueue::create_from_handle(&h, 0)
    };
    assert_corrupt(
        with(&|s| s.n_chunks = usize::MAX),
        &writer,
        &["n_chunks = 18446744073709551615"],
    );
    assert_corrupt(with(&|s| s.n_chunks = 0), &writer, &["n_chunks = 0"]);
    assert_corrupt(
        with(&|s| s.max_chunk_bytes = usize::MAX),
        &writer,
        &["max_chunk_bytes"],
    );
    assert_corrupt(
        with(&|s| s.max_chunk_bytes = 64),
        &writer,
        &["max_chunk_bytes = 4194304 but the handle says 64"],
    );
    // More local ranks than a queue has, with a header that agrees (a hostile
    // writer controls both): the slot would index past every per-reader array.
    writer
        .segment()
        .header()
        .n_readers
        .store(100, Ordering::Relaxed);
    let mut many = handle.clone();
    many.n_readers = 100;
    many.local_reader_ranks = (0..100).collect();
    assert_corrupt(
        MessageQueue::create_from_handle(&many, 70),
        &writer,
        &["100 local reader ranks"],
    );
}

#[test]
fn read_flags_cleared_on_a_never_written_chunk_are_named_not_an_underflow() {
    let (writer, _reader) = pair(2, 64);
    writer.segment().meta(0).read.0[0].store(0, Ordering::Relaxed);
    assert_corrupt(
        writer.enqueue_bytes(b"x", SHORT),
        &writer,
        &[
            "chunk 0",
            "none was ever written",
            "reader processes are broken or hostile",
        ],
    );
}

#[test]
fn attached_bits_beyond_the_readers_do_not_block_readiness() {
    let writer = MessageQueue::new_writer(1, QueueConfig::default()).unwrap();
    writer
        .segment()
        .header()
        .attached
        .store(0b110, Ordering::Relaxed);
    let _reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).unwrap();
    writer.wait_until_ready(Duration::from_secs(2)).unwrap();
}

/// Fills the one-chunk ring, sets reader 0's recorded identity, and returns
/// what a blocked enqueue reports about it, and how long that took.
fn blocked_enqueue_with_reader(pid: u32, start_time: u64) -> (ReaderLag, Duration) {
    let (writer, _reader) = pair(1, 64);
    writer.enqueue_bytes(b"unread", SEC).unwrap();
    let h = writer.segment().header();
    h.reader_starts[0].store(start_time, Ordering::Relaxed);
    h.reader_pids[0].store(pid, Ordering::Release);
    let start = Instant::now();
    match writer.enqueue_bytes(b"blocked", Some(Duration::from_secs(1))) {
        Err(QueueError::Full { mut behind, .. }) if behind.len() == 1 => {
            (behind.remove(0), start.elapsed())
        }
        other => panic!("expected Full naming reader 0, got {other:?}"),
    }
}

#[test]
fn a_reader_pid_no_process_can_have_counts_as_dead_at_once() {
    // `kill(-1, 0)` would succeed: u32::MAX must not reach kill as a pid_t.
    for pid in [u32::MAX, 1 << 31] {
        let (lag, took) = blocked_enqueue_with_reader(pid, 0);
        assert!(!lag.alive, "pid {pid}: {lag}");
        assert!(
            took < Duration::from_millis(900),
            "pid {pid}: waited {took:?}"
        );
    }
}

#[test]
fn a_reader_whose_pid_was_reused_counts_as_dead() {
    let me = ProcessId::current();
    let (lag, took) = blocked_enqueue_with_reader(me.pid, me.start_time + 1);
    assert_eq!((lag.pid, lag.alive), (Some(me.pid), false), "{lag}");
    assert!(took < Duration::from_millis(900), "waited {took:?}");
    let (lag, _) = blocked_enqueue_with_reader(me.pid, me.start_time);
    assert!(lag.alive, "the right start time is the live reader: {lag}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever a chunk's metadata and payload hold, a read returns a
    /// message within its mapping or an error, and never panics.
    #[test]
    fn reading_a_garbage_chunk_never_panics(
        payload in prop::collection::vec(any::<u8>(), 0..=200),
        garbage in prop::collection::vec(any::<u8>(), 64),
        len in prop_oneof![0..=250u64, any::<u64>(), u64::MAX - 100..=u64::MAX],
        kind in prop_oneof![Just(KIND_INLINE), Just(KIND_OVERFLOW), any::<u32>()],
        written in prop_oneof![Just(1u64), 0..4u64, any::<u64>()],
        typed in any::<bool>(),
    ) {
        let (writer, reader) = pair(2, 64);
        // Payloads over 64 bytes go to an overflow segment of their own.
        writer.enqueue_bytes(&payload, SEC).unwrap();
        let seg = writer.segment();
        // SAFETY: the test is the only party touching the chunk's payload.
        unsafe { std::ptr::copy_nonoverlapping(garbage.as_ptr(), seg.chunk_ptr(0), 64) };
        let meta = seg.meta(0);
        meta.len.store(len, Ordering::Relaxed);
        meta.kind.store(kind, Ordering::Relaxed);
        meta.written.store(written, Ordering::Release);
        let zero = Some(Duration::ZERO);
        if typed {
            let _ = reader.dequeue::<(String, Vec<u32>, Option<u64>)>(zero);
        } else if let Ok(bytes) = reader.dequeue_bytes(zero) {
            let source = if kind == KIND_INLINE { &garbage } else { &payload };
            prop_assert!(bytes.len() <= source.len());
            prop_assert_eq!(&bytes[..], &source[..bytes.len()]);
        }
    }

    /// Whatever the header's geometry says, attaching is refused or
    /// succeeds, and never panics.
    #[test]
    fn attaching_to_a_garbage_header_never_panics(
        magic_ok in any::<bool>(),
        n_readers in prop_oneof![Just(1u32), any::<u32>()],
        n_chunks in prop_oneof![Just(2u32), any::<u32>()],
        max_chunk_bytes in prop_oneof![Just(64u64), any::<u64>()],
    ) {
        let writer = MessageQueue::new_writer(1, QueueConfig { n_chunks: 2, max_chunk_bytes: 64, ..QueueConfig::default() }).unwrap();
        let h = writer.segment().header();
        if !magic_ok {
            h.magic.store(0, Ordering::Relaxed);
        }
        h.n_readers.store(n_readers, Ordering::Relaxed);
        h.n_chunks.store(n_chunks, Ordering::Relaxed);
        h.max_chunk_bytes.store(max_chunk_bytes, Ordering::Relaxed);
        let sane = magic_ok && (n_readers, n_chunks, max_chunk_bytes) == (1, 2, 64);
        let attached = MessageQueue::create_from_handle(&writer.export_handle(), 0);
        prop_assert_eq!(attached.is_ok(), sane, "{:?}", attached.err());
    }
}
