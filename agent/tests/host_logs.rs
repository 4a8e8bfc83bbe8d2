//! Live step logs against real `tart-double` builds: shipped to a `file://` folder and to an S3
//! server (moto, started by the test; without it that test says SKIPPED and passes) while the
//! build runs, complete after it failed, and never a cause of failure or delay when the store is
//! broken or hangs. The S3 client is configured through the executor's `[artifacts]` settings,
//! never the process environment, so the tests run side by side.

mod host_common;

use futures::TryStreamExt;
use host_common::*;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tartan_agent::config::ArtifactsConfig;
use tartan_agent::host::{AttemptExecutor, DriveError, artifacts::s3_store, cancel_pair, drive};
use tartan_agent::machine::{Attempt, Config};
use tartan_api::logs::{LogObject, parse_object_name};
use tartan_api::{AttemptState as S, Outcome, Reason};
use tartan_testkit::support::Moto;
use tartan_testkit::wait_for;

/// Where a test reads what was shipped.
enum Store {
    File(PathBuf),
    S3 {
        store: Arc<dyn ObjectStore>,
        prefix: String,
    },
}

impl Store {
    /// The parts of `step`'s log joined in number order, and the whole log if written.
    async fn read(&self, vm: &str, step: &str) -> (String, Option<String>) {
        let mut objects: Vec<(LogObject, Vec<u8>)> = Vec::new();
        match self {
            Store::File(dir) => {
                let folder = dir.join(vm).join("logs");
                for e in std::fs::read_dir(&folder).into_iter().flatten().flatten() {
                    let name = e.file_name().into_string().unwrap();
                    if let Some(o) = parse_object_name(&name) {
                        objects.push((o, std::fs::read(e.path()).unwrap()));
                    }
                }
            }
            Store::S3 { store, prefix } => {
                let folder = ObjectPath::parse(format!("{prefix}/{vm}/logs")).unwrap();
                let metas: Vec<_> = store.list(Some(&folder)).try_collect().await.unwrap();
                for m in metas {
                    if let Some(o) = parse_object_name(m.location.filename().unwrap()) {
                        let bytes = store.get(&m.location).await.unwrap().bytes().await.unwrap();
                        objects.push((o, bytes.to_vec()));
                    }
                }
            }
        }
        objects.sort_by(|a, b| a.0.cmp(&b.0));
        let mut parts = Vec::new();
        let mut whole = None;
        for (o, bytes) in objects.into_iter().filter(|(o, _)| o.step() == step) {
            match o {
                LogObject::Part { .. } => parts.extend(bytes),
                LogObject::Whole { .. } => whole = Some(String::from_utf8(bytes).unwrap()),
            }
        }
        (String::from_utf8(parts).unwrap(), whole)
    }
}

fn spawn_drive(
    mut exec: AttemptExecutor,
    mut a: Attempt,
    journal: &MemJournal,
) -> tokio::task::JoinHandle<(Result<S, DriveError>, AttemptExecutor)> {
    let mut hooks = journal.clone();
    tokio::spawn(async move {
        let end = drive(&mut exec, &mut a, admit(600), &Config::default(), &mut hooks).await;
        (end, exec)
    })
}

