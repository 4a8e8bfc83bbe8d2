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
        if last_scan.is_none_or(|t| t.elapsed() >= config.rescan) {
            rescan(&dir, &mut picture, &ctx.record);
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

/// Brings the picture up to date with the folder: reads new and changed files, forgets removed ones.
fn rescan(dir: &Path, picture: &mut Picture, record: &Record) {
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
            return;
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
                bad_file(
                    record,
                    vm,
                    Some(view.deadline),
                    format!(
                        "{} names VM {:?}, which lacks the agent's prefix {:?}; the watchdog never touches it. Left in place for an operator",
                        dir.join(name).display(),
                        view.vm,
                        tartan_api::VM_PREFIX
                    ),
                );
                picture.tracked.remove(vm);
            }
            Err(ReadError::Missing) => {
                // Gone between listing and reading: the next rescan sees it as removed.
                listing.remove(name);
            }
            Err(ReadError::Bad(why)) => {
                bad_file(record, vm, None, format!("{why}; left in place for an operator"));
                picture.tracked.remove(vm);
            }
        }
    }
    picture.listing = listing;
}

fn bad_file(record: &Record, vm: &str, deadline: Option<Timestamp>, detail: String) {
    let line = Line::new(Timestamp::now(), vm, deadline, Action::BadDeadlineFile, detail);
    if let Err(e) = record.append(&line) {
        tracing::error!(vm, "{e}");
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
