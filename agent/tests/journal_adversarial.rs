//! The journal against a hostile or careless hand on its directory: the last record cut at every
//! byte, every byte of a record flipped, segments removed, reordered or copied, foreign files,
//! and (property-based) random bytes appended or spliced in. What was acknowledged is never lost
//! silently: it is replayed, or kept in `damaged/` with a warning, or the open fails naming what
//! is missing and how to proceed. Nothing the journal did not write is deleted.

use proptest::prelude::*;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;
use tartan_agent::journal::{DAMAGED_DIR, JOURNAL_DIR, Journal, JournalError, JournalOptions, Replay};
use tartan_agent::lock::StateLock;
use tartan_agent::record::Record;
use tartan_api::AttemptState;

fn record(detail: String) -> Record {
    Record {
        version: 0,
        seq: 0,
        time: "2026-10-05T02:41:40.304Z".parse().unwrap(),
        build: None,
        attempt: Some(1),
        vm: Some("mb-ci-build-1-a1".into()),
        from: None,
        to: AttemptState::Running,
        reason: None,
        detail,
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

fn open(state: &Path) -> Result<(Journal, Replay), JournalError> {
    let lock = StateLock::acquire(state).unwrap();
    let opened = Journal::open(&lock, JournalOptions::default());
    drop(lock);
    opened
}

fn seqs(replay: &Replay) -> Vec<u64> {
    replay.records.iter().map(|r| r.seq).collect()
}

/// The journal's segment files, in id order.
fn segments(state: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(state.join(JOURNAL_DIR))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "journal") && p.is_file())
        .collect();
    files.sort();
    files
}

fn damaged(state: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(state.join(JOURNAL_DIR).join(DAMAGED_DIR))
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

/// Everything in the journal directory (names and contents), to show nothing changed.
fn snapshot(state: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(state.join(JOURNAL_DIR))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                fs::read(&p).unwrap(),
            )
        })
        .collect()
}

