//! The engine core on its own threads, in this process and in its own
//! process, driven through `EngineCoreClient` on the real model: outputs
//! must equal the synchronous offline API's, a dropped stream must abort its
//! request and free its blocks, a request that can never fit is refused
//! while the engine carries on, the busy loop must sleep when idle, shutdown
//! must drain or abort as asked, and a crash anywhere must reach every
//! stream as the engine-dead sentinel.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread;
use std::time::{Duration, Instant};

use host::config::EngineConfig;
use host::engine::{
    EngineCoreClient, EngineCoreError, EngineCoreRequest, GenerateRequest, Llm, Prompt,
};
use host::sampling::SamplingParams;

fn config(kv_blocks: u64) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    // The model's own context, lowered at start-up to what the cache holds.
    c.model.max_model_len = 0;
    c.scheduler.max_num_batched_tokens = 256;
    // One block of SmolLM2: 30 layers x K and V x 3 heads x 64 dims x 16 slots x 4 bytes.
    c.cache.kv_cache_memory_bytes = Some(kv_blocks * 30 * 2 * 3 * 64 * 16 * 4);
    c
}

/// Where the engine core runs.
#[derive(Clone, Copy, Debug)]
enum Mode {
    InProcess,
    Process,
}

const MODES: [Mode; 2] = [Mode::InProcess, Mode::Process];

fn start(mode: Mode, config: &EngineConfig) -> (EngineCoreClient, host::tokenizer::Tokenizer) {
    match mode {
        Mode::InProcess => EngineCoreClient::start_in_process(config),
        Mode::Process => EngineCoreClient::start_process(config),
    }
    .unwrap_or_else(|e| panic!("{mode:?}: {e:#}"))
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn request(id: &str, prompt_token_ids: Vec<u32>, params: SamplingParams) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: id.into(),
        prompt_token_ids,
        sampling_params: params,
        priority: 0,
        output_token_ids: Vec::new(),
        prediction: Vec::new(),
        cache_salt: None,
    }
}

/// Waits (bounded) until `cond` holds.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

/// Every token of a request, from a stream read to its end.
fn collect(client: &EngineCoreClient, req: EngineCoreRequest) -> Result<Vec<u32>, EngineCoreError> {
    let mut stream = client.add_request(req)?;
    let mut tokens = Vec::new();
    while let Some(out) = stream.blocking_next() {
        let out = out?;
        tokens.extend(out.new_token_ids);
        if out.finish_reason.is_some() {
            break;
        }
    }
    Ok(tokens)
}

const TEXTS: [&str; 6] = [
    "The capital of France is",
    "Once upon a time, in a quiet village by the sea,",
    "To bake bread, first",
    "The three primary colors are",
    "def fibonacci(n):",
    "Rain forms when",
];

#[test]
fn streams_from_many_threads_equal_the_offline_api() {
    let _engines = shared();
    let params = greedy(10);
    let mut llm = Llm::new(&config(512)).unwrap();
    let prompts: Vec<Vec<u32>> = TEXTS
        .iter()
        .map(|t| llm.encode(&Prompt::Text(t.to_string())).unwrap())
        .collect();
    let requests: Vec<GenerateRequest> = prompts
        .iter()
        .map(|ids| GenerateRequest::new(Prompt::Tokens(ids.clone()), params.clone()))
        .collect();
    let expected: Vec<Vec<u32>> = llm
        .generate(&requests, |_, _| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap().token_ids)
        .collect();
    drop(llm);

    for mode in MODES {
        let (client, _tokenizer) = start(mode, &config(512));
        let got: Vec<Vec<u32>> = thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, ids)| {
                    let client = client.clone();
                    let req = request(&format!("r{i}"), ids.clone(), params.clone());
                    s.spawn(move || collect(&client, req).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, expected, "{mode:?}");
        assert_eq!(
            client.stats().scheduler.kv_cache_usage,
            0.0,
            "finished requests freed their blocks"
        );
        assert!(client.stats().num_generation_tokens >= 6 * 10);
        client.shutdown(false);
    }
}

