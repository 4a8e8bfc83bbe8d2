//! Adversary round 6: the collect phase (`host/executor/collect.rs`): the test report read from
//! the guest into memory and counted, each artifact read through a `ScreenedCopy` into a host
//! file and published, both through `READ_GUEST_FILE` and `Tart::exec_into`. Driven end to end
//! against `tart-double` (the "guest" is the VM's folder on this host). Each test names the
//! promise it checks; a failing test is a finding, tests marked HELD checked something that held.
//!
//! Promises: (1) a Secret value never lands on the host disk in clear, is never published, never
//! appears in a status message, journal record or log; (2) whatever the guest does, the agent
//! stays bounded and the failure names the file and the cause; (3) a clean artifact is published
//! byte for byte, a clean report is counted correctly, nothing is reported as success that was
//! not.

mod host_common;

use host_common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tartan_agent::host::env::{SecretAccess, SecretData, SecretReadError, SecretSource};
use tartan_agent::host::{ExecutorConfig, cancel_pair, drive};
use tartan_agent::machine::Config;
use tartan_agent::record::Record;
use tartan_api::{AttemptState as S, EnvVar, MacBuildSpec, Reason};

const LIMIT: Duration = Duration::from_secs(120);
const SECRET: &str = "s3cr3t-deploy-token-0123456789abcdef";

struct Secrets(BTreeMap<String, BTreeMap<String, Vec<u8>>>);

impl SecretSource for Secrets {
    fn get<'a>(
        &'a self,
        _namespace: &'a str,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<SecretData, SecretReadError>> + Send + 'a>> {
        let found = self.0.get(name).cloned();
        Box::pin(async move { Ok(found) })
    }
}

fn access() -> SecretAccess {
    SecretAccess {
        allowed: BTreeSet::from(["ci/registry".to_string()]),
        source: Arc::new(Secrets(BTreeMap::from([(
            "registry".to_string(),
            BTreeMap::from([("token".to_string(), SECRET.as_bytes().to_vec())]),
        )]))),
    }
}

fn with_secret(mut spec: MacBuildSpec) -> MacBuildSpec {
    spec.env = vec![EnvVar::from_secret("TOKEN", "registry", "token")];
    spec
}

fn artifacts(spec: &mut MacBuildSpec, dest: &Path, paths: &[&str]) {
    spec.artifacts = Some(tartan_api::Artifacts {
        paths: paths.iter().map(|p| p.to_string()).collect(),
        destination: format!("file://{}/", dest.display()),
    });
}

/// Every file under `dir` whose bytes contain `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.is_file()
                && let Ok(bytes) = std::fs::read(&path)
                && bytes.windows(needle.len()).any(|w| w == needle)
            {
                found.push(path.display().to_string());
            }
        }
    }
    found
}

/// Drives one attempt to its end; returns the final state, the journal records and how long it
/// took.
async fn run(
    rig: &Rig,
    name: &str,
    spec: MacBuildSpec,
    tweak: impl FnOnce(&mut ExecutorConfig),
    journal: MemJournal,
) -> (S, Vec<Record>, Duration) {
    let mut cfg = rig.config();
    cfg.step_poll = Duration::from_millis(100);
    cfg.secrets = Some(access());
    tweak(&mut cfg);
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt_with(rig, name, spec, signal, cfg);
    let mut journal = journal;
    let started = Instant::now();
    let end = tokio::time::timeout(
        LIMIT,
        drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
    )
    .await
    .expect("attempt finished in time")
    .unwrap();
    let records = journal.records.lock().unwrap().clone();
    (end, records, started.elapsed())
}

fn retiring(records: &[Record]) -> (Option<Reason>, String) {
    let r = records.iter().find(|r| r.to == S::Retiring).expect("a Retiring record");
    (r.reason, r.detail.clone())
}

