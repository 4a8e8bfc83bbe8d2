//! The `kube-emulator` binary: `--port 0 --crd FILE --kubeconfig-out FILE`, used by shell e2e scripts.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use kube::api::PostParams;
use serde_json::json;

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn binary_serves_and_writes_a_kubeconfig_kube_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    let _child = Child(
        Command::new(env!("CARGO_BIN_EXE_kube-emulator"))
            .args(["--port", "0", "--crd"])
            .arg(fixture("macbuild-crd.yaml"))
            .arg("--crd")
            .arg(tartan_testkit::customrun_crd())
            .arg("--kubeconfig-out")
            .arg(&kubeconfig)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let kc = eventually(20, "kubeconfig written", || {
        let path = kubeconfig.clone();
        async move { kube::config::Kubeconfig::read_from(&path).ok() }
    })
    .await;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    assert_eq!(config.default_namespace, "default");
    let client = kube::Client::try_from(config).unwrap();
    let api = macbuilds(&client, "default");
    let created = api
        .create(&PostParams::default(), &macbuild("from-binary", json!({"image": "x"})))
        .await
        .unwrap();
    assert_eq!(created.metadata.generation, Some(1));
    let list = customruns(&client, "default").list(&Default::default()).await.unwrap();
    assert!(list.items.is_empty());
    let version = tokio::time::timeout(Duration::from_secs(5), client.apiserver_version())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(version.major, "1");
}
