//! Steps as detached guest jobs ([`tartan_agent::host::guest_job`]), for real against
//! `tart-double` (whose "guest" is the VM folder on this host), and the guest scripts run by `sh`.

mod host_common;

use host_common::{IMAGE, Rig};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tart_double::{Fault, Faults};
use tartan_agent::host::guest_job::{
    FollowConfig, Job, JobEnd, JobError, JobState, parse_poll, parse_start, poll_argv, run_or_attach, sidecar_path,
    start_argv,
};
use tartan_tart::{RunOptions, RunningVm, log_cap_note};

fn cfg() -> FollowConfig {
    FollowConfig {
        poll_interval: Duration::from_millis(50),
        exec_timeout: Duration::from_secs(10),
        unresponsive_limit: Duration::from_secs(30),
        no_pid_limit: Duration::from_secs(2),
        chunk_bytes: 1 << 20,
        log_cap: 1 << 20,
        tail_bytes: 4096,
        ..FollowConfig::default()
    }
}

fn sh(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script.into()]
}

/// Waits (polling every 20 ms) until `cond` holds; panics naming `what` after `within`.
async fn wait_for(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "{what} did not happen within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A cloned, running VM of the double; the rig's drop kills its `tart run`.
async fn vm(rig: &Rig, name: &str) -> RunningVm {
    rig.tart.clone_vm(IMAGE, name).await.unwrap();
    let mut run = rig.tart.run(name, &RunOptions::default()).unwrap();
    run.wait_until_running(Duration::from_secs(30)).await.unwrap();
    run
}

/// Kills on drop the processes whose pids the given files hold (steps left running in the guest).
struct Reaper(Vec<PathBuf>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for f in &self.0 {
            if let Some(pid) = std::fs::read_to_string(f)
                .ok()
                .and_then(|t| t.trim().parse::<i32>().ok())
            {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
        }
    }
}

struct Step<'a> {
    rig: &'a Rig,
    job: Job,
    log: PathBuf,
}

impl Step<'_> {
    fn new<'a>(rig: &'a Rig, vm: &str, index: usize, name: &str, argv: Vec<String>) -> Step<'a> {
        let log = rig.state.path().join("logs").join(vm).join(format!("{index}.log"));
        std::fs::create_dir_all(log.parent().unwrap()).unwrap();
        Step {
            rig,
            job: Job::new(vm, index, name, argv),
            log,
        }
    }

    /// The job's folder in the "guest" (the VM folder).
    fn guest(&self) -> PathBuf {
        self.rig.vm_dir(&self.job.vm).join(&self.job.dir)
    }

    fn guest_log(&self) -> Vec<u8> {
        std::fs::read(self.guest().join("out.log")).unwrap()
    }

    fn host_log(&self) -> Vec<u8> {
        std::fs::read(&self.log).unwrap()
    }

    async fn run(&self, cfg: &FollowConfig) -> Result<JobEnd, JobError> {
        run_or_attach(&self.rig.tart, &self.job, &self.log, cfg).await
    }
}

#[tokio::test]
async fn output_and_exit_codes_come_through_even_before_the_guest_answers() {
    let rig = Rig::new();
    // The guest agent answers only after a second: the first start calls fail and are retried.
    let mut faults = Faults::default();
    faults.vms.insert(
        "mb-codes".into(),
        Fault {
            boot_delay_secs: Some(1.0),
            ..Fault::default()
        },
    );
    rig.set_faults(&faults);
    let _run = vm(&rig, "mb-codes").await;
    let cases: [(&str, i32, &str); 3] = [
        ("echo out; echo err >&2; printf 'no newline'", 0, "out\nerr\nno newline"),
        ("echo failing; exit 3", 3, "failing\n"),
        ("echo dying; kill -TERM $$", 128 + 15, "dying\n"),
    ];
    for (i, (script, code, output)) in cases.into_iter().enumerate() {
        let step = Step::new(&rig, "mb-codes", i, "build", sh(script));
        let end = step.run(&cfg()).await.unwrap();
        assert_eq!(end.exit_code, code, "{script}");
        assert_eq!(end.tail, output, "{script}");
        assert_eq!(end.output_bytes, output.len() as u64);
        assert!(!end.truncated && !end.attached, "{end:?}");
        assert_eq!(step.host_log(), output.as_bytes(), "{script}");
        assert_eq!(step.guest_log(), output.as_bytes(), "{script}");
        assert_eq!(
            std::fs::read_to_string(step.guest().join("exit")).unwrap(),
            format!("{code}\n")
        );
    }
}

