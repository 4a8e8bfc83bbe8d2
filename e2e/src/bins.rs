//! Where the binaries under test are: `target/<profile>/` next to the test executable (or
//! `$TARTAN_E2E_BIN_DIR`). They are built once per test process with `cargo build` unless
//! `TARTAN_E2E_NO_BUILD=1` (what `scripts/e2e` sets after building them itself).

use std::path::{Path, PathBuf};

/// The packages and binaries a scenario runs.
pub const BINARIES: &[(&str, &str)] = &[
    ("tartan-agent", "tartan-agent"),
    ("tartan-controller", "tartan-controller"),
    ("tart-double", "tart-double"),
    ("tartan-testkit", "kube-emulator"),
    ("kubectl-tartan", "kubectl-tartan"),
];

/// The workspace root (the folder holding `deploy/` and `testkit/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ is inside the workspace")
        .to_path_buf()
}

/// The path of binary `name` (one of [`BINARIES`]), built once per test process through
/// `tartan_testkit::support::workspace_bin` (a no-op when up to date), or taken as it is from
/// `$TARTAN_E2E_BIN_DIR` / next to the test executable when `TARTAN_E2E_NO_BUILD=1`.
pub fn bin(name: &str) -> PathBuf {
    let path = if std::env::var("TARTAN_E2E_NO_BUILD").as_deref() == Ok("1") {
        prebuilt_dir().join(name)
    } else {
        let (package, _) = BINARIES
            .iter()
            .find(|(_, bin)| *bin == name)
            .unwrap_or_else(|| panic!("{name} is not one of the binaries under test"));
        tartan_testkit::support::workspace_bin(package, name)
    };
    assert!(
        path.is_file(),
        "{} is missing: build it with `cargo build --bins` (scripts/e2e does)",
        path.display()
    );
    path
}

/// The variable naming the agent built with `--features crash-points` (scripts/sweep sets it).
pub const CRASH_AGENT_ENV: &str = "TARTAN_E2E_CRASH_AGENT";

/// The agent binary built with the `crash-points` feature: `$TARTAN_E2E_CRASH_AGENT`, else
/// `crash-points/tartan-agent` in the binaries' folder (where scripts/sweep copies it). Kept apart
/// from `tartan-agent` so that the binary every other scenario runs never carries the points.
pub fn crash_agent() -> PathBuf {
    let path = std::env::var_os(CRASH_AGENT_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| prebuilt_dir().join("crash-points").join("tartan-agent"));
    assert!(
        path.is_file(),
        "{} is missing: build it with `cargo build -p tartan-agent --features crash-points` and copy it there (scripts/sweep does)",
        path.display()
    );
    path
}

fn prebuilt_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TARTAN_E2E_BIN_DIR") {
        // Absolute: the paths go into agent configs, which refuse relative ones (launchd runs
        // agents from /), and scripts pass `target/release` as it comes.
        return std::path::absolute(&dir)
            .unwrap_or_else(|e| panic!("TARTAN_E2E_BIN_DIR {}: {e}", Path::new(&dir).display()));
    }
    // Test executables live in <target>/<profile>/deps/.
    let exe = std::env::current_exe().expect("the test knows its own path");
    exe.parent()
        .and_then(Path::parent)
        .expect("test executable is in <target>/<profile>/deps")
        .to_path_buf()
}
