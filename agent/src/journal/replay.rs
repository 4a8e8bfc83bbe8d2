//! Replay planning: what the journal's files hold and what the writer must repair before it
//! appends. [`plan`] reads every file (never writes) and returns the records to replay, the
//! warnings to log and the [`Action`]s that leave the journal readable whole; [`repair`] carries
//! out one action durably, keeping a copy of anything it replaces in `damaged/`.

use super::format::{self, FileKind, HEADER_LEN, Header, HeaderCheck};
use super::{DAMAGED_DIR, JournalError, Listing, MAX_FILE_BYTES, list_files, sync_dir, write_and_sync};
use crate::record::Record;
use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use tartan_api::files::{ReadFileError, read_regular_file};

/// A change the writer makes on open to leave the journal readable whole.
#[derive(Debug)]
pub(super) enum Action {
    /// A temporary file of a compaction or repair cut short (it starts as a journal file does).
    RemoveTmp { path: PathBuf },
    /// A file whose creation was cut short inside its header: it holds no record.
    RemoveEmpty { path: PathBuf },
    /// Moved to damaged/ whole: a file whose header is unreadable, an older file a compaction
    /// superseded (its removal was cut short, or someone put it there), or anything named like a
    /// journal file that the journal did not write. The journal deletes only what it wrote.
    MoveDamaged { path: PathBuf },
    /// The last file ends in a torn write: cut it off.
    Truncate { path: PathBuf, at: u64 },
    /// A file not readable whole: keep a copy in damaged/, replace it by its readable records.
    /// When its damage swallowed records the next file proves were acknowledged, the replacement
    /// is a compaction of every record so far (its header records where the sequence continues,
    /// so the loss is not taken for a missing file at the next open) and `supersedes` lists the
    /// older files it replaces, removed after it is in place.
    Salvage {
        path: PathBuf,
        header: Header,
        records: Vec<Record>,
        supersedes: Vec<PathBuf>,
    },
}

#[derive(Debug, Default)]
pub(super) struct Plan {
    pub(super) records: Vec<Record>,
    pub(super) actions: Vec<Action>,
    pub(super) warnings: Vec<String>,
    pub(super) max_id: u64,
    pub(super) next_seq: u64,
    /// The regular files named like journal files that were read.
    pub(super) seen: BTreeSet<PathBuf>,
}

/// Whether `bytes` could be the start of a file the journal writes: empty, a prefix of a header
/// of this layout, or a whole valid header. Only such files are removed when cut short.
pub(super) fn starts_like_a_journal_file(bytes: &[u8]) -> bool {
    if bytes.len() >= HEADER_LEN {
        return matches!(format::check_header(bytes), HeaderCheck::Valid(_));
    }
    // Magic, version and kind are known in advance; first_seq and the checksum are not.
    let n = bytes.len().min(16);
    [FileKind::Appended, FileKind::Compacted].into_iter().any(|kind| {
        let expected = Header { kind, first_seq: 0 }.encode();
        bytes[..n] == expected[..n]
    })
}

/// Reads a file named like a journal file: `None` (with a warning) if it is not a regular file,
/// which the journal never creates, so nothing it wrote is there; it is left alone.
fn read_journal_file(plan: &mut Plan, path: &Path) -> Result<Option<Vec<u8>>, JournalError> {
    const NEXT: &str = "cannot replay the journal";
    match read_regular_file(path, MAX_FILE_BYTES) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(ReadFileError::NotRegular(what)) => {
            plan.warnings.push(format!(
                "ignoring {}: it is {what}, not a file the journal wrote; left in place (move it out of the journal directory)",
                path.display()
            ));
            Ok(None)
        }
        Err(ReadFileError::TooLarge { len, max }) => Err(JournalError::Corrupt {
            path: path.to_path_buf(),
            offset: 0,
            what: format!("it is {len} bytes, more than the {max} bytes of any journal file"),
            next: "refusing to start; if the file is not the agent's, move it out of the journal directory",
        }),
        Err(ReadFileError::Io(error)) => Err(JournalError::io("reading journal file", path, NEXT)(error)),
    }
}

fn seq_range(first: u64, last: u64) -> String {
    if first == last {
        format!("#{first}")
    } else {
        format!("#{first}..=#{last}")
    }
}

