use super::*;
use crate::record::BuildRef;
use std::os::fd::AsRawFd;
use tartan_api::{AttemptState, Reason};

fn draft(attempt: u32, to: AttemptState, detail: &str) -> Record {
    Record {
        version: 0,
        seq: 0,
        time: "2026-10-05T02:41:40.304Z".parse().unwrap(),
        build: Some(BuildRef {
            namespace: "ci".into(),
            name: "build-42-mac-build".into(),
            uid: "u-1".into(),
        }),
        attempt: Some(attempt),
        vm: Some(format!("mb-ci-build-42-mac-build-a{attempt}")),
        from: None,
        to,
        reason: Some(Reason::SlotFree),
        detail: detail.into(),
        outcome: None,
        slot: Some(0),
        deadline: None,
        max_attempts: None,
        step: None,
        generation: None,
        status: None,
        warm: None,
    }
}

thread_local! {
    /// How many of this thread's next journal syncs fail (see [`fail_next_syncs`]).
    static SYNCS_TO_FAIL: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Makes the next `n` syncs of journal writes on this thread fail after their write went through,
/// as an `fsync` refused by a failing disk does: the bytes are in the file, not acknowledged.
fn fail_next_syncs(n: u32) {
    SYNCS_TO_FAIL.with(|c| c.set(n));
}

/// Called by the journal's write path in tests: whether this sync is to fail.
pub(super) fn injected_sync_failure() -> bool {
    SYNCS_TO_FAIL.with(|c| {
        let left = c.get();
        c.set(left.saturating_sub(1));
        left > 0
    })
}

#[derive(Debug)]
struct Opened {
    journal: Journal,
    replay: Replay,
    _lock: StateLock,
}

fn open_with(state: &Path, max_file_bytes: u64) -> Result<Opened, JournalError> {
    let lock = StateLock::acquire(state).unwrap();
    let (journal, replay) = Journal::open(&lock, JournalOptions { max_file_bytes })?;
    Ok(Opened {
        journal,
        replay,
        _lock: lock,
    })
}

fn open(state: &Path) -> Opened {
    open_with(state, JournalOptions::default().max_file_bytes).unwrap()
}

fn append_n(journal: &mut Journal, n: usize, detail: &str) -> Vec<u64> {
    (0..n)
        .map(|i| {
            journal
                .append(&mut draft(1, AttemptState::Running, &format!("{detail} {i}")))
                .unwrap()
        })
        .collect()
}

fn seqs(records: &[Record]) -> Vec<u64> {
    records.iter().map(|r| r.seq).collect()
}

fn files(state: &Path) -> Vec<PathBuf> {
    list_files(&state.join(JOURNAL_DIR))
        .unwrap()
        .files
        .into_iter()
        .map(|(_, p)| p)
        .collect()
}

fn damaged_files(state: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = fs::read_dir(state.join(JOURNAL_DIR).join(DAMAGED_DIR))
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    found.sort();
    found
}

#[test]
fn sequence_numbers_continue_across_appends_reopen_and_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    {
        let mut o = open(state);
        assert!(o.replay.records.is_empty());
        assert_eq!(o.journal.next_seq(), 1);
        assert_eq!(append_n(&mut o.journal, 3, "first run"), vec![1, 2, 3]);
        assert_eq!(o.journal.next_seq(), 4);
    }
    {
        // Small files: every append after the first in a file rotates quickly.
        let mut o = open_with(state, 600).unwrap();
        assert_eq!(seqs(&o.replay.records), vec![1, 2, 3]);
        assert_eq!(append_n(&mut o.journal, 20, "second run"), (4..24).collect::<Vec<_>>());
    }
    let n_files = files(state).len();
    assert!(n_files >= 5, "rotation should have made several files, got {n_files}");
    let o = open(state);
    assert_eq!(seqs(&o.replay.records), (1..24).collect::<Vec<_>>());
    assert!(o.replay.warnings.is_empty(), "{:?}", o.replay.warnings);
    assert_eq!(o.replay.records[5].detail, "second run 2");
    assert_eq!(o.replay.records[5].version, crate::record::PLAIN_RECORD_VERSION);
    assert_eq!(o.journal.next_seq(), 24);
}

