//! The env file: `spec.env` read from its Secrets once per executor (a refusal ends the attempt),
//! written into the guest through `tart exec -i` stdin before the steps need it, and removed from
//! the guest once the steps ended.

use std::time::Duration;
use tartan_tart::ExecOptions;

use super::{AttemptExecutor, Performed};
use crate::machine::Event;

impl AttemptExecutor {
    /// Reads `spec.env` (its Secrets) unless this executor did: a refusal is the event that ends
    /// the attempt. Nothing of a value is logged.
    pub(super) async fn ensure_env(&mut self) -> Result<(), Performed> {
        if self.env.is_some() {
            return Ok(());
        }
        let namespace = self.attempt.build.namespace.clone();
        match crate::host::env::resolve(&self.attempt.spec.env, &namespace, self.cfg.secrets.as_ref()).await {
            Ok(env) => {
                if !env.vars.is_empty() {
                    tracing::info!(vm = %self.attempt.vm, env = ?env, "step environment resolved");
                }
                self.env = Some(env);
                Ok(())
            }
            Err(refused) => {
                tracing::warn!(vm = %self.attempt.vm, reason = %refused.reason, error = %refused.message, "spec.env refused; the build fails");
                Err(Performed::Event(Event::EnvRefused {
                    reason: refused.reason,
                    error: refused.message,
                }))
            }
        }
    }

    /// Reads `spec.env` again if this executor has not (an agent restarted after the steps), so
    /// that what the guest hands over after the steps is masked; `Err` says why it cannot be,
    /// and then nothing of the guest's is used.
    pub(super) async fn ensure_mask(&mut self) -> Result<(), String> {
        match self.ensure_env().await {
            Ok(()) => Ok(()),
            Err(Performed::Event(Event::EnvRefused { error, .. })) => Err(error),
            Err(other) => Err(format!("{other:?}")),
        }
    }

    /// The masker of this build's Secret values (none read yet: masks nothing).
    pub(super) fn masker(&self) -> crate::host::env::Masker {
        self.env.as_ref().map(|e| e.masker.clone()).unwrap_or_default()
    }

    /// The VM's guest folder, which holds the env file and the step jobs' folders.
    fn guest_vm_dir(&self) -> String {
        format!(
            "{}/{}",
            crate::host::guest_job::GUEST_ROOT,
            crate::host::steps::safe_name(&self.attempt.vm)
        )
    }

    /// Writes the env file into the guest through `tart exec -i` stdin (never argv), unless there
    /// is no env or this executor wrote it. Rewriting it after an agent restart gives the later
    /// steps the values read now; the file it replaces (what the steps an earlier agent process
    /// started have, e.g. a Secret's value from before a rotation) comes back in memory and its
    /// values are masked too (docs/env-and-secrets.md). The call's output never touches the host
    /// disk.
    pub(super) async fn write_env_file(&mut self) -> Result<(), String> {
        let Some(env) = self.env.as_ref().filter(|e| !e.vars.is_empty()) else {
            return Ok(());
        };
        if self.env_written {
            return Ok(());
        }
        let file = crate::host::env::render_env_file(&env.vars);
        let options = tartan_tart::CaptureOptions {
            max_bytes: crate::host::env::PREVIOUS_MAX_BYTES + (64 << 10),
            timeout: Duration::from_secs(60).min(self.exec_timeout()),
            stop_at_cap: false,
        };
        let argv = crate::host::env::write_script_argv(&self.guest_vm_dir());
        let out = self
            .tart
            .exec_capture(&self.attempt.vm, &argv, Some(file), &options)
            .await
            .map_err(|e| format!("writing the env file in the guest: {e}"))?;
        if out.outcome.exit_code != 0 {
            let why = crate::host::env::parse_write(&out.output).err().unwrap_or_default();
            return Err(format!(
                "writing the env file in the guest exited {}: {why}",
                out.outcome.exit_code
            ));
        }
        let previous = crate::host::env::parse_write(&out.output)
            .map_err(|e| format!("writing the env file in the guest: {e}"))?;
        let vm = &self.attempt.vm;
        let env = self.env.as_mut().expect("checked above");
        match previous {
            crate::host::env::Previous::None => {}
            crate::host::env::Previous::File(bytes) => match env.adopt_previous(&bytes) {
                Ok(0) => {}
                Ok(changed) => {
                    tracing::warn!(%vm, changed, "Secret values changed since the attempt's steps got them; the old values stay masked too")
                }
                Err(error) => {
                    tracing::warn!(%vm, %error, "the guest's earlier env file is not the agent's (a step changed it); only the values read now are masked")
                }
            },
            crate::host::env::Previous::TooLarge(bytes) => {
                tracing::warn!(%vm, bytes, "the guest's earlier env file is too large to be the agent's (a step changed it); only the values read now are masked")
            }
        }
        self.env_written = true;
        tracing::info!(%vm, vars = env.vars.len(), "env file written in the guest (mode 0600)");
        Ok(())
    }

    /// Removes the env file from the guest once no step needs it (best effort: the VM is
    /// deleted next anyway).
    pub(super) async fn remove_env_file(&mut self) {
        if self.env.as_ref().is_none_or(|e| e.vars.is_empty()) {
            return;
        }
        let log = self.tmp_dir().join("env-remove.log");
        let _ = std::fs::create_dir_all(self.tmp_dir());
        let options = ExecOptions::new(&log, Duration::from_secs(30).min(self.exec_timeout()));
        let argv = crate::host::env::remove_script_argv(&self.guest_vm_dir());
        match self.tart.exec(&self.attempt.vm, &argv, &options).await {
            Ok(o) if o.exit_code == 0 => tracing::info!(vm = %self.attempt.vm, "env file removed from the guest"),
            Ok(o) => {
                tracing::warn!(vm = %self.attempt.vm, code = o.exit_code, "env file not removed from the guest; the VM is deleted next")
            }
            Err(error) => {
                tracing::warn!(vm = %self.attempt.vm, %error, "env file not removed from the guest; the VM is deleted next")
            }
        }
        let _ = std::fs::remove_file(&log);
        self.env_written = false;
    }
}
