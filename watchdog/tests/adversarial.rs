//! The watchdog against a hostile deadline folder: a FIFO, symbolic links (to `/dev/zero`, and to
//! a valid file outside the folder), a 1 GiB sparse file, garbage, invalid UTF-8 and truncated
//! JSON next to a real overdue VM. The real VM is still deleted on time, every bad file is
//! recorded once and its VM left alone, and the watchdog still stops promptly on SIGTERM.

mod common;

use common::{Host, plus, secs_f, time_of};
use k8s_openapi::jiff::Timestamp;
use std::fs::File;
use std::os::unix::fs::symlink;
use std::time::Duration;
use tartan_api::deadline::{DeadlineFile, write_deadline_file};

const LIMIT: Duration = Duration::from_secs(30);
/// How late the real VM's deletion may be (rescan 1 s + tart work + a slow CI machine).
const SLACK: f64 = 3.0;

fn mkfifo(path: &std::path::Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_files_in_the_deadline_folder_neither_block_nor_mislead_it() {
    common::tartan_agent(); // build it before any deadline is set
    let mut host = Host::new();
    host.running_vm("mb-real").await;
    // A VM that exists, named by a valid, overdue deadline file outside the folder that a
    // symbolic link in the folder points to: the agent never writes links, so it is not touched.
    host.clone_vm("mb-link");
    let outside = host.root.join("outside");
    let overdue = plus(Timestamp::now(), secs_f(-600.0));
    let linked = DeadlineFile {
        vm: "mb-link".into(),
        namespace: "ci".into(),
        name: "b".into(),
        uid: "u".into(),
        attempt: 1,
        deadline: overdue,
        agent: "a".into(),
        written_at: overdue,
    };
    let target = write_deadline_file(&outside, &linked).unwrap();
    let dir = host.deadlines();
    symlink(&target, dir.join("mb-link.json")).unwrap();
    mkfifo(&dir.join("mb-fifo.json"));
    symlink("/dev/zero", dir.join("mb-zero.json")).unwrap();
    File::create(dir.join("mb-huge.json"))
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    std::fs::write(dir.join("mb-garbage.json"), [0u8, 0xff, 0x13, b'{', 0x80, 0x7f]).unwrap();
    std::fs::write(dir.join("mb-utf8.json"), b"{\"version\":1,\"vm\":\"mb-utf8\xff\xfe\"}").unwrap();
    let whole = std::fs::read(&target).unwrap();
    std::fs::write(dir.join("mb-trunc.json"), &whole[..whole.len() / 2]).unwrap();
    let bad = [
        "mb-fifo",
        "mb-garbage",
        "mb-huge",
        "mb-link",
        "mb-trunc",
        "mb-utf8",
        "mb-zero",
    ];

    let deadline = plus(Timestamp::now(), secs_f(-0.5));
    host.write_deadline("mb-real", deadline);
    let spawned = Timestamp::now();
    let watchdog = host.spawn_watchdog_process(&["--grace", "1s"], "watchdog.log");

    let line = host.wait_line("mb-real", "deleted", LIMIT).await;
    let due = plus(deadline, secs_f(1.0)).max(spawned);
    assert!(
        time_of(&line) <= plus(due, secs_f(SLACK)),
        "mb-real deleted at {}, more than {SLACK}s after it was due and the watchdog started ({due})",
        line.time
    );
    assert!(!host.vm_exists("mb-real"));
    assert!(!host.run_alive("mb-real"));

    // A second VM due later proves that several rescans have passed over the hostile files.
    host.running_vm("mb-later").await;
    host.write_deadline("mb-later", plus(Timestamp::now(), secs_f(1.5)));
    host.wait_line("mb-later", "deleted", LIMIT).await;

    for vm in bad {
        let lines = host.lines_for(vm);
        assert_eq!(lines.len(), 1, "{vm}: exactly one line, not one per rescan: {lines:?}");
        assert_eq!(lines[0].action.as_str(), "bad-deadline-file", "{vm}: {lines:?}");
        assert!(
            dir.join(format!("{vm}.json")).symlink_metadata().is_ok(),
            "{vm}'s file is left in place"
        );
    }
    let detail = |vm: &str| host.lines_for(vm)[0].detail.clone();
    assert!(
        detail("mb-fifo").contains("is a FIFO, not a regular file"),
        "{}",
        detail("mb-fifo")
    );
    assert!(
        detail("mb-zero").contains("is a symbolic link"),
        "{}",
        detail("mb-zero")
    );
    assert!(
        detail("mb-link").contains("is a symbolic link"),
        "{}",
        detail("mb-link")
    );
    assert!(detail("mb-huge").contains("1073741824 bytes"), "{}", detail("mb-huge"));
    assert!(detail("mb-trunc").contains("malformed"), "{}", detail("mb-trunc"));
    assert!(
        host.vm_exists("mb-link"),
        "a VM named only through a symbolic link is not touched"
    );
    assert!(target.exists(), "the file outside the folder is not touched");

    let status = host.terminate(watchdog, Duration::from_secs(10)).await;
    assert!(status.success(), "the watchdog exits cleanly on SIGTERM: {status}");
}
