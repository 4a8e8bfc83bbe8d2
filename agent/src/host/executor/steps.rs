//! The steps phase: the guest commands (the source checkout's, then the spec's steps), each run
//! as a detached guest job (or re-attached to after a restart) to its exit or its
//! `timeoutSeconds`, its log capped by the build's log budget; then the next step's start or the
//! steps' end, as the event the machine expects.

use k8s_openapi::jiff::Timestamp;
use std::path::Path;
use tartan_api::text::{TAIL_BYTES, TAIL_LINES, clean_str, last_lines};

use super::cancel::until;
use super::{AttemptExecutor, Performed};
use crate::host::steps::{GuestCommand, checkout_commands, log_dir, step_log};
use crate::machine::Event;

impl AttemptExecutor {
    /// The commands the guest runs, in order: the source checkout's, then the spec's steps. A
    /// step's index in this list is what the journal records.
    fn guest_commands(&self) -> Result<Vec<GuestCommand>, Performed> {
        let mut commands: Vec<GuestCommand> = Vec::new();
        if let Some(source) = &self.attempt.spec.source {
            match checkout_commands(source, &self.cfg.checkout_dir) {
                Ok(c) => commands.extend(c),
                Err(e) => {
                    return Err(failed_step(
                        crate::host::steps::CHECKOUT_STEP.to_string(),
                        -1,
                        self.status_text(&e.to_string()),
                    ));
                }
            }
        }
        commands.extend(self.attempt.spec.steps.iter().map(|s| GuestCommand {
            name: s.name.clone(),
            argv: s.run.clone(),
        }));
        Ok(commands)
    }

    /// Runs guest command `index` (started at `since`) to its exit, or stops it at its
    /// `timeoutSeconds`; then removes the env file if the attempt's steps ended. The next one's
    /// start goes through the journal first.
    pub(super) async fn run_step(&mut self, index: u32, since: Timestamp) -> Performed {
        let performed = self.run_step_inner(index, since).await;
        let ended = !matches!(&performed, Performed::Event(Event::StepStarting { .. }));
        if ended {
            self.remove_env_file().await;
        }
        performed
    }

