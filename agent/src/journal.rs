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
//!   record in an *older* file with that number or higher is dropped as never acknowledged.
//! - **A new process never appends to an old file**; its first append starts a new file.
//! - **Torn tail.** Trailing bytes of the last file that hold no readable record (a write cut
//!   short by a crash) are cut off on open (truncate + sync), with a warning naming the file and
//!   offset.
//! - **Damage.** A file that cannot be read whole (unreadable bytes followed by readable records,
//!   records out of order, or a torn end in a file that is not the last) is copied into
//!   `journal/damaged/` as it was and replaced, atomically, by a file holding every record of it
//!   that still verifies (before *and* after the damage), with a warning. A file whose header is
//!   unreadable holds nothing readable and is moved to `damaged/` whole. A file cut short inside
//!   its header (its creation was interrupted) holds no record and is removed.
//! - **Newer layouts are refused**: a file or record of a newer version stops the open with an
//!   error rather than being guessed at.
//! - **Rotation and compaction.** Appends go to a new file once the current one reaches
//!   [`JournalOptions::max_file_bytes`]. [`Journal::compact`] writes the records the caller keeps
//!   into one new file (sequence numbers unchanged; its header marks it as superseding every
//!   older file), syncs it, renames it into place, syncs the directory and only then removes the
//!   older files. A compaction cut short by a crash is finished on the next open.

mod format;
mod tail;

pub use format::{FORMAT_VERSION, MAX_RECORD_BYTES};
pub use tail::Tail;

use crate::lock::StateLock;
use crate::record::{RECORD_VERSION, Record};
use format::{FileKind, HEADER_LEN, Header, HeaderCheck};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The journal directory inside the state directory.
pub const JOURNAL_DIR: &str = "journal";
/// Where damaged files are kept, inside the journal directory.
pub const DAMAGED_DIR: &str = "damaged";
const FILE_SUFFIX: &str = ".journal";
const TMP_SUFFIX: &str = ".journal.tmp";

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

