//! `deploy/crd.yaml` must be exactly what `tartan-controller crd` prints, and that output must
//! read back as the CRD the code derives (so `kubectl apply -f deploy/crd.yaml` installs the
//! schema the agent and controller were built against).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt as _;
use std::path::PathBuf;
use std::process::Command;
use tartan_api::MacBuild;

const REGENERATE: &str = "regenerate with: cargo run -p tartan-controller -- crd > deploy/crd.yaml";

fn printed_crd() -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_tartan-controller"))
        .arg("crd")
        .output()
        .expect("running tartan-controller crd");
    assert!(
        output.status.success(),
        "tartan-controller crd failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("tartan-controller crd printed non-UTF-8")
}

#[test]
fn deploy_crd_yaml_matches_the_generated_crd() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/crd.yaml");
    let committed =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}; {REGENERATE}", path.display()));
    let generated = printed_crd();
    if committed != generated {
        let line = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map_or_else(
                || {
                    format!(
                        "the files differ in length ({} vs {} lines)",
                        committed.lines().count(),
                        generated.lines().count()
                    )
                },
                |i| {
                    format!(
                        "first difference at line {}:\n  deploy/crd.yaml: {}\n  generated:       {}",
                        i + 1,
                        committed.lines().nth(i).unwrap_or_default(),
                        generated.lines().nth(i).unwrap_or_default()
                    )
                },
            );
        panic!("deploy/crd.yaml is out of date with the MacBuild types; {line}\n{REGENERATE}");
    }
}

#[test]
fn printed_yaml_reads_back_as_the_derived_crd() {
    let parsed: CustomResourceDefinition =
        serde_saphyr::from_str(&printed_crd()).expect("tartan-controller crd printed YAML that does not parse");
    assert_eq!(
        parsed,
        MacBuild::crd(),
        "the YAML does not read back as the CRD derived from tartan-api"
    );
}

#[test]
fn printed_yaml_is_a_single_document_with_quoted_condition_statuses() {
    let yaml = printed_crd();
    assert!(
        yaml.starts_with("apiVersion: apiextensions.k8s.io/v1\n"),
        "{}",
        &yaml[..yaml.len().min(200)]
    );
    assert!(!yaml.lines().any(|l| l == "---"), "expected one YAML document");
    // YAML readers (kubectl's included) take a bare True/False as a boolean, which the enum of
    // condition statuses would then refuse.
    assert!(
        yaml.contains("- \"True\"") && yaml.contains("- \"False\""),
        "condition statuses are not quoted"
    );
}
