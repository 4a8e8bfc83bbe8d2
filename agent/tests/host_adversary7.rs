//! Adversary round 7: what a MacBuild (or its guest) makes the agent write, read or create on the
//! Mac host — artifact destinations and keys, the step logs' shipping, mounts — driven through
//! real `tart-double` builds. Each FINDING test fails on the code it was written against and
//! says which promise broke, with which input, and what happened; HELD tests pass.

mod host_common;

use futures::TryStreamExt;
use host_common::*;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tart_double::run_flags::runs_of;
use tartan_agent::config::{ArtifactsConfig, Config as AgentConfig, MountConfig};
use tartan_agent::host::{AttemptExecutor, ExecutorConfig, artifacts::s3_store, cancel_pair, drive};
use tartan_agent::machine::{Attempt, Config};
use tartan_agent::record::Record;
use tartan_api::crd::MountRequest;
use tartan_api::logs::{LogObject, parse_object_name};
use tartan_api::{Artifacts, AttemptState as S, MacBuildSpec, Outcome, Reason};
use tartan_testkit::support::Moto;

const LIMIT: Duration = Duration::from_secs(90);

/// Drives one attempt of build `name` with `cfg` to its end; returns the attempt, the executor and
/// the records.
async fn run(
    rig: &Rig,
    name: &str,
    spec: MacBuildSpec,
    cfg: ExecutorConfig,
) -> (Attempt, AttemptExecutor, Vec<Record>) {
    let (_cancel, signal) = cancel_pair();
    let (mut a, mut exec) = attempt_with(rig, name, spec, signal, cfg);
    let mut journal = MemJournal::new();
    let end = tokio::time::timeout(
        LIMIT,
        drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
    )
    .await
    .expect("the attempt ended in time")
    .unwrap();
    assert_eq!(end, S::Retired, "{:#?}", journal.lines());
    let records = journal.records.lock().unwrap().clone();
    (a, exec, records)
}

/// The record that fixed the outcome.
fn ending(records: &[Record]) -> &Record {
    records
        .iter()
        .find(|r| r.outcome.is_some())
        .expect("a record with the outcome")
}

/// The VM name build `name` gets for its first attempt in the rig (the VM name is also on the
/// MacBuild's status, `status.vm`, for anyone who can read it; attempt 2's is computable from the
/// uid alone).
fn vm_of(name: &str) -> String {
    let b = build(name);
    tartan_api::vm_name(&b.namespace, &b.name, &b.uid, 1)
}

// ------------------------------------------------------------------------------------------------
// Artifact paths: refused only after the whole build ran.

/// FINDING (severity: low-medium; promise: "bad input is refused with a clear error that names
/// what was refused, before anything is cloned where possible").
///
/// Input: `spec.artifacts.paths: ["/etc/passwd"]` (also `../x` or `logs/build.log`). Every such
/// path is refused by `artifact_key`, a pure function of the path that needs no guest: the
/// admission (which already refuses a bad image, destination, mount or env before the clone)
/// could refuse it. What happened: the admission let it through, the VM was cloned and booted and
/// every step ran (minutes to hours of Mac time on a real host, with the steps' side effects, e.g.
/// a deploy step), and only then did the upload refuse the path, failing the build
/// `ArtifactUploadFailed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_an_artifact_path_the_agent_refuses_is_refused_only_after_the_build_ran() {
    let rig = Rig::new();
    let dest = tempfile::tempdir().unwrap();
    let mut spec = spec(vec![step("build", "echo the whole build ran")]);
    spec.artifacts = Some(Artifacts {
        paths: vec!["/etc/passwd".into()],
        destination: format!("file://{}/", dest.path().display()),
    });
    let (a, _exec, records) = run(&rig, "abs-artifact", spec, rig.config()).await;
    let end = ending(&records);
    assert!(
        end.detail.contains("/etc/passwd") && end.detail.contains("absolute"),
        "the refusal names the path: {}",
        end.detail
    );
    let states: Vec<S> = records.iter().map(|r| r.to).collect();
    let ran = rig.state.path().join("logs").join(&a.vm).join("build.log").exists();
    assert!(
        states == vec![S::Admitted, S::Retiring, S::Retired] && !ran,
        "an artifact path the agent refuses whatever the guest holds was refused only after the VM was cloned \
         and every step ran (states {states:?}, step log written: {ran}); it ended: {:?} {}",
        end.reason,
        end.detail
    );
}

// ------------------------------------------------------------------------------------------------
// One build's destination inside another build's attempt folder.

