//! The loop: keep an up-to-date picture of the deadline folder, ask [`plan`] what is due, start a
//! bounded number of [`reap`] jobs, and sleep exactly until the next thing is due.
//!
//! Why a rescan of the folder rather than inotify/kqueue/FSEvents: the folder holds a handful of
//! small files (at most a few VMs per host) and one `read_dir` plus a `stat` per file costs
//! microseconds, so rescanning every second is negligible idle CPU, needs no extra dependency,
//! behaves the same on macOS and Linux, and cannot miss events (no queue overflows, no watch lost
//! when the folder is recreated). New files matter only when already overdue (the agent writes
//! them before `tart clone`, long before their deadline), and a removed file is re-checked right
//! before a job acts, so one second of staleness never makes the watchdog act wrongly. Deadlines
//! themselves are not found by polling: the loop sleeps until the earliest `deadline + grace`.

use crate::deadline::{self, ReadError};
use crate::plan::{self, Fingerprint, Tracked, is_ours, vm_of_file};
use crate::reap::{self, Ctx, Job, Outcome, Skip};
use crate::record::{Action, Line, Record, RecordError};
use crate::scan;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tartan_tart::{Tart, Timeouts};
use tokio::task::JoinSet;

/// The source document's grace after the host execution deadline.
pub const DEFAULT_GRACE: SignedDuration = SignedDuration::from_secs(60);
/// How often the deadline folder is listed for new and removed files.
pub const DEFAULT_RESCAN: Duration = Duration::from_secs(1);
/// How many VMs are stopped and deleted at the same time.
pub const DEFAULT_CONCURRENCY: usize = 4;
/// The folder inside the state directory holding one `<vm>.json` per VM.
pub const DEADLINES_DIR: &str = "deadlines";
/// The watchdog's own lock (never the agent's `.lock`): one watchdog per state directory.
pub const LOCK_FILE: &str = "watchdog.lock";

/// How the watchdog runs.
#[derive(Clone, Debug)]
pub struct Config {
    pub state_dir: PathBuf,
    pub grace: SignedDuration,
    /// The tart program (a name on PATH or a path).
    pub tart_program: PathBuf,
    /// tart's home; `None` uses tart's own default (`$TART_HOME`, else `~/.tart`).
    pub tart_home: Option<PathBuf>,
    pub rescan: Duration,
    pub concurrency: usize,
    /// First retry delay after a failed delete; doubled per failure up to `retry_cap`.
    pub retry_base: Duration,
    pub retry_cap: Duration,
    pub kill_timeout: Duration,
    /// `tart stop --timeout`; the call itself is bounded by this plus `stop_margin`.
    pub stop_timeout: Duration,
    pub stop_margin: Duration,
    pub delete_timeout: Duration,
    /// On shutdown, how long running jobs may finish before they are abandoned (their tart
    /// children are killed; the deadline files stay, so the next watchdog picks them up).
    pub shutdown_wait: Duration,
}

impl Config {
    pub fn new(state_dir: impl Into<PathBuf>) -> Config {
        Config {
            state_dir: state_dir.into(),
            grace: DEFAULT_GRACE,
            tart_program: PathBuf::from("tart"),
            tart_home: None,
            rescan: DEFAULT_RESCAN,
            concurrency: DEFAULT_CONCURRENCY,
            retry_base: Duration::from_secs(2),
            retry_cap: Duration::from_secs(60),
            kill_timeout: Duration::from_secs(20),
            stop_timeout: Duration::from_secs(5),
            stop_margin: Duration::from_secs(10),
            delete_timeout: Duration::from_secs(30),
            shutdown_wait: Duration::from_secs(5),
        }
    }

    pub fn deadlines_dir(&self) -> PathBuf {
        self.state_dir.join(DEADLINES_DIR)
    }
}

