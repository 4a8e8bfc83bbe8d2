//! The boot phase: the deadline file (after the checks that refuse a build before any VM exists:
//! image, artifact destination, mounts, `spec.env`), then `tart clone`, `tart set`, `tart run`
//! and the readiness probe (`tart exec NAME true`). A failure is `VmStartFailed`.

use k8s_openapi::jiff::Timestamp;
use std::time::{Duration, Instant};
use tartan_api::deadline::{DeadlineFile, write_deadline_file};
use tartan_tart::{ExecOptions, RunOptions, SetOptions, TartError};

use super::{AttemptExecutor, Performed};
use crate::host::artifacts::artifact_key;
use crate::host::steps::{log_dir, step_log};
use crate::machine::Event;

/// How often a clone that lost its temporary directory to tart's garbage collection is tried
/// again within the attempt.
const CLONE_TMP_RACE_RETRIES: u32 = 3;

impl AttemptExecutor {
    pub(super) async fn write_deadline(&mut self, deadline: Timestamp) -> Performed {
        // An image or destination the agent will refuse fails the build now, before any VM exists.
        if let Err(refused) = tartan_api::names::check_image(&self.attempt.spec.image, &self.cfg.local_images) {
            return self.fail_start(format!("image refused: {refused}; nothing was cloned"));
        }
        if let Some(Err(refused)) = self.artifact_destination() {
            return self.fail_start(format!("{refused}; nothing was cloned"));
        }
        // A path the upload would refuse whatever the guest holds is refused before the build
        // runs, not after.
        let paths = self.attempt.spec.artifacts.iter().flat_map(|a| &a.paths);
        if let Some(Err(refused)) = paths.map(|p| artifact_key(&self.attempt.vm, p)).find(Result::is_err) {
            return self.fail_start(format!("{refused}; nothing was cloned"));
        }
        match crate::host::mounts::shares_for(&self.attempt.spec.mounts, &self.cfg.mounts) {
            Ok(_) => {}
            Err(crate::host::mounts::MountRefused::NotDeclared(e)) => {
                tracing::warn!(vm = %self.attempt.vm, error = %e, "mount refused; nothing is cloned");
                return Performed::Event(Event::MountRefused {
                    error: format!("{e}; nothing was cloned"),
                });
            }
            Err(crate::host::mounts::MountRefused::Unusable(e)) => {
                return self.fail_start(format!("{e}; nothing was cloned"));
            }
        }
        if let Err(refused) = self.ensure_env().await {
            return refused;
        }
        let a = &self.attempt;
        let file = DeadlineFile {
            vm: a.vm.clone(),
            namespace: a.build.namespace.clone(),
            name: a.build.name.clone(),
            uid: a.build.uid.clone(),
            attempt: a.attempt,
            deadline,
            agent: a.agent.clone(),
            written_at: Timestamp::now(),
        };
        let dir = self.deadlines_dir();
        crate::crash_point!("deadline_file.write.before");
        let written = tokio::task::spawn_blocking(move || write_deadline_file(&dir, &file)).await;
        crate::crash_point!("deadline_file.write.after");
        match written {
            Ok(Ok(_)) => Performed::Done,
            Ok(Err(e)) => self.fail_start(format!("{e}; nothing was cloned")),
            Err(e) => self.fail_start(format!("deadline file task failed: {e}; nothing was cloned")),
        }
    }

