//! The on-disk cache of compiled components: compiling a plugin takes about
//! 100 ms (seconds for a large one), loading its compiled form about 0.3 ms,
//! so a restart should never compile again.
//!
//! An entry is `<sha256 of the .wasm>-<engine compatibility hash>.cwasm`:
//! a changed plugin or a host whose wasmtime settings or version differ gets
//! a new key instead of loading incompatible code. Entries are written to a
//! temporary file and renamed, so a crash never leaves a torn entry, and an
//! entry that fails to load is recompiled and replaced.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

/// The cache file for `bytes` under `dir`.
pub(super) fn entry_path(engine: &Engine, dir: &Path, bytes: &[u8]) -> PathBuf {
    let digest = Sha256::digest(bytes);
    let content: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    // SipHash with fixed keys: stable for one build of the host, which is
    // all the compatibility hash promises anyway.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    dir.join(format!("{content}-{:016x}.cwasm", h.finish()))
}

/// Loads the compiled form of `bytes` from `dir`, or compiles it and stores
/// it there. Cache write failures are logged, never fatal: the cache only
/// saves time.
pub(super) fn load_or_compile(
    engine: &Engine,
    dir: Option<&Path>,
    bytes: &[u8],
) -> wasmtime::Result<Component> {
    let Some(dir) = dir else {
        return Component::new(engine, bytes);
    };
    let entry = entry_path(engine, dir, bytes);
    // Read into memory rather than mapped: a mapped file truncated by
    // another process would fault this one (SIGBUS).
    if let Ok(compiled) = std::fs::read(&entry) {
        // SAFETY: the entry was written by `Component::serialize` of this
        // engine configuration (the key includes its compatibility hash),
        // into a cache directory only this host writes; wasmtime checks its
        // header and rejects anything else.
        match unsafe { Component::deserialize(engine, &compiled) } {
            Ok(component) => return Ok(component),
            Err(e) => tracing::warn!(
                "plugin cache entry {} is unusable ({e}); recompiling",
                entry.display()
            ),
        }
    }
    let component = Component::new(engine, bytes)?;
    if let Err(e) = store(&entry, &component) {
        tracing::warn!("cannot write plugin cache entry {}: {e}", entry.display());
    }
    Ok(component)
}

fn store(entry: &Path, component: &Component) -> anyhow::Result<()> {
    let dir = entry.parent().expect("entry paths have a parent");
    std::fs::create_dir_all(dir)?;
    let tmp = entry.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, component.serialize()?)?;
    std::fs::rename(&tmp, entry)?;
    Ok(())
}