/// FINDING (severity: medium; promise: "one build never touches another build's files"; "names
/// that collide with another build's files").
///
/// Input: build B (any author whose builds run on the same agent) names as its destination a
/// folder inside build A's attempt folder under the same allowed root:
/// `file://<root>/<A's vm>/out/App.ipa/` (A's VM name is on A's status; an attempt 2's is
/// computable from A's uid). The policy allows it: it resolves inside `allowed_file_roots` and
/// touches neither the state dir nor tart's home. B's own artifact and log writes then create the
/// folders `<root>/<A's vm>/out/App.ipa/<B's vm>/…` inside A's attempt folder.
///
/// What happened: A's artifact `out/App.ipa` cannot be renamed into place over B's folder, every
/// retry fails, and A — whose steps and tests all passed — ends `Failed/ArtifactUploadFailed`.
/// The same works against A's step logs (`<A's vm>/logs/build.log/` as B's destination keeps A's
/// whole log from ever being written), and B's files sit in A's folder for A's readers to find.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_a_destination_inside_another_builds_attempt_folder_breaks_its_upload() {
    let rig = Rig::new();
    let root = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(root.path()).unwrap();
    let victim_vm = vm_of("victim");

    // B: a one-step build whose destination is A's artifact path, as a folder.
    let mut spec_b = spec(vec![step("build", "printf planted > planted.txt")]);
    spec_b.artifacts = Some(Artifacts {
        paths: vec!["planted.txt".into()],
        destination: format!("file://{}/{victim_vm}/out/App.ipa/", root.display()),
    });
    let (b, _, records_b) = run(&rig, "intruder", spec_b, rig.config()).await;
    // Fixed: refused before anything is cloned, and nothing of B is in A's folder.
    refused_as_inside_another_attempt(&records_b);
    assert!(!root.join(&victim_vm).exists(), "B ({}) wrote into A's folder", b.vm);

    // A: an ordinary build publishing out/App.ipa to the root.
    let mut spec_a = spec(vec![step("build", "mkdir -p out && printf app > out/App.ipa")]);
    spec_a.artifacts = Some(Artifacts {
        paths: vec!["out/App.ipa".into()],
        destination: format!("file://{}/", root.display()),
    });
    let (a, _, records_a) = run(&rig, "victim", spec_a, rig.config()).await;
    assert_eq!(a.vm, victim_vm);
    let end = ending(&records_a);
    assert_eq!(
        (end.reason, end.outcome),
        (Some(Reason::TestsPassed), Some(Outcome::Succeeded)),
        "build B (destination {root}/{victim_vm}/out/App.ipa/) made build A fail: {}",
        end.detail,
        root = root.display()
    );
}