#[test]
fn dropping_a_stream_aborts_its_request_and_frees_its_blocks() {
    let _engines = shared();
    for mode in MODES {
        let (client, tokenizer) = start(mode, &config(512));
        let ids = tokenizer.encode(TEXTS[1], true).unwrap();
        let mut stream = client
            .add_request(request("long", ids.clone(), greedy(400)))
            .unwrap();
        let first = stream.blocking_next().unwrap().unwrap();
        assert!(first.finish_reason.is_none());
        assert!(client.stats().scheduler.kv_cache_usage > 0.0);
        drop(stream);
        // The next step frees its blocks; the engine goes idle.
        wait_until("the aborted request's blocks are free", || {
            let s = client.stats().scheduler;
            s.kv_cache_usage == 0.0 && s.num_running == 0
        });
        // The same id can be used again, and the engine still serves.
        assert_eq!(
            collect(&client, request("long", ids, greedy(3)))
                .unwrap()
                .len(),
            3
        );
        client.shutdown(false);
    }
}

#[test]
fn a_request_that_can_never_fit_is_refused_and_the_engine_carries_on() {
    let _engines = shared();
    for mode in MODES {
        // 8 blocks of 16 tokens: 128 tokens of KV in all, so the engine
        // serves contexts of at most 128 tokens.
        let (client, tokenizer) = start(mode, &config(8));
        let too_long = vec![tokenizer.encode("word", false).unwrap()[0]; 200];
        match collect(&client, request("big", too_long, greedy(4))) {
            Err(EngineCoreError::Rejected(reason)) => {
                assert!(reason.contains("exceeds max_model_len (128)"), "{reason}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        let ids = tokenizer.encode(TEXTS[0], true).unwrap();
        assert_eq!(
            collect(&client, request("small", ids, greedy(4)))
                .unwrap()
                .len(),
            4
        );
        let dup = client
            .add_request(request("dup", vec![1, 2, 3], greedy(50)))
            .unwrap();
        assert!(matches!(
            client.add_request(request("dup", vec![1], greedy(1))),
            Err(EngineCoreError::Rejected(_))
        ));
        drop(dup);
        client.shutdown(false);
    }
}

#[test]
fn utility_calls_reach_the_engine_and_unknown_ones_are_named() {
    let _engines = shared();
    for mode in MODES {
        let (client, _) = start(mode, &config(64));
        assert_eq!(
            client
                .call_utility("reset_prefix_cache", serde_json::Value::Null)
                .unwrap(),
            true
        );
        let err = client
            .call_utility("no_such_method", serde_json::Value::Null)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no_such_method") && err.contains("reset_prefix_cache"),
            "{mode:?}: {err}"
        );
        client.shutdown(false);
    }
}

/// In-process engines of concurrently running tests share this process, so
/// a test that looks at "the" engine-core thread runs alone (`exclusive`)
/// while the others share.
static ENGINES: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    ENGINES.read().unwrap_or_else(|e| e.into_inner())
}

fn exclusive() -> RwLockWriteGuard<'static, ()> {
    ENGINES.write().unwrap_or_else(|e| e.into_inner())
}

/// The CPU time, in clock ticks (user + system), that the thread named
/// `name` of process `pid` (`self` for this one) has used, from /proc.
fn thread_cpu_ticks(pid: &str, name: &str) -> Option<u64> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let dir = task.ok()?.path();
        if std::fs::read_to_string(dir.join("comm")).ok()?.trim() == name {
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            // After the parenthesised command name: state is field 3, utime
            // and stime are fields 14 and 15 of proc(5).
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let ticks = |i: usize| fields.get(i - 3)?.parse::<u64>().ok();
            return Some(ticks(14)? + ticks(15)?);
        }
    }
    None
}

