//! The host journal: append-only, synced records of every attempt transition.
//!
//! Files live in `<state>/journal/` and are named by a growing id (`00000000000000000007.journal`);
//! replay reads them in id order. Each starts with a magic-and-version header and holds frames of
//! length + crc32 + JSON [`Record`] (layout in [`format`]). Only the process holding the
//! [`StateLock`] writes; [`read_records`] and [`Tail`] read without the lock and change nothing.
//!
//! Rules, in the order they matter:
//!
//! - **Written means synced.** [`Journal::append`] returns the record's sequence number only after
//!   `write` and `sync_all` (F_FULLFSYNC on Apple) returned, and for a new file after its
//!   directory was synced too.
//! - **Fail closed.** If a write or sync fails, `append` returns the error (the caller must not act
//!   on that transition) and the file is never written again; the next append starts a new file,
//!   and fails again until a write and sync work. The failed record's sequence number is reused:
//!   a file's header carries the first sequence number it was created for, and on replay any
//!   record in an *older* file with that number or higher is dropped as never acknowledged. A
//!   compaction rewrites only acknowledged records (numbered below the next sequence number), so
//!   the bytes of a failed append (a sync that failed after its write) never become durable.
//! - **A new process never appends to an old file**; its first append starts a new file.
//! - **Torn tail.** Trailing bytes of the last file that hold no readable record (a write cut
//!   short by a crash) are cut off on open (truncate + sync), with a warning naming the file and
//!   offset.
//! - **Damage.** A file that cannot be read whole (unreadable bytes followed by readable records,
//!   records out of order, or a torn end in a file that is not the last) is copied into
//!   `journal/damaged/` as it was and replaced, atomically, by a file holding every record of it
//!   that still verifies (before *and* after the damage), with a warning. When the next file
//!   proves the damage swallowed acknowledged records, the warning names them and the replacement
//!   is a compaction of every record so far, so the known loss is not taken for a missing file
//!   later. A file whose header is unreadable holds nothing readable and is moved to `damaged/`
//!   whole. A file cut short inside its header (its creation was interrupted) holds no record and
//!   is removed — only if its bytes are the start of a header: the journal deletes only what it
//!   wrote; anything else named like its files goes to `damaged/`, and what is not a regular file
//!   (a directory, FIFO or link) is left alone with a warning and never read.
//! - **Complete or refused.** Each file starts where the journal was when it created it, so a
//!   file starting past the records before it means records are missing (a file was removed), and
//!   a file starting before the one it follows means files were reordered; the same records twice
//!   mean a copy. Any of these stops the open with [`JournalError::Inconsistent`], naming the
//!   records and files and how to proceed; nothing is repaired.
//! - **Newer layouts are refused**: a file or record of a newer version stops the open with an
//!   error rather than being guessed at.
//! - **Rotation and compaction.** Appends go to a new file once the current one reaches
//!   [`JournalOptions::max_file_bytes`]. [`Journal::compact`] writes the records the caller keeps
//!   into one new file (sequence numbers unchanged; its header marks it as superseding every
//!   older file), syncs it, renames it into place, syncs the directory and only then removes the
//!   older files it read. A compaction cut short by a crash is finished on the next open, which
//!   moves superseded files to `damaged/` (it cannot tell its own leftovers from a restored file).
//! - **Failing.** While appends fail, [`Journal::health`] says so (for `/healthz`) and
//!   [`Journal::writable`] tells callers not to start new work, retrying the disk with capped
//!   exponential backoff; a failed try uses up no file id unless it created a file.

mod format;
mod replay;
mod tail;

pub use format::{FORMAT_VERSION, MAX_RECORD_BYTES};
pub use tail::Tail;

#[cfg(test)]
use replay::starts_like_a_journal_file;
use replay::{Action, copy_to_damaged, plan, repair};

