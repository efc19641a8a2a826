//! Shared-memory queue benchmarks, side by side with iceoryx2 in one run.
//!
//! Layout (the same for both libraries): this process publishes; 1 or 2
//! reader processes (this binary re-executed with `MQ_BENCH_ROLE`) receive
//! and answer on their own 1-to-1 channel.
//!
//! - `latency/<lib>/<readers>r/<size>`: ping-pong, one message in flight.
//!   Each message carries its send time (CLOCK_MONOTONIC, shared by all
//!   processes); a reader answers with its one-way latency, and a message's
//!   latency is the slowest reader's. Criterion reports the mean; p50/p99 of
//!   all measured messages are printed at the end.
//! - `throughput/<lib>/<readers>r/<size>`: back-to-back messages, readers
//!   answer only the last of each batch.
//! - The idle CPU of a reader blocked in `dequeue` for 2 s (getrusage), and
//!   the futex-only latency (spin window 0) that sizes the spin window.
//!
//! Run: `cargo bench -p host --bench message_queue` (add `-- latency` etc.
//! to filter). Both libraries wait by polling with `sched_yield`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use host::message_queue::{Handle, MessageQueue, QueueConfig, QueueError};
use iceoryx2::prelude::*;

const SIZES: [usize; 4] = [64, 4096, 65536, 1 << 20];
const KIND_PING: u64 = 0;
const KIND_BULK: u64 = 1;
const KIND_LAST: u64 = 2;
const KIND_EXIT: u64 = 3;
const WAIT: Option<Duration> = Some(Duration::from_secs(30));

