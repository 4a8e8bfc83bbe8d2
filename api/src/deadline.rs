//! The per-VM deadline file: written by the agent to `<state>/deadlines/<vm>.json` before
//! `tart clone`, read by the watchdog, which deletes a VM once it is well past its deadline
//! without reading the journal or taking the agent's lock.
//!
//! The file is versioned JSON:
//!
//! ```json
//! {"version":1,"vm":"mb-ci-build-42-c49f62f4","namespace":"ci","name":"build-42","uid":"6f1c…",
//!  "attempt":1,"deadline":"2026-10-05T02:55:36.40012Z","agent":"mac-mini-07",
//!  "writtenAt":"2026-10-05T02:53:56.4Z"}
//! ```
//!
//! A reader refuses a newer version instead of guessing: the watchdog must never delete a VM on
//! the strength of a file it does not understand.

use crate::files::{ReadFileError, read_regular_file};
use crate::names::check_vm_name;
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The format version this crate writes and the only one it reads.
pub const DEADLINE_FILE_VERSION: u64 = 1;

/// Name of the deadline directory inside the agent's state directory.
pub const DEADLINES_DIR: &str = "deadlines";

/// Extension of a deadline file.
const EXTENSION: &str = ".json";

/// The largest deadline file read. The agent writes a few hundred bytes; anything far larger was
/// not written by it and is refused unread.
pub const MAX_DEADLINE_FILE_BYTES: u64 = 64 << 10;

/// When one VM must be gone, and whose it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadlineFile {
    /// The tart VM; the file is named `<vm>.json`.
    pub vm: String,
    /// Namespace of the MacBuild.
    pub namespace: String,
    /// Name of the MacBuild.
    pub name: String,
    /// uid of the MacBuild.
    pub uid: String,
    /// Attempt number (1, 2, 3).
    pub attempt: u32,
    /// Host execution deadline (first admission + `timeoutSeconds`).
    pub deadline: Timestamp,
    /// The agent that wrote the file.
    pub agent: String,
    /// When the agent wrote it.
    pub written_at: Timestamp,
}

/// The on-disk shape: the version next to the fields.
#[derive(Serialize)]
struct VersionedRef<'a> {
    version: u64,
    #[serde(flatten)]
    file: &'a DeadlineFile,
}

#[derive(Deserialize)]
struct Versioned {
    #[serde(flatten)]
    file: DeadlineFile,
}

/// Only the version, read first so a newer format is named as such rather than as garbage.
#[derive(Deserialize)]
struct VersionProbe {
    version: Option<serde_json::Value>,
}

/// A deadline file that could not be used, with the reason.
#[derive(Debug)]
pub struct BadFile {
    /// The file (or the directory, if listing an entry failed).
    pub path: PathBuf,
    /// What is wrong with it.
    pub error: DeadlineFileError,
}