use crate::lock::StateLock;
use crate::record::{RECORD_VERSION, Record};
use format::{FileKind, HEADER_LEN, Header};
use k8s_openapi::jiff::Timestamp;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The journal directory inside the state directory.
pub const JOURNAL_DIR: &str = "journal";
/// Where damaged files are kept, inside the journal directory.
pub const DAMAGED_DIR: &str = "damaged";
const FILE_SUFFIX: &str = ".journal";
const TMP_SUFFIX: &str = ".journal.tmp";
/// The largest journal file read. Files rotate at a few MiB and a compaction holds only the
/// records of unfinished builds; anything this large was not written by the journal.
pub const MAX_FILE_BYTES: u64 = 256 << 20;
/// While appends fail, [`Journal::writable`] tries the disk again after this, doubling per
/// failure up to [`PROBE_CAP`].
const PROBE_BASE: Duration = Duration::from_secs(1);
const PROBE_CAP: Duration = Duration::from_secs(60);
/// What an operator can do about a journal that is missing records or out of order.
const INCOMPLETE_HOW: &str = "the agent does not act on a journal it knows is incomplete or out of order. To proceed: \
put the missing or misnamed file(s) back under their original names; or stop the agent, move the journal directory \
aside and start with an empty one, knowing that every build recorded in the old journal must then be checked by hand \
(its VM in `tart list`, its MacBuild status)";

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The operating system refused a read, write, sync, rename or removal.
    #[error("{action} {}: {error}; {next}", path.display())]
    Io {
        action: String,
        path: PathBuf,
        error: io::Error,
        next: &'static str,
    },
    /// Bytes on disk that do not hold what the journal wrote.
    #[error("journal file {} is corrupt at offset {offset}: {what}; {next}", path.display())]
    Corrupt {
        path: PathBuf,
        offset: u64,
        what: String,
        next: &'static str,
    },
    #[error(
        "journal file {} has format version {found}, newer than version {FORMAT_VERSION} that this tartan-agent reads; refusing to start rather than guess (run a newer tartan-agent)",
        path.display()
    )]
    NewerFormat { path: PathBuf, found: u32 },
    #[error(
        "journal file {} holds record {} of layout version {found} at offset {offset}, newer than version {RECORD_VERSION} that this tartan-agent reads; refusing to start rather than guess (run a newer tartan-agent)",
        path.display(),
        seq.map_or_else(|| "#?".to_string(), |s| format!("#{s}"))
    )]
    NewerRecord {
        path: PathBuf,
        offset: u64,
        found: u32,
        seq: Option<u64>,
    },
    #[error("journal record #{seq} cannot be encoded: {what}; nothing was written, do not act on this transition")]
    Encode { seq: u64, what: String },
    /// Files missing, reordered or duplicated: records the journal acknowledged are not where
    /// they must be. Never repaired automatically.
    #[error("journal in {} is inconsistent: {what}; {INCOMPLETE_HOW}", dir.display())]
    Inconsistent { dir: PathBuf, what: String },
}

impl JournalError {
    fn io(action: impl Into<String>, path: &Path, next: &'static str) -> impl FnOnce(io::Error) -> JournalError {
        let (action, path) = (action.into(), path.to_path_buf());
        move |error| JournalError::Io {
            action,
            path,
            error,
            next,
        }
    }
}

#[derive(Clone, Debug)]
pub struct JournalOptions {
    /// Appends go to a new file once the current one has reached this size.
    pub max_file_bytes: u64,
}

impl Default for JournalOptions {
    fn default() -> Self {
        JournalOptions {
            max_file_bytes: 4 << 20,
        }
    }
}

/// What replay found: every record in sequence order, and what was repaired or skipped on the way
/// (each warning was also logged).
#[derive(Clone, Debug, Default)]
pub struct Replay {
    pub records: Vec<Record>,
    pub warnings: Vec<String>,
}

/// What [`Journal::compact`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compaction {
    pub kept: usize,
    pub dropped: usize,
    pub removed_files: usize,
    pub file: PathBuf,
}

/// Since when and why appends fail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failing {
    pub since: Timestamp,
    /// The last failure's message.
    pub error: String,
    /// Failed appends and probes since the last success.
    pub failures: u32,
}

/// A cheap, shareable view of whether the journal can be written, readable without the lock that
/// guards the [`Journal`] (so `/healthz` answers even while a write hangs).
#[derive(Clone, Debug, Default)]
pub struct JournalHealth(Arc<Mutex<Option<Failing>>>);

impl JournalHealth {
    /// `Some` from a failed append until an append or probe succeeds.
    pub fn failing(&self) -> Option<Failing> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, value: Option<Failing>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = value;
    }
}

