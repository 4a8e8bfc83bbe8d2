//! kubectl against the emulator: `apply` with default (strict) validation, `get` through Tables,
//! `describe` with events. Set `KUBECTL` to pick a binary (e.g. Debian's 1.20, which validates
//! client-side with the protobuf OpenAPI v2 document); tests skip loudly when none is installed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use kube::api::{Patch, PatchParams};
use serde_json::json;

fn kubectl() -> Option<PathBuf> {
    if let Some(k) = std::env::var_os("KUBECTL") {
        return Some(PathBuf::from(k));
    }
    let found = Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        Some(PathBuf::from("kubectl"))
    } else {
        eprintln!(
            "\n!!!!!!!! SKIPPING kubectl test: no kubectl on PATH (apt-get install -y kubernetes-client) !!!!!!!!\n"
        );
        None
    }
}

struct Kubectl {
    bin: PathBuf,
    dir: tempfile::TempDir,
}

impl Kubectl {
    fn new(bin: PathBuf, emu: &tartan_testkit::EmulatorHandle) -> Self {
        let dir = tempfile::tempdir().unwrap();
        emu.write_kubeconfig(dir.path().join("kubeconfig")).unwrap();
        Kubectl { bin, dir }
    }

    fn run(&self, args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
        use std::io::Write;
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .env("KUBECONFIG", self.dir.path().join("kubeconfig"))
            .env("KUBECACHEDIR", self.dir.path().join("cache"))
            .env("HOME", self.dir.path())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        if let Some(input) = stdin {
            child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        }
        drop(child.stdin.take());
        let out = child.wait_with_output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into(),
            String::from_utf8_lossy(&out.stderr).into(),
        )
    }
}

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

const MACBUILD: &str = r#"
apiVersion: tartan.dev/v1alpha1
kind: MacBuild
metadata:
  name: build-42-mac-build
  labels: {app: demo}
spec:
  image: ghcr.io/cirruslabs/macos-sequoia-xcode:16
  steps:
  - {name: build, run: [xcodebuild, -scheme, App, build]}
  timeoutSeconds: 1800
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_apply_get_describe() {
    let Some(bin) = kubectl() else { return };
    let emu = tartan_testkit::start(tartan_testkit::Options::default().crd_file(tartan_testkit::customrun_crd()))
        .await
        .unwrap();
    let k = Kubectl::new(bin, &emu);
    // The project's CRD when present, else the test one.
    let crd = [repo_file("deploy/crd.yaml"), fixture("macbuild-crd.yaml")]
        .into_iter()
        .find(|p| p.exists())
        .unwrap();
    let crd_path = crd.to_str().unwrap().to_string();
    let k = std::sync::Arc::new(k);
    let run = |args: Vec<String>, stdin: Option<String>| {
        let k = k.clone();
        tokio::task::spawn_blocking(move || {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            k.run(&a, stdin.as_deref())
        })
    };
    let ok = |args: &[&str], stdin: Option<&str>| {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let stdin = stdin.map(str::to_string);
        let r = run(args.clone(), stdin);
        async move {
            let (success, out, err) = r.await.unwrap();
            assert!(success, "kubectl {args:?} failed:\n{out}\n{err}");
            out
        }
    };

    let out = ok(&["apply", "-f", &crd_path], None).await;
    assert!(
        out.contains("customresourcedefinition.apiextensions.k8s.io/macbuilds.tartan.dev created"),
        "{out}"
    );
    let out = ok(&["apply", "-f", "-"], Some(MACBUILD)).await;
    assert!(out.contains("macbuild.tartan.dev/build-42-mac-build created"), "{out}");
    let out = ok(&["apply", "-f", "-"], Some(MACBUILD)).await;
    assert!(out.contains("unchanged"), "{out}");

    // Status and an event, written the way the agent would.
    let api = macbuilds(&emu.client(), "default");
    api.patch_status(
        "build-42-mac-build",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running", "claim": {"holder": "mac-mini-07", "attempt": "build-42-mac-build#1", "epoch": 1}}})),
    )
    .await
    .unwrap();
    let mb = api.get("build-42-mac-build").await.unwrap();
    let recorder = kube::runtime::events::Recorder::new(
        emu.client(),
        kube::runtime::events::Reporter {
            controller: "tartan-agent".into(),
            instance: Some("mac-mini-07".into()),
        },
    );
    use kube::Resource;
    recorder
        .publish(
            &kube::runtime::events::Event {
                type_: kube::runtime::events::EventType::Normal,
                reason: "Claimed".into(),
                note: Some("claimed by mac-mini-07".into()),
                action: "Claim".into(),
                secondary: None,
            },
            &mb.object_ref(&macbuild_resource()),
        )
        .await
        .unwrap();

    let table = ok(&["get", "mb"], None).await;
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(header.first(), Some(&"NAME"));
    assert!(
        header.contains(&"PHASE") && header.contains(&"HOST") && header.contains(&"AGE"),
        "{table}"
    );
    let row = lines.next().unwrap();
    assert!(
        row.starts_with("build-42-mac-build") && row.contains("Running") && row.contains("mac-mini-07"),
        "{table}"
    );
    let age = row.split_whitespace().last().unwrap();
    assert!(
        age.ends_with('s') || age.ends_with('m'),
        "age column is a duration: {table}"
    );
    let by_label = ok(&["get", "macbuilds.tartan.dev", "-l", "app=demo", "-o", "name"], None).await;
    assert_eq!(by_label.trim(), "macbuild.tartan.dev/build-42-mac-build");
    let ci = ok(&["get", "ci"], None).await;
    assert!(ci.contains("build-42-mac-build"), "category `ci` resolves: {ci}");

    let described = ok(&["describe", "mb", "build-42-mac-build"], None).await;
    assert!(described.contains("Name:         build-42-mac-build"), "{described}");
    assert!(described.contains("mac-mini-07"), "{described}");
    assert!(
        described.contains("Claimed") && described.contains("claimed by mac-mini-07"),
        "events listed:\n{described}"
    );

    let runs = run(vec!["get".into(), "customruns".into()], None).await.unwrap();
    assert!(runs.0, "{runs:?}");
    assert!(runs.2.contains("No resources found"), "{runs:?}");

    // Strict validation: an unknown field is refused (server-side on current kubectl, client-side on 1.20).
    let bad = MACBUILD.replace("timeoutSeconds: 1800", "timeoutSeconds: 1800\n  bogus: 1");
    let (success, out, err) = run(vec!["apply".into(), "-f".into(), "-".into()], Some(bad))
        .await
        .unwrap();
    assert!(!success, "{out}");
    assert!(err.contains("bogus"), "{err}");
    // Schema validation errors come back as the apiserver's Invalid.
    let invalid = MACBUILD.replace("timeoutSeconds: 1800", "timeoutSeconds: -5");
    let (success, _, err) = run(vec!["apply".into(), "-f".into(), "-".into()], Some(invalid))
        .await
        .unwrap();
    assert!(!success);
    assert!(err.contains("spec.timeoutSeconds"), "{err}");

    let out = ok(&["delete", "mb", "build-42-mac-build"], None).await;
    assert!(out.contains("deleted"), "{out}");
    assert_eq!(status_of(api.get("build-42-mac-build").await).code, 404);
}
