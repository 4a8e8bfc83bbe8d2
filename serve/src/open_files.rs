//! The soft limit on open files (`RLIMIT_NOFILE`), raised toward the hard limit at start.
//!
//! launchd starts jobs with a soft limit of 256 (the plists ask for more, `launchd/`); a shell's
//! is often 256 or 1024. The hard limit is what an unprivileged process may raise it to.

use nix::sys::resource::{Resource, getrlimit, setrlimit};

/// The most the soft limit is raised to: far above what an agent with two VMs or a controller
/// needs, and below macOS's per-process ceiling on most machines.
pub const WANTED_OPEN_FILES: u64 = 65_536;
/// macOS refuses a soft limit above `kern.maxfilesperproc` (EINVAL), which can be lower than the
/// hard limit (often "unlimited"); `OPEN_MAX` (10240) is accepted everywhere, so it is the second
/// try.
const FALLBACK_OPEN_FILES: u64 = 10_240;

/// The soft limit before and after [`raise_open_files_limit`], and the hard limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenFiles {
    pub before: u64,
    pub after: u64,
    pub hard: u64,
}

/// The soft limit to ask for given the current `soft` and `hard` ones: `None` when it is already
/// high enough. Never lowers it.
pub fn open_files_target(soft: u64, hard: u64) -> Option<u64> {
    let target = hard.min(WANTED_OPEN_FILES);
    (target > soft).then_some(target)
}

/// Raises the soft `RLIMIT_NOFILE` toward the hard limit (at most [`WANTED_OPEN_FILES`]). An error
/// says what failed; the caller logs it and goes on with the limit it has.
pub fn raise_open_files_limit() -> Result<OpenFiles, String> {
    let (soft, hard) =
        getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| format!("reading the open-files limit (RLIMIT_NOFILE): {e}"))?;
    let Some(target) = open_files_target(soft, hard) else {
        return Ok(OpenFiles {
            before: soft,
            after: soft,
            hard,
        });
    };
    let first = setrlimit(Resource::RLIMIT_NOFILE, target, hard);
    let after = match first {
        Ok(()) => target,
        Err(error) => match open_files_target(soft, target.min(FALLBACK_OPEN_FILES)) {
            Some(fallback) if setrlimit(Resource::RLIMIT_NOFILE, fallback, hard).is_ok() => fallback,
            _ => {
                return Err(format!(
                    "raising the soft open-files limit (RLIMIT_NOFILE) from {soft} to {target} (hard limit {hard}): \
                     {error}; it stays {soft}"
                ));
            }
        },
    };
    Ok(OpenFiles {
        before: soft,
        after,
        hard,
    })
}

/// [`raise_open_files_limit`], saying what it did in the log (the agent and the controller call
/// this once at start).
pub fn raise_and_log_open_files_limit() {
    match raise_open_files_limit() {
        Ok(l) if l.after > l.before => tracing::info!(
            "raised the soft open-files limit from {} to {} (hard limit {})",
            l.before,
            l.after,
            l.hard
        ),
        Ok(l) => tracing::info!("the soft open-files limit is {} (hard limit {})", l.after, l.hard),
        Err(e) => tracing::warn!("{e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_is_the_hard_limit_capped_and_never_lower() {
        let unlimited = u64::MAX; // RLIM_INFINITY
        for (soft, hard, want) in [
            (256, unlimited, Some(WANTED_OPEN_FILES)),
            (256, 1024, Some(1024)),
            (1024, 1024, None),
            (256, 256, None),
            (100_000, unlimited, None),
            (1_048_576, 1_048_576, None),
            (1024, 1_048_576, Some(WANTED_OPEN_FILES)),
        ] {
            assert_eq!(open_files_target(soft, hard), want, "soft {soft} hard {hard}");
        }
    }
}