/// How long [`Journal::writable`] waits before trying the disk again after `failures` failures:
/// [`PROBE_BASE`] doubled per failure, at most [`PROBE_CAP`].
fn probe_backoff(failures: u32) -> Duration {
    PROBE_BASE
        .saturating_mul(1u32.checked_shl(failures.saturating_sub(1)).unwrap_or(u32::MAX))
        .min(PROBE_CAP)
}

/// The writer. One per state directory, by way of the [`StateLock`].
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    options: JournalOptions,
    /// The file appends go to; `None` after a failed write or sync, and before the first append.
    current: Option<Current>,
    next_seq: u64,
    /// The id of the next new file; used up only once a file of that name was created.
    next_file_id: u64,
    health: JournalHealth,
    /// While failing: when [`Journal::writable`] may try the disk again.
    probe_at: Option<Instant>,
}

#[derive(Debug)]
struct Current {
    file: File,
    path: PathBuf,
    len: u64,
}

impl Journal {
    /// Replays `<state>/journal/` (repairing it as the module documentation says) and returns the
    /// writer and the records. The lock proves no other agent writes here.
    pub fn open(lock: &StateLock, options: JournalOptions) -> Result<(Journal, Replay), JournalError> {
        let dir = lock.state_dir().join(JOURNAL_DIR);
        const NEXT: &str = "the agent cannot start without its journal";
        if !dir.is_dir() {
            fs::create_dir_all(&dir).map_err(JournalError::io("creating journal directory", &dir, NEXT))?;
            sync_dir(lock.state_dir()).map_err(JournalError::io("syncing directory", lock.state_dir(), NEXT))?;
        }
        let plan = plan(&dir)?;
        for warning in &plan.warnings {
            tracing::warn!("{warning}");
        }
        for action in &plan.actions {
            repair(&dir, action)?;
        }
        let journal = Journal {
            dir,
            options,
            current: None,
            next_seq: plan.next_seq,
            next_file_id: plan.max_id + 1,
            health: JournalHealth::default(),
            probe_at: None,
        };
        Ok((
            journal,
            Replay {
                records: plan.records,
                warnings: plan.warnings,
            },
        ))
    }

    /// The sequence number the next successful append will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The journal directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A handle telling whether appends currently fail (shared, cheap to read).
    pub fn health(&self) -> JournalHealth {
        self.health.clone()
    }

    /// Whether new work may start: `true` unless appends are failing. While they fail, this tries
    /// the disk again at most once per back-off period (1 s, doubling to 60 s) by starting a new,
    /// empty file, which the next append then uses; success ends the failure. Callers that would
    /// begin something with a journal write (a claim) ask this first, so a journal that cannot be
    /// written is not hammered in a loop.
    pub fn writable(&mut self) -> bool {
        let Some(failing) = self.health.failing() else {
            return true;
        };
        if self.probe_at.is_some_and(|at| Instant::now() < at) {
            return false;
        }
        self.current = None;
        match self.start_file(FileKind::Appended, &[], "a probe (no record)") {
            Ok(current) => {
                self.current = Some(current);
                self.succeeded();
                true
            }
            Err(error) => {
                self.failed(&error);
                tracing::warn!(
                    failures = failing.failures + 1,
                    retry_in = ?probe_backoff(failing.failures + 1),
                    "journal still cannot be written: {error}"
                );
                false
            }
        }
    }

    fn failed(&mut self, error: &JournalError) {
        let previous = self.health.failing();
        let failures = previous.as_ref().map_or(0, |f| f.failures).saturating_add(1);
        if previous.is_none() {
            tracing::error!(
                "the journal cannot be written: {error}; no new build is claimed until a write works again (tried again after {:?}, backing off to {:?})",
                probe_backoff(1),
                PROBE_CAP
            );
        }
        self.health.set(Some(Failing {
            since: previous.map_or_else(Timestamp::now, |f| f.since),
            error: error.to_string(),
            failures,
        }));
        self.probe_at = Some(Instant::now() + probe_backoff(failures));
    }

    fn succeeded(&mut self) {
        if let Some(failing) = self.health.failing() {
            tracing::info!(
                failures = failing.failures,
                since = %failing.since,
                "the journal can be written again"
            );
            self.health.set(None);
        }
        self.probe_at = None;
    }