/// Everything that can go wrong with deadline files. Each names the VM or file it concerns.
#[derive(Debug, thiserror::Error)]
pub enum DeadlineFileError {
    /// The VM name is not one Tartan creates, so no file is written or removed for it.
    #[error("refusing deadline file for VM {vm:?}: the name {why}; no file was written or removed")]
    InvalidVmName { vm: String, why: &'static str },

    /// Serializing failed (not expected for this plain struct, but never a panic).
    #[error("encoding the deadline file for VM {vm}: {source}; nothing was written")]
    Encode { vm: String, source: serde_json::Error },

    /// The file could not be read.
    #[error("reading deadline file {path}: {source}; it is skipped")]
    Read { path: PathBuf, source: io::Error },

    /// Not a regular file (a FIFO, a symbolic link, a directory, a device): the agent writes only
    /// regular files, and reading anything else could block or never end.
    #[error(
        "deadline file {path} is {what}, not a regular file the agent wrote; it is skipped unread and no VM is touched because of it (remove it)"
    )]
    NotRegular { path: PathBuf, what: &'static str },

    /// Far larger than any deadline file the agent writes.
    #[error(
        "deadline file {path} is {len} bytes, more than the {MAX_DEADLINE_FILE_BYTES} bytes a deadline file can be; it is skipped unread and no VM is touched because of it (remove it)"
    )]
    TooLarge { path: PathBuf, len: u64 },

    /// The content is not JSON of the expected shape.
    #[error("deadline file {path} is malformed: {source}; it is skipped and its VM is not touched")]
    Malformed { path: PathBuf, source: serde_json::Error },

    /// No `version` field, or one that is not a whole number.
    #[error("deadline file {path} has no valid \"version\" field; it is skipped and its VM is not touched")]
    MissingVersion { path: PathBuf },

    /// Written by a newer agent; this reader does not guess at its meaning.
    #[error(
        "deadline file {path} has version {found}, this build reads only version {DEADLINE_FILE_VERSION}; \
         it is skipped and its VM is not touched (upgrade the watchdog)"
    )]
    UnsupportedVersion { path: PathBuf, found: u64 },

    /// The VM named inside is not a Tartan VM name, or not the one the file name says.
    #[error("deadline file {path} names VM {vm:?}, which {why}; it is skipped and its VM is not touched")]
    WrongVm { path: PathBuf, vm: String, why: String },

    /// A step of the atomic write failed; the previous file (if any) is unchanged.
    #[error("writing deadline file {path} failed at {step}: {source}; the VM must not be cloned without it")]
    Write {
        path: PathBuf,
        step: &'static str,
        source: io::Error,
    },

    /// The file could not be removed.
    #[error("removing deadline file {path}: {source}; the watchdog may still act on it")]
    Remove { path: PathBuf, source: io::Error },

    /// The directory could not be listed.
    #[error("listing deadline directory {dir}: {source}; no deadline could be checked")]
    ReadDir { dir: PathBuf, source: io::Error },
}

/// The file name for `vm`'s deadline: `<vm>.json`.
pub fn deadline_file_name(vm: &str) -> String {
    format!("{vm}{EXTENSION}")
}