#[test]
fn a_torn_last_record_is_cut_off_with_a_warning_naming_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    drop(append_n(&mut open(state).journal, 5, "r"));
    let path = files(state).pop().unwrap();
    let full_len = fs::metadata(&path).unwrap().len();
    // Learn where record #5 starts from a journal holding only #1..#4.
    let bytes = fs::read(&path).unwrap();
    let mut pos = HEADER_LEN;
    for _ in 0..4 {
        let format::Frame::Record(_, len) = format::decode_frame(&bytes, pos) else {
            panic!("frame at {pos}")
        };
        pos += len;
    }
    let cut = full_len - 3;
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();

    // The read-only reader reports it but changes nothing.
    let read = read_records(state).unwrap();
    assert_eq!(seqs(&read.records), vec![1, 2, 3, 4]);
    assert_eq!(fs::metadata(&path).unwrap().len(), cut);

    let mut o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![1, 2, 3, 4]);
    assert_eq!(o.replay.warnings.len(), 1, "{:?}", o.replay.warnings);
    let warning = &o.replay.warnings[0];
    assert!(warning.contains(&path.display().to_string()), "{warning}");
    assert!(warning.contains(&format!("offset {pos}")), "{warning}");
    assert_eq!(fs::metadata(&path).unwrap().len(), pos as u64);
    assert!(damaged_files(state).is_empty());
    // The unacknowledged number is given out again.
    assert_eq!(
        o.journal.append(&mut draft(1, AttemptState::Retired, "after")).unwrap(),
        5
    );
    drop(o);
    assert_eq!(seqs(&open(state).replay.records), vec![1, 2, 3, 4, 5]);
}

#[test]
fn a_bit_flip_in_the_middle_moves_the_file_aside_keeping_every_readable_record() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    drop(append_n(&mut open(state).journal, 10, "r"));
    let path = files(state).pop().unwrap();
    let mut bytes = fs::read(&path).unwrap();
    let original = bytes.clone();
    // Flip one bit inside record #5's payload.
    let needle = b"\"seq\":5,";
    let at = bytes.windows(needle.len()).position(|w| w == needle).unwrap();
    bytes[at + 3] ^= 0x04;
    fs::write(&path, &bytes).unwrap();

    let mut o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![1, 2, 3, 4, 6, 7, 8, 9, 10]);
    assert_eq!(o.replay.warnings.len(), 1, "{:?}", o.replay.warnings);
    assert!(
        o.replay.warnings[0].contains("cannot be read whole"),
        "{:?}",
        o.replay.warnings
    );
    assert!(
        o.replay.warnings[0].contains("checksum mismatch"),
        "{:?}",
        o.replay.warnings
    );
    let damaged = damaged_files(state);
    assert_eq!(damaged.len(), 1);
    assert_eq!(
        fs::read(&damaged[0]).unwrap(),
        bytes,
        "damaged/ keeps the file as it was"
    );
    assert_ne!(fs::read(&path).unwrap(), original);
    assert_eq!(o.journal.next_seq(), 11);
    assert_eq!(o.journal.append(&mut draft(2, AttemptState::Admitted, "")).unwrap(), 11);
    drop(o);
    // The repaired journal reads whole now.
    let o = open(state);
    assert!(o.replay.warnings.is_empty(), "{:?}", o.replay.warnings);
    assert_eq!(seqs(&o.replay.records), vec![1, 2, 3, 4, 6, 7, 8, 9, 10, 11]);
}

