//! Hostile `tart` output: a stand-in `tart` (a shell script) that prints garbage, floods, hangs
//! or fails with terminal escapes. The driver must answer each with a clear, bounded error —
//! never a panic, never a hang past its timeout, never a child left running.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tartan_tart::{Tart, TartError, Timeouts};

/// A `tart` whose `list` runs `body` (a shell snippet); it writes its pid first.
fn fake_tart(dir: &Path, body: &str) -> (Tart, PathBuf) {
    let program = dir.join("tart");
    let pid_file = dir.join("pid");
    std::fs::write(
        &program,
        format!("#!/bin/sh\necho $$ > '{}'\n{body}\n", pid_file.display()),
    )
    .unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
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
