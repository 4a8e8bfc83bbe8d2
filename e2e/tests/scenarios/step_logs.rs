//! Step logs where the pipeline user looks: the agent ships each step's output to the build's
//! artifact destination while it runs (the stack's agents have a `file://` default destination),
//! the CustomRun's `logs` result names the attempt's folder, and the real `kubectl-tartan logs`
//! prints a failed step's output, or follows a running build until it ends.

use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tartan_e2e::invariants::result;
use tartan_e2e::stack::IMAGE;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

/// The `logs` result must be the attempt's folder under the agent's destination.
fn check_logs_result(s: &Stack, run: &serde_json::Value) {
    let logs = result(run, "logs").expect("a logs result");
    let prefix = format!("file://{}/mb-", s.artifacts_dir().display());
    assert!(
        logs.starts_with(&prefix) && logs.ends_with("/logs/"),
        "logs result {logs}"
    );
}

// scenario: step-logs-failed
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_steps_output_is_printed_by_kubectl_tartan_logs() {
    let mut s = Stack::new("step-logs-failed").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let steps = json!([
        "echo 'compiling App (2 files)'",
        "echo 'App.swift:3: error: cannot find x in scope' >&2; echo '** BUILD FAILED **'; exit 65",
    ]);
    s.create_run("build-1", &[("image", json!(IMAGE)), ("steps", steps)], None)
        .await;
    let run = s.wait_run_ended("build-1", Duration::from_secs(90)).await;
    let c = &run["status"]["conditions"][0];
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("False"), Some("StepFailed")),
        "{c}"
    );
    check_logs_result(&s, &run);

    let out = s.kubectl_tartan(&["logs", "build-1"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("$ kubectl tartan logs build-1\n{stdout}{stderr}");
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stdout,
        "==> step-1 <==\ncompiling App (2 files)\n\n==> step-2 <==\nApp.swift:3: error: cannot find x in scope\n** BUILD FAILED **\n"
    );
    let out = s
        .kubectl_tartan(&["logs", "build-1", "--step", "step-2"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "App.swift:3: error: cannot find x in scope\n** BUILD FAILED **\n"
    );
    let out = s.kubectl_tartan(&["get", "build-1"]).output().unwrap();
    eprintln!("$ kubectl tartan get build-1\n{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success());
    s.finish().await;
}

// scenario: step-logs-follow
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_tartan_logs_follows_a_running_build_until_it_ends() {
    let mut s = Stack::new("step-logs-follow").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let gate = s.dir.join("gate");
    let step = format!(
        "echo 'first line'; while [ ! -e {} ]; do sleep 0.1; done; echo 'second line'",
        gate.display()
    );
    s.create_run("build-1", &[("image", json!(IMAGE)), ("steps", json!([step]))], None)
        .await;

    // Followed from the start: it waits for the logs location, then prints as the agent ships
    // (every 5 s, the default).
    let mut child = s
        .kubectl_tartan(&["logs", "build-1", "-f"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let (tx, lines) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send((Instant::now(), line));
        }
    });
    let host_log = |s: &Stack| {
        let logs = s.agent("agent-a").state_dir.join("logs");
        std::fs::read_dir(logs)
            .into_iter()
            .flatten()
            .flatten()
            .find_map(|vm| std::fs::read_to_string(vm.path().join("step-1.log")).ok())
            .unwrap_or_default()
    };
    let expect = |want: &str, limit: Duration| -> Instant {
        let start = Instant::now();
        loop {
            let left = limit
                .checked_sub(start.elapsed())
                .unwrap_or_else(|| panic!("no {want:?} within {limit:?}"));
            match lines.recv_timeout(left) {
                Ok((at, line)) if line == want => return at,
                Ok(_) => {}
                Err(_) => panic!("no {want:?} within {limit:?}"),
            }
        }
    };
    tartan_testkit::wait_for("the first line in the host log", Duration::from_secs(60), || {
        host_log(&s).contains("first line").then_some(())
    })
    .await;
    let written = Instant::now();
    let printed = expect("first line", Duration::from_secs(10));
    let latency = printed.duration_since(written);
    eprintln!("follow: the first line was printed {latency:?} after it reached the host log");
    assert!(
        latency <= Duration::from_secs(7),
        "took {latency:?} (ship interval 5s, poll 1s)"
    );

    s.open_gate();
    expect("second line", Duration::from_secs(30));
    let run = s.wait_run_ended("build-1", Duration::from_secs(60)).await;
    assert_eq!(run["status"]["conditions"][0]["status"], "True", "{}", run["status"]);
    check_logs_result(&s, &run);
    // The follower stops by itself once the build is terminal.
    let stopped = tartan_testkit::wait_for("the follower to stop", Duration::from_secs(10), || {
        child.try_wait().unwrap()
    })
    .await;
    assert!(stopped.success());
    s.finish().await;
}

/// The agent killed mid-step and started again resumes the same attempt; its new shipper goes on
/// from the parts already in the folder: every line shows exactly once.
// scenario: step-logs-restart
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_shipped_across_an_agent_restart_show_each_line_once() {
    let mut s = Stack::new("step-logs-restart").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    let gate = s.dir.join("gate");
    let step = format!(
        "echo 'before the restart'; while [ ! -e {} ]; do sleep 0.1; done; echo 'after the restart'",
        gate.display()
    );
    s.create_run("build-1", &[("image", json!(IMAGE)), ("steps", json!([step]))], None)
        .await;
    // Shipped before the agent dies.
    tartan_testkit::wait_for("the first line shipped", Duration::from_secs(60), || {
        let out = s.kubectl_tartan(&["logs", "build-1"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .contains("before the restart")
            .then_some(())
    })
    .await;
    s.kill_agent("agent-a", tartan_e2e::KillMode::Alone);
    s.start_agent("agent-a").await;
    s.open_gate();
    let run = s.wait_run_ended("build-1", Duration::from_secs(90)).await;
    assert_eq!(run["status"]["conditions"][0]["status"], "True", "{}", run["status"]);
    assert_eq!(
        result(&run, "attempt"),
        Some("build-1#1"),
        "the same attempt ended the build"
    );
    check_logs_result(&s, &run);
    let out = s.kubectl_tartan(&["logs", "build-1"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!(
        "$ kubectl tartan logs build-1\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout, "==> step-1 <==\nbefore the restart\nafter the restart\n");
    s.finish().await;
}
