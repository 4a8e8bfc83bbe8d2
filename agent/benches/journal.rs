//! Journal throughput and replay time: `cargo bench -p tartan-agent --bench journal`.
//!
//! Prints appends/s of [`Journal::append`] (write + sync per record) next to a raw `write` +
//! `sync_all` loop over the same frame bytes in the same directory, then the time
//! [`Journal::open`] and [`read_records`] take to replay 10k and 100k records. Set
//! `TARTAN_BENCH_DIR` to measure on another file system than the temp directory's.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};
use tartan_agent::journal::{Journal, JournalOptions, read_records};
use tartan_agent::lock::StateLock;
use tartan_agent::record::{BuildRef, Record};
use tartan_api::{AttemptState, Outcome, Reason};

/// The synced-append loops alternate this many times, each running this long.
const ROUNDS: u32 = 6;
const ROUND: Duration = Duration::from_millis(500);

fn record(i: u64) -> Record {
    Record {
        version: 0,
        seq: 0,
        time: "2026-10-05T02:41:40.304Z".parse().unwrap(),
        build: Some(BuildRef {
            namespace: "ci".into(),
            name: format!("build-{}-mac-build", i / 6),
            uid: "0b6c1f0e-8d5a-4f7e-9a53-2f4c1f2f7c11".into(),
        }),
        attempt: Some(1),
        vm: Some(format!("mb-ci-build-{}-mac-build-c49f62f4", i / 6)),
        from: Some(AttemptState::Booting),
        to: AttemptState::Running,
        reason: Some(Reason::GuestReady),
        detail: "tart exec ready after 13.91s".into(),
        outcome: (i % 6 == 5).then_some(Outcome::Succeeded),
        slot: Some((i % 2) as u8),
        deadline: Some("2026-10-05T03:11:40.304Z".parse().unwrap()),
        max_attempts: None,
        step: None,
        generation: None,
        status: None,
        warm: None,
    }
}

/// The journal's frame for `r`: length, crc32 of length + payload, JSON payload.
fn frame(r: &Record) -> Vec<u8> {
    let payload = serde_json::to_vec(r).unwrap();
    let len = (payload.len() as u32).to_le_bytes();
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&len);
    hasher.update(&payload);
    let mut out = len.to_vec();
    out.extend_from_slice(&hasher.finalize().to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

fn bench_root() -> tempfile::TempDir {
    match std::env::var_os("TARTAN_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir).unwrap(),
        None => tempfile::tempdir().unwrap(),
    }
}

/// Alternates the two loops (journal, raw, journal, raw, ...) so drift in the disk's speed
/// affects both alike. Returns (journal appends, journal time, raw appends, raw time).
fn synced_appends(root: &Path, frames: &[Vec<u8>]) -> (u64, Duration, u64, Duration) {
    let lock = StateLock::acquire(&root.join("append")).unwrap();
    let (mut journal, _) = Journal::open(&lock, JournalOptions::default()).unwrap();
    let mut raw = OpenOptions::new()
        .create_new(true)
        .write(true)
        .open(root.join("raw.bin"))
        .unwrap();
    let (mut n_journal, mut t_journal, mut n_raw, mut t_raw) = (0u64, Duration::ZERO, 0u64, Duration::ZERO);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        while start.elapsed() < ROUND {
            journal.append(&mut record(n_journal)).unwrap();
            n_journal += 1;
        }
        t_journal += start.elapsed();
        let start = Instant::now();
        while start.elapsed() < ROUND {
            raw.write_all(&frames[n_raw as usize % frames.len()]).unwrap();
            raw.sync_all().unwrap();
            n_raw += 1;
        }
        t_raw += start.elapsed();
    }
    (n_journal, t_journal, n_raw, t_raw)
}

fn replay(state: &Path, records: u64) {
    {
        let lock = StateLock::acquire(state).unwrap();
        let (mut journal, _) = Journal::open(&lock, JournalOptions::default()).unwrap();
        let mut i = 0;
        while i < records {
            let mut batch: Vec<Record> = (i..(i + 1000).min(records)).map(record).collect();
            journal.append_batch(&mut batch).unwrap();
            i += batch.len() as u64;
        }
    }
    let bytes: u64 = std::fs::read_dir(state.join("journal"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    let start = Instant::now();
    let read = read_records(state).unwrap();
    let read_time = start.elapsed();
    assert_eq!(read.records.len() as u64, records);
    let lock = StateLock::acquire(state).unwrap();
    let start = Instant::now();
    let (_, replayed) = Journal::open(&lock, JournalOptions::default()).unwrap();
    let open_time = start.elapsed();
    assert_eq!(replayed.records.len() as u64, records);
    println!(
        "replay {records:>6} records ({:.1} MiB): Journal::open {:>8.1} ms, read_records {:>8.1} ms ({:.0} records/s)",
        bytes as f64 / (1 << 20) as f64,
        open_time.as_secs_f64() * 1e3,
        read_time.as_secs_f64() * 1e3,
        records as f64 / open_time.as_secs_f64()
    );
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: then only smoke-run replay.
    let benching = std::env::args().any(|a| a == "--bench");
    let root = bench_root();
    println!("journal benchmark in {}", root.path().display());
    if benching {
        let frames: Vec<Vec<u8>> = (0..64)
            .map(|i| {
                let mut r = record(i);
                r.version = 1;
                r.seq = 1000 + i;
                frame(&r)
            })
            .collect();
        let (n, took, m, raw_took) = synced_appends(root.path(), &frames);
        let journal_rate = n as f64 / took.as_secs_f64();
        let raw_rate = m as f64 / raw_took.as_secs_f64();
        println!(
            "synced appends: Journal::append {journal_rate:.0}/s ({:.3} ms each); raw write+sync_all of the same {}-byte frames {raw_rate:.0}/s ({:.3} ms each); journal/raw = {:.2}",
            1e3 / journal_rate,
            frames[0].len(),
            1e3 / raw_rate,
            journal_rate / raw_rate
        );
        replay(&root.path().join("r10k"), 10_000);
        replay(&root.path().join("r100k"), 100_000);
    } else {
        replay(&root.path().join("r1k"), 1_000);
    }
}
