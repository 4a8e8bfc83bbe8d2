//! One journal append fails mid-attempt (a transient disk error), then the journal can be written
//! again. The agent stops and deletes the VM (issue 10), but must not then leave the attempt open
//! for ever: once the journal works, the attempt is retired, the slot freed, the finalizer
//! released and the pipeline told. The failure is real: the agent inherits SIGXFSZ ignored from
//! this test, and a file-size limit (`prlimit`, as root) on the agent at the current journal
//! file's size makes the next append fail with EFBIG; the limit is lifted once the agent reacted.

use serde_json::json;
use std::path::Path;
use std::time::Duration;
use tartan_api::AttemptState;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for};

/// Sets the soft RLIMIT_FSIZE of process `pid` (`None`: unlimited, up to the hard limit).
fn set_file_size_limit(pid: i32, soft: Option<u64>) {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit on plain local structs; reading first, then setting.
    unsafe {
        assert_eq!(
            libc::prlimit(pid, libc::RLIMIT_FSIZE, std::ptr::null(), &mut old),
            0,
            "prlimit read of {pid}"
        );
        let new = libc::rlimit {
            rlim_cur: soft.map_or(old.rlim_max, |s| s.min(old.rlim_max)),
            rlim_max: old.rlim_max,
        };
        assert_eq!(
            libc::prlimit(pid, libc::RLIMIT_FSIZE, &new, std::ptr::null_mut()),
            0,
            "prlimit set of {pid} (needs root)"
        );
    }
}

/// The size of the newest journal file: the one the next append goes to.
fn current_journal_size(state: &Path) -> (String, u64) {
    let mut files: Vec<_> = std::fs::read_dir(state.join("journal"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".journal"))
        .collect();
    files.sort_by_key(|e| e.file_name());
    let newest = files.last().expect("a journal file");
    (
        newest.file_name().to_string_lossy().to_string(),
        newest.metadata().unwrap().len(),
    )
}

// scenario: journal-blip
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failed_journal_append_mid_attempt_does_not_hold_the_build_and_slot_for_ever() {
    // Inherited by every process the stack starts: a file-size limit then fails writes with
    // EFBIG instead of killing the writer.
    // SAFETY: setting a signal disposition to SIG_IGN.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let mut s = Stack::new("journal-blip").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let mut params = s.build_params(true);
    params.push(("timeout-seconds", json!("600")));
    s.create_run("build-1", &params, None).await;
    s.wait_builds_started(1, Duration::from_secs(60)).await;
    let (vm, _) = s.admitted_vm("agent-a").await;
    s.wait_journal("agent-a", "a1 Running", Duration::from_secs(30), |r| {
        r.attempt == Some(1) && r.to == AttemptState::Running
    })
    .await;

    // The harness's own handle: scanning /proc for the agent's executable also finds its children
    // between their fork and their exec of tart-double (seen on a loaded CI machine).
    let pid = s.agent_pid("agent-a").expect("agent-a runs") as i32;
    let (file, size) = current_journal_size(&s.agent("agent-a").state_dir);
    eprintln!("[e2e] agent pid {pid}: limiting its file size to {size} bytes (journal {file})");
    set_file_size_limit(pid, Some(size));
    s.open_gate();
    // The next append (Running -> Collecting) fails; the agent stops and deletes the VM anyway.
    wait_for(
        &format!("the agent to delete {vm} after the failed append"),
        Duration::from_secs(30),
        || {
            (!s.vms("agent-a").contains(&vm))
                .then_some(())
                .ok_or(format!("VMs {:?}", s.vms("agent-a")))
        },
    )
    .await;
    set_file_size_limit(pid, None);
    let last = s
        .journal("agent-a")
        .into_iter()
        .rfind(|r| r.attempt == Some(1))
        .expect("a1 is journaled");
    eprintln!("[e2e] the journal can be written again; a1's last record: {last}");
    assert_eq!(
        last.to,
        AttemptState::Running,
        "the failed append was Running's successor"
    );

    // The journal works again: the attempt must not stay open (slot held, finalizer on, the
    // pipeline waiting until its timeout) until someone restarts the agent by hand.
    let retired = s
        .wait_journal(
            "agent-a",
            "build-1 a1 Retired once the journal works again",
            Duration::from_secs(60),
            |r| {
                r.build.as_ref().is_some_and(|b| b.name == "build-1")
                    && r.attempt == Some(1)
                    && r.to == AttemptState::Retired
            },
        )
        .await;
    eprintln!("[e2e] journaled: {retired}");
    s.create_run("build-2", &s.build_params(false), None).await;
    s.wait_run("build-2", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    s.wait_run_ended("build-1", Duration::from_secs(60)).await;
    s.finish().await;
}