    /// Stamps `record` with the next sequence number and the current layout version, writes and
    /// syncs it, and returns the sequence number. `Ok` means the record is durable; on `Err` the
    /// transition is not recorded and the caller must not act on it. The journal never writes to a
    /// file again after a failed write or sync: the next append starts a new file.
    pub fn append(&mut self, record: &mut Record) -> Result<u64, JournalError> {
        self.append_batch(std::slice::from_mut(record)).map(|seqs| seqs.start)
    }

    /// Like [`Journal::append`] for several records at once, with one write and one sync: on `Ok`
    /// all of them are durable (numbered in order, the returned range); on `Err` none counts as
    /// recorded. An empty batch writes nothing.
    pub fn append_batch(&mut self, records: &mut [Record]) -> Result<Range<u64>, JournalError> {
        let first = self.next_seq;
        let seqs = first..first + records.len() as u64;
        if records.is_empty() {
            return Ok(seqs);
        }
        let mut frames = Vec::with_capacity(512 * records.len());
        for (record, seq) in records.iter_mut().zip(seqs.clone()) {
            record.seq = seq;
            record.version = record.layout_version();
            format::encode_frame(record, &mut frames).map_err(|what| JournalError::Encode { seq, what })?;
        }
        let label = if seqs.end - seqs.start == 1 {
            format!("record #{first}")
        } else {
            format!("records #{first}..=#{}", seqs.end - 1)
        };

        crate::crash_point!("journal.append.before");
        let written = self.write_frames(&frames, &label);
        if written.is_ok() {
            crate::crash_point!("journal.append.after");
        }
        match &written {
            Ok(()) => self.succeeded(),
            Err(error) => self.failed(error),
        }
        written?;
        self.next_seq = seqs.end;
        Ok(seqs)
    }

    /// Writes and syncs encoded frames into the current file, or a new one when rotating.
    fn write_frames(&mut self, frames: &[u8], label: &str) -> Result<(), JournalError> {
        let rotate = self
            .current
            .as_ref()
            .is_none_or(|c| c.len >= self.options.max_file_bytes);
        if rotate {
            self.current = None;
            crate::crash_point!("journal.rotate.before");
            self.current = Some(self.start_file(FileKind::Appended, frames, label)?);
            crate::crash_point!("journal.rotate.after");
        } else {
            let current = self.current.as_mut().expect("checked above");
            if let Err(error) = write_and_sync(&mut current.file, frames) {
                let path = current.path.clone();
                // Poisoned: the handle is dropped and the file never written again.
                self.current = None;
                return Err(JournalError::Io {
                    action: format!("appending journal {label} to"),
                    path,
                    error,
                    next: "the transition is NOT recorded and must not be acted on; the next append starts a new file",
                });
            }
            current.len += frames.len() as u64;
        }
        Ok(())
    }

    /// Creates a new file holding the header and `body`, syncs it and the directory.
    /// The id is used up only once a file of that name exists: a journal directory that refuses
    /// new files (read-only, full) does not make every try burn a new id. Once a file was created
    /// its id is never given out again, even if the file is removed, so a reader following the
    /// journal never sees two different files under one name.
    fn start_file(&mut self, kind: FileKind, body: &[u8], label: &str) -> Result<Current, JournalError> {
        let id = self.next_file_id;
        let path = self.dir.join(file_name(id));
        let header = Header {
            kind,
            first_seq: self.next_seq,
        };
        let mut buf = Vec::with_capacity(HEADER_LEN + body.len());
        buf.extend_from_slice(&header.encode());
        buf.extend_from_slice(body);
        const NEXT: &str =
            "the transition is NOT recorded and must not be acted on; the next append tries another new file";
        let created = OpenOptions::new().read(true).write(true).create_new(true).open(&path);
        if created
            .as_ref()
            .is_err_and(|e| e.kind() == io::ErrorKind::AlreadyExists)
        {
            // Something else took the name (not the journal: it never reuses a created id).
            self.next_file_id += 1;
        }
        let mut file = created.map_err(JournalError::io(
            format!("creating a journal file for {label}:"),
            &path,
            NEXT,
        ))?;
        self.next_file_id += 1;
        let synced = write_and_sync(&mut file, &buf).and_then(|()| sync_dir(&self.dir));
        if let Err(error) = synced {
            drop(file);
            // The new file holds no acknowledged record; remove it if we can (replay copes if not).
            if fs::remove_file(&path).is_ok() {
                let _ = sync_dir(&self.dir);
            }
            return Err(JournalError::Io {
                action: format!("writing and syncing journal {label} (and its directory) into new file"),
                path,
                error,
                next: NEXT,
            });
        }
        Ok(Current {
            file,
            path,
            len: buf.len() as u64,
        })
    }