/// Monotonic nanoseconds, comparable across processes on one machine.
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Message header: [send time ns][kind].
fn header(msg: &[u8]) -> (u64, u64) {
    let word = |i: usize| u64::from_le_bytes(msg[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    (word(0), word(1))
}

/// Writes the header; `sent` is taken before the payload is copied in, so
/// a message's latency includes writing it.
fn stamp(buf: &mut [u8], sent: u64, kind: u64) {
    buf[8..16].copy_from_slice(&kind.to_le_bytes());
    buf[..8].copy_from_slice(&sent.to_le_bytes());
}

/// One publisher and its reader processes, for one library.
trait Link {
    /// Sends one message of `size` bytes of `kind`.
    fn send(&mut self, size: usize, kind: u64);
    /// Waits for one answer from every reader; returns the largest.
    fn answers(&mut self) -> u64;
}

/// The payload every message copies in (both libraries copy it once).
fn source() -> &'static [u8] {
    static SRC: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    SRC.get_or_init(|| (0..SIZES[SIZES.len() - 1]).map(|i| i as u8).collect())
}

struct MqLink {
    writer: MessageQueue,
    acks: Vec<MessageQueue>,
    children: Vec<Child>,
}

impl Link for MqLink {
    fn send(&mut self, size: usize, kind: u64) {
        let sent = now_ns();
        self.writer
            .enqueue_with(size, WAIT, |buf| {
                buf.copy_from_slice(&source()[..size]);
                stamp(buf, sent, kind);
            })
            .expect("enqueue");
    }
    fn answers(&mut self) -> u64 {
        self.acks
            .iter()
            .map(|q| q.dequeue_with(WAIT, |b| header(b).0).expect("ack"))
            .max()
            .unwrap_or(0)
    }
}

struct IoxLink {
    _node: Node<ipc::Service>,
    publisher: iceoryx2::port::publisher::Publisher<ipc::Service, [u8], ()>,
    acks: Vec<iceoryx2::port::subscriber::Subscriber<ipc::Service, [u8], ()>>,
    children: Vec<Child>,
}

impl Link for IoxLink {
    fn send(&mut self, size: usize, kind: u64) {
        let sent = now_ns();
        let sample = self.publisher.loan_slice_uninit(size).expect("loan");
        let mut sample = sample.write_from_slice(&source()[..size]);
        stamp(sample.payload_mut(), sent, kind);
        sample.send().expect("send");
    }
    fn answers(&mut self) -> u64 {
        let mut worst = 0;
        for sub in &self.acks {
            loop {
                if let Some(s) = sub.receive().expect("receive") {
                    worst = worst.max(header(s.payload()).0);
                    break;
                }
                // SAFETY: no preconditions.
                unsafe { libc::sched_yield() };
            }
        }
        worst
    }
}

fn spawn_reader(role: &str, rank: usize, env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("bench binary"));
    cmd.env("MQ_BENCH_ROLE", role)
        .env("MQ_BENCH_RANK", rank.to_string())
        .stdout(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn reader")
}

fn read_line(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("reader output");
    line.trim().to_string()
}

/// The spin window of every party: `MQ_BENCH_SPIN_US`, or the default.
fn spin_window() -> Duration {
    std::env::var("MQ_BENCH_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(
            host::message_queue::DEFAULT_SPIN_WINDOW,
            Duration::from_micros,
        )
}

fn config_for(size: usize) -> QueueConfig {
    QueueConfig {
        n_chunks: 8,
        max_chunk_bytes: size.max(64),
        spin_window: spin_window(),
    }
}

fn mq_link(readers: usize, size: usize) -> MqLink {
    let writer = MessageQueue::new_writer(readers, config_for(size)).expect("writer");
    let handle = serde_json::to_string(&writer.export_handle()).expect("handle");
    let mut children: Vec<Child> = (0..readers)
        .map(|r| spawn_reader("mq", r, &[("MQ_BENCH_HANDLE", handle.clone())]))
        .collect();
    let acks = children
        .iter_mut()
        .map(|c| {
            let h: Handle = serde_json::from_str(&read_line(c)).expect("ack handle");
            let mut q = MessageQueue::create_from_handle(&h, 0).expect("attach ack queue");
            q.set_spin_window(spin_window());
            q
        })
        .collect();
    writer
        .wait_until_ready(Duration::from_secs(30))
        .expect("readers attach");
    MqLink {
        writer,
        acks,
        children,
    }
}

fn iox_link(readers: usize, size: usize) -> IoxLink {
    let node = NodeBuilder::new().create::<ipc::Service>().expect("node");
    let base = format!("mqbench-{}-{}-{readers}", std::process::id(), size);
    let service = node
        .service_builder(&base.as_str().try_into().expect("name"))
        .publish_subscribe::<[u8]>()
        .enable_safe_overflow(false)
        .subscriber_max_buffer_size(8)
        .max_subscribers(readers)
        .open_or_create()
        .expect("service");
    let publisher = service
        .publisher_builder()
        .initial_max_slice_len(size)
        .backpressure_strategy(BackpressureStrategy::RetryUntilDelivered)
        .create()
        .expect("publisher");
    let acks = (0..readers)
        .map(|r| {
            let name = format!("{base}-ack{r}");
            let svc = node
                .service_builder(&name.as_str().try_into().expect("name"))
                .publish_subscribe::<[u8]>()
                .open_or_create()
                .expect("ack service");
            svc.subscriber_builder().create().expect("ack subscriber")
        })
        .collect();
    let mut children: Vec<Child> = (0..readers)
        .map(|r| {
            spawn_reader(
                "iox",
                r,
                &[
                    ("MQ_BENCH_SERVICE", base.clone()),
                    ("MQ_BENCH_SIZE", size.to_string()),
                ],
            )
        })
        .collect();
    for c in &mut children {
        assert_eq!(read_line(c), "READY");
    }
    IoxLink {
        _node: node,
        publisher,
        acks,
        children,
    }
}

/// Reader process for our queue: answers pings with their latency.
fn mq_reader() {
    let handle: Handle =
        serde_json::from_str(&std::env::var("MQ_BENCH_HANDLE").expect("handle")).expect("json");
    let rank: usize = std::env::var("MQ_BENCH_RANK")
        .expect("rank")
        .parse()
        .expect("rank");
    let ack = MessageQueue::new_writer(1, config_for(64)).expect("ack writer");
    println!(
        "{}",
        serde_json::to_string(&ack.export_handle()).expect("json")
    );
    let mut q = MessageQueue::create_from_handle(&handle, rank).expect("attach");
    q.set_spin_window(spin_window());
    ack.wait_until_ready(Duration::from_secs(30))
        .expect("ack reader");
    loop {
        let (sent, kind) = q
            .dequeue_with(WAIT, |b| (header(b), now_ns()))
            .map(|((t, k), now)| (now - t, k))
            .expect("dequeue");
        match kind {
            KIND_EXIT => return,
            KIND_BULK => {}
            _ => ack
                .enqueue_with(64, WAIT, |b| b[..8].copy_from_slice(&sent.to_le_bytes()))
                .expect("ack"),
        }
    }
}

/// Reader process for iceoryx2, polling with `sched_yield` like ours spins.
fn iox_reader() {
    let base = std::env::var("MQ_BENCH_SERVICE").expect("service");
    let rank: usize = std::env::var("MQ_BENCH_RANK")
        .expect("rank")
        .parse()
        .expect("rank");
    let node = NodeBuilder::new().create::<ipc::Service>().expect("node");
    let svc = node
        .service_builder(&base.as_str().try_into().expect("name"))
        .publish_subscribe::<[u8]>()
        .open()
        .expect("open service");
    let sub = svc.subscriber_builder().create().expect("subscriber");
    let ack_name = format!("{base}-ack{rank}");
    let ack_svc = node
        .service_builder(&ack_name.as_str().try_into().expect("name"))
        .publish_subscribe::<[u8]>()
        .open_or_create()
        .expect("ack");
    let ack = ack_svc
        .publisher_builder()
        .initial_max_slice_len(64)
        .create()
        .expect("ack publisher");
    println!("READY");
    loop {
        let Some(sample) = sub.receive().expect("receive") else {
            // SAFETY: no preconditions.
            unsafe { libc::sched_yield() };
            continue;
        };
        let (t, kind) = header(sample.payload());
        let latency = now_ns() - t;
        drop(sample);
        match kind {
            KIND_EXIT => return,
            KIND_BULK => {}
            _ => {
                let mut s = ack
                    .loan_slice_uninit(64)
                    .expect("loan")
                    .write_from_fn(|_| 0u8);
                s.payload_mut()[..8].copy_from_slice(&latency.to_le_bytes());
                s.send().expect("ack send");
            }
        }
    }
}

fn finish(link: &mut dyn Link, children: &mut Vec<Child>) {
    link.send(64, KIND_EXIT);
    for mut c in children.drain(..) {
        c.wait().expect("reader exit");
    }
}

/// Latencies (ns) of every measured message, by benchmark id.
static LATENCIES: Mutex<BTreeMap<String, Vec<u64>>> = Mutex::new(BTreeMap::new());

fn run_latency(c: &mut Criterion, lib: &str, readers: usize, size: usize, link: &mut dyn Link) {
    let id = format!("{lib}/{readers}r/{size}");
    let mut group = c.benchmark_group("latency");
    group.bench_function(BenchmarkId::from_parameter(&id), |b| {
        b.iter_custom(|iters| {
            let mut total = 0;
            let mut samples = Vec::with_capacity(iters as usize);
            for _ in 0..iters {
                link.send(size, KIND_PING);
                let ns = link.answers();
                samples.push(ns);
                total += ns;
            }
            LATENCIES
                .lock()
                .unwrap()
                .entry(id.clone())
                .or_default()
                .extend(samples);
            Duration::from_nanos(total)
        })
    });
    group.finish();
}

fn run_throughput(c: &mut Criterion, lib: &str, readers: usize, size: usize, link: &mut dyn Link) {
    let mut group = c.benchmark_group("throughput");
    group.throughput(Throughput::Bytes(size as u64));
    group.bench_function(
        BenchmarkId::from_parameter(format!("{lib}/{readers}r/{size}")),
        |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for i in 0..iters {
                    link.send(size, if i + 1 == iters { KIND_LAST } else { KIND_BULK });
                }
                link.answers();
                start.elapsed()
            })
        },
    );
    group.finish();
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
}