    async fn run_step_inner(&mut self, index: u32, since: Timestamp) -> Performed {
        let vm = self.attempt.vm.clone();
        let commands = match self.guest_commands() {
            Ok(c) => c,
            Err(failed) => return self.record_failure(failed),
        };
        if let Err(refused) = self.ensure_env().await {
            return refused;
        }
        // Every step's successor is started by `after_step`, which ends the steps after the last
        // one: an index past the end only comes from a resumed attempt whose MacBuild lost steps
        // since (its spec changed), and is never taken for the steps' success.
        let Some(cmd) = usize::try_from(index).ok().and_then(|i| commands.get(i)).cloned() else {
            tracing::warn!(%vm, index, commands = commands.len(), "the journal's step is past the end of the MacBuild's steps; the attempt is interrupted");
            return Performed::Event(Event::SpecChanged {
                change: format!(
                    "the journal started step {} of the attempt, the MacBuild now has {} step(s) in all",
                    u64::from(index) + 1,
                    commands.len()
                ),
                at_start: None,
            });
        };
        let logs = log_dir(&self.cfg.state_dir, &vm);
        if let Err(e) = std::fs::create_dir_all(&logs) {
            let msg = format!("creating log folder {}: {e}", logs.display());
            return self.step_failed(cmd.name, -1, msg);
        }
        if let Err(e) = self.write_env_file().await {
            return self.step_failed(cmd.name, -1, format!("{e}; the step did not run"));
        }
        // After the env file's write: it may have added values to mask.
        // The steps before this one are finished, so their logs' sizes, and with them this step's
        // cap, are the same when a restarted agent re-attaches to it.
        // Each log once: commands may share one (the checkout's two commands write one log).
        let earlier_logs: std::collections::BTreeSet<std::path::PathBuf> = commands[..index as usize]
            .iter()
            .map(|c| step_log(&self.cfg.state_dir, &vm, &c.name))
            .collect();
        let earlier: u64 = earlier_logs
            .iter()
            .map(|log| std::fs::metadata(log).map_or(0, |m| m.len()))
            .fold(0, u64::saturating_add);
        let log_cap = step_log_cap(self.cfg.step_log_cap, self.cfg.build_log_budget, earlier);
        if log_cap < self.cfg.step_log_cap {
            tracing::info!(%vm, step = %cmd.name, earlier, log_cap, "the build's log budget leaves this step less than the per-step cap");
        }
        let follow = crate::host::guest_job::FollowConfig {
            poll_interval: self.cfg.step_poll,
            no_pid_limit: self.cfg.step_no_pid_limit,
            log_cap,
            tail_bytes: self.cfg.tail_bytes as u64,
            mask: self.masker(),
            ..crate::host::guest_job::FollowConfig::default()
        };
        // The step runs as a detached job in the guest (docs/resume.md): a restarted agent
        // re-attaches to it here, and its guard folder keeps it from starting twice.
        let job = crate::host::guest_job::Job::new(&vm, index as usize, &cmd.name, cmd.argv.clone());
        let host_log = step_log(&self.cfg.state_dir, &vm, &cmd.name);
        tracing::info!(%vm, step = %cmd.name, index, job = %job.dir, argv = %tartan_tart::argv_for_log(&cmd.argv), "step started or re-attached");
        // The checkout's commands come first and have no limit of their own.
        let limit = (index as usize)
            .checked_sub(commands.len() - self.attempt.spec.steps.len())
            .and_then(|i| self.attempt.spec.steps.get(i))
            .and_then(|s| s.timeout_seconds);
        let followed = match limit {
            None => crate::host::guest_job::run_or_attach(&self.tart, &job, &host_log, &follow).await,
            Some(secs) => {
                let at = crate::host::step_timeout::step_deadline(since, secs);
                tokio::select! {
                    end = crate::host::guest_job::run_or_attach(&self.tart, &job, &host_log, &follow) => end,
                    () = until(at) => match self.stop_timed_out_step(&job, &host_log, &follow, secs).await {
                        Some(timed_out) => return timed_out,
                        // It had exited on its own at its limit: its own end counts.
                        None => crate::host::guest_job::run_or_attach(&self.tart, &job, &host_log, &follow).await,
                    },
                }
            }
        };
        match followed {
            Ok(end) => {
                tracing::info!(%vm, step = %cmd.name, code = end.exit_code, took = ?end.elapsed, attached = end.attached, "step finished");
                if end.exit_code != 0 {
                    let last = last_lines(end.tail.as_bytes(), TAIL_LINES, TAIL_BYTES);
                    return self.step_failed(cmd.name, end.exit_code, last);
                }
                self.last_step = Some((cmd.name.clone(), end.tail));
            }
            // Not the step's doing: its start was cut short (an agent death in the start call).
            Err(e @ crate::host::guest_job::JobError::NeverLaunched { .. }) => {
                tracing::warn!(%vm, step = %cmd.name, error = %e, "the step's guest job was never launched; the attempt is interrupted");
                return Performed::Event(Event::AgentFault { message: e.to_string() });
            }
            Err(e) => {
                tracing::warn!(%vm, step = %cmd.name, error = %e, "the step's guest job failed");
                return self.step_failed(cmd.name, -1, e.to_string());
            }
        }
        self.after_step(index, &cmd.name, &commands)
    }

    /// Stops the job of a step that ran past its `timeoutSeconds` (`secs`) and reads its end
    /// (bounded: the VM's deletion that follows ends whatever is left). Returns the `StepTimedOut`
    /// event, or `None` if the job had already exited on its own.
    async fn stop_timed_out_step(
        &mut self,
        job: &crate::host::guest_job::Job,
        host_log: &Path,
        follow: &crate::host::guest_job::FollowConfig,
        secs: u32,
    ) -> Option<Performed> {
        use crate::host::step_timeout::{Stopped, host_log_tail, stop};
        let vm = &self.attempt.vm;
        tracing::warn!(%vm, step = %job.step, timeout_seconds = secs, "step ran past its timeoutSeconds; stopping its guest job");
        let stopped = stop(
            &self.tart,
            job,
            host_log,
            follow.exec_timeout,
            follow.unresponsive_limit,
        )
        .await;
        let killed = match &stopped {
            Ok(Stopped::Exited(code)) => {
                tracing::info!(%vm, step = %job.step, code, "the step had exited on its own at its timeout");
                return None;
            }
            Ok(Stopped::Killed(n)) => format!("it was killed in the guest ({n} process(es))"),
            Ok(Stopped::NoPid) => "its guest job had no pid to kill; the VM's deletion ends it".to_string(),
            Err(e) => format!("stopping it in the guest failed ({e}); the VM's deletion ends it"),
        };
        // Read what the step wrote up to its death (its job now exits 137 at once).
        let drained = match stopped {
            Ok(Stopped::Killed(_)) => tokio::time::timeout(
                follow.exec_timeout,
                crate::host::guest_job::run_or_attach(&self.tart, job, host_log, follow),
            )
            .await
            .ok()
            .and_then(Result::ok),
            _ => None,
        };
        let tail = match drained {
            Some(end) => end.tail,
            None => host_log_tail(host_log, self.cfg.tail_bytes as u64),
        };
        let output = last_lines(tail.as_bytes(), TAIL_LINES, TAIL_BYTES);
        self.last_step = Some((job.step.clone(), output.clone()));
        tracing::warn!(%vm, step = %job.step, %killed, "step timed out");
        Some(Performed::Event(Event::StepTimedOut {
            step: job.step.clone(),
            timeout_seconds: secs,
            killed,
            output: self.status_text(&output),
        }))
    }