/// A journal written by three agent runs (three segments) of `per_run` records each; returns the
/// records as acknowledged, by seq.
fn three_runs(state: &Path, per_run: usize) -> BTreeMap<u64, Record> {
    let mut written = BTreeMap::new();
    for run in 0..3 {
        let (mut journal, _) = open(state).unwrap();
        for i in 0..per_run {
            let mut r = record(format!("run {run} record {i}"));
            let seq = journal.append(&mut r).unwrap();
            written.insert(seq, r);
        }
    }
    assert_eq!(segments(state).len(), 3);
    written
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Byte offsets where each record's frame starts in a segment, found by appending one at a time.
fn single_file_with_offsets(state: &Path, n: usize) -> (PathBuf, Vec<u64>) {
    let (mut journal, _) = open(state).unwrap();
    let mut offsets = Vec::new();
    for i in 0..n {
        journal.append(&mut record(format!("record {i}"))).unwrap();
        let path = segments(state).pop().unwrap();
        offsets.push(fs::metadata(&path).unwrap().len());
    }
    let path = segments(state).pop().unwrap();
    // offsets[i] is the end of record i+1; starts are the previous ends (the first after the header).
    let mut starts = vec![32];
    starts.extend_from_slice(&offsets[..n - 1]);
    starts.push(offsets[n - 1]);
    (path, starts)
}

#[test]
fn the_last_record_cut_at_every_byte_keeps_every_earlier_record() {
    let pristine = tempfile::tempdir().unwrap();
    let (path, bounds) = single_file_with_offsets(pristine.path(), 4);
    let bytes = fs::read(&path).unwrap();
    let (start, end) = (bounds[3], bounds[4]);
    let name = path.file_name().unwrap();
    for cut in start..end {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(&pristine.path().join(JOURNAL_DIR), &dir.path().join(JOURNAL_DIR));
        fs::write(dir.path().join(JOURNAL_DIR).join(name), &bytes[..cut as usize]).unwrap();
        let (mut journal, replay) = open(dir.path()).unwrap();
        assert_eq!(seqs(&replay), vec![1, 2, 3], "cut at {cut}");
        assert_eq!(
            replay.warnings.len(),
            usize::from(cut > start),
            "cut at {cut}: {:?}",
            replay.warnings
        );
        assert!(damaged(dir.path()).is_empty(), "cut at {cut}");
        // The cut record was never acknowledged: its number is given out again.
        assert_eq!(journal.append(&mut record("again".into())).unwrap(), 4);
        drop(journal);
        let (_, replay) = open(dir.path()).unwrap();
        assert_eq!(seqs(&replay), vec![1, 2, 3, 4], "cut at {cut}");
        assert!(replay.warnings.is_empty(), "cut at {cut}: {:?}", replay.warnings);
    }
}

#[test]
fn every_byte_of_a_middle_record_flipped_is_salvaged_loudly_keeping_the_rest() {
    let pristine = tempfile::tempdir().unwrap();
    let (path, bounds) = single_file_with_offsets(pristine.path(), 5);
    let bytes = fs::read(&path).unwrap();
    let name = path.file_name().unwrap();
    for at in bounds[2]..bounds[3] {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(&pristine.path().join(JOURNAL_DIR), &dir.path().join(JOURNAL_DIR));
        let mut flipped = bytes.clone();
        flipped[at as usize] ^= 0xff;
        fs::write(dir.path().join(JOURNAL_DIR).join(name), &flipped).unwrap();
        let (_, replay) = open(dir.path()).unwrap();
        assert_eq!(seqs(&replay), vec![1, 2, 4, 5], "byte {at}");
        assert!(
            replay.warnings.len() == 1 && replay.warnings[0].contains("cannot be read whole"),
            "byte {at}: {:?}",
            replay.warnings
        );
        let kept = damaged(dir.path());
        assert_eq!(kept.len(), 1, "byte {at}");
        assert_eq!(
            fs::read(&kept[0]).unwrap(),
            flipped,
            "byte {at}: damaged/ holds the file as it was"
        );
        let (_, replay) = open(dir.path()).unwrap();
        assert_eq!(seqs(&replay), vec![1, 2, 4, 5], "byte {at}");
        assert!(replay.warnings.is_empty(), "byte {at}: {:?}", replay.warnings);
    }
}

#[test]
fn a_flipped_last_record_of_a_middle_segment_is_reported_lost_and_the_next_open_is_clean() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    three_runs(state, 3);
    let middle = segments(state)[1].clone();
    let mut bytes = fs::read(&middle).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x01;
    fs::write(&middle, &bytes).unwrap();
    let (mut journal, replay) = open(state).unwrap();
    assert_eq!(seqs(&replay), vec![1, 2, 3, 4, 5, 7, 8, 9]);
    assert!(
        replay
            .warnings
            .iter()
            .any(|w| w.contains("records #6 were in the damaged part")),
        "{:?}",
        replay.warnings
    );
    assert_eq!(damaged(state).len(), 1);
    assert_eq!(journal.append(&mut record("after".into())).unwrap(), 10);
    drop(journal);
    let (_, replay) = open(state).unwrap();
    assert_eq!(seqs(&replay), vec![1, 2, 3, 4, 5, 7, 8, 9, 10]);
    assert!(replay.warnings.is_empty(), "{:?}", replay.warnings);
}

