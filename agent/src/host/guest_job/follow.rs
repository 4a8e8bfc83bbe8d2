//! Following a started job: the polls of its output (retried until the guest answers, bounded
//! in size and time), the host step log they append to, and the sidecar that keeps the log's
//! place so a new follower continues where the last one stopped. [`follow`] is the loop
//! [`run_or_attach`](super::run_or_attach) runs.

use super::*;

pub(super) async fn follow(f: &mut Follower<'_>, host_log: &Path) -> Result<JobEnd, JobError> {
    let (job, cfg) = (f.job, f.cfg);
    let started_at = Instant::now();
    if job.argv.is_empty() {
        return Err(f.start_refused("the step has no command".to_string()));
    }
    let mut log =
        HostLog::open(host_log, &job.dir, cfg.log_cap).map_err(|(action, path, source)| f.io(action, path, source))?;
    if !cfg.mask.is_empty() && log.place.logged.is_none() {
        // A place kept without masking (an older agent's): what it logged is replaced by the
        // job's whole output, fetched again and masked.
        log.start_over_masked().map_err(|(a, p, s)| f.io(a, p, s))?;
    }
    let attached = if log.place.started {
        // Started before, as the guest confirmed: followed, never started again (a folder that
        // is gone now was removed in the guest, and the poll reports the job vanished).
        tracing::info!(vm = %job.vm, step = %job.step, dir = %job.dir, offset = log.place.offset, "re-attached to the step job");
        true
    } else {
        crate::crash_point!("step.start.before");
        let start = f.call("start", &start_argv(job), 4096).await?;
        crate::crash_point!("step.start.after");
        let attached = match parse_start(&start).map_err(|d| f.protocol("start", d))? {
            Started::Now => {
                tracing::info!(vm = %job.vm, step = %job.step, dir = %job.dir, "step job started");
                if log.place.offset > 0 {
                    // An older agent's sidecar (without `started`) remembers a job of this
                    // folder that the guest no longer has: its output follows what is logged.
                    log.restart().map_err(|(a, p, s)| f.io(a, p, s))?;
                }
                false
            }
            Started::Before => {
                tracing::info!(vm = %job.vm, step = %job.step, dir = %job.dir, offset = log.place.offset, "re-attached to the step job");
                true
            }
            Started::Refused(why) => {
                return Err(f.start_refused(format!("the guest could not make its folder: {why}")));
            }
        };
        log.place.started = true;
        log.save().map_err(|(a, p, s)| f.io(a, p, s))?;
        attached
    };
    let mut starting_since: Option<Instant> = None;
    let (code, size) = loop {
        let from = log.place.offset;
        let max = poll_bytes(from, cfg);
        let reply = f.poll(from, max).await?;
        let seen = from + reply.bytes.len() as u64;
        let complete = matches!(reply.state, JobState::Exited(_)) && seen >= reply.size;
        let full = reply.bytes.len() as u64 == max;
        let took = take_off_runtime(from, reply.bytes, reply.size, complete, full, cfg).await;
        if took.next != from || took.note {
            log.append(&took.bytes, took.note, took.next)
                .map_err(|(a, p, s)| f.io(a, p, s))?;
        }
        let pending = seen < reply.size;
        match reply.state {
            JobState::Exited(code) if !pending => break (code, reply.size),
            JobState::Exited(_) => continue,
            JobState::Running => starting_since = None,
            JobState::Starting => {
                let since = *starting_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= cfg.no_pid_limit {
                    return Err(JobError::NeverLaunched {
                        vm: job.vm.clone(),
                        step: job.step.clone(),
                        dir: job.dir.clone(),
                        waited: since.elapsed(),
                    });
                }
            }
            JobState::Vanished(_) if pending => continue,
            JobState::Vanished(pid) => {
                let pid = pid.map_or("an unreadable pid".to_string(), |p| format!("pid {p}"));
                return Err(f.vanished(format!(
                    "{pid} is gone and left no exit status; its {} bytes of output are in the log",
                    reply.size
                )));
            }
            JobState::Absent => {
                return Err(f.vanished(
                    "its folder is gone (removed in the guest after the job started); not started again".to_string(),
                ));
            }
        }
        if !pending {
            tokio::time::sleep(cfg.poll_interval).await;
        }
    };
    let tail_from = size.saturating_sub(cfg.tail_bytes);
    // Read from earlier by up to a value's length, so a value cut by the tail's start is masked.
    let window_from = tail_from.saturating_sub(cfg.mask.max_len().saturating_sub(1) as u64);
    let tail = f.poll(window_from, size - window_from).await?;
    if tail.state != JobState::Exited(code) || tail.size != size {
        return Err(f.protocol(
            "tail read",
            format!(
                "the job had exited {code} with {size} bytes of output, now it reads {:?} with {}",
                tail.state, tail.size
            ),
        ));
    }
    tracing::info!(vm = %job.vm, step = %job.step, code, bytes = size, "step job exited");
    Ok(JobEnd {
        exit_code: code,
        tail: String::from_utf8_lossy(&cfg.mask.mask_window(&tail.bytes, (tail_from - window_from) as usize))
            .into_owned(),
        output_bytes: size,
        truncated: size > cfg.log_cap,
        attached,
        elapsed: started_at.elapsed(),
    })
}