#[tokio::test]
async fn hostile_argv_runs_verbatim_and_writes_nothing_outside() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-hostile").await;
    let words = [
        "$(touch pwned)",
        "`touch pwned`",
        "'\"",
        "a\nb",
        "--",
        "; touch pwned &&",
        "$HOME",
        "*",
        "-a",
        "",
    ];
    let mut argv = vec!["printf".to_string(), "[%s]".to_string()];
    argv.extend(words.iter().map(|w| w.to_string()));
    let before: Vec<_> = std::fs::read_dir(rig.home.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    let step = Step::new(&rig, "mb-hostile", 0, "../../escape me", argv);
    let end = step.run(&cfg()).await.unwrap();
    let expected: String = words.iter().map(|w| format!("[{w}]")).collect();
    assert_eq!((end.exit_code, end.tail.as_str()), (0, expected.as_str()));
    assert_eq!(step.host_log(), expected.as_bytes());
    // The job folder is where job_dir says, inside the VM's .tartan folder.
    assert_eq!(step.job.dir, ".tartan/mb-hostile/00-______escape_me");
    assert!(step.guest().join("exit").is_file());
    // Nothing was touched: no `pwned` anywhere in the VM folder or the home, no new home entry.
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                walk(&e.path(), found);
            }
            found.push(e.path());
        }
    }
    let mut all = Vec::new();
    walk(rig.home.path(), &mut all);
    assert!(!all.iter().any(|p| p.to_string_lossy().contains("pwned")), "{all:?}");
    let after: Vec<_> = std::fs::read_dir(rig.home.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(before, after);
    let tartan: Vec<_> = std::fs::read_dir(rig.vm_dir("mb-hostile").join(".tartan/mb-hostile"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(tartan, ["00-______escape_me"]);

    // A program name that a shell would take for a builtin, an option or an assignment is looked
    // up as a program, as tart exec would: not found.
    for (i, argv0) in ["exit", "--", "-a", "A=b", "exec"].into_iter().enumerate() {
        let step = Step::new(&rig, "mb-hostile", i + 1, "odd", vec![argv0.into(), "3".into()]);
        let end = step.run(&cfg()).await.unwrap();
        assert_eq!(end.exit_code, 127, "{argv0}: {end:?}");
        assert!(end.tail.contains(argv0), "{argv0}: {end:?}");
    }
    let mut all = Vec::new();
    walk(rig.home.path(), &mut all);
    assert!(!all.iter().any(|p| p.to_string_lossy().contains("pwned")), "{all:?}");
}

#[tokio::test]
async fn a_dropped_follower_loses_nothing_and_a_new_one_continues_at_the_saved_offset() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-reattach").await;
    // 2000 lines, then wait for `go` (made by the test once the first follower is dropped), then more.
    let script = "i=0; while [ $i -lt 2000 ]; do echo \"line $i\"; i=$((i+1)); done
        while [ ! -f go ]; do sleep 0.02; done
        i=0; while [ $i -lt 500 ]; do echo \"after $i\"; i=$((i+1)); done; exit 4";
    let step = Step::new(&rig, "mb-reattach", 0, "long", sh(script));
    let small = FollowConfig {
        chunk_bytes: 1000,
        ..cfg()
    };
    {
        let follower = step.run(&small);
        tokio::pin!(follower);
        let log = step.log.clone();
        let seen = async {
            wait_for("the host log to grow past 5000 bytes", Duration::from_secs(30), || {
                std::fs::metadata(&log).is_ok_and(|m| m.len() > 5000)
            })
            .await
        };
        tokio::select! {
            r = &mut follower => panic!("the follower ended before it was dropped: {r:?}"),
            () = seen => {}
        }
        // Dropped here, mid-step (possibly mid-poll).
    }
    let sidecar = std::fs::read_to_string(sidecar_path(&step.log)).unwrap();
    let saved: u64 = sidecar.split(' ').nth(3).unwrap().trim().parse().unwrap();
    assert!(saved > 5000, "{sidecar}");
    assert_eq!(std::fs::metadata(&step.log).unwrap().len(), saved, "{sidecar}");
    // The job went on without a follower.
    std::fs::write(rig.vm_dir("mb-reattach").join("go"), "").unwrap();
    let end = step.run(&small).await.unwrap();
    assert!(end.attached, "{end:?}");
    assert_eq!(end.exit_code, 4);
    let guest = step.guest_log();
    assert!(guest.ends_with(b"after 499\n"));
    assert_eq!(step.host_log(), guest, "host log differs from the guest log");
    assert_eq!(end.output_bytes, guest.len() as u64);
    assert_eq!(end.tail.as_bytes(), &guest[guest.len() - 4096..]);
}

#[tokio::test]
async fn a_second_start_does_not_run_the_step_again() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-once").await;
    let step = Step::new(
        &rig,
        "mb-once",
        0,
        "count",
        sh("n=$(cat counter 2>/dev/null || echo 0); echo $((n+1)) > counter; echo counted"),
    );
    let first = step.run(&cfg()).await.unwrap();
    assert!(!first.attached);
    let again = step.run(&cfg()).await.unwrap();
    assert!(again.attached, "{again:?}");
    assert_eq!((again.exit_code, again.tail.as_str()), (0, "counted\n"));
    assert_eq!(
        std::fs::read_to_string(rig.vm_dir("mb-once").join("counter")).unwrap(),
        "1\n"
    );
    // The second follower found everything logged: nothing repeats.
    assert_eq!(step.host_log(), b"counted\n");
    // An older agent's sidecar (no `started`) and a guest without the job folder: started anew,
    // its output following what is logged instead of being taken for what was read already.
    std::fs::remove_dir_all(step.guest()).unwrap();
    let sidecar = sidecar_path(&step.log);
    let old = std::fs::read_to_string(&sidecar).unwrap().replace(" started\n", "\n");
    std::fs::write(&sidecar, old).unwrap();
    let fresh = step.run(&cfg()).await.unwrap();
    assert!(!fresh.attached, "{fresh:?}");
    assert_eq!(
        std::fs::read_to_string(rig.vm_dir("mb-once").join("counter")).unwrap(),
        "2\n"
    );
    assert_eq!(step.host_log(), b"counted\ncounted\n");
}

