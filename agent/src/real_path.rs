//! The real path of a folder that may not exist yet: what artifact destinations and mounts are
//! compared by, at config load ([`crate::config`]) and per build ([`crate::host::artifacts`]).

use std::path::{Path, PathBuf};

/// `path` (absolute, without `..`) with its existing part resolved through every symlink and the
/// rest appended as written. A component that exists but cannot be resolved (a symlink to
/// nowhere, a file used as a folder, no permission) is an error naming it.
pub fn resolve(path: &Path) -> Result<PathBuf, (PathBuf, std::io::Error)> {
    let mut existing = path.to_path_buf();
    let mut missing = Vec::new();
    loop {
        match std::fs::symlink_metadata(&existing) {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match existing.file_name() {
                Some(name) => {
                    missing.push(name.to_os_string());
                    existing.pop();
                }
                None => return Err((existing, e)),
            },
            Err(e) => return Err((existing, e)),
        }
    }
    let mut real = std::fs::canonicalize(&existing).map_err(|e| (existing, e))?;
    real.extend(missing.iter().rev());
    Ok(real)
}
