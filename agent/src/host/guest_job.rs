//! A build step as a detached job in the guest, so that losing the agent loses nothing.
//!
//! A step used to be one long `tart exec VM argv…`: when the agent died, the exec client died and
//! the guest agent SIGKILLed the step. Here a step is started through one short `tart exec` as a
//! job detached from that exec (`nohup … &`, all three stdio redirected: the guest agent kills
//! only the exec's direct child, and a job holding the exec's stdout would keep the exec from
//! returning). The job writes its pid, its output and its exit status to files in its guest
//! folder ([`job_dir`]):
//!
//! * `pid`: the wrapper shell's pid, written first (through `pid.tmp` and a rename);
//! * `out.log`: stdout and stderr of the step, whose stdin is `/dev/null`;
//! * `size`: the size of `out.log` when the step's process exited, written before `exit`;
//! * `exit`: the exit status as `sh` reports it (128+N for a death by signal N), written through
//!   `exit.tmp` and a rename, after `out.log` is complete.
//!
//! The step ends when its own process exits, as a `tart exec` of it did: a child it leaves behind
//! may go on writing to `out.log`, and what it writes after `size` was taken is not the step's
//! output (polls of an exited job never report more than `size`; a job started by a wrapper
//! without `size`, an older agent's, reports the whole file).
//!
//! [`run_or_attach`] follows the job with short `tart exec` polls ([`poll_argv`]) that print one
//! header line and a slice of `out.log`; it appends the new bytes to the host step log and keeps
//! its place in a sidecar file next to that log ([`sidecar_path`]), so a new follower (after an
//! agent restart) continues where the last one stopped. `mkdir` of the job folder is the
//! "started once" guard: starting an existing job does nothing.
//!
//! The guest is macOS: the scripts use POSIX `sh` and tools macOS has. The step's argv (written
//! by pipeline authors, untrusted) reaches the guest only as positional parameters and is run by
//! `nohup -- "$@"` (an exec of the program, as `tart exec` would: no shell builtins, no option or
//! assignment parsing). Guest paths are relative to the exec working directory (the guest user's
//! home; the VM folder with `tart-double`). The driver's exec log interleaves stdout and stderr,
//! so the scripts send nothing to stderr.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tartan_tart::{CaptureOptions, Captured, Tart, TartError, log_cap_note};

use super::steps::safe_name;

mod follow;

use follow::{Follower, follow};

/// The guest folder under the exec working directory that holds every job folder.
pub const GUEST_ROOT: &str = ".tartan";

/// First word of every line the scripts print, so that nothing else is taken for an answer.
const MAGIC: &str = "tartan-job";

/// The guest folder of step number `index` (0-based, in the order the steps run) named `step`
/// of VM `vm`: `.tartan/<vm>/<NN>-<step>`, with `vm` and `step` made harmless by
/// [`safe_name`] (no `/`, no `..`), so the folder never leaves `.tartan/<vm>/`.
pub fn job_dir(vm: &str, index: usize, step: &str) -> String {
    format!("{GUEST_ROOT}/{}/{index:02}-{}", safe_name(vm), safe_name(step))
}

/// One step to run as a job in VM `vm`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// The VM (`tart exec` target).
    pub vm: String,
    /// The step's name, for messages.
    pub step: String,
    /// The guest folder ([`job_dir`]).
    pub dir: String,
    /// The step's argv, run verbatim.
    pub argv: Vec<String>,
}

impl Job {
    /// Step number `index` (0-based, unique within the attempt) named `step`, running `argv`.
    pub fn new(vm: &str, index: usize, step: &str, argv: Vec<String>) -> Job {
        Job {
            vm: vm.to_string(),
            step: step.to_string(),
            dir: job_dir(vm, index, step),
            argv,
        }
    }
}