#[tokio::test]
async fn output_beyond_the_cap_is_capped_on_the_host_with_the_right_tail() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-cap").await;
    let step = Step::new(
        &rig,
        "mb-cap",
        0,
        "loud",
        sh("i=0; while [ $i -lt 3000 ]; do echo \"line $i\"; i=$((i+1)); done"),
    );
    let capped = FollowConfig {
        log_cap: 1000,
        chunk_bytes: 300,
        tail_bytes: 200,
        ..cfg()
    };
    // Something already in the log (the checkout's two commands share one) stays in front.
    std::fs::write(&step.log, "earlier\n").unwrap();
    let end = step.run(&capped).await.unwrap();
    let guest = step.guest_log();
    assert!(guest.len() > 20_000);
    assert!(end.truncated && end.exit_code == 0, "{end:?}");
    assert_eq!(end.output_bytes, guest.len() as u64);
    assert_eq!(end.tail.as_bytes(), &guest[guest.len() - 200..]);
    let mut expected = b"earlier\n".to_vec();
    expected.extend(&guest[..1000]);
    expected.extend(log_cap_note(1000).as_bytes());
    assert_eq!(
        String::from_utf8(step.host_log()).unwrap(),
        String::from_utf8(expected).unwrap()
    );
    // A re-attach after the end changes nothing.
    let again = step.run(&capped).await.unwrap();
    assert!(again.attached && again.truncated && again.tail == end.tail, "{again:?}");
    assert_eq!(step.host_log().len(), 8 + 1000 + log_cap_note(1000).len());
}

#[tokio::test]
async fn a_killed_job_is_reported_as_vanished() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-vanish").await;
    let step = Step::new(
        &rig,
        "mb-vanish",
        0,
        "victim",
        sh("echo $$ > step.pid; echo started; exec sleep 60"),
    );
    let _reaper = Reaper(vec![rig.vm_dir("mb-vanish").join("step.pid")]);
    let config = cfg();
    let follower = step.run(&config);
    tokio::pin!(follower);
    let pid_file = step.guest().join("pid");
    let log = step.log.clone();
    let started = async {
        wait_for("the job to start and log", Duration::from_secs(30), || {
            pid_file.is_file() && std::fs::read(&log).is_ok_and(|b| b == b"started\n")
        })
        .await
    };
    tokio::select! {
        r = &mut follower => panic!("the follower ended early: {r:?}"),
        () = started => {}
    }
    let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(30), follower)
        .await
        .expect("the follower noticed")
        .unwrap_err();
    assert!(matches!(err, JobError::Vanished { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("mb-vanish") && msg.contains("\"victim\"") && msg.contains(&format!("pid {pid} is gone")),
        "{msg}"
    );
}

#[tokio::test]
async fn a_folder_without_a_pid_was_never_launched_after_the_bound() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-nopid").await;
    let step = Step::new(&rig, "mb-nopid", 0, "never", sh("echo never"));
    // As if the guest died between the start's mkdir and the launch.
    std::fs::create_dir_all(step.guest()).unwrap();
    let t0 = Instant::now();
    let err = step.run(&cfg()).await.unwrap_err();
    assert!(matches!(err, JobError::NeverLaunched { .. }), "{err}");
    assert!(err.to_string().contains("no pid file"), "{err}");
    assert!(t0.elapsed() >= cfg().no_pid_limit, "{:?}", t0.elapsed());
    assert!(!step.guest().join("out.log").exists());
}

