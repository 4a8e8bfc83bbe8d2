//! Build script of `tartan-agent` and `tartan-controller`: sets `TARTAN_GIT_COMMIT` for their
//! `--version` (the version alone cannot tell two builds of one release apart).
//!
//! The commit is `$TARTAN_GIT_COMMIT` when set (a container build has no `.git`: `scripts/image`
//! passes it), else `git rev-parse HEAD`, else `unknown` (a source tarball). The script reruns
//! only when HEAD or the branch it points to moves, not on every edit of the sources.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(std::env::var_os("CARGO_MANIFEST_DIR")?)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !text.is_empty()).then_some(text)
}

/// Files whose change means another commit: HEAD, and the branch's loose ref or `packed-refs`
/// (a missing file would make cargo rerun this script on every build).
fn watched() -> Vec<PathBuf> {
    let mut paths = vec![];
    let mut push = |path: Option<String>| {
        if let Some(p) = path.map(PathBuf::from).filter(|p| p.is_file()) {
            paths.push(p);
        }
    };
    push(git(&["rev-parse", "--path-format=absolute", "--git-path", "HEAD"]));
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        push(git(&["rev-parse", "--path-format=absolute", "--git-path", &branch]));
    }
    push(git(&[
        "rev-parse",
        "--path-format=absolute",
        "--git-path",
        "packed-refs",
    ]));
    paths
}

fn main() {
    println!("cargo:rerun-if-env-changed=TARTAN_GIT_COMMIT");
    let commit = match std::env::var("TARTAN_GIT_COMMIT") {
        Ok(c) if !c.is_empty() => c,
        _ => {
            for path in watched() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
            git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".to_owned())
        }
    };
    println!("cargo:rustc-env=TARTAN_GIT_COMMIT={commit}");
}