/// Why the watchdog could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot create the state directory {path}: {source}; check the path and its permissions")]
    StateDir { path: PathBuf, source: std::io::Error },
    #[error("cannot open the watchdog lock {path}: {source}")]
    Lock { path: PathBuf, source: std::io::Error },
    #[error("another watchdog holds {path}; exiting (only one watchdog per state directory)")]
    AlreadyRunning { path: PathBuf },
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// What the loop knows between wakes.
#[derive(Default)]
struct Picture {
    listing: BTreeMap<String, Fingerprint>,
    tracked: BTreeMap<String, Tracked>,
    /// VMs a job is working on. Kept apart from `tracked`, which follows the folder, so a file
    /// removed and recreated during a job never starts a second job on the same VM.
    busy: BTreeSet<String>,
    /// The last listing error, so a persistent one is logged once rather than every second.
    list_error: Option<String>,
}

/// Runs until `shutdown` resolves. Returns an error only if it cannot start (state directory,
/// its own lock, the record file); everything after that is recorded and retried.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    if config.concurrency == 0 {
        return Err(Error::Config("concurrency must be at least 1".into()));
    }
    if config.grace.is_negative() {
        return Err(Error::Config(format!(
            "grace must not be negative, got {}",
            config.grace
        )));
    }
    std::fs::create_dir_all(&config.state_dir).map_err(|source| Error::StateDir {
        path: config.state_dir.clone(),
        source,
    })?;
    let _lock = take_own_lock(&config.state_dir)?;
    let record = Record::open(&config.state_dir)?;
    let timeouts = Timeouts {
        delete: config.delete_timeout,
        stop_margin: config.stop_margin,
        ..Timeouts::default()
    };
    let tart = Tart::new(&config.tart_program, config.tart_home.clone()).with_timeouts(timeouts);
    let ctx = Arc::new(Ctx {
        tart,
        record,
        grace: config.grace,
        kill_timeout: config.kill_timeout,
        stop_timeout: config.stop_timeout,
        retry_base: config.retry_base,
        retry_cap: config.retry_cap,
    });
    let dir = config.deadlines_dir();
    tracing::info!(
        deadlines = %dir.display(),
        grace = %config.grace,
        record = %ctx.record.path().display(),
        "watchdog started"
    );

    let mut picture = Picture::default();
    let mut jobs: JoinSet<(String, Outcome)> = JoinSet::new();
    let mut last_scan: Option<Instant> = None;
    tokio::pin!(shutdown);

    loop {
        let mut bad = Vec::new();
        if last_scan.is_none_or(|t| t.elapsed() >= config.rescan) {
            bad = rescan(&dir, &mut picture);
            last_scan = Some(Instant::now());
        }

        let now = Timestamp::now();
        let due = plan::overdue(&picture.tracked, now, config.grace);
        let mut held_back = false;
        for vm in due {
            if jobs.len() >= config.concurrency {
                held_back = true;
                break;
            }
            let Some(t) = picture.tracked.get_mut(&vm) else {
                continue;
            };
            t.in_flight = true;
            picture.busy.insert(vm.clone());
            let job = Job {
                file: dir.join(format!("{vm}.json")),
                vm,
                deadline: t.deadline,
                failures: t.failures,
            };
            tracing::info!(vm = %job.vm, deadline = %job.deadline, attempt = job.failures + 1, "VM overdue; deleting it");
            jobs.spawn(reap::reap(ctx.clone(), job));
        }
        if !bad.is_empty() {
            // Off the loop, after the VMs due: the jobs and the loop go on meanwhile.
            let ctx = ctx.clone();
            tokio::task::spawn_blocking(move || record_all(&ctx.record, bad));
        }

        // Sleep until the next VM is due, the next rescan, or a job finishing (which may free a
        // slot for a held-back VM or need a retry scheduled).
        let until_rescan = config
            .rescan
            .saturating_sub(last_scan.map_or(Duration::ZERO, |t| t.elapsed()));
        let sleep = if held_back {
            until_rescan
        } else {
            plan::sleep_for(
                plan::next_wake(&picture.tracked, config.grace),
                Timestamp::now(),
                until_rescan,
            )
        };
        tokio::select! {
            () = &mut shutdown => break,
            () = tokio::time::sleep(sleep) => {}
            Some(done) = jobs.join_next(), if !jobs.is_empty() => finish(done, &mut picture, &config),
        }
    }

    tracing::info!(running = jobs.len(), "watchdog stopping");
    let drain = async {
        while let Some(done) = jobs.join_next().await {
            finish(done, &mut picture, &config);
        }
    };
    if tokio::time::timeout(config.shutdown_wait, drain).await.is_err() {
        tracing::warn!(
            "jobs still running after {:?} were abandoned; their deadline files remain for the next watchdog",
            config.shutdown_wait
        );
        jobs.shutdown().await;
    }
    Ok(())
}