#[tokio::test]
async fn a_vm_stopped_mid_step_gives_the_not_running_error() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-stop").await;
    let step_pid = rig.vm_dir("mb-stop").join("step.pid");
    let _reaper = Reaper(vec![step_pid.clone()]);
    let step = Step::new(&rig, "mb-stop", 0, "long", sh("echo $$ > step.pid; exec sleep 60"));
    let config = cfg();
    let follower = step.run(&config);
    tokio::pin!(follower);
    let started = wait_for("the step to start", Duration::from_secs(30), || step_pid.is_file());
    tokio::select! {
        r = &mut follower => panic!("the follower ended early: {r:?}"),
        () = started => {}
    }
    rig.tart.stop("mb-stop", Duration::from_secs(5)).await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(30), follower)
        .await
        .expect("the follower noticed")
        .unwrap_err();
    match &err {
        JobError::VmGone { vm, step, source } => {
            assert_eq!((vm.as_str(), step.as_str()), ("mb-stop", "long"));
            assert!(source.is_not_running(), "{source}");
        }
        other => panic!("expected VmGone, got {other}"),
    }
    // A VM that does not exist says so as well.
    let ghost = Step::new(&rig, "mb-ghost", 0, "x", sh("true"));
    match ghost.run(&cfg()).await.unwrap_err() {
        JobError::VmGone { source, .. } => assert!(source.is_vm_missing(), "{source}"),
        other => panic!("expected VmGone, got {other}"),
    }
}

#[tokio::test]
async fn a_guest_that_stops_answering_is_given_up_after_the_limit_and_the_job_survives() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-hang").await;
    let go = rig.vm_dir("mb-hang").join("go");
    let step = Step::new(
        &rig,
        "mb-hang",
        0,
        "patient",
        sh("echo waiting; while [ ! -f go ]; do sleep 0.02; done; echo done"),
    );
    let quick = FollowConfig {
        exec_timeout: Duration::from_secs(1),
        unresponsive_limit: Duration::from_secs(3),
        ..cfg()
    };
    let follower = step.run(&quick);
    tokio::pin!(follower);
    let log = step.log.clone();
    let waiting = wait_for("the step's first line", Duration::from_secs(30), || {
        std::fs::read(&log).is_ok_and(|b| b == b"waiting\n")
    });
    tokio::select! {
        r = &mut follower => panic!("the follower ended early: {r:?}"),
        () = waiting => {}
    }
    let mut hang = Faults::default();
    hang.vms.insert(
        "mb-hang".into(),
        Fault {
            exec_hangs: Some(true),
            ..Fault::default()
        },
    );
    rig.set_faults(&hang);
    let t0 = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(30), follower)
        .await
        .expect("the follower gave up")
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, JobError::Unresponsive { .. }), "{msg}");
    assert!(
        msg.contains("mb-hang") && msg.contains("\"patient\"") && msg.contains("did not finish within 1s"),
        "{msg}"
    );
    assert!(t0.elapsed() >= Duration::from_secs(2), "{:?}", t0.elapsed());
    // The guest answers again: the job was never touched, a new follower sees it through.
    rig.set_faults(&Faults::default());
    std::fs::write(&go, "").unwrap();
    let end = step.run(&quick).await.unwrap();
    assert!(end.attached && end.exit_code == 0, "{end:?}");
    assert_eq!(step.host_log(), b"waiting\ndone\n");
}