/// The start script: `$1` is the job folder, the rest the step's argv.
///
/// The guard (`mkdir` of the folder) and the launch happen in one shell that is not the exec's
/// direct child: the guest agent SIGKILLs only that child when the `tart exec` client goes away
/// (the agent killed mid-start), so once the folder exists the job is launched whatever happens to
/// the exec. Done by the direct child, a kill between the two left a folder without a job, which a
/// resumed agent never starts again and fails as vanished.
///
/// The step runs as an asynchronous list that the wrapper waits for: run in the foreground, a
/// death by signal would make the shell write `Terminated` into `out.log`. `set -m` (job control)
/// keeps a non-interactive shell from starting asynchronous lists with SIGINT and SIGQUIT ignored
/// (macOS's `sh`, bash, honours it without a terminal; dash cannot and leaves them ignored). The
/// step starts with SIGHUP ignored (nohup). With job control bash's `wait` also returns when the
/// step is stopped (status 128+N): the wrapper waits again while the step is still there, so a
/// step stopped for a while (a debugger, SIGTSTP) keeps its own exit status. The wrapper sources
/// the VM folder's env file (`spec.env`, see `host::env`), if there is one, before the step.
const START_SCRIPT: &str = r#"exec 2>/dev/null
d=$1
shift
mkdir -p "${d%/*}"
job='set -m
d=$1
shift
echo $$ >"$d/pid.tmp" && mv "$d/pid.tmp" "$d/pid" || exit 1
e=${d%/*}/env
if [ -f "$e" ]; then . "$e"; fi
nohup -- "$@" </dev/null >"$d/out.log" 2>&1 &
p=$!
wait $p
c=$?
while [ "$c" -gt 128 ] && kill -0 "$p"; do sleep 1; wait "$p"; c=$?; done
wc -c <"$d/out.log" >"$d/size.tmp" && mv "$d/size.tmp" "$d/size"
echo $c >"$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"'
launch='job=$1
d=$2
shift 2
if err=$(mkdir "$d" 2>&1); then
  set -m
  nohup sh -c "$job" tartan-job "$d" "$@" </dev/null >/dev/null 2>&1 &
  echo "tartan-job started"
elif [ -d "$d" ]; then
  echo "tartan-job exists"
else
  echo "tartan-job refused: $err"
fi'
nohup sh -c "$launch" tartan-start "$job" "$d" "$@" </dev/null
exit 0
"#;

/// The argv of the call that starts `job` in the guest unless its folder exists. It prints one
/// line, read by [`parse_start`]. The step's argv follows as positional parameters, never as
/// script text.
pub fn start_argv(job: &Job) -> Vec<String> {
    let mut argv = vec![
        "sh".to_string(),
        "-c".to_string(),
        START_SCRIPT.to_string(),
        MAGIC.to_string(),
        job.dir.clone(),
    ];
    argv.extend(job.argv.iter().cloned());
    argv
}

/// What the start call found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Started {
    /// The folder was made and the job launched by this call.
    Now,
    /// The folder existed: the job was started before (by this call's predecessor).
    Before,
    /// The folder could not be made (the guest's reason).
    Refused(String),
}

/// Reads the start call's output: exactly one of its three lines.
pub fn parse_start(out: &[u8]) -> Result<Started, String> {
    let text = std::str::from_utf8(out).map_err(|_| format!("not UTF-8: {}", show(out)))?;
    match text {
        "tartan-job started\n" => Ok(Started::Now),
        "tartan-job exists\n" => Ok(Started::Before),
        _ => match text.strip_prefix("tartan-job refused: ") {
            Some(why) => Ok(Started::Refused(why.trim().to_string())),
            None => Err(format!(
                "expected `tartan-job started|exists|refused: …`, got {}",
                show(out)
            )),
        },
    }
}

/// The poll script: `$1` the job folder, `$2` the byte offset, `$3` the most bytes to send. The
/// exit file is read before the log's size, so "exited" means the size is final. The size is never
/// more than the `size` file says once it exists, whatever state was read before it (a child the
/// step left may write on after the step's exit); a zombie counts as gone (an orphan's parent may
/// not reap it at once).
const POLL_SCRIPT: &str = r#"exec 2>/dev/null
d=$1 from=$2 max=$3
alive() {
  kill -0 "$1" || return 1
  case $(ps -o stat= -p "$1") in Z*) return 1 ;; esac
}
if [ -f "$d/exit" ]; then
  state="exited $(cat "$d/exit")"
elif [ -f "$d/pid" ]; then
  pid=$(cat "$d/pid")
  case $pid in ''|*[!0-9]*) pid=- ;; esac
  if [ "$pid" != - ] && alive "$pid"; then
    state=running
  elif [ -f "$d/exit" ]; then
    state="exited $(cat "$d/exit")"
  else
    state="vanished $pid"
  fi
elif [ -d "$d" ]; then
  state=starting
else
  state=absent
fi
size=0
if [ -f "$d/out.log" ]; then size=$(( $(wc -c <"$d/out.log") )); fi
final=
if [ -f "$d/size" ]; then final=$(tr -d ' \n' <"$d/size"); fi
case $final in ''|*[!0-9]*) ;; *) if [ "$size" -gt "$final" ]; then size=$final; fi ;; esac
n=$((size - from))
if [ "$n" -gt "$max" ]; then n=$max; fi
if [ "$n" -lt 0 ]; then n=0; fi
echo "tartan-job $state size $size bytes $n"
if [ "$n" -gt 0 ]; then tail -c +$((from + 1)) "$d/out.log" | head -c "$n"; fi
exit 0
"#;

/// The argv of a poll of the job in folder `dir`: one header line (see [`parse_poll`]), then at
/// most `max` bytes of `out.log` from byte `from` (never past the size the header states).
pub fn poll_argv(dir: &str, from: u64, max: u64) -> Vec<String> {
    vec![
        "sh".to_string(),
        "-c".to_string(),
        POLL_SCRIPT.to_string(),
        MAGIC.to_string(),
        dir.to_string(),
        from.to_string(),
        max.to_string(),
    ]
}

/// The job's state in a poll.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobState {
    /// The exit file holds this status; the log is complete.
    Exited(i32),
    /// The pid file names a live process.
    Running,
    /// The folder exists but the pid file does not (yet).
    Starting,
    /// The pid file names a process that is gone, and there is no exit file; `None` if the pid
    /// file did not hold a number.
    Vanished(Option<u32>),
    /// There is no job folder.
    Absent,
}

/// One poll's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PollReply {
    pub state: JobState,
    /// Size of `out.log` when it was measured (after the state was read).
    pub size: u64,
    /// `out.log` from the requested offset, at most the requested count.
    pub bytes: Vec<u8>,
}

/// Reads a poll's output for a request of `max` bytes from `from`: the header line
/// `tartan-job <state> size <S> bytes <N>` and exactly `N` bytes. Anything else (a missing or
/// malformed header, a count that disagrees with the request or the size, more or fewer bytes
/// than announced) is refused with what was seen.
pub fn parse_poll(out: &[u8], from: u64, max: u64) -> Result<PollReply, String> {
    let Some(nl) = out.iter().position(|&b| b == b'\n') else {
        return Err(format!("no header line in {}", show(out)));
    };
    let (header, body) = (&out[..nl], &out[nl + 1..]);
    let header = std::str::from_utf8(header).map_err(|_| format!("header is not UTF-8: {}", show(header)))?;
    let bad = |why: &str| format!("{why} in header {header:?}");
    let words: Vec<&str> = header.split(' ').collect();
    let (state, rest) = match words.as_slice() {
        [MAGIC, "exited", code, rest @ ..] => {
            let code: i32 = code.parse().map_err(|_| bad("exit status is not a number"))?;
            if !(0..=255).contains(&code) {
                return Err(bad("exit status out of 0..=255"));
            }
            (JobState::Exited(code), rest)
        }
        [MAGIC, "running", rest @ ..] => (JobState::Running, rest),
        [MAGIC, "starting", rest @ ..] => (JobState::Starting, rest),
        [MAGIC, "vanished", pid, rest @ ..] => {
            let pid = match *pid {
                "-" => None,
                p => Some(p.parse().map_err(|_| bad("pid is not a number"))?),
            };
            (JobState::Vanished(pid), rest)
        }
        [MAGIC, "absent", rest @ ..] => (JobState::Absent, rest),
        _ => return Err(bad("unknown state")),
    };
    let ["size", size, "bytes", count] = rest else {
        return Err(bad("expected `size S bytes N` after the state"));
    };
    let size: u64 = size.parse().map_err(|_| bad("size is not a number"))?;
    let count: u64 = count.parse().map_err(|_| bad("byte count is not a number"))?;
    let expected = size.saturating_sub(from).min(max);
    if count != expected {
        return Err(bad(&format!(
            "byte count {count} is not the {expected} asked for (from {from}, at most {max})"
        )));
    }
    if body.len() as u64 != count {
        return Err(bad(&format!("{} bytes follow, not {count}", body.len())));
    }
    Ok(PollReply {
        state,
        size,
        bytes: body.to_vec(),
    })
}

/// Some bytes for an error message: lossy, escaped, the first 200 bytes.
/// Why `out` is no poll reply ([`parse_poll`]'s error), with Secret values masked in the header
/// before it is quoted: the header is the guest's text (the step can write its job's exit file),
/// and quoting escapes it, after which no mask matches a value holding `"` or `\`.
pub fn poll_error(out: &[u8], from: u64, max: u64, mask: &crate::host::env::Masker) -> String {
    let end = out.iter().position(|&b| b == b'\n').unwrap_or(out.len());
    let masked = [mask.mask(&out[..end], true).0.as_slice(), &out[end..]].concat();
    match parse_poll(&masked, from, max) {
        Err(why) => why,
        Ok(_) => "the poll's header holds a Secret value; it is not quoted".into(),
    }
}

fn show(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(200)];
    let more = if bytes.len() > 200 { "…" } else { "" };
    format!("{:?}{more} ({} bytes)", String::from_utf8_lossy(cut), bytes.len())
}

// ------------------------------------------------------------------------------------------------
// The host log and its sidecar (pure parts).

/// Where a follower of the job keeps its place: the job's folder, the host log's length before
/// the job's first byte (`base`: the log may hold earlier commands, as the two checkout commands
/// share one), how many bytes of the guest log were consumed (`offset`: written, or skipped
/// past the cap), and whether the guest confirmed the job's start (`started`).
///
/// `started` makes "never run twice" independent of the guest folder: the VM name carries the
/// build's uid and the attempt, so the step logs of `logs/<vm>/` belong to this VM alone, and a
/// job this host saw started is never started again, even when a later step deleted its folder
/// (it is then vanished). A sidecar without it (an older agent's) leaves that to the folder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    pub dir: String,
    pub base: u64,
    pub offset: u64,
    pub started: bool,
    /// Host bytes written for the job since `base`, kept when secret values are masked (the
    /// log then no longer holds the guest's bytes one for one); `None`: [`logged_len`] says it.
    pub logged: Option<u64>,
}

/// The sidecar of `host_log`: `<host_log>.follow`.
pub fn sidecar_path(host_log: &Path) -> PathBuf {
    with_suffix(host_log, ".follow")
}

/// The scratch file an older agent passed each poll's output through: `<host_log>.poll`.
pub fn scratch_path(host_log: &Path) -> PathBuf {
    with_suffix(host_log, ".poll")
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

impl Place {
    /// The sidecar's text: one line.
    pub fn render(&self) -> String {
        let started = if self.started { " started" } else { "" };
        let logged = self.logged.map_or(String::new(), |l| format!(" logged {l}"));
        format!(
            "tartan-follow {} {} {}{started}{logged}\n",
            self.dir, self.base, self.offset
        )
    }

    /// Reads [`render`](Self::render)'s line; `None` for anything else (the sidecar is then ignored).
    pub fn parse(text: &str) -> Option<Place> {
        let line = text.strip_suffix('\n')?;
        let (dir, base, offset, started, logged) = match line.split(' ').collect::<Vec<_>>()[..] {
            ["tartan-follow", dir, base, offset] => (dir, base, offset, false, None),
            ["tartan-follow", dir, base, offset, "started"] => (dir, base, offset, true, None),
            ["tartan-follow", dir, base, offset, "logged", l] => (dir, base, offset, false, Some(l)),
            ["tartan-follow", dir, base, offset, "started", "logged", l] => (dir, base, offset, true, Some(l)),
            _ => return None,
        };
        Some(Place {
            dir: dir.to_string(),
            base: base.parse().ok()?,
            offset: offset.parse().ok()?,
            started,
            logged: logged.map(str::parse).transpose().ok()?,
        })
    }
}

/// How long the host log should be at guest offset `offset` under cap `cap`, counted from the
/// job's base: the first `cap` bytes, then the cap note once more than `cap` came.
pub fn logged_len(offset: u64, cap: u64) -> u64 {
    offset.min(cap)
        + if offset > cap {
            log_cap_note(cap).len() as u64
        } else {
            0
        }
}

/// Where a follower of the job in `dir` starts, given the sidecar's place (if any) and the host
/// log's length now. Returns the place and the length to cut the host log to.
///
/// A place of another job (or none) starts a new one at the log's end. A log longer than the
/// place says (a crash between an append and the sidecar's update) is cut back to it, so nothing
/// repeats. A shorter one (its end was lost, e.g. not on disk at a power loss) continues from what
/// it holds: up to the cap the log holds the guest's bytes one for one.
pub fn resume(saved: Option<Place>, dir: &str, host_len: u64, cap: u64) -> (Place, u64) {
    let fresh = Place {
        dir: dir.to_string(),
        base: host_len,
        offset: 0,
        started: false,
        logged: None,
    };
    let Some(place) = saved.filter(|p| p.dir == dir) else {
        return (fresh, host_len);
    };
    if host_len < place.base {
        return (fresh, host_len);
    }
    if let Some(logged) = place.logged {
        // Masked output maps to the guest's bytes only at the recorded place: a longer log is
        // cut back to it; a shorter one (its end lost) starts the job's output over from the
        // guest log, which is complete.
        let expected = place.base + logged;
        if host_len >= expected {
            return (place, expected);
        }
        let base = place.base;
        return (
            Place {
                offset: 0,
                logged: Some(0),
                ..place
            },
            base,
        );
    }
    let expected = place.base + logged_len(place.offset, cap);
    if host_len >= expected {
        return (place, expected);
    }
    let keep = (host_len - place.base).min(cap);
    let base = place.base;
    (Place { offset: keep, ..place }, base + keep)
}

/// What to do with `chunk` (the guest bytes from `offset`; the guest log has `size` bytes):
/// returns how many of its bytes go to the host log, whether the cap note follows them, and the
/// new offset. Once the cap is reached nothing more is written and the offset skips to `size`
/// (no need to fetch what is not kept).
pub fn advance(offset: u64, chunk_len: u64, size: u64, cap: u64) -> (u64, bool, u64) {
    let room = cap.saturating_sub(offset);
    let write = chunk_len.min(room);
    let mut next = offset + chunk_len;
    if next >= cap {
        next = next.max(size);
    }
    let note = offset <= cap && next > cap;
    (write, note, next)
}

/// How many bytes to ask for at `offset`: a chunk, but never more than `lookahead` bytes past
/// the cap (0 once the offset is there). The lookahead is what masking needs to see past the cap
/// ([`take`]); nothing past the cap is logged.
pub fn request(offset: u64, chunk: u64, cap: u64, lookahead: u64) -> u64 {
    if offset >= cap {
        return 0;
    }
    chunk.min((cap - offset).saturating_add(lookahead))
}

/// Bytes past the cap a poll brings so that a secret value that starts before the cap and ends
/// after it is seen whole: one less than the longest value.
pub fn cap_lookahead(mask: &super::env::Masker) -> u64 {
    mask.max_len().saturating_sub(1) as u64
}

/// What one poll adds to the host log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Take {
    /// The masked bytes to append.
    pub bytes: Vec<u8>,
    /// Whether the cap note follows them.
    pub note: bool,
    /// The guest offset after them.
    pub next: u64,
}

/// What to log of `chunk`, the guest bytes from `offset` (the guest log has `size` bytes;
/// `complete`: the job exited and `chunk` reaches its end; `full`: the poll brought all it asked
/// for), under cap `cap`, masking `mask`'s values.
///
/// The end of the chunk may be the start of a value: unless the output is complete, that much is
/// held back (not logged, the offset stays before it) and read again with what follows. At the
/// cap the bytes past it are context only (the poll asks for [`cap_lookahead`] of them): a value
/// that straddles the cap is masked, and the cap part is held back like any other until it can
/// be told; only then comes the note and the offset skips to `size`.
///
/// A full chunk always makes progress: a poll asks for two values' length more than a chunk
/// ([`poll_bytes`]), which tells any value and any value overlapping it; only a run of values
/// overlapping each other longer than a chunk is decided up to where a value may start in it,
/// or at the chunk's end as if the output ended there when none may (otherwise the follower
/// would ask for the same bytes again and again).
pub fn take(
    offset: u64,
    chunk: &[u8],
    size: u64,
    complete: bool,
    full: bool,
    cap: u64,
    mask: &super::env::Masker,
) -> Take {
    let (write, note, next) = advance(offset, chunk.len() as u64, size, cap);
    let (mut bytes, mut used) = mask.mask_until(chunk, write as usize, complete);
    if used == 0 && write > 0 && full && !complete {
        // A run of overlapping values covers the read up to where a value may start: decide up
        // to that place (occurrences reaching past it show as the mask) and read again from it,
        // so that a value starting there is whole in the next read. Deciding the whole read as
        // if the output ended there logged such a value's rest in clear.
        match mask.open_start(chunk).filter(|&at| at > 0 && at < write as usize) {
            Some(at) => (bytes, used) = (mask.mask_until(chunk, at, true).0, at),
            None => (bytes, used) = mask.mask_until(chunk, write as usize, true),
        }
    }
    if (used as u64) < write {
        return Take {
            bytes,
            note: false,
            next: offset + used as u64,
        };
    }
    Take { bytes, note, next }
}

/// Pieces at least this large are masked on a blocking thread ([`take_off_runtime`]).
pub const MASK_OFF_RUNTIME_BYTES: usize = 64 << 10;

/// [`take`] for the follower: a large piece with values to mask is masked on tokio's blocking
/// pool, so masking a megabyte of output never holds up the runtime's threads (heartbeats,
/// Lease renewals, other builds' followers). Dropped while it runs, nothing is appended: the
/// next follower reads the piece again.
async fn take_off_runtime(
    offset: u64,
    chunk: Vec<u8>,
    size: u64,
    complete: bool,
    full: bool,
    cfg: &FollowConfig,
) -> Take {
    if cfg.mask.is_empty() || chunk.len() < MASK_OFF_RUNTIME_BYTES {
        return take(offset, &chunk, size, complete, full, cfg.log_cap, &cfg.mask);
    }
    let (cap, mask) = (cfg.log_cap, cfg.mask.clone());
    let masking = tokio::task::spawn_blocking(move || take(offset, &chunk, size, complete, full, cap, &mask));
    match masking.await {
        Ok(took) => took,
        // A panic in `take` is the follower's own, not the guest's.
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // The runtime is shutting down: nothing is logged, the piece is read again next time.
        Err(_) => Take {
            bytes: Vec::new(),
            note: false,
            next: offset,
        },
    }
}

/// How many bytes a poll at `offset` asks for: a chunk and two of the longest value (what
/// [`take`] needs to tell a value and one overlapping it at the chunk's end), never more than
/// [`cap_lookahead`] past the cap.
pub fn poll_bytes(offset: u64, cfg: &FollowConfig) -> u64 {
    let values = 2 * cfg.mask.max_len() as u64;
    request(offset, cfg.chunk_bytes + values, cfg.log_cap, cap_lookahead(&cfg.mask))
}

// ------------------------------------------------------------------------------------------------
// The follower.

/// Limits of [`run_or_attach`]. Defaults suit a real Mac.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FollowConfig {
    /// Pause between polls of a running job (none while a poll brings a full chunk).
    pub poll_interval: Duration,
    /// Limit of each `tart exec` (start or poll); it must be well below `unresponsive_limit`
    /// and the caller's own limits. On expiry that `tart exec` is killed, never the job.
    pub exec_timeout: Duration,
    /// How long the guest may fail to answer (timeouts, guest agent unavailable, tart failing)
    /// before [`JobError::Unresponsive`].
    pub unresponsive_limit: Duration,
    /// How long a job folder may lack its pid file before [`JobError::NeverLaunched`] (the
    /// launching shell died between `mkdir` and the job's pid: the guest rebooted or crashed).
    pub no_pid_limit: Duration,
    /// Most bytes of output one poll brings.
    pub chunk_bytes: u64,
    /// Most bytes of the job's output written to the host log; then [`log_cap_note`].
    pub log_cap: u64,
    /// Bytes of the end of the output returned in [`JobEnd::tail`].
    pub tail_bytes: u64,
    /// Secret values replaced by `***` in the host log and the tail (`spec.env`); empty: none.
    pub mask: super::env::Masker,
}

impl Default for FollowConfig {
    fn default() -> Self {
        FollowConfig {
            poll_interval: Duration::from_secs(1),
            exec_timeout: Duration::from_secs(20),
            unresponsive_limit: Duration::from_secs(60),
            no_pid_limit: Duration::from_secs(15),
            chunk_bytes: 1 << 20,
            log_cap: 64 << 20,
            tail_bytes: 16 << 10,
            mask: super::env::Masker::default(),
        }
    }
}

/// How a job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobEnd {
    /// The step's exit status as the guest's `sh` reports it (128+N for a death by signal N).
    pub exit_code: i32,
    /// The last [`FollowConfig::tail_bytes`] of the step's output (lossy UTF-8), read from the
    /// guest log's end (right after a restart and past the cap too).
    pub tail: String,
    /// Size of the step's output in the guest.
    pub output_bytes: u64,
    /// True if the host log was capped.
    pub truncated: bool,
    /// True if the job had been started before this call (a re-attach).
    pub attached: bool,
    /// Time this call took.
    pub elapsed: Duration,
}

/// Why [`run_or_attach`] did not bring the job's end. Each names the VM, the step and what
/// happens next; the caller maps them differently.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The VM is not running or does not exist (`source` says which): the step cannot go on.
    #[error("step {step:?} in {vm}: {source}; the step's job ended with the VM")]
    VmGone {
        vm: String,
        step: String,
        #[source]
        source: TartError,
    },
    /// The guest has not answered for `silent` (each `tart exec` timed out or failed).
    #[error(
        "step {step:?} in {vm}: the guest has not answered for {silent:?} (last failure: {last}); \
         stopped following job {dir}, which may still run in the guest"
    )]
    Unresponsive {
        vm: String,
        step: String,
        dir: String,
        silent: Duration,
        last: String,
    },
    /// The job is gone without an exit status: its process died without writing one, or its
    /// folder disappeared.
    #[error("step {step:?} in {vm}: job {dir} vanished ({detail}); its exit status is unknown")]
    Vanished {
        vm: String,
        step: String,
        dir: String,
        detail: String,
    },
    /// The job's folder has had no pid for `waited`: the start call that made it was cut short
    /// between its `mkdir` and the launch (its `tart exec` killed, as with the agent's process
    /// group), so the step never ran; the folder keeps it from being started now.
    #[error(
        "step {step:?} in {vm}: job {dir} was never launched (its folder has had no pid file for {waited:?}: \
         the start that made it was cut short before the launch); the step did not run"
    )]
    NeverLaunched {
        vm: String,
        step: String,
        dir: String,
        waited: Duration,
    },
    /// The guest or tart refused to start the job (no command, a folder that cannot be made,
    /// arguments tart cannot pass): the step did not run.
    #[error("step {step:?} in {vm}: job {dir} could not be started: {detail}; the step did not run")]
    StartRefused {
        vm: String,
        step: String,
        dir: String,
        detail: String,
    },
    /// The guest answered something the scripts never print, or tart failed in a way retrying
    /// cannot mend.
    #[error("step {step:?} in {vm}: the {what} of job {dir} failed: {detail}; stopped following it")]
    Protocol {
        vm: String,
        step: String,
        dir: String,
        what: &'static str,
        detail: String,
    },
    /// The host log or its sidecar could not be written or read.
    #[error("step {step:?} in {vm}: {action} {}: {source}; stopped following the job, which may still run", path.display())]
    HostIo {
        vm: String,
        step: String,
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Runs `job` to its end, or follows it if it was started before, appending its output to
/// `host_log` (created if missing) under [`FollowConfig::log_cap`].
///
/// The start is idempotent (the job folder's `mkdir`), so calling this again for the same job,
/// in this process or after a restart, re-attaches: the sidecar ([`sidecar_path`]) says how far
/// the host log got, and the host log ends up holding the guest's output exactly once.
///
/// Cancel-safe: dropping the future kills at most the `tart exec` in flight (a start or a poll),
/// never the job; the host log and sidecar are updated together without an await between them.
/// Dropping it during the very first start call may leave a folder without a job (killed between
/// its `mkdir` and the launch); the next follower reports that as [`JobError::NeverLaunched`]
/// after [`FollowConfig::no_pid_limit`].
pub async fn run_or_attach(tart: &Tart, job: &Job, host_log: &Path, cfg: &FollowConfig) -> Result<JobEnd, JobError> {
    // An older agent passed each poll's raw output through this file; whatever it left goes.
    remove_scratch(host_log);
    let mut f = Follower {
        tart,
        job,
        cfg,
        last_answer: Instant::now(),
        last_failure: String::new(),
    };
    follow(&mut f, host_log).await
}

/// Removes the scratch files in step log folder `dir`: `*.log.poll` (an older agent's poll
/// output, unmasked) and `*.log.stop` (a stop's reply). Returns how many went; failures are
/// logged (the folder's pruning removes them later).
pub fn remove_scratch_files(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.ends_with(".log.poll") || name.ends_with(".log.stop")) {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => removed += 1,
            Err(error) => {
                tracing::warn!(file = %entry.path().display(), %error, "could not remove a step scratch file")
            }
        }
    }
    removed
}

/// Removes the poll scratch file an older agent may have left next to `host_log` (it held a
/// poll's raw, unmasked output). Polls now keep their output in memory only.
pub fn remove_scratch(host_log: &Path) {
    let scratch = scratch_path(host_log);
    match std::fs::remove_file(&scratch) {
        Ok(()) => tracing::info!(file = %scratch.display(), "removed an older agent's poll scratch file"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => {
            tracing::warn!(file = %scratch.display(), %error, "could not remove an older agent's poll scratch file")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_folders_stay_under_the_vms_folder() {
        assert_eq!(job_dir("mb-x", 3, "build"), ".tartan/mb-x/03-build");
        assert_eq!(job_dir("mb-x", 123, "_checkout"), ".tartan/mb-x/123-_checkout");
        assert_eq!(job_dir("mb-x", 0, "../../etc"), ".tartan/mb-x/00-______etc");
        assert_eq!(job_dir("../x", 0, "a"), ".tartan/___x/00-a");
        for hostile in ["..", "/", "a/../../b", "a b", "a\nb", "\0", "", ".", "\u{202e}x"] {
            let dir = job_dir("mb-x", 1, hostile);
            let (parent, name) = dir.rsplit_once('/').unwrap();
            assert_eq!(parent, ".tartan/mb-x", "{hostile:?}");
            assert!(name.starts_with("01-"), "{hostile:?}: {name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
                "{hostile:?}: {name}"
            );
        }
        // The same cut as the host logs' (one sanitizer for both).
        let long = job_dir("mb-x", 1, &"s".repeat(1000));
        assert_eq!(
            long.len(),
            ".tartan/mb-x/01-".len() + super::super::steps::STEP_LOG_NAME_MAX
        );
    }

    #[test]
    fn the_step_argv_is_passed_as_parameters_never_as_script_text() {
        let argv: Vec<String> = ["printf", "%s", "$(touch pwned)", "'\"", "a\nb", "--"]
            .map(String::from)
            .to_vec();
        let job = Job::new("mb-x", 2, "build", argv.clone());
        let start = start_argv(&job);
        assert_eq!(start[..2], ["sh", "-c"]);
        assert_eq!(start[2], START_SCRIPT);
        assert_eq!(start[3], "tartan-job");
        assert_eq!(start[4], ".tartan/mb-x/02-build");
        assert_eq!(start[5..], argv[..]);
        assert_eq!(
            poll_argv(".tartan/mb-x/02-build", 10, 4096),
            [
                "sh",
                "-c",
                POLL_SCRIPT,
                "tartan-job",
                ".tartan/mb-x/02-build",
                "10",
                "4096"
            ]
        );
        // Neither script writes to stderr (the exec log mixes it into what is parsed).
        for script in [START_SCRIPT, POLL_SCRIPT] {
            assert!(script.starts_with("exec 2>/dev/null\n"), "{script}");
        }
    }

    #[test]
    fn start_replies_are_exactly_the_three_lines() {
        assert_eq!(parse_start(b"tartan-job started\n"), Ok(Started::Now));
        assert_eq!(parse_start(b"tartan-job exists\n"), Ok(Started::Before));
        assert_eq!(
            parse_start(b"tartan-job refused: mkdir: x: Permission denied\n"),
            Ok(Started::Refused("mkdir: x: Permission denied".into()))
        );
        for bad in [
            &b""[..],
            b"tartan-job started",
            b"tartan-job started\nmore\n",
            b"started\n",
            b"sh: warning\ntartan-job started\n",
            b"tartan-job exists\n\n",
            b"\xff\n",
        ] {
            let e = parse_start(bad).unwrap_err();
            assert!(e.contains("bytes)"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn poll_replies_parse_every_state() {
        let r = parse_poll(b"tartan-job exited 3 size 10 bytes 4\nabcd", 6, 100).unwrap();
        assert_eq!(
            r,
            PollReply {
                state: JobState::Exited(3),
                size: 10,
                bytes: b"abcd".to_vec()
            }
        );
        let r = parse_poll(b"tartan-job running size 10 bytes 2\n\n\n", 0, 2).unwrap();
        assert_eq!((r.state, r.bytes), (JobState::Running, b"\n\n".to_vec()));
        let r = parse_poll(b"tartan-job starting size 0 bytes 0\n", 0, 2).unwrap();
        assert_eq!(r.state, JobState::Starting);
        let r = parse_poll(b"tartan-job vanished 4242 size 1 bytes 0\n", 1, 2).unwrap();
        assert_eq!(r.state, JobState::Vanished(Some(4242)));
        let r = parse_poll(b"tartan-job vanished - size 0 bytes 0\n", 0, 2).unwrap();
        assert_eq!(r.state, JobState::Vanished(None));
        let r = parse_poll(b"tartan-job absent size 0 bytes 0\n", 0, 2).unwrap();
        assert_eq!(r.state, JobState::Absent);
        // An offset past the end (the log was read to it) brings nothing.
        let r = parse_poll(b"tartan-job exited 0 size 5 bytes 0\n", 9, 2).unwrap();
        assert_eq!((r.state, r.size, r.bytes.len()), (JobState::Exited(0), 5, 0));
        // The body is the job's output: a line in it that looks like a header is data.
        let body = b"tartan-job exited 0 size 0 bytes 0\n";
        let mut out = format!("tartan-job running size 90 bytes {}\n", body.len()).into_bytes();
        out.extend(body);
        let r = parse_poll(&out, 0, body.len() as u64).unwrap();
        assert_eq!((r.state, r.bytes), (JobState::Running, body.to_vec()));
    }

    #[test]
    fn poll_replies_refuse_anything_unexpected() {
        let cases: &[(&[u8], u64, u64, &str)] = &[
            (b"", 0, 10, "no header line"),
            (b"tartan-job running size 1 bytes 1", 0, 10, "no header line"),
            (
                b"tartan-job exited x size 0 bytes 0\n",
                0,
                10,
                "exit status is not a number",
            ),
            (b"tartan-job exited 256 size 0 bytes 0\n", 0, 10, "out of 0..=255"),
            (b"tartan-job exited -1 size 0 bytes 0\n", 0, 10, "out of 0..=255"),
            (
                b"tartan-job exited  size 0 bytes 0\n",
                0,
                10,
                "exit status is not a number",
            ),
            (
                b"tartan-job exited 1 2 size 0 bytes 0\n",
                0,
                10,
                "expected `size S bytes N`",
            ),
            (b"tartan-job vanished x size 0 bytes 0\n", 0, 10, "pid is not a number"),
            (b"tartan-job sleeping size 0 bytes 0\n", 0, 10, "unknown state"),
            (b"tartan-jab running size 0 bytes 0\n", 0, 10, "unknown state"),
            (b"sh: oops\ntartan-job running size 0 bytes 0\n", 0, 10, "unknown state"),
            (b"tartan-job running size -1 bytes 0\n", 0, 10, "size is not a number"),
            (
                b"tartan-job running size 1 bytes 0 extra\n",
                0,
                10,
                "expected `size S bytes N`",
            ),
            (
                b"tartan-job running bytes 0 size 1\n",
                0,
                10,
                "expected `size S bytes N`",
            ),
            (
                b"tartan-job running size 1 bytes x\n",
                0,
                10,
                "byte count is not a number",
            ),
            (
                b"tartan-job running size 10 bytes 5\nabcde",
                0,
                4,
                "not the 4 asked for",
            ),
            (
                b"tartan-job running size 10 bytes 5\nabcde",
                7,
                10,
                "not the 3 asked for",
            ),
            (
                b"tartan-job running size 10 bytes 3\nab",
                7,
                10,
                "2 bytes follow, not 3",
            ),
            (
                b"tartan-job running size 10 bytes 3\nabcd",
                7,
                10,
                "4 bytes follow, not 3",
            ),
            (
                b"tartan-job running size 10 bytes 3\r\nabc",
                7,
                10,
                "byte count is not a number",
            ),
            (b"\xfftartan-job running size 0 bytes 0\n", 0, 10, "not UTF-8"),
        ];
        for (out, from, max, want) in cases {
            let e = parse_poll(out, *from, *max).unwrap_err();
            assert!(e.contains(want), "{:?}: {e}", String::from_utf8_lossy(out));
        }
    }

    #[test]
    fn the_sidecar_line_round_trips_and_rejects_damage() {
        let p = Place {
            dir: ".tartan/mb-x/01-build".into(),
            base: 12,
            offset: 3456,
            started: false,
            logged: None,
        };
        assert_eq!(p.render(), "tartan-follow .tartan/mb-x/01-build 12 3456\n");
        assert_eq!(Place::parse(&p.render()), Some(p.clone()));
        let started = Place {
            started: true,
            logged: None,
            ..p.clone()
        };
        assert_eq!(
            started.render(),
            "tartan-follow .tartan/mb-x/01-build 12 3456 started\n"
        );
        assert_eq!(Place::parse(&started.render()), Some(started));
        for bad in [
            "",
            "tartan-follow .tartan/mb-x/01-build 12 3456",
            "tartan-follow .tartan/mb-x/01-build 12\n",
            "tartan-follow .tartan/mb-x/01-build 12 x\n",
            "tartan-follow .tartan/mb-x/01-build -1 3\n",
            "other .tartan/mb-x/01-build 12 3456\n",
            "tartan-follow a 1 2 3\n",
            "tartan-follow a 1 2 started x\n",
            "tartan-follow a 1 2 Started\n",
        ] {
            assert_eq!(Place::parse(bad), None, "{bad:?}");
        }
        assert_eq!(
            sidecar_path(Path::new("/s/logs/mb-x/build.log")),
            PathBuf::from("/s/logs/mb-x/build.log.follow")
        );
        assert_eq!(
            scratch_path(Path::new("/s/logs/mb-x/build.log")),
            PathBuf::from("/s/logs/mb-x/build.log.poll")
        );
    }

    fn place(base: u64, offset: u64) -> Place {
        Place {
            dir: "d".into(),
            base,
            offset,
            started: false,
            logged: None,
        }
    }

    #[test]
    fn a_masked_place_keeps_the_host_length_and_restarts_a_lost_end() {
        let masked = Place {
            logged: Some(20),
            ..place(7, 30)
        };
        let text = masked.render();
        assert_eq!(text, "tartan-follow d 7 30 logged 20\n");
        assert_eq!(Place::parse(&text), Some(masked.clone()));
        // As saved, or longer (an append whose sidecar update was lost): cut to base + logged.
        assert_eq!(resume(Some(masked.clone()), "d", 27, 100), (masked.clone(), 27));
        assert_eq!(resume(Some(masked.clone()), "d", 40, 100), (masked.clone(), 27));
        // Shorter: the job's output starts over from the guest log (masked bytes do not map
        // back to guest offsets).
        let over = Place {
            offset: 0,
            logged: Some(0),
            ..masked.clone()
        };
        assert_eq!(resume(Some(masked), "d", 20, 100), (over, 7));
    }

    #[test]
    fn resuming_cuts_repeats_and_refetches_what_was_lost() {
        let note = log_cap_note(100).len() as u64;
        assert_eq!(logged_len(0, 100), 0);
        assert_eq!(logged_len(100, 100), 100);
        assert_eq!(logged_len(101, 100), 100 + note);
        assert_eq!(logged_len(5000, 100), 100 + note);
        // No sidecar, or another job's: a new job at the log's end (the checkout's two commands
        // share one log).
        assert_eq!(resume(None, "d", 7, 100), (place(7, 0), 7));
        let other = Place {
            dir: "e".into(),
            ..place(0, 50)
        };
        assert_eq!(resume(Some(other), "d", 57, 100), (place(57, 0), 57));
        // As saved.
        assert_eq!(resume(Some(place(7, 30)), "d", 37, 100), (place(7, 30), 37));
        // An append whose sidecar update was lost: cut back, so it does not repeat.
        assert_eq!(resume(Some(place(7, 30)), "d", 60, 100), (place(7, 30), 37));
        assert_eq!(
            resume(Some(place(7, 500)), "d", 7 + 100 + note + 9, 100),
            (place(7, 500), 7 + 100 + note)
        );
        // The log lost its end: continue from what it holds.
        assert_eq!(resume(Some(place(7, 30)), "d", 20, 100), (place(7, 13), 20));
        assert_eq!(resume(Some(place(7, 500)), "d", 7 + 100 + 3, 100), (place(7, 100), 107));
        assert_eq!(resume(Some(place(7, 500)), "d", 50, 100), (place(7, 43), 50));
        // Shorter than the base: the sidecar cannot be right; start at the end.
        assert_eq!(resume(Some(place(70, 5)), "d", 20, 100), (place(20, 0), 20));
    }

    #[test]
    fn advancing_writes_up_to_the_cap_then_notes_once_and_skips() {
        // (offset, chunk, size, cap) -> (write, note, next)
        assert_eq!(advance(0, 10, 50, 100), (10, false, 10));
        assert_eq!(advance(0, 0, 0, 100), (0, false, 0));
        assert_eq!(advance(90, 10, 100, 100), (10, false, 100));
        // Exactly at the cap and nothing more: no note (as the driver's exec logs).
        assert_eq!(advance(100, 0, 100, 100), (0, false, 100));
        // More than the cap came: the note, once, and skip to the end.
        assert_eq!(advance(90, 10, 150, 100), (10, true, 150));
        assert_eq!(advance(100, 0, 101, 100), (0, true, 101));
        assert_eq!(advance(150, 0, 400, 100), (0, false, 400));
        // A chunk that crosses the cap (a caller asking for more than `request` gives).
        assert_eq!(advance(95, 10, 105, 100), (5, true, 105));
        assert_eq!(request(0, 64, 100, 0), 64);
        assert_eq!(request(90, 64, 100, 0), 10);
        assert_eq!(request(100, 64, 100, 0), 0);
        assert_eq!(request(150, 64, 100, 0), 0);
        // With a lookahead for masking: that much past the cap, never from the cap on.
        assert_eq!(request(90, 64, 100, 7), 17);
        assert_eq!(request(99, 64, 100, 7), 8);
        assert_eq!(request(100, 64, 100, 7), 0);
        // Walking a 250-byte output in 64-byte chunks under a cap of 100 writes 100 bytes and one note.
        let (mut offset, mut written, mut notes) = (0, 0, 0);
        while offset < 250 {
            let chunk = request(offset, 64, 100, 0).min(250 - offset);
            let (w, n, next) = advance(offset, chunk, 250, 100);
            written += w;
            notes += u64::from(n);
            assert!(next > offset, "stuck at {offset}");
            offset = next;
        }
        assert_eq!((written, notes, offset), (100, 1, 250));
    }

    /// Follows a job whose whole output is `output` as [`follow`] does: each poll asks for what
    /// [`request`] says from the offset, the job has written `grow` more bytes by each poll and
    /// exits once all is written. Returns the host log.
    fn simulate(output: &[u8], grow: usize, chunk: u64, cap: u64, mask: &super::super::env::Masker) -> Vec<u8> {
        let (mut log, mut offset, mut written) = (Vec::new(), 0u64, 0usize);
        for _ in 0..100_000 {
            written = (written + grow).min(output.len());
            let exited = written == output.len();
            let size = written as u64;
            let cfg = FollowConfig {
                chunk_bytes: chunk,
                log_cap: cap,
                mask: mask.clone(),
                ..FollowConfig::default()
            };
            let max = poll_bytes(offset, &cfg);
            let end = (offset + max).min(size).max(offset);
            let bytes = &output[offset.min(size) as usize..end as usize];
            let seen = offset + bytes.len() as u64;
            let complete = exited && seen >= size;
            let full = bytes.len() as u64 == max;
            let t = take(offset, bytes, size, complete, full, cap, mask);
            log.extend_from_slice(&t.bytes);
            if t.note {
                log.extend_from_slice(log_cap_note(cap).as_bytes());
            }
            offset = t.next;
            if exited && seen >= size {
                return log;
            }
        }
        panic!(
            "the follower made no progress: offset {offset} of {} bytes ({:?}…), grow {grow}, chunk {chunk}, cap {cap}",
            output.len(),
            String::from_utf8_lossy(&output[..output.len().min(60)])
        );
    }

    /// The host log a follower must end with: the output masked as one piece, cut at the cap
    /// (a value straddling it shown as `***`), then the note.
    fn expected(output: &[u8], cap: u64, mask: &super::super::env::Masker) -> Vec<u8> {
        if output.len() as u64 <= cap {
            return mask.mask(output, true).0;
        }
        let mut log = mask.mask_until(output, cap as usize, true).0;
        log.extend_from_slice(log_cap_note(cap).as_bytes());
        log
    }

    /// Secret values are upper-case letters (and a newline), the rest of the output never is:
    /// any upper-case letter in a host log (its cap note aside) is a leaked byte of a value.
    fn leaked(log: &[u8], cap: u64) -> Option<String> {
        let text = String::from_utf8_lossy(log).replace(&log_cap_note(cap), "");
        text.contains(|c: char| c.is_ascii_uppercase()).then_some(text)
    }

    #[test]
    fn a_secret_straddling_any_cap_chunk_or_hold_back_boundary_is_masked() {
        use super::super::env::Masker;
        let sets: &[&[&str]] = &[
            // 42 bytes, as in issue 25 (41 of them before the cap leaked).
            &["ABCDEFGHIJKLMNOPQRSTUVWXYZABCDEFGHIJKLMNOP"],
            // A value that is a prefix of another.
            &["QWER", "QWERTYUIOP"],
            // Two values that overlap (XYZZY and ZYXW share ZY... as XYZZYXW).
            &["XYZZY", "ZYXW"],
            // A value that overlaps itself.
            &["AAAAAA"],
            // A multi-line value (each line is masked too).
            &["LINEONE\nLINETWO"],
        ];
        let mut runs = 0;
        for values in sets {
            let mask = Masker::new(values.iter().map(|v| v.as_bytes()));
            let longest = values.iter().map(|v| v.len()).max().unwrap();
            for value in values.iter() {
                // Shapes: the value alone, at the start, at the end, twice in a row, overlapping
                // the others, and with filler around it at every position near the cap.
                let mut shapes: Vec<(Vec<u8>, usize)> = Vec::new();
                for at in 0..24 {
                    let mut out = b".".repeat(at);
                    out.extend_from_slice(value.as_bytes());
                    out.extend_from_slice(b"..\n..");
                    shapes.push((out, at));
                    let mut twice = b".".repeat(at);
                    twice.extend_from_slice(value.as_bytes());
                    twice.extend_from_slice(value.as_bytes());
                    shapes.push((twice, at));
                }
                shapes.push((value.as_bytes().to_vec(), 0));
                let all = values.concat();
                shapes.push((format!("..{all}{all}").into_bytes(), 2));
                // The values run into each other, and a value's start without its end.
                let (first, rest) = values.split_at(1);
                let mixed = [rest.concat(), first.concat(), first.concat()[..3].to_lowercase()].concat();
                shapes.push((mixed.into_bytes(), 0));
                for (out, at) in &shapes {
                    let at = *at as u64;
                    let len = value.len() as u64;
                    let mut caps = vec![1, 2, 3, out.len() as u64, out.len() as u64 + 5];
                    for d in [0, 1, len / 2, len - 1, len, len + 1] {
                        caps.extend([at + d, (at + d).saturating_sub(1)]);
                    }
                    for cap in caps.into_iter().filter(|c| *c > 0) {
                        for chunk in [1, 2, 3, 5, 8, 64] {
                            for grow in [1, 7, 1 << 20] {
                                runs += 1;
                                let log = simulate(out, grow, chunk, cap, &mask);
                                let want = expected(out, cap, &mask);
                                let shown = String::from_utf8_lossy(out);
                                assert!(
                                    leaked(&log, cap).is_none(),
                                    "{values:?} in {shown:?}, cap {cap}, chunk {chunk}, grow {grow}: {:?}",
                                    String::from_utf8_lossy(&log)
                                );
                                assert_eq!(
                                    String::from_utf8_lossy(&log),
                                    String::from_utf8_lossy(&want),
                                    "{values:?} in {shown:?}, cap {cap}, chunk {chunk}, grow {grow}"
                                );
                            }
                        }
                    }
                }
            }
            assert!(longest >= 4);
        }
        assert!(runs > 10_000, "{runs}");
    }

    /// A run of values overlapping each other longer than any read (only a build that prints
    /// such a run on purpose makes one): each full read is decided at its end, so the follower
    /// never asks for the same bytes again and again (before, it polled in a tight loop until
    /// the step's end). What shows of the values is at most the start of one per read.
    #[test]
    fn a_run_of_overlapping_values_longer_than_a_read_makes_progress() {
        use super::super::env::Masker;
        let mask = Masker::new([&b"AAAAAA"[..], b"ABAB"]);
        for out in [b"A".repeat(10_000), b"AB".repeat(5_000)] {
            for chunk in [1, 7, 64] {
                // `simulate` panics if the follower gets stuck.
                let log = simulate(&out, 1 << 20, chunk, 1 << 20, &mask);
                // Each poll reads a chunk and two values' length (12 bytes).
                let reads = out.len() as u64 / (chunk + 12) + 1;
                let shown = log.iter().filter(|b| b.is_ascii_uppercase()).count() as u64;
                assert!(
                    shown <= reads * 3,
                    "chunk {chunk}: {shown} bytes of values shown in {reads} reads"
                );
                assert!(
                    shown * 4 < out.len() as u64,
                    "chunk {chunk}: {shown} bytes of values shown"
                );
                assert!(log.contains(&b'*'), "chunk {chunk}");
            }
        }
    }

    #[test]
    fn the_cap_note_waits_for_a_value_straddling_the_cap_to_be_told() {
        use super::super::env::Masker;
        let secret = "ABCDEFGHIJKLMNOPQRSTUVWXYZABCDEFGHIJKLMNOP";
        let mask = Masker::new([secret.as_bytes()]);
        // 41 bytes of the value before the cap of 100, the last one after it.
        let out = format!("{}{secret}..", ".".repeat(59));
        let cap = 100;
        // The poll at 0 asks for the cap and 41 more bytes: the value is seen whole.
        let asked = request(0, 1 << 20, cap, cap_lookahead(&mask));
        assert_eq!(asked, cap + 41);
        let t = take(0, &out.as_bytes()[..103], out.len() as u64, false, false, cap, &mask);
        assert_eq!(t.bytes, format!("{}***", ".".repeat(59)).into_bytes());
        assert!(t.note);
        assert_eq!(t.next, out.len() as u64);
        // Only the cap's bytes came so far (the job is still writing): nothing of the value
        // is logged, no note yet, and the offset stays at the value's start.
        let t = take(0, &out.as_bytes()[..100], 100, false, false, cap, &mask);
        assert_eq!((t.bytes, t.note, t.next), (".".repeat(59).into_bytes(), false, 59));
    }

    /// A large piece is masked on the blocking pool, as `take` masks it in place.
    #[tokio::test(flavor = "current_thread")]
    async fn large_pieces_are_masked_off_the_runtime_as_in_place() {
        use super::super::env::Masker;
        let cfg = FollowConfig {
            mask: Masker::new([&b"TOPSECRET"[..]]),
            ..FollowConfig::default()
        };
        let mut out = b"x TOPSECRET y\n".repeat(MASK_OFF_RUNTIME_BYTES / 8);
        out.extend_from_slice(b"TOPSEC");
        for (complete, full) in [(false, true), (true, false)] {
            let size = out.len() as u64 + 100;
            let want = take(7, &out, size, complete, full, cfg.log_cap, &cfg.mask);
            let got = take_off_runtime(7, out.clone(), size, complete, full, &cfg).await;
            assert_eq!(got, want);
            assert!(!got.bytes.windows(9).any(|w| w == b"TOPSECRET"));
        }
    }

    #[test]
    fn default_limits_keep_each_exec_well_inside_the_silence_limit() {
        let c = FollowConfig::default();
        assert!(c.exec_timeout * 2 < c.unresponsive_limit);
        assert_eq!(c.poll_interval, Duration::from_secs(1));
        assert!(c.chunk_bytes > 0 && c.tail_bytes <= c.log_cap);
    }
}
