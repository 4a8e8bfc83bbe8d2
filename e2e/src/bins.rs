//! Where the binaries under test are: `target/<profile>/` next to the test executable (or
//! `$TARTAN_E2E_BIN_DIR`). They are built once per test process with `cargo build` unless
//! `TARTAN_E2E_NO_BUILD=1` (what `scripts/e2e` sets after building them itself).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The packages and binaries a scenario runs.
pub const BINARIES: &[(&str, &str)] = &[
    ("tartan-agent", "tartan-agent"),
    ("tartan-controller", "tartan-controller"),
    ("tartan-tart", "tart-double"),
    ("tartan-testkit", "kube-emulator"),
];

/// The workspace root (the folder holding `deploy/` and `testkit/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ is inside the workspace")
        .to_path_buf()
}

fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TARTAN_E2E_BIN_DIR") {
        return PathBuf::from(dir);
    }
    // Test executables live in <target>/<profile>/deps/.
    let exe = std::env::current_exe().expect("the test knows its own path");
    exe.parent()
        .and_then(Path::parent)
        .expect("test executable is in <target>/<profile>/deps")
        .to_path_buf()
}

/// Builds every binary once (a no-op when they are up to date) and returns their folder.
fn built_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = bin_dir();
        if std::env::var("TARTAN_E2E_NO_BUILD").as_deref() != Ok("1") {
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.current_dir(workspace_root()).args(["build", "--quiet"]);
            for (package, bin) in BINARIES {
                cmd.args(["-p", package, "--bin", bin]);
            }
            if dir.file_name().and_then(|n| n.to_str()) == Some("release") {
                cmd.arg("--release");
            }
            if let Some(target) = dir.parent() {
                cmd.arg("--target-dir").arg(target);
            }
            let out = cmd.output().expect("cannot run cargo to build the binaries under test");
            assert!(
                out.status.success(),
                "building the binaries under test failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        dir
    })
}

/// The path of binary `name` (one of [`BINARIES`]), checked to exist.
pub fn bin(name: &str) -> PathBuf {
    let path = built_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing: build it with `cargo build --bins` (scripts/e2e does)",
        path.display()
    );
    path
}

/// Whether `tartan-agent` has the `run` subcommand yet (it is being wired up).
pub fn agent_has_run() -> bool {
    Command::new(bin("tartan-agent"))
        .args(["run", "--help"])
        .output()
        .is_ok_and(|o| o.status.success())
}