/// FINDING (severity: low-medium; promise: "one build never touches another build's files"; a
/// build's live logs are its own).
///
/// Input: build B names `s3://<bucket>/<prefix>/<A's vm>/logs/` as its destination (any bucket
/// is allowed when `allowed_buckets` is empty, and A's VM name is on its status or, for a retry,
/// computable from its uid). B's own step log is shipped as
/// `<prefix>/<A's vm>/logs/<B's vm>/logs/build.log.part000001`.
///
/// What happened: A's shipper starts by listing `<prefix>/<A's vm>/logs` to learn what an earlier
/// agent shipped; on S3 that listing is recursive and only the object's last name is read, so
/// B's part is taken for A's part 1 of `build`. A's shipper then believes the first N bytes of
/// its `build` log (N = the size of B's part) are already shipped and never ships them: A's live
/// parts lack the start of its log (and its later parts are numbered after B's). The `file://`
/// listing (one level, regular files only) does not have this.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_another_builds_log_parts_below_an_attempts_s3_logs_folder_count_as_its_own() {
    let Some(moto) = Moto::start() else {
        eprintln!("SKIPPED: moto is not installed (pip install 'moto[server]'); S3 shipping was not tested");
        return;
    };
    assert!(moto.create_bucket("shared-logs").contains(" 200"), "bucket not created");
    let rig = Rig::new();
    let mut cfg = rig.config();
    cfg.log_ship.interval = Duration::from_millis(300);
    cfg.artifacts = ArtifactsConfig {
        destination: Some("s3://shared-logs/ci/".into()),
        s3_endpoint: Some(moto.endpoint()),
        s3_region: Some("us-east-1".into()),
        s3_access_key_id: Some("tartan-test".into()),
        s3_secret_access_key: Some("tartan-test-secret".into()),
        ..cfg.artifacts
    };
    let store: Arc<dyn ObjectStore> = s3_store("shared-logs", &cfg.artifacts).unwrap();
    let victim_vm = vm_of("s3-victim");

    // B: prints a long line; its logs go below A's logs folder.
    let mut spec_b = spec(vec![step("build", "printf 'B%.0s' $(seq 1 400); echo")]);
    spec_b.artifacts = Some(Artifacts {
        paths: vec!["b.txt".into()],
        destination: format!("s3://shared-logs/ci/{victim_vm}/logs/"),
    });
    spec_b.steps.push(step("pack", "printf b > b.txt"));
    let (_, _, records_b) = run(&rig, "s3-intruder", spec_b, cfg.clone()).await;
    refused_as_inside_another_attempt(&records_b);

    // A: an ordinary build whose step log is short.
    let spec_a = spec(vec![step("build", "echo victim says hello")]);
    let (a, _, records_a) = run(&rig, "s3-victim", spec_a, cfg).await;
    assert_eq!(a.vm, victim_vm);
    assert_eq!(ending(&records_a).outcome, Some(Outcome::Succeeded));
    let host = std::fs::read_to_string(rig.state.path().join("logs").join(&a.vm).join("build.log")).unwrap();

    // A's own parts, as a reader of its logs folder names them (directly in the folder).
    let folder = ObjectPath::parse(format!("ci/{victim_vm}/logs")).unwrap();
    let metas: Vec<_> = store.list(Some(&folder)).try_collect().await.unwrap();
    let mut parts: Vec<(u32, Vec<u8>)> = Vec::new();
    for m in metas {
        let direct = m.location.as_ref().rsplit_once('/').map(|(dir, _)| dir) == Some(folder.as_ref());
        if let (true, Some(LogObject::Part { step, n })) = (direct, parse_object_name(m.location.filename().unwrap()))
            && step == "build"
        {
            let bytes = store.get(&m.location).await.unwrap().bytes().await.unwrap();
            parts.push((n, bytes.to_vec()));
        }
    }
    parts.sort();
    // The shipper itself worked: A's whole log was written at the end.
    let whole = ObjectPath::parse(format!("ci/{victim_vm}/logs/build.log")).unwrap();
    let whole = store.get(&whole).await.unwrap().bytes().await.unwrap();
    assert_eq!(String::from_utf8_lossy(&whole), host);
    let shipped: Vec<u8> = parts.iter().flat_map(|(_, b)| b.clone()).collect();
    assert_eq!(
        String::from_utf8_lossy(&shipped),
        host,
        "A's live parts do not hold A's log: B's part below A's logs folder was counted as A's (A's part \
         numbers: {:?})",
        parts.iter().map(|(n, _)| *n).collect::<Vec<_>>()
    );
}

// ------------------------------------------------------------------------------------------------
// Mounts: a declared folder swapped for a link by another build.

/// FINDING (severity: medium, needs an operator config with one mount inside another, the outer
/// one read-write; promise: "nothing a MacBuild or its guest does ... reads a host file outside
/// what the operator's config allows (links ..., races that swap a folder for a link)"; docs:
/// "A read-only share cannot be corrupted by a build").
///
/// Input: `[[mounts]] cache = /…/cache` (read-write) and `seed = /…/cache/seed` (read-only). The
/// agent loads it: mounts are checked against the agent's folders and the artifact folders, not
/// against each other. A build mounting `cache` replaces `seed` in it with a symlink to the
/// agent's state dir (in the guest: `rm -rf "/Volumes/My Shared Files/cache/seed" && ln -s …`;
/// here done on the host, as virtio-fs would).
///
/// What happened: the next build asking for `seed` is started with `tart run --dir
/// seed:/…/cache/seed:ro`; the per-build check is `is_dir()`, which follows the link, so the
/// share is the state dir (journal, deadline files, every build's step logs) — a folder the
/// config refuses as a mount outright. A rw `seed` would give write access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_a_mount_swapped_for_a_link_by_another_build_is_still_shared() {
    let rig = Rig::new();
    let base = tempfile::tempdir().unwrap();
    let b = std::fs::canonicalize(base.path()).unwrap();
    let cache = b.join("cache");
    let seed = cache.join("seed");
    std::fs::create_dir_all(&seed).unwrap();
    let state = std::fs::canonicalize(rig.state.path()).unwrap();
    let text = format!(
        "state_dir = {state:?}\ntart_home = {:?}\n[[mounts]]\nname = \"cache\"\nhost_path = {cache:?}\n\
         [[mounts]]\nname = \"seed\"\nhost_path = {seed:?}\nread_only = true\n",
        std::fs::canonicalize(rig.home.path()).unwrap()
    );
    let loaded = AgentConfig::from_toml(Path::new("/etc/agent.toml"), &text, "mac", Some(Path::new("/Users/ci")));
    let mounts: Vec<MountConfig> = match loaded {
        // Refusing nested mounts at load would be one way to hold the promise.
        Err(e) => {
            eprintln!("HELD at load: {e}");
            return;
        }
        Ok(c) => c.mounts,
    };

    // Build 1 (mounting `cache` read-write) swaps `seed` for a link to the state dir.
    std::fs::remove_dir_all(&seed).unwrap();
    std::os::unix::fs::symlink(&state, &seed).unwrap();

    // Build 2 asks for the read-only seed.
    let mut spec2 = spec(vec![step("build", "echo reading the seed")]);
    spec2.mounts = vec![MountRequest { name: "seed".into() }];
    let mut cfg = rig.config();
    cfg.mounts = mounts;
    let (a, _, records) = run(&rig, "seed-reader", spec2, cfg).await;
    let shared: Vec<String> = runs_of(rig.home.path(), &a.vm)
        .iter()
        .flat_map(|r| r["dir"].as_array().cloned().unwrap_or_default())
        .filter_map(|d| d["path"].as_str().map(str::to_string))
        .collect();
    let reached_state = shared
        .iter()
        .any(|p| std::fs::canonicalize(p).is_ok_and(|p| p.starts_with(&state)));
    assert!(
        !reached_state,
        "tart run shared {shared:?}, which resolves into the agent's state dir {} (a link another build \
         planted); the build ended {:?}: {}",
        state.display(),
        ending(&records).reason,
        ending(&records).detail
    );
}

