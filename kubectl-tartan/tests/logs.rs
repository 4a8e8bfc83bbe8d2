//! The real `kubectl-tartan` binary against the Kubernetes API emulator and a logs folder laid
//! out as the agent ships it, on `file://` and on S3 (moto, started here; without it that test
//! says SKIPPED): following a running build sees new parts within a few polls and stops once the
//! MacBuild is terminal; after a failure it prints the whole logs; bad runs and stores are clear
//! errors. The binary gets the S3 settings in its own environment only.

use kube::api::{Api, Patch, PatchParams, PostParams};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tartan_api::MacBuild;
use tartan_testkit::support::Moto;

const BIN: &str = env!("CARGO_BIN_EXE_kubectl-tartan");

struct Cluster {
    _emu: tartan_testkit::EmulatorHandle,
    client: kube::Client,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

async fn cluster() -> Cluster {
    let crd = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crd.yaml");
    let tekton = tartan_testkit::customrun_crd();
    let emu = tartan_testkit::start(tartan_testkit::Options::default().crd_file(crd).crd_file(tekton))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig).unwrap();
    Cluster {
        client: emu.client(),
        _emu: emu,
        kubeconfig,
        _dir: dir,
    }
}

impl Cluster {
    async fn create_build(&self, name: &str) {
        let api: Api<MacBuild> = Api::namespaced(self.client.clone(), "default");
        let mb: MacBuild = serde_json::from_value(json!({
            "apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"image": "ghcr.io/cirruslabs/macos-sequoia-base:latest",
                     "steps": [{"name": "build", "run": ["make"]}, {"name": "test", "run": ["make", "test"]}]},
        }))
        .unwrap();
        api.create(&PostParams::default(), &mb).await.unwrap();
    }

    async fn set_status(&self, name: &str, status: serde_json::Value) {
        let api: Api<MacBuild> = Api::namespaced(self.client.clone(), "default");
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(json!({"status": status})))
            .await
            .unwrap();
    }

    fn command(&self, env: &[(&str, String)], args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["-n", "default"])
            .args(args);
        cmd.env_remove("KUBECONFIG");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd
    }

    fn run(&self, env: &[(&str, String)], args: &[&str]) -> (bool, String, String) {
        let out = self.command(env, args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// A follower's stdout, line by line, on a thread.
struct Follower {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Follower {
    fn start(mut cmd: Command) -> Follower {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Follower {
            child,
            lines,
            seen: vec![],
        }
    }

    /// Waits (at most `limit`) for a line equal to `want`; returns how long it took.
    fn expect(&mut self, want: &str, limit: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let left = limit
                .checked_sub(start.elapsed())
                .unwrap_or_else(|| panic!("no line {want:?} within {limit:?}; seen {:?}", self.seen));
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line == want {
                        return start.elapsed();
                    }
                }
                Err(_) => panic!("no line {want:?} within {limit:?}; seen {:?}", self.seen),
            }
        }
    }

    /// Waits (at most `limit`) for the process to exit; returns whether it succeeded.
    fn wait_exit(&mut self, limit: Duration) -> bool {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.success();
            }
            assert!(start.elapsed() < limit, "the follower did not stop within {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the test writes what the agent would ship.
enum Folder {
    File(PathBuf),
    S3(Arc<dyn ObjectStore>, String),
}

impl Folder {
    async fn put(&self, name: &str, text: &str) {
        match self {
            Folder::File(dir) => {
                std::fs::create_dir_all(dir).unwrap();
                // As the agent does: a temp name, then a rename.
                let temp = dir.join(format!(".{name}.1.part"));
                std::fs::write(&temp, text).unwrap();
                std::fs::rename(temp, dir.join(name)).unwrap();
            }
            Folder::S3(store, folder) => {
                let path = ObjectPath::parse(format!("{folder}/{name}")).unwrap();
                store.put(&path, text.as_bytes().to_vec().into()).await.unwrap();
            }
        }
    }
}

/// A running build followed, then failed; `location` is its `status.logs`, `env` the binary's
/// store settings.
async fn follow_then_failed(c: &Cluster, run: &str, location: &str, folder: Folder, env: &[(&str, String)]) {
    c.create_build(run).await;
    c.set_status(run, json!({"phase": "Running", "logs": location})).await;
    folder.put("build.log.part000001", "compiling 1/2\n").await;

    let mut f = Follower::start(c.command(env, &["logs", run, "-f", "--poll-seconds", "0.2"]));
    f.expect("==> build <==", Duration::from_secs(10));
    f.expect("compiling 1/2", Duration::from_secs(5));
    folder
        .put("build.log.part000002", "compiling 2/2\nerror: x.swift:3\n")
        .await;
    let took = f.expect("error: x.swift:3", Duration::from_secs(5));
    eprintln!("a new part was printed {took:?} after it was written");

    // The agent finishes the logs, then the build turns terminal: the follower prints the rest
    // and stops.
    folder
        .put("build.log", "compiling 1/2\ncompiling 2/2\nerror: x.swift:3\nexit 65\n")
        .await;
    folder.put("test.log.part000001", "never ran\n").await;
    c.set_status(run, json!({"phase": "Failed", "outcome": "Failed"})).await;
    f.expect("exit 65", Duration::from_secs(5));
    f.expect("==> test <==", Duration::from_secs(5));
    f.expect("never ran", Duration::from_secs(5));
    assert!(f.wait_exit(Duration::from_secs(5)), "the follower failed");

    // After the failure, without -f: everything, once.
    let (ok, out, err) = c.run(env, &["logs", run]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        "==> build <==\ncompiling 1/2\ncompiling 2/2\nerror: x.swift:3\nexit 65\n\n==> test <==\nnever ran\n"
    );
    assert!(err.contains("did not finish the logs of test"), "{err}");
    let (ok, out, _) = c.run(env, &["logs", run, "--step", "build"]);
    assert!(ok);
    assert_eq!(out, "compiling 1/2\ncompiling 2/2\nerror: x.swift:3\nexit 65\n");
    let (ok, _, err) = c.run(env, &["logs", run, "--step", "nope"]);
    assert!(!ok && err.contains("no log named \"nope\" was shipped"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_file_location_and_says_what_is_wrong() {
    let c = cluster().await;
    let dest = tempfile::tempdir().unwrap();
    let logs = dest.path().join("mb-default-b1-0001/logs");
    let location = format!("file://{}/", logs.display());
    follow_then_failed(&c, "b1", &location, Folder::File(logs), &[]).await;

    // Also by get and describe.
    let (ok, out, err) = c.run(&[], &["get", "b1"]);
    assert!(ok, "{err}");
    assert!(
        out.starts_with("NAME") && out.contains("b1") && out.contains("Failed") && out.contains(&location),
        "{out}"
    );
    let (ok, out, _) = c.run(&[], &["describe", "b1"]);
    assert!(
        ok && out.contains("Phase:       Failed") && out.contains(&format!("Logs:        {location}")),
        "{out}"
    );

    let (ok, _, err) = c.run(&[], &["logs", "nope"]);
    assert!(!ok && err.contains("no such run") && err.contains("nope"), "{err}");
    c.create_build("pending").await;
    let (ok, _, err) = c.run(&[], &["logs", "pending"]);
    assert!(!ok && err.contains("no logs location yet"), "{err}");
    c.set_status("pending", json!({"phase": "Failed"})).await;
    let (ok, _, err) = c.run(&[], &["logs", "pending"]);
    assert!(!ok && err.contains("no logs location"), "{err}");
    assert!(err.contains("artifact destination"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_an_s3_location_with_the_users_credentials() {
    let Some(moto) = Moto::start() else {
        eprintln!("SKIPPED: moto is not installed (pip install 'moto[server]'); reading S3 was not tested");
        return;
    };
    assert!(moto.create_bucket("ci-logs").contains(" 200"));
    let env = [
        ("AWS_ACCESS_KEY_ID", "tartan-test".to_string()),
        ("AWS_SECRET_ACCESS_KEY", "tartan-test-secret".to_string()),
        ("AWS_REGION", "us-east-1".to_string()),
        ("AWS_ENDPOINT_URL", moto.endpoint()),
        ("HOME", "/nonexistent".to_string()),
    ];
    let _ = rustls::crypto::ring::default_provider().install_default();
    let store: Arc<dyn ObjectStore> = Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name("ci-logs")
            .with_region("us-east-1")
            .with_access_key_id("tartan-test")
            .with_secret_access_key("tartan-test-secret")
            .with_endpoint(moto.endpoint())
            .with_allow_http(true)
            .build()
            .unwrap(),
    );
    let c = cluster().await;
    let folder = "app/mb-default-b2-0001/logs";
    follow_then_failed(
        &c,
        "b2",
        &format!("s3://ci-logs/{folder}/"),
        Folder::S3(store, folder.into()),
        &env,
    )
    .await;

    // A store that does not answer: a clear error, not a hang.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut env = env.to_vec();
    env[3].1 = format!("http://127.0.0.1:{port}");
    let started = Instant::now();
    let (ok, _, err) = c.run(&env, &["logs", "b2"]);
    assert!(!ok && err.contains("store is unreachable"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

/// `logs -f` started right after a CustomRun was created, before the controller made its
/// MacBuild: it waits for the MacBuild (and then its logs location) instead of failing; without
/// -f the same moment is a clear "not yet".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_waits_for_the_controller_to_create_the_macbuild() {
    let c = cluster().await;
    let runs: Api<kube::api::DynamicObject> = Api::namespaced_with(
        c.client.clone(),
        "default",
        &kube::api::ApiResource {
            group: "tekton.dev".into(),
            version: "v1beta1".into(),
            api_version: "tekton.dev/v1beta1".into(),
            kind: "CustomRun".into(),
            plural: "customruns".into(),
        },
    );
    let run: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
        "metadata": {"name": "early", "namespace": "default"},
        "spec": {"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"}},
    }))
    .unwrap();
    runs.create(&PostParams::default(), &run).await.unwrap();
    let (ok, _, err) = c.run(&[], &["logs", "early"]);
    assert!(
        !ok && err.contains("has no MacBuild yet") && err.contains("-f"),
        "{err}"
    );

    let mut f = Follower::start(c.command(&[], &["logs", "early", "-f", "--poll-seconds", "0.2"]));
    // The follower is polling for the MacBuild now; the controller creates it a moment later.
    let dest = tempfile::tempdir().unwrap();
    let logs = dest.path().join("mb-default-early-0001/logs");
    c.create_build("early").await;
    c.set_status(
        "early",
        json!({"phase": "Running", "logs": format!("file://{}/", logs.display())}),
    )
    .await;
    let folder = Folder::File(logs);
    folder.put("build.log.part000001", "resolving packages\n").await;
    f.expect("resolving packages", Duration::from_secs(10));
    folder.put("build.log", "resolving packages\n").await;
    folder.put("test.log", "").await;
    c.set_status("early", json!({"phase": "Succeeded", "outcome": "Succeeded"}))
        .await;
    assert!(f.wait_exit(Duration::from_secs(10)), "the follower failed");
}

/// Issue 25: a build's output reached the reader's terminal with its escape sequences (OSC 52
/// clipboard writes, window titles, DCS, clear-screen). They are removed by default, as in the
/// CustomRun's message, also when a sequence is split between two parts or two reads;
/// `--raw` prints the bytes as shipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escapes_are_cleaned_unless_raw_even_split_across_parts_and_reads() {
    let c = cluster().await;
    let dest = tempfile::tempdir().unwrap();
    let logs = dest.path().join("mb-default-esc-0001/logs");
    std::fs::create_dir_all(&logs).unwrap();
    c.create_build("esc").await;
    c.set_status(
        "esc",
        json!({"phase": "Running", "logs": format!("file://{}/", logs.display())}),
    )
    .await;
    // Part 1 ends inside an OSC 52 clipboard write that part 2 ends.
    let part1: &[u8] = b"start\x1b]0;owned\x07\x1b[2J\x1b[3J\x1bP1$qm\x1b\\ \x1b_apc\x1b\\\xc2\x9b6n\x1b]52;c;cHdu";
    let part2: &[u8] = b"ZWQ=\x07 \x1b^pm\x07\xc2\x9d8;;x\xc2\x9cdone\r\n";
    std::fs::write(logs.join("build.log.part000001"), part1).unwrap();
    std::fs::write(logs.join("build.log.part000002"), part2).unwrap();
    let (ok, out, err) = c.run(&[], &["logs", "esc", "--step", "build"]);
    assert!(ok, "{err}");
    assert_eq!(out, "start  done\n");
    let raw = c
        .command(&[], &["logs", "esc", "--step", "build", "--raw"])
        .output()
        .unwrap();
    assert!(raw.status.success());
    assert_eq!(raw.stdout, [part1, part2].concat(), "--raw prints the bytes as shipped");

    // The whole log, with a sequence across the boundary of two reads of 1 MiB.
    let mut whole = b"a".repeat((1 << 20) - 4);
    whole.extend_from_slice(b"\x1b]52;c;cHduZWQ=\x1b\\b\n");
    std::fs::write(logs.join("build.log"), &whole).unwrap();
    let out = c.command(&[], &["logs", "esc", "--step", "build"]).output().unwrap();
    assert!(out.status.success());
    let mut want = b"a".repeat((1 << 20) - 4);
    want.extend_from_slice(b"b\n");
    assert!(out.stdout == want, "an escape across two reads came through");
}

/// Issue 25: `logs` read each log whole into memory (a 2 GiB log: out of memory). It streams it
/// in reads of 1 MiB: its peak memory stays far below the log's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_log_is_streamed_in_bounded_memory() {
    use std::io::Read;
    let c = cluster().await;
    let dest = tempfile::tempdir().unwrap();
    let logs = dest.path().join("mb-default-big-0001/logs");
    std::fs::create_dir_all(&logs).unwrap();
    c.create_build("big").await;
    c.set_status(
        "big",
        json!({"phase": "Succeeded", "logs": format!("file://{}/", logs.display())}),
    )
    .await;
    // 512 MiB (sparse: no disk is used).
    let size: u64 = 512 << 20;
    std::fs::File::create(logs.join("build.log"))
        .unwrap()
        .set_len(size)
        .unwrap();
    let mut child = c
        .command(&[], &["logs", "big", "--step", "build", "--raw"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            match stdout.read(&mut buf).unwrap() {
                0 => return total,
                n => total += n as u64,
            }
        }
    });
    // The peak resident size (VmHWM only grows) as long as the process is there.
    let mut peak_kib = 0u64;
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status"))
            && let Some(kib) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        {
            peak_kib = peak_kib.max(kib);
        }
        assert!(started.elapsed() < Duration::from_secs(300), "logs did not finish");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(child.wait().unwrap().success());
    assert_eq!(reader.join().unwrap(), size, "every byte printed");
    assert!(peak_kib > 0, "no memory figure read");
    assert!(
        peak_kib < 96 << 10,
        "peak resident memory {} MiB for a {} MiB log",
        peak_kib >> 10,
        size >> 20
    );
    eprintln!(
        "a {} MiB log printed with a peak of {} MiB resident",
        size >> 20,
        peak_kib >> 10
    );
}

/// Polls `check` every 20 ms for at most `limit`.
fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> bool, context: impl Fn() -> String) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}: {}", context());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_survives_a_failing_api_and_store_without_printing_a_line_twice() {
    let c = cluster().await;
    let dest = tempfile::tempdir().unwrap();
    let logs = dest.path().join("mb-default-r1-0001/logs");
    let folder = Folder::File(logs.clone());
    c.create_build("r1").await;
    c.set_status(
        "r1",
        json!({"phase": "Running", "logs": format!("file://{}/", logs.display())}),
    )
    .await;
    folder.put("build.log.part000001", "one\n").await;
    let stderr_path = dest.path().join("stderr");
    let mut cmd = c.command(&[], &["logs", "r1", "-f", "--poll-seconds", "0.1", "--step", "build"]);
    cmd.stderr(std::fs::File::create(&stderr_path).unwrap());
    let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let printed = Arc::new(std::sync::Mutex::new(String::new()));
    let sink = Arc::clone(&printed);
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        loop {
            match std::io::Read::read(&mut stdout, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
    });
    let stderr = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let seen = || format!("stdout {:?}, stderr {:?}", printed.lock().unwrap(), stderr());
    wait_until(
        "part one",
        Duration::from_secs(10),
        || *printed.lock().unwrap() == "one\n",
        seen,
    );

    // The API refuses connections for a while: the follower says so and keeps going.
    c._emu.set_availability(tartan_testkit::Availability::Refuse);
    wait_until(
        "a note on the failing API",
        Duration::from_secs(10),
        || stderr().contains("reading MacBuild r1") && stderr().contains("trying again in 1s (failure 1 in a row"),
        seen,
    );
    folder.put("build.log.part000002", "two\n").await;
    c._emu.set_availability(tartan_testkit::Availability::Up);
    wait_until(
        "part two",
        Duration::from_secs(10),
        || *printed.lock().unwrap() == "one\ntwo\n",
        seen,
    );

    // The store fails (its folder replaced by a file): the same, then it resumes where it was.
    let away = dest.path().join("logs-away");
    std::fs::rename(&logs, &away).unwrap();
    std::fs::write(&logs, "not a folder").unwrap();
    wait_until(
        "a note on the failing store",
        Duration::from_secs(10),
        || {
            stderr()
                .lines()
                .any(|l| l.contains("trying again") && !l.contains("reading MacBuild"))
        },
        seen,
    );
    std::fs::remove_file(&logs).unwrap();
    std::fs::rename(&away, &logs).unwrap();
    folder.put("build.log", "one\ntwo\nthree\n").await;
    c.set_status("r1", json!({"phase": "Succeeded", "outcome": "Succeeded"}))
        .await;
    wait_until(
        "the follower to end",
        Duration::from_secs(30),
        || child.try_wait().unwrap().is_some(),
        seen,
    );
    assert!(child.wait().unwrap().success(), "{}", seen());
    reader.join().unwrap();
    assert_eq!(*printed.lock().unwrap(), "one\ntwo\nthree\n", "{}", seen());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_attempts_logs_and_the_timeline_of_each_attempt() {
    let c = cluster().await;
    let dest = tempfile::tempdir().unwrap();
    let first = dest.path().join("mb-default-a1-0001/logs");
    let second = dest.path().join("mb-default-a1-0002/logs");
    Folder::File(first).put("build.log", "first try\n").await;
    Folder::File(second.clone()).put("build.log", "second try\n").await;
    c.create_build("a1").await;
    c.set_status(
        "a1",
        json!({
            "phase": "Succeeded",
            "vm": "mb-default-a1-0002",
            "logs": format!("file://{}/", second.display()),
            "attempts": [
                {"number": 1, "id": "a1#1", "vm": "mb-default-a1-0001", "host": "mac-1", "outcome": "Interrupted",
                 "reason": "AgentRestarted", "startedAt": "2026-10-05T02:00:05Z", "finishedAt": "2026-10-05T02:03:00Z"},
                {"number": 2, "id": "a1#2", "vm": "mb-default-a1-0002", "host": "mac-2", "outcome": "Succeeded",
                 "startedAt": "2026-10-05T02:03:30Z", "finishedAt": "2026-10-05T02:09:00Z"},
            ],
        }),
    )
    .await;
    let (ok, out, err) = c.run(&[], &["logs", "a1", "--step", "build"]);
    assert!(ok, "{err}");
    assert_eq!(out, "second try\n");
    let (ok, out, err) = c.run(&[], &["logs", "a1", "--step", "build", "--attempt", "1"]);
    assert!(ok, "{err}");
    assert_eq!(out, "first try\n");
    let (ok, _, err) = c.run(&[], &["logs", "a1", "--attempt", "3"]);
    assert!(
        !ok && err.contains("no attempt 3") && err.contains("attempts 1, 2"),
        "{err}"
    );

    // The timeline from the status alone, then from the agent's Events on the MacBuild.
    let (ok, out, err) = c.run(&[], &["describe", "a1"]);
    assert!(ok, "{err}");
    assert!(out.contains("Timeline:\n"), "{out}");
    assert!(
        out.contains("2026-10-05T02:03:00Z  +2m55s   attempt 1 retired, VM deleted: Interrupted AgentRestarted"),
        "{out}"
    );
    let mb: MacBuild = Api::namespaced(c.client.clone(), "default").get("a1").await.unwrap();
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(c.client.clone(), "default");
    for (i, (at, reason, note)) in [
        (
            "2026-10-05T02:00:05.000000Z",
            "SlotFree",
            "#2 a1 Requested -> Admitted (SlotFree)",
        ),
        (
            "2026-10-05T02:00:20.000000Z",
            "GuestReady",
            "#3 a1 Booting -> Running (GuestReady) ready after 13s",
        ),
        (
            "2026-10-05T02:03:31.000000Z",
            "SlotFree",
            "#9 a2 Requested -> Admitted (SlotFree)",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let event = json!({
            "metadata": {"name": format!("a1.{i}")},
            "eventTime": at, "reason": reason, "note": note, "type": "Normal", "action": "x",
            "reportingController": "tartan.dev/agent", "reportingInstance": "mac-1",
            "regarding": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild", "name": "a1",
                          "namespace": "default", "uid": mb.metadata.uid},
        });
        events
            .create(&PostParams::default(), &serde_json::from_value(event).unwrap())
            .await
            .unwrap();
    }
    let (ok, out, err) = c.run(&[], &["describe", "a1", "--attempt", "1"]);
    assert!(ok, "{err}");
    let timeline: Vec<&str> = out
        .split("Timeline:\n")
        .nth(1)
        .unwrap_or_else(|| panic!("{out}"))
        .lines()
        .collect();
    assert_eq!(
        timeline,
        [
            "  2026-10-05T02:00:05Z           SlotFree: #2 a1 Requested -> Admitted (SlotFree)",
            "  2026-10-05T02:00:20Z  +15s     GuestReady: #3 a1 Booting -> Running (GuestReady) ready after 13s",
            "  (15s in all)",
        ],
        "{out}"
    );
    assert!(
        out.contains("  #1 mb-default-a1-0001 on mac-1") && !out.contains("  #2 "),
        "{out}"
    );
    let (ok, _, err) = c.run(&[], &["describe", "a1", "--attempt", "4"]);
    assert!(!ok && err.contains("has no attempt 4"), "{err}");
}