#[test]
fn a_deleted_middle_segment_stops_the_open_naming_the_missing_records() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    three_runs(state, 3);
    let [first, middle, last] = segments(state).try_into().unwrap();
    fs::remove_file(&middle).unwrap();
    let before = snapshot(state);
    let err = open(state).unwrap_err();
    assert!(matches!(err, JournalError::Inconsistent { .. }), "{err:?}");
    let text = err.to_string();
    for needle in [
        "records #4..=#6 are missing",
        &last.display().to_string(),
        &first.display().to_string(),
        "removed or lost",
        "move the journal directory aside",
        "checked by hand",
    ] {
        assert!(text.contains(needle), "{needle:?} not in: {text}");
    }
    assert_eq!(snapshot(state), before, "nothing is changed");
    // The read-only reader refuses it too.
    assert!(tartan_agent::journal::read_records(state).is_err());

    // The middle segment's header overwritten: its records may be in it, but cannot be read.
    let dir = tempfile::tempdir().unwrap();
    three_runs(dir.path(), 3);
    let middle = segments(dir.path())[1].clone();
    let mut bytes = fs::read(&middle).unwrap();
    bytes[..8].copy_from_slice(b"garbage!");
    fs::write(&middle, &bytes).unwrap();
    let before = snapshot(dir.path());
    let text = open(dir.path()).unwrap_err().to_string();
    assert!(
        text.contains("records #4..=#6 are missing")
            && text.contains(&format!("{} between them cannot be read", middle.display())),
        "{text}"
    );
    assert_eq!(snapshot(dir.path()), before);

    // The oldest segment gone (no compaction before it): records from #1 on are missing.
    let dir = tempfile::tempdir().unwrap();
    three_runs(dir.path(), 2);
    fs::remove_file(&segments(dir.path())[0]).unwrap();
    let text = open(dir.path()).unwrap_err().to_string();
    assert!(
        text.contains("records #1..=#2 are missing") && text.contains("no journal file before it holds them"),
        "{text}"
    );
}

#[test]
fn reordered_or_copied_segments_stop_the_open() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    three_runs(state, 3);
    let [_, middle, last] = segments(state).try_into().unwrap();
    let swap = state.join("swap");
    fs::rename(&middle, &swap).unwrap();
    fs::rename(&last, &middle).unwrap();
    fs::rename(&swap, &last).unwrap();
    let before = snapshot(state);
    let text = open(state).unwrap_err().to_string();
    assert!(
        text.contains("out of order") && text.contains(&last.display().to_string()),
        "{text}"
    );
    assert_eq!(snapshot(state), before);

    // The last segment copied under a later name: the same records twice.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    three_runs(state, 3);
    let last = segments(state).pop().unwrap();
    let copy = last.with_file_name("00000000000000000099.journal");
    fs::copy(&last, &copy).unwrap();
    let text = open(state).unwrap_err().to_string();
    assert!(text.contains("records #7..=#9 appear twice"), "{text}");
    assert!(text.contains(&copy.display().to_string()), "{text}");

    // An older segment copied under a later name starts before the file it follows.
    fs::remove_file(&copy).unwrap();
    fs::copy(&segments(state)[0], &copy).unwrap();
    let text = open(state).unwrap_err().to_string();
    assert!(text.contains("out of order"), "{text}");

    // A compaction copied under a later name would supersede the files written after it.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let (mut journal, _) = open(state).unwrap();
    journal.append(&mut record("before".into())).unwrap();
    let compaction = journal.compact(|_| true).unwrap().file;
    drop(journal);
    two_more_runs(state);
    let copy = compaction.with_file_name("00000000000000000099.journal");
    fs::copy(&compaction, &copy).unwrap();
    let before = snapshot(state);
    let text = open(state).unwrap_err().to_string();
    assert!(
        text.contains("the compaction cannot have superseded it") && text.contains(&copy.display().to_string()),
        "{text}"
    );
    assert_eq!(snapshot(state), before);
}

