//! Which workspace crates ship and which exist only for tests: a product crate (everything but
//! [`TEST_ONLY`]) may use a test-only crate in its own tests and benches (`[dev-dependencies]`),
//! never in what it builds for users (`[dependencies]`, `[build-dependencies]`). Benches that need
//! the emulator or tart-double therefore live here, in `src/bin/`, not as a product's example.

use serde_json::Value;

/// The crates that exist only for tests, benches and the harness.
pub const TEST_ONLY: &[&str] = &["tartan-testkit", "tart-double", "tartan-e2e"];

/// Every `product -> test-only (kind)` edge outside `[dev-dependencies]` in the output of
/// `cargo metadata --format-version 1 --no-deps` (whose packages are the workspace's members).
pub fn test_only_edges(metadata: &Value) -> Vec<String> {
    let mut edges = Vec::new();
    for package in metadata["packages"].as_array().into_iter().flatten() {
        let name = package["name"].as_str().unwrap_or_default();
        if TEST_ONLY.contains(&name) {
            continue;
        }
        for dep in package["dependencies"].as_array().into_iter().flatten() {
            let dep_name = dep["name"].as_str().unwrap_or_default();
            let kind = dep["kind"].as_str().unwrap_or("normal");
            if TEST_ONLY.contains(&dep_name) && kind != "dev" {
                edges.push(format!("{name} -> {dep_name} ({kind})"));
            }
        }
    }
    edges
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_a_product_crates_dev_dependencies_may_name_a_test_only_crate() {
        let metadata = json!({"packages": [
            {"name": "tartan-agent", "dependencies": [
                {"name": "tartan-api", "kind": null},
                {"name": "tartan-testkit", "kind": "dev"},
                {"name": "tart-double", "kind": null},
            ]},
            {"name": "tartan-watchdog", "dependencies": [{"name": "tartan-testkit", "kind": "build"}]},
            {"name": "tartan-e2e", "dependencies": [{"name": "tartan-testkit", "kind": null}]},
        ]});
        assert_eq!(
            test_only_edges(&metadata),
            vec![
                "tartan-agent -> tart-double (normal)".to_string(),
                "tartan-watchdog -> tartan-testkit (build)".to_string(),
            ]
        );
    }

    #[test]
    fn no_product_crate_of_the_workspace_needs_a_test_only_crate_outside_its_tests() {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let manifest = crate::bins::workspace_root().join("Cargo.toml");
        let out = std::process::Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--no-deps", "--manifest-path"])
            .arg(&manifest)
            .output()
            .expect("cargo metadata runs");
        assert!(
            out.status.success(),
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let metadata: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
        let members: Vec<&str> = metadata["packages"]
            .as_array()
            .expect("packages")
            .iter()
            .filter_map(|p| p["name"].as_str())
            .collect();
        // The check means something only if it sees the product crates.
        for product in [
            "tartan-api",
            "tartan-tart",
            "tartan-agent",
            "tartan-watchdog",
            "tartan-controller",
        ] {
            assert!(
                members.contains(&product),
                "{product} is not among the members {members:?}"
            );
        }
        assert_eq!(
            test_only_edges(&metadata),
            Vec::<String>::new(),
            "a product crate depends on a test-only crate outside [dev-dependencies]: move that code \
             to the test-only crate (benches: e2e/src/bin/)"
        );
    }
}
