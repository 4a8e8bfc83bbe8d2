//! Adversary round 6: `Tart::exec_into` with an `OutputConsumer`, as the collect phase uses it to
//! read a guest file (the test report into memory, an artifact into a screened host file). A
//! stand-in `tart` (a shell script) plays the guest. Each test names the promise it checks; a
//! failing test is a finding, tests marked HELD checked something that held.
//!
//! Promises: (2) whatever the guest does, the read stays bounded in time and memory;
//! (3) a clean file comes out byte for byte identical; nothing is lost or reported as success
//! that was not.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tartan_tart::{ExecOptions, OutputConsumer, Tart};

/// A `tart` whose every invocation runs `body` (a shell snippet).
fn fake_tart(dir: &Path, body: &str) -> Tart {
    let program = dir.join("tart");
    common::write_program(&program, &format!("#!/bin/sh\n{body}\n"));
    Tart::new(&program, Some(dir.join("home")))
}

fn options(cap: u64, timeout: Duration) -> ExecOptions {
    ExecOptions {
        log_cap: cap,
        stop_at_cap: true,
        tail_bytes: 2048,
        ..ExecOptions::new("/nonexistent/unused.log", timeout)
    }
}

/// What a consumer saw, shared with the test; optionally slow (a host disk that stalls, a busy
/// host: the consumer writes to the state dir's disk on the runtime's thread).
#[derive(Clone, Default)]
struct Slow {
    seen: Arc<Mutex<Vec<u8>>>,
    delay: Duration,
}

impl OutputConsumer for Slow {
    fn consume(&mut self, data: &[u8]) -> Result<(), String> {
        std::thread::sleep(self.delay);
        self.seen.lock().unwrap().extend_from_slice(data);
        Ok(())
    }
}

/// HELD (promise 3: nothing lost or reported as success that was not).
///
/// Input: a guest file of 64 KiB that `tart exec` writes at once and then exits 0 (the whole file
/// sits in the pipe when tart exits), read by a consumer that takes 400 ms per piece (a stalled
/// disk under the state dir, a loaded 2-core host): 1.6 s of consuming after the exit.
///
/// Suspected: `pump` drains the pipes for at most a second after tart's exit, so the pieces still
/// buffered after a second would be dropped while the exec says exit 0. It held: the drain is
/// polled first by `tokio::time::timeout`, and a pipe holding data is always ready, so the drain
/// only ends once the pipe is empty (the second only bounds a straggler that keeps it open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_a_slow_consumer_gets_all_of_an_exec_that_exited_0() {
    let dir = tempfile::tempdir().unwrap();
    // 64 KiB fits the pipe: tart's writes never block, it exits at once.
    let tart = fake_tart(dir.path(), "head -c 65536 /dev/zero | tr '\\0' x; exit 0");
    let consumer = Slow {
        delay: Duration::from_millis(400),
        ..Slow::default()
    };
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        tart.exec_into(
            "mb-x",
            &["cat".into()],
            Box::new(consumer.clone()),
            &options(1 << 20, Duration::from_secs(30)),
        ),
    )
    .await
    .expect("the exec ended in time")
    .unwrap();
    let seen = consumer.seen.lock().unwrap().len();
    assert_eq!(
        (got.outcome.exit_code, got.outcome.truncated, got.refused.as_deref()),
        (0, false, None)
    );
    assert_eq!(
        seen, 65536,
        "the exec says success (exit 0, not truncated, not refused) but the consumer got {seen} of 65536 bytes \
         (output_bytes {})",
        got.outcome.output_bytes
    );
}

/// FINDING (promise 3: a clean artifact is published byte for byte identical; low).
///
/// Input: a `tart exec` that writes the file on stdout and a line on stderr, and exits 0 (a
/// warning of tart's or of the guest's shell, e.g. `sh: warning: setlocale: LC_ALL: cannot change
/// locale`).
///
/// What happens: the consumer is handed stdout and stderr interleaved, so the stderr line becomes
/// part of the artifact (or of the test report, which then no longer parses) and the read still
/// succeeds. `READ_GUEST_FILE` prints its complaints on stderr and the collect phase reads its
/// stderr tail for the failure message, so stderr is not needed in the file's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stderr_of_an_exec_that_exited_0_ends_up_in_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let tart = fake_tart(
        dir.path(),
        "printf 'PK\\003\\004 the bundle'; echo 'sh: warning: setlocale: LC_ALL: cannot change locale' >&2; exit 0",
    );
    let consumer = Slow::default();
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        tart.exec_into(
            "mb-x",
            &["cat".into()],
            Box::new(consumer.clone()),
            &options(1 << 20, Duration::from_secs(30)),
        ),
    )
    .await
    .expect("the exec ended in time")
    .unwrap();
    assert_eq!(got.outcome.exit_code, 0);
    let seen = consumer.seen.lock().unwrap().clone();
    assert_eq!(
        String::from_utf8_lossy(&seen),
        "PK\u{3}\u{4} the bundle",
        "the file's bytes as the consumer got them"
    );
}

/// HELD (promise 2). A guest that writes a little, then neither writes nor exits: the exec is
/// killed at its timeout, with what came before handed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_a_guest_that_stops_answering_is_killed_at_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let tart = fake_tart(dir.path(), "printf 'start'; exec sleep 600");
    let consumer = Slow::default();
    let started = Instant::now();
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        tart.exec_into(
            "mb-x",
            &["cat".into()],
            Box::new(consumer.clone()),
            &options(1 << 20, Duration::from_secs(2)),
        ),
    )
    .await
    .expect("the exec ended in time");
    assert!(
        matches!(got, Err(tartan_tart::TartError::ExecTimeout { .. })),
        "{got:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
}

/// HELD (promise 2). Endless output on stdout and stderr at once: stopped at the cap, promptly,
/// and the consumer got exactly the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_endless_output_on_both_streams_stops_at_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let tart = fake_tart(dir.path(), "yes err >&2 & yes out");
    let consumer = Slow::default();
    let started = Instant::now();
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        tart.exec_into(
            "mb-x",
            &["cat".into()],
            Box::new(consumer.clone()),
            &options(4 << 20, Duration::from_secs(30)),
        ),
    )
    .await
    .expect("the exec ended in time")
    .unwrap();
    assert!(got.outcome.truncated);
    assert_eq!(consumer.seen.lock().unwrap().len(), 4 << 20);
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
}

/// HELD (promise 2). `tart exec` exits 0 but a process it left behind keeps the pipes open and
/// writes for ever, slowly or as fast as it can: the read ends about a second after the exit,
/// not at the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_a_straggler_holding_the_pipes_does_not_hold_the_read() {
    let dir = tempfile::tempdir().unwrap();
    for body in [
        "printf 'file'; ( while :; do printf z; sleep 0.05; done ) & exit 0",
        "printf 'file'; yes & exit 0",
    ] {
        let tart = fake_tart(dir.path(), body);
        let consumer = Slow::default();
        let started = Instant::now();
        let got = tokio::time::timeout(
            Duration::from_secs(60),
            tart.exec_into(
                "mb-x",
                &["cat".into()],
                Box::new(consumer.clone()),
                &options(1 << 40, Duration::from_secs(30)),
            ),
        )
        .await
        .expect("the exec ended in time")
        .unwrap();
        assert_eq!(got.outcome.exit_code, 0, "{body}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{body}: {:?}",
            started.elapsed()
        );
    }
}