// ------------------------------------------------------------------------------------------------
// The build's log budget and the source checkout.

/// FINDING (severity: low; promise: the per-build log budget `[logs] max_build_mib` — "a step
/// gets what its predecessors left"; docs/logs.md).
///
/// Input: a MacBuild with `spec.source` (any git checkout) whose checkout writes output (here
/// `GIT_TRACE=1` from `spec.env`, a literal; a real clone prints warnings, hints, LFS progress).
/// The checkout is two guest commands, both named `_checkout`, sharing one host log
/// `_checkout.log`.
///
/// What happened: a step's cap is the budget less the sizes of the logs of the commands before
/// it, looked up by name, so `_checkout.log` is counted once per checkout command — twice. The
/// first spec step gets `budget - 2 × checkout` instead of `budget - checkout`: its log is cut
/// (with the cap note) although the build's logs together are well within the budget, and a
/// checkout writing half the budget leaves the steps nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_the_checkout_log_is_counted_twice_against_the_build_log_budget() {
    let rig = Rig::new();
    // A local repository to check out (tart-double runs guest commands on this host).
    let repo = tempfile::tempdir().unwrap();
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .args(args)
            .current_dir(repo.path())
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    git(&["init", "-q"]);
    std::fs::write(repo.path().join("README"), b"app\n").unwrap();
    git(&["add", "README"]);
    git(&["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one"]);
    let revision = git(&["rev-parse", "HEAD"]).trim().to_string();

    let mut cfg = rig.config();
    cfg.step_log_cap = 1 << 20;
    cfg.build_log_budget = 64 << 10;
    let mut spec = spec(vec![step("build", "head -c 70000 /dev/zero | tr '\\0' x")]);
    spec.source = Some(tartan_api::Source {
        git: repo.path().display().to_string(),
        revision,
    });
    spec.env = vec![tartan_api::crd::EnvVar {
        name: "GIT_TRACE".into(),
        value: Some("1".into()),
        value_from: None,
    }];
    let (a, _, records) = run(&rig, "checkout-budget", spec, cfg.clone()).await;
    assert_eq!(
        ending(&records).outcome,
        Some(Outcome::Succeeded),
        "{}",
        ending(&records).detail
    );
    let logs = rig.state.path().join("logs").join(&a.vm);
    let checkout = std::fs::metadata(logs.join("_checkout.log")).unwrap().len();
    assert!(checkout > 0, "the checkout wrote output");
    let build = std::fs::read(logs.join("build.log")).unwrap();
    let kept = build.iter().take_while(|&&b| b == b'x').count() as u64;
    let left = cfg.build_log_budget - checkout;
    assert!(
        kept >= left.min(70_000),
        "the budget is {} bytes and the checkout's log holds {checkout}: the step should keep {} bytes of its \
         70000, it kept {kept} (budget less twice the checkout's log: {})",
        cfg.build_log_budget,
        left.min(70_000),
        cfg.build_log_budget.saturating_sub(2 * checkout)
    );
}