/// Encodes `file` as version-1 JSON (one line, newline-terminated).
pub fn encode(file: &DeadlineFile) -> Result<Vec<u8>, DeadlineFileError> {
    check_vm_name(&file.vm).map_err(|why| DeadlineFileError::InvalidVmName {
        vm: file.vm.clone(),
        why,
    })?;
    let mut bytes = serde_json::to_vec(&VersionedRef {
        version: DEADLINE_FILE_VERSION,
        file,
    })
    .map_err(|source| DeadlineFileError::Encode {
        vm: file.vm.clone(),
        source,
    })?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// Decodes the content of the deadline file at `path` (used only to name it in errors).
pub fn decode(path: &Path, bytes: &[u8]) -> Result<DeadlineFile, DeadlineFileError> {
    let malformed = |source| DeadlineFileError::Malformed {
        path: path.to_path_buf(),
        source,
    };
    let probe: VersionProbe = serde_json::from_slice(bytes).map_err(malformed)?;
    match probe.version.as_ref().and_then(serde_json::Value::as_u64) {
        None => {
            return Err(DeadlineFileError::MissingVersion {
                path: path.to_path_buf(),
            });
        }
        Some(DEADLINE_FILE_VERSION) => {}
        Some(found) => {
            return Err(DeadlineFileError::UnsupportedVersion {
                path: path.to_path_buf(),
                found,
            });
        }
    }
    let Versioned { file } = serde_json::from_slice(bytes).map_err(malformed)?;
    check_vm_name(&file.vm).map_err(|why| DeadlineFileError::WrongVm {
        path: path.to_path_buf(),
        vm: file.vm.clone(),
        why: format!("is not a Tartan VM name: it {why}"),
    })?;
    Ok(file)
}

/// Reads one deadline file and checks that it is named after the VM it describes. Only a regular
/// file of at most [`MAX_DEADLINE_FILE_BYTES`] is read, never through a symbolic link and never
/// blocking (`tartan_api::files`): whatever else sits in the folder is refused at once.
pub fn read_deadline_file(path: &Path) -> Result<DeadlineFile, DeadlineFileError> {
    let path_buf = || path.to_path_buf();
    let bytes = read_regular_file(path, MAX_DEADLINE_FILE_BYTES).map_err(|e| match e {
        ReadFileError::Io(source) => DeadlineFileError::Read {
            path: path_buf(),
            source,
        },
        ReadFileError::NotRegular(what) => DeadlineFileError::NotRegular { path: path_buf(), what },
        ReadFileError::TooLarge { len, .. } => DeadlineFileError::TooLarge { path: path_buf(), len },
    })?;
    let file = decode(path, &bytes)?;
    let expected = deadline_file_name(&file.vm);
    if path.file_name().and_then(|n| n.to_str()) != Some(expected.as_str()) {
        return Err(DeadlineFileError::WrongVm {
            path: path.to_path_buf(),
            vm: file.vm,
            why: format!("does not match the file name (expected {expected})"),
        });
    }
    Ok(file)
}

/// Writes `file` to `dir/<vm>.json` atomically and durably: a temp file in `dir` is written and
/// synced, renamed over the target, and `dir` itself is synced, so after a crash the file is
/// either the old one or the new one, never partial. Creates `dir` if needed. Returns the path.
pub fn write_deadline_file(dir: &Path, file: &DeadlineFile) -> Result<PathBuf, DeadlineFileError> {
    let bytes = encode(file)?;
    let path = dir.join(deadline_file_name(&file.vm));
    let temp = dir.join(temp_file_name(&file.vm));
    let fail = |step: &'static str| {
        let path = path.clone();
        move |source| DeadlineFileError::Write { path, step, source }
    };
    fs::create_dir_all(dir).map_err(fail("creating the directory"))?;
    // Whatever sits at the temp name is not followed or written through: a stale temp file is
    // removed (a planted symlink with it), and the new one is created exclusively, which refuses
    // a symlink or anything recreated there meanwhile.
    let _ = fs::remove_file(&temp);
    let written = (|| {
        let mut out = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&temp)
            .map_err(fail("creating the temp file"))?;
        out.write_all(&bytes).map_err(fail("writing the temp file"))?;
        out.sync_all().map_err(fail("syncing the temp file"))?;
        fs::rename(&temp, &path).map_err(fail("renaming the temp file into place"))
    })();
    if written.is_err() {
        // Best effort: a leftover temp file is skipped by readers and replaced by the next write.
        let _ = fs::remove_file(&temp);
    }
    written?;
    sync_dir(dir).map_err(fail("syncing the directory"))?;
    Ok(path)
}

/// Removes `vm`'s deadline file from `dir` and syncs `dir`. Returns whether a file was there.
pub fn remove_deadline_file(dir: &Path, vm: &str) -> Result<bool, DeadlineFileError> {
    check_vm_name(vm).map_err(|why| DeadlineFileError::InvalidVmName {
        vm: vm.to_string(),
        why,
    })?;
    let path = dir.join(deadline_file_name(vm));
    match fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(source) => return Err(DeadlineFileError::Remove { path, source }),
    }
    sync_dir(dir).map_err(|source| DeadlineFileError::Remove { path, source })?;
    Ok(true)
}

