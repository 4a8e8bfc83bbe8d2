//! Crash test: a child process appends journal records and is SIGKILLed at random moments, 200
//! times. After each kill the journal, reopened, must be an exact prefix of what was written: no
//! gap, no duplicate, every acknowledged record present, at most the one unacknowledged record
//! in flight beyond them.
//!
//! The child is this test binary re-executed with `CHILD_ENV` set, running the ignored
//! `crash_child` test. It uses small files (rotation every few records) and compacts now and then
//! (keeping everything), so kills also land in file creation, rotation, compaction and in the
//! repairs a reopen makes.

use rand::Rng;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};
use tartan_agent::journal::{Journal, JournalOptions, read_records};
use tartan_agent::lock::StateLock;
use tartan_agent::record::{BuildRef, Record};
use tartan_api::{AttemptState, Reason};

const CHILD_ENV: &str = "TARTAN_JOURNAL_CRASH_CHILD_STATE";
const KILLS: usize = 200;
const MAX_FILE_BYTES: u64 = 2048;

fn detail_for(seq: u64) -> String {
    format!("written as #{seq}")
}

fn record(detail: String) -> Record {
    Record {
        version: 0,
        seq: 0,
        time: "2026-10-05T02:41:40.304Z".parse().unwrap(),
        build: Some(BuildRef {
            namespace: "ci".into(),
            name: "crash".into(),
            uid: "u".into(),
        }),
        attempt: Some(1),
        vm: None,
        from: Some(AttemptState::Booting),
        to: AttemptState::Running,
        reason: Some(Reason::GuestReady),
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

#[test]
#[ignore = "child process of journal_crash_200_kills; it appends until killed"]
fn crash_child() {
    let state = std::env::var(CHILD_ENV).expect("run by journal_crash_200_kills, which sets the state directory");
    let lock = StateLock::acquire(Path::new(&state)).unwrap();
    let (mut journal, _) = Journal::open(
        &lock,
        JournalOptions {
            max_file_bytes: MAX_FILE_BYTES,
        },
    )
    .unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "START {}", journal.next_seq()).unwrap();
    out.flush().unwrap();
    for n in 1u64.. {
        let mut r = record(detail_for(journal.next_seq()));
        let seq = journal.append(&mut r).unwrap();
        writeln!(out, "ACK {seq}").unwrap();
        out.flush().unwrap();
        if n % 7 == 0 {
            journal.compact(|_| true).unwrap();
        }
    }
}

/// Kills and reaps the child however the test ends.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_child(state: &Path) -> (Reaped, BufReader<ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, state)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (Reaped(child), stdout)
}

/// Parses the child's `START n` and `ACK n` lines.
fn parse(lines: &str, start: &mut Option<u64>, acks: &mut Vec<u64>) {
    for line in lines.lines() {
        // libtest may have begun the line with "test crash_child ... ".
        if let Some((_, n)) = line.split_once("START ") {
            *start = Some(n.parse().unwrap());
        } else if let Some(n) = line.strip_prefix("ACK ") {
            acks.push(n.parse().unwrap());
        }
    }
}

#[test]
fn journal_crash_200_kills() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let mut rng = rand::rng();
    // Records known to be in the journal (acknowledged, or found by an earlier reopen).
    let mut present = 0u64;
    let mut total_acks = 0usize;
    let mut killed_in_open = 0;
    let mut repairs = Vec::new();
    let began = Instant::now();
    for kill in 0..KILLS {
        let (mut child, mut stdout) = spawn_child(state);
        let mut start = None;
        let mut acks = Vec::new();
        if rng.random_bool(0.85) {
            // Let it open the journal, then kill it 0..40 ms into its appends.
            // (libtest prints its own lines first.)
            while start.is_none() {
                let mut line = String::new();
                assert_ne!(
                    stdout.read_line(&mut line).unwrap(),
                    0,
                    "kill {kill}: child ended before opening the journal"
                );
                parse(&line, &mut start, &mut acks);
            }
            std::thread::sleep(Duration::from_micros(rng.random_range(0..40_000)));
        } else {
            // Kill it at any moment from its start on: during exec, open, or repair.
            std::thread::sleep(Duration::from_micros(rng.random_range(0..15_000)));
        }
        child.0.kill().unwrap();
        let status = child.0.wait().unwrap();
        let mut rest = String::new();
        stdout.read_to_string(&mut rest).unwrap();
        parse(&rest, &mut start, &mut acks);
        if status.success() || start.is_none() && !acks.is_empty() {
            let mut stderr = String::new();
            child.0.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
            panic!("kill {kill}: child was not killed as planned ({status}): {stderr}");
        }
        match start {
            None => killed_in_open += 1,
            Some(start) => assert_eq!(
                start,
                present + 1,
                "kill {kill}: the child's journal did not continue at the next number"
            ),
        }
        for (i, seq) in acks.iter().enumerate() {
            assert_eq!(
                *seq,
                present + 1 + i as u64,
                "kill {kill}: acknowledgements skipped or repeated: {acks:?}"
            );
        }
        total_acks += acks.len();
        let last_ack = acks.last().copied().unwrap_or(present);

        // Reopen: as the next agent would (repairing), or read-only (leaving repairs to the child).
        let records = if kill % 2 == 0 {
            let lock = StateLock::acquire(state).unwrap();
            let (journal, replay) = Journal::open(&lock, JournalOptions::default()).unwrap();
            repairs.extend(replay.warnings);
            assert_eq!(journal.next_seq(), replay.records.last().map_or(1, |r| r.seq + 1));
            replay.records
        } else {
            read_records(state).unwrap().records
        };
        let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
        let n = seqs.len() as u64;
        assert!(
            seqs.iter().copied().eq(1..=n),
            "kill {kill}: journal is not 1..={n} without gaps or duplicates: {seqs:?}"
        );
        for r in &records {
            assert_eq!(
                r.detail,
                detail_for(r.seq),
                "kill {kill}: record #{} holds another record's content",
                r.seq
            );
        }
        assert!(
            n >= last_ack,
            "kill {kill}: acknowledged record #{last_ack} lost; journal ends at #{n}"
        );
        assert!(
            n <= last_ack + 1,
            "kill {kill}: journal holds #{n}, beyond the one record in flight after #{last_ack}"
        );
        present = n;
    }
    let count = |what: &str| repairs.iter().filter(|w| w.contains(what)).count();
    eprintln!(
        "{KILLS} kills in {:.1}s: {total_acks} acknowledged appends, {present} records at the end, {killed_in_open} kill(s) \
         before the journal was open; reopens cut {} torn record(s), removed {} half-created file(s), finished {} \
         compaction(s), other repairs: {:?}",
        began.elapsed().as_secs_f64(),
        count("torn record"),
        count("creation was cut short"),
        count("superseded by a compaction") + count("compaction or repair was cut short"),
        repairs
            .iter()
            .filter(|w| !["torn record", "creation was cut short", "compaction"]
                .iter()
                .any(|k| w.contains(k)))
            .collect::<Vec<_>>()
    );
    assert!(
        total_acks > KILLS,
        "too few appends happened to test anything: {total_acks}"
    );
}
