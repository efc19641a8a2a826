//! The cache against tampering, with real (if empty) components: a changed
//! or swapped entry and symlinks planted at its paths.

use std::path::{Path, PathBuf};

use wasmtime::component::Component;
use wasmtime::Engine;

use super::{CompiledCache, Outcome};

/// The smallest component: its header alone.
const EMPTY: &[u8] = b"\0asm\x0d\x00\x01\x00";

/// Another valid component: the header and a custom section named `x`.
const OTHER: &[u8] = b"\0asm\x0d\x00\x01\x00\x00\x02\x01x";

fn outcome(cache: &CompiledCache, engine: &Engine, bytes: &[u8]) -> Outcome {
    cache.load_or_compile(engine, bytes).unwrap().1
}

/// A fresh cache under a temporary folder, and `EMPTY`'s entry in it.
fn cache_with_entry(engine: &Engine) -> (tempfile::TempDir, CompiledCache, PathBuf) {
    let base = tempfile::tempdir().unwrap();
    let cache = CompiledCache::open(&base.path().join("cache")).unwrap();
    assert_eq!(outcome(&cache, engine, EMPTY), Outcome::Compiled);
    let (entry, _) = cache.entry(engine, EMPTY);
    assert!(entry.is_file());
    (base, cache, entry)
}

fn rejected(o: Outcome, why: &str) {
    assert!(
        matches!(&o, Outcome::Rejected(reason) if reason.contains(why)),
        "expected a rejection for {why:?}, got {o:?}"
    );
}

fn is_symlink(p: &Path) -> bool {
    std::fs::symlink_metadata(p)
        .unwrap()
        .file_type()
        .is_symlink()
}

#[test]
fn a_verified_entry_is_loaded_and_a_changed_one_is_not() {
    let engine = Engine::default();
    let (_base, cache, entry) = cache_with_entry(&engine);
    assert_eq!(outcome(&cache, &engine, EMPTY), Outcome::Loaded);
    // One flipped byte in the compiled code, past the tag.
    let mut bytes = std::fs::read(&entry).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&entry, &bytes).unwrap();
    rejected(
        outcome(&cache, &engine, EMPTY),
        "integrity tag does not match",
    );
    assert_ne!(
        std::fs::read(&entry).unwrap(),
        bytes,
        "the entry was rewritten"
    );
    assert_eq!(outcome(&cache, &engine, EMPTY), Outcome::Loaded);
    // Unsigned: a compiled component written without the tag, as an
    // attacker without the key would.
    let unsigned = Component::new(&engine, EMPTY).unwrap().serialize().unwrap();
    std::fs::write(&entry, &unsigned).unwrap();
    rejected(outcome(&cache, &engine, EMPTY), "integrity tag");
}

#[test]
fn another_valid_entry_copied_over_this_one_is_rejected() {
    let engine = Engine::default();
    let (_base, cache, entry) = cache_with_entry(&engine);
    assert_eq!(outcome(&cache, &engine, OTHER), Outcome::Compiled);
    let (other, _) = cache.entry(&engine, OTHER);
    assert_ne!(other, entry);
    std::fs::copy(&other, &entry).unwrap();
    rejected(
        outcome(&cache, &engine, EMPTY),
        "integrity tag does not match",
    );
    assert_eq!(outcome(&cache, &engine, EMPTY), Outcome::Loaded);
    assert_ne!(
        std::fs::read(&entry).unwrap(),
        std::fs::read(&other).unwrap()
    );
}

#[test]
fn a_symlink_at_the_entry_is_not_followed_and_is_replaced() {
    let engine = Engine::default();
    let (base, cache, entry) = cache_with_entry(&engine);
    // A valid, tagged entry elsewhere: following the link would load it.
    let planted = base.path().join("planted.cwasm");
    std::fs::rename(&entry, &planted).unwrap();
    std::os::unix::fs::symlink(&planted, &entry).unwrap();
    rejected(outcome(&cache, &engine, EMPTY), "symbolic link");
    assert!(!is_symlink(&entry), "the link was replaced by a file");
    assert!(planted.is_file(), "its target was left alone");
    assert_eq!(outcome(&cache, &engine, EMPTY), Outcome::Loaded);
}

#[test]
fn a_symlink_at_the_temporary_path_is_not_followed() {
    let engine = Engine::default();
    let base = tempfile::tempdir().unwrap();
    let cache = CompiledCache::open(&base.path().join("cache")).unwrap();
    let (entry, _) = cache.entry(&engine, EMPTY);
    let victim = base.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let tmp = super::cache_guard::temp_path(&entry);
    std::os::unix::fs::symlink(&victim, &tmp).unwrap();
    assert_eq!(outcome(&cache, &engine, EMPTY), Outcome::Compiled);
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(!tmp.exists() && !is_symlink(&entry));
    assert_eq!(outcome(&cache, &engine, EMPTY), Outcome::Loaded);
}
