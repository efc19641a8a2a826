//! The plugin host without the model: resolution by qualified name, the
//! version and kind checks, the compiled-component cache, and containment of
//! deliberately bad plugins (panic, infinite loop, memory bomb, invalid
//! answers, filesystem / socket / environment access). Each bad plugin must
//! be reported by name and the policy must fall back to FCFS for that step,
//! within a bounded time, and keep working afterwards. The cache loads
//! only what this host wrote: a changed or swapped entry is recompiled,
//! and a folder others may write to is not used.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::plugin;
use host::config::PluginsConfig;
use host::plugins::{host_from_config, PluginHost, PluginKind};
use host::scheduler::{policy_from_host, SchedulingPolicy, WaitingView};

fn config(paths: Vec<PathBuf>, cache_dir: &std::path::Path) -> PluginsConfig {
    PluginsConfig {
        paths,
        cache_dir: Some(cache_dir.to_path_buf()),
        ..PluginsConfig::default()
    }
}

fn with_options(name: &str, json_mode: &str) -> BTreeMap<String, toml::Table> {
    let table: toml::Table = format!("mode = \"{json_mode}\"").parse().unwrap();
    BTreeMap::from([(name.to_string(), table)])
}

/// A queue of five requests with prompt lengths 50, 10, 40, 20, 30.
fn order(policy: &mut dyn SchedulingPolicy) -> Vec<u32> {
    let view = WaitingView {
        ids: &[10, 11, 12, 13, 14],
        prompt_lens: &[50, 10, 40, 20, 30],
        priorities: &[0; 5],
        arrival_times: &[0.0, 1.0, 2.0, 3.0, 4.0],
    };
    let mut out = Vec::new();
    policy.order_waiting(&view, &mut out);
    out
}

#[test]
fn policies_resolve_by_qualified_name() {
    let cache = tempfile::tempdir().unwrap();
    let host = host_from_config(&config(
        vec![plugin("shortest_prompt_first"), plugin("fcfs")],
        cache.path(),
    ))
    .unwrap();
    let names: Vec<(&str, PluginKind)> =
        host.plugins().map(|p| (p.name.as_str(), p.kind)).collect();
    assert_eq!(
        names,
        [
            ("engine:shortest-prompt-first", PluginKind::SchedulingPolicy),
            ("engine:fcfs", PluginKind::SchedulingPolicy)
        ]
    );
    let info = host.plugins().next().unwrap();
    assert_eq!(
        (info.version.as_str(), info.wit_version.as_str()),
        ("0.1.0", "engine:plugins@0.2.0")
    );
    assert_eq!(info.options[0].name, "max_wait_s");

    let mut sjf = policy_from_host(&host, "engine:shortest-prompt-first").unwrap();
    assert_eq!(sjf.name(), "engine:shortest-prompt-first");
    assert_eq!(order(&mut *sjf), [1, 3, 4, 2, 0], "ascending prompt length");
    assert_eq!(
        order(&mut *policy_from_host(&host, "engine:fcfs").unwrap()),
        [0, 1, 2, 3, 4]
    );
    // Built-ins keep their names, qualified and bare.
    assert_eq!(
        policy_from_host(&host, "builtin:priority").unwrap().name(),
        "builtin:priority"
    );
    assert_eq!(
        policy_from_host(&host, "fcfs").unwrap().name(),
        "builtin:fcfs"
    );

    let err = policy_from_host(&host, "acme:nope")
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("acme:nope")
            && err.contains(
                "builtin:fcfs, builtin:priority, engine:shortest-prompt-first, engine:fcfs"
            ),
        "{err}"
    );
}