/// A build whose step prints a line, waits for a gate, prints another and fails: the first line
/// must be in the destination within the interval (plus a margin) while the step still runs,
/// `status.logs` must name the attempt's folder from the record after admission on, and after
/// the failure the parts and the whole log must hold exactly the host log.
async fn live_then_failed(rig: &Rig, mut cfg: tartan_agent::host::ExecutorConfig, name: &str, store: Store) {
    let interval = Duration::from_secs(1);
    cfg.log_ship.interval = interval;
    let gate = rig.state.path().join(format!("gate-{name}"));
    let script = format!(
        "echo first line; while [ ! -e {gate} ]; do sleep 0.1; done; echo second line; echo to stderr >&2; exit 3",
        gate = gate.display()
    );
    let spec = spec(vec![step("build", &script)]);
    let (_cancel, signal) = cancel_pair();
    let (a, exec) = attempt_with(rig, name, spec, signal, cfg);
    let vm = a.vm.clone();
    let journal = MemJournal::new();
    let task = spawn_drive(exec, a, &journal);

    let host_log = rig.state.path().join("logs").join(&vm).join("build.log");
    let written = wait_for("the first line in the host log", Duration::from_secs(60), || {
        std::fs::read_to_string(&host_log)
            .ok()
            .filter(|t| t.contains("first line"))
            .map(|_| Instant::now())
    })
    .await;
    let limit = interval + Duration::from_secs(2);
    loop {
        let (parts, whole) = store.read(&vm, "build").await;
        if parts.contains("first line") {
            assert_eq!(whole, None, "the whole log is written only at the end");
            break;
        }
        assert!(
            written.elapsed() < limit,
            "the first line was not shipped within {limit:?} of reaching the host log (parts: {parts:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "first line shipped {:?} after it reached the host log",
        written.elapsed()
    );
    std::fs::write(&gate, b"open").unwrap();

    let (end, exec) = tokio::time::timeout(Duration::from_secs(90), task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end.unwrap(), S::Retired);
    let retiring = journal.records.lock().unwrap()[3].clone();
    assert_eq!(
        (retiring.to, retiring.reason, retiring.outcome),
        (S::Retiring, Some(Reason::StepFailed), Some(Outcome::Failed)),
        "{:#?}",
        journal.lines()
    );
    let location = exec.logs_location().expect("a location");
    assert!(location.ends_with(&format!("/{vm}/logs/")), "{location}");
    let reported = journal.logs.lock().unwrap().clone();
    assert_eq!(reported[0], None, "the admission's record precedes any shipping");
    assert!(
        reported[1..].iter().all(|l| l.as_deref() == Some(location.as_str())),
        "{reported:?}"
    );
    let host = std::fs::read_to_string(&host_log).unwrap();
    assert!(host.contains("second line") && host.contains("to stderr"), "{host}");
    let (parts, whole) = store.read(&vm, "build").await;
    assert_eq!(parts, host, "the parts hold the host log exactly");
    assert_eq!(
        whole.as_deref(),
        Some(host.as_str()),
        "the whole log is written at the end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_destination_gets_live_parts_and_the_whole_log_after_a_failure() {
    let rig = Rig::new();
    let dest = tempfile::tempdir().unwrap();
    let mut cfg = rig.config();
    cfg.artifacts.destination = Some(format!("file://{}/", dest.path().display()));
    let dir = std::fs::canonicalize(dest.path()).unwrap();
    live_then_failed(&rig, cfg, "live-file", Store::File(dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_destination_gets_live_parts_and_the_whole_log_after_a_failure() {
    let Some(moto) = Moto::start() else {
        eprintln!("SKIPPED: moto is not installed (pip install 'moto[server]'); shipping to S3 was not tested");
        return;
    };
    assert!(moto.create_bucket("build-logs").contains(" 200"), "bucket not created");
    let rig = Rig::new();
    let mut cfg = rig.config();
    cfg.artifacts = ArtifactsConfig {
        destination: Some("s3://build-logs/ci/".into()),
        s3_endpoint: Some(moto.endpoint()),
        s3_region: Some("us-east-1".into()),
        s3_access_key_id: Some("tartan-test".into()),
        s3_secret_access_key: Some("tartan-test-secret".into()),
        ..cfg.artifacts
    };
    let store = s3_store("build-logs", &cfg.artifacts).unwrap();
    live_then_failed(
        &rig,
        cfg,
        "live-s3",
        Store::S3 {
            store,
            prefix: "ci".into(),
        },
    )
    .await;
}

/// Runs a one-step build that passes with `cfg` and returns how long the retirement took (from
/// the `Retiring` record to the end).
async fn passing_build(rig: &Rig, cfg: tartan_agent::host::ExecutorConfig, name: &str) -> (Duration, MemJournal) {
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt_with(rig, name, spec(vec![step("build", "echo hello")]), signal, cfg);
    let retiring_at = Arc::new(std::sync::Mutex::new(None));
    let at = retiring_at.clone();
    let mut journal = MemJournal::with_hook(move |r| {
        if r.to == S::Retiring {
            *at.lock().unwrap() = Some(Instant::now());
        }
    });
    let end = tokio::time::timeout(
        Duration::from_secs(90),
        drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
    )
    .await
    .expect("the build ended")
    .unwrap();
    assert_eq!(end, S::Retired);
    let retiring = journal.records.lock().unwrap()[4].clone();
    assert_eq!(
        (retiring.reason, retiring.outcome),
        (Some(Reason::TestsPassed), Some(Outcome::Succeeded)),
        "{:#?}",
        journal.lines()
    );
    let took = retiring_at.lock().unwrap().expect("a Retiring record").elapsed();
    (took, journal)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_fails_or_hangs_neither_fails_nor_stalls_the_build() {
    let rig = Rig::new();
    // A file destination whose attempt folder is taken by a file: every write fails at once.
    let dest = tempfile::tempdir().unwrap();
    let mut cfg = rig.config();
    cfg.log_ship.interval = Duration::from_secs(1);
    cfg.artifacts.destination = Some(format!("file://{}/", dest.path().display()));
    let vm = tartan_api::vm_name("ci", "blocked", "uid-blocked", 1);
    std::fs::write(dest.path().join(&vm), b"in the way").unwrap();
    let (took, journal) = passing_build(&rig, cfg, "blocked").await;
    eprintln!("failing store: retirement took {took:?}");
    assert!(journal.logs.lock().unwrap().iter().skip(1).all(Option::is_some));
    assert_eq!(std::fs::read(dest.path().join(&vm)).unwrap(), b"in the way");

    // An S3 endpoint that accepts connections and never answers: each request gives up at the
    // request limit and the end at the finish limit, whatever the client's own retries.
    let hole = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = hole.local_addr().unwrap().port();
    let mut cfg = rig.config();
    cfg.log_ship.interval = Duration::from_secs(1);
    cfg.log_ship.put_timeout = Duration::from_millis(500);
    cfg.log_ship.finish_limit = Duration::from_secs(2);
    cfg.artifacts = ArtifactsConfig {
        destination: Some("s3://black-hole/ci/".into()),
        s3_endpoint: Some(format!("http://127.0.0.1:{port}")),
        s3_region: Some("us-east-1".into()),
        s3_access_key_id: Some("x".into()),
        s3_secret_access_key: Some("y".into()),
        ..cfg.artifacts
    };
    let (took, _) = passing_build(&rig, cfg, "hole").await;
    eprintln!("hanging store: retirement took {took:?}");
    assert!(
        took < Duration::from_secs(2) + Duration::from_secs(5),
        "the retirement waited {took:?} for a hanging store (finish limit 2s)"
    );
    drop(hole);
    assert!(rig.vms().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_any_destination_nothing_is_shipped_and_no_location_is_reported() {
    let rig = Rig::new();
    let cfg = rig.config();
    assert_eq!(cfg.artifacts.destination, None);
    let (_, journal) = passing_build(&rig, cfg, "no-dest").await;
    assert!(journal.logs.lock().unwrap().iter().all(Option::is_none));
    let host = rig.state.path().join("logs");
    assert!(has_build_log(&host), "the host log is still written");
}

fn has_build_log(logs: &Path) -> bool {
    std::fs::read_dir(logs)
        .into_iter()
        .flatten()
        .flatten()
        .any(|vm| vm.path().join("build.log").is_file())
}

/// A build cancelled mid-step still gets its logs finished: the parts and the whole log hold
/// what the step printed before it was killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_build_gets_its_logs_finished() {
    let rig = Rig::new();
    let dest = tempfile::tempdir().unwrap();
    let mut cfg = rig.config();
    cfg.artifacts.destination = Some(format!("file://{}/", dest.path().display()));
    let (cancel, signal) = cancel_pair();
    let spec = spec(vec![step("build", "echo before the cancel; sleep 600")]);
    let (a, exec) = attempt_with(&rig, "cancelled", spec, signal, cfg);
    let vm = a.vm.clone();
    let journal = MemJournal::new();
    let task = spawn_drive(exec, a, &journal);
    let host_log = rig.state.path().join("logs").join(&vm).join("build.log");
    wait_for("the line in the host log", Duration::from_secs(60), || {
        std::fs::read_to_string(&host_log)
            .ok()
            .filter(|t| t.contains("before the cancel"))
    })
    .await;
    cancel.cancel(tartan_agent::host::Withdrawal::CancelRequested);
    let (end, _) = tokio::time::timeout(Duration::from_secs(60), task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end.unwrap(), S::Retired);
    assert!(
        journal
            .records
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.outcome == Some(Outcome::Cancelled)),
        "{:#?}",
        journal.lines()
    );
    let store = Store::File(std::fs::canonicalize(dest.path()).unwrap());
    let (parts, whole) = store.read(&vm, "build").await;
    assert_eq!(parts, "before the cancel\n");
    assert_eq!(whole.as_deref(), Some("before the cancel\n"));
}

/// Three steps of 3000 bytes each under a per-step cap of 4096 and a build budget of 5000: the
/// first logs all, the second what is left (2000) and the note, the third only the note. Before
/// the budget each step had its own cap only (4 × 66 MiB passed a 64 MiB total).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_builds_step_logs_stay_within_its_log_budget() {
    let rig = Rig::new();
    let mut cfg = rig.config();
    cfg.step_log_cap = 4096;
    cfg.build_log_budget = 5000;
    let print = "head -c 3000 /dev/zero | tr '\\0' x";
    let steps = vec![step("one", print), step("two", print), step("three", print)];
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt_with(&rig, "budget", spec(steps), signal, cfg);
    let vm = a.vm.clone();
    let mut journal = MemJournal::new();
    let end = tokio::time::timeout(
        Duration::from_secs(90),
        drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
    )
    .await
    .expect("the build ended")
    .unwrap();
    assert_eq!(end, S::Retired, "{:#?}", journal.lines());
    let logs = rig.state.path().join("logs").join(&vm);
    let read = |name: &str| std::fs::read_to_string(logs.join(format!("{name}.log"))).unwrap();
    let note = |cap: u64| tartan_tart::log_cap_note(cap);
    assert_eq!(read("one"), "x".repeat(3000));
    assert_eq!(read("two"), "x".repeat(2000) + &note(2000));
    assert_eq!(read("three"), note(0));
}
