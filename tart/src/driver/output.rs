//! Where an exec's output goes: [`pump`] reads a `tart exec` child's stdout and stderr until it
//! exits (then drains the pipes for at most a second), into a [`LogSink`] that keeps the first
//! `cap` bytes (in the exec log file or in memory), notes the cap once, and keeps the last bytes
//! for error messages.

use super::*;

pub(super) async fn pump(
    child: &mut Child,
    out: &mut tokio::process::ChildStdout,
    err: &mut tokio::process::ChildStderr,
    sink: &mut LogSink,
    stop_at_cap: bool,
) -> std::io::Result<Option<ExitStatus>> {
    let mut out_buf = vec![0u8; 16 << 10];
    let mut err_buf = vec![0u8; 16 << 10];
    let (mut out_open, mut err_open) = (true, true);
    let mut exited: Option<ExitStatus> = None;
    while exited.is_none() {
        if (stop_at_cap && sink.truncated) || sink.refused.is_some() {
            return Ok(None);
        }
        tokio::select! {
            r = out.read(&mut out_buf), if out_open => match r {
                Ok(0) | Err(_) => out_open = false,
                Ok(n) => sink.write(&out_buf[..n], false),
            },
            r = err.read(&mut err_buf), if err_open => match r {
                Ok(0) | Err(_) => err_open = false,
                Ok(n) => sink.write(&err_buf[..n], true),
            },
            status = child.wait() => exited = Some(status?),
        }
    }
    // tart exec has exited; collect what is still buffered in the pipes, but don't wait on a straggler that
    // inherited them.
    let drain = async {
        while out_open || err_open {
            tokio::select! {
                r = out.read(&mut out_buf), if out_open => match r {
                    Ok(0) | Err(_) => out_open = false,
                    Ok(n) => sink.write(&out_buf[..n], false),
                },
                r = err.read(&mut err_buf), if err_open => match r {
                    Ok(0) | Err(_) => err_open = false,
                    Ok(n) => sink.write(&err_buf[..n], true),
                },
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
    Ok(exited)
}

/// The line a capped log ends with once more than `cap` bytes of output came (one wording for every
/// log that is capped this way).
pub fn log_cap_note(cap: u64) -> String {
    format!("\n[tartan: log cap of {cap} bytes reached; further output is not logged]\n")
}

/// Mode of the exec log files the driver creates: output may hold what only the agent's user
/// (and its group) should read.
pub const LOG_FILE_MODE: u32 = 0o640;

/// Where an exec's output goes.
pub(super) enum Target {
    File(std::fs::File),
    /// Kept in memory only ([`Tart::exec_capture`]).
    Memory(Vec<u8>),
    /// Handed to the caller's consumer piece by piece ([`Tart::exec_into`]).
    Consumer(Box<dyn OutputConsumer>),
}

/// Takes an exec's stdout as it comes (at most the cap; stderr only goes to the outcome's tail):
/// for output the caller must check before any of it is written anywhere.
pub trait OutputConsumer: Send {
    /// Takes the next piece. An error stops the exec at once (its `tart exec` is killed and its
    /// outcome is that of an exec stopped at the cap, without `truncated`); the error says why.
    fn consume(&mut self, data: &[u8]) -> Result<(), String>;
}

/// The exec log: the first `cap` bytes go to the file (or memory), the last `tail_cap` bytes stay
/// in memory.
pub(super) struct LogSink {
    pub(super) target: Target,
    /// The file's path (for messages); `(in memory)` for a memory sink.
    pub(super) path: PathBuf,
    pub(super) cap: u64,
    pub(super) written: u64,
    pub(super) total: u64,
    pub(super) truncated: bool,
    pub(super) write_failed: bool,
    /// Why the consumer refused the output (the exec is then stopped).
    pub(super) refused: Option<String>,
    pub(super) tail: VecDeque<u8>,
    pub(super) tail_cap: usize,
    pub(super) stderr_tail: VecDeque<u8>,
}

impl LogSink {
    pub(super) fn open(path: &Path, cap: u64, tail_cap: usize) -> Result<Self, TartError> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(LOG_FILE_MODE)
            .open(path)
            .map_err(|source| TartError::Io {
                action: "could not open the exec log",
                path: path.to_path_buf(),
                source,
            })?;
        Ok(LogSink {
            target: Target::File(file),
            path: path.to_path_buf(),
            cap,
            written: 0,
            total: 0,
            truncated: false,
            write_failed: false,
            refused: None,
            tail: VecDeque::new(),
            tail_cap,
            stderr_tail: VecDeque::new(),
        })
    }

    /// A sink that keeps the first `cap` bytes in memory; its tail is stderr's (see [`Captured`]).
    pub(super) fn memory(cap: u64) -> Self {
        LogSink {
            target: Target::Memory(Vec::new()),
            path: PathBuf::from("(in memory)"),
            cap,
            written: 0,
            total: 0,
            truncated: false,
            write_failed: false,
            refused: None,
            tail: VecDeque::new(),
            tail_cap: 0,
            stderr_tail: VecDeque::new(),
        }
    }

    /// A sink that hands the first `cap` bytes to `consumer`; its tail is stderr's, as a memory
    /// sink's.
    pub(super) fn consumer(consumer: Box<dyn OutputConsumer>, cap: u64) -> Self {
        LogSink {
            target: Target::Consumer(consumer),
            path: PathBuf::from("(the caller's consumer)"),
            ..LogSink::memory(cap)
        }
    }

    /// What a memory sink kept (empty for a file or a consumer).
    pub(super) fn into_memory(self) -> Vec<u8> {
        match self.target {
            Target::Memory(kept) => kept,
            Target::File(_) | Target::Consumer(_) => Vec::new(),
        }
    }

    pub(super) fn push(buf: &mut VecDeque<u8>, data: &[u8], cap: usize) {
        let data = &data[data.len().saturating_sub(cap)..];
        buf.extend(data);
        let excess = buf.len().saturating_sub(cap);
        buf.drain(..excess);
    }

    pub(super) fn write(&mut self, data: &[u8], is_stderr: bool) {
        if is_stderr && matches!(self.target, Target::Consumer(_)) {
            // A consumer takes the command's output (a file's bytes): what tart or the guest's
            // shell says on stderr, even of a command that succeeds, is kept for messages only.
            Self::push(&mut self.stderr_tail, data, 4096);
            return;
        }
        self.total += data.len() as u64;
        Self::push(&mut self.tail, data, self.tail_cap);
        if is_stderr {
            Self::push(&mut self.stderr_tail, data, 4096);
        }
        let room = self.cap.saturating_sub(self.written) as usize;
        let take = room.min(data.len());
        if take > 0 {
            self.file_write(&data[..take]);
            self.written += take as u64;
        }
        if take < data.len() && !self.truncated {
            self.truncated = true;
            // Memory keeps the output only; the caller sees `truncated`.
            if matches!(self.target, Target::File(_)) {
                let cap = self.cap;
                self.file_write(log_cap_note(cap).as_bytes());
            }
        }
    }

    pub(super) fn note(&mut self, text: &str) {
        if matches!(self.target, Target::File(_)) {
            self.file_write(text.as_bytes());
        }
    }

    pub(super) fn file_write(&mut self, data: &[u8]) {
        let file = match &mut self.target {
            Target::File(file) => file,
            Target::Memory(kept) => {
                kept.extend_from_slice(data);
                return;
            }
            Target::Consumer(consumer) => {
                if self.refused.is_none()
                    && let Err(why) = consumer.consume(data)
                {
                    self.refused = Some(why);
                }
                return;
            }
        };
        if let Err(e) = file.write_all(data)
            && !self.write_failed
        {
            self.write_failed = true;
            tracing::warn!(path = %self.path.display(), error = %e, "exec log write failed; output is kept only in the in-memory tail");
        }
    }

    pub(super) fn flush(&mut self) {
        if let Target::File(file) = &mut self.target {
            let _ = file.flush();
        }
    }

    pub(super) fn tail(&self) -> String {
        if !matches!(self.target, Target::File(_)) {
            return self.stderr_tail();
        }
        let (a, b) = self.tail.as_slices();
        String::from_utf8_lossy(&[a, b].concat()).into_owned()
    }

    pub(super) fn stderr_tail(&self) -> String {
        let (a, b) = self.stderr_tail.as_slices();
        String::from_utf8_lossy(&[a, b].concat()).into_owned()
    }
}