/// Two more agent runs of one record each after whatever is in the journal.
fn two_more_runs(state: &Path) {
    for run in 0..2 {
        let (mut journal, _) = open(state).unwrap();
        journal.append(&mut record(format!("later run {run}"))).unwrap();
    }
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// Opens on another thread, failing the test if it does not return within 30 s (a FIFO would
/// block a reader that opens it like a file).
fn open_bounded(state: &Path) -> (Journal, Replay) {
    let (tx, rx) = mpsc::channel();
    let state = state.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(open(&state).map_err(|e| e.to_string()));
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("the open returns instead of blocking")
        .unwrap()
}

#[test]
fn foreign_files_are_handled_clearly_and_nothing_the_journal_did_not_write_is_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let written = three_runs(state, 2);
    let jdir = state.join(JOURNAL_DIR);
    let (mut journal, _) = open(state).unwrap();
    // After a compaction the oldest file is the compacted one.
    journal.compact(|_| true).unwrap();
    journal.append(&mut record("after compaction".into())).unwrap();
    drop(journal);
    let compacted_ids: Vec<PathBuf> = segments(state);

    fs::write(jdir.join("notes.txt"), b"an operator's notes").unwrap();
    fs::create_dir(jdir.join("00000000000000000050.journal")).unwrap();
    mkfifo(&jdir.join("00000000000000000051.journal"));
    std::os::unix::fs::symlink("/dev/zero", jdir.join("00000000000000000052.journal")).unwrap();
    let short_garbage = b"hello, journal".to_vec();
    fs::write(jdir.join("00000000000000000060.journal"), &short_garbage).unwrap();
    let long_garbage = vec![0x5a; 100];
    fs::write(jdir.join("00000000000000000061.journal"), &long_garbage).unwrap();
    fs::write(jdir.join("00000000000000000062.journal.tmp"), b"not a journal file").unwrap();
    // Names the journal never gives: not 20 digits, or an id it could never reach.
    let odd_names = ["+5.journal", "5.journal", "18446744073709551615.journal"];
    for name in odd_names {
        fs::write(jdir.join(name), b"whatever").unwrap();
    }
    // A file with the journal's magic at a lower id than the compaction: an old segment restored.
    let old = fs::read(compacted_ids.first().unwrap()).unwrap();
    fs::write(jdir.join("00000000000000000000.journal"), &old).unwrap();

    let (mut journal, replay) = open_bounded(state);
    let all: Vec<u64> = written.keys().copied().chain([7]).collect();
    assert_eq!(seqs(&replay), all);
    let warned = |needle: &str| replay.warnings.iter().any(|w| w.contains(needle));
    assert!(
        warned("00000000000000000050.journal: it is a directory"),
        "{:?}",
        replay.warnings
    );
    assert!(
        warned("00000000000000000051.journal: it is a FIFO"),
        "{:?}",
        replay.warnings
    );
    assert!(
        warned("00000000000000000052.journal: it is a symbolic link"),
        "{:?}",
        replay.warnings
    );
    assert!(warned("superseded by the compaction"), "{:?}", replay.warnings);
    // Left alone: the notes, the odd names, the directory, the FIFO, the link.
    assert_eq!(fs::read(jdir.join("notes.txt")).unwrap(), b"an operator's notes");
    for name in odd_names {
        assert_eq!(fs::read(jdir.join(name)).unwrap(), b"whatever", "{name}");
        assert!(
            warned(&format!("{name}: named like a journal file, but not as")),
            "{name}: {:?}",
            replay.warnings
        );
    }
    assert!(jdir.join("00000000000000000050.journal").is_dir());
    for name in ["00000000000000000051.journal", "00000000000000000052.journal"] {
        assert!(jdir.join(name).symlink_metadata().is_ok(), "{name} left in place");
    }
    // Moved, never deleted: the garbage, the foreign temp file, the old segment.
    let kept: BTreeMap<String, Vec<u8>> = damaged(state)
        .iter()
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                fs::read(p).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kept.get("00000000000000000060.journal"),
        Some(&short_garbage),
        "{:?}",
        kept.keys()
    );
    assert_eq!(kept.get("00000000000000000061.journal"), Some(&long_garbage));
    assert_eq!(
        kept.get("00000000000000000062.journal.tmp").map(Vec::as_slice),
        Some(&b"not a journal file"[..])
    );
    assert_eq!(kept.get("00000000000000000000.journal"), Some(&old));
    // Appends continue past every id in use, including the foreign ones.
    assert_eq!(journal.append(&mut record("next".into())).unwrap(), 8);
    drop(journal);
    let newest = segments(state).pop().unwrap();
    assert!(newest.file_name().unwrap().to_string_lossy().as_ref() > "00000000000000000061.journal");
    let (_, replay) = open_bounded(state);
    assert_eq!(replay.records.last().map(|r| r.seq), Some(8));

    // A follower (`tartan-agent journal --follow`) skips the FIFO and the link instead of blocking.
    let (tx, rx) = mpsc::channel();
    let follow = state.to_path_buf();
    std::thread::spawn(move || {
        let mut tail = tartan_agent::journal::Tail::new(&follow);
        let _ = tx.send(tail.poll().map(|r| r.last().map(|r| r.seq)).map_err(|e| e.to_string()));
    });
    let last = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the follower returns instead of blocking");
    assert_eq!(last, Ok(Some(8)));
}