    pub(super) async fn clone_vm(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let image = self.attempt.spec.image.clone();
        if !self.deadline_file().is_file() {
            return self.fail_start(format!(
                "no deadline file at {}; refusing to clone {vm} without one (the watchdog could not find it)",
                self.deadline_file().display()
            ));
        }
        let dir = match self.tart.vm_dir(&vm) {
            Ok(d) => d,
            Err(e) => return self.fail_start(e.to_string()),
        };
        if std::fs::symlink_metadata(&dir).is_ok() {
            self.refused_existing = true;
            return self.fail_start(format!(
                "{} already exists before the clone; refusing to clone {image} over it (tart overwrites silently) \
                 and leaving it for an operator",
                dir.display()
            ));
        }
        let started = Instant::now();
        let mut pause = Duration::from_millis(250);
        for race in 0..=CLONE_TMP_RACE_RETRIES {
            crate::crash_point!("tart.clone.before");
            let cloned = self.tart.clone_vm(&image, &vm).await;
            crate::crash_point!("tart.clone.after");
            match cloned {
                Ok(()) => {
                    tracing::info!(%vm, %image, took = ?started.elapsed(), "cloned");
                    self.vm_created = true;
                    return Performed::Done;
                }
                // Another tart command collected the clone's temporary directory: nothing was
                // made (the VM folder is checked), so it is cloned again within this attempt.
                Err(e)
                    if e.is_clone_tmp_race()
                        && race < CLONE_TMP_RACE_RETRIES
                        && std::fs::symlink_metadata(&dir).is_err() =>
                {
                    tracing::warn!(%vm, %image, error = %e, retry_in = ?pause, "clone lost its temporary directory to tart's garbage collection; cloning again");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                Err(e) => return self.fail_start(e.to_string()),
            }
        }
        unreachable!("the last try returns")
    }

    pub(super) async fn set_vm(&mut self) -> Performed {
        let res = self.attempt.spec.resources.clone().unwrap_or_default();
        let options = SetOptions {
            cpu: res.cpu,
            memory_mb: res.memory_mib.map(u64::from),
            random_mac: true,
        };
        crate::crash_point!("tart.set.before");
        let set = self.tart.set(&self.attempt.vm, &options).await;
        crate::crash_point!("tart.set.after");
        match set {
            Ok(()) => Performed::Done,
            Err(e) => self.fail_start(e.to_string()),
        }
    }

    pub(super) async fn start_vm(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let logs = log_dir(&self.cfg.state_dir, &vm);
        if let Err(e) = std::fs::create_dir_all(&logs) {
            return self.fail_start(format!(
                "creating log folder {}: {e}; tart run not started",
                logs.display()
            ));
        }
        // Checked at the admission; checked again, as the folders may have gone since.
        let extra_args = match crate::host::mounts::shares_for(&self.attempt.spec.mounts, &self.cfg.mounts)
            .map_err(|e| e.to_string())
            .and_then(|shares| tartan_tart::run_args(&shares, &self.cfg.network))
        {
            Ok(args) => args,
            Err(e) => return self.fail_start(format!("{e}; tart run not started")),
        };
        let options = RunOptions {
            log_path: Some(logs.join("_tart-run.log")),
            extra_args,
            detached: self.cfg.detach_vm,
        };
        self.boot_started = Some(Instant::now());
        crate::crash_point!("tart.run.before");
        match self.tart.run(&vm, &options) {
            Ok(run) => self.run = Some(run),
            Err(e) => return self.fail_start(e.to_string()),
        }
        crate::crash_point!("tart.run.after");
        let timeout = self.cfg.boot_timeout;
        let run = self.run.as_mut().expect("just set");
        match run.wait_until_running(timeout).await {
            Ok(()) => Performed::Done,
            Err(e) => self.fail_start(e.to_string()),
        }
    }

    pub(super) async fn probe_ready(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let started = *self.boot_started.get_or_insert_with(Instant::now);
        let limit = started + self.cfg.boot_timeout;
        let log = step_log(&self.cfg.state_dir, &vm, "_probe");
        let mut last = String::from("no probe finished");
        loop {
            if let Some(run) = self.run.as_mut()
                && let Ok(Some(exit)) = run.try_wait()
            {
                self.run = None;
                return self.fail_start(format!(
                    "tart run {vm} exited ({exit}) before the guest answered tart exec"
                ));
            }
            let now = Instant::now();
            if now >= limit {
                return self.fail_start(format!(
                    "the guest did not answer tart exec {vm} true within {:?} of tart run (last: {last})",
                    self.cfg.boot_timeout
                ));
            }
            let mut options = ExecOptions::new(&log, self.cfg.probe_timeout.min(limit - now));
            options.log_cap = 64 << 10;
            options.tail_bytes = 1024;
            match self.tart.exec(&vm, &["true".to_string()], &options).await {
                Ok(out) if out.exit_code == 0 => {
                    let after = started.elapsed();
                    tracing::info!(%vm, ?after, "guest ready");
                    return Performed::Event(Event::GuestReady {
                        after: after.try_into().unwrap_or_default(),
                    });
                }
                Ok(out) => last = format!("`true` exited {} in the guest: {}", out.exit_code, out.tail.trim()),
                Err(e @ (TartError::VmNotRunning { .. } | TartError::VmDoesNotExist { .. })) => {
                    return self.fail_start(e.to_string());
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(self.cfg.probe_interval).await;
        }
    }

    /// Asks the adopted warm VM's guest once (`tart exec <vm> true`, within the probe timeout):
    /// it answered when the pool booted it, so anything but a prompt exit 0 means the VM is no
    /// longer fit to serve and the attempt ends as a failed start (its VM deleted, a retry cold).
    pub(super) async fn probe_adopted(&mut self) -> Performed {
        let vm = self.attempt.vm.clone();
        let started = Instant::now();
        let log = step_log(&self.cfg.state_dir, &vm, "_probe");
        let mut options = ExecOptions::new(&log, self.cfg.probe_timeout);
        options.log_cap = 64 << 10;
        options.tail_bytes = 1024;
        match self.tart.exec(&vm, &["true".to_string()], &options).await {
            Ok(out) if out.exit_code == 0 => Performed::Event(Event::Adopted {
                after: started.elapsed().try_into().unwrap_or_default(),
            }),
            Ok(out) => self.fail_start(format!(
                "the adopted warm VM {vm} answered `true` with exit {}: {}",
                out.exit_code,
                out.tail.trim()
            )),
            Err(e) => self.fail_start(format!("the adopted warm VM {vm} did not answer tart exec: {e}")),
        }
    }

    fn fail_start(&self, error: String) -> Performed {
        tracing::warn!(vm = %self.attempt.vm, %error, "VM start failed");
        Performed::Event(Event::VmStartFailed { error })
    }
}
