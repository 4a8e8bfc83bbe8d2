//! Listing the deadline folder cheaply: one `read_dir` plus one `stat` per deadline file, so it can
//! run every second; a file's contents are read again only when its fingerprint changes.

use crate::plan::{Fingerprint, vm_of_file};
use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The deadline files in `dir` (names of the form `<vm>.json`), with their fingerprints. A missing
/// folder is an empty listing: the agent creates it with its first deadline file. A file that
/// vanishes between `read_dir` and `stat` is left out.
pub fn list(dir: &Path) -> io::Result<BTreeMap<String, Fingerprint>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(e),
    };
    let mut out = BTreeMap::new();
    for entry in entries {
        let entry = entry?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if vm_of_file(&name).is_none() {
            continue;
        }
        let meta = match entry.path().symlink_metadata() {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let mtime_ns = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
        out.insert(
            name,
            Fingerprint {
                inode: meta.ino(),
                len: meta.len(),
                mtime_ns,
            },
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::diff;

    #[test]
    fn lists_only_deadline_files_and_sees_rewrites_and_removals() {
        let dir = tempfile::tempdir().unwrap();
        let deadlines = dir.path().join("deadlines");
        assert!(list(&deadlines).unwrap().is_empty(), "a missing folder is empty");
        std::fs::create_dir(&deadlines).unwrap();
        std::fs::write(deadlines.join("mb-a.json"), "{}").unwrap();
        std::fs::write(deadlines.join(".mb-b.json.tmp"), "{}").unwrap();
        std::fs::write(deadlines.join("notes.txt"), "x").unwrap();
        let first = list(&deadlines).unwrap();
        assert_eq!(first.keys().collect::<Vec<_>>(), vec!["mb-a.json"]);

        // An atomic rewrite (write temp, rename over) is a change even with equal size.
        std::fs::write(deadlines.join(".mb-a.json.tmp"), "[]").unwrap();
        std::fs::rename(deadlines.join(".mb-a.json.tmp"), deadlines.join("mb-a.json")).unwrap();
        std::fs::write(deadlines.join("mb-c.json"), "{}").unwrap();
        let second = list(&deadlines).unwrap();
        let changes = diff(&first, &second);
        assert_eq!(changes.changed, vec!["mb-a.json", "mb-c.json"]);
        assert!(changes.removed.is_empty());

        std::fs::remove_file(deadlines.join("mb-a.json")).unwrap();
        let third = list(&deadlines).unwrap();
        let changes = diff(&second, &third);
        assert!(changes.changed.is_empty());
        assert_eq!(changes.removed, vec!["mb-a.json"]);
    }
}
