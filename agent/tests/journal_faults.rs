//! Fail-closed appends against real write failures: a child process lowers its file-size limit
//! (RLIMIT_FSIZE, with SIGXFSZ ignored) so that the kernel refuses journal writes with EFBIG,
//! appends, then lifts the limit and appends again. The limit is per process, hence the child.

use std::path::Path;
use std::process::Command;
use tartan_agent::journal::{DAMAGED_DIR, JOURNAL_DIR, Journal, JournalError, JournalOptions};
use tartan_agent::lock::StateLock;
use tartan_agent::record::Record;
use tartan_api::AttemptState;

const CHILD_ENV: &str = "TARTAN_JOURNAL_FAULT_CHILD_STATE";

fn record(detail: &str) -> Record {
    Record {
        version: 0,
        seq: 0,
        time: "2026-10-05T02:41:40.304Z".parse().unwrap(),
        build: None,
        attempt: Some(1),
        vm: None,
        from: None,
        to: AttemptState::Running,
        reason: None,
        detail: detail.into(),
        outcome: None,
        slot: None,
        deadline: None,
        max_attempts: None,
        step: None,
        generation: None,
        status: None,
        warm: None,
    }
}

fn journal_files(state: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(state.join(JOURNAL_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != DAMAGED_DIR)
        .collect();
    names.sort();
    names
}

fn set_file_size_limit(soft: libc::rlim_t) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain libc calls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut limit), 0);
        limit.rlim_cur = soft.min(limit.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
}

#[test]
#[ignore = "child process of appends_fail_closed_until_a_write_works; changes its own file-size limit"]
fn fault_child() {
    let state = std::env::var(CHILD_ENV).expect("run by appends_fail_closed_until_a_write_works");
    let state = Path::new(&state);
    let lock = StateLock::acquire(state).unwrap();
    let (mut journal, _) = Journal::open(&lock, JournalOptions::default()).unwrap();
    assert_eq!(journal.append(&mut record("one")).unwrap(), 1);
    assert_eq!(journal.append(&mut record("two")).unwrap(), 2);
    let first_file = journal_files(state);
    assert_eq!(first_file.len(), 1);

    // Writing past 16 bytes now fails with EFBIG instead of killing us with SIGXFSZ.
    // SAFETY: setting a signal to be ignored has no handler to be unsafe about.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    set_file_size_limit(16);

    // Into the current file.
    let err = journal.append(&mut record("lost in the old file")).unwrap_err();
    assert!(
        matches!(&err, JournalError::Io { error, .. } if error.raw_os_error() == Some(libc::EFBIG)),
        "{err:?}"
    );
    assert!(err.to_string().contains(&first_file[0]), "{err}");
    assert!(err.to_string().contains("must not be acted on"), "{err}");
    // Into new files (a partial header gets written, then EFBIG), again and again.
    for _ in 0..2 {
        let err = journal.append(&mut record("lost in a new file")).unwrap_err();
        assert!(err.to_string().contains("into new file"), "{err}");
        assert_eq!(journal.next_seq(), 3);
        assert_eq!(journal_files(state), first_file, "failed new files are removed");
    }

    set_file_size_limit(libc::RLIM_INFINITY);
    assert_eq!(journal.append(&mut record("three")).unwrap(), 3);
    assert_eq!(journal.append(&mut record("four")).unwrap(), 4);
    let files = journal_files(state);
    assert_eq!(files.len(), 2, "{files:?}");
    assert_eq!(
        files[0], first_file[0],
        "the failed file is kept but never written again"
    );
    println!("\nFAULTS CHECKED");
}

#[test]
fn appends_fail_closed_until_a_write_works() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "fault_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("FAULTS CHECKED"),
        "child failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let lock = StateLock::acquire(dir.path()).unwrap();
    let (_, replay) = Journal::open(&lock, JournalOptions::default()).unwrap();
    let got: Vec<(u64, &str)> = replay.records.iter().map(|r| (r.seq, r.detail.as_str())).collect();
    assert_eq!(got, vec![(1, "one"), (2, "two"), (3, "three"), (4, "four")]);
    assert!(replay.warnings.is_empty(), "{:?}", replay.warnings);
}