/// CPU seconds used by this process.
fn cpu_seconds() -> f64 {
    // SAFETY: `usage` is a valid out-pointer.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// A reader blocked in `dequeue` for 2 s: the share of a core it uses.
fn idle_cpu() -> f64 {
    let writer = MessageQueue::new_writer(1, QueueConfig::default()).expect("writer");
    let reader = MessageQueue::create_from_handle(&writer.export_handle(), 0).expect("reader");
    let before = cpu_seconds();
    let start = Instant::now();
    let r = reader.dequeue_bytes(Some(Duration::from_secs(2)));
    assert!(matches!(r, Err(QueueError::Timeout { .. })));
    (cpu_seconds() - before) / start.elapsed().as_secs_f64()
}

/// p50 one-way latency (µs) of 64-byte pings when every wait sleeps on the
/// futex (spin window 0) or spins for `window`, with `gap` between pings.
fn futex_latency(window: Duration, gap: Duration) -> (f64, f64) {
    let writer = MessageQueue::new_writer(
        1,
        QueueConfig {
            spin_window: window,
            ..config_for(64)
        },
    )
    .expect("writer");
    let handle = writer.export_handle();
    let t = std::thread::spawn(move || {
        let mut q = MessageQueue::create_from_handle(&handle, 0).expect("attach");
        q.set_spin_window(window);
        let mut lat = Vec::new();
        let cpu0 = thread_cpu();
        for _ in 0..200 {
            lat.push(
                q.dequeue_with(WAIT, |b| now_ns() - header(b).0)
                    .expect("dequeue"),
            );
        }
        lat.sort_unstable();
        (lat, thread_cpu() - cpu0)
    });
    writer
        .wait_until_ready(Duration::from_secs(10))
        .expect("ready");
    let start = Instant::now();
    for _ in 0..200 {
        std::thread::sleep(gap);
        writer
            .enqueue_with(64, WAIT, |b| stamp(b, now_ns(), KIND_PING))
            .expect("enqueue");
    }
    let (lat, cpu) = t.join().expect("reader thread");
    (percentile(&lat, 0.5), cpu / start.elapsed().as_secs_f64())
}

fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

fn main() {
    match std::env::var("MQ_BENCH_ROLE").as_deref() {
        Ok("mq") => return mq_reader(),
        Ok("iox") => return iox_reader(),
        _ => {}
    }
    set_log_level(LogLevel::Error);
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    for readers in [1, 2] {
        for size in SIZES {
            let mut link = mq_link(readers, size);
            run_latency(&mut c, "mq", readers, size, &mut link);
            run_throughput(&mut c, "mq", readers, size, &mut link);
            let mut children = std::mem::take(&mut link.children);
            finish(&mut link, &mut children);
            let mut link = iox_link(readers, size);
            run_latency(&mut c, "iceoryx2", readers, size, &mut link);
            run_throughput(&mut c, "iceoryx2", readers, size, &mut link);
            let mut children = std::mem::take(&mut link.children);
            finish(&mut link, &mut children);
        }
    }
    c.final_summary();
    println!("\none-way latency, µs (all measured messages)");
    println!("{:<28} {:>8} {:>8} {:>8}", "benchmark", "p50", "p99", "n");
    for (id, mut v) in std::mem::take(&mut *LATENCIES.lock().unwrap()) {
        if v.is_empty() {
            continue;
        }
        v.sort_unstable();
        println!(
            "{id:<28} {:>8.2} {:>8.2} {:>8}",
            percentile(&v, 0.5),
            percentile(&v, 0.99),
            v.len()
        );
    }
    println!(
        "\nidle reader blocked 2 s in dequeue: {:.3}% of a core",
        idle_cpu() * 100.0
    );
    println!("\nspin window vs. wake latency (64 B, 200 pings, reader thread):");
    for (window, gap) in [(0, 1000), (200, 1000), (200, 50), (2000, 1000)] {
        let (p50, cpu) = futex_latency(Duration::from_micros(window), Duration::from_micros(gap));
        println!(
            "  window {window:>5} µs, gap {gap:>5} µs: p50 {p50:>7.2} µs, reader CPU {:.1}%",
            cpu * 100.0
        );
    }
}