#[test]
fn an_idle_engine_sleeps_and_wakes_for_new_work() {
    let _engines = exclusive();
    for mode in MODES {
        let (client, tokenizer) = start(mode, &config(64));
        let pid = match mode {
            Mode::InProcess => "self".to_string(),
            Mode::Process => client.process_id().expect("a process").to_string(),
        };
        let ids = tokenizer.encode(TEXTS[2], true).unwrap();
        assert_eq!(
            collect(&client, request("a", ids.clone(), greedy(2)))
                .unwrap()
                .len(),
            2
        );
        // Blocked on its input queue, not spinning: past the queue's short
        // spin window, the thread uses almost no CPU while idle. (It wakes
        // every 200 ms to look at its workers, so its state letter alone
        // could read "running" at an unlucky moment.) A spinning loop would
        // use most of the second, even on a crowded machine.
        thread::sleep(Duration::from_millis(100));
        let before = thread_cpu_ticks(&pid, "engine-core").expect("an engine-core thread");
        thread::sleep(Duration::from_secs(1));
        let used = thread_cpu_ticks(&pid, "engine-core").unwrap() - before;
        assert!(
            used <= 10,
            "{mode:?}: the idle busy loop must block, but it used {used} ticks of CPU in 1 s"
        );
        assert_eq!(
            collect(&client, request("b", ids, greedy(2)))
                .unwrap()
                .len(),
            2
        );
        client.shutdown(false);
    }
}

#[test]
fn shutdown_drains_or_aborts_as_asked() {
    let _engines = shared();
    for mode in MODES {
        let (client, tokenizer) = start(mode, &config(128));
        let ids = tokenizer.encode(TEXTS[3], true).unwrap();

        let mut drained = client
            .add_request(request("d", ids.clone(), greedy(8)))
            .unwrap();
        client.shutdown(true);
        let mut n = 0;
        let mut last = None;
        while let Some(out) = drained.blocking_next() {
            let out = out.expect("a drained request runs to its end");
            n += out.new_token_ids.len();
            last = out.finish_reason;
        }
        assert_eq!((n, last.map(|r| r.as_str())), (8, Some("length")));
        assert!(!client.is_alive());
        assert!(matches!(
            client.add_request(request("late", ids.clone(), greedy(1))),
            Err(EngineCoreError::Dead(_))
        ));

        let (client, _) = start(mode, &config(128));
        let mut aborted = client.add_request(request("a", ids, greedy(400))).unwrap();
        aborted.blocking_next().unwrap().unwrap();
        client.shutdown(false);
        let mut tail = Vec::new();
        while let Some(item) = aborted.blocking_next() {
            tail.push(item);
        }
        let end = tail.last().expect("the stream ends with a reason");
        assert!(
            matches!(end, Ok(o) if o.finish_reason.map(|r| r.as_str()) == Some("abort"))
                || matches!(end, Err(EngineCoreError::Dead(_))),
            "{mode:?}: {end:?}"
        );
    }
}