/// Reads every deadline file in `dir`, sorted by VM name. Files that cannot be used are returned
/// in the second list instead of failing the scan, so one bad file never hides the others.
/// Hidden files (including this module's temp files) are ignored; a missing `dir` means no
/// deadlines yet (the agent creates it with the first file).
pub fn read_deadline_dir(dir: &Path) -> Result<(Vec<DeadlineFile>, Vec<BadFile>), DeadlineFileError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), Vec::new())),
        Err(source) => {
            return Err(DeadlineFileError::ReadDir {
                dir: dir.to_path_buf(),
                source,
            });
        }
    };
    let mut files = Vec::new();
    let mut bad = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(source) => {
                let error = DeadlineFileError::ReadDir {
                    dir: dir.to_path_buf(),
                    source,
                };
                bad.push(BadFile {
                    path: dir.to_path_buf(),
                    error,
                });
                continue;
            }
        };
        if entry.file_name().as_encoded_bytes().starts_with(b".") {
            continue;
        }
        let path = entry.path();
        match read_deadline_file(&path) {
            Ok(file) => files.push(file),
            Err(error) => bad.push(BadFile { path, error }),
        }
    }
    files.sort_by(|a, b| a.vm.cmp(&b.vm));
    bad.sort_by(|a, b| a.path.cmp(&b.path));
    Ok((files, bad))
}

/// Hidden (leading dot) so readers skip it, and unique per VM so writes for different VMs never
/// collide.
fn temp_file_name(vm: &str) -> String {
    format!(".{vm}{EXTENSION}.tmp")
}