/// Reads every file and decides what replay returns and what the writer must repair. Reads only.
/// Refuses ([`JournalError::Inconsistent`]) a journal whose files do not follow one another: a
/// file missing between two others, files out of order, or the same records twice.
pub(super) fn plan(dir: &Path) -> Result<Plan, JournalError> {
    let Listing { files, tmps, foreign } = list_files(dir)?;
    let mut plan = Plan {
        next_seq: 1,
        max_id: files.last().map_or(0, |(id, _)| *id),
        ..Plan::default()
    };
    for path in foreign {
        plan.warnings.push(format!(
            "ignoring {}: named like a journal file, but not as the journal names its files; left in place (move it out of the journal directory)",
            path.display()
        ));
    }
    plan_tmps(&mut plan, tmps)?;
    let mut contents = read_contents(&mut plan, files)?;
    set_aside_superseded(&mut plan, dir, &mut contents)?;
    check_file_order(dir, &contents)?;
    read_records_in_order(&mut plan, dir, contents)?;
    Ok(plan)
}

/// A journal file as read: its id, path, bytes and what its header says.
type Content = (u64, PathBuf, Vec<u8>, HeaderCheck);

/// Temporary files: one cut short by the journal is removed, anything else moved to damaged/.
fn plan_tmps(plan: &mut Plan, tmps: Vec<PathBuf>) -> Result<(), JournalError> {
    for path in tmps {
        let Some(bytes) = read_journal_file(plan, &path)? else {
            continue;
        };
        if starts_like_a_journal_file(&bytes) {
            plan.warnings.push(format!(
                "removing {}: a compaction or repair was cut short before it took effect",
                path.display()
            ));
            plan.actions.push(Action::RemoveTmp { path });
        } else {
            plan.warnings.push(format!(
                "moving {} to {DAMAGED_DIR}/: named like a journal temporary file, but the journal did not write it",
                path.display()
            ));
            plan.actions.push(Action::MoveDamaged { path });
        }
    }
    Ok(())
}

/// Reads every journal file; refuses one of a newer format.
fn read_contents(plan: &mut Plan, files: Vec<(u64, PathBuf)>) -> Result<Vec<Content>, JournalError> {
    let mut contents = Vec::with_capacity(files.len());
    for (id, path) in files {
        let Some(bytes) = read_journal_file(plan, &path)? else {
            continue;
        };
        let check = format::check_header(&bytes);
        if let HeaderCheck::NewerFormat(found) = check {
            return Err(JournalError::NewerFormat { path, found });
        }
        plan.seen.insert(path.clone());
        contents.push((id, path, bytes, check));
    }
    Ok(contents)
}

/// A compacted file supersedes every older file. The journal removes those after the
/// compaction is durable; any still here (cleanup cut short, or put here by someone) are kept
/// in damaged/, never deleted. One created after the compaction cannot be superseded by it.
fn set_aside_superseded(plan: &mut Plan, dir: &Path, contents: &mut Vec<Content>) -> Result<(), JournalError> {
    let inconsistent = |what: String| JournalError::Inconsistent {
        dir: dir.to_path_buf(),
        what,
    };
    if let Some(pos) = contents
        .iter()
        .rposition(|(_, _, _, c)| matches!(c, HeaderCheck::Valid(h) if h.kind == FileKind::Compacted))
    {
        let (compacted, compacted_header) = match &contents[pos] {
            (_, path, _, HeaderCheck::Valid(h)) => (path.clone(), *h),
            _ => unreachable!("found above"),
        };
        for (_, path, _, check) in &contents[..pos] {
            if let HeaderCheck::Valid(h) = check
                && h.first_seq > compacted_header.first_seq
            {
                return Err(inconsistent(format!(
                    "{} starts at #{}, after #{} where the compaction {} starts, yet sorts before it: the compaction cannot have superseded it (files renamed, copied or restored)",
                    path.display(),
                    h.first_seq,
                    compacted_header.first_seq,
                    compacted.display()
                )));
            }
        }
        for (_, path, _, _) in contents.drain(..pos) {
            plan.warnings.push(format!(
                "moving {} to {DAMAGED_DIR}/: superseded by the compaction {} (its cleanup was cut short, or the file was put here); the journal no longer reads it",
                path.display(),
                compacted.display()
            ));
            plan.actions.push(Action::MoveDamaged { path });
        }
    }
    Ok(())
}

/// Files start where the journal was when it created them, so their first sequence numbers
/// never go down in id order.
fn check_file_order(dir: &Path, contents: &[Content]) -> Result<(), JournalError> {
    let inconsistent = |what: String| JournalError::Inconsistent {
        dir: dir.to_path_buf(),
        what,
    };
    let mut previous: Option<(&Path, u64)> = None;
    for (_, path, _, check) in contents {
        let HeaderCheck::Valid(h) = check else { continue };
        if let Some((before, first)) = previous
            && h.first_seq < first
        {
            return Err(inconsistent(format!(
                "journal files are out of order: {} starts at #{}, before #{} where {} starts, though it sorts after it (files renamed, copied or restored under other names)",
                path.display(),
                h.first_seq,
                first,
                before.display()
            )));
        }
        previous = Some((path, h.first_seq));
    }
    Ok(())
}