/// The scripts alone, run by this host's `sh` in a folder standing for the guest's home.
#[test]
fn the_poll_script_tells_every_state_and_slices_the_log() {
    let home = tempfile::tempdir().unwrap();
    let run = |argv: Vec<String>| -> Vec<u8> {
        let out = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .current_dir(home.path())
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
        out.stdout
    };
    let dir = ".tartan/mb-x/00-s";
    let poll = |from: u64, max: u64| parse_poll(&run(poll_argv(dir, from, max)), from, max).unwrap();
    assert_eq!(poll(0, 10).state, JobState::Absent);
    let abs = home.path().join(dir);
    std::fs::create_dir_all(&abs).unwrap();
    assert_eq!(poll(0, 10).state, JobState::Starting);
    // A pid that names no process (a finished child of ours, reaped), then garbage.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    std::fs::write(abs.join("pid"), format!("{dead}\n")).unwrap();
    assert_eq!(poll(0, 10).state, JobState::Vanished(Some(dead)));
    // A zombie (exited, not yet reaped: an orphan under an init that does not reap) is gone too.
    let mut zombie = std::process::Command::new("true").spawn().unwrap();
    let zpid = zombie.id();
    let t0 = Instant::now();
    loop {
        let stat = std::process::Command::new("ps")
            .args(["-o", "stat=", "-p", &zpid.to_string()])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&stat.stdout).trim_start().starts_with('Z') {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{zpid} never became a zombie");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::write(abs.join("pid"), format!("{zpid}\n")).unwrap();
    assert_eq!(poll(0, 10).state, JobState::Vanished(Some(zpid)));
    zombie.wait().unwrap();
    std::fs::write(abs.join("pid"), "x y\n").unwrap();
    assert_eq!(poll(0, 10).state, JobState::Vanished(None));
    std::fs::write(abs.join("pid"), format!("{}\n", std::process::id())).unwrap();
    std::fs::write(abs.join("out.log"), b"0123456789").unwrap();
    let r = poll(0, 4);
    assert_eq!((r.state, r.size, r.bytes), (JobState::Running, 10, b"0123".to_vec()));
    let r = poll(8, 4);
    assert_eq!((r.size, r.bytes), (10, b"89".to_vec()));
    assert_eq!(poll(10, 4).bytes, b"");
    assert_eq!(poll(20, 4).bytes, b"");
    assert_eq!(poll(3, 0).bytes, b"");
    std::fs::write(abs.join("exit"), "7\n").unwrap();
    let r = poll(5, 100);
    assert_eq!((r.state, r.bytes), (JobState::Exited(7), b"56789".to_vec()));
    // The size at the step's exit bounds an exited job's output (macOS's wc pads it with blanks);
    // a damaged size file is ignored.
    std::fs::write(abs.join("size"), "       6\n").unwrap();
    let r = poll(2, 100);
    assert_eq!((r.state, r.size, r.bytes), (JobState::Exited(7), 6, b"2345".to_vec()));
    assert_eq!(poll(6, 100).bytes, b"");
    std::fs::write(abs.join("size"), "6 x\n").unwrap();
    assert_eq!(poll(2, 100).size, 10);

    // The start script: the first start launches, the second finds the folder.
    let job = Job::new("mb-x", 1, "s", sh("echo $0 \"$@\"; printf '%s' \"$HOME\" > /dev/null"));
    let first = parse_start(&run(start_argv(&job))).unwrap();
    let second = parse_start(&run(start_argv(&job))).unwrap();
    assert_eq!(
        (first, second),
        (
            tartan_agent::host::guest_job::Started::Now,
            tartan_agent::host::guest_job::Started::Before
        )
    );
    let exit = home.path().join(&job.dir).join("exit");
    let t0 = Instant::now();
    while !exit.is_file() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the job never wrote its exit file"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(std::fs::read_to_string(&exit).unwrap(), "0\n");
    assert_eq!(
        std::fs::read_to_string(home.path().join(&job.dir).join("out.log")).unwrap(),
        "sh\n"
    );
    // A folder that cannot be made is a refusal with the guest's reason.
    std::fs::write(home.path().join(".tartan/mb-y"), "a file where a folder should be").unwrap();
    let blocked = Job::new("mb-y", 0, "s", sh("true"));
    match parse_start(&run(start_argv(&blocked))).unwrap() {
        tartan_agent::host::guest_job::Started::Refused(why) => assert!(why.contains("mb-y"), "{why}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A step that exits 0 but leaves a child behind that keeps writing to the step's output (a log
/// stream, a daemon): the step ends when its own process does, as `tart exec` did, with the
/// output written until then. The follower used to chase the growing log until the child
/// stopped (for ever here) and, when it caught up between two writes, to fail the step with
/// "now it reads … with N bytes" in the tail read.
#[tokio::test]
async fn a_step_whose_background_child_keeps_writing_ends_when_the_step_exits() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-bg").await;
    let step = Step::new(
        &rig,
        "mb-bg",
        0,
        "build",
        // The child starts writing once the step's exit is recorded.
        sh("(while [ ! -f .tartan/mb-bg/00-build/exit ]; do sleep 0.01; done; \
            while :; do echo late; sleep 0.02; done) & echo $! > bg.pid; echo main"),
    );
    let _reaper = Reaper(vec![rig.vm_dir("mb-bg").join("bg.pid")]);
    let end = tokio::time::timeout(Duration::from_secs(15), step.run(&cfg()))
        .await
        .expect("the follower still chases the child's output 15 s after the step exited")
        .unwrap();
    assert_eq!(end.exit_code, 0, "{end:?}");
    assert_eq!(end.tail, "main\n");
    assert_eq!(end.output_bytes, 5);
    assert_eq!(step.host_log(), b"main\n");
    // The child is still writing: the guest log goes on growing past what the step wrote.
    wait_for("the child's late output", Duration::from_secs(10), || {
        step.guest_log().len() > 5
    })
    .await;
}

/// A later step that empties the guest's dot-folders (`rm -rf ~/.tartan`, a home clean-up) takes
/// the earlier steps' guard folders with it. A restarted agent that re-attaches to the step the
/// journal names (it died after the step exited, before the next step's start was journaled)
/// used to find no folder and start the step a second time. The sidecar records the start the
/// guest confirmed: the job is followed, not started, and reported vanished.
#[tokio::test]
async fn a_deleted_guard_folder_does_not_run_the_step_again_on_reattach() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-swept").await;
    let step = Step::new(&rig, "mb-swept", 0, "count", sh("echo run >> runs; echo counted"));
    assert_eq!(step.run(&cfg()).await.unwrap().exit_code, 0);
    // A later step sweeps the dot-folders of the guest user's home.
    std::fs::remove_dir_all(rig.vm_dir("mb-swept").join(".tartan")).unwrap();
    // The restarted agent follows the step the journal names again.
    let again = step.run(&cfg()).await;
    let runs = std::fs::read_to_string(rig.vm_dir("mb-swept").join("runs")).unwrap();
    assert_eq!(runs, "run\n", "the step ran again: {again:?}");
    assert!(matches!(again, Err(JobError::Vanished { .. })), "{again:?}");
}

/// The guest agent SIGKILLs the exec's direct child when the `tart exec` client dies (the agent
/// killed mid-start). Once the job folder exists, that kill must not keep the job from launching:
/// a resumed agent finds the folder, never starts the step again, and would otherwise wait for a
/// pid that never comes and fail the step as vanished. A `mkdir` on PATH stands for the moment:
/// it makes the folder, then SIGKILLs the start script (the process running `START_SCRIPT`, whose
/// first line it finds in the ancestors' argv).
#[test]
fn a_start_killed_right_after_making_its_folder_still_launches_the_job() {
    let home = tempfile::tempdir().unwrap();
    let bin = tempfile::tempdir().unwrap();
    let wrapper = bin.path().join("mkdir");
    tartan_testkit::write_program(
        &wrapper,
        r#"#!/bin/sh
PATH=${PATH#*:} mkdir "$@" || exit $?
[ "$1" = -p ] && exit 0
p=$PPID
while [ "$p" -gt 1 ]; do
  if tr '\0' '\n' </proc/$p/cmdline | grep -qx 'exec 2>/dev/null'; then kill -9 "$p"; exit 0; fi
  p=$(sed 's/.*) . \([0-9]*\) .*/\1/' /proc/$p/stat)
done
echo "no start script among the ancestors of $$" >&2
exit 1
"#,
    );
    let job = Job::new("mb-killed-start", 0, "s", sh("echo launched"));
    let argv = start_argv(&job);
    let status = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .current_dir(home.path())
        .env(
            "PATH",
            format!("{}:{}", bin.path().display(), std::env::var("PATH").unwrap()),
        )
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(
        status.signal(),
        Some(9),
        "the wrapper killed the start script: {status:?}"
    );
    let dir = home.path().join(&job.dir);
    assert!(dir.is_dir(), "the folder was made before the kill");
    let t0 = Instant::now();
    while !dir.join("exit").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the job never ran: {:?}",
            std::fs::read_dir(&dir).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(std::fs::read_to_string(dir.join("out.log")).unwrap(), "launched\n");
    assert_eq!(std::fs::read_to_string(dir.join("exit")).unwrap(), "0\n");
    assert!(dir.join("pid").exists());
}

/// macOS's `sh` is bash, whose `wait` (with job control, `set -m`) returns when the waited-for
/// job *stops*, not only when it ends: a step stopped for a while (SIGSTOP from a debugger or a
/// tool, SIGTSTP) had `128+N` written as its exit status and was reported failed while it was
/// still there to go on. Run with bash as `sh` (on PATH), the job's status must be the step's own.
#[test]
fn a_step_stopped_for_a_while_is_waited_for_to_its_end_under_bash() {
    let Ok(bash) = which_bash() else {
        panic!("bash is needed to stand for macOS's sh");
    };
    let home = tempfile::tempdir().unwrap();
    let bin = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&bash, bin.path().join("sh")).unwrap();
    let path = format!("{}:{}", bin.path().display(), std::env::var("PATH").unwrap());
    let job = Job::new("mb-stopped", 0, "s", sh("kill -STOP $$; echo after; exit 3"));
    let argv = start_argv(&job);
    let out = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .current_dir(home.path())
        .env("PATH", &path)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"tartan-job started\n");
    let dir = home.path().join(&job.dir);
    // The step stops itself; it is continued (once found stopped, by its working directory)
    // until its exit is written.
    let stopped_in_home = || -> Vec<i32> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let stopped = stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with("T "));
            let here = std::fs::read_link(entry.path().join("cwd")).is_ok_and(|c| c == home.path());
            if let (true, true, Some(pid)) = (stopped, here, entry.file_name().to_str().and_then(|n| n.parse().ok())) {
                found.push(pid);
            }
        }
        found
    };
    let t0 = Instant::now();
    while !dir.join("exit").exists() {
        for pid in stopped_in_home() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGCONT);
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the step never ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(std::fs::read_to_string(dir.join("exit")).unwrap(), "3\n");
}