/// A `tart` that is `tart-double`, except that a guest file read (`READ_GUEST_FILE`) also prints
/// a warning line on stderr and still exits with the read's code, as a guest shell or tart itself
/// may (`sh: warning: setlocale: LC_ALL: cannot change locale`).
fn warning_tart(rig: &mut Rig) {
    let wrapper = rig.home.path().join("tart-with-warning");
    tartan_testkit::write_program(
        &wrapper,
        &format!(
            r#"#!/bin/sh
case "$*" in
  *"only regular files are read"*) '{double}' "$@"; rc=$?; echo 'sh: warning: setlocale: LC_ALL: cannot change locale (en_US.UTF-8)' >&2; exit $rc ;;
esac
exec '{double}' "$@"
"#,
            double = tartan_testkit::tart_double().display()
        ),
    );
    let timeouts = tartan_tart::Timeouts {
        clone: Duration::from_secs(120),
        set: Duration::from_secs(20),
        delete: Duration::from_secs(20),
        list: Duration::from_secs(20),
        get: Duration::from_secs(20),
        ip_margin: Duration::from_secs(5),
        stop_margin: Duration::from_secs(10),
    };
    rig.tart = tartan_tart::Tart::new(&wrapper, Some(rig.home.path().to_path_buf())).with_timeouts(timeouts);
}

// ------------------------------------------------------------------------------------------------
// Findings.

/// FINDING (promise 3: a clean artifact is published byte for byte identical; low-medium).
///
/// Input: a clean artifact (`out/App.bin`, 5 bytes); the guest read exits 0 but something on the
/// way (the guest's shell, tart itself) prints one warning line on stderr.
///
/// What happens: `exec_into` hands stdout and stderr interleaved to the consumer, so the
/// `ScreenedCopy` writes the warning into the artifact's host file and the corrupted artifact
/// (`BIN\x01\x02sh: warning: ...\n`) is published as a success. READ_GUEST_FILE never needs its
/// stderr in the file's bytes: its complaints are read from the stderr tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stderr_of_a_successful_guest_read_is_published_inside_the_artifact() {
    let mut rig = Rig::new();
    warning_tart(&mut rig);
    let dest = tempfile::tempdir().unwrap();
    let mut spec = spec(vec![step(
        "build",
        r#"mkdir -p out && printf 'BIN\001\002' > out/App.bin"#,
    )]);
    artifacts(&mut spec, dest.path(), &["out/App.bin"]);
    let (end, records, _) = run(&rig, "stderr-in-artifact", spec, |_| {}, MemJournal::new()).await;
    assert_eq!(end, S::Retired);
    let (reason, detail) = retiring(&records);
    assert_eq!(reason, Some(Reason::TestsPassed), "{detail}");
    let published = files_containing(dest.path(), b"BIN");
    assert_eq!(published.len(), 1, "{published:?}");
    let bytes = std::fs::read(&published[0]).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&bytes),
        "BIN\u{1}\u{2}",
        "the artifact as published is not the guest's file"
    );
}

/// FINDING (promise 3: a clean report is counted correctly; low-medium). The report side of the
/// finding above.
///
/// Input: a clean report (one passing test case); the guest read exits 0 and one warning line
/// comes on stderr.
///
/// What happens: the warning lands in the in-memory report after its root element, and the build
/// fails with "test report out/junit.xml is not well-formed XML: text outside the root element at
/// byte 44" instead of being counted as one passed test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stderr_of_a_successful_guest_read_is_counted_as_part_of_the_report() {
    let mut rig = Rig::new();
    warning_tart(&mut rig);
    let mut spec = spec(vec![step(
        "test",
        r#"mkdir -p out && printf '<testsuite><testcase name="a"/></testsuite>' > out/junit.xml"#,
    )]);
    spec.test_report = Some("out/junit.xml".into());
    let (end, records, _) = run(&rig, "stderr-in-report", spec, |_| {}, MemJournal::new()).await;
    assert_eq!(end, S::Retired);
    let (reason, detail) = retiring(&records);
    assert_eq!(
        reason,
        Some(Reason::TestsPassed),
        "a clean report was not counted: {detail}"
    );
}

// ------------------------------------------------------------------------------------------------
// What held.