    /// Rewrites the journal into one file holding only the records for which `keep` returns true
    /// (sequence numbers unchanged), then removes the older files. Pass a predicate that keeps
    /// every record of an attempt that is not both retired and delivered. On error nothing was
    /// removed and the journal is as before.
    pub fn compact(&mut self, mut keep: impl FnMut(&Record) -> bool) -> Result<Compaction, JournalError> {
        const NEXT: &str = "compaction abandoned, the journal is unchanged";
        let plan = plan(&self.dir)?;
        // Evidence first: a file replay could not read whole goes to damaged/ before it is removed.
        for action in &plan.actions {
            match action {
                Action::Salvage { path, .. } | Action::MoveDamaged { path, .. } | Action::Truncate { path, .. } => {
                    tracing::warn!("compaction: keeping a copy of {} in damaged/", path.display());
                    copy_to_damaged(&self.dir, path)?;
                }
                _ => {}
            }
        }
        // Only acknowledged records are rewritten: one at or past `next_seq` is the bytes of an
        // append whose write or sync failed (still in its poisoned file, which no later file has
        // superseded yet). Copied into a synced file it would become durable though it was never
        // acknowledged, and the next append would reuse its number.
        let (acknowledged, unacknowledged): (Vec<&Record>, Vec<&Record>) =
            plan.records.iter().partition(|r| r.seq < self.next_seq);
        for record in &unacknowledged {
            tracing::warn!(
                "compaction: dropping record #{} ({record}): its append failed, it was never acknowledged",
                record.seq
            );
        }
        let total = plan.records.len();
        let mut body = Vec::new();
        let mut kept = 0;
        for record in acknowledged.into_iter().filter(|r| keep(r)) {
            format::encode_frame(record, &mut body).map_err(|what| JournalError::Encode { seq: record.seq, what })?;
            kept += 1;
        }
        let id = self.next_file_id;
        self.next_file_id += 1;
        let final_path = self.dir.join(file_name(id));
        let tmp_path = self.dir.join(format!("{id:020}{TMP_SUFFIX}"));
        let header = Header {
            kind: FileKind::Compacted,
            first_seq: self.next_seq,
        };
        crate::crash_point!("journal.compact.before");
        let written = (|| {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&tmp_path)
                .map_err(JournalError::io("creating compaction file", &tmp_path, NEXT))?;
            let mut buf = Vec::with_capacity(HEADER_LEN + body.len());
            buf.extend_from_slice(&header.encode());
            buf.extend_from_slice(&body);
            write_and_sync(&mut file, &buf).map_err(JournalError::io("writing compaction file", &tmp_path, NEXT))?;
            fs::rename(&tmp_path, &final_path).map_err(JournalError::io(
                "renaming compaction file",
                &tmp_path,
                NEXT,
            ))?;
            Ok::<_, JournalError>((file, buf.len() as u64))
        })();
        let (file, len) = match written {
            Ok(done) => done,
            Err(err) => {
                let _ = fs::remove_file(&tmp_path);
                return Err(err);
            }
        };
        // Once the rename is durable the compaction has happened: the new file supersedes the rest.
        sync_dir(&self.dir).map_err(JournalError::io(
            "syncing journal directory after compaction into",
            &final_path,
            "the compaction may not have happened; the older files are left in place",
        ))?;
        crate::crash_point!("journal.compact.after");
        self.current = Some(Current {
            file,
            path: final_path.clone(),
            len,
        });
        let mut removed_files = 0;
        let old_files = match list_files(&self.dir) {
            Ok(listing) => listing.files,
            Err(e) => {
                tracing::warn!("compaction: {e}; the superseded files are removed at the next open");
                Vec::new()
            }
        };
        for (old_id, path) in old_files {
            // Only files this compaction read are removed; anything that appeared since is left
            // for the next open, which keeps it in damaged/.
            if old_id < id && !plan.seen.contains(&path) {
                tracing::warn!(
                    "compaction: {} appeared after the compaction read the journal; left in place, the next open keeps it in {DAMAGED_DIR}/",
                    path.display()
                );
            } else if old_id < id {
                match fs::remove_file(&path) {
                    Ok(()) => removed_files += 1,
                    Err(e) => tracing::warn!(
                        "compaction: removing superseded journal file {} failed: {e}; the next open removes it",
                        path.display()
                    ),
                }
            }
        }
        let removed = sync_dir(&self.dir);
        crate::crash_point!("journal.compact_remove.after");
        if let Err(e) = removed {
            tracing::warn!(
                "compaction: syncing {} after removing old files failed: {e}; the next open removes any that reappear",
                self.dir.display()
            );
        }
        Ok(Compaction {
            kept,
            dropped: total - kept,
            removed_files,
            file: final_path,
        })
    }
}

