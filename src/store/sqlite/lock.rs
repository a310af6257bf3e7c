//! One process per embedded database file: an exclusive lock on
//! `<file>.lock`, taken at start and held until the store closes, so a
//! second process is refused with a clear error instead of sharing the file.

use std::fs::File;
use std::os::fd::AsRawFd;

/// The file behind a `sqlite:` URL, if it is a file.
pub(super) fn file_of(url: &str) -> Option<String> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next().unwrap_or(rest);
    if path.is_empty() || path == ":memory:" || url.contains("mode=memory") {
        None
    } else {
        Some(path.to_string())
    }
}

pub(super) fn take_lock(path: &str) -> anyhow::Result<File> {
    let lock_path = format!("{path}.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&lock_path)
        .map_err(|e| anyhow::anyhow!("cannot open the lock file {lock_path}: {e}"))?;
    // SAFETY: flock on a descriptor we own; no memory is involved.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            anyhow::bail!(
                "the embedded database {path} is in use by another process (it holds {lock_path}); \
                 an embedded store serves one process only — run several replicas on PostgreSQL (--database-url postgres://...)"
            );
        }
        anyhow::bail!("cannot lock {lock_path}: {err}");
    }
    Ok(file)
}
