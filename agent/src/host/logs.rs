//! Retention of the step logs under `<state>/logs/<vm>/`: [`select`] decides which VM folders go
//! (pure), [`prune`] scans the folder and removes them.
//!
//! A VM's folder goes once it is older than `[logs] max_age`, and the oldest go first while all
//! folders together hold more than `max_total_bytes`. Never removed: the folders of attempts
//! still open on this agent (the caller's `keep`), folders written to in the last
//! [`RECENT`] (an attempt the caller does not know yet), and anything in `logs/` that is not a
//! folder named like a Tartan VM.

use crate::config::LogsConfig;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// Folders written to this recently are never removed, whatever the limits say.
pub const RECENT: Duration = Duration::from_secs(3600);

/// One VM's log folder as found on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogFolder {
    pub vm: String,
    /// The latest modification of the folder or of a file in it.
    pub modified: SystemTime,
    /// Bytes of the files in it.
    pub bytes: u64,
}

/// The VMs whose log folders to remove, oldest first: those older than `limits.max_age`, then,
/// while the total is above `limits.max_total_bytes`, the oldest of the rest. Folders in `keep`
/// or modified within [`RECENT`] of `now` are never chosen (they still count in the total).
pub fn select(folders: &[LogFolder], keep: &BTreeSet<String>, now: SystemTime, limits: &LogsConfig) -> Vec<String> {
    let age = |f: &LogFolder| now.duration_since(f.modified).unwrap_or(Duration::ZERO);
    let mut candidates: Vec<&LogFolder> = folders
        .iter()
        .filter(|f| !keep.contains(&f.vm) && age(f) >= RECENT)
        .collect();
    candidates.sort_by(|a, b| a.modified.cmp(&b.modified).then_with(|| a.vm.cmp(&b.vm)));
    let mut total: u64 = folders.iter().map(|f| f.bytes).fold(0, u64::saturating_add);
    let mut chosen = Vec::new();
    for f in candidates {
        if age(f) >= limits.max_age || total > limits.max_total_bytes {
            total = total.saturating_sub(f.bytes);
            chosen.push(f.vm.clone());
        }
    }
    chosen
}

/// What [`prune`] did.
#[derive(Debug, Default)]
pub struct Pruned {
    /// VM folders removed.
    pub removed: Vec<String>,
    /// Bytes their files held.
    pub freed: u64,
    /// Folders that could not be scanned or removed, and why; they are tried again next time.
    pub errors: Vec<String>,
}

/// Scans `<state_dir>/logs/` and removes the folders [`select`] chooses.
pub fn prune(state_dir: &Path, keep: &BTreeSet<String>, now: SystemTime, limits: &LogsConfig) -> Pruned {
    let logs = state_dir.join("logs");
    let mut pruned = Pruned::default();
    let entries = match std::fs::read_dir(&logs) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return pruned,
        Err(e) => {
            pruned.errors.push(format!("reading {}: {e}", logs.display()));
            return pruned;
        }
    };
    let mut folders = Vec::new();
    for entry in entries.flatten() {
        let Some(vm) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        // Only what the agent writes: real folders (not symlinks) named like its VMs.
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if !is_dir || tartan_api::check_vm_name(&vm).is_err() {
            continue;
        }
        match scan(&entry.path()) {
            Ok((modified, bytes)) => folders.push(LogFolder { vm, modified, bytes }),
            Err(e) => pruned.errors.push(e),
        }
    }
    for vm in select(&folders, keep, now, limits) {
        let dir = logs.join(&vm);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                pruned.freed += folders.iter().find(|f| f.vm == vm).map_or(0, |f| f.bytes);
                pruned.removed.push(vm);
            }
            Err(e) => pruned.errors.push(format!("removing {}: {e}", dir.display())),
        }
    }
    pruned
}

