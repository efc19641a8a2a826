//! Directories granted to a plugin (`[[plugins.grants]]`), preopened with
//! cap-std: the plugin reads its granted file in `init`, cannot write there
//! unless the grant is `writable`, cannot reach anything outside it (not
//! /etc/passwd), and without a grant it sees no filesystem at all. A grant
//! for an unknown plugin or a missing directory is refused at start, and so
//! is a writable one holding the compiled-component cache. A
//! `collective_rpc` caller cannot load plugins with grants or a cache the
//! operator did not configure.

use std::path::Path;

use e2e::plugin;
use host::config::{EngineConfig, GrantConfig, PluginsConfig};
use host::engine::Llm;
use host::plugins::{host_from_config, PluginError, Row};
use serde_json::json;

/// `test:reads-grant` with `options` (a flat object of strings) and `grants`.
fn config(cache: &Path, options: &[(&str, &str)], grants: Vec<GrantConfig>) -> PluginsConfig {
    let mut table = toml::Table::new();
    for (k, v) in options {
        table.insert(k.to_string(), toml::Value::String(v.to_string()));
    }
    PluginsConfig {
        paths: vec![plugin("reads_grant")],
        cache_dir: Some(cache.to_path_buf()),
        options: [("test:reads-grant".to_string(), table)].into(),
        grants,
        ..PluginsConfig::default()
    }
}

fn grant(dir: &Path, writable: bool) -> GrantConfig {
    GrantConfig {
        plugin: "test:reads-grant".into(),
        dir: dir.to_path_buf(),
        guest: "/data".into(),
        writable,
    }
}

/// Starts the processor; its `init` reads (and maybe writes) files.
fn start(c: &PluginsConfig) -> Result<host::plugins::LogitsProcessors, String> {
    let host = host_from_config(c).map_err(|e| e.to_string())?;
    host.logits_processors(&["test:reads-grant".to_string()])
        .map(|p| p.expect("one processor"))
        .map_err(|e: PluginError| e.to_string())
}

/// A data directory holding `banned.txt` with token ids 3 and 5.
fn data_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("banned.txt"), "3 5\n").unwrap();
    dir
}

#[test]
fn a_granted_file_is_read_and_used() {
    let (cache, data) = (tempfile::tempdir().unwrap(), data_dir());
    let mut processors =
        start(&config(cache.path(), &[], vec![grant(data.path(), false)])).unwrap();
    let row = Row {
        id: 1,
        num_output_tokens: 0,
        last_token: 0,
        logits_row: 0,
    };
    let mut logits = vec![0.0f32; 8];
    processors.apply(&[row], &mut logits, 8, |_| &[]).unwrap();
    let banned: Vec<usize> = (0..8).filter(|&t| logits[t] == f32::NEG_INFINITY).collect();
    assert_eq!(banned, [3, 5], "the ids in the granted file: {logits:?}");
}

#[test]
fn a_read_only_grant_refuses_writes_and_a_writable_one_allows_them() {
    let (cache, data) = (tempfile::tempdir().unwrap(), data_dir());
    let written = data.path().join("out.txt");
    let opts = [("write", "/data/out.txt")];
    let err = start(&config(
        cache.path(),
        &opts,
        vec![grant(data.path(), false)],
    ))
    .unwrap_err();
    assert!(
        err.contains("test:reads-grant") && err.contains("cannot write /data/out.txt"),
        "{err}"
    );
    assert!(!written.exists(), "a read-only grant wrote a file");

    start(&config(cache.path(), &opts, vec![grant(data.path(), true)])).unwrap();
    assert_eq!(
        std::fs::read_to_string(&written).unwrap(),
        "written by test:reads-grant"
    );
}

#[test]
fn nothing_outside_the_grant_and_nothing_without_one_is_reachable() {
    let (cache, data) = (tempfile::tempdir().unwrap(), data_dir());
    // With a grant, a path outside it does not resolve.
    let outside = [("path", "/etc/passwd")];
    let err = start(&config(
        cache.path(),
        &outside,
        vec![grant(data.path(), false)],
    ))
    .unwrap_err();
    assert!(err.contains("cannot read /etc/passwd"), "{err}");
    // `..` does not climb out of the preopen either.
    let name = data.path().file_name().unwrap().to_str().unwrap();
    let sneaky = format!("/data/../{name}/banned.txt");
    let err = start(&config(
        cache.path(),
        &[("path", &sneaky)],
        vec![grant(data.path(), false)],
    ))
    .unwrap_err();
    assert!(err.contains("cannot read"), "{err}");
    // Without a grant, the first filesystem call traps, naming the import.
    let err = start(&config(cache.path(), &[], vec![])).unwrap_err();
    assert!(
        err.contains("test:reads-grant")
            && err.contains("wasi:filesystem")
            && err.contains("does not grant"),
        "{err}"
    );
}

