//! Whether a compiled-component cache folder can be trusted, and its key.
//!
//! The cache holds native code the host runs, so the folder must be one
//! only this user can write: it is created `0700`, and an existing one is
//! refused when another user owns it or its group or others may write to
//! it. The key the entries' tags are made with (`super::cache`) is 32
//! random bytes in `<dir>/key`, mode `0600`, published atomically (written
//! to a file created exclusively, then hard-linked into place, which fails
//! rather than replace a key another process published first) and read
//! with `O_NOFOLLOW`, refused when anyone else could read or write it.

use std::fs::{DirBuilder, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

/// The secret the cache's tags are made with.
pub struct Key([u8; 32]);

impl Key {
    /// The key's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The effective user id this process writes files as.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Creates `dir` (`0700`) if needed, checks it and reads or makes its key;
/// returns the folder's canonical path and the key. An error names the
/// path, what is wrong and how to fix it.
pub fn open(dir: &Path) -> Result<(PathBuf, Key), String> {
    let shown = dir.display();
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create the plugin cache dir {shown}: {e}"))?;
    // The checked, canonical path is used from here on, so a symlink on
    // the way that changes later cannot redirect the cache.
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("cannot resolve the plugin cache dir {shown}: {e}"))?;
    let meta = std::fs::metadata(&dir)
        .map_err(|e| format!("cannot inspect the plugin cache dir {shown}: {e}"))?;
    check_owner_and_mode(&dir, meta.uid(), meta.mode(), euid(), 0o022)?;
    let key = read_or_create_key(&dir.join("key"))?;
    Ok((dir, key))
}

/// Refuses `path` when `owner` is not `euid` or its mode has any bit of
/// `forbidden` (group/other write for the folder; any group/other access
/// for the key).
pub fn check_owner_and_mode(
    path: &Path,
    owner: u32,
    mode: u32,
    euid: u32,
    forbidden: u32,
) -> Result<(), String> {
    let shown = path.display();
    if owner != euid {
        return Err(format!(
            "{shown} is owned by uid {owner}, not by this user (uid {euid}): native code there could have been written by someone else; \
             point plugins.cache_dir at a folder of your own, or set plugins.cache = false"
        ));
    }
    if mode & forbidden != 0 {
        return Err(format!(
            "{shown} has mode {:o}: other users may change it; run `chmod {:o} {shown}`, \
             point plugins.cache_dir elsewhere, or set plugins.cache = false",
            mode & 0o7777,
            mode & 0o7777 & !forbidden
        ));
    }
    Ok(())
}

/// Reads the key at `path`, creating it when there is none.
fn read_or_create_key(path: &Path) -> Result<Key, String> {
    let shown = path.display();
    let open = || {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
    };
    let mut file = match open() {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            publish_new_key(path)?;
            open().map_err(|e| format!("cannot open the plugin cache key {shown}: {e}"))?
        }
        Err(e) => {
            return Err(format!(
                "cannot open the plugin cache key {shown} ({e}); delete it and the cache makes a new one"
            ))
        }
    };
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot inspect the plugin cache key {shown}: {e}"))?;
    check_owner_and_mode(path, meta.uid(), meta.mode(), euid(), 0o077)?;
    let mut key = [0u8; 32];
    let mut rest = Vec::new();
    let read = file
        .read_exact(&mut key)
        .and_then(|()| file.read_to_end(&mut rest));
    if !meta.is_file() || read.is_err() || !rest.is_empty() {
        return Err(format!(
            "the plugin cache key {shown} is not a file of 32 bytes; delete it and the cache makes a new one"
        ));
    }
    Ok(Key(key))
}

/// Writes 32 random bytes to a file created exclusively next to `path`
/// and links it to `path`; a key another process published first wins.
fn publish_new_key(path: &Path) -> Result<(), String> {
    let shown = path.display();
    let mut key = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut r| r.read_exact(&mut key))
        .map_err(|e| format!("cannot read /dev/urandom for the plugin cache key: {e}"))?;
    let (tmp, mut file) =
        create_temp(path).map_err(|e| format!("cannot create a file beside {shown}: {e}"))?;
    let linked = file
        .write_all(&key)
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::hard_link(&tmp, path));
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(format!("cannot write the plugin cache key {shown}: {e}")),
    }
}