type IoFail = (&'static str, PathBuf, std::io::Error);

/// The host log of one job, with its place kept in the sidecar.
struct HostLog {
    file: std::fs::File,
    path: PathBuf,
    sidecar: PathBuf,
    cap: u64,
    place: Place,
}

impl HostLog {
    /// Opens (creates) the log, reads the sidecar and cuts the log to where it says.
    fn open(path: &Path, dir: &str, cap: u64) -> Result<HostLog, IoFail> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let sidecar = sidecar_path(path);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(tartan_tart::LOG_FILE_MODE)
            .open(path)
            .map_err(|e| ("could not open the step log", path.to_path_buf(), e))?;
        // A log an older agent made world-readable is closed to others too.
        let meta = file
            .metadata()
            .map_err(|e| ("could not read the size of the step log", path.to_path_buf(), e))?;
        if meta.permissions().mode() & 0o007 != 0 {
            file.set_permissions(std::fs::Permissions::from_mode(tartan_tart::LOG_FILE_MODE))
                .map_err(|e| ("could not make the step log private", path.to_path_buf(), e))?;
        }
        let len = meta.len();
        let saved = match std::fs::read_to_string(&sidecar) {
            Ok(text) => Place::parse(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(("could not read the step log's sidecar", sidecar, e)),
        };
        let (place, cut) = resume(saved.clone(), dir, len, cap);
        if cut < len {
            tracing::info!(log = %path.display(), from = len, to = cut, "step log cut back to its sidecar's place");
            file.set_len(cut)
                .map_err(|e| ("could not cut back the step log", path.to_path_buf(), e))?;
        }
        let mut log = HostLog {
            file,
            path: path.to_path_buf(),
            sidecar,
            cap,
            place,
        };
        if saved.as_ref() != Some(&log.place) {
            log.save()?;
        }
        Ok(log)
    }

    /// Starts the job's output over at the log's end.
    fn restart(&mut self) -> Result<(), IoFail> {
        let len = self
            .file
            .metadata()
            .map_err(|e| ("could not read the size of the step log", self.path.clone(), e))?
            .len();
        self.place.base = len;
        self.place.offset = 0;
        self.place.logged = self.place.logged.map(|_| 0);
        self.save()
    }

    /// Cuts the log back to the job's base and starts its output over, counting the host bytes
    /// (masked output does not map one for one to the guest's).
    fn start_over_masked(&mut self) -> Result<(), IoFail> {
        self.file
            .set_len(self.place.base)
            .map_err(|e| ("could not cut back the step log", self.path.clone(), e))?;
        self.place.offset = 0;
        self.place.logged = Some(0);
        self.save()
    }

    /// Appends `bytes` (and the cap note), then records `offset`: no await between the two, so a
    /// dropped follower never leaves them apart; a crash between them is mended by [`resume`].
    fn append(&mut self, bytes: &[u8], note: bool, offset: u64) -> Result<(), IoFail> {
        let fail = |e| ("could not append to the step log", self.path.clone(), e);
        self.file.write_all(bytes).map_err(fail)?;
        let mut written = bytes.len() as u64;
        if note {
            self.file.write_all(log_cap_note(self.cap).as_bytes()).map_err(fail)?;
            written += log_cap_note(self.cap).len() as u64;
        }
        self.place.offset = offset;
        if let Some(logged) = self.place.logged.as_mut() {
            *logged += written;
        }
        self.save()
    }

    /// Writes the sidecar through a temporary file and a rename (never half a line).
    fn save(&mut self) -> Result<(), IoFail> {
        let tmp = with_suffix(&self.sidecar, ".tmp");
        std::fs::write(&tmp, self.place.render())
            .map_err(|e| ("could not write the step log's sidecar", tmp.clone(), e))?;
        std::fs::rename(&tmp, &self.sidecar)
            .map_err(|e| ("could not replace the step log's sidecar", self.sidecar.clone(), e))
    }
}

/// What one guest call brought.
enum Call {
    Output(Vec<u8>),
    Retry(String),
    Garbage(String),
}

pub(super) struct Follower<'a> {
    pub(super) tart: &'a Tart,
    pub(super) job: &'a Job,
    pub(super) cfg: &'a FollowConfig,
    /// When the guest last answered (or the follower started).
    pub(super) last_answer: Instant,
    pub(super) last_failure: String,
}