#[test]
fn a_torn_end_of_a_file_that_is_not_the_last_counts_as_damage() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    drop(append_n(&mut open(state).journal, 3, "first"));
    drop(append_n(&mut open(state).journal, 2, "second"));
    let [first, _second] = files(state).try_into().unwrap();
    let len = fs::metadata(&first).unwrap().len();
    OpenOptions::new()
        .write(true)
        .open(&first)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![1, 2, 4, 5]);
    assert_eq!(damaged_files(state).len(), 1);
    assert!(
        o.replay.warnings[0].contains("unreadable to the end"),
        "{:?}",
        o.replay.warnings
    );
    assert!(
        o.replay
            .warnings
            .iter()
            .any(|w| w.contains("records #3 were in the damaged part")),
        "{:?}",
        o.replay.warnings
    );
    drop(o);
    // The known loss is not mistaken for a missing file at the next open.
    let o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![1, 2, 4, 5]);
    assert!(o.replay.warnings.is_empty(), "{:?}", o.replay.warnings);
    assert_eq!(damaged_files(state).len(), 1);
}

#[test]
fn a_newer_record_version_or_file_format_is_refused_and_nothing_is_changed() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    drop(append_n(&mut open(state).journal, 2, "r"));
    let path = files(state).pop().unwrap();
    let mut newer = draft(1, AttemptState::Running, "from the future");
    newer.version = RECORD_VERSION + 1;
    newer.seq = 3;
    let mut bytes = fs::read(&path).unwrap();
    format::encode_frame(&newer, &mut bytes).unwrap();
    fs::write(&path, &bytes).unwrap();
    let err = open_with(state, 1 << 20).unwrap_err();
    assert!(
        matches!(err, JournalError::NewerRecord { found, seq: Some(3), .. } if found == RECORD_VERSION + 1),
        "{err:?}"
    );
    assert!(err.to_string().contains("refusing to start"), "{err}");
    assert_eq!(fs::read(&path).unwrap(), bytes);

    let mut header = bytes.clone();
    header[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let crc = crc32fast::hash(&header[0..24]);
    header[24..28].copy_from_slice(&crc.to_le_bytes());
    fs::write(&path, &header).unwrap();
    let err = open_with(state, 1 << 20).unwrap_err();
    assert!(matches!(err, JournalError::NewerFormat { .. }), "{err:?}");
    assert!(read_records(state).is_err());
}

#[test]
fn a_failed_write_fails_closed_and_the_next_append_goes_to_a_new_file() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let mut o = open(state);
    append_n(&mut o.journal, 2, "before");
    let current = o.journal.current.as_ref().unwrap();
    let poisoned_path = current.path.clone();
    // Make the journal's descriptor refer to a read-only open file: the kernel refuses the write.
    let read_only = File::open(&poisoned_path).unwrap();
    // SAFETY: both descriptors are open and owned here; dup2 swaps what the journal's one refers to.
    let rc = unsafe { libc::dup2(read_only.as_raw_fd(), current.file.as_raw_fd()) };
    assert_eq!(
        rc,
        current.file.as_raw_fd(),
        "dup2 failed: {}",
        io::Error::last_os_error()
    );
    drop(read_only);

    let err = o
        .journal
        .append(&mut draft(1, AttemptState::Collecting, "lost"))
        .unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, JournalError::Io { .. }), "{err:?}");
    assert!(message.contains("#3"), "{message}");
    assert!(message.contains(&poisoned_path.display().to_string()), "{message}");
    assert!(message.contains("must not be acted on"), "{message}");
    assert_eq!(o.journal.next_seq(), 3, "a failed append does not use up its number");

    assert_eq!(
        o.journal
            .append(&mut draft(1, AttemptState::Collecting, "kept"))
            .unwrap(),
        3
    );
    let new_path = o.journal.current.as_ref().unwrap().path.clone();
    assert_ne!(new_path, poisoned_path);
    append_n(&mut o.journal, 1, "after");
    drop(o);
    let o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![1, 2, 3, 4]);
    assert_eq!(o.replay.records[2].detail, "kept");
}