/// The writer. One per state directory, by way of the [`StateLock`].
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    options: JournalOptions,
    /// The file appends go to; `None` after a failed write or sync, and before the first append.
    current: Option<Current>,
    next_seq: u64,
    next_file_id: u64,
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
            record.version = RECORD_VERSION;
            format::encode_frame(record, &mut frames).map_err(|what| JournalError::Encode { seq, what })?;
        }
        let label = if seqs.end - seqs.start == 1 {
            format!("record #{first}")
        } else {
            format!("records #{first}..=#{}", seqs.end - 1)
        };

        let rotate = self
            .current
            .as_ref()
            .is_none_or(|c| c.len >= self.options.max_file_bytes);
        if rotate {
            self.current = None;
            self.current = Some(self.start_file(FileKind::Appended, &frames, &label)?);
        } else {
            let current = self.current.as_mut().expect("checked above");
            if let Err(error) = write_and_sync(&mut current.file, &frames) {
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
        self.next_seq = seqs.end;
        Ok(seqs)
    }

    /// Creates a new file holding the header and `body`, syncs it and the directory.
    fn start_file(&mut self, kind: FileKind, body: &[u8], label: &str) -> Result<Current, JournalError> {
        let id = self.next_file_id;
        self.next_file_id += 1;
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
        let mut file = created.map_err(JournalError::io(
            format!("creating a journal file for {label}:"),
            &path,
            NEXT,
        ))?;
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
        let total = plan.records.len();
        let mut body = Vec::new();
        let mut kept = 0;
        for record in plan.records.iter().filter(|r| keep(r)) {
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
            if old_id < id {
                match fs::remove_file(&path) {
                    Ok(()) => removed_files += 1,
                    Err(e) => tracing::warn!(
                        "compaction: removing superseded journal file {} failed: {e}; the next open removes it",
                        path.display()
                    ),
                }
            }
        }
        if let Err(e) = sync_dir(&self.dir) {
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
}

pub(crate) fn list_files(dir: &Path) -> Result<Listing, JournalError> {
    let entries = fs::read_dir(dir).map_err(JournalError::io(
        "listing journal directory",
        dir,
        "cannot read the journal",
    ))?;
    let mut files = Vec::new();
    let mut tmps = Vec::new();
    for entry in entries {
        let entry = entry.map_err(JournalError::io(
            "listing journal directory",
            dir,
            "cannot read the journal",
        ))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.ends_with(TMP_SUFFIX) {
            tmps.push(entry.path());
        } else if let Some(id) = name.strip_suffix(FILE_SUFFIX).and_then(|s| s.parse::<u64>().ok()) {
            files.push((id, entry.path()));
        }
    }
    files.sort();
    Ok(Listing { files, tmps })
}

/// A change the writer makes on open to leave the journal readable whole.
#[derive(Debug)]
enum Action {
    /// A temporary file of a compaction or repair cut short.
    RemoveTmp { path: PathBuf },
    /// An older file a completed compaction superseded (its removal was cut short).
    RemoveSuperseded { path: PathBuf },
    /// A file whose creation was cut short inside its header: it holds no record.
    RemoveEmpty { path: PathBuf },
    /// A file whose header is unreadable: moved to damaged/ whole.
    MoveDamaged { path: PathBuf },
    /// The last file ends in a torn write: cut it off.
    Truncate { path: PathBuf, at: u64 },
    /// A file not readable whole: keep a copy in damaged/, replace it by its readable records.
    Salvage {
        path: PathBuf,
        header: Header,
        records: Vec<Record>,
    },
}

#[derive(Debug, Default)]
struct Plan {
    records: Vec<Record>,
    actions: Vec<Action>,
    warnings: Vec<String>,
    max_id: u64,
    next_seq: u64,
}

/// Reads every file and decides what replay returns and what the writer must repair. Reads only.
fn plan(dir: &Path) -> Result<Plan, JournalError> {
    let Listing { files, tmps } = list_files(dir)?;
    let mut plan = Plan {
        next_seq: 1,
        max_id: files.last().map_or(0, |(id, _)| *id),
        ..Plan::default()
    };
    for path in tmps {
        plan.warnings.push(format!(
            "removing {}: a compaction or repair was cut short before it took effect",
            path.display()
        ));
        plan.actions.push(Action::RemoveTmp { path });
    }
    const NEXT: &str = "cannot replay the journal";
    let mut contents = Vec::with_capacity(files.len());
    for (id, path) in files {
        let bytes = fs::read(&path).map_err(JournalError::io("reading journal file", &path, NEXT))?;
        let check = format::check_header(&bytes);
        if let HeaderCheck::NewerFormat(found) = check {
            return Err(JournalError::NewerFormat { path, found });
        }
        contents.push((id, path, bytes, check));
    }
    // A compacted file supersedes every older file.
    if let Some(pos) = contents
        .iter()
        .rposition(|(_, _, _, c)| matches!(c, HeaderCheck::Valid(h) if h.kind == FileKind::Compacted))
    {
        for (_, path, _, _) in contents.drain(..pos) {
            plan.warnings.push(format!(
                "removing {}: superseded by a compaction whose cleanup was cut short",
                path.display()
            ));
            plan.actions.push(Action::RemoveSuperseded { path });
        }
    }
    let last_whole = contents.iter().rposition(|(_, _, b, _)| b.len() >= HEADER_LEN);
    for (index, (_, path, bytes, check)) in contents.into_iter().enumerate() {
        let header = match check {
            HeaderCheck::Valid(header) => header,
            HeaderCheck::TooShort => {
                plan.warnings.push(format!(
                    "removing {}: its creation was cut short ({} byte(s), no record)",
                    path.display(),
                    bytes.len()
                ));
                plan.actions.push(Action::RemoveEmpty { path });
                continue;
            }
            HeaderCheck::Invalid(what) => {
                plan.warnings.push(format!(
                    "moving {} to {DAMAGED_DIR}/: unreadable header ({what}); it holds no readable record",
                    path.display()
                ));
                plan.actions.push(Action::MoveDamaged { path });
                continue;
            }
            HeaderCheck::NewerFormat(_) => unreachable!("refused above"),
        };
        // Records at or above this file's first sequence number in older files were never
        // acknowledged: their append failed and the number was given to this file.
        while plan.records.last().is_some_and(|r| r.seq >= header.first_seq) {
            let dropped = plan.records.pop().expect("checked");
            plan.warnings.push(format!(
                "ignoring record #{} written before {}: its append failed and was never acknowledged",
                dropped.seq,
                path.display()
            ));
        }
        plan.next_seq = plan.next_seq.max(header.first_seq);
        let scan = format::scan(&bytes, header, plan.records.last().map(|r| r.seq));
        if let Some((offset, found, seq)) = scan.newer {
            return Err(JournalError::NewerRecord {
                path,
                offset,
                found,
                seq,
            });
        }
        if let Some(last) = scan.records.last() {
            plan.next_seq = plan.next_seq.max(last.seq + 1);
        }
        let is_last = Some(index) == last_whole;
        match (scan.damage.is_empty(), scan.torn_at) {
            (true, None) => {}
            (true, Some(at)) if is_last => {
                plan.warnings.push(format!(
                    "cutting off a torn record at the end of {} at offset {at} ({} byte(s)): its write was cut short and never acknowledged",
                    path.display(),
                    bytes.len() as u64 - at
                ));
                plan.actions.push(Action::Truncate { path: path.clone(), at });
            }
            _ => {
                let mut what: Vec<String> = scan
                    .damage
                    .iter()
                    .map(|d| format!("offset {}: {}", d.offset, d.what))
                    .collect();
                if let Some(at) = scan.torn_at {
                    what.push(format!("offset {at}: unreadable to the end"));
                }
                plan.warnings.push(format!(
                    "{} cannot be read whole ({}); keeping its {} readable record(s) and moving the original to {DAMAGED_DIR}/",
                    path.display(),
                    what.join("; "),
                    scan.records.len()
                ));
                plan.actions.push(Action::Salvage {
                    path: path.clone(),
                    header,
                    records: scan.records.clone(),
                });
            }
        }
        plan.records.extend(scan.records);
    }
    Ok(plan)
}

/// Carries out one repair durably.
fn repair(dir: &Path, action: &Action) -> Result<(), JournalError> {
    const NEXT: &str = "refusing to start with a journal that could not be repaired";
    match action {
        Action::RemoveTmp { path } | Action::RemoveSuperseded { path } | Action::RemoveEmpty { path } => {
            fs::remove_file(path).map_err(JournalError::io("removing", path, NEXT))?;
            sync_dir(dir).map_err(JournalError::io("syncing journal directory", dir, NEXT))?;
        }
        Action::MoveDamaged { path } => {
            let damaged = damaged_dir(dir)?;
            let target = unique_in(&damaged, path);
            fs::rename(path, &target).map_err(JournalError::io("moving to damaged/", path, NEXT))?;
            sync_dir(&damaged).map_err(JournalError::io("syncing directory", &damaged, NEXT))?;
            sync_dir(dir).map_err(JournalError::io("syncing journal directory", dir, NEXT))?;
        }
        Action::Truncate { path, at } => {
            let file = OpenOptions::new().write(true).open(path).map_err(JournalError::io(
                "opening for truncation",
                path,
                NEXT,
            ))?;
            file.set_len(*at)
                .map_err(JournalError::io(format!("truncating at offset {at}"), path, NEXT))?;
            file.sync_all()
                .map_err(JournalError::io("syncing after truncation", path, NEXT))?;
        }
        Action::Salvage { path, header, records } => {
            copy_to_damaged(dir, path)?;
            let mut buf = header.encode().to_vec();
            for record in records {
                format::encode_frame(record, &mut buf).map_err(|what| JournalError::Corrupt {
                    path: path.clone(),
                    offset: 0,
                    what: format!("record #{} read back cannot be encoded again: {what}", record.seq),
                    next: NEXT,
                })?;
            }
            let tmp = path.with_extension("journal.tmp");
            let mut file = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)
                .map_err(JournalError::io("creating", &tmp, NEXT))?;
            write_and_sync(&mut file, &buf).map_err(JournalError::io("writing", &tmp, NEXT))?;
            fs::rename(&tmp, path).map_err(JournalError::io("renaming repaired file over", path, NEXT))?;
            sync_dir(dir).map_err(JournalError::io("syncing journal directory", dir, NEXT))?;
        }
    }
    Ok(())
}

fn damaged_dir(dir: &Path) -> Result<PathBuf, JournalError> {
    let damaged = dir.join(DAMAGED_DIR);
    if !damaged.is_dir() {
        const NEXT: &str = "the damaged file is left in place";
        fs::create_dir_all(&damaged).map_err(JournalError::io("creating", &damaged, NEXT))?;
        sync_dir(dir).map_err(JournalError::io("syncing journal directory", dir, NEXT))?;
    }
    Ok(damaged)
}

/// `damaged/<name>`, or `damaged/<name>.N` if that exists already.
fn unique_in(damaged: &Path, path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut target = damaged.join(&name);
    let mut n = 1;
    while target.exists() {
        target = damaged.join(format!("{name}.{n}"));
        n += 1;
    }
    target
}

/// Copies a file into damaged/ durably, leaving the original in place.
fn copy_to_damaged(dir: &Path, path: &Path) -> Result<(), JournalError> {
    const NEXT: &str = "the damaged file is left in place and the journal unchanged";
    let damaged = damaged_dir(dir)?;
    let target = unique_in(&damaged, path);
    fs::copy(path, &target).map_err(JournalError::io(
        format!("copying to {}:", target.display()),
        path,
        NEXT,
    ))?;
    File::open(&target)
        .and_then(|f| f.sync_all())
        .map_err(JournalError::io("syncing", &target, NEXT))?;
    sync_dir(&damaged).map_err(JournalError::io("syncing directory", &damaged, NEXT))?;
    Ok(())
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