fn write_and_sync(file: &mut File, buf: &[u8]) -> io::Result<()> {
    file.write_all(buf)?;
    #[cfg(test)]
    if tests::injected_sync_failure() {
        return Err(io::Error::other("injected fsync failure (test)"));
    }
    // std's sync_all is fcntl(F_FULLFSYNC) on Apple, fsync elsewhere.
    file.sync_all()
}

/// Syncs a directory so that entries created, renamed or removed in it are durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    let handle = File::open(dir)?;
    match handle.sync_all() {
        Ok(()) => Ok(()),
        // F_FULLFSYNC is not available on every file system for directories; fall back to fsync.
        #[cfg(target_vendor = "apple")]
        Err(_) => nix::unistd::fsync(&handle).map_err(io::Error::from),
        #[cfg(not(target_vendor = "apple"))]
        Err(e) => Err(e),
    }
}

fn file_name(id: u64) -> String {
    format!("{id:020}{FILE_SUFFIX}")
}

/// The journal directory's contents.
pub(crate) struct Listing {
    /// Journal files, by id.
    pub files: Vec<(u64, PathBuf)>,
    /// Leftover temporary files of a compaction or repair.
    pub tmps: Vec<PathBuf>,
    /// Named like journal files but not as the journal names them (not 20 digits, or an id it
    /// could never reach): never read, never touched.
    pub foreign: Vec<PathBuf>,
}

/// The id in a name the journal gives its files: exactly 20 digits (`{id:020}`), and an id far
/// below `u64::MAX` (ids count up by one per file, so a larger one was never the journal's and
/// would leave no id after it).
fn parse_id(digits: &str) -> Option<u64> {
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok().filter(|id| *id < u64::MAX / 2)
}

pub(crate) fn list_files(dir: &Path) -> Result<Listing, JournalError> {
    let entries = fs::read_dir(dir).map_err(JournalError::io(
        "listing journal directory",
        dir,
        "cannot read the journal",
    ))?;
    let mut files = Vec::new();
    let mut tmps = Vec::new();
    let mut foreign = Vec::new();
    for entry in entries {
        let entry = entry.map_err(JournalError::io(
            "listing journal directory",
            dir,
            "cannot read the journal",
        ))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(digits) = name.strip_suffix(TMP_SUFFIX) {
            match parse_id(digits) {
                Some(_) => tmps.push(entry.path()),
                None => foreign.push(entry.path()),
            }
        } else if let Some(digits) = name.strip_suffix(FILE_SUFFIX) {
            match parse_id(digits) {
                Some(id) => files.push((id, entry.path())),
                None => foreign.push(entry.path()),
            }
        }
    }
    files.sort();
    foreign.sort();
    Ok(Listing { files, tmps, foreign })
}

/// Reads the journal of `state_dir` without taking the lock and without changing anything:
/// what [`Journal::open`] would replay, with warnings for what it would repair. A torn record at
/// the end may simply be an append in progress.
pub fn read_records(state_dir: &Path) -> Result<Replay, JournalError> {
    let plan = plan(&state_dir.join(JOURNAL_DIR))?;
    Ok(Replay {
        records: plan.records,
        warnings: plan.warnings,
    })
}

#[cfg(test)]
mod tests;
