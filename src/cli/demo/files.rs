//! The demo's files: the embedded ledger (with SQLite's lock and WAL files)
//! and the service's log beside it. A ledger the demo named itself is
//! removed at the end with its log, unless `--keep`; one given with
//! `--database` is the user's and stays.

use std::path::{Path, PathBuf};

/// The ledger a demo names itself: `volume-reconciler-demo-<uuid>.db` in the
/// temp directory.
pub fn fresh_ledger() -> PathBuf {
    std::env::temp_dir().join(format!(
        "volume-reconciler-demo-{}.db",
        uuid::Uuid::new_v4().simple()
    ))
}

/// The service's log beside the ledger (`.db` → `.log`).
pub fn log_beside(ledger: &Path) -> PathBuf {
    ledger.with_extension("log")
}

/// Every file a run may leave: the ledger, its lock, SQLite's WAL and
/// shared-memory files, and the log.
pub fn all(ledger: &Path) -> Vec<PathBuf> {
    let with = |suffix: &str| {
        let mut s = ledger.as_os_str().to_owned();
        s.push(suffix);
        PathBuf::from(s)
    };
    vec![
        ledger.to_path_buf(),
        with(".lock"),
        with("-wal"),
        with("-shm"),
        with("-journal"),
        log_beside(ledger),
    ]
}

/// Removes the files of a run; those that do not exist are fine (SQLite
/// removes its WAL on a clean close). Returns the ones that could not be
/// removed, with why.
pub fn remove(ledger: &Path) -> Vec<String> {
    all(ledger)
        .into_iter()
        .filter_map(|p| match std::fs::remove_file(&p) {
            Ok(()) => None,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => Some(format!("{}: {e}", p.display())),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_files_sit_beside_its_ledger() {
        let files = all(Path::new("/tmp/volume-reconciler-demo-x.db"));
        let names: Vec<_> = files
            .iter()
            .map(|p| p.to_string_lossy().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "/tmp/volume-reconciler-demo-x.db",
                "/tmp/volume-reconciler-demo-x.db.lock",
                "/tmp/volume-reconciler-demo-x.db-wal",
                "/tmp/volume-reconciler-demo-x.db-shm",
                "/tmp/volume-reconciler-demo-x.db-journal",
                "/tmp/volume-reconciler-demo-x.log",
            ]
        );
    }
}
