//! The on-disk cache of compiled components: compiling a plugin takes about
//! 100 ms (seconds for a large one), loading its compiled form about 0.3 ms,
//! so a restart should never compile again.
//!
//! An entry is `<sha256 of the .wasm>-<engine compatibility hash>.cwasm`:
//! a changed plugin or a host whose wasmtime settings or version differ gets
//! a new key instead of loading incompatible code.
//!
//! An entry is native code the host runs, so the cache only loads what this
//! host wrote ([`super::cache_guard`] checks the folder and keeps the key):
//! every entry starts with an HMAC-SHA256 tag, under a per-user secret key,
//! over the entry's name and its compiled bytes. A tag that does not match
//! (a flipped byte, a torn write, another entry copied over this one, or a
//! file written by anyone without the key) means the entry is recompiled and
//! replaced, never deserialized. Entries are written to a file created
//! exclusively (`O_CREAT | O_EXCL`: a planted symlink is not followed) and
//! renamed into place, and read with `O_NOFOLLOW`.

use std::fs::OpenOptions;
use std::hash::{Hash, Hasher};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

use super::cache_guard::{self, Key};

/// Length of the HMAC-SHA256 tag that starts every entry.
const TAG_LEN: usize = 32;

/// What [`CompiledCache::load_or_compile`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The entry was verified and loaded.
    Loaded,
    /// There was no entry: compiled, and stored.
    Compiled,
    /// An entry was there but failed its check (the reason): compiled, and
    /// the entry replaced.
    Rejected(String),
}

/// A checked cache folder and its key.
pub struct CompiledCache {
    dir: PathBuf,
    key: Key,
}

impl CompiledCache {
    /// Opens (creating it `0700`) the cache folder `dir`; an error says why
    /// the folder cannot be trusted and how to fix it.
    pub fn open(dir: &Path) -> Result<CompiledCache, String> {
        let (dir, key) = cache_guard::open(dir)?;
        Ok(CompiledCache { dir, key })
    }

    /// The folder, canonical.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The entry file for `bytes` and the name its tag covers.
    fn entry(&self, engine: &Engine, bytes: &[u8]) -> (PathBuf, String) {
        let digest = Sha256::digest(bytes);
        let content: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        // SipHash with fixed keys: stable for one build of the host, which
        // is all the compatibility hash promises anyway.
        #[allow(deprecated)]
        let mut h = std::hash::SipHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        let name = format!("{content}-{:016x}.cwasm", h.finish());
        (self.dir.join(&name), name)
    }

    /// Loads the verified compiled form of `bytes`, or compiles it and
    /// stores it. Write failures are logged, never fatal: the cache only
    /// saves time.
    pub fn load_or_compile(
        &self,
        engine: &Engine,
        bytes: &[u8],
    ) -> wasmtime::Result<(Component, Outcome)> {
        let (entry, name) = self.entry(engine, bytes);
        let rejected = match self.read_verified(&entry, &name) {
            Ok(None) => None,
            Ok(Some(compiled)) => {
                // SAFETY: the tag proves these bytes are what this host
                // serialized under this entry's name, which includes the
                // engine's compatibility hash; wasmtime checks its header too.
                match unsafe { Component::deserialize(engine, &compiled[TAG_LEN..]) } {
                    Ok(component) => return Ok((component, Outcome::Loaded)),
                    Err(e) => Some(format!("wasmtime refused it: {e}")),
                }
            }
            Err(reason) => Some(reason),
        };
        if let Some(reason) = &rejected {
            tracing::warn!(
                "plugin cache entry {} rejected ({reason}); recompiling and replacing it",
                entry.display()
            );
        }
        let component = Component::new(engine, bytes)?;
        if let Err(e) = self.store(&entry, &name, &component) {
            tracing::warn!("cannot write plugin cache entry {}: {e}", entry.display());
        }
        Ok((
            component,
            rejected.map_or(Outcome::Compiled, Outcome::Rejected),
        ))
    }

    /// The entry's bytes (its tag, then the compiled component from
    /// [`TAG_LEN`] on) if the tag verifies; `None` when there is none; an
    /// error saying why it is not trusted otherwise.
    fn read_verified(&self, entry: &Path, name: &str) -> Result<Option<Vec<u8>>, String> {
        // Read into memory rather than mapped: a mapped file truncated by
        // another process would fault this one (SIGBUS).
        let mut file = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(entry)
        {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err("it is a symbolic link".into())
            }
            Err(e) => return Err(format!("cannot open it: {e}")),
        };
        let mut data = Vec::new();
        file.read_to_end(&mut data)
            .map_err(|e| format!("cannot read it: {e}"))?;
        if data.len() < TAG_LEN {
            return Err("it is shorter than its integrity tag".into());
        }
        let (tag, compiled) = data.split_at(TAG_LEN);
        let expected = hmac_sha256(self.key.bytes(), &[name.as_bytes(), &[0], compiled]);
        if !equal_in_constant_time(tag, &expected) {
            return Err(
                "its integrity tag does not match: it was changed, or not written by this host"
                    .into(),
            );
        }
        Ok(Some(data))
    }

    fn store(&self, entry: &Path, name: &str, component: &Component) -> anyhow::Result<()> {
        let compiled = component.serialize()?;
        let tag = hmac_sha256(self.key.bytes(), &[name.as_bytes(), &[0], &compiled]);
        let (tmp, mut file) = cache_guard::create_temp(entry)?;
        let written = file
            .write_all(&tag)
            .and_then(|()| file.write_all(&compiled));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
        // rename(2) replaces whatever `entry` is, a symlink included,
        // without following it.
        std::fs::rename(&tmp, entry)?;
        Ok(())
    }
}

/// HMAC-SHA256 (RFC 2104) of the concatenated `parts` under `key`.
pub(super) fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut block_key = [0u8; BLOCK];
    if key.len() > BLOCK {
        block_key[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block_key[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(block_key.map(|b| b ^ 0x36));
    for part in parts {
        inner.update(part);
    }
    let mut outer = Sha256::new();
    outer.update(block_key.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Compares without an early exit, so the time taken says nothing about
/// where a forged tag first differs.
fn equal_in_constant_time(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod hmac_tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test cases 2 and 6 (a key longer than the block).
        let tag = hmac_sha256(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(
            hex(&tag),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let tag = hmac_sha256(
            &[0xaa; 131],
            &[b"Test Using Larger Than Block-Size Key - Hash Key First"],
        );
        assert_eq!(
            hex(&tag),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }
}
