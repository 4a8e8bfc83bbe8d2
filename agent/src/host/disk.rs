//! The disk floor (`[disk] min_free_gib`): below it, on the filesystem of the state dir or of
//! tart's home, the agent claims no new build, as kubelet stops admitting pods under disk
//! pressure. A macOS VM clone needs tens of GiB, and a disk that fills up halfway fails the build
//! and may take the journal with it. Builds already admitted go on (their retries and resumes
//! too); claiming resumes on its own once space is back.
//!
//! [`pressure`] decides from two readings and the floor; [`free_bytes`] is the `statvfs` behind a
//! reading; [`DiskFloor`] keeps the last reading for [`READING_MAX_AGE`], so the check before each
//! claim costs nothing, and tells the rest of the agent (log lines, the Lease annotation
//! [`DISK_PRESSURE_ANNOTATION`], `/healthz`, metrics, one Event per build left waiting).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The agent's Lease annotation while it is below the floor: which filesystems, how much is free
/// (JSON, [`Pressure::annotation`]); absent otherwise.
pub const DISK_PRESSURE_ANNOTATION: &str = "tartan.dev/disk-pressure";

/// How long one reading of the filesystems serves before they are read again.
pub const READING_MAX_AGE: Duration = Duration::from_secs(2);

/// The filesystems the floor watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Filesystem {
    /// The one holding `state_dir` (journal, step logs, artifacts on their way out).
    StateDir,
    /// The one holding tart's home (the VM clones and the image cache).
    TartHome,
}

impl Filesystem {
    /// The config key naming the folder; also the metric label and the annotation's `fs`.
    pub fn as_str(self) -> &'static str {
        match self {
            Filesystem::StateDir => "state_dir",
            Filesystem::TartHome => "tart_home",
        }
    }
}

/// One filesystem's free space (bytes available to the agent's user), or why it could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reading {
    pub fs: Filesystem,
    pub path: PathBuf,
    pub free: Result<u64, String>,
}

/// The filesystems below the floor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pressure {
    /// The floor in bytes.
    pub min_free: u64,
    /// Each filesystem below it: which, its folder, its free bytes.
    pub below: Vec<(Filesystem, PathBuf, u64)>,
}

/// The decision: pressure when any reading is below `min_free` bytes. A floor of 0 is off. A
/// reading that failed does not count (the agent logs it): an unreadable `statvfs` says nothing
/// about the space, and a clone on a disk that is really full fails with its own error.
pub fn pressure(readings: &[Reading], min_free: u64) -> Option<Pressure> {
    let below: Vec<(Filesystem, PathBuf, u64)> = readings
        .iter()
        .filter_map(|r| match r.free {
            Ok(free) if free < min_free => Some((r.fs, r.path.clone(), free)),
            _ => None,
        })
        .collect();
    (!below.is_empty()).then_some(Pressure { min_free, below })
}

/// `bytes` in GiB with one decimal: `12.3 GiB`.
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

impl Pressure {
    /// For log lines, `/healthz` and Events: `tart_home /Users/ci/.tart has 12.3 GiB free, below
    /// the floor of 20.0 GiB ([disk] min_free_gib)`.
    pub fn describe(&self) -> String {
        let each: Vec<String> = self
            .below
            .iter()
            .map(|(fs, path, free)| format!("{} {} has {} free", fs.as_str(), path.display(), gib(*free)))
            .collect();
        format!(
            "{}, below the floor of {} ([disk] min_free_gib)",
            each.join(" and "),
            gib(self.min_free)
        )
    }

    /// The value of [`DISK_PRESSURE_ANNOTATION`]:
    /// `{"minFreeBytes":N,"below":[{"fs":"tart_home","path":"/Users/ci/.tart","freeBytes":N}]}`.
    pub fn annotation(&self) -> String {
        let below: Vec<serde_json::Value> = self
            .below
            .iter()
            .map(|(fs, path, free)| {
                serde_json::json!({"fs": fs.as_str(), "path": path.display().to_string(), "freeBytes": free})
            })
            .collect();
        serde_json::json!({"minFreeBytes": self.min_free, "below": below}).to_string()
    }
}