impl Follower<'_> {
    /// One poll, retried until the guest answers.
    async fn poll(&mut self, from: u64, max: u64) -> Result<PollReply, JobError> {
        crate::crash_point!("step.poll.before");
        let out = self
            .call("poll", &poll_argv(&self.job.dir, from, max), max + 4096)
            .await?;
        crate::crash_point!("step.poll.after");
        parse_poll(&out, from, max).map_err(|_| self.protocol("poll", poll_error(&out, from, max, &self.cfg.mask)))
    }

    /// Runs `argv` in the guest (a script that exits 0 and writes only to stdout) and returns its
    /// output; retries transient failures until the guest has been silent for the limit.
    async fn call(&mut self, what: &'static str, argv: &[String], max_out: u64) -> Result<Vec<u8>, JobError> {
        loop {
            let failure = match self.call_once(argv, max_out).await {
                Ok(Call::Output(out)) => {
                    self.last_answer = Instant::now();
                    return Ok(out);
                }
                Ok(Call::Retry(failure)) => failure,
                Ok(Call::Garbage(detail)) => return Err(self.protocol(what, detail)),
                Err(TartError::Io { action, path, source }) => return Err(self.io(action, path, source)),
                Err(e @ (TartError::VmNotRunning { .. } | TartError::VmDoesNotExist { .. })) => {
                    return Err(JobError::VmGone {
                        vm: self.job.vm.clone(),
                        step: self.job.step.clone(),
                        source: e,
                    });
                }
                Err(
                    e @ (TartError::ExecTimeout { .. }
                    | TartError::Timeout { .. }
                    | TartError::GuestAgentUnavailable { .. }
                    | TartError::Killed { .. }
                    | TartError::Failed { .. }
                    | TartError::UnexpectedOutput { .. }),
                ) => e.to_string(),
                Err(e) if what == "start" => return Err(self.start_refused(e.to_string())),
                Err(e) => return Err(self.protocol(what, e.to_string())),
            };
            let silent = self.last_answer.elapsed();
            tracing::warn!(vm = %self.job.vm, step = %self.job.step, what, ?silent, %failure, "guest call failed; retrying");
            self.last_failure = failure;
            if silent >= self.cfg.unresponsive_limit {
                return Err(JobError::Unresponsive {
                    vm: self.job.vm.clone(),
                    step: self.job.step.clone(),
                    dir: self.job.dir.clone(),
                    silent,
                    last: self.last_failure.clone(),
                });
            }
            tokio::time::sleep(self.cfg.poll_interval).await;
        }
    }

    /// One call: its output, a failure worth retrying, or output the scripts never make; `Err`
    /// for tart's typed errors. The output (a poll's holds the step's raw output, secret values
    /// not masked yet) stays in memory: never a file on the host.
    async fn call_once(&mut self, argv: &[String], max_out: u64) -> Result<Call, TartError> {
        let options = CaptureOptions {
            max_bytes: max_out,
            timeout: self.cfg.exec_timeout,
            stop_at_cap: false,
        };
        let Captured { outcome, output } = self.tart.exec_capture(&self.job.vm, argv, None, &options).await?;
        if outcome.exit_code != 0 {
            // The scripts exit 0: this is tart or the guest agent failing (the tail is tart's
            // stderr, not the output).
            return Ok(Call::Retry(format!(
                "tart exec exited {}: {}",
                outcome.exit_code,
                outcome.tail.trim()
            )));
        }
        if outcome.truncated {
            return Ok(Call::Garbage(format!(
                "the guest sent {} bytes, more than the {max_out} a reply can have",
                outcome.output_bytes
            )));
        }
        Ok(Call::Output(output))
    }

    fn io(&self, action: &'static str, path: PathBuf, source: std::io::Error) -> JobError {
        JobError::HostIo {
            vm: self.job.vm.clone(),
            step: self.job.step.clone(),
            action,
            path,
            source,
        }
    }

    fn protocol(&self, what: &'static str, detail: String) -> JobError {
        JobError::Protocol {
            vm: self.job.vm.clone(),
            step: self.job.step.clone(),
            dir: self.job.dir.clone(),
            what,
            detail,
        }
    }

    fn vanished(&self, detail: String) -> JobError {
        JobError::Vanished {
            vm: self.job.vm.clone(),
            step: self.job.step.clone(),
            dir: self.job.dir.clone(),
            detail,
        }
    }

    fn start_refused(&self, detail: String) -> JobError {
        JobError::StartRefused {
            vm: self.job.vm.clone(),
            step: self.job.step.clone(),
            dir: self.job.dir.clone(),
            detail,
        }
    }
}