#[test]
fn a_record_whose_append_failed_is_dropped_when_a_later_file_reused_its_number() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    drop(append_n(&mut open(state).journal, 3, "first"));
    let first = files(state).pop().unwrap();
    drop(append_n(&mut open(state).journal, 1, "second"));
    // As if #4's write into the first file had reached the disk though its sync failed.
    let mut ghost = draft(1, AttemptState::Running, "never acknowledged");
    ghost.version = RECORD_VERSION;
    ghost.seq = 4;
    let mut bytes = fs::read(&first).unwrap();
    format::encode_frame(&ghost, &mut bytes).unwrap();
    fs::write(&first, &bytes).unwrap();

    let o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![1, 2, 3, 4]);
    assert_eq!(o.replay.records[3].detail, "second 0");
    assert!(o.replay.warnings[0].contains("record #4"), "{:?}", o.replay.warnings);
}

#[test]
fn compaction_keeps_chosen_records_and_their_numbers_and_the_sequence_continues() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let mut o = open_with(state, 400).unwrap();
    for attempt in 1..=3 {
        for to in [AttemptState::Admitted, AttemptState::Running, AttemptState::Retired] {
            o.journal.append(&mut draft(attempt, to, "")).unwrap();
        }
    }
    assert!(files(state).len() > 2);
    let report = o.journal.compact(|r| r.attempt == Some(2)).unwrap();
    assert_eq!((report.kept, report.dropped), (3, 6));
    assert_eq!(files(state), vec![report.file.clone()]);
    assert_eq!(o.journal.append(&mut draft(4, AttemptState::Admitted, "")).unwrap(), 10);
    drop(o);

    let mut o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![4, 5, 6, 10]);
    // Compacting everything away still keeps the sequence going.
    o.journal.compact(|_| false).unwrap();
    drop(o);
    let mut o = open(state);
    assert!(o.replay.records.is_empty());
    assert_eq!(o.journal.next_seq(), 11);
    assert_eq!(o.journal.append(&mut draft(5, AttemptState::Admitted, "")).unwrap(), 11);
}

#[test]
fn a_compaction_cut_short_is_finished_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let mut o = open(state);
    append_n(&mut o.journal, 4, "r");
    let old = files(state).pop().unwrap();
    let old_bytes = fs::read(&old).unwrap();
    o.journal.compact(|r| r.seq > 2).unwrap();
    drop(o);
    // As if the crash came after the rename but before the old file was removed, and during a
    // later compaction's write.
    fs::write(&old, &old_bytes).unwrap();
    let tmp = state.join(JOURNAL_DIR).join(format!("{:020}{TMP_SUFFIX}", 99));
    let partial = Header {
        kind: FileKind::Compacted,
        first_seq: 5,
    }
    .encode();
    fs::write(&tmp, &partial[..20]).unwrap();
    let o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![3, 4]);
    assert!(!old.exists() && !tmp.exists());
    assert_eq!(o.replay.warnings.len(), 2, "{:?}", o.replay.warnings);
    // The journal cannot tell its own leftover from a file put there: kept, never deleted.
    let damaged = damaged_files(state);
    assert_eq!(damaged.len(), 1, "{damaged:?}");
    assert_eq!(fs::read(&damaged[0]).unwrap(), old_bytes);
}

#[test]
fn files_cut_short_in_the_header_are_removed_and_bad_headers_moved_aside() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    drop(append_n(&mut open(state).journal, 2, "r"));
    let jdir = state.join(JOURNAL_DIR);
    fs::write(jdir.join(file_name(50)), b"TRTN").unwrap();
    fs::write(jdir.join(file_name(40)), [7u8; 64]).unwrap();
    let mut o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![1, 2]);
    assert!(!jdir.join(file_name(50)).exists());
    assert_eq!(damaged_files(state), vec![jdir.join(DAMAGED_DIR).join(file_name(40))]);
    assert_eq!(o.journal.append(&mut draft(1, AttemptState::Retired, "")).unwrap(), 3);
}

