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
    let tekton = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testkit/tests/fixtures/tekton-customrun-crd.yaml");
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