/// Bytes available to unprivileged users on the filesystem holding `path` (`statvfs`: available
/// blocks × fragment size). A folder not created yet (tart makes its home on first use) is
/// measured at its nearest existing ancestor, where it will be created.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let mut at = path;
    loop {
        match nix::sys::statvfs::statvfs(at) {
            // The field types differ between macOS (u32 blocks) and Linux (u64).
            #[allow(clippy::useless_conversion)]
            Ok(s) => return Ok(u64::from(s.blocks_available()).saturating_mul(u64::from(s.fragment_size()))),
            Err(nix::errno::Errno::ENOENT) if at.parent().is_some() => at = at.parent().unwrap_or(at),
            Err(e) if at == path => {
                return Err(std::io::Error::other(format!("statvfs of {}: {e}", path.display())));
            }
            Err(e) => {
                return Err(std::io::Error::other(format!(
                    "statvfs of {} (at {}, the nearest existing folder): {e}",
                    path.display(),
                    at.display()
                )));
            }
        }
    }
}

/// The floor's last reading, and what follows from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskState {
    pub readings: Vec<Reading>,
    pub pressure: Option<Pressure>,
}

/// How a [`DiskFloor`] reads a folder's free space.
pub type FreeBytes = fn(&Path) -> std::io::Result<u64>;

/// The floor as the agent keeps it: readings at most [`READING_MAX_AGE`] old, transitions
/// logged, the annotation value published for the Lease keeper.
pub struct DiskFloor {
    folders: Vec<(Filesystem, Result<PathBuf, String>)>,
    min_free: u64,
    /// [`free_bytes`]; a test gives its own, to change the space under a running floor.
    read: FreeBytes,
    last: Mutex<Option<(Instant, DiskState)>>,
    /// Builds told (by an Event) that they wait for space, during the current pressure.
    told: Mutex<BTreeSet<String>>,
    annotation: watch::Sender<Option<String>>,
}

impl DiskFloor {
    /// The floor of `min_free` bytes on the filesystems of `state_dir` and `tart_home` (an `Err`
    /// when tart's home cannot be found: that reading fails and does not count). Reads them once
    /// now, so the Lease and the first scan already know; the receiver carries the annotation.
    pub fn new(
        state_dir: PathBuf,
        tart_home: Result<PathBuf, String>,
        min_free: u64,
    ) -> (DiskFloor, watch::Receiver<Option<String>>) {
        DiskFloor::reading_with(state_dir, tart_home, min_free, free_bytes)
    }

    /// [`DiskFloor::new`] reading the free space with `read`.
    pub fn reading_with(
        state_dir: PathBuf,
        tart_home: Result<PathBuf, String>,
        min_free: u64,
        read: FreeBytes,
    ) -> (DiskFloor, watch::Receiver<Option<String>>) {
        let (annotation, rx) = watch::channel(None);
        let floor = DiskFloor {
            folders: vec![(Filesystem::StateDir, Ok(state_dir)), (Filesystem::TartHome, tart_home)],
            min_free,
            read,
            last: Mutex::new(None),
            told: Mutex::new(BTreeSet::new()),
            annotation,
        };
        floor.check();
        (floor, rx)
    }

    /// The floor in bytes (0: off).
    pub fn min_free(&self) -> u64 {
        self.min_free
    }

    /// The state as of a reading at most [`READING_MAX_AGE`] old: reads the filesystems again when
    /// the last reading is older, logging when pressure starts, changes or ends.
    pub fn check(&self) -> DiskState {
        self.check_at(Instant::now())
    }

    /// [`DiskFloor::check`] at `now`.
    pub fn check_at(&self, now: Instant) -> DiskState {
        let mut last = self.last.lock().expect("not poisoned");
        if let Some((at, state)) = last.as_ref()
            && now.saturating_duration_since(*at) < READING_MAX_AGE
        {
            return state.clone();
        }
        let readings: Vec<Reading> = self
            .folders
            .iter()
            .map(|(fs, folder)| match folder {
                Ok(path) => Reading {
                    fs: *fs,
                    path: path.clone(),
                    free: (self.read)(path).map_err(|e| e.to_string()),
                },
                Err(why) => Reading {
                    fs: *fs,
                    path: PathBuf::new(),
                    free: Err(why.clone()),
                },
            })
            .collect();
        let state = DiskState {
            pressure: pressure(&readings, self.min_free),
            readings,
        };
        let before = last.as_ref().map(|(_, s)| s);
        self.log_changes(before, &state);
        self.annotation
            .send_if_modified(|a| replace_if_changed(a, state.pressure.as_ref().map(Pressure::annotation)));
        if state.pressure.is_none() {
            self.told.lock().expect("not poisoned").clear();
        }
        *last = Some((now, state.clone()));
        state
    }