/// The pids of this process's child processes running `host worker` (the
/// `mp` executor's workers; other tests' children are engine-core
/// processes).
fn worker_children() -> Vec<u32> {
    let mut pids = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let children =
            std::fs::read_to_string(task.unwrap().path().join("children")).unwrap_or_default();
        pids.extend(
            children
                .split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    pids.retain(|pid| {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        cmdline.split(|&b| b == 0).any(|arg| arg == b"worker")
    });
    pids
}

/// Reads `stream` on to its end, which must be the engine-dead sentinel
/// (the request cannot finish while the engine is dying).
fn sentinel(stream: &mut host::engine::OutputStream) -> EngineCoreError {
    loop {
        match stream.blocking_next() {
            Some(Ok(out)) => assert!(
                out.finish_reason.is_none(),
                "the request cannot finish: {out:?}"
            ),
            Some(Err(e)) => return e,
            None => panic!("the stream ended without the engine-dead sentinel"),
        }
    }
}

/// Kills process `pid` with SIGKILL.
fn kill9(pid: u32) {
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
}

#[test]
fn a_crashed_engine_core_process_reaches_every_stream_as_the_sentinel() {
    let _engines = shared();
    let mut c = config(128);
    // Restarts off (vLLM's behaviour): the death is final.
    c.engine.max_restarts = 0;
    let (client, tokenizer) = start(Mode::Process, &c);
    let ids = tokenizer.encode(TEXTS[5], true).unwrap();
    let mut stream = client
        .add_request(request("victim", ids.clone(), greedy(400)))
        .unwrap();
    stream.blocking_next().unwrap().unwrap();
    kill9(client.process_id().expect("a process"));
    let end = sentinel(&mut stream);
    match &end {
        EngineCoreError::Dead(reason) => assert!(reason.contains("signal: 9"), "{reason}"),
        other => panic!("expected the engine-dead sentinel, got {other:?}"),
    }
    assert!(!client.is_alive());
    assert!(matches!(
        client.add_request(request("after", ids, greedy(1))),
        Err(EngineCoreError::Dead(_))
    ));
    assert!(matches!(
        client.call_utility("reset_prefix_cache", serde_json::Value::Null),
        Err(EngineCoreError::Dead(_))
    ));
    client.shutdown(false);
}

#[test]
fn a_dead_worker_kills_the_engine_and_every_stream_gets_the_sentinel() {
    let _engines = shared();
    let mut c = config(128);
    c.parallel.distributed_executor_backend = "mp".into();
    // Restarts off (vLLM's behaviour): the death is final.
    c.engine.max_restarts = 0;
    let (client, tokenizer) = EngineCoreClient::start_in_process(&c).unwrap();
    let ids = tokenizer.encode(TEXTS[4], true).unwrap();
    let mut stream = client
        .add_request(request("victim", ids.clone(), greedy(400)))
        .unwrap();
    stream.blocking_next().unwrap().unwrap();
    let workers = worker_children();
    assert_eq!(workers.len(), 1, "one worker process: {workers:?}");
    kill9(workers[0]);
    let end = sentinel(&mut stream);
    match &end {
        EngineCoreError::Dead(reason) => assert!(reason.contains("rank 0"), "{reason}"),
        other => panic!("expected the engine-dead sentinel, got {other:?}"),
    }
    assert!(!client.is_alive());
    match client.add_request(request("after", ids, greedy(1))) {
        Err(EngineCoreError::Dead(reason)) => assert!(reason.contains("rank 0"), "{reason}"),
        other => panic!(
            "a dead engine refuses work: {:?}",
            other.map(|s| s.request_id().to_string())
        ),
    }
    client.shutdown(false);
}

/// Sampling that exercises every piece of per-request state a replay must
/// restore: the seeded generator, the penalties' token counts and
/// min_tokens.
fn seeded_with_penalties(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(1234),
        repetition_penalty: 1.3,
        frequency_penalty: 0.5,
        presence_penalty: 0.2,
        min_tokens: max_tokens / 2,
        max_tokens,
        ..SamplingParams::default()
    }
}

#[test]
fn a_request_replayed_with_its_output_continues_as_if_undisturbed() {
    // What a client replays after an engine-core process died: the prompt
    // and the tokens already streamed. The rest must be what the request
    // would have produced anyway.
    let _engines = shared();
    let (client, tokenizer) = start(Mode::InProcess, &config(256));
    let ids = tokenizer.encode(TEXTS[1], true).unwrap();
    for params in [greedy(24), seeded_with_penalties(24)] {
        let whole = collect(&client, request("whole", ids.clone(), params.clone())).unwrap();
        assert_eq!(whole.len(), 24);
        for k in [1, 9, 23] {
            let mut replay = request(&format!("replay{k}"), ids.clone(), params.clone());
            replay.output_token_ids = whole[..k].to_vec();
            let rest = collect(&client, replay).unwrap();
            assert_eq!(rest, whole[k..], "replayed after {k} tokens, {params:?}");
        }
    }
    let mut done = request("done", ids, greedy(4));
    done.output_token_ids = vec![1, 2, 3, 4];
    match collect(&client, done) {
        Err(EngineCoreError::Rejected(why)) => assert!(why.contains("max_tokens"), "{why}"),
        other => panic!("a request with nothing left to generate is refused: {other:?}"),
    }
    client.shutdown(false);
}