#[test]
fn plugin_options_reach_init_and_bad_ones_are_refused() {
    let cache = tempfile::tempdir().unwrap();
    let mut c = config(vec![plugin("shortest_prompt_first")], cache.path());
    c.options.insert(
        "engine:shortest-prompt-first".into(),
        "max_wait_s = 2.5".parse().unwrap(),
    );
    let host = host_from_config(&c).unwrap();
    // Requests 0 and 1 arrived more than 2.5 s before the newest (at 4 s):
    // starved, so first (shorter of them first), then the rest by length.
    assert_eq!(
        order(&mut *policy_from_host(&host, "engine:shortest-prompt-first").unwrap()),
        [1, 0, 3, 4, 2]
    );

    c.options.insert(
        "engine:shortest-prompt-first".into(),
        "max_wait = 1".parse().unwrap(),
    );
    let host = host_from_config(&c).unwrap();
    let err = policy_from_host(&host, "engine:shortest-prompt-first")
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("engine:shortest-prompt-first") && err.contains("max_wait_s"),
        "{err}"
    );

    c.options = BTreeMap::from([("acme:ghost".to_string(), toml::Table::new())]);
    let err = host_from_config(&c).unwrap_err().to_string();
    assert!(
        err.contains("acme:ghost") && err.contains("engine:shortest-prompt-first"),
        "{err}"
    );
}

#[test]
fn wrong_kind_and_newer_wit_are_refused_with_both_sides_named() {
    let cache = tempfile::tempdir().unwrap();
    let host = host_from_config(&config(vec![plugin("logit_bias")], cache.path())).unwrap();
    let err = policy_from_host(&host, "engine:logit-bias")
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("is a logits processor, not a scheduling policy"),
        "{err}"
    );

    let err = host_from_config(&config(vec![plugin("future_wit")], cache.path()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("future_wit.wasm")
            && err.contains("built against engine:plugins@0.9.0")
            && err.contains("supports engine:plugins@0.1.x"),
        "{err}"
    );

    let not_wasm = cache.path().join("junk.wasm");
    std::fs::write(&not_wasm, b"not a component").unwrap();
    let err = host_from_config(&config(vec![not_wasm], cache.path()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("junk.wasm") && err.contains("not a loadable WebAssembly component"),
        "{err}"
    );
}

/// The compiled entries (`*.cwasm`) in `dir`, sorted.
fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
        .collect();
    found.sort();
    found
}

#[test]
fn compiled_components_are_cached_on_disk() {
    let cache = tempfile::tempdir().unwrap();
    let c = config(vec![plugin("fcfs")], cache.path());
    host_from_config(&c).unwrap();
    let entries = || entries(cache.path());
    let first = entries();
    assert_eq!(first.len(), 1, "one compiled entry: {first:?}");
    let written = std::fs::metadata(&first[0]).unwrap().modified().unwrap();
    // A second host loads the entry instead of writing it again.
    let host = host_from_config(&c).unwrap();
    assert_eq!(entries(), first);
    assert_eq!(
        std::fs::metadata(&first[0]).unwrap().modified().unwrap(),
        written
    );
    assert_eq!(
        order(&mut *policy_from_host(&host, "engine:fcfs").unwrap()),
        [0, 1, 2, 3, 4]
    );
    // A corrupt entry is recompiled, not trusted.
    drop(host);
    std::fs::write(&first[0], b"garbage").unwrap();
    let host = host_from_config(&c).unwrap();
    assert_eq!(
        order(&mut *policy_from_host(&host, "engine:fcfs").unwrap()),
        [0, 1, 2, 3, 4]
    );
    assert!(
        std::fs::metadata(&first[0]).unwrap().len() > 1000,
        "the entry was rewritten"
    );
}