fn take_own_lock(state_dir: &Path) -> Result<File, Error> {
    let path = state_dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|source| Error::Lock {
            path: path.clone(),
            source,
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::AlreadyRunning { path }),
        Err(std::fs::TryLockError::Error(source)) => Err(Error::Lock { path, source }),
    }
}

/// Brings the picture up to date with the folder: reads new and changed files, forgets removed
/// ones. Returns the record lines of the bad files it met, for the caller to write once the VMs
/// due are on their way: thousands of bad files (each line synced) must not hold back a VM.
fn rescan(dir: &Path, picture: &mut Picture) -> Vec<Line> {
    let mut bad = Vec::new();
    let listing = match scan::list(dir) {
        Ok(listing) => {
            picture.list_error = None;
            listing
        }
        Err(e) => {
            let msg = format!(
                "cannot list the deadline folder {}: {e}; trying again every rescan",
                dir.display()
            );
            if picture.list_error.as_deref() != Some(msg.as_str()) {
                tracing::error!("{msg}");
                picture.list_error = Some(msg);
            }
            return bad;
        }
    };
    let changes = plan::diff(&picture.listing, &listing);
    for name in &changes.removed {
        if let Some(vm) = vm_of_file(name) {
            picture.tracked.remove(vm);
        }
    }
    let mut listing = listing;
    for name in &changes.changed {
        let Some(vm) = vm_of_file(name) else { continue };
        match deadline::read(&dir.join(name)) {
            Ok(view) if is_ours(&view.vm) => match picture.tracked.get_mut(vm) {
                Some(t) => t.deadline = view.deadline,
                None => {
                    let in_flight = picture.busy.contains(vm);
                    picture.tracked.insert(
                        vm.to_string(),
                        Tracked {
                            in_flight,
                            ..Tracked::new(view.deadline)
                        },
                    );
                }
            },
            Ok(view) => {
                bad.push(bad_file(
                    vm,
                    Some(view.deadline),
                    format!(
                        "{} names VM {:?}, which lacks the agent's prefix {:?}; the watchdog never touches it. Left in place for an operator",
                        dir.join(name).display(),
                        view.vm,
                        tartan_api::VM_PREFIX
                    ),
                ));
                picture.tracked.remove(vm);
            }
            Err(ReadError::Missing) => {
                // Gone between listing and reading: the next rescan sees it as removed.
                listing.remove(name);
            }
            Err(ReadError::Bad(why)) => {
                bad.push(bad_file(vm, None, format!("{why}; left in place for an operator")));
                picture.tracked.remove(vm);
            }
        }
    }
    picture.listing = listing;
    bad
}

/// The record line of a bad file, once per version of it (the rescan reads a file again only
/// when it changes).
fn bad_file(vm: &str, deadline: Option<Timestamp>, detail: String) -> Line {
    tracing::warn!(vm, "bad deadline file: {detail}");
    Line::new(Timestamp::now(), vm, deadline, Action::BadDeadlineFile, detail)
}

/// Appends `lines` to the record, each synced.
fn record_all(record: &Record, lines: Vec<Line>) {
    for line in lines {
        if let Err(e) = record.append(&line) {
            tracing::error!(vm = %line.vm, "{e}");
        }
    }
}