/// HELD (promise 2). Files that are not regular files or are over the cap, as the test report
/// and as an artifact: a FIFO (reading it would block for ever), a link to `/dev/zero` (endless),
/// a sparse file far over the cap, a folder, a dangling link, a missing file. Each is refused
/// quickly, the failure names the file and the cause, and nothing is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_special_files_and_huge_files_are_refused_quickly_naming_them() {
    let rig = Rig::new();
    let dest = tempfile::tempdir().unwrap();
    let make = r#"mkdir -p out && mkfifo out/fifo && ln -s /dev/zero out/zero && truncate -s 64G out/sparse && mkdir out/dir && ln -s nowhere out/dangling"#;
    for (i, (path, says)) in [
        ("out/fifo", "out/fifo is not a regular file"),
        ("out/zero", "out/zero is not a regular file"),
        ("out/sparse", "out/sparse is 68719476736 bytes, more than the"),
        ("out/dir", "out/dir is not a regular file"),
        ("out/dangling", "out/dangling is not a regular file"),
        ("out/missing", "out/missing does not exist"),
    ]
    .into_iter()
    .enumerate()
    {
        for report in [true, false] {
            let mut spec = spec(vec![step("build", make)]);
            if report {
                spec.test_report = Some(path.into());
            } else {
                artifacts(&mut spec, dest.path(), &[path]);
            }
            let name = format!("special-{i}-{report}");
            let (end, records, took) = run(
                &rig,
                &name,
                spec,
                |cfg| {
                    cfg.artifact_cap = 1 << 20;
                    cfg.report_cap = 1 << 20;
                    cfg.guest_read_floor = Duration::from_secs(20);
                },
                MemJournal::new(),
            )
            .await;
            assert_eq!(end, S::Retired);
            let (reason, detail) = retiring(&records);
            let want = if report {
                Reason::TestsFailed
            } else {
                Reason::ArtifactUploadFailed
            };
            assert_eq!(reason, Some(want), "{name}: {detail}");
            assert!(detail.contains(says), "{name}: {detail}");
            assert!(took < Duration::from_secs(60), "{name}: {took:?}");
        }
    }
    let published: Vec<String> = std::fs::read_dir(dest.path())
        .unwrap()
        .flatten()
        .flat_map(|vm| std::fs::read_dir(vm.path()).into_iter().flatten().flatten())
        .filter(|e| e.file_name() != "logs")
        .map(|e| e.path().display().to_string())
        .collect();
    assert_eq!(published, Vec::<String>::new(), "something was published");
}

/// HELD (promise 1). A Secret value that starts a few bytes before the artifact cap and ends
/// past it (a file that grew after `READ_GUEST_FILE` checked its size, so `cat` reads past the
/// cap and the exec is stopped there, inside the value): the read says truncated, and the bytes of
/// the value before the cap were held back by the screen, never written to the host file. Driven
/// at the driver level (a stand-in `tart` printing the file) with the collect phase's consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_a_value_cut_by_the_cap_never_reaches_the_host_disk() {
    use tartan_agent::host::env::Masker;
    use tartan_agent::host::guest_copy::ScreenedCopy;
    let dir = tempfile::tempdir().unwrap();
    let cap: u64 = 1 << 20;
    let program = dir.path().join("tart");
    tartan_testkit::write_program(
        &program,
        &format!(
            "#!/bin/sh\nhead -c {} /dev/zero | tr '\\0' a; printf '%s' '{SECRET}'; exit 0\n",
            cap - 10
        ),
    );
    let tart = tartan_tart::Tart::new(&program, Some(dir.path().join("home")));
    let host = dir.path().join("artifact-0");
    let mask = Masker::new([SECRET.as_bytes()]);
    let copy = ScreenedCopy::create(&host, mask.screen()).unwrap();
    let options = tartan_tart::ExecOptions {
        log_cap: cap,
        stop_at_cap: true,
        tail_bytes: 2048,
        ..tartan_tart::ExecOptions::new("/nonexistent", Duration::from_secs(30))
    };
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        tart.exec_into("mb-x", &["cat".into()], Box::new(copy.clone()), &options),
    )
    .await
    .expect("in time")
    .unwrap();
    assert!(got.outcome.truncated);
    assert_eq!(copy.found(), None);
    let written = std::fs::read(&host).unwrap();
    assert_eq!(
        written.len() as u64,
        cap - 10,
        "the value's first 10 bytes were held back"
    );
    assert_eq!(
        files_containing(dir.path(), &SECRET.as_bytes()[..10]),
        vec![program.display().to_string()]
    );
}