fn which_bash() -> Result<PathBuf, ()> {
    ["/bin/bash", "/usr/bin/bash"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or(())
}

#[tokio::test]
async fn secret_values_are_masked_across_tiny_chunks_and_a_new_follower() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-masked").await;
    let secret = "SECRET-value-42";
    // The value many times at shifting offsets, a pause for `go` (the first follower is dropped
    // meanwhile), then more, and it ends with the value cut by the tail's start.
    let script = format!(
        "i=0; while [ $i -lt 300 ]; do printf '%s %s|' $i '{secret}'; i=$((i+1)); done
         while [ ! -f go ]; do sleep 0.02; done
         i=0; while [ $i -lt 50 ]; do printf 'after %s %s\\n' $i '{secret}'; i=$((i+1)); done; exit 3"
    );
    let step = Step::new(&rig, "mb-masked", 0, "masked", sh(&script));
    let masker = tartan_agent::host::env::Masker::new([secret.as_bytes()]);
    let tiny = FollowConfig {
        chunk_bytes: 7,
        tail_bytes: 10,
        mask: masker.clone(),
        ..cfg()
    };
    {
        let follower = step.run(&tiny);
        tokio::pin!(follower);
        let log = step.log.clone();
        let seen = async {
            wait_for("the host log to grow past 200 bytes", Duration::from_secs(30), || {
                std::fs::metadata(&log).is_ok_and(|m| m.len() > 200)
            })
            .await
        };
        tokio::select! {
            r = &mut follower => panic!("the follower ended before it was dropped: {r:?}"),
            () = seen => {}
        }
    }
    std::fs::write(rig.vm_dir("mb-masked").join("go"), "").unwrap();
    let end = step.run(&tiny).await.unwrap();
    assert_eq!(end.exit_code, 3);
    let guest = step.guest_log();
    let host = step.host_log();
    assert!(
        !host.windows(secret.len()).any(|w| w == secret.as_bytes()),
        "the value is in the host log"
    );
    assert_eq!(
        String::from_utf8(host).unwrap(),
        String::from_utf8(masker.mask(&guest, true).0).unwrap(),
        "the host log is the guest log masked, once"
    );
    // The last 10 bytes of the guest log (`-value-42\n`) start inside the value: the tail
    // shows it masked, not its end.
    assert!(guest.ends_with(b"after 49 SECRET-value-42\n"));
    assert_eq!(end.tail, "***\n");
}

