//! Pure helpers for the guest commands: the source checkout's argv and the per-step log files.

use std::path::{Path, PathBuf};
use tartan_api::Source;

/// The step name used in events and logs for the source checkout (not a valid spec step name,
/// which cannot start with `_`, so its log never collides with a step's).
pub const CHECKOUT_STEP: &str = "_checkout";

/// One command to run in the guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestCommand {
    /// Names the command in events and its log file (`<name>.log`).
    pub name: String,
    pub argv: Vec<String>,
}

/// Why the checkout cannot be run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("source {what} {value:?} starts with '-' and would be read as an option by git; refusing to run it")]
pub struct UnsafeSource {
    pub what: &'static str,
    pub value: String,
}

/// `git clone` of `source.git` into `dir`, then a detached checkout of `source.revision`.
/// `--` keeps the URL from being read as an option; a revision starting with `-` is refused.
pub fn checkout_commands(source: &Source, dir: &str) -> Result<Vec<GuestCommand>, UnsafeSource> {
    if source.revision.starts_with('-') {
        return Err(UnsafeSource {
            what: "revision",
            value: source.revision.clone(),
        });
    }
    if dir.starts_with('-') {
        return Err(UnsafeSource {
            what: "checkout directory",
            value: dir.to_string(),
        });
    }
    let s = |x: &str| x.to_string();
    Ok(vec![
        GuestCommand {
            name: s(CHECKOUT_STEP),
            argv: vec![s("git"), s("clone"), s("--quiet"), s("--"), source.git.clone(), s(dir)],
        },
        GuestCommand {
            name: s(CHECKOUT_STEP),
            argv: vec![
                s("git"),
                s("-C"),
                s(dir),
                s("checkout"),
                s("--quiet"),
                s("--detach"),
                source.revision.clone(),
            ],
        },
    ])
}

/// Longest step name kept in a log file name.
pub use tartan_api::logs::STEP_LOG_NAME_MAX;

/// `<state>/logs/<vm>/`.
pub fn log_dir(state_dir: &Path, vm: &str) -> PathBuf {
    state_dir.join("logs").join(vm)
}

/// The log of step `step`: `<state>/logs/<vm>/<step>.log`. Characters other than ASCII letters,
/// digits, `-` and `_` become `_` (spec step names are already of that kind), so a name can never
/// leave the folder, and it is cut to [`STEP_LOG_NAME_MAX`] characters so the file name stays
/// within the file system's 255 bytes (spec step names have at most 63).
pub fn step_log(state_dir: &Path, vm: &str, step: &str) -> PathBuf {
    log_dir(state_dir, vm).join(format!("{}.log", safe_name(step)))
}

/// `name` as one harmless path component (the host step logs and the guest job folders,
/// [`super::guest_job::job_dir`]); shared with the readers of shipped logs.
pub use tartan_api::logs::safe_name;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkout_is_clone_then_detached_checkout() {
        let src = Source {
            git: "https://github.com/acme/app.git".into(),
            revision: "3f2c9e1".into(),
        };
        let cmds = checkout_commands(&src, "src").unwrap();
        assert_eq!(
            cmds.iter().map(|c| c.argv.join(" ")).collect::<Vec<_>>(),
            vec![
                "git clone --quiet -- https://github.com/acme/app.git src",
                "git -C src checkout --quiet --detach 3f2c9e1"
            ]
        );
        assert!(cmds.iter().all(|c| c.name == CHECKOUT_STEP));
        let bad = Source {
            git: "x".into(),
            revision: "--upload-pack=evil".into(),
        };
        assert_eq!(
            checkout_commands(&bad, "src").unwrap_err().to_string(),
            "source revision \"--upload-pack=evil\" starts with '-' and would be read as an option by git; refusing to run it"
        );
    }

    #[test]
    fn step_logs_stay_in_the_vm_folder() {
        let state = Path::new("/state");
        assert_eq!(
            step_log(state, "mb-x", "build"),
            PathBuf::from("/state/logs/mb-x/build.log")
        );
        assert_eq!(
            step_log(state, "mb-x", "../../etc/passwd"),
            PathBuf::from("/state/logs/mb-x/______etc_passwd.log")
        );
        for hostile in ["..", "/etc/passwd", "a\0b", "a/../../b", "\u{202e}x", ""] {
            let log = step_log(state, "mb-x", hostile);
            assert_eq!(log.parent(), Some(Path::new("/state/logs/mb-x")), "{hostile:?}");
            let name = log.file_name().unwrap().to_str().unwrap();
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.'),
                "{hostile:?}: {name}"
            );
            assert!(!name.starts_with(".."), "{hostile:?}: {name}");
        }
        assert_eq!(
            step_log(state, "mb-x", "a\0b"),
            PathBuf::from("/state/logs/mb-x/a_b.log")
        );
        let long = step_log(state, "mb-x", &"s".repeat(10_000));
        assert_eq!(long.file_name().unwrap().len(), STEP_LOG_NAME_MAX + ".log".len());
        assert_eq!(
            step_log(state, "mb-x", CHECKOUT_STEP),
            PathBuf::from("/state/logs/mb-x/_checkout.log")
        );
    }
}
