//! The watchdog's view of one deadline file (`tartan_api::deadline`): which VM, and its host
//! execution deadline.

use k8s_openapi::jiff::Timestamp;
use std::path::Path;
use tartan_api::deadline::{DeadlineFileError, read_deadline_file};

/// What the watchdog needs from a deadline file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadlineView {
    pub vm: String,
    pub deadline: Timestamp,
}

/// Why a deadline file cannot be used. `Missing` is no operator problem: the agent removed it.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadError {
    Missing,
    Bad(String),
}

/// Reads and validates `path`: a supported version, a Tartan VM name, and named `<vm>.json`.
pub fn read(path: &Path) -> Result<DeadlineView, ReadError> {
    match read_deadline_file(path) {
        Ok(file) => Ok(DeadlineView {
            vm: file.vm,
            deadline: file.deadline,
        }),
        Err(DeadlineFileError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Err(ReadError::Missing)
        }
        Err(e) => Err(ReadError::Bad(e.to_string())),
    }
}
