//! The retire phase: stop and delete the VM (a VM found before this attempt's clone is never
//! deleted), confirm a VM the watchdog deleted is gone without touching it, retry a quarantined
//! VM's deletion, remove the scratch files and the deadline file. Never interrupted.

use k8s_openapi::jiff::SignedDuration;
use std::time::{Duration, Instant};
use tartan_api::deadline::remove_deadline_file;

use super::{AttemptExecutor, Performed};
use crate::host::steps::log_dir;
use crate::machine::{DeleteContext, Deleted, Event};

impl AttemptExecutor {
    pub(super) async fn stop_and_delete_vm(&mut self, context: DeleteContext) -> Performed {
        let started = Instant::now();
        let result = if self.refused_existing {
            self.check_gone()
                .map_err(|e| format!("{e}; it existed before this attempt's clone, so it is not deleted"))
        } else {
            self.stop_and_delete().await
        };
        match result {
            Ok(()) => {
                let took = started.elapsed();
                tracing::info!(vm = %self.attempt.vm, ?took, "stopped and deleted");
                Performed::Event(Event::VmDeleted {
                    how: context.deleted(took.try_into().unwrap_or_default()),
                })
            }
            Err(error) => {
                tracing::warn!(vm = %self.attempt.vm, %error, "VM not deleted");
                Performed::Event(Event::DeleteFailed { context, error })
            }
        }
    }

    pub(super) async fn confirm_gone(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let listed = match self.tart.list().await {
            Ok(list) => list.iter().any(|e| e.is_local() && e.name == vm),
            Err(e) => {
                return Performed::Event(Event::DeleteFailed {
                    context: DeleteContext::Watchdog,
                    error: format!("cannot confirm {vm} is gone: {e}"),
                });
            }
        };
        match (listed, self.check_gone()) {
            (false, Ok(())) => Performed::Event(Event::VmDeleted {
                how: Deleted::ByWatchdog,
            }),
            (true, _) => Performed::Event(Event::DeleteFailed {
                context: DeleteContext::Watchdog,
                error: format!("{vm} is still listed by tart list"),
            }),
            (false, Err(e)) => Performed::Event(Event::DeleteFailed {
                context: DeleteContext::Watchdog,
                error: e,
            }),
        }
    }

    /// One more try at deleting a quarantined VM (stop, delete, check the folder is gone).
    /// A VM found before this attempt's clone is never deleted: it only counts as gone once an
    /// operator removed it. Returns how long it took.
    pub async fn retry_delete(&mut self) -> Result<Duration, String> {
        let started = Instant::now();
        self.remove_scratch_files();
        if self.refused_existing {
            self.check_gone()?;
        } else {
            self.stop_and_delete().await?;
        }
        Ok(started.elapsed())
    }

    pub(super) fn check_gone(&self) -> Result<(), String> {
        let dir = self.tart.vm_dir(&self.attempt.vm).map_err(|e| e.to_string())?;
        match std::fs::symlink_metadata(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("cannot check {}: {e}", dir.display())),
            Ok(_) => Err(format!("{} still exists", dir.display())),
        }
    }

    /// `tart stop` (killing the VM's processes if that fails), `tart delete` (absent counts as
    /// deleted), then the VM folder must be gone.
    async fn stop_and_delete(&mut self) -> Result<(), String> {
        let vm = self.attempt.vm.clone();
        crate::crash_point!("tart.stop.before");
        let stopped = self.tart.stop(&vm, self.cfg.stop_timeout).await;
        crate::crash_point!("tart.stop.after");
        match stopped {
            Ok(()) => {}
            Err(e) if e.is_not_running() || e.is_vm_missing() => {}
            Err(e) => {
                tracing::warn!(%vm, error = %e, "tart stop failed; killing the VM's tart processes");
                self.tart
                    .kill_vm_processes(&vm)
                    .await
                    .map_err(|k| format!("{e}; killing its processes failed too: {k}"))?;
            }
        }
        if let Some(mut run) = self.run.take() {
            // `tart stop` has returned, so our `tart run` has exited or is about to.
            if tokio::time::timeout(Duration::from_secs(5), run.wait()).await.is_err() {
                let _ = run.kill().await;
            }
        }
        crate::crash_point!("tart.delete.before");
        let deleted = self.tart.delete(&vm).await;
        crate::crash_point!("tart.delete.after");
        match deleted {
            Ok(()) => {}
            Err(e) if e.is_vm_missing() => {}
            Err(e) => return Err(e.to_string()),
        }
        self.check_gone()
            .map_err(|e| format!("tart delete {vm} returned, but {e}"))?;
        let _ = std::fs::remove_dir_all(self.tmp_dir());
        Ok(())
    }

    /// Removes what the step followers of this attempt (or an older agent's) left beside the
    /// step logs: poll scratch files (raw, unmasked output) and stop replies. Every retirement
    /// passes here (a deletion, the watchdog's confirmed, a quarantined VM's retry), recovered
    /// attempts too.
    pub(super) fn remove_scratch_files(&self) {
        let dir = log_dir(&self.cfg.state_dir, &self.attempt.vm);
        let removed = crate::host::guest_job::remove_scratch_files(&dir);
        if removed > 0 {
            tracing::info!(vm = %self.attempt.vm, removed, "removed step scratch files");
        }
    }

    /// Retries the deletion of a quarantined VM until it is gone. From 1 s, doubling up to
    /// `after`: a transient failure (or one an agent restart finds already lifted) frees the slot
    /// soon; a lasting one is not hammered.
    pub(super) async fn retry_delete_later(&mut self, after: SignedDuration) -> Performed {
        let vm = self.attempt.vm.clone();
        let after = Duration::try_from(after).unwrap_or(Duration::from_secs(30));
        let mut wait = after.min(Duration::from_secs(1));
        loop {
            tokio::time::sleep(wait).await;
            match self.retry_delete().await {
                Ok(_) => return Performed::Event(Event::VmDeleted { how: Deleted::OnRetry }),
                Err(error) => {
                    wait = (wait * 2).min(after);
                    tracing::warn!(%vm, %error, retry_in = ?wait, "quarantined VM still not deleted; retrying")
                }
            }
        }
    }

    /// Removes the VM's deadline file: the VM is gone, the file has nothing left to guard. A
    /// failure is logged; the retirement goes on.
    pub(super) async fn remove_vm_deadline_file(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let dir = self.deadlines_dir();
        let v = vm.clone();
        crate::crash_point!("deadline_file.remove.before");
        let removed = tokio::task::spawn_blocking(move || remove_deadline_file(&dir, &v)).await;
        crate::crash_point!("deadline_file.remove.after");
        match removed {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::warn!(%vm, %error, "deadline file not removed"),
            Err(error) => tracing::warn!(%vm, %error, "deadline file removal task failed"),
        }
        Performed::Done
    }
}
