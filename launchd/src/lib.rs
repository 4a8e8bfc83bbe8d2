//! Tartan's two LaunchAgents and the `launchctl` commands that install, remove and inspect them.
//!
//! - [`job`]: the LaunchAgent plist types (`plist` crate, PascalCase keys).
//! - [`tartan`]: the agent's and the watchdog's jobs, generated from a [`tartan::Layout`].
//! - [`launchctl`]: `bootstrap` / `bootout` / `print` in the `gui/<uid>` domain, behind a runner.
//! - [`files`]: atomic plist writes and the install / uninstall sequences.
//!
//! Generation is pure (paths in, XML bytes out); only [`files`] and [`launchctl::ProcessRunner`]
//! touch the system.

use std::path::PathBuf;

pub mod files;
pub mod job;
pub mod launchctl;
pub mod tartan;

pub use job::{KeepAlive, KeepAliveConditions, LaunchAgent, ProcessType, ResourceLimits};
pub use tartan::{AGENT_LABEL, Layout, WATCHDOG_LABEL};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} must be an absolute path (launchd expands nothing), got {}", path.display())]
    RelativePath { what: &'static str, path: PathBuf },
    #[error("{what} {} is not valid UTF-8, which a plist string cannot hold", path.display())]
    NonUtf8Path { what: &'static str, path: PathBuf },
    #[error("could not write the plist of {label}: {source}")]
    Serialize { label: String, source: plist::Error },
    #[error("could not read {what} as a LaunchAgent plist: {source}")]
    Parse { what: String, source: plist::Error },
    #[error("the comment for the plist of {label} cannot be placed (it contains `--`, or the XML has no <plist> tag)")]
    Comment { label: String },
    #[error("the plist generated for {label} does not read back as the same job; nothing was written")]
    RoundTrip { label: String },
    #[error("could not {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("could not run `{command}` ({}): {source}; set TARTAN_LAUNCHCTL to launchctl's path if it is elsewhere", program.display())]
    Spawn {
        program: PathBuf,
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({output}); {hint}")]
    Launchctl {
        command: String,
        output: String,
        hint: String,
    },
}