/// Books a finished job.
fn finish(done: Result<(String, Outcome), tokio::task::JoinError>, picture: &mut Picture, config: &Config) {
    let (vm, outcome) = match done {
        Ok(done) => done,
        Err(e) => {
            // A panicking job must not leave its VM stuck "in flight": unmark every VM no job owns.
            // Jobs never panic by design; if one did, nothing says which VM it had, so every
            // busy VM is released (at worst a VM is attempted twice; tart serialises that).
            tracing::error!("a watchdog job ended abnormally: {e}; its VM will be retried");
            picture.busy.clear();
            for t in picture.tracked.values_mut() {
                t.in_flight = false;
            }
            return;
        }
    };
    picture.busy.remove(&vm);
    match outcome {
        Outcome::Done => {
            picture.tracked.remove(&vm);
        }
        Outcome::Skipped(Skip::Gone) => {
            tracing::info!(
                vm,
                "not acting: the deadline file was removed (the agent finished with the VM)"
            );
            picture.tracked.remove(&vm);
        }
        Outcome::Skipped(Skip::Bad(why)) => {
            // The rescan records the bad file when it sees the change.
            tracing::warn!(vm, "not acting: {why}");
            picture.tracked.remove(&vm);
        }
        Outcome::Skipped(Skip::NotDue(deadline)) => {
            tracing::info!(vm, %deadline, "not acting: the deadline file now names a later deadline");
            if let Some(t) = picture.tracked.get_mut(&vm) {
                t.in_flight = false;
                t.deadline = deadline;
            }
        }
        Outcome::Failed => {
            if let Some(t) = picture.tracked.get_mut(&vm) {
                t.in_flight = false;
                t.failures = t.failures.saturating_add(1);
                let wait = plan::backoff(t.failures, config.retry_base, config.retry_cap);
                t.retry_at = Some(plan::add(
                    Timestamp::now(),
                    SignedDuration::try_from(wait).unwrap_or(SignedDuration::MAX),
                ));
            }
        }
    }
}