    /// What follows guest command `index`, which exited 0: the next one's start, or the end.
    fn after_step(&self, index: u32, name: &str, commands: &[GuestCommand]) -> Performed {
        let next = index.saturating_add(1);
        match usize::try_from(next).ok().and_then(|i| commands.get(i)) {
            Some(cmd) => Performed::Event(Event::StepStarting {
                index: next,
                of: u32::try_from(commands.len()).unwrap_or(u32::MAX),
                name: cmd.name.clone(),
                previous: name.to_string(),
            }),
            None => Performed::Event(Event::StepsSucceeded {
                steps: self.attempt.spec.steps.len() as u32,
            }),
        }
    }

    /// Keeps what a [`failed_step`] event says as the last step's output.
    fn record_failure(&mut self, failed: Performed) -> Performed {
        if let Performed::Event(Event::StepFailed { step, output, .. }) = &failed {
            self.last_step = Some((step.clone(), output.clone()));
        }
        failed
    }

    /// Ends the steps with `step` failed: `why` (its last lines, or the error that kept it from
    /// running) goes into the event, so the record, the status and the CustomRun say it.
    fn step_failed(&mut self, step: String, exit_code: i32, why: String) -> Performed {
        let failed = failed_step(step, exit_code, self.status_text(&why));
        self.record_failure(failed)
    }

    /// `text` (a step's last lines, an error) as the record, the status and the CustomRun say
    /// it: cleaned, then masked. The raw output was masked already, but cleaning removes bytes
    /// (escapes, `\r`, invalid UTF-8, bidi controls) and so can join a value that they held
    /// apart in the raw output back together.
    fn status_text(&self, text: &str) -> String {
        status_text(&self.masker(), text)
    }
}

/// `text` cleaned for a status, then masked with `mask` ([`AttemptExecutor::status_text`]).
pub fn status_text(mask: &crate::host::env::Masker, text: &str) -> String {
    mask.mask_text(&clean_str(text, TAIL_BYTES))
}

/// The `StepFailed` event of `step`: `output` (its last lines, or the error that kept it from
/// running, as [`AttemptExecutor::status_text`] makes it) goes into the event, so the record, the
/// status and the CustomRun say it.
fn failed_step(step: String, exit_code: i32, output: String) -> Performed {
    Performed::Event(Event::StepFailed {
        step,
        exit_code,
        output,
    })
}

/// The log cap of a step: the per-step cap, or what is left of the build's `budget` after the
/// `earlier` steps' logs, whichever is smaller. At 0 the step's output is dropped from its first
/// byte, with the cap note.
pub fn step_log_cap(per_step: u64, budget: u64, earlier: u64) -> u64 {
    per_step.min(budget.saturating_sub(earlier))
}

#[cfg(test)]
mod log_budget_tests {
    use super::step_log_cap;

    #[test]
    fn a_step_gets_what_the_earlier_steps_left_of_the_budget() {
        const MIB: u64 = 1 << 20;
        for (per_step, budget, earlier, want) in [
            (64 * MIB, 256 * MIB, 0, 64 * MIB),
            (64 * MIB, 256 * MIB, 200 * MIB, 56 * MIB),
            (64 * MIB, 256 * MIB, 256 * MIB, 0),
            // Four steps at the per-step cap passed a 64 MiB budget before: the second gets nothing.
            (66 * MIB, 64 * MIB, 66 * MIB, 0),
            (64 * MIB, 64 * MIB, 10 * MIB, 54 * MIB),
            (10, u64::MAX, u64::MAX - 1, 1),
        ] {
            assert_eq!(
                step_log_cap(per_step, budget, earlier),
                want,
                "{per_step} {budget} {earlier}"
            );
        }
    }
}
