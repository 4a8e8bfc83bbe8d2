//! The host side of one attempt: the attempt machine's host actions performed with tart.
//!
//! The runtime owns the loop "step → journal (synced) → act → event". [`AttemptExecutor`] is the
//! "act" for host actions: [`AttemptExecutor::perform`] takes one [`Action`] of a transition that
//! is already journaled and returns [`Performed::Done`] (go on with the next action),
//! [`Performed::Event`] (the event the machine expects next; drop the remaining actions) or
//! [`Performed::NotHost`] (claim, slot, status, finalizer, next attempt: the runtime's own).
//! Since the executor acts only when asked, no tart side effect happens before its record:
//! `Admitted` is journaled, then the deadline file is written; `Booting` is journaled, then
//! `tart clone` runs.
//!
//! [`drive`] is that loop for one attempt, with the journal and the non-host actions behind
//! [`AttemptHooks`]; the runtime may use it or its own loop around `perform`.
//!
//! Interruptions: a withdrawal sent through [`CancelHandle`] or the host execution deadline
//! interrupts any action of an open phase (deadline file, clone, set, run, readiness, steps,
//! collection, upload) at once: the in-flight tart child is SIGKILLed, `tart run` too, and the
//! action returns `CancelRequested`/`OwnerDeleted`/`DeadlinePassed`. Retiring actions (stop,
//! delete, retry, deadline-file removal) are never interrupted.
//!
//! Files under the state directory: `deadlines/<vm>.json` (the watchdog's), `logs/<vm>/<step>.log`
//! (each capped; `_checkout.log`, `_probe.log`, `_tart-run.log` for Tartan's own commands) and
//! `tmp/<vm>/` (guest files on their way to the destination; removed with the VM).
//!
//! Guest paths (test report, artifacts) are read with `tart exec NAME sh -c SCRIPT sh PATH CAP`
//! ([`executor::READ_GUEST_FILE`]: a regular file within CAP is `cat`, anything else refused),
//! relative to the exec working directory (the guest user's home on a Mac, the VM folder with
//! `tart-double`), the exec killed at CAP and after a time limit. tart exec merges the guest's
//! stderr into what is read, so a read that succeeds must not write to stderr (it does not).

pub mod artifacts;
pub mod disk;
pub mod env;
pub mod executor;
pub mod guest_copy;
pub mod guest_job;
pub mod junit;
pub mod log_shipper;
pub mod logs;
pub mod mounts;
pub mod nofollow;
pub mod step_timeout;
pub mod steps;

pub use artifacts::{Destination, DestinationPolicy, DestinationRefused, UploadPolicy};
pub use executor::{
    AttemptExecutor, CancelHandle, CancelSignal, ExecutorConfig, HostAttempt, Performed, Withdrawal, cancel_pair,
};
pub use junit::{TestCounts, count_report, parse_report};

use crate::machine::{self, Action, Attempt, Event, Refusal, Transition};
use crate::record::Record;
use k8s_openapi::jiff::Timestamp;
use std::future::Future;
use tartan_api::{AttemptState, BuildResults};

/// The runtime's part of [`drive`].
pub trait AttemptHooks {
    /// Journals `t` for `attempt` and returns the record once it is synced; `results` is what the
    /// executor has gathered so far and `logs` where it ships the step logs, if it does (both for
    /// the status snapshot). On error nothing of `t` is performed and [`drive`] returns the error
    /// (fail closed).
    fn journal(
        &mut self,
        attempt: &Attempt,
        t: &Transition,
        results: &BuildResults,
        logs: Option<&str>,
    ) -> impl Future<Output = Result<Record, String>> + Send;

    /// Performs a non-host action (claim, slot release, status delivery, finalizer, next
    /// attempt); returns the event it produced, if any.
    fn act(&mut self, attempt: &Attempt, action: &Action) -> impl Future<Output = Option<Event>> + Send;
}

/// Why [`drive`] stopped before the attempt was retired.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error("attempt {attempt}: {refusal}; nothing was performed for it")]
    Refused { attempt: String, refusal: Refusal },
    #[error("attempt {attempt}: journaling {transition} failed: {error}; its actions were not performed")]
    Journal {
        attempt: String,
        transition: String,
        error: String,
    },
}

/// Feeds `first` to the machine and follows the attempt through journal and actions until it is
/// `Retired` (or a transition's actions end without an event, as for a claim loser). After the
/// admission's actions `Boot` follows by itself. Returns the final state.
pub async fn drive(
    exec: &mut AttemptExecutor,
    attempt: &mut Attempt,
    first: Event,
    cfg: &machine::Config,
    hooks: &mut impl AttemptHooks,
) -> Result<AttemptState, DriveError> {
    let mut event = first;
    loop {
        let t = machine::step(attempt, event, Timestamp::now(), cfg).map_err(|refusal| DriveError::Refused {
            attempt: attempt.key().to_string(),
            refusal,
        })?;
        let logs = exec.logs_location();
        let record = match hooks.journal(attempt, &t, &exec.results(), logs.as_deref()).await {
            Ok(record) => record,
            Err(error) => {
                if attempt.state.may_have_vm() {
                    // Nothing more can be recorded, but a VM left running would hold the Mac until
                    // the watchdog's deadline: stop and delete it anyway. Leaving that unrecorded
                    // is safe — recovery finds the VM absent and retires the attempt as
                    // interrupted, as after a crash.
                    let done = exec
                        .perform(&Action::StopAndDeleteVm {
                            vm: attempt.vm.clone(),
                            context: machine::DeleteContext::Normal,
                        })
                        .await;
                    tracing::warn!(attempt = %attempt.key(), ?done, "journal failed; the VM is stopped and deleted anyway");
                }
                return Err(DriveError::Journal {
                    attempt: attempt.key().to_string(),
                    transition: format!("{:?} -> {}", t.from, t.to),
                    error,
                });
            }
        };
        attempt.observe(&record);
        let mut next = None;
        for action in &t.actions {
            let produced = match exec.perform(action).await {
                Performed::Done => None,
                Performed::Event(ev) => Some(ev),
                Performed::NotHost => hooks.act(attempt, action).await,
            };
            if produced.is_some() {
                next = produced;
                break;
            }
        }
        event = match next {
            Some(ev) => ev,
            None if attempt.state == AttemptState::Admitted => Event::Boot,
            None => return Ok(attempt.state),
        };
    }
}