/// The latest modification time and the byte count of a VM's log folder (its files, one level:
/// the agent writes nothing deeper).
fn scan(dir: &Path) -> Result<(SystemTime, u64), String> {
    let err = |e: std::io::Error| format!("scanning {}: {e}", dir.display());
    let meta = std::fs::symlink_metadata(dir).map_err(err)?;
    let mut modified = meta.modified().map_err(err)?;
    let mut bytes = 0u64;
    for entry in std::fs::read_dir(dir).map_err(err)?.flatten() {
        let Ok(m) = entry.metadata() else { continue };
        bytes = bytes.saturating_add(m.len());
        if let Ok(t) = m.modified() {
            modified = modified.max(t);
        }
    }
    Ok((modified, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn folder(vm: &str, age: Duration, bytes: u64, now: SystemTime) -> LogFolder {
        LogFolder {
            vm: vm.into(),
            modified: now - age,
            bytes,
        }
    }

    fn limits(max_age: Duration, max_total_bytes: u64) -> LogsConfig {
        LogsConfig {
            max_age,
            max_total_bytes,
            ..LogsConfig::default()
        }
    }

    #[test]
    fn old_folders_go_then_the_oldest_while_over_the_size_limit() {
        let now = SystemTime::now();
        let folders = vec![
            folder("mb-c", 2 * DAY, 100, now),
            folder("mb-a", 10 * DAY, 100, now),
            folder("mb-b", 8 * DAY, 100, now),
            folder("mb-d", DAY, 100, now),
            folder("mb-e", Duration::from_secs(7200), 100, now),
        ];
        let none = BTreeSet::new();
        // Age only: oldest first.
        assert_eq!(
            select(&folders, &none, now, &limits(7 * DAY, 1 << 30)),
            vec!["mb-a", "mb-b"]
        );
        // Size: 500 bytes, limit 250: after the two old ones (300 left) the oldest of the rest.
        assert_eq!(
            select(&folders, &none, now, &limits(7 * DAY, 250)),
            vec!["mb-a", "mb-b", "mb-c"]
        );
        // Nothing over either limit: nothing goes.
        assert!(select(&folders, &none, now, &limits(30 * DAY, 500)).is_empty());
    }

    #[test]
    fn open_attempts_and_recent_folders_are_never_chosen() {
        let now = SystemTime::now();
        let folders = vec![
            folder("mb-open", 30 * DAY, 1000, now),
            folder("mb-fresh", Duration::from_secs(60), 1000, now),
            folder("mb-old", 30 * DAY, 10, now),
            // A clock that jumped back: modified "in the future" counts as fresh.
            LogFolder {
                vm: "mb-future".into(),
                modified: now + DAY,
                bytes: 10,
            },
        ];
        let keep = BTreeSet::from(["mb-open".to_string()]);
        // Even at a zero size limit, only the old, closed folder goes.
        assert_eq!(select(&folders, &keep, now, &limits(DAY, 0)), vec!["mb-old"]);
    }

    #[test]
    fn pruning_removes_real_folders_and_nothing_else() {
        let state = tempfile::tempdir().unwrap();
        let logs = state.path().join("logs");
        let now = SystemTime::now();
        let make = |vm: &str, age: Duration, bytes: usize| {
            let dir = logs.join(vm);
            std::fs::create_dir_all(&dir).unwrap();
            let file = std::fs::File::create(dir.join("build.log")).unwrap();
            file.set_len(bytes as u64).unwrap();
            file.set_modified(now - age).unwrap();
            std::fs::File::open(&dir).unwrap().set_modified(now - age).unwrap();
        };
        make("mb-old", 10 * DAY, 10);
        make("mb-open", 10 * DAY, 10);
        make("mb-new", Duration::from_secs(2 * 3600), 10);
        make("not-a-vm", 10 * DAY, 10);
        // A folder whose own time is old but whose log was just written is fresh.
        make("mb-writing", 10 * DAY, 10);
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(logs.join("mb-writing/build.log"))
            .unwrap();
        log.set_modified(now).unwrap();
        // A symlink named like a VM, pointing at something that must survive.
        let precious = state.path().join("precious");
        std::fs::create_dir_all(&precious).unwrap();
        std::os::unix::fs::symlink(&precious, logs.join("mb-link")).unwrap();

        let keep = BTreeSet::from(["mb-open".to_string()]);
        let pruned = prune(state.path(), &keep, now, &limits(7 * DAY, 5 << 30));
        assert_eq!(pruned.removed, vec!["mb-old"]);
        assert_eq!(pruned.freed, 10);
        assert!(pruned.errors.is_empty(), "{:?}", pruned.errors);
        let mut left: Vec<String> = std::fs::read_dir(&logs)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, vec!["mb-link", "mb-new", "mb-open", "mb-writing", "not-a-vm"]);
        assert!(precious.is_dir());

        // Over the size limit the oldest closed folder goes next.
        let pruned = prune(state.path(), &keep, now, &limits(7 * DAY, 25));
        assert_eq!(pruned.removed, vec!["mb-new"]);
        // No logs folder at all is not an error.
        let empty = tempfile::tempdir().unwrap();
        let pruned = prune(empty.path(), &keep, now, &limits(DAY, 0));
        assert!(pruned.removed.is_empty() && pruned.errors.is_empty());
    }
}
