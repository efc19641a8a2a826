//! Directories granted to a plugin (`[[plugins.grants]]`), preopened with
//! cap-std: the plugin reads its granted file in `init`, cannot write there
//! unless the grant is `writable`, cannot reach anything outside it (not
//! /etc/passwd), and without a grant it sees no filesystem at all. A grant
//! for an unknown plugin or a missing directory is refused at start.

use std::path::Path;

use e2e::plugin;
use host::config::{GrantConfig, PluginsConfig};
use host::plugins::{host_from_config, PluginError, Row};

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
    processors.apply(&[row], &mut logits, 8).unwrap();
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