#[test]
fn a_killed_worker_is_replaced_and_every_request_finishes_as_undisturbed() {
    let _engines = exclusive();
    let mut c = config(256);
    c.parallel.distributed_executor_backend = "mp".into();
    let (client, tokenizer) = EngineCoreClient::start_in_process(&c).unwrap();
    let requests: Vec<EngineCoreRequest> = TEXTS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let params = if i % 2 == 0 {
                greedy(32)
            } else {
                seeded_with_penalties(32)
            };
            request(&format!("r{i}"), tokenizer.encode(t, true).unwrap(), params)
        })
        .collect();
    let undisturbed: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| collect(&client, r.clone()).unwrap())
        .collect();
    let workers = worker_children();
    assert_eq!(workers.len(), 1, "one worker process: {workers:?}");
    let mut streams: Vec<_> = requests
        .iter()
        .map(|r| client.add_request(r.clone()).unwrap())
        .collect();
    let mut got: Vec<Vec<u32>> = streams
        .iter_mut()
        .map(|s| s.blocking_next().unwrap().unwrap().new_token_ids)
        .collect();
    kill9(workers[0]);
    for (stream, tokens) in streams.iter_mut().zip(&mut got) {
        while let Some(out) = stream.blocking_next() {
            let out = out.unwrap_or_else(|e| panic!("the request survives the worker: {e}"));
            tokens.extend(out.new_token_ids);
            if out.finish_reason.is_some() {
                break;
            }
        }
    }
    assert_eq!(got, undisturbed);
    let replaced = worker_children();
    assert_eq!(replaced.len(), 1, "a new worker: {replaced:?}");
    assert_ne!(replaced, workers);
    let stats = client.stats();
    assert_eq!(stats.num_worker_restarts, 1);
    assert_eq!(stats.num_worker_replayed_requests, requests.len() as u64);
    assert!(client.is_alive());
    client.shutdown(false);
}

#[test]
fn a_constrained_request_keeps_its_constraint_across_a_worker_restart() {
    // The structured-output plugin on the new worker learns the request
    // again with its output so far, so the JSON it finishes is the one an
    // undisturbed run gives, and still follows the schema.
    let _engines = exclusive();
    let mut c = config(256);
    c.parallel.distributed_executor_backend = "mp".into();
    c.plugins.paths = vec![e2e::plugin("structured_output")];
    c.plugins.logits_processors = vec!["engine:structured-output".into()];
    c.plugins.cache_dir = Some(std::env::temp_dir().join("host-plugin-tests-cache"));
    let (client, tokenizer) = EngineCoreClient::start_in_process(&c).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
            "rivers": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        },
        "required": ["city", "population", "rivers"],
        "additionalProperties": false
    });
    let params = SamplingParams {
        extra_args: Some(serde_json::json!({"structured_outputs": {"json": schema}})),
        ..greedy(60)
    };
    let params = SamplingParams {
        ignore_eos: false,
        ..params
    };
    let ids = tokenizer
        .encode("Describe Paris as JSON with its rivers:", true)
        .unwrap();
    let req = request("json", ids, params);
    let undisturbed = collect(&client, req.clone()).unwrap();
    let text = tokenizer.decode(&undisturbed, true).unwrap();
    let value: serde_json::Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("the undisturbed answer is JSON: {e}: {text}"));
    assert!(value["rivers"].is_array(), "{value}");
    let workers = worker_children();
    assert_eq!(workers.len(), 1, "one worker process: {workers:?}");
    let mut stream = client.add_request(req).unwrap();
    let mut got = stream.blocking_next().unwrap().unwrap().new_token_ids;
    // A few tokens in, so the constraint is mid-object when the worker dies.
    while got.len() < 5 {
        got.extend(stream.blocking_next().unwrap().unwrap().new_token_ids);
    }
    kill9(workers[0]);
    while let Some(out) = stream.blocking_next() {
        let out = out.unwrap_or_else(|e| panic!("the request survives the worker: {e}"));
        got.extend(out.new_token_ids);
        if out.finish_reason.is_some() {
            break;
        }
    }
    assert_eq!(
        got,
        undisturbed,
        "{}",
        tokenizer.decode(&got, true).unwrap()
    );
    assert_eq!(client.stats().num_worker_restarts, 1);
    client.shutdown(false);
}