#[test]
fn a_changed_or_swapped_cache_entry_is_recompiled_not_loaded() {
    let cache = tempfile::tempdir().unwrap();
    let fcfs = config(vec![plugin("fcfs")], cache.path());
    host_from_config(&fcfs).unwrap();
    let [fcfs_entry] = entries(cache.path()).try_into().unwrap();
    host_from_config(&config(vec![plugin("logit_bias")], cache.path())).unwrap();
    let bias_entry = entries(cache.path())
        .into_iter()
        .find(|e| *e != fcfs_entry)
        .unwrap();
    // Another plugin's valid, tagged entry in fcfs's place: loading it would
    // make `engine:fcfs` a logits processor.
    std::fs::copy(&bias_entry, &fcfs_entry).unwrap();
    let host = host_from_config(&fcfs).unwrap();
    let names: Vec<&str> = host.plugins().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["engine:fcfs"]);
    assert_eq!(
        order(&mut *policy_from_host(&host, "engine:fcfs").unwrap()),
        [0, 1, 2, 3, 4]
    );
    let rewritten = std::fs::read(&fcfs_entry).unwrap();
    assert_ne!(rewritten, std::fs::read(&bias_entry).unwrap());
    // One flipped byte in the compiled code: recompiled and rewritten.
    let mut flipped = rewritten.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x40;
    std::fs::write(&fcfs_entry, &flipped).unwrap();
    let host = host_from_config(&fcfs).unwrap();
    assert_eq!(
        order(&mut *policy_from_host(&host, "engine:fcfs").unwrap()),
        [0, 1, 2, 3, 4]
    );
    assert_ne!(std::fs::read(&fcfs_entry).unwrap(), flipped, "rewritten");
}