#[test]
fn tail_follows_appends_across_rotation_and_compaction_once_each() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let mut tail = Tail::new(state);
    assert!(tail.poll().unwrap().is_empty(), "no journal yet reads as empty");
    let mut o = open_with(state, 500).unwrap();
    append_n(&mut o.journal, 3, "a");
    assert_eq!(seqs(&tail.poll().unwrap()), vec![1, 2, 3]);
    assert!(tail.poll().unwrap().is_empty());
    append_n(&mut o.journal, 10, "b");
    assert_eq!(seqs(&tail.poll().unwrap()), (4..14).collect::<Vec<_>>());
    o.journal.compact(|r| r.seq % 2 == 0).unwrap();
    append_n(&mut o.journal, 2, "c");
    assert_eq!(seqs(&tail.poll().unwrap()), vec![14, 15]);
    // A half-written frame at the end is waited on, not skipped.
    let path = o.journal.current.as_ref().unwrap().path.clone();
    let mut frame = Vec::new();
    let mut next = draft(1, AttemptState::Retired, "slow");
    next.seq = 16;
    next.version = RECORD_VERSION;
    format::encode_frame(&next, &mut frame).unwrap();
    let mut file = OpenOptions::new().append(true).open(&path).unwrap();
    file.write_all(&frame[..10]).unwrap();
    assert!(tail.poll().unwrap().is_empty());
    file.write_all(&frame[10..]).unwrap();
    assert_eq!(seqs(&tail.poll().unwrap()), vec![16]);
    assert_eq!(tail.last_seq(), Some(16));
}

#[test]
fn a_batch_is_numbered_in_order_and_durable_as_a_whole() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let mut o = open(state);
    append_n(&mut o.journal, 1, "single");
    let mut batch: Vec<Record> = (0..5)
        .map(|i| draft(2, AttemptState::Running, &format!("b{i}")))
        .collect();
    assert_eq!(o.journal.append_batch(&mut batch).unwrap(), 2..7);
    assert_eq!(
        batch.iter().map(|r| r.seq).collect::<Vec<_>>(),
        (2..7).collect::<Vec<_>>()
    );
    assert_eq!(o.journal.append_batch(&mut []).unwrap(), 7..7);
    assert_eq!(o.journal.next_seq(), 7);
    drop(o);
    let o = open(state);
    assert_eq!(seqs(&o.replay.records), (1..7).collect::<Vec<_>>());
    assert_eq!(o.replay.records[3].detail, "b2");
}

#[test]
fn probes_back_off_exponentially_to_a_cap() {
    let waits: Vec<u64> = [1, 2, 3, 4, 6, 7, 8, 40, u32::MAX]
        .into_iter()
        .map(|n| probe_backoff(n).as_secs())
        .collect();
    assert_eq!(waits, vec![1, 2, 4, 8, 32, 60, 60, 60, 60]);
}

#[test]
fn only_empty_files_and_header_prefixes_look_like_the_journal_s_own() {
    let header = Header {
        kind: FileKind::Compacted,
        first_seq: 77,
    }
    .encode();
    for n in 0..=HEADER_LEN {
        assert!(starts_like_a_journal_file(&header[..n]), "prefix of {n} bytes");
    }
    assert!(!starts_like_a_journal_file(b"TRTNJRNX"));
    assert!(!starts_like_a_journal_file(&[7u8; 20]));
    let mut other_kind = header;
    other_kind[12] = 9;
    assert!(!starts_like_a_journal_file(&other_kind[..14]));
}