/// Reads the records of every file in order: drops the never-acknowledged ones, refuses copies
/// and gaps no salvage explains, and plans cutting off a torn end or salvaging a damaged file.
fn read_records_in_order(plan: &mut Plan, dir: &Path, contents: Vec<Content>) -> Result<(), JournalError> {
    let inconsistent = |what: String| JournalError::Inconsistent {
        dir: dir.to_path_buf(),
        what,
    };
    let last_whole = contents.iter().rposition(|(_, _, b, _)| b.len() >= HEADER_LEN);
    // The valid files read so far, the last one's salvage (if damaged), and files between it and
    // the next valid one whose header is unreadable.
    let mut read: Vec<PathBuf> = Vec::new();
    let mut last_salvage: Option<usize> = None;
    let mut unreadable: Vec<PathBuf> = Vec::new();
    for (index, (_, path, bytes, check)) in contents.into_iter().enumerate() {
        let Some(header) = header_or_set_aside(plan, path.clone(), &bytes, check, &mut unreadable) else {
            continue;
        };
        // A file created later than the records so far: the records in between were acknowledged
        // (the journal moved past them) and must be in an earlier file.
        account_for_gap(plan, dir, &path, header, &read, &unreadable, last_salvage)?;
        // Records at or above this file's first sequence number in older files were never
        // acknowledged: their append failed and the number was given to this file.
        let mut dropped = Vec::new();
        while plan.records.last().is_some_and(|r| r.seq >= header.first_seq) {
            dropped.push(plan.records.pop().expect("checked"));
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
        // A failed append's record differs from the one later written under its number (at least
        // in its time); the very same records twice mean a file was copied.
        let copies: Vec<u64> = dropped
            .iter()
            .filter(|d| scan.records.iter().any(|r| r == *d))
            .map(|d| d.seq)
            .collect();
        if let (Some(low), Some(high)) = (copies.iter().min(), copies.iter().max()) {
            return Err(inconsistent(format!(
                "records {} appear twice, identically, in {} and in an older file: a journal file was copied or restored next to the original",
                seq_range(*low, *high),
                path.display()
            )));
        }
        for d in dropped.iter().rev() {
            plan.warnings.push(format!(
                "ignoring record #{} written before {}: its append failed and was never acknowledged",
                d.seq,
                path.display()
            ));
        }
        if let Some(last) = scan.records.last() {
            plan.next_seq = plan.next_seq.max(last.seq + 1);
        }
        read.push(path.clone());
        unreadable.clear();
        let is_last = Some(index) == last_whole;
        last_salvage = note_damage(plan, &path, &bytes, header, &scan, is_last);
        plan.records.extend(scan.records);
    }
    Ok(())
}

/// The header of a file in the walk, or `None` when the file holds no record: one whose creation
/// was cut short is removed; one whose header is unreadable is moved to damaged/ (`unreadable`).
fn header_or_set_aside(
    plan: &mut Plan,
    path: PathBuf,
    bytes: &[u8],
    check: HeaderCheck,
    unreadable: &mut Vec<PathBuf>,
) -> Option<Header> {
    match check {
        HeaderCheck::Valid(header) => Some(header),
        HeaderCheck::TooShort if starts_like_a_journal_file(bytes) => {
            plan.warnings.push(format!(
                "removing {}: its creation was cut short ({} byte(s), no record)",
                path.display(),
                bytes.len()
            ));
            plan.actions.push(Action::RemoveEmpty { path });
            None
        }
        HeaderCheck::TooShort => {
            plan.warnings.push(format!(
            "moving {} to {DAMAGED_DIR}/: {} byte(s) that are not the start of a journal file; the journal did not write it",
            path.display(),
            bytes.len()
        ));
            plan.actions.push(Action::MoveDamaged { path: path.clone() });
            unreadable.push(path);
            None
        }
        HeaderCheck::Invalid(what) => {
            plan.warnings.push(format!(
                "moving {} to {DAMAGED_DIR}/: unreadable header ({what}); it holds no readable record",
                path.display()
            ));
            plan.actions.push(Action::MoveDamaged { path: path.clone() });
            unreadable.push(path);
            None
        }
        HeaderCheck::NewerFormat(_) => unreachable!("refused above"),
    }
}

/// A file created later than the records so far: the records in between were acknowledged
/// (the journal moved past them) and must be in an earlier file.
fn account_for_gap(
    plan: &mut Plan,
    dir: &Path,
    path: &Path,
    header: Header,
    read: &[PathBuf],
    unreadable: &[PathBuf],
    last_salvage: Option<usize>,
) -> Result<(), JournalError> {
    let inconsistent = |what: String| JournalError::Inconsistent {
        dir: dir.to_path_buf(),
        what,
    };
    if header.kind == FileKind::Appended && header.first_seq > plan.next_seq {
        let (first, last) = (plan.next_seq, header.first_seq - 1);
        // An unreadable file in between may have held them: then it is not known to be the damage.
        match last_salvage.filter(|_| unreadable.is_empty()) {
            // Lost to damage already being salvaged (a copy goes to damaged/): say so, and
            // make the salvage a compaction that records where the sequence continues.
            Some(at) => {
                let Action::Salvage {
                    path: damaged,
                    header: salvage_header,
                    records,
                    supersedes,
                } = &mut plan.actions[at]
                else {
                    unreachable!("last_salvage indexes a salvage")
                };
                plan.warnings.push(format!(
                    "records {} were in the damaged part of {} and are lost (the file as it was is kept in {DAMAGED_DIR}/); check the builds they concerned by hand",
                    seq_range(first, last),
                    damaged.display()
                ));
                *salvage_header = Header {
                    kind: FileKind::Compacted,
                    first_seq: header.first_seq,
                };
                *records = plan.records.clone();
                *supersedes = read[..read.len() - 1].to_vec();
                plan.next_seq = header.first_seq;
            }
            None => {
                let before = match read.last() {
                    Some(file) => format!("the file before it, {}, ends before them", file.display()),
                    None => "no journal file before it holds them".to_string(),
                };
                let between = if unreadable.is_empty() {
                    String::new()
                } else {
                    format!(
                        " ({} between them cannot be read and may have held them; left in place)",
                        unreadable
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                };
                return Err(inconsistent(format!(
                    "records {} are missing: {} starts at #{} but {before}{between}; a journal file was removed or lost",
                    seq_range(first, last),
                    path.display(),
                    header.first_seq
                )));
            }
        }
    }
    Ok(())
}

/// Plans what a file's damage needs: a torn end of the last whole file is cut off, anything else
/// is salvaged. Returns the salvage's index in `plan.actions`.
fn note_damage(
    plan: &mut Plan,
    path: &Path,
    bytes: &[u8],
    header: Header,
    scan: &format::Scan,
    is_last: bool,
) -> Option<usize> {
    match (scan.damage.is_empty(), scan.torn_at) {
        (true, None) => None,
        (true, Some(at)) if is_last => {
            plan.warnings.push(format!(
                "cutting off a torn record at the end of {} at offset {at} ({} byte(s)): its write was cut short and never acknowledged",
                path.display(),
                bytes.len() as u64 - at
            ));
            plan.actions.push(Action::Truncate {
                path: path.to_path_buf(),
                at,
            });
            None
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
            let salvage = plan.actions.len();
            plan.actions.push(Action::Salvage {
                path: path.to_path_buf(),
                header,
                records: scan.records.clone(),
                supersedes: Vec::new(),
            });
            Some(salvage)
        }
    }
}

/// Carries out one repair durably.
pub(super) fn repair(dir: &Path, action: &Action) -> Result<(), JournalError> {
    const NEXT: &str = "refusing to start with a journal that could not be repaired";
    match action {
        Action::RemoveTmp { path } | Action::RemoveEmpty { path } => {
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
            let file = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(path)
                .map_err(JournalError::io("opening for truncation", path, NEXT))?;
            file.set_len(*at)
                .map_err(JournalError::io(format!("truncating at offset {at}"), path, NEXT))?;
            file.sync_all()
                .map_err(JournalError::io("syncing after truncation", path, NEXT))?;
        }
        Action::Salvage {
            path,
            header,
            records,
            supersedes,
        } => {
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
            // Never written through whatever sits at the name (a planted link): removed, then
            // created exclusively.
            let _ = fs::remove_file(&tmp);
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)
                .map_err(JournalError::io("creating", &tmp, NEXT))?;
            write_and_sync(&mut file, &buf).map_err(JournalError::io("writing", &tmp, NEXT))?;
            fs::rename(&tmp, path).map_err(JournalError::io("renaming repaired file over", path, NEXT))?;
            sync_dir(dir).map_err(JournalError::io("syncing journal directory", dir, NEXT))?;
            // Every record of these is in the replacement, which is durable now.
            for old in supersedes {
                fs::remove_file(old).map_err(JournalError::io("removing superseded", old, NEXT))?;
            }
            if !supersedes.is_empty() {
                sync_dir(dir).map_err(JournalError::io("syncing journal directory", dir, NEXT))?;
            }
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
    // symlink_metadata: a dangling link there counts as taken (a copy must not go through it).
    while target.symlink_metadata().is_ok() {
        target = damaged.join(format!("{name}.{n}"));
        n += 1;
    }
    target
}

/// Copies a file into damaged/ durably, leaving the original in place.
pub(super) fn copy_to_damaged(dir: &Path, path: &Path) -> Result<(), JournalError> {
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