#[tokio::test]
async fn a_masked_follower_after_an_unmasked_one_replaces_what_it_logged() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-remask").await;
    let secret = "another-secret-99";
    let script = format!("echo 'first {secret}'; while [ ! -f go ]; do sleep 0.02; done; echo 'then {secret}'");
    let step = Step::new(&rig, "mb-remask", 0, "remask", sh(&script));
    {
        // A follower that masks nothing (as an agent without the values had) logs the first line.
        let plain = cfg();
        let follower = step.run(&plain);
        tokio::pin!(follower);
        let log = step.log.clone();
        let seen = async {
            wait_for("the first line in the host log", Duration::from_secs(30), || {
                std::fs::read_to_string(&log).is_ok_and(|t| t.contains("first"))
            })
            .await
        };
        tokio::select! {
            r = &mut follower => panic!("the follower ended before it was dropped: {r:?}"),
            () = seen => {}
        }
    }
    std::fs::write(rig.vm_dir("mb-remask").join("go"), "").unwrap();
    let masked = FollowConfig {
        mask: tartan_agent::host::env::Masker::new([secret.as_bytes()]),
        ..cfg()
    };
    let end = step.run(&masked).await.unwrap();
    assert_eq!(end.exit_code, 0);
    assert_eq!(String::from_utf8(step.host_log()).unwrap(), "first ***\nthen ***\n");
}