// ------------------------------------------------------------------------------------------------
// Artifact keys and the logs folder under case folding.

/// FINDING (severity: low-medium, macOS only; promise: "odd Unicode/case" never reaches another
/// file than the one allowed; `artifact_key` refuses the top-level `logs/` folder "in any case: a
/// Mac's disk usually ignores it").
///
/// Input: `spec.artifacts.paths: ["logſ/build.log"]` (U+017F LATIN SMALL LETTER LONG S), or
/// `LOGſ/…`. The check is `eq_ignore_ascii_case`, ASCII only. A
/// case-insensitive APFS volume compares names by Unicode case folding, under which `ſ` is `s`
/// (the round that fixed mounts said so: `within_ignoring_case` maps `ſ` to `s`), so on a Mac
/// `<vm>/logſ/` is the folder `<vm>/logs/` where the shipper writes the build's step logs.
///
/// What happened: the key is accepted (`<vm>/logſ/build.log`); on a Mac the artifact replaces the
/// build's whole shipped step log, or, named `logſ/build.log.part000001`, forges a part the
/// shipper's listing then counts (hiding the start of the real log). On Linux (case-sensitive)
/// the write goes to a separate folder; the test checks the key, which decides it on both.
#[test]
fn finding_an_artifact_under_a_case_folded_logs_folder_is_accepted() {
    let mut accepted = Vec::new();
    for path in ["logſ/build.log", "LOGſ/build.log.part000001"] {
        if let Ok(key) = tartan_agent::host::artifacts::artifact_key("mb-x", path) {
            accepted.push(key);
        }
    }
    assert!(
        accepted.is_empty(),
        "keys in the shipper's logs/ folder on a case-insensitive Mac disk were accepted: {accepted:?}"
    );
}

/// HELD: the `file://` counterpart of the S3 finding above. Build B's destination is build A's
/// logs folder, `file://<root>/<A's vm>/logs/`; B's parts land in `<A's vm>/logs/<B's vm>/logs/`,
/// a folder, which the one-level listing of regular files skips: A's parts hold A's log exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_another_builds_log_parts_below_an_attempts_file_logs_folder_are_not_counted() {
    let rig = Rig::new();
    let root = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(root.path()).unwrap();
    let mut cfg = rig.config();
    cfg.log_ship.interval = Duration::from_millis(300);
    cfg.artifacts.destination = Some(format!("file://{}/", root.display()));
    let victim_vm = vm_of("file-victim");
    let mut spec_b = spec(vec![step(
        "build",
        "printf 'B%.0s' $(seq 1 400); echo; printf b > b.txt",
    )]);
    spec_b.artifacts = Some(Artifacts {
        paths: vec!["b.txt".into()],
        destination: format!("file://{}/{victim_vm}/logs/", root.display()),
    });
    let (_, _, records_b) = run(&rig, "file-intruder", spec_b, cfg.clone()).await;
    refused_as_inside_another_attempt(&records_b);
    let (a, _, records_a) = run(
        &rig,
        "file-victim",
        spec(vec![step("build", "echo victim says hello")]),
        cfg,
    )
    .await;
    assert_eq!(a.vm, victim_vm);
    assert_eq!(ending(&records_a).outcome, Some(Outcome::Succeeded));
    let host = std::fs::read(rig.state.path().join("logs").join(&a.vm).join("build.log")).unwrap();
    let folder = root.join(&victim_vm).join("logs");
    let mut parts: Vec<(u32, Vec<u8>)> = Vec::new();
    for e in std::fs::read_dir(&folder).unwrap().flatten() {
        if let Some(LogObject::Part { step, n }) = parse_object_name(&e.file_name().to_string_lossy())
            && step == "build"
        {
            parts.push((n, std::fs::read(e.path()).unwrap()));
        }
    }
    parts.sort();
    let shipped: Vec<u8> = parts.into_iter().flat_map(|(_, b)| b).collect();
    assert_eq!(String::from_utf8_lossy(&shipped), String::from_utf8_lossy(&host));
}

/// The fix for the two findings above: a destination with a part named as a build's VM is
/// refused at the admission, before anything is cloned, saying why.
fn refused_as_inside_another_attempt(records: &[Record]) {
    let end = ending(records);
    assert!(
        end.detail.contains("named as a build's VM is") && end.detail.contains("nothing was cloned"),
        "{:?} {}",
        end.reason,
        end.detail
    );
    let states: Vec<S> = records.iter().map(|r| r.to).collect();
    assert_eq!(states, vec![S::Admitted, S::Retiring, S::Retired]);
}
