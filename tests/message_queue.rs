//! The shared-memory message queue across real processes: broadcast order
//! and content, overflow messages, and cleanup of `/dev/shm` when the owner
//! or a reader is SIGKILLed.
//!
//! Child processes re-run this test binary on one test (`--exact`) with
//! `MQ_ROLE` selecting their part; every wait is bounded and a child that
//! overruns is killed.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use host::message_queue::{shm_names, Handle, MessageQueue, QueueConfig, QueueError};

const SEC10: Option<Duration> = Some(Duration::from_secs(10));
const CHUNK: usize = 4096;
const MESSAGES: u64 = 3000;

/// Serialises the parent sides: a new writer sweeps dead owners' segments,
/// which would race with another test's count of them.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The segment names of the queue `handle` describes, overflow ones included.
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

/// The role this process plays, if it is a child.
fn role() -> Option<String> {
    std::env::var("MQ_ROLE").ok()
}

/// Starts this test binary as a child running `test` in `role`.
fn spawn(test: &str, role: &str, handle: Option<&Handle>, rank: usize) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("MQ_ROLE", role)
        .env("MQ_RANK", rank.to_string())
        .stdout(Stdio::piped());
    if let Some(h) = handle {
        cmd.env(
            "MQ_HANDLE",
            serde_json::to_string(h).expect("handle to json"),
        );
    }
    cmd.spawn().expect("spawn child test process")
}

/// Reads the child's stdout until a line starting with `prefix`, with a deadline.
fn read_line_with(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).expect("read child stdout");
        assert!(n > 0, "child exited before printing {prefix}");
        // libtest may print "test <name> ... " on the same line first.
        if let Some(at) = line.find(prefix) {
            return line[at + prefix.len()..].trim_end().to_string();
        }
    }
}

/// Waits for a child to exit, killing it if it runs past `timeout`.
fn wait_or_kill(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child {} hung for {timeout:?} and was killed", child.id());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn kill(child: &mut Child) {
    child.kill().expect("SIGKILL child");
    child.wait().expect("reap child");
}

fn names_owned_by(pid: u32) -> Vec<String> {
    shm_names()
        .into_iter()
        .filter(|n| n.starts_with(&format!("hostmq-{pid}-")))
        .collect()
}

fn env_handle() -> Handle {
    serde_json::from_str(&std::env::var("MQ_HANDLE").expect("MQ_HANDLE")).expect("handle json")
}

/// Message `seq`: sizes from 1 byte to several chunks, content tied to `seq`.
fn payload(seq: u64) -> Vec<u8> {
    let sizes = [1, 64, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 3, 100, 2];
    let len = sizes[seq as usize % sizes.len()];
    (0..len)
        .map(|i| (seq as usize * 131 + i * 17) as u8)
        .collect()
}

#[test]
fn broadcast_reaches_reader_processes_exactly_once_in_order() {
    const TEST: &str = "broadcast_reaches_reader_processes_exactly_once_in_order";
    if role().as_deref() == Some("reader") {
        let rank: usize = std::env::var("MQ_RANK").unwrap().parse().unwrap();
        let q = MessageQueue::create_from_handle(&env_handle(), rank).expect("attach");
        for seq in 0..MESSAGES {
            let got = q.dequeue_bytes(SEC10).expect("dequeue");
            assert_eq!(got, payload(seq), "reader {rank} message {seq}");
            if rank == 1 && seq % 500 == 0 {
                std::thread::sleep(Duration::from_millis(20)); // the slow reader
            }
        }
        assert!(matches!(q.dequeue_bytes(SEC10), Err(QueueError::Shutdown)));
        println!("READ {MESSAGES}");
        return;
    }
    let _serial = serial();
    let config = QueueConfig {
        n_chunks: 4,
        max_chunk_bytes: CHUNK,
        ..QueueConfig::default()
    };
    let writer = MessageQueue::new_writer(2, config).expect("writer");
    let handle = writer.export_handle();
    let mut children: Vec<Child> = (0..2)
        .map(|r| spawn(TEST, "reader", Some(&handle), r))
        .collect();
    writer
        .wait_until_ready(Duration::from_secs(30))
        .expect("readers attach");
    assert!(
        names_of(&handle).is_empty(),
        "the name must go once every reader attached"
    );
    for seq in 0..MESSAGES {
        writer.enqueue_bytes(&payload(seq), SEC10).expect("enqueue");
    }
    writer.shutdown();
    for child in &mut children {
        let mut out = BufReader::new(child.stdout.take().unwrap());
        assert_eq!(read_line_with(&mut out, "READ "), MESSAGES.to_string());
        assert!(wait_or_kill(child, Duration::from_secs(60)).success());
    }
    drop(writer);
    assert_eq!(names_of(&handle), Vec::<String>::new());
}

