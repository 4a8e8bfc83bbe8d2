//! Logging for every `tartan-agent` subcommand.
//!
//! Events go to stderr, as text or as one JSON object per line (`--log-format json` or
//! `TARTAN_LOG_FORMAT=json`), filtered by `RUST_LOG` (default `info`). Under launchd, stderr lands
//! in `~/Library/Logs/Tartan/<label>.err.log`. On macOS they also go to unified logging with
//! subsystem [`SUBSYSTEM`] and the program (`agent`, `watchdog`) as category:
//! `log stream --predicate 'subsystem == "dev.tartan"'`.

use std::io::IsTerminal;

use tracing_subscriber::{EnvFilter, fmt, layer::SubscriberExt, util::SubscriberInitExt};

/// The unified-logging subsystem of all Tartan programs.
pub const SUBSYSTEM: &str = "dev.tartan";

/// How events are written to stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (for log shippers).
    Json,
}

impl LogFormat {
    pub fn is_json(self) -> bool {
        self == LogFormat::Json
    }
}

/// Install the global subscriber: stderr (text or JSON), plus os_log on macOS with `program` as
/// the category. Call once, first thing in `main`.
///
/// # Panics
/// If a global subscriber is already installed (calling it twice is a programming error).
pub fn init(program: &str, json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let text = (!json).then(|| {
        fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
    });
    let json = json.then(|| fmt::layer().json().with_writer(std::io::stderr));
    let registry = tracing_subscriber::registry().with(filter).with(text).with(json);
    #[cfg(target_os = "macos")]
    let registry = registry.with(tracing_oslog::OsLogger::new(SUBSYSTEM, program));
    #[cfg(not(target_os = "macos"))]
    let _ = program;
    registry.init();
}