/// Creates, exclusively and readable by the user alone, the file that is
/// written first and then renamed or linked to `path` (see [`temp_path`]);
/// returns its path and the open file. One already there was left by a
/// crashed process with this pid and thread, or planted: it is removed
/// (removing a symlink never touches its target) and creation is tried
/// once more, still exclusively, so no link is ever followed.
pub fn create_temp(path: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    let tmp = temp_path(path);
    let create = || {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
    };
    let file = match create() {
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            std::fs::remove_file(&tmp)?;
            create()?
        }
        other => other?,
    };
    Ok((tmp, file))
}

/// Where a file to be renamed or linked to `path` is written first: named
/// by process and thread, so concurrent writers never share one (the
/// calling thread can know it in advance; `O_EXCL` makes that harmless).
pub fn temp_path(path: &Path) -> PathBuf {
    // SAFETY: pthread_self has no preconditions and cannot fail.
    let thread = unsafe { libc::pthread_self() } as usize;
    let pid = std::process::id();
    path.with_extension(format!("tmp{pid}-{thread:x}"))
}

/// `path` made absolute with every symlink of its existing part resolved
/// and `.`/`..` of the rest applied, so two paths to one place compare
/// equal even before the folder exists.
pub fn resolve(path: &Path) -> PathBuf {
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let parts: Vec<Component> = path.components().collect();
    for split in (1..=parts.len()).rev() {
        let existing: PathBuf = parts[..split].iter().collect();
        let Ok(mut resolved) = existing.canonicalize() else {
            continue;
        };
        for part in &parts[split..] {
            match part {
                Component::ParentDir => {
                    resolved.pop();
                }
                Component::Normal(p) => resolved.push(p),
                _ => {}
            }
        }
        return resolved;
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_folder_is_created_private_and_the_key_kept() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("a/cache");
        let (canonical, key) = open(&dir).unwrap();
        assert_eq!(canonical, dir.canonicalize().unwrap());
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("key")), 0o600);
        let (_, again) = open(&dir).unwrap();
        assert_eq!(key.bytes(), again.bytes(), "the key is kept");
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary left"
        );
    }

    #[test]
    fn a_folder_or_key_others_may_change_is_refused() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("cache");
        std::fs::create_dir(&dir).unwrap();
        for (mode, fix) in [(0o777, "chmod 755"), (0o770, "chmod 750")] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = open(&dir).err().unwrap();
            assert!(
                err.contains(&dir.display().to_string()) && err.contains(fix),
                "{mode:o}: {err}"
            );
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        open(&dir).unwrap();
        let key = dir.join("key");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = open(&dir).err().unwrap();
        assert!(err.contains("key") && err.contains("chmod 600"), "{err}");
        // A symlink planted as the key is not followed.
        std::fs::remove_file(&key).unwrap();
        let elsewhere = base.path().join("elsewhere");
        std::fs::write(&elsewhere, [7u8; 32]).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &key).unwrap();
        let err = open(&dir).err().unwrap();
        assert!(err.contains("cannot open the plugin cache key"), "{err}");
    }

    #[test]
    fn another_owner_is_refused() {
        let err = check_owner_and_mode(Path::new("/c"), 1000, 0o700, 1001, 0o022).unwrap_err();
        assert!(
            err.contains("owned by uid 1000") && err.contains("uid 1001"),
            "{err}"
        );
        check_owner_and_mode(Path::new("/c"), 1001, 0o755, 1001, 0o022).unwrap();
    }

    #[test]
    fn resolve_applies_symlinks_and_dots_of_missing_paths() {
        let base = tempfile::tempdir().unwrap();
        let real = base.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let canonical = real.canonicalize().unwrap();
        assert_eq!(resolve(&link.join("x/../y")), canonical.join("y"));
        assert_eq!(resolve(&link), canonical);
    }
}
