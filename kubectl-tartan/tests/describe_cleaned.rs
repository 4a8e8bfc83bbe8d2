//! `kubectl tartan describe` and `get` print what a pipeline author or a guest wrote (an image, an
//! artifact path): cleaned, so that no terminal escape or bidirectional override reaches the
//! reader's terminal (found by the adversary of issue 25: OSC 52 wrote the clipboard).
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use std::path::Path;
use std::process::Command;
use tartan_api::MacBuild;

const BIN: &str = env!("CARGO_BIN_EXE_kubectl-tartan");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_and_get_clean_what_the_pipeline_and_the_guest_wrote() {
    let crd = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crd.yaml");
    let emu = tartan_testkit::start(
        tartan_testkit::Options::default()
            .crd_file(crd)
            .crd_file(tartan_testkit::customrun_crd()),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    emu.write_kubeconfig(&kubeconfig).unwrap();
    let api: Api<MacBuild> = Api::namespaced(emu.client(), "default");
    let image = "ghcr.io/x\u{1b}]52;c;cHduZWQ=\u{7}\u{1b}]0;owned\u{7}\u{1b}[8m";
    let mb: MacBuild = serde_json::from_value(json!({
        "apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild",
        "metadata": {"name": "evil", "namespace": "default"},
        "spec": {"image": image, "steps": [{"name": "build", "run": ["make"]}]},
    }))
    .unwrap();
    api.create(&PostParams::default(), &mb).await.unwrap();
    api.patch_status(
        "evil",
        &PatchParams::default(),
        &Patch::Merge(
            json!({"status": {"results": {"artifactUrl": "file:///srv/a/mb-evil-1/out/App\u{202e}api.exe"}}}),
        ),
    )
    .await
    .unwrap();
    for command in ["describe", "get"] {
        let out = Command::new(BIN)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["-n", "default", command, "evil"])
            .env_remove("KUBECONFIG")
            .output()
            .unwrap();
        assert!(out.status.success(), "{command}: {out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            !stdout.contains('\u{1b}'),
            "{command}: an escape reaches the terminal: {stdout:?}"
        );
        assert!(
            !stdout.contains('\u{7}'),
            "{command}: a BEL reaches the terminal: {stdout:?}"
        );
        assert!(
            !stdout.contains('\u{202e}'),
            "{command}: a bidi override reaches the terminal: {stdout:?}"
        );
        if command == "describe" {
            assert!(
                stdout.contains("ghcr.io/x"),
                "{command}: the image is still shown: {stdout:?}"
            );
        }
    }
}