/// Resolves on SIGTERM (launchd's stop) or SIGINT. If the handlers cannot be installed the error
/// is logged and this never resolves (the process is then stopped by SIGKILL, which is safe:
/// every action is recorded before its deadline file is removed).
pub async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received"),
                _ = int.recv() => tracing::info!("SIGINT received"),
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!("cannot install the SIGTERM/SIGINT handlers: {e}; only SIGKILL will stop the watchdog");
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::read_lines;
    use tartan_api::deadline::{DeadlineFile, write_deadline_file};

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn write(dir: &Path, vm: &str, deadline: &str) {
        let file = DeadlineFile {
            vm: vm.into(),
            namespace: "ci".into(),
            name: "b".into(),
            uid: "u".into(),
            attempt: 1,
            deadline: ts(deadline),
            agent: "a".into(),
            written_at: ts(deadline),
        };
        write_deadline_file(dir, &file).unwrap();
    }

    struct Fixture {
        _tmp: tempfile::TempDir,
        dir: PathBuf,
        record: Record,
        picture: Picture,
    }

    impl Fixture {
        fn new() -> Fixture {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join(DEADLINES_DIR);
            let record = Record::open(tmp.path()).unwrap();
            Fixture {
                _tmp: tmp,
                dir,
                record,
                picture: Picture::default(),
            }
        }
        fn rescan(&mut self) {
            let bad = rescan(&self.dir, &mut self.picture);
            record_all(&self.record, bad);
        }
        fn actions(&self) -> Vec<(String, Action)> {
            read_lines(self.record.path())
                .unwrap()
                .into_iter()
                .map(|l| (l.vm, l.action))
                .collect()
        }
        fn tracked(&self) -> Vec<(&str, Timestamp, bool)> {
            self.picture
                .tracked
                .iter()
                .map(|(vm, t)| (vm.as_str(), t.deadline, t.in_flight))
                .collect()
        }
    }

    const D1: &str = "2026-10-05T02:55:36.40012Z";
    const D2: &str = "2026-10-05T03:00:00Z";

    #[test]
    fn rescan_follows_added_changed_and_removed_files() {
        let mut f = Fixture::new();
        f.rescan(); // no folder yet: nothing, no error
        assert!(f.picture.tracked.is_empty() && f.picture.list_error.is_none());
        write(&f.dir, "mb-a", D1);
        write(&f.dir, "mb-b", D1);
        f.rescan();
        assert_eq!(f.tracked(), vec![("mb-a", ts(D1), false), ("mb-b", ts(D1), false)]);
        write(&f.dir, "mb-a", D2);
        std::fs::remove_file(f.dir.join("mb-b.json")).unwrap();
        f.rescan();
        assert_eq!(f.tracked(), vec![("mb-a", ts(D2), false)]);
        assert!(f.actions().is_empty());
    }

    #[test]
    fn a_bad_file_is_recorded_once_per_version_and_never_tracked() {
        let mut f = Fixture::new();
        std::fs::create_dir_all(&f.dir).unwrap();
        std::fs::write(f.dir.join("mb-bad.json"), "{").unwrap();
        f.rescan();
        f.rescan();
        f.rescan();
        assert_eq!(f.actions(), vec![("mb-bad".to_string(), Action::BadDeadlineFile)]);
        assert!(f.picture.tracked.is_empty());
        // Repaired by the agent: tracked, nothing more recorded.
        write(&f.dir, "mb-bad", D1);
        f.rescan();
        assert_eq!(f.tracked(), vec![("mb-bad", ts(D1), false)]);
        // Broken again (a new version): recorded again, once, and no longer tracked.
        std::fs::write(f.dir.join("mb-bad.json"), "[]").unwrap();
        f.rescan();
        f.rescan();
        assert_eq!(f.actions().len(), 2);
        assert!(f.picture.tracked.is_empty());
    }

    #[test]
    fn a_file_recreated_while_its_vm_is_busy_does_not_start_a_second_job() {
        let mut f = Fixture::new();
        write(&f.dir, "mb-a", D1);
        f.rescan();
        // The loop started a job on mb-a.
        f.picture.busy.insert("mb-a".into());
        f.picture.tracked.get_mut("mb-a").unwrap().in_flight = true;
        std::fs::remove_file(f.dir.join("mb-a.json")).unwrap();
        f.rescan();
        assert!(f.picture.tracked.is_empty());
        write(&f.dir, "mb-a", D1);
        f.rescan();
        assert_eq!(f.tracked(), vec![("mb-a", ts(D1), true)]);
        assert!(plan::overdue(&f.picture.tracked, ts(D2), SignedDuration::ZERO).is_empty());
    }

    fn config() -> Config {
        let mut c = Config::new("/nonexistent");
        c.retry_base = Duration::from_secs(2);
        c.retry_cap = Duration::from_secs(5);
        c
    }

    fn busy(f: &mut Fixture, vm: &str) {
        f.picture.busy.insert(vm.into());
        f.picture.tracked.insert(
            vm.into(),
            Tracked {
                in_flight: true,
                ..Tracked::new(ts(D1))
            },
        );
    }

    #[test]
    fn finished_jobs_are_booked() {
        let mut f = Fixture::new();
        let c = config();
        busy(&mut f, "mb-done");
        finish(Ok(("mb-done".into(), Outcome::Done)), &mut f.picture, &c);
        assert!(f.picture.tracked.is_empty() && f.picture.busy.is_empty());

        busy(&mut f, "mb-gone");
        finish(Ok(("mb-gone".into(), Outcome::Skipped(Skip::Gone))), &mut f.picture, &c);
        assert!(f.picture.tracked.is_empty() && f.picture.busy.is_empty());

        busy(&mut f, "mb-later");
        finish(
            Ok(("mb-later".into(), Outcome::Skipped(Skip::NotDue(ts(D2))))),
            &mut f.picture,
            &c,
        );
        assert_eq!(f.tracked(), vec![("mb-later", ts(D2), false)]);
        f.picture.tracked.clear();

        busy(&mut f, "mb-fail");
        let before = Timestamp::now();
        for n in 1..=3u32 {
            finish(Ok(("mb-fail".into(), Outcome::Failed)), &mut f.picture, &c);
            let t = &f.picture.tracked["mb-fail"];
            assert_eq!((t.failures, t.in_flight), (n, false));
            let wait = plan::backoff(n, c.retry_base, c.retry_cap);
            let retry = t.retry_at.unwrap();
            assert!(
                retry >= plan::add(before, SignedDuration::try_from(wait).unwrap()),
                "retry {n} waits {wait:?}"
            );
            assert!(retry <= plan::add(Timestamp::now(), SignedDuration::try_from(wait).unwrap()));
        }
        assert!(f.picture.busy.is_empty());
    }

    #[test]
    fn a_failed_job_whose_file_was_removed_is_not_retried() {
        let mut f = Fixture::new();
        busy(&mut f, "mb-a");
        f.picture.tracked.clear(); // the rescan saw the file go while the job ran
        finish(Ok(("mb-a".into(), Outcome::Failed)), &mut f.picture, &config());
        assert!(f.picture.tracked.is_empty() && f.picture.busy.is_empty());
    }
}