    /// Whether `uid` is seen waiting for space for the first time in this pressure (then it gets
    /// its Event); later calls say false until the pressure has ended and come back.
    pub fn first_wait(&self, uid: &str) -> bool {
        self.told.lock().expect("not poisoned").insert(uid.to_string())
    }

    /// Forgets the builds no longer waiting (claimed elsewhere, deleted), so the set stays small
    /// through a long pressure.
    pub fn retain_waiting(&self, waiting: &BTreeSet<String>) {
        self.told
            .lock()
            .expect("not poisoned")
            .retain(|uid| waiting.contains(uid));
    }

    fn log_changes(&self, before: Option<&DiskState>, now: &DiskState) {
        let was = before.and_then(|s| s.pressure.as_ref());
        match (was, &now.pressure) {
            (None, Some(p)) => tracing::warn!(
                "disk space low: {}; claiming no new build until there is more (builds already admitted go on)",
                p.describe()
            ),
            (Some(a), Some(b)) if a.below.iter().map(|x| x.0).ne(b.below.iter().map(|x| x.0)) => {
                tracing::warn!("disk space low: {}; still claiming no new build", b.describe())
            }
            (Some(_), None) => tracing::info!(
                "disk space back above the floor of {} ([disk] min_free_gib); claiming new builds resumes",
                gib(self.min_free)
            ),
            _ => {}
        }
        for r in &now.readings {
            let error = r.free.as_ref().err();
            let was_error = before
                .and_then(|s| s.readings.iter().find(|b| b.fs == r.fs))
                .and_then(|b| b.free.as_ref().err());
            if let Some(e) = error
                && was_error != Some(e)
            {
                tracing::warn!(
                    "cannot read the free space of {} ({e}); the disk floor ignores it until it can be read",
                    r.fs.as_str()
                );
            }
        }
    }
}