#[test]
fn a_cache_folder_others_may_write_is_not_used() {
    use std::os::unix::fs::PermissionsExt;
    let cache = tempfile::tempdir().unwrap();
    std::fs::set_permissions(cache.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let host = host_from_config(&config(vec![plugin("fcfs")], cache.path())).unwrap();
    assert_eq!(host.runtime().cache_dir(), None, "the cache is off");
    assert_eq!(
        order(&mut *policy_from_host(&host, "engine:fcfs").unwrap()),
        [0, 1, 2, 3, 4],
        "the plugin still runs, compiled at load"
    );
    assert_eq!(
        std::fs::read_dir(cache.path()).unwrap().count(),
        0,
        "nothing written"
    );
    // Made private, it is used.
    std::fs::set_permissions(cache.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let host = host_from_config(&config(vec![plugin("fcfs")], cache.path())).unwrap();
    assert_eq!(
        host.runtime().cache_dir(),
        Some(cache.path().canonicalize().unwrap().as_path())
    );
    assert_eq!(entries(cache.path()).len(), 1);
}

/// Loads the misbehaving policy in `mode`, calls it twice, and returns the
/// fault message of the first call and the time both calls took.
fn misbehave(mode: &str) -> (String, Duration) {
    let cache = tempfile::tempdir().unwrap();
    let mut c = config(vec![plugin("misbehave")], cache.path());
    c.options = with_options("test:misbehave", mode);
    let host: PluginHost = host_from_config(&c).unwrap();
    let mut policy = host.wasm_policy("test:misbehave").unwrap();
    let start = Instant::now();
    assert_eq!(
        order(&mut policy),
        [0, 1, 2, 3, 4],
        "{mode}: FCFS for the faulting step"
    );
    let message = policy
        .last_fault()
        .unwrap_or_else(|| panic!("{mode}: no fault recorded"))
        .to_string();
    // The instance was recreated and is called again (and faults again).
    assert_eq!(
        order(&mut policy),
        [0, 1, 2, 3, 4],
        "{mode}: still served after recreation"
    );
    assert_eq!(policy.faults(), 2, "{mode}");
    (message, start.elapsed())
}

#[test]
fn a_panicking_plugin_is_contained() {
    let (msg, _) = misbehave("panic");
    assert!(
        msg.contains("order-waiting") && msg.contains("usually a panic"),
        "{msg}"
    );
}

#[test]
fn an_endless_loop_is_interrupted_at_the_deadline() {
    let (msg, took) = misbehave("loop");
    // `deadline_ms` (20) and `deadline_per_request_us` (1000) for each of
    // the 5 requests in the queue.
    assert!(msg.contains("exceeded its deadline of 25 ms"), "{msg}");
    assert!(
        took < Duration::from_secs(2),
        "two interrupted calls took {took:?}"
    );
}

#[test]
fn a_memory_bomb_hits_the_limit() {
    let (msg, _) = misbehave("oom");
    assert!(msg.contains("memory"), "{msg}");
}

#[test]
fn invalid_answers_are_rejected() {
    let (msg, _) = misbehave("out-of-range");
    assert!(
        msg.contains("position 10 is out of range (queue of 5)"),
        "{msg}"
    );
    let (msg, _) = misbehave("duplicate");
    assert!(msg.contains("position 0 appears twice"), "{msg}");
}

#[test]
fn the_sandbox_grants_no_filesystem_network_or_environment() {
    for (mode, import) in [("read-file", "wasi:filesystem"), ("socket", "wasi:sockets")] {
        let (msg, _) = misbehave(mode);
        assert!(
            msg.contains("does not grant") && msg.contains(import),
            "{mode}: {msg}"
        );
    }
    // The environment is empty: HOME is unset, so the fixture answers with
    // position 5 + len(HOME) = 5, which is out of range.
    let (msg, _) = misbehave("env");
    assert!(msg.contains("position 5 is out of range"), "env: {msg}");
}

#[test]
fn host_plugin_list_and_inspect_print_what_plugins_declare() {
    let run = |args: &[&std::ffi::OsStr]| {
        let out = std::process::Command::new(e2e::host_bin())
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let sjf = plugin("shortest_prompt_first");
    let (ok, stdout, stderr) = run(&["plugin".as_ref(), "inspect".as_ref(), sjf.as_os_str()]);
    assert!(ok, "{stderr}");
    for line in [
        "name: engine:shortest-prompt-first",
        "version: 0.1.0",
        "kind: scheduling policy",
        "wit: engine:plugins@0.2.0",
        "  engine:plugins/scheduling-policy@0.2.0",
        "  max_wait_s (default 0): ",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in\n{stdout}");
    }
    let bias = plugin("logit_bias");
    let (ok, stdout, stderr) = run(&[
        "--plugin".as_ref(),
        bias.as_os_str(),
        "plugin".as_ref(),
        "list".as_ref(),
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("builtin:fcfs\t")
            && stdout.contains("engine:logit-bias@0.1.0\tlogits processor\t"),
        "{stdout}"
    );
    let (ok, _, stderr) = run(&[
        "plugin".as_ref(),
        "inspect".as_ref(),
        plugin("future_wit").as_os_str(),
    ]);
    assert!(
        !ok && stderr.contains("built against engine:plugins@0.9.0"),
        "{stderr}"
    );
}

#[test]
fn auto_takes_the_one_policy_given_by_plugin_paths() {
    let cache = tempfile::tempdir().unwrap();
    let resolve = |paths: Vec<PathBuf>| {
        host::scheduler::policy_from_config("auto", &config(paths, cache.path()))
            .map(|p| p.name().to_string())
    };
    assert_eq!(resolve(vec![]).unwrap(), "builtin:fcfs");
    assert_eq!(
        resolve(vec![plugin("logit_bias")]).unwrap(),
        "builtin:fcfs",
        "no policy among them"
    );
    assert_eq!(
        resolve(vec![plugin("logit_bias"), plugin("shortest_prompt_first")]).unwrap(),
        "engine:shortest-prompt-first"
    );
    let err = resolve(vec![plugin("shortest_prompt_first"), plugin("fcfs")])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2 scheduling policies (engine:shortest-prompt-first, engine:fcfs)"),
        "{err}"
    );
    let err = host::scheduler::policy_from_config("acme:x", &PluginsConfig::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("acme:x") && err.contains("builtin:fcfs, builtin:priority"),
        "{err}"
    );
}