#[test]
fn an_unwritable_journal_fails_without_burning_file_ids_and_recovers_by_a_backed_off_probe() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    // Every append rotates, so every append has to create a file.
    let mut o = open_with(state, 1).unwrap();
    append_n(&mut o.journal, 2, "before");
    let health = o.journal.health();
    assert!(health.failing().is_none() && o.journal.writable());
    // Even root cannot create files in a directory that is a regular file now.
    let jdir = state.join(JOURNAL_DIR);
    let away = state.join("journal.away");
    fs::rename(&jdir, &away).unwrap();
    fs::write(&jdir, b"not a directory").unwrap();
    let id_before = o.journal.next_file_id;
    for n in 1..=5u32 {
        let err = o
            .journal
            .append(&mut draft(1, AttemptState::Collecting, "lost"))
            .unwrap_err();
        assert!(err.to_string().contains("must not be acted on"), "{err}");
        let failing = health.failing().expect("failing after a failed append");
        assert_eq!(failing.failures, n);
        assert_eq!(failing.error, err.to_string());
    }
    assert_eq!(o.journal.next_file_id, id_before, "no file was created, no id used up");
    assert_eq!(o.journal.next_seq(), 3);
    // Within the back-off the disk is not touched again.
    assert!(!o.journal.writable());
    assert_eq!(health.failing().unwrap().failures, 5);
    // Its time has come but the directory is still broken: one more failure, a longer wait.
    o.journal.probe_at = Some(Instant::now());
    assert!(!o.journal.writable());
    assert_eq!(health.failing().unwrap().failures, 6);
    let wait = o.journal.probe_at.unwrap() - Instant::now();
    assert!(wait > probe_backoff(5) && wait <= probe_backoff(6), "{wait:?}");

    fs::remove_file(&jdir).unwrap();
    fs::rename(&away, &jdir).unwrap();
    assert!(!o.journal.writable(), "not before the back-off ends");
    o.journal.probe_at = Some(Instant::now());
    assert!(o.journal.writable());
    assert!(health.failing().is_none());
    assert_eq!(
        o.journal
            .append(&mut draft(1, AttemptState::Collecting, "kept"))
            .unwrap(),
        3
    );
    drop(o);
    let o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![1, 2, 3]);
    assert!(o.replay.warnings.is_empty(), "{:?}", o.replay.warnings);
}

/// A sync that fails after its write went through leaves the record's bytes in the poisoned file.
/// Nothing may take them for a durable record: not the next append (it reuses the number in a new
/// file, which supersedes them), and not a compaction run before any later append: before the fix
/// the compaction copied the unacknowledged record into its synced file, the next append reused
/// its number after it, and the next open refused the journal as holding the same number twice.
#[test]
fn a_record_whose_sync_failed_is_never_taken_for_durable() {
    for compact_first in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path();
        let mut o = open(state);
        append_n(&mut o.journal, 2, "before");
        fail_next_syncs(1);
        let err = o
            .journal
            .append(&mut draft(1, AttemptState::Collecting, "sync failed"))
            .unwrap_err();
        assert!(err.to_string().contains("injected fsync failure"), "{err}");
        assert!(err.to_string().contains("must not be acted on"), "{err}");
        assert_eq!(o.journal.next_seq(), 3);
        assert!(o.journal.health().failing().is_some());
        if compact_first {
            let done = o.journal.compact(|_| true).unwrap();
            assert_eq!(done.kept, 2, "compact_first: {done:?}");
        }
        assert_eq!(
            o.journal
                .append(&mut draft(1, AttemptState::Collecting, "kept"))
                .unwrap(),
            3
        );
        assert!(o.journal.health().failing().is_none());
        drop(o);
        let o = open_with(state, JournalOptions::default().max_file_bytes)
            .unwrap_or_else(|e| panic!("compact_first {compact_first}: {e}"));
        assert_eq!(seqs(&o.replay.records), vec![1, 2, 3], "compact_first {compact_first}");
        assert_eq!(o.replay.records[2].detail, "kept");
        assert!(
            !o.replay.records.iter().any(|r| r.detail == "sync failed"),
            "compact_first {compact_first}"
        );
    }
}

/// A sync that fails while a new file is started (rotation, or the first append of a process)
/// leaves nothing behind either: the file is removed and its number given to the next try.
#[test]
fn a_failed_sync_of_a_new_file_acknowledges_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let mut o = open(state);
    fail_next_syncs(1);
    assert!(o.journal.append(&mut draft(1, AttemptState::Running, "lost")).is_err());
    assert_eq!(o.journal.next_seq(), 1);
    assert_eq!(append_n(&mut o.journal, 1, "kept"), vec![1]);
    drop(o);
    let o = open(state);
    assert_eq!(seqs(&o.replay.records), vec![1]);
    assert_eq!(o.replay.records[0].detail, "kept 0");
}
