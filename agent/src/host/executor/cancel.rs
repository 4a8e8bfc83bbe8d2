//! Cancellation: the withdrawal signal between the runtime ([`CancelHandle`]) and the executor
//! ([`CancelSignal`]), and [`AttemptExecutor::guarded`], which runs an open phase's work unless a
//! withdrawal or the host execution deadline comes first, then kills the VM's tart processes and
//! says which came.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::time::{Duration, Instant};
use tokio::sync::watch;

use super::{AttemptExecutor, Performed};
use crate::machine::Event;

/// Why the build is being withdrawn (the reason the machine records).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Withdrawal {
    /// The MacBuild asked for cancellation (or is being deleted).
    CancelRequested,
    /// The MacBuild's owner (the CustomRun) was deleted.
    OwnerDeleted,
    /// A status write of the attempt was fenced out: its claim moved to another holder.
    ClaimMoved,
}

type Signal = Option<(Withdrawal, Instant)>;

/// The runtime's side of the cancellation signal: [`CancelHandle::cancel`] stops the attempt in
/// whatever phase it is, at once.
#[derive(Debug)]
pub struct CancelHandle(watch::Sender<Signal>);

/// The executor's side of the cancellation signal.
#[derive(Clone, Debug)]
pub struct CancelSignal(watch::Receiver<Signal>);

/// A connected pair of cancellation handle and signal.
pub fn cancel_pair() -> (CancelHandle, CancelSignal) {
    let (tx, rx) = watch::channel(None);
    (CancelHandle(tx), CancelSignal(rx))
}

impl CancelHandle {
    /// Withdraws the build. The first call wins; later ones change nothing.
    pub fn cancel(&self, why: Withdrawal) {
        self.0.send_if_modified(|v| {
            if v.is_some() {
                return false;
            }
            *v = Some((why, Instant::now()));
            true
        });
    }
}

impl CancelSignal {
    /// The withdrawal, if one was signalled.
    pub fn current(&self) -> Option<Withdrawal> {
        self.0.borrow().map(|(w, _)| w)
    }

    /// Resolves once a withdrawal is signalled (never, if the handle was dropped without one).
    async fn wait(&mut self) -> (Withdrawal, Instant) {
        let signalled = self.0.wait_for(Option::is_some).await.map(|v| *v);
        match signalled {
            Ok(Some(v)) => v,
            // The handle is gone without a withdrawal: none will come.
            Ok(None) | Err(_) => std::future::pending().await,
        }
    }
}

enum Interrupt {
    Withdrawn(Withdrawal, Instant),
    Deadline,
}

impl AttemptExecutor {
    /// Runs `work` unless a withdrawal or the deadline comes first; if one does, the work is
    /// dropped (its tart child is SIGKILLed by `kill_on_drop`) and every tart process of the VM
    /// is killed before the matching event is returned.
    pub(super) async fn guarded<F>(&mut self, work: F) -> Performed
    where
        F: for<'a> FnOnce(&'a mut Self) -> std::pin::Pin<Box<dyn std::future::Future<Output = Performed> + Send + 'a>>,
    {
        let mut cancel = self.cancel.clone();
        let deadline = self.attempt.deadline;
        let signalled = *cancel.0.borrow();
        // Whichever was seen first is the reason. A withdrawal seen only after the deadline (an
        // agent paused or slow past it) gives way to the deadline: the time was up first, and the
        // watchdog may have deleted the VM since, which is then what it says. One seen before the
        // deadline but acted on only after it (a slow journal sync in between) is still the reason.
        let past_deadline = || Timestamp::now() >= deadline;
        let interrupt = if let Some((w, at)) = signalled
            && seen_before(at.elapsed(), Timestamp::now(), deadline)
        {
            Some(Interrupt::Withdrawn(w, at))
        } else if past_deadline() {
            Some(Interrupt::Deadline)
        } else if let Some((w, at)) = signalled {
            Some(Interrupt::Withdrawn(w, at))
        } else {
            tokio::select! {
                biased;
                (w, at) = cancel.wait() => Some(if past_deadline() {
                    Interrupt::Deadline
                } else {
                    Interrupt::Withdrawn(w, at)
                }),
                () = until(deadline) => Some(Interrupt::Deadline),
                done = work(self) => return done,
            }
        };
        let Some(interrupt) = interrupt else {
            return Performed::Done;
        };
        let killed = self.kill_children().await;
        let vm = &self.attempt.vm;
        match interrupt {
            Interrupt::Withdrawn(why, at) => {
                let took = at.elapsed();
                self.interrupt_latency = Some(took);
                tracing::info!(%vm, ?why, killed, took = ?took, "build withdrawn; tart children killed");
                Performed::Event(match why {
                    Withdrawal::CancelRequested => Event::CancelRequested { at_start: None },
                    Withdrawal::OwnerDeleted => Event::OwnerDeleted { at_start: None },
                    Withdrawal::ClaimMoved => Event::ClaimLost {
                        holder: "another holder (a status write of this attempt was fenced out)".to_string(),
                    },
                })
            }
            // Only the watchdog deletes a VM of ours behind our back, and only after the
            // deadline: a VM already gone here was removed by it (the agent was paused or slow).
            Interrupt::Deadline if self.vm_created && self.check_gone().is_ok() => {
                tracing::warn!(%vm, deadline = %self.attempt.deadline, killed, "host execution deadline passed and the watchdog already deleted the VM");
                Performed::Event(Event::WatchdogRemovedVm)
            }
            Interrupt::Deadline => {
                tracing::warn!(%vm, deadline = %self.attempt.deadline, killed, "host execution deadline passed; tart children killed");
                Performed::Event(Event::DeadlinePassed { at_start: None })
            }
        }
    }

    /// SIGKILLs our `tart run` and every other tart process of the VM; returns how many died.
    async fn kill_children(&mut self) -> usize {
        let vm = self.attempt.vm.clone();
        let mut killed = 0;
        if let Some(run) = self.run.as_mut() {
            match run.try_wait() {
                Ok(None) => match run.kill().await {
                    Ok(_) => killed += 1,
                    Err(error) => tracing::warn!(%vm, %error, "could not kill tart run"),
                },
                Ok(Some(_)) => {}
                Err(error) => tracing::warn!(%vm, %error, "could not poll tart run"),
            }
        }
        self.run = None;
        match self.tart.kill_vm_processes(&vm).await {
            Ok(report) => killed += report.count(),
            Err(error) => tracing::warn!(%vm, %error, "could not kill every tart process; stop and delete go on"),
        }
        killed
    }
}

/// Whether something seen `ago` before `now` was seen before `deadline`. (`ago` comes from the
/// monotonic clock, which on macOS stops while the Mac sleeps: a sleep makes it look seen later,
/// never earlier, so the deadline is then the reason, as for a paused agent.)
fn seen_before(ago: Duration, now: Timestamp, deadline: Timestamp) -> bool {
    SignedDuration::try_from(ago)
        .ok()
        .and_then(|ago| now.checked_sub(ago).ok())
        .is_some_and(|seen| seen < deadline)
}

/// Resolves once the wall clock reaches `deadline`.
pub(super) async fn until(deadline: Timestamp) {
    loop {
        let left = Timestamp::now().duration_until(deadline);
        match Duration::try_from(left) {
            Ok(d) if !d.is_zero() => tokio::time::sleep(d.min(Duration::from_secs(60))).await,
            _ => return,
        }
    }
}