/// A valid three-segment journal, its acknowledged records, and where they live.
fn valid_journal() -> (tempfile::TempDir, BTreeMap<u64, Record>) {
    let dir = tempfile::tempdir().unwrap();
    let written = three_runs(dir.path(), 3);
    (dir, written)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random bytes appended to or spliced into any segment never make the reader panic or
    /// return a record that was not written; the repaired journal reads the same again.
    #[test]
    fn random_bytes_never_panic_or_invent_records(
        file in 0usize..3,
        at in any::<prop::sample::Index>(),
        append in any::<bool>(),
        overwrite in any::<bool>(),
        junk in prop::collection::vec(any::<u8>(), 1..300),
    ) {
        let (dir, written) = valid_journal();
        let path = segments(dir.path())[file].clone();
        let mut bytes = fs::read(&path).unwrap();
        if append {
            bytes.extend_from_slice(&junk);
        } else {
            let pos = at.index(bytes.len());
            if overwrite {
                let end = (pos + junk.len()).min(bytes.len());
                bytes[pos..end].copy_from_slice(&junk[..end - pos]);
            } else {
                bytes.splice(pos..pos, junk.iter().copied());
            }
        }
        fs::write(&path, &bytes).unwrap();
        if let Ok(replay) = tartan_agent::journal::read_records(dir.path()) {
            for r in &replay.records {
                prop_assert_eq!(Some(r), written.get(&r.seq), "read-only replay invented or changed #{}", r.seq);
            }
        }
        if let Ok((_, replay)) = open(dir.path()) {
            for r in &replay.records {
                prop_assert_eq!(Some(r), written.get(&r.seq), "replay invented or changed #{}", r.seq);
            }
            let (_, again) = open(dir.path()).unwrap();
            prop_assert_eq!(seqs(&again), seqs(&replay));
        }
    }
}

#[test]
fn repairs_never_write_through_links_planted_at_their_names() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let outside = tempfile::tempdir().unwrap();
    let (path, bounds) = single_file_with_offsets(state, 3);
    let mut bytes = fs::read(&path).unwrap();
    bytes[bounds[1] as usize + 12] ^= 0x01; // inside record #2: the file needs a salvage
    fs::write(&path, &bytes).unwrap();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let jdir = state.join(JOURNAL_DIR);
    let victim = outside.path().join("victim");
    fs::write(&victim, b"precious").unwrap();
    std::os::unix::fs::symlink(&victim, jdir.join(format!("{name}.tmp"))).unwrap();
    fs::create_dir(jdir.join(DAMAGED_DIR)).unwrap();
    let created_elsewhere = outside.path().join("created");
    std::os::unix::fs::symlink(&created_elsewhere, jdir.join(DAMAGED_DIR).join(&name)).unwrap();

    let (_, replay) = open(state).unwrap();
    assert_eq!(seqs(&replay), vec![1, 3]);
    assert_eq!(fs::read(&victim).unwrap(), b"precious");
    assert!(
        !created_elsewhere.exists(),
        "the damaged copy went through a dangling link"
    );
    assert_eq!(
        fs::read(jdir.join(DAMAGED_DIR).join(format!("{name}.1"))).unwrap(),
        bytes
    );
}