/// Issue 25: a poll's raw output (the step's output before masking) went through a scratch file
/// beside the host log (`<step>.log.poll`, 0644) for the length of each `tart exec`, and stayed
/// there when the follower was dropped. It is kept in memory now: while polls hang (and are
/// killed) no such file ever exists, no file holds the value, and the host log is not
/// world-readable. A scratch file an older agent left is removed by the next follower.
#[tokio::test]
async fn raw_poll_output_never_touches_the_host_disk() {
    use std::os::unix::fs::PermissionsExt;
    let rig = Rig::new();
    let _run = vm(&rig, "mb-scratch").await;
    let secret = "RAW-secret-value-77";
    let step = Step::new(
        &rig,
        "mb-scratch",
        0,
        "raw",
        sh(&format!(
            "echo 'one {secret}'; while [ ! -f go ]; do sleep 0.02; done; echo 'two {secret}'"
        )),
    );
    // An older agent's step log, world-readable (made 0640 when followed), and its scratch file
    // beside it, world-readable, with the value.
    std::fs::write(&step.log, "").unwrap();
    std::fs::set_permissions(&step.log, std::fs::Permissions::from_mode(0o644)).unwrap();
    let legacy = step.log.with_extension("log.poll");
    std::fs::write(&legacy, format!("tartan-job running size 9 bytes 9\n{secret}")).unwrap();
    std::fs::set_permissions(&legacy, std::fs::Permissions::from_mode(0o644)).unwrap();
    let quick = FollowConfig {
        exec_timeout: Duration::from_millis(500),
        unresponsive_limit: Duration::from_secs(2),
        mask: tartan_agent::host::env::Masker::new([secret.as_bytes()]),
        ..cfg()
    };
    let dir = step.log.parent().unwrap().to_path_buf();
    let scratch_seen = || {
        std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(".poll"))
    };
    let follower = step.run(&quick);
    tokio::pin!(follower);
    let log = step.log.clone();
    let logged = wait_for("the first line", Duration::from_secs(30), || {
        std::fs::read(&log).is_ok_and(|b| b == b"one ***\n")
    });
    tokio::select! {
        r = &mut follower => panic!("the follower ended early: {r:?}"),
        () = logged => {}
    }
    assert!(!legacy.exists(), "the older agent's scratch file is removed");
    // Polls hang now, each killed after 500 ms, until the follower gives up after 2 s: all the
    // while, no scratch file beside the log.
    let mut hang = Faults::default();
    hang.vms.insert(
        "mb-scratch".into(),
        Fault {
            exec_hangs: Some(true),
            ..Fault::default()
        },
    );
    rig.set_faults(&hang);
    let mut samples = 0;
    let ended = loop {
        tokio::select! {
            r = &mut follower => break r,
            () = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
        samples += 1;
        assert!(!scratch_seen(), "a poll scratch file exists (sample {samples})");
    };
    assert!(matches!(ended, Err(JobError::Unresponsive { .. })), "{ended:?}");
    assert!(samples > 50, "{samples}");
    // A new follower sees the step through; nothing on the host holds the value.
    rig.set_faults(&Faults::default());
    std::fs::write(rig.vm_dir("mb-scratch").join("go"), "").unwrap();
    let end = step.run(&quick).await.unwrap();
    assert_eq!(end.exit_code, 0);
    assert_eq!(step.host_log(), b"one ***\ntwo ***\n");
    let mut found = Vec::new();
    let mut stack = vec![rig.state.path().to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if std::fs::read(&p)
                .unwrap()
                .windows(secret.len())
                .any(|w| w == secret.as_bytes())
            {
                found.push(p);
            }
        }
    }
    assert!(found.is_empty(), "{found:?}");
    let mode = std::fs::metadata(&step.log).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & 0o007, 0, "the host log is not world-readable: {mode:o}");
}

/// Issue 25: at the per-step log cap a value straddling the cap was logged unmasked (41 of its
/// 42 bytes). Through the real poll script: the follower reads past the cap just far enough,
/// logs `***` and the cap note, for each place of the value around the cap and in tiny reads.
#[tokio::test]
async fn a_secret_straddling_the_log_cap_is_masked_on_the_host() {
    let rig = Rig::new();
    let _run = vm(&rig, "mb-capmask").await;
    let secret = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnop";
    assert_eq!(secret.len(), 42);
    let masker = tartan_agent::host::env::Masker::new([secret.as_bytes()]);
    for (index, before) in [59usize, 60, 99, 100].into_iter().enumerate() {
        for chunk in [7u64, 1 << 20] {
            // `before` dots, the value, more output: with a cap of 100, 41 (59), 40, 1 or none
            // (100) of its bytes come before the cap.
            let script = format!(
                "printf '%s' '{}{secret}'; printf 'after\\n%.0s' 1 2 3",
                ".".repeat(before)
            );
            let step = Step::new(
                &rig,
                "mb-capmask",
                index * 2 + usize::from(chunk > 7),
                "cap",
                sh(&script),
            );
            let capped = FollowConfig {
                log_cap: 100,
                chunk_bytes: chunk,
                mask: masker.clone(),
                ..cfg()
            };
            let end = step.run(&capped).await.unwrap();
            assert!(end.truncated, "{end:?}");
            let host = String::from_utf8(step.host_log()).unwrap();
            let shown = if before < 100 { "***" } else { "" };
            let want = format!("{}{shown}{}", ".".repeat(before.min(100)), log_cap_note(100));
            assert_eq!(host, want, "value after {before} bytes, chunk {chunk}");
            assert!(!host.contains("ABCD") && !host.contains("mnop"), "{host}");
        }
    }
}
