//! Hostile `tart` output: a stand-in `tart` (a shell script) that prints garbage, floods, hangs
//! or fails with terminal escapes. The driver must answer each with a clear, bounded error —
//! never a panic, never a hang past its timeout, never a child left running.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tartan_tart::{Tart, TartError, Timeouts};

/// A `tart` whose `list` runs `body` (a shell snippet); it writes its pid first.
fn fake_tart(dir: &Path, body: &str) -> (Tart, PathBuf) {
    let program = dir.join("tart");
    let pid_file = dir.join("pid");
    common::write_program(
        &program,
        &format!("#!/bin/sh\necho $$ > '{}'\n{body}\n", pid_file.display()),
    );
    let tart = Tart::new(&program, Some(dir.join("home"))).with_timeouts(Timeouts {
        list: Duration::from_secs(2),
        ..Timeouts::default()
    });
    (tart, pid_file)
}

fn alive(pid_file: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(pid_file) else {
        return false;
    };
    let pid: i32 = text.trim().parse().unwrap();
    // kill(pid, 0): the process exists (a zombie is reaped by the driver's wait).
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

async fn list_with(
    body: &str,
) -> (
    Result<Vec<tartan_tart::VmListEntry>, TartError>,
    Duration,
    PathBuf,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let (tart, pid_file) = fake_tart(dir.path(), body);
    let started = Instant::now();
    let result = tart.list().await;
    (result, started.elapsed(), pid_file, dir)
}

#[tokio::test]
async fn garbage_on_stdout_is_unexpected_output_bounded_and_escaped() {
    let (result, _, _, _dir) = list_with("head -c 65536 /dev/urandom; exit 0").await;
    let e = result.expect_err("random bytes are not tart's JSON");
    assert!(matches!(e, TartError::UnexpectedOutput { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.len() < 40_000,
        "the error quotes at most a bounded part: {} bytes",
        text.len()
    );
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "control characters escaped"
    );
}

#[tokio::test]
async fn json_of_another_shape_is_unexpected_output() {
    for body in [r#"echo '{"vms": []}'"#, r#"echo '[{"Name": 7}]'"#, "echo '['", "true"] {
        let (result, _, _, _dir) = list_with(body).await;
        let e = result.expect_err(body);
        assert!(matches!(e, TartError::UnexpectedOutput { .. }), "{body}: {e}");
    }
}

#[tokio::test]
async fn a_flood_of_output_ends_in_an_error_not_a_hang() {
    // 32 MiB on stdout and stderr at once (a pipe that is not drained would deadlock).
    let (result, took, _, _dir) =
        list_with("head -c 33554432 /dev/zero | tr '\\0' x; head -c 33554432 /dev/zero >&2; exit 0").await;
    let e = result.expect_err("not JSON");
    assert!(matches!(e, TartError::UnexpectedOutput { .. }), "{e}");
    assert!(e.to_string().len() < 40_000, "bounded error text");
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[tokio::test]
async fn a_hanging_tart_is_killed_at_its_timeout() {
    let (result, took, pid_file, _dir) = list_with("exec sleep 300").await;
    let e = result.expect_err("no answer");
    assert!(e.is_timeout(), "{e}");
    assert!(took < Duration::from_secs(5), "the 2 s timeout held: {took:?}");
    let until = Instant::now() + Duration::from_secs(5);
    while alive(&pid_file) {
        assert!(
            Instant::now() < until,
            "the hung tart is still running 5 s after its timeout"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_failure_with_escapes_and_nul_is_a_bounded_failed_error() {
    let (result, _, _, _dir) =
        list_with("printf 'Error: \\033[31mboom\\000\\033[0m\\n'; head -c 100000 /dev/zero | tr '\\0' e >&2; exit 1")
            .await;
    let e = result.expect_err("exit 1");
    assert!(matches!(e, TartError::Failed { code: 1, .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.len() < 10_000,
        "stderr is capped in the error: {} bytes",
        text.len()
    );
}

/// `exec_capture` keeps the output in memory: the guest's output (stdout and stderr) comes back
/// whole up to the bound, is counted past it, and never reaches a file; the outcome's tail is
/// tart's stderr only, so an error message built from it cannot carry the output; a timeout
/// kills the exec and says nothing of the output either.
#[tokio::test]
async fn a_captured_exec_keeps_its_output_in_memory_only() {
    let dir = tempfile::tempdir().unwrap();
    let (tart, _) = fake_tart(
        dir.path(),
        r#"case $3 in
  hang) printf 'secret-before-hang'; sleep 30 ;;
  *) printf 'out-secret-1 '; printf 'tart: warning\n' >&2; printf 'out-secret-2' ;;
esac"#,
    );
    let argv = |what: &str| vec![what.to_string()];
    let options = tartan_tart::CaptureOptions {
        max_bytes: 1 << 20,
        timeout: Duration::from_secs(10),
        stop_at_cap: false,
    };
    let got = tart.exec_capture("mb-x", &argv("print"), None, &options).await.unwrap();
    assert_eq!(got.outcome.exit_code, 0);
    // Both streams, in arrival order (which two pipes do not fix).
    let text = String::from_utf8(got.output).unwrap();
    assert_eq!(text.len(), 39, "{text}");
    assert!(
        text.contains("tart: warning\n") && text.replace("tart: warning\n", "") == "out-secret-1 out-secret-2",
        "{text}"
    );
    assert_eq!(got.outcome.tail, "tart: warning\n");
    assert!(!got.outcome.truncated);
    let small = tartan_tart::CaptureOptions {
        max_bytes: 5,
        ..options
    };
    let got = tart.exec_capture("mb-x", &argv("print"), None, &small).await.unwrap();
    assert_eq!((got.output.len(), got.outcome.truncated), (5, true));
    assert_eq!(got.outcome.output_bytes, 39);
    let quick = tartan_tart::CaptureOptions {
        timeout: Duration::from_millis(500),
        ..options
    };
    let e = tart
        .exec_capture("mb-x", &argv("hang"), None, &quick)
        .await
        .unwrap_err();
    assert!(matches!(e, TartError::ExecTimeout { .. }), "{e}");
    assert!(!e.to_string().contains("secret"), "{e}");
    // Nothing but the fake tart and its pid file was written.
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, ["pid", "tart"]);
}

/// What an [`exec_into`](Tart::exec_into) consumer saw, shared with the test.
#[derive(Clone, Default)]
struct Seen(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl tartan_tart::OutputConsumer for Seen {
    fn consume(&mut self, data: &[u8]) -> Result<(), String> {
        let mut seen = self.0.lock().unwrap();
        seen.extend_from_slice(data);
        match seen.windows(6).any(|w| w == b"FORBID") {
            true => Err("the output holds FORBID".into()),
            false => Ok(()),
        }
    }
}

/// `exec_into` hands the output to the consumer only (no file is written), up to the cap; a
/// consumer's refusal stops an exec whose guest would go on for ever, at once, and says why.
#[tokio::test]
async fn an_exec_into_a_consumer_writes_nothing_and_stops_when_it_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let (tart, _) = fake_tart(
        dir.path(),
        r#"case $3 in
  forbid) printf 'before '; printf 'FORBID'; while :; do printf 'after'; sleep 0.01; done ;;
  *) printf 'all of it' ;;
esac"#,
    );
    let options = |cap| tartan_tart::ExecOptions {
        log_cap: cap,
        ..tartan_tart::ExecOptions::new(dir.path().join("unused.log"), Duration::from_secs(20))
    };
    let seen = Seen::default();
    let got = tart
        .exec_into("mb-x", &["print".into()], Box::new(seen.clone()), &options(1 << 20))
        .await
        .unwrap();
    assert_eq!((got.outcome.exit_code, got.refused), (0, None));
    assert_eq!(seen.0.lock().unwrap().as_slice(), b"all of it");
    let capped = Seen::default();
    let got = tart
        .exec_into("mb-x", &["print".into()], Box::new(capped.clone()), &options(3))
        .await
        .unwrap();
    assert!(got.outcome.truncated);
    assert_eq!(capped.0.lock().unwrap().as_slice(), b"all");
    let started = Instant::now();
    let got = tart
        .exec_into("mb-x", &["forbid".into()], Box::new(Seen::default()), &options(1 << 20))
        .await
        .unwrap();
    assert_eq!(got.refused.as_deref(), Some("the output holds FORBID"));
    assert_eq!((got.outcome.exit_code, got.outcome.truncated), (-1, false));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the refused exec was not stopped"
    );
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, ["pid", "tart"]);
}