#[test]
fn bad_grants_are_refused_naming_what_is_wrong() {
    let (cache, data) = (tempfile::tempdir().unwrap(), data_dir());
    let mut unknown = grant(data.path(), false);
    unknown.plugin = "acme:nope".into();
    let err = start(&config(cache.path(), &[], vec![unknown])).unwrap_err();
    assert!(
        err.contains("[[plugins.grants]]")
            && err.contains("\"acme:nope\"")
            && err.contains("test:reads-grant"),
        "{err}"
    );
    let missing = grant(&data.path().join("missing"), false);
    let err = start(&config(cache.path(), &[], vec![missing])).unwrap_err();
    assert!(
        err.contains("missing") && err.contains("is not a directory"),
        "{err}"
    );
    let mut relative = grant(data.path(), false);
    relative.guest = "data".into();
    let err = start(&config(cache.path(), &[], vec![relative])).unwrap_err();
    assert!(err.contains("must be an absolute path"), "{err}");
}

#[test]
fn a_writable_grant_holding_the_cache_is_refused() {
    let data = data_dir();
    // Reached through a symlink and `..`, so only canonical paths match.
    let link = tempfile::tempdir().unwrap();
    let via = link.path().join("via");
    std::os::unix::fs::symlink(data.path(), &via).unwrap();
    let cache = via.join("sub/../cache");
    let err = start(&config(&cache, &[], vec![grant(data.path(), true)])).unwrap_err();
    let data_shown = data.path().canonicalize().unwrap().display().to_string();
    assert!(
        err.contains(&format!("dir {data_shown} is writable"))
            && err.contains(&format!("cache {data_shown}/cache"))
            && err.contains("plugins.cache_dir")
            && err.contains("writable = false"),
        "{err}"
    );
    assert!(
        !data.path().join("cache").exists(),
        "refused before creating the cache"
    );
    // The cache folder itself granted, through the symlink.
    let err = start(&config(&via, &[], vec![grant(data.path(), true)])).unwrap_err();
    assert!(
        err.contains("contains the compiled-component cache"),
        "{err}"
    );
    // Read-only, the plugin cannot plant anything: allowed.
    start(&config(&cache, &[], vec![grant(data.path(), false)])).unwrap();
    // A cache beside the writable grant is fine.
    let beside = tempfile::tempdir().unwrap();
    start(&config(beside.path(), &[], vec![grant(data.path(), true)])).unwrap();
}

#[test]
fn collective_rpc_cannot_load_plugins_with_other_grants_or_cache() {
    let (cache, data) = (tempfile::tempdir().unwrap(), data_dir());
    let mut c = EngineConfig::default();
    c.model.path = e2e::default_model();
    c.model.max_model_len = 256;
    c.cache.kv_cache_memory_bytes = Some(64 * 30 * 2 * 3 * 64 * 16 * 4);
    c.plugins = config(cache.path(), &[], vec![]);
    let mut llm = Llm::new(&c).unwrap();
    let mut asked = serde_json::to_value(&c.plugins).unwrap();
    asked["logits_processors"] = json!(["test:reads-grant"]);
    asked["grants"] = json!([{"plugin": "test:reads-grant", "dir": data.path(), "guest": "/data", "writable": true}]);
    let err = llm
        .collective_rpc("load_logits_processors", Some(asked.clone()))
        .unwrap_err();
    assert!(
        err.contains("refused") && err.contains("grants") && err.contains("operator's"),
        "{err}"
    );
    asked["grants"] = json!([]);
    asked["cache_dir"] = json!(data.path());
    let err = llm
        .collective_rpc("load_logits_processors", Some(asked))
        .unwrap_err();
    assert!(err.contains("cache_dir"), "{err}");
    assert_eq!(
        std::fs::read_dir(data.path()).unwrap().count(),
        1,
        "nothing cached there"
    );
    // The operator's own configuration loads (nothing to load here).
    let own = serde_json::to_value(&c.plugins).unwrap();
    llm.collective_rpc("load_logits_processors", Some(own))
        .unwrap();
}
