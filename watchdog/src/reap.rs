//! Carrying out one decision: make one overdue VM go away, prove it, record it, then drop its
//! deadline file. Every step is bounded by a timeout smaller than the whole job's budget.

use crate::deadline::{self, ReadError};
use crate::plan::{self, is_ours};
use crate::record::{Action, Line, Record};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tartan_tart::{Tart, TartError};

/// Everything a job needs, shared by all jobs.
#[derive(Debug)]
pub struct Ctx {
    pub tart: Tart,
    pub record: Record,
    pub grace: SignedDuration,
    /// Bound on killing a VM's tart processes (covers the driver's own wait for them to die).
    pub kill_timeout: Duration,
    /// `tart stop --timeout` (the driver adds its margin to the call's limit).
    pub stop_timeout: Duration,
    pub retry_base: Duration,
    pub retry_cap: Duration,
}

/// One overdue VM to deal with.
#[derive(Clone, Debug)]
pub struct Job {
    pub vm: String,
    pub deadline: Timestamp,
    pub file: PathBuf,
    /// Failed attempts so far.
    pub failures: u32,
}

/// How a job ended, for the loop's bookkeeping.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The VM is confirmed gone, recorded, and its deadline file removed.
    Done,
    /// Something failed and was recorded; try again after the backoff.
    Failed,
    /// Nothing was touched: the deadline file changed since the loop read it.
    Skipped(Skip),
}

/// Why a job did not act after all.
#[derive(Debug, PartialEq, Eq)]
pub enum Skip {
    /// The deadline file is gone: the agent finished with the VM.
    Gone,
    /// The deadline file is no longer usable (the loop records that when it rereads it).
    Bad(String),
    /// The deadline file now names a deadline (plus grace) still in the future.
    NotDue(Timestamp),
}

/// Runs one job to its end. Never panics on I/O; every failure becomes a `delete-failed` (or
/// `deadline-file-remove-failed`) line and [`Outcome::Failed`].
pub async fn reap(ctx: Arc<Ctx>, job: Job) -> (String, Outcome) {
    let outcome = reap_inner(&ctx, &job).await;
    (job.vm, outcome)
}

async fn reap_inner(ctx: &Ctx, job: &Job) -> Outcome {
    // The loop's listing may be up to one rescan old: look again right before touching anything.
    if !is_ours(&job.vm) {
        return Outcome::Skipped(Skip::Bad(format!("{} lacks the agent's prefix", job.vm)));
    }
    match deadline::read(&job.file) {
        Err(ReadError::Missing) => return Outcome::Skipped(Skip::Gone),
        Err(ReadError::Bad(why)) => return Outcome::Skipped(Skip::Bad(why)),
        Ok(view) if plan::add(view.deadline, ctx.grace) > Timestamp::now() => {
            return Outcome::Skipped(Skip::NotDue(view.deadline));
        }
        Ok(_) => {}
    }

    let started = Instant::now();
    let retry_in = plan::backoff(job.failures + 1, ctx.retry_base, ctx.retry_cap);
    let fail = |detail: String| {
        let detail = format!("{detail}; retry {} in {}", job.failures + 1, secs(retry_in));
        append(ctx, job, Action::DeleteFailed, detail);
        Outcome::Failed
    };

    let killed = match tokio::time::timeout(ctx.kill_timeout, ctx.tart.kill_vm_processes(&job.vm)).await {
        Ok(Ok(report)) => report.count(),
        Ok(Err(e)) => return fail(format!("could not kill the tart processes of {}: {e}", job.vm)),
        Err(_) => {
            return fail(format!(
                "killing the tart processes of {} did not finish within {}",
                job.vm,
                secs(ctx.kill_timeout)
            ));
        }
    };

    // After the kill nothing should be running; `stop` covers a `tart run` the kill could not see
    // (e.g. started a moment later). "Not running" and "does not exist" are fine here.
    let stop_note = match ctx.tart.stop(&job.vm, ctx.stop_timeout).await {
        Ok(()) => String::new(),
        Err(e) if e.is_not_running() || e.is_vm_missing() => String::new(),
        Err(e) => format!("; tart stop failed ({e}), deleting anyway"),
    };

    let absent = match ctx.tart.delete(&job.vm).await {
        Ok(()) => false,
        Err(e) if e.is_vm_missing() => true,
        Err(e) => {
            return fail(format!(
                "killed {killed} tart process(es){stop_note}; {}",
                delete_message(&e)
            ));
        }
    };

    let dir = match ctx.tart.vm_dir(&job.vm) {
        Ok(dir) => dir,
        Err(e) => {
            return fail(format!(
                "killed {killed} tart process(es); cannot confirm deletion: {e}"
            ));
        }
    };
    if let Some(why) = still_there(&dir) {
        let said = if absent {
            "tart delete said it does not exist"
        } else {
            "tart delete succeeded"
        };
        return fail(format!(
            "killed {killed} tart process(es){stop_note}; {said}, but {why}"
        ));
    }

    let elapsed = started.elapsed();
    let (action, detail) = if absent {
        (
            Action::AlreadyAbsent,
            format!("killed {killed} tart process(es){stop_note}; the VM was already absent"),
        )
    } else {
        (
            Action::Deleted,
            format!(
                "killed {killed} tart process(es){stop_note}; stopped and deleted in {:.2}s",
                elapsed.as_secs_f64()
            ),
        )
    };
    // Record first, then drop the deadline file: a crash in between re-runs the job, which then
    // finds the VM absent and records that, rather than losing the record of the deletion.
    if !append(ctx, job, action, detail) {
        return Outcome::Failed;
    }
    let removed = match job.file.parent() {
        Some(dir) => tartan_api::deadline::remove_deadline_file(dir, &job.vm)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        None => Err(format!("{} has no parent folder", job.file.display())),
    };
    match removed {
        Ok(()) => Outcome::Done,
        Err(e) => {
            let detail = format!(
                "the VM is gone, but its deadline file could not be removed: {e}; retry {} in {}",
                job.failures + 1,
                secs(retry_in)
            );
            append(ctx, job, Action::DeadlineFileRemoveFailed, detail);
            Outcome::Failed
        }
    }
}

/// Appends a line; a record that cannot be written is logged (the job then counts as failed and
/// is retried, so the action is recorded once the disk allows).
fn append(ctx: &Ctx, job: &Job, action: Action, detail: String) -> bool {
    let line = Line::new(Timestamp::now(), &job.vm, Some(job.deadline), action, detail);
    match ctx.record.append(&line) {
        Ok(()) => true,
        Err(e) => {
            tracing::error!(vm = %job.vm, "{e}");
            false
        }
    }
}

fn delete_message(e: &TartError) -> String {
    match e {
        TartError::VmRunning { .. } => format!("{e} (a tart run survived the kill)"),
        _ => e.to_string(),
    }
}

/// `None` when `dir` is confirmed absent; otherwise why not.
fn still_there(dir: &Path) -> Option<String> {
    match dir.symlink_metadata() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => Some(format!("{} cannot be checked: {e}", dir.display())),
        Ok(_) => Some(format!("{} still exists", dir.display())),
    }
}

fn secs(d: Duration) -> String {
    format!("{}s", d.as_secs_f64())
}