/// Makes a rename or removal in `dir` durable (std uses `F_FULLFSYNC` on macOS).
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(vm: &str) -> DeadlineFile {
        DeadlineFile {
            vm: vm.to_string(),
            namespace: "ci".into(),
            name: "build-42".into(),
            uid: "6f1c0e2a-1111-2222-3333-444455556666".into(),
            attempt: 1,
            deadline: "2026-10-05T02:55:36.40012Z".parse().unwrap(),
            agent: "mac-mini-07".into(),
            written_at: "2026-10-05T02:53:56.4Z".parse().unwrap(),
        }
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn encodes_the_documented_camel_case_form() {
        let json: serde_json::Value = serde_json::from_slice(&encode(&sample("mb-ci-b-0000abcd")).unwrap()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "version": 1, "vm": "mb-ci-b-0000abcd", "namespace": "ci", "name": "build-42",
                "uid": "6f1c0e2a-1111-2222-3333-444455556666", "attempt": 1,
                "deadline": "2026-10-05T02:55:36.40012Z", "agent": "mac-mini-07",
                "writtenAt": "2026-10-05T02:53:56.4Z"
            })
        );
    }

    #[test]
    fn encode_and_decode_round_trip_with_subsecond_precision() {
        let file = sample("mb-ci-b-0000abcd");
        let decoded = decode(Path::new("x.json"), &encode(&file).unwrap()).unwrap();
        assert_eq!(decoded, file);
    }

    #[test]
    fn a_newer_version_is_refused_by_name() {
        let bytes = br#"{"version":2,"vm":"mb-x-1","somethingNew":true}"#;
        let err = decode(Path::new("/s/deadlines/mb-x-1.json"), bytes).unwrap_err();
        assert!(
            matches!(err, DeadlineFileError::UnsupportedVersion { found: 2, .. }),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("/s/deadlines/mb-x-1.json") && text.contains("version 2"),
            "{text}"
        );
    }

    #[test]
    fn garbage_missing_version_and_missing_fields_are_refused() {
        let path = Path::new("/s/deadlines/mb-x-1.json");
        for bytes in [&b"\x00\xffnot json"[..], b"", b"[1,2]", b"{\"version\":1,\"vm\":"] {
            let err = decode(path, bytes).unwrap_err();
            assert!(matches!(err, DeadlineFileError::Malformed { .. }), "{bytes:?}: {err:?}");
            assert!(err.to_string().contains("/s/deadlines/mb-x-1.json"));
        }
        for bytes in [&br#"{"vm":"mb-x-1"}"#[..], br#"{"version":"1"}"#, br#"{"version":-1}"#] {
            let err = decode(path, bytes).unwrap_err();
            assert!(matches!(err, DeadlineFileError::MissingVersion { .. }), "{err:?}");
        }
        let err = decode(path, br#"{"version":1,"vm":"mb-x-1"}"#).unwrap_err();
        assert!(matches!(err, DeadlineFileError::Malformed { .. }), "{err:?}");
        let mut bad_time = serde_json::to_value(VersionedRef {
            version: 1,
            file: &sample("mb-x-1"),
        })
        .unwrap();
        bad_time["deadline"] = "yesterday".into();
        let err = decode(path, &serde_json::to_vec(&bad_time).unwrap()).unwrap_err();
        assert!(matches!(err, DeadlineFileError::Malformed { .. }), "{err:?}");
    }

    #[test]
    fn a_file_naming_a_foreign_vm_is_refused() {
        let mut foreign = serde_json::to_value(VersionedRef {
            version: 1,
            file: &sample("mb-x-1"),
        })
        .unwrap();
        foreign["vm"] = "macos-base".into();
        let err = decode(Path::new("macos-base.json"), &serde_json::to_vec(&foreign).unwrap()).unwrap_err();
        assert!(matches!(err, DeadlineFileError::WrongVm { .. }), "{err:?}");
    }

    #[test]
    fn encode_refuses_names_that_could_escape_the_directory() {
        for vm in ["../../etc/passwd", "mb-a/b", "base"] {
            let err = encode(&sample(vm)).unwrap_err();
            assert!(matches!(err, DeadlineFileError::InvalidVmName { .. }), "{vm}: {err:?}");
        }
    }

    #[test]
    fn write_then_read_leaves_exactly_the_target_file() {
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join(DEADLINES_DIR);
        let file = sample("mb-ci-b-0000abcd");
        let path = write_deadline_file(&dir, &file).unwrap();
        assert_eq!(path, dir.join("mb-ci-b-0000abcd.json"));
        assert_eq!(names_in(&dir), vec!["mb-ci-b-0000abcd.json"]);
        assert_eq!(read_deadline_file(&path).unwrap(), file);
    }

    #[test]
    fn a_rewrite_replaces_the_content() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = sample("mb-ci-b-0000abcd");
        write_deadline_file(dir.path(), &file).unwrap();
        file.deadline = "2026-10-05T03:00:00Z".parse().unwrap();
        let path = write_deadline_file(dir.path(), &file).unwrap();
        assert_eq!(read_deadline_file(&path).unwrap(), file);
        assert_eq!(names_in(dir.path()), vec!["mb-ci-b-0000abcd.json"]);
    }

    #[test]
    fn a_failed_write_keeps_the_old_file_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = sample("mb-ci-b-0000abcd");
        write_deadline_file(dir.path(), &file).unwrap();
        // A directory where the temp file should go makes the write fail before the rename.
        fs::create_dir(dir.path().join(temp_file_name(&file.vm))).unwrap();
        let mut newer = file.clone();
        newer.attempt = 2;
        let err = write_deadline_file(dir.path(), &newer).unwrap_err();
        assert!(
            matches!(
                err,
                DeadlineFileError::Write {
                    step: "creating the temp file",
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            read_deadline_file(&dir.path().join("mb-ci-b-0000abcd.json")).unwrap(),
            file
        );
    }

    #[test]
    fn a_symlink_planted_at_the_temp_name_is_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("authorized_keys");
        fs::write(&victim, b"precious").unwrap();
        let file = sample("mb-ci-b-0000abcd");
        std::os::unix::fs::symlink(&victim, dir.path().join(temp_file_name(&file.vm))).unwrap();
        let path = write_deadline_file(dir.path(), &file).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert!(!path.symlink_metadata().unwrap().file_type().is_symlink());
        assert_eq!(read_deadline_file(&path).unwrap(), file);
        assert_eq!(names_in(dir.path()), vec!["mb-ci-b-0000abcd.json"]);
    }

    #[test]
    fn remove_reports_whether_a_file_was_there() {
        let dir = tempfile::tempdir().unwrap();
        write_deadline_file(dir.path(), &sample("mb-ci-b-0000abcd")).unwrap();
        assert!(remove_deadline_file(dir.path(), "mb-ci-b-0000abcd").unwrap());
        assert!(!remove_deadline_file(dir.path(), "mb-ci-b-0000abcd").unwrap());
        assert!(names_in(dir.path()).is_empty());
        let err = remove_deadline_file(dir.path(), "../x").unwrap_err();
        assert!(matches!(err, DeadlineFileError::InvalidVmName { .. }), "{err:?}");
    }

    #[test]
    fn scanning_reports_bad_files_and_skips_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let good_b = sample("mb-ci-b-0000000b");
        let good_a = sample("mb-ci-a-0000000a");
        write_deadline_file(dir.path(), &good_b).unwrap();
        write_deadline_file(dir.path(), &good_a).unwrap();
        fs::write(dir.path().join(".mb-ci-c-0000000c.json.tmp"), b"{half").unwrap();
        fs::write(dir.path().join(".DS_Store"), b"\x00").unwrap();
        fs::write(dir.path().join("mb-ci-d-0000000d.json"), b"garbage").unwrap();
        fs::write(dir.path().join("mb-ci-e-0000000e.json"), br#"{"version":2}"#).unwrap();
        // Valid content under another VM's name.
        fs::copy(
            dir.path().join("mb-ci-a-0000000a.json"),
            dir.path().join("mb-ci-f-0000000f.json"),
        )
        .unwrap();

        let (files, bad) = read_deadline_dir(dir.path()).unwrap();
        assert_eq!(files, vec![good_a, good_b]);
        let bad: Vec<(String, &DeadlineFileError)> = bad
            .iter()
            .map(|b| (b.path.file_name().unwrap().to_string_lossy().into_owned(), &b.error))
            .collect();
        assert_eq!(bad.len(), 3, "{bad:?}");
        assert!(matches!(bad[0], (ref n, DeadlineFileError::Malformed { .. }) if n == "mb-ci-d-0000000d.json"));
        assert!(
            matches!(bad[1], (ref n, DeadlineFileError::UnsupportedVersion { .. }) if n == "mb-ci-e-0000000e.json")
        );
        assert!(matches!(bad[2], (ref n, DeadlineFileError::WrongVm { .. }) if n == "mb-ci-f-0000000f.json"));
    }

    #[test]
    fn special_links_and_huge_files_are_refused_unread_and_do_not_hide_good_files() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let good = sample("mb-ci-a-0000000a");
        write_deadline_file(dir.path(), &good).unwrap();
        let fifo = dir.path().join("mb-ci-b-0000000b.json");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("mb-ci-c-0000000c.json")).unwrap();
        // A valid file for its name, but reached through a link to outside the folder.
        let elsewhere = write_deadline_file(outside.path(), &sample("mb-ci-d-0000000d")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.path().join("mb-ci-d-0000000d.json")).unwrap();
        File::create(dir.path().join("mb-ci-e-0000000e.json"))
            .unwrap()
            .set_len(1 << 30)
            .unwrap();

        let (files, bad) = read_deadline_dir(dir.path()).unwrap();
        assert_eq!(files, vec![good]);
        let kinds: Vec<String> = bad
            .iter()
            .map(|b| match &b.error {
                DeadlineFileError::NotRegular { what, .. } => what.to_string(),
                DeadlineFileError::TooLarge { len, .. } => format!("{len} bytes"),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(
            kinds,
            vec!["a FIFO", "a symbolic link", "a symbolic link", "1073741824 bytes"]
        );
        let text = bad[0].error.to_string();
        assert!(
            text.contains("mb-ci-b-0000000b.json") && text.contains("not a regular file"),
            "{text}"
        );
    }

    #[test]
    fn a_missing_directory_is_an_empty_scan_but_a_file_in_its_place_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (files, bad) = read_deadline_dir(&dir.path().join("absent")).unwrap();
        assert!(files.is_empty() && bad.is_empty());
        let not_a_dir = dir.path().join("plain");
        fs::write(&not_a_dir, b"").unwrap();
        let err = read_deadline_dir(&not_a_dir).unwrap_err();
        assert!(matches!(err, DeadlineFileError::ReadDir { .. }), "{err:?}");
    }
}