/// Adversary finding: `describe` lists every Event of the namespace (unpaginated, no field
/// selector: memory grows with the namespace's Events, not the build's) and keeps those whose
/// `regarding` names a MacBuild of this name, whatever its uid. The Events of an earlier MacBuild
/// of the same name (deleted, then a CustomRun of that name ran again; Events live an hour) fill
/// the new build's timeline as if they were its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_timeline_holds_only_this_macbuilds_events_not_an_earlier_namesakes() {
    let c = cluster().await;
    c.create_build("again").await;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(c.client.clone(), "default");
    let event = json!({
        "metadata": {"name": "again.old"},
        "eventTime": "2026-10-05T02:00:05.000000Z", "reason": "SlotFree",
        "note": "#2 a1 Requested -> Admitted (SlotFree) of-the-deleted-build", "type": "Normal", "action": "x",
        "reportingController": "tartan.dev/agent", "reportingInstance": "mac-1",
        "regarding": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild", "name": "again",
                      "namespace": "default", "uid": "00000000-0000-0000-0000-00000000dead"},
    });
    events
        .create(&PostParams::default(), &serde_json::from_value(event).unwrap())
        .await
        .unwrap();
    let (ok, out, err) = c.run(&[], &["describe", "again"]);
    assert!(ok, "{err}");
    assert!(
        !out.contains("of-the-deleted-build"),
        "an earlier MacBuild's Event is in this one's timeline: {out}"
    );
}

/// Adversary finding: errors are printed as `error: {e:#}` without cleaning, and some quote what
/// an agent wrote: `status.logs` is checked only for C0/C1 controls (`Destination::parse`), so a
/// bidirectional override in it reaches the reader's terminal in "no log named … was shipped to
/// <location>" (the describe and get outputs and the logs themselves are cleaned of these).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_quoting_the_agents_logs_location_is_cleaned() {
    let c = cluster().await;
    c.create_build("bidi").await;
    c.set_status(
        "bidi",
        json!({"phase": "Running", "logs": "file:///tmp/tartan-no-such/\u{202e}txt.exe/mb-default-bidi-0001/logs/"}),
    )
    .await;
    let (ok, _, err) = c.run(&[], &["logs", "bidi", "--step", "nope"]);
    assert!(!ok && err.contains("no log named"), "{err}");
    assert!(
        !err.contains('\u{202e}'),
        "a bidi override from status.logs reaches the terminal: {err:?}"
    );
}