#[test]
fn owner_killed_before_readers_attach_leaves_nothing_behind() {
    const TEST: &str = "owner_killed_before_readers_attach_leaves_nothing_behind";
    if role().as_deref() == Some("writer") {
        let writer = MessageQueue::new_writer(1, QueueConfig::default()).expect("writer");
        // An overflow message too, so its segment must be cleaned up as well.
        writer
            .enqueue_bytes(&vec![9; 5 << 20], SEC10)
            .expect("enqueue");
        println!(
            "HANDLE {}",
            serde_json::to_string(&writer.export_handle()).unwrap()
        );
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let _serial = serial();
    let mut child = spawn(TEST, "writer", None, 0);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let handle: Handle = serde_json::from_str(&read_line_with(&mut out, "HANDLE ")).unwrap();
    kill(&mut child);
    assert_eq!(
        names_owned_by(child.id()).len(),
        2,
        "the dead owner left its segment and an overflow segment"
    );
    let err = MessageQueue::create_from_handle(&handle, 0)
        .err()
        .expect("attach to a dead owner must fail");
    assert!(
        matches!(err, QueueError::WriterDead { pid } if pid == child.id()),
        "{err}"
    );
    assert_eq!(names_owned_by(child.id()), Vec::<String>::new());
}

#[test]
fn the_next_owner_sweeps_segments_of_dead_owners() {
    const TEST: &str = "the_next_owner_sweeps_segments_of_dead_owners";
    if role().as_deref() == Some("writer") {
        let writer = MessageQueue::new_writer(2, QueueConfig::default()).expect("writer");
        println!(
            "HANDLE {}",
            serde_json::to_string(&writer.export_handle()).unwrap()
        );
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let _serial = serial();
    let mut child = spawn(TEST, "writer", None, 0);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    read_line_with(&mut out, "HANDLE ");
    kill(&mut child);
    assert_eq!(names_owned_by(child.id()).len(), 1);
    let _next = MessageQueue::new_writer(1, QueueConfig::default()).expect("writer");
    assert_eq!(names_owned_by(child.id()), Vec::<String>::new());
}

#[test]
fn a_reader_sees_its_writer_die_and_cleans_up() {
    const TEST: &str = "a_reader_sees_its_writer_die_and_cleans_up";
    if role().as_deref() == Some("writer") {
        let writer = MessageQueue::new_writer(
            1,
            QueueConfig {
                max_chunk_bytes: 1024,
                ..QueueConfig::default()
            },
        )
        .unwrap();
        println!(
            "HANDLE {}",
            serde_json::to_string(&writer.export_handle()).unwrap()
        );
        writer
            .wait_until_ready(Duration::from_secs(30))
            .expect("reader attaches");
        writer.enqueue(&"first", SEC10).unwrap();
        writer.enqueue_bytes(&[7; 3000], SEC10).unwrap(); // overflow, read before the kill
        writer.enqueue_bytes(&[8; 3000], SEC10).unwrap(); // overflow, never read
        println!("SENT");
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let _serial = serial();
    let mut child = spawn(TEST, "writer", None, 0);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let handle: Handle = serde_json::from_str(&read_line_with(&mut out, "HANDLE ")).unwrap();
    let reader = MessageQueue::create_from_handle(&handle, 0).expect("attach");
    read_line_with(&mut out, "SENT");
    assert_eq!(reader.dequeue::<String>(SEC10).unwrap(), "first");
    assert_eq!(reader.dequeue_bytes(SEC10).unwrap(), vec![7; 3000]);
    // Attached everywhere: the main name is gone, only the unread overflow is left.
    assert_eq!(
        names_owned_by(child.id()).len(),
        1,
        "{:?}",
        names_owned_by(child.id())
    );
    kill(&mut child);
    // Let the reader consume the last message, then wait for more: it must
    // notice the death within its recheck interval, not hang.
    assert_eq!(reader.dequeue_bytes(SEC10).unwrap(), vec![8; 3000]);
    let start = Instant::now();
    let err = reader.dequeue_bytes(None).unwrap_err();
    assert!(matches!(err, QueueError::WriterDead { .. }), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(names_owned_by(child.id()), Vec::<String>::new());
}

#[test]
fn a_writer_blocked_on_a_dead_reader_reports_it_instead_of_hanging() {
    const TEST: &str = "a_writer_blocked_on_a_dead_reader_reports_it_instead_of_hanging";
    if role().as_deref() == Some("reader") {
        let _q = MessageQueue::create_from_handle(&env_handle(), 1).expect("attach");
        println!("ATTACHED");
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let _serial = serial();
    let writer = MessageQueue::new_writer(
        2,
        QueueConfig {
            n_chunks: 2,
            ..QueueConfig::default()
        },
    )
    .unwrap();
    let handle = writer.export_handle();
    let fast = MessageQueue::create_from_handle(&handle, 0).unwrap();
    let mut child = spawn(TEST, "reader", Some(&handle), 1);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    read_line_with(&mut out, "ATTACHED");
    for i in 0..2u8 {
        writer.enqueue_bytes(&[i], SEC10).unwrap();
        fast.dequeue_bytes(SEC10).unwrap();
    }
    kill(&mut child);
    let start = Instant::now();
    match writer.enqueue_bytes(b"blocked", None) {
        Err(QueueError::Full { behind, .. }) => {
            assert_eq!(behind.len(), 1);
            assert_eq!(
                (behind[0].rank, behind[0].pid, behind[0].alive),
                (1, Some(child.id()), false)
            );
        }
        other => panic!("expected Full naming the dead reader, got {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
}