/// Sets `slot` to `value` and says whether that changed it (for `send_if_modified`).
fn replace_if_changed(slot: &mut Option<String>, value: Option<String>) -> bool {
    if *slot == value {
        false
    } else {
        *slot = value;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn reading(fs: Filesystem, free: Result<u64, &str>) -> Reading {
        let path = match fs {
            Filesystem::StateDir => "/var/tartan",
            Filesystem::TartHome => "/Users/ci/.tart",
        };
        Reading {
            fs,
            path: PathBuf::from(path),
            free: free.map_err(str::to_string),
        }
    }

    #[test]
    fn pressure_when_either_filesystem_is_below_the_floor() {
        use Filesystem::{StateDir as S, TartHome as T};
        let floor = 20 * GIB;
        // (state_dir free, tart_home free, floor) -> the filesystems below it.
        type Free = Result<u64, &'static str>;
        let table: &[(Free, Free, u64, &[Filesystem])] = &[
            (Ok(100 * GIB), Ok(100 * GIB), floor, &[]),
            (Ok(floor), Ok(floor), floor, &[]),
            (Ok(floor - 1), Ok(100 * GIB), floor, &[S]),
            (Ok(100 * GIB), Ok(floor - 1), floor, &[T]),
            (Ok(GIB), Ok(0), floor, &[S, T]),
            // A floor of 0 is off, even on a full disk.
            (Ok(0), Ok(0), 0, &[]),
            // A reading that failed does not count either way.
            (Err("statvfs: EACCES"), Ok(100 * GIB), floor, &[]),
            (Err("statvfs: EACCES"), Ok(GIB), floor, &[T]),
            (Ok(GIB), Err("no tart home"), floor, &[S]),
        ];
        for (state, tart, min_free, expected) in table {
            let readings = [reading(S, *state), reading(T, *tart)];
            let got = pressure(&readings, *min_free);
            let below: Vec<Filesystem> = got.iter().flat_map(|p| p.below.iter().map(|b| b.0)).collect();
            assert_eq!(&below, expected, "state {state:?}, tart {tart:?}, floor {min_free}");
            if let Some(p) = got {
                assert_eq!(p.min_free, *min_free);
            }
        }
    }

    #[test]
    fn pressure_says_which_filesystem_and_how_much_is_free() {
        let p = pressure(
            &[
                reading(Filesystem::StateDir, Ok(100 * GIB)),
                reading(Filesystem::TartHome, Ok(12 * GIB + (300 << 20))),
            ],
            20 * GIB,
        )
        .unwrap();
        assert_eq!(
            p.describe(),
            "tart_home /Users/ci/.tart has 12.3 GiB free, below the floor of 20.0 GiB ([disk] min_free_gib)"
        );
        let a: serde_json::Value = serde_json::from_str(&p.annotation()).unwrap();
        assert_eq!(
            a,
            serde_json::json!({"minFreeBytes": 20 * GIB, "below": [
                {"fs": "tart_home", "path": "/Users/ci/.tart", "freeBytes": 12 * GIB + (300 << 20)}
            ]})
        );
    }

    #[test]
    fn free_bytes_reads_the_filesystem_of_a_folder_or_its_nearest_ancestor() {
        let dir = tempfile::tempdir().unwrap();
        let here = free_bytes(dir.path()).unwrap();
        assert!(here > 0, "a temp dir on a filesystem with no free byte");
        // Not created yet: measured where it will be created (free space moves a little).
        let later = free_bytes(&dir.path().join("not/yet")).unwrap();
        assert!(later.abs_diff(here) < 1 << 30, "{later} vs {here}");
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        let err = free_bytes(&file.join("x")).unwrap_err().to_string();
        assert!(err.contains("statvfs of") && err.contains("file/x"), "{err}");
    }

    /// The free space the next reading of [`the_floor_follows_the_space_without_a_restart`] sees.
    static FREE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    #[test]
    fn the_floor_follows_the_space_without_a_restart() {
        use std::sync::atomic::Ordering::SeqCst;
        FREE.store(5 * GIB, SeqCst);
        let read: FreeBytes = |_| Ok(FREE.load(SeqCst));
        let (floor, annotation) =
            DiskFloor::reading_with("/var/tartan".into(), Ok("/Users/ci/.tart".into()), 20 * GIB, read);
        // Past the reading `reading_with` took, so this one is taken at t0 exactly.
        let t0 = Instant::now() + READING_MAX_AGE;
        assert!(floor.check_at(t0).pressure.is_some(), "5 GiB is below 20");
        assert!(annotation.borrow().is_some());
        assert!(floor.first_wait("uid-1"));

        // Space freed: the reading serves READING_MAX_AGE, then the floor sees it.
        FREE.store(100 * GIB, SeqCst);
        let cached = floor.check_at(t0 + READING_MAX_AGE - Duration::from_millis(1));
        assert!(
            cached.pressure.is_some(),
            "within READING_MAX_AGE the last reading serves"
        );
        let fresh = floor.check_at(t0 + READING_MAX_AGE);
        assert_eq!(fresh.pressure, None, "{fresh:?}");
        assert_eq!(
            fresh.readings.iter().map(|r| r.free.clone()).collect::<Vec<_>>(),
            [Ok(100 * GIB), Ok(100 * GIB)]
        );
        assert_eq!(*annotation.borrow(), None, "the annotation goes with the pressure");

        // Low again later: a build left waiting is told again, once.
        FREE.store(GIB, SeqCst);
        assert!(floor.check_at(t0 + 2 * READING_MAX_AGE).pressure.is_some());
        assert!(floor.first_wait("uid-1"));
        assert!(!floor.first_wait("uid-1"));
    }

    #[test]
    fn the_floor_publishes_its_annotation_and_tells_each_build_once() {
        let dir = tempfile::tempdir().unwrap();
        // Above any disk: pressure on both filesystems at once.
        let (floor, annotation) = DiskFloor::new(dir.path().into(), Ok(dir.path().join("tart")), u64::MAX);
        let state = floor.check();
        let p = state.pressure.expect("below a floor of u64::MAX");
        assert_eq!(p.below.len(), 2);
        assert_eq!(annotation.borrow().as_deref(), Some(p.annotation().as_str()));
        assert!(floor.first_wait("uid-1"));
        assert!(!floor.first_wait("uid-1"), "a build is told once");
        assert!(floor.first_wait("uid-2"));
        floor.retain_waiting(&BTreeSet::from(["uid-2".to_string()]));
        assert!(floor.first_wait("uid-1"), "forgotten once it no longer waited");

        let (off, annotation) = DiskFloor::new(dir.path().into(), Err("no tart home".into()), 0);
        let state = off.check();
        assert_eq!(state.pressure, None);
        assert!(state.readings[1].free.is_err());
        assert_eq!(*annotation.borrow(), None);
    }
}
