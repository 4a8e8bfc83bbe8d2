//! tartan-agent: claims MacBuilds, drives tart, keeps the host journal and recovers after a crash.

pub mod cluster;
pub mod config;
pub mod crash;
pub mod doctor;
pub mod host;
pub mod journal;
pub mod lock;
pub mod logging;
pub mod machine;
pub mod pool;
pub mod rbac;
pub mod real_path;
pub mod record;
pub mod recovery;
pub mod runtime;
pub mod service;
pub mod status;

/// What `tartan-agent --version` prints after the name: the release and the git commit it was
/// built from (`build-support/git-version.rs`). `install` reads it back from the installed binary.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("TARTAN_GIT_COMMIT"), ")");
