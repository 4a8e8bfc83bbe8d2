//! Putting plists into `~/Library/LaunchAgents` and taking them out again.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::Error;
use crate::job::LaunchAgent;
use crate::launchctl::{Bootout, Launchctl, Runner};

/// `<home>/Library/LaunchAgents`, where per-user agents live.
pub fn launch_agents_dir(home: &Path) -> PathBuf {
    home.join("Library/LaunchAgents")
}

/// Replace `path` with `bytes` atomically: a temporary file in the same directory, synced, mode
/// 0644 (launchd refuses plists that others may write), then renamed over `path`.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let io = |action: &'static str, at: &Path| {
        let at = at.to_owned();
        move |source| Error::Io {
            action,
            path: at,
            source,
        }
    };
    let dir = path.parent().ok_or_else(|| Error::Io {
        action: "find the directory of",
        path: path.to_owned(),
        source: std::io::Error::other("the path has no parent directory"),
    })?;
    fs::create_dir_all(dir).map_err(io("create the directory", dir))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            file.set_permissions(fs::Permissions::from_mode(0o644))?;
        }
        file.sync_all()
    };
    if let Err(source) = write() {
        let _ = fs::remove_file(&tmp);
        return Err(io("write", &tmp)(source));
    }
    if let Err(source) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(io("rename the temporary file into", path)(source));
    }
    // Make the rename itself durable; a failure here leaves a complete file either way.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// What [`install`] did for one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    pub label: String,
    pub plist: PathBuf,
    /// Whether an older copy of the job was loaded and removed first.
    pub previous: Bootout,
}

/// Write each job's plist into `dir`, then for each: `bootout` (a job that is not loaded is fine)
/// and `bootstrap`. The plists are checked to parse back to the same job before anything is written.
pub fn install<R: Runner>(
    launchctl: &mut Launchctl<R>,
    dir: &Path,
    jobs: &[LaunchAgent],
    bootout_wait: Duration,
) -> Result<Vec<Installed>, Error> {
    let mut files = Vec::with_capacity(jobs.len());
    for job in jobs {
        let xml = crate::tartan::render(job)?;
        if LaunchAgent::from_bytes(&xml, &job.label)? != *job {
            return Err(Error::RoundTrip {
                label: job.label.clone(),
            });
        }
        files.push((job, dir.join(job.file_name()), xml));
    }
    for (_, path, xml) in &files {
        write_atomically(path, xml)?;
    }
    let mut done = Vec::with_capacity(files.len());
    for (job, path, _) in files {
        let previous = launchctl.bootout(&job.label, bootout_wait)?;
        launchctl.bootstrap(&path)?;
        done.push(Installed {
            label: job.label.clone(),
            plist: path,
            previous,
        });
    }
    Ok(done)
}

/// What [`uninstall`] did for one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uninstalled {
    pub label: String,
    pub plist: PathBuf,
    pub bootout: Bootout,
    /// Whether the plist file existed (and was removed).
    pub removed_file: bool,
}

/// For each label: `bootout`, then remove `<dir>/<label>.plist` (a missing file is fine).
pub fn uninstall<R: Runner>(
    launchctl: &mut Launchctl<R>,
    dir: &Path,
    labels: &[&str],
    bootout_wait: Duration,
) -> Result<Vec<Uninstalled>, Error> {
    let mut done = Vec::with_capacity(labels.len());
    for label in labels {
        let bootout = launchctl.bootout(label, bootout_wait)?;
        let plist = dir.join(format!("{label}.plist"));
        let removed_file = match fs::remove_file(&plist) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(source) => {
                return Err(Error::Io {
                    action: "remove",
                    path: plist,
                    source,
                });
            }
        };
        done.push(Uninstalled {
            label: (*label).to_owned(),
            plist,
            bootout,
            removed_file,
        });
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("LaunchAgents/dev.tartan.agent.plist");
        write_atomically(&path, b"one").unwrap();
        write_atomically(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["dev.tartan.agent.plist"]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
        }
    }

    #[test]
    fn atomic_write_into_an_unwritable_place_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        fs::write(&blocker, b"").unwrap();
        let err = write_atomically(&blocker.join("x.plist"), b"x")
            .unwrap_err()
            .to_string();
        assert!(err.contains(&blocker.display().to_string()), "{err}");
    }
}