/// HELD (promise 2). The guest stops answering once the steps are done (`tart exec` hangs): the
/// report read is killed after its limit, the failure names the report and says why, and the
/// attempt ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_a_guest_that_stops_answering_at_collect_fails_the_read_in_time() {
    let rig = Rig::new();
    let mut spec = spec(vec![step(
        "test",
        r#"mkdir -p out && printf '<testsuite><testcase name="a"/></testsuite>' > out/junit.xml"#,
    )]);
    spec.test_report = Some("out/junit.xml".into());
    let home = rig.home.path().to_path_buf();
    let journal = MemJournal::with_hook(move |r: &Record| {
        if r.to == S::Collecting {
            tart_double::Faults {
                global: tart_double::faults::Fault {
                    exec_hangs: Some(true),
                    ..Default::default()
                },
                ..Default::default()
            }
            .store(&home)
            .unwrap();
        }
    });
    let (end, records, took) = run(
        &rig,
        "hangs-at-collect",
        spec,
        |cfg| {
            cfg.report_cap = 1 << 20;
            cfg.guest_read_floor = Duration::from_secs(3);
        },
        journal,
    )
    .await;
    rig.set_faults(&tart_double::Faults::default());
    assert_eq!(end, S::Retired);
    let (reason, detail) = retiring(&records);
    assert_eq!(reason, Some(Reason::TestsFailed), "{detail}");
    assert!(
        detail.contains("out/junit.xml did not come out of the guest within 4s"),
        "{detail}"
    );
    assert!(took < Duration::from_secs(90), "{took:?}");
}

/// HELD (promise 3). A clean artifact that holds every prefix of the value and the value with
/// its last byte changed, spread over the 16 KiB pieces the exec reads, and ends in a prefix of
/// the value (held back by the screen until the end): published byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_a_clean_artifact_full_of_near_values_is_published_byte_for_byte() {
    let rig = Rig::new();
    let dest = tempfile::tempdir().unwrap();
    // Built in the step from $TOKEN: each prefix, then the value with its last byte changed,
    // many times over, ending with the value less its last byte.
    let script = r#"mkdir -p out && i=0 && : > out/near.bin && while [ $i -lt 400 ]; do n=1; while [ $n -lt ${#TOKEN} ]; do printf '%s' "$TOKEN" | head -c $n >> out/near.bin; n=$((n + 7)); done; printf '%sX' "$(printf '%s' "$TOKEN" | head -c $((${#TOKEN} - 1)))" >> out/near.bin; i=$((i + 1)); done; printf '%s' "$TOKEN" | head -c $((${#TOKEN} - 1)) >> out/near.bin && cp out/near.bin near.copy"#;
    let mut spec = with_secret(spec(vec![step("build", script)]));
    artifacts(&mut spec, dest.path(), &["out/near.bin"]);
    let (end, records, _) = run(&rig, "near-values", spec, |_| {}, MemJournal::new()).await;
    assert_eq!(end, S::Retired);
    let (reason, detail) = retiring(&records);
    assert_eq!(reason, Some(Reason::TestsPassed), "{detail}");
    let published = files_containing(dest.path(), &SECRET.as_bytes()[..20]);
    assert_eq!(published.len(), 1, "{published:?}");
    let got = std::fs::read(&published[0]).unwrap();
    let mut want = Vec::new();
    for _ in 0..400 {
        let mut n = 1;
        while n < SECRET.len() {
            want.extend_from_slice(&SECRET.as_bytes()[..n]);
            n += 7;
        }
        want.extend_from_slice(&SECRET.as_bytes()[..SECRET.len() - 1]);
        want.push(b'X');
    }
    want.extend_from_slice(&SECRET.as_bytes()[..SECRET.len() - 1]);
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the published artifact differs from the guest's file");
}
