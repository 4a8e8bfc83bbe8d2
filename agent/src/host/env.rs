//! `spec.env` on the host: Secret values read at attempt start, the env file the guest's steps
//! source, and the masking of secret values in step output.
//!
//! Values never reach a command line (the Mac's `ps` shows every argv): the env file is written
//! through `tart exec -i` stdin ([`write_script_argv`]) with mode 0600 under the VM's guest folder
//! and sourced by each step's job wrapper (`guest_job`), then removed after the last step.
//! Secret values are never logged, journaled or put into status: [`ResolvedEnv`] and [`Masker`]
//! print only names and counts.
//!
//! Masking: every secret value of at least [`MIN_MASKED_LEN`] bytes (and each line of a multi-line
//! value of that length) is replaced by `***` where step output reaches the host step log, so the
//! log files, the failure tail and whatever is shipped from them never hold it. Shorter values are
//! not masked: starring every `1` or `ab` of a log garbles it and shows the value anyway (by where
//! the stars are); such a value is no secret worth the name, and the agent warns (naming the
//! variable) when a build uses one.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use value_automaton::ValueAutomaton;
pub use value_automaton::ValueScreen;

mod value_automaton;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use tartan_api::{EnvVar, Reason};

/// Secret values shorter than this are not masked (see the module documentation).
pub const MIN_MASKED_LEN: usize = 4;

/// What stands for a secret value in step output.
pub const MASK: &[u8] = b"***";

/// Most bytes of all resolved values together (a Secret holds at most 1 MiB).
pub const ENV_MAX_TOTAL_BYTES: usize = 4 << 20;

/// Replaces secret values by [`MASK`] in step output. Its `Debug` shows only how many values it
/// masks.
///
/// Every occurrence of every value is found in one pass over the output (an Aho-Corasick
/// automaton built once per set of values, shared by clones), so masking costs the same per byte
/// whether a build has one value or the thousands of lines of a CA bundle. Occurrences that
/// overlap (the end of one value is the start of another, or of itself) are masked together as
/// one run; adjacent ones each show as [`MASK`].
#[derive(Clone, Default)]
pub struct Masker {
    /// Unique, in byte order (masking compares maskers by them; the reference test reads them).
    values: Vec<Vec<u8>>,
    /// Finds every occurrence of `values`, and where one may be starting; `None` when there are
    /// none. Shared by clones (each step's follower has one).
    matcher: Option<Arc<ValueAutomaton>>,
    /// The longest value's length (0 if none).
    max_len: usize,
    /// The secrets as given, and each multi-line one with either line end (no single lines):
    /// what [`find_in`](Self::find_in) looks for in an artifact.
    whole: Vec<Vec<u8>>,
    /// The automaton of `whole`, built at the first artifact scan and shared by clones.
    whole_matcher: Arc<std::sync::OnceLock<Option<Arc<ValueAutomaton>>>>,
}

/// The automaton of `values` (see [`ValueAutomaton`]). Values are at most twice
/// ENV_MAX_TOTAL_BYTES, or an earlier env file's PREVIOUS_MAX_BYTES: far below its 2^31 states.
fn automaton(values: &[Vec<u8>]) -> Arc<ValueAutomaton> {
    #[cfg(test)]
    MATCHERS_BUILT.with(|n| n.set(n.get() + 1));
    Arc::new(ValueAutomaton::new(values).expect("the values are far below the automaton's limits"))
}

/// The lossy UTF-8 forms of value `v` (not UTF-8) that text made lossy may hold: of the whole
/// value, and of it without the continuation bytes it starts with and the incomplete sequence it
/// ends with, since a lead byte before it or continuation bytes after it in the output decode
/// together with those into one U+FFFD, which the value's own lossy form does not have there.
fn lossy_forms(v: &[u8]) -> Vec<Vec<u8>> {
    let is_continuation = |b: &u8| (0x80..0xC0).contains(b);
    let start = v.iter().take(3).take_while(|b| is_continuation(b)).count();
    let width = |lead: u8| match lead {
        0xC0..=0xDF => 2,
        0xE0..=0xEF => 3,
        0xF0..=0xF7 => 4,
        _ => 1,
    };
    // A lead byte in the last three whose sequence the value does not complete.
    let open_tail = (v.len().saturating_sub(3)..v.len())
        .rev()
        .find(|&p| !is_continuation(&v[p]))
        .filter(|&p| v[p] >= 0xC0 && width(v[p]) > v.len() - p)
        .map_or(0, |p| v.len() - p);
    let end = v.len() - open_tail;
    let mut forms: Vec<Vec<u8>> = [(0, v.len()), (start, v.len()), (0, end), (start, end)]
        .into_iter()
        .filter(|&(a, b)| b > a && b - a >= MIN_MASKED_LEN)
        .map(|(a, b)| String::from_utf8_lossy(&v[a..b]).into_owned().into_bytes())
        .collect();
    forms.dedup();
    forms
}

impl PartialEq for Masker {
    fn eq(&self, other: &Masker) -> bool {
        self.values == other.values
    }
}

impl Eq for Masker {}

impl fmt::Debug for Masker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Masker({} value(s))", self.values.len())
    }
}

#[cfg(test)]
thread_local! {
    /// How many matchers this thread built (tests check that masking never builds one).
    static MATCHERS_BUILT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Masker {
    /// A masker of `secrets`: each value of at least [`MIN_MASKED_LEN`] bytes, and each line
    /// (without its line end, `\n` or `\r\n`) of a multi-line value that long, since a tool may
    /// print such a value line by line or with other line ends.
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a [u8]>) -> Masker {
        let mut set = BTreeSet::new();
        let mut whole = BTreeSet::new();
        for v in secrets {
            set.insert(v.to_vec());
            whole.insert(v.to_vec());
            if !v.contains(&b'\n') {
                continue;
            }
            let lines: Vec<&[u8]> = v
                .split(|&b| b == b'\n')
                .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
                .collect();
            set.extend(lines.iter().map(|line| line.to_vec()));
            // The whole value with either line end: lines shorter than MIN_MASKED_LEN are not
            // masked alone, and a value written with `\r\n` may be printed with `\n` or the
            // other way round.
            // And without its final line end: a Secret made from a file ends with one, which
            // `$(…)`, a JSON string or a file's end drops.
            let kept = lines.len() - lines.iter().rev().take_while(|line| line.is_empty()).count();
            for lines in [&lines[..], &lines[..kept]] {
                for joined in [lines.join(&b"\n"[..]), lines.join(&b"\r\n"[..])] {
                    set.insert(joined.clone());
                    whole.insert(joined);
                }
            }
        }
        let raw: Vec<Vec<u8>> = set.into_iter().filter(|v| v.len() >= MIN_MASKED_LEN).collect();
        // Text made from output with `from_utf8_lossy` (a status message's tail) holds a value,
        // or a line of one, that is not UTF-8 (a keystore's password) only in its lossy form;
        // short raw values stay unmasked in either form.
        let lossy: Vec<Vec<u8>> = raw
            .iter()
            .filter(|v| std::str::from_utf8(v).is_err())
            .flat_map(|v| lossy_forms(v))
            .collect();
        let values: Vec<Vec<u8>> = raw
            .into_iter()
            .chain(lossy)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let max_len = values.iter().map(Vec::len).max().unwrap_or(0);
        let matcher = (!values.is_empty()).then(|| automaton(&values));
        Masker {
            values,
            matcher,
            max_len,
            whole: whole.into_iter().filter(|v| v.len() >= MIN_MASKED_LEN).collect(),
            whole_matcher: Default::default(),
        }
    }

    /// This masker and `more` values (as [`new`](Self::new) takes them).
    pub fn with<'a>(&self, more: impl IntoIterator<Item = &'a [u8]>) -> Masker {
        let more: Vec<Vec<u8>> = more.into_iter().map(<[u8]>::to_vec).collect();
        // From the whole values (their lines follow again): a line on its own is no value.
        Masker::new(self.whole.iter().chain(&more).map(Vec::as_slice))
    }

    /// Whether there is nothing to mask.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The longest masked value's length (0 if none).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The first place in `bytes` from which the rest may be the start of a value (only the last
    /// `max_len - 1` bytes can be).
    fn held_from(&self, matcher: &ValueAutomaton, bytes: &[u8]) -> Option<usize> {
        let from = bytes.len().saturating_sub(self.max_len.saturating_sub(1));
        let open = matcher.open_start_len(&bytes[from..]);
        (open > 0).then(|| bytes.len() - open)
    }

    /// Where in `bytes` a value may be starting that the bytes end before it does: the earliest
    /// such place, if any (only the last `max_len - 1` bytes can be one).
    pub fn open_start(&self, bytes: &[u8]) -> Option<usize> {
        self.matcher.as_ref().and_then(|matcher| self.held_from(matcher, bytes))
    }

    /// `text`, whole, with its values masked (a message quoting guest output).
    pub fn mask_text(&self, text: &str) -> String {
        if self.is_empty() {
            return text.to_string();
        }
        String::from_utf8_lossy(&self.mask(text.as_bytes(), true).0).into_owned()
    }

    /// Where the first whole value occurs in `input`, read in pieces of `piece` bytes through a
    /// [`screen`](Self::screen): memory is bounded whatever the input's size. Whole values only,
    /// not their single lines: a public line of a Secret (a CA bundle's
    /// `-----BEGIN CERTIFICATE-----`) would refuse every artifact that holds any certificate.
    pub fn find_in(&self, mut input: impl std::io::Read, piece: usize) -> std::io::Result<Option<u64>> {
        let Some(mut screen) = self.screen() else {
            return Ok(None);
        };
        let mut buf = vec![0u8; piece.max(1)];
        loop {
            let n = match input.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                other => other?,
            };
            if n == 0 {
                return Ok(None);
            }
            if let Err(at) = screen.feed(&buf[..n]) {
                return Ok(Some(at));
            }
        }
    }

    /// A screen for whole values (the secrets as given, multi-line ones with either line end) of a stream read
    /// once as it comes: what it passes on holds no value, and what may be the start of one is
    /// held back until the stream shows it is not. `None` when there is nothing to look for.
    pub fn screen(&self) -> Option<ValueScreen> {
        self.whole_automaton().map(ValueScreen::new)
    }

    /// The automaton of [`whole`](Self::whole), built at the first use and shared by clones.
    fn whole_automaton(&self) -> Option<Arc<ValueAutomaton>> {
        self.whole_matcher
            .get_or_init(|| (!self.whole.is_empty()).then(|| automaton(&self.whole)))
            .clone()
    }

    /// Masks `bytes`, a piece of a stream. Unless `last` (nothing follows), a piece that ends
    /// inside what may be a value is held back: returns the masked output and how many bytes of
    /// `bytes` it covers; the caller passes the rest again with what follows.
    pub fn mask(&self, bytes: &[u8], last: bool) -> (Vec<u8>, usize) {
        self.mask_range(bytes, 0, bytes.len(), last)
    }

    /// Masks a window of a stream whose first `skip` bytes are only context: output starts at
    /// byte `skip` (a value that begins in the context and reaches past it still shows as
    /// [`MASK`]). The window is the stream's end.
    pub fn mask_window(&self, bytes: &[u8], skip: usize) -> Vec<u8> {
        self.mask_range(bytes, skip, bytes.len(), true).0
    }

    /// Masks the first `limit` bytes of `bytes`, a piece of a stream whose bytes from `limit` on
    /// are only context (a log cap: they are never logged, but a value that starts before
    /// `limit` and reaches past it must still show as [`MASK`], not as its first bytes). Unless
    /// `last` (nothing follows `bytes`), a place before `limit` where a value may start and the
    /// piece is too short to tell is held back. Returns the masked output and how far in `bytes`
    /// it covers: `limit` or more (a value reaching past the limit) when all of it is done.
    pub fn mask_until(&self, bytes: &[u8], limit: usize, last: bool) -> (Vec<u8>, usize) {
        self.mask_range(bytes, 0, limit.min(bytes.len()), last)
    }

    /// Output for bytes `skip..limit` of `bytes`; bytes before `skip` and from `limit` on are
    /// context. Returns the output and how far in `bytes` it is decided.
    ///
    /// Each run of overlapping occurrences that starts before `limit` becomes one [`MASK`] (shown
    /// if it reaches past `skip`); past `limit` nothing is output, so occurrences starting there
    /// do not extend a run. Unless `last`, output stops where the rest may start a value: at that
    /// place, or at the start of the run it falls inside (the run may grow with what follows).
    fn mask_range(&self, bytes: &[u8], skip: usize, limit: usize, last: bool) -> (Vec<u8>, usize) {
        let Some(matcher) = &self.matcher else {
            return (bytes[skip.min(limit)..limit].to_vec(), limit);
        };
        let held = if last {
            None
        } else {
            self.held_from(matcher, bytes).filter(|&p| p < limit)
        };
        // Occurrences starting before `limit` end before this.
        let seen = bytes.len().min(limit.saturating_add(self.max_len));
        // Runs, in order and disjoint: occurrences come by their end (the longest of those ending
        // at one place covers the others), and each one merges with the runs it overlaps (those
        // ending after its start).
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (occurrence_start, occurrence_end) in matcher.longest_occurrences(&bytes[..seen]) {
            if occurrence_start >= limit {
                continue;
            }
            let mut start = occurrence_start;
            while let Some(&(s, e)) = runs.last() {
                if e <= start {
                    break;
                }
                start = start.min(s);
                runs.pop();
            }
            runs.push((start, occurrence_end));
        }
        let stop = match held {
            Some(h) => runs.iter().find(|&&(s, e)| s < h && h < e).map_or(h, |&(s, _)| s),
            None => limit,
        };
        let mut out = Vec::with_capacity(stop.saturating_sub(skip) + MASK.len());
        let mut at = 0;
        for &(s, e) in runs.iter().take_while(|&&(s, _)| s < stop) {
            out.extend_from_slice(&bytes[at.max(skip).min(s)..s]);
            if e > skip {
                out.extend_from_slice(MASK);
            }
            at = e;
        }
        out.extend_from_slice(&bytes[at.max(skip).min(stop)..stop]);
        let decided = if held.is_some() { stop } else { stop.max(at) };
        (out, decided)
    }
}

/// `value` as one POSIX `sh` word: single-quoted, each `'` written as `'\''`. Any byte but NUL
/// (which no environment can hold) survives as it is: newlines, `$(…)`, backticks, quotes.
pub fn shell_quote(value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len() + 2);
    out.push(b'\'');
    for &b in value {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
    out
}

/// The env file's text: one `export NAME='value'` line per variable, in spec order.
pub fn render_env_file(vars: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in vars {
        out.extend_from_slice(b"export ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'=');
        out.extend_from_slice(&shell_quote(value));
        out.push(b'\n');
    }
    out
}

/// Name of the env file in the VM's guest folder (`.tartan/<vm>/env`); the job wrapper sources it.
pub const ENV_FILE: &str = "env";

/// Most bytes of an earlier env file the write script prints back (a rendered file of
/// [`ENV_MAX_TOTAL_BYTES`] of values, each `'` four bytes, and the names, fits).
pub const PREVIOUS_MAX_BYTES: u64 = 4 * ENV_MAX_TOTAL_BYTES as u64 + (1 << 20);

/// Writes stdin to `$1/env` with mode 0600 (made as `env.tmp`, then renamed, so a step never
/// sources half a file). An env file already there (written by an earlier agent process for a
/// step that may still run with it) is printed first, `tartan-env previous <size>` and its bytes
/// (or `tartan-env previous-too-large <size>` past `$2` bytes), so that what the steps actually
/// have is masked too (see [`ResolvedEnv::adopt_previous`]). Ends with `tartan-env written`.
const WRITE_SCRIPT: &str = r#"exec 2>&1
umask 077
d=$1 max=$2
mkdir -p "$d" || exit 1
if [ -f "$d/env" ]; then
  n=$(( $(wc -c <"$d/env") ))
  if [ "$n" -gt "$max" ]; then
    echo "tartan-env previous-too-large $n"
  else
    echo "tartan-env previous $n"
    head -c "$n" "$d/env"
  fi
fi
cat >"$d/env.tmp" && chmod 600 "$d/env.tmp" && mv -f "$d/env.tmp" "$d/env" || exit 1
echo "tartan-env written"
"#;

/// What [`WRITE_SCRIPT`] prints last on success.
pub const WRITTEN: &str = "tartan-env written\n";

/// The argv that writes the env file (given on stdin) into guest folder `dir`.
pub fn write_script_argv(dir: &str) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        WRITE_SCRIPT.into(),
        "tartan-env".into(),
        dir.into(),
        PREVIOUS_MAX_BYTES.to_string(),
    ]
}

/// The env file the guest held before a write.
#[derive(Clone, PartialEq, Eq)]
pub enum Previous {
    /// There was none (the attempt's first write).
    None,
    /// Its bytes (Secret values in clear: kept in memory only).
    File(Vec<u8>),
    /// It was larger than [`PREVIOUS_MAX_BYTES`] (not the agent's: a step rewrote it).
    TooLarge(u64),
}

impl fmt::Debug for Previous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Previous::None => write!(f, "None"),
            Previous::File(b) => write!(f, "File({} bytes)", b.len()),
            Previous::TooLarge(n) => write!(f, "TooLarge({n})"),
        }
    }
}

/// Reads what [`write_script_argv`]'s call printed: the earlier file, if any, then
/// [`WRITTEN`]. Anything else is refused with what was seen (never its bytes: they may be
/// values).
pub fn parse_write(out: &[u8]) -> Result<Previous, String> {
    let written = WRITTEN.as_bytes();
    let Some(before) = out.strip_suffix(written) else {
        // The guest's complaint says why; output after the earlier file's header may hold
        // values and is not shown.
        let shown = if out.starts_with(b"tartan-env previous") {
            "not shown: it holds the earlier env file".to_string()
        } else {
            format!("{:?}", String::from_utf8_lossy(&out[..out.len().min(200)]).trim())
        };
        return Err(format!(
            "the write did not end with `tartan-env written` ({} bytes: {shown})",
            out.len()
        ));
    };
    if before.is_empty() {
        return Ok(Previous::None);
    }
    let nl = before.iter().position(|&b| b == b'\n').ok_or_else(|| {
        format!(
            "{} bytes before `tartan-env written` without a header line",
            before.len()
        )
    })?;
    let (header, body) = (&before[..nl], &before[nl + 1..]);
    let header = std::str::from_utf8(header).map_err(|_| "the earlier env file's header is not UTF-8".to_string())?;
    let number = |n: &str| {
        n.parse::<u64>()
            .map_err(|_| format!("header {header:?}: size is not a number"))
    };
    match header.split(' ').collect::<Vec<_>>()[..] {
        ["tartan-env", "previous", n] => {
            let n = number(n)?;
            if body.len() as u64 != n {
                return Err(format!("header {header:?}: {} bytes follow", body.len()));
            }
            Ok(Previous::File(body.to_vec()))
        }
        ["tartan-env", "previous-too-large", n] if body.is_empty() => Ok(Previous::TooLarge(number(n)?)),
        _ => Err(format!("unexpected header {header:?}")),
    }
}

/// The variables of an env file [`render_env_file`] wrote, in order; `Err` (saying where, never
/// what) for any other text: a file a step changed.
pub fn parse_env_file(file: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    // The agent never writes one (a Secret value holding one is refused), and the masker's
    // automaton relies on values without it.
    if let Some(at) = file.iter().position(|&b| b == 0) {
        return Err(format!(
            "byte {at}: a NUL byte, which no environment variable can carry"
        ));
    }
    let mut vars = Vec::new();
    let mut rest = file;
    while !rest.is_empty() {
        let at = file.len() - rest.len();
        let bad = |why: &str| format!("byte {at}: {why}");
        rest = rest.strip_prefix(b"export ").ok_or_else(|| bad("no `export `"))?;
        let eq = rest
            .iter()
            .position(|&b| b == b'=')
            .ok_or_else(|| bad("no `=` after the name"))?;
        let name = std::str::from_utf8(&rest[..eq])
            .ok()
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
            .ok_or_else(|| bad("not a variable name"))?
            .to_string();
        rest = rest[eq + 1..]
            .strip_prefix(b"'")
            .ok_or_else(|| bad("the value is not quoted"))?;
        let mut value = Vec::new();
        loop {
            let q = rest
                .iter()
                .position(|&b| b == b'\'')
                .ok_or_else(|| bad("the value's quote is not closed"))?;
            value.extend_from_slice(&rest[..q]);
            rest = &rest[q + 1..];
            match rest.strip_prefix(b"\\''") {
                Some(after) => {
                    value.push(b'\'');
                    rest = after;
                }
                None => break,
            }
        }
        rest = rest
            .strip_prefix(b"\n")
            .ok_or_else(|| bad("no line end after the value"))?;
        vars.push((name, value));
    }
    Ok(vars)
}

/// The argv that removes the env file of guest folder `dir`.
pub fn remove_script_argv(dir: &str) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        r#"rm -f "$1/env" "$1/env.tmp""#.into(),
        "tartan-env".into(),
        dir.into(),
    ]
}

/// The environment of one attempt's steps, Secret values included. Its `Debug` shows the names
/// only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ResolvedEnv {
    /// Name and value, in spec order.
    pub vars: Vec<(String, Vec<u8>)>,
    /// Masks the values that came from Secrets.
    pub masker: Masker,
    /// The names whose values came from Secrets.
    pub secret_names: BTreeSet<String>,
}

impl ResolvedEnv {
    /// Adds to the masker the Secret values of `previous`, the env file the guest held before
    /// this agent process wrote its own: steps started by an earlier process sourced it, and a
    /// Secret rotated meanwhile left them with the old value, which they may still print.
    /// Returns how many variables had another value than now (a count, never a value). A file
    /// that is not one the agent writes (a step changed it) is refused: nothing is added.
    pub fn adopt_previous(&mut self, previous: &[u8]) -> Result<usize, String> {
        let vars = parse_env_file(previous)?;
        let mut changed = 0;
        let mut old: Vec<&[u8]> = Vec::new();
        for (name, value) in &vars {
            if !self.secret_names.contains(name) {
                continue;
            }
            if self.vars.iter().any(|(n, v)| n == name && v != value) {
                changed += 1;
            }
            old.push(value);
        }
        if changed > 0 {
            self.masker = self.masker.with(old);
        }
        Ok(changed)
    }
}

impl fmt::Debug for ResolvedEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Names only: the secret names are among them.
        let names: Vec<&str> = self.vars.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("ResolvedEnv")
            .field("names", &names)
            .field("masker", &self.masker)
            .finish()
    }
}

/// Why an attempt's env could not be made: the reason the build fails with, and what to say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvRefused {
    pub reason: Reason,
    pub message: String,
}

/// A Secret as read: its `data`, or `None` when it does not exist.
pub type SecretData = Option<BTreeMap<String, Vec<u8>>>;

/// Why a Secret could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretReadError {
    /// The API refused (`403`): the agent's RBAC does not cover it.
    Forbidden(String),
    /// Anything else (unreachable, timeout, server error).
    Failed(String),
}

/// Reads one Secret of a namespace (`get` by name; never list or watch).
pub trait SecretSource: Send + Sync {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<SecretData, SecretReadError>> + Send + 'a>>;
}

/// What an executor may read: the operator's allowed Secrets (`namespace/name`) and the reader.
#[derive(Clone)]
pub struct SecretAccess {
    pub allowed: BTreeSet<String>,
    pub source: Arc<dyn SecretSource>,
}

impl fmt::Debug for SecretAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretAccess").field("allowed", &self.allowed).finish()
    }
}

/// Reads Secrets through the Kubernetes API, each `get` bounded by `timeout`.
pub struct KubeSecrets {
    pub client: kube::Client,
    pub timeout: Duration,
}

impl SecretSource for KubeSecrets {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<SecretData, SecretReadError>> + Send + 'a>> {
        Box::pin(async move {
            let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
            match tokio::time::timeout(self.timeout, api.get_opt(name)).await {
                Err(_) => Err(SecretReadError::Failed(format!("no answer within {:?}", self.timeout))),
                Ok(Err(kube::Error::Api(e))) if e.code == 403 => Err(SecretReadError::Forbidden(e.message.clone())),
                Ok(Err(e)) => Err(SecretReadError::Failed(e.to_string())),
                Ok(Ok(None)) => Ok(None),
                Ok(Ok(Some(secret))) => Ok(Some(
                    secret
                        .data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.0))
                        .collect(),
                )),
            }
        })
    }
}

/// Resolves `env` of a MacBuild in `namespace`: literal values as given; each Secret named is
/// checked against the allowed list first (all of them, before any is read), then read once.
/// Fails with the reason the build ends with and a message naming the variable, the Secret and
/// the key. Never puts a value into a message.
pub async fn resolve(
    env: &[EnvVar],
    namespace: &str,
    access: Option<&SecretAccess>,
) -> Result<ResolvedEnv, EnvRefused> {
    let refuse = |reason, message| EnvRefused { reason, message };
    tartan_api::env::check_env(env).map_err(|e| refuse(Reason::SecretUnreadable, format!("spec.env: {e}")))?;
    for var in env {
        let Some(from) = &var.value_from else { continue };
        let secret = &from.secret_key_ref.name;
        let id = format!("{namespace}/{secret}");
        if !access.is_some_and(|a| a.allowed.contains(&id)) {
            return Err(refuse(
                Reason::SecretNotAllowed,
                format!(
                    "env {}: Secret {id} is not allowed on this agent: an operator lists it in the agent config's \
                     [secrets] allowed and applies the RBAC `tartan-agent rbac` prints for it; nothing was cloned",
                    var.name
                ),
            ));
        }
    }
    let mut read: BTreeMap<String, BTreeMap<String, Vec<u8>>> = BTreeMap::new();
    let mut vars = Vec::new();
    let mut secrets: Vec<Vec<u8>> = Vec::new();
    let mut secret_names = BTreeSet::new();
    let mut total = 0usize;
    for var in env {
        let value = match (&var.value, &var.value_from) {
            (Some(v), _) => v.as_bytes().to_vec(),
            (None, Some(from)) => {
                let (secret, key) = (&from.secret_key_ref.name, &from.secret_key_ref.key);
                let id = format!("{namespace}/{secret}");
                if !read.contains_key(secret) {
                    let source = &access.expect("checked above: every Secret is allowed").source;
                    let data = match source.get(namespace, secret).await {
                        Ok(Some(data)) => data,
                        Ok(None) => {
                            return Err(refuse(
                                Reason::SecretMissing,
                                format!("env {}: Secret {id} does not exist; nothing was cloned", var.name),
                            ));
                        }
                        Err(SecretReadError::Forbidden(why)) => {
                            return Err(refuse(
                                Reason::SecretUnreadable,
                                format!(
                                    "env {}: reading Secret {id} was refused ({why}): the agent's RBAC does not cover \
                                     it; an operator applies what `tartan-agent rbac --secret {id}` prints; nothing \
                                     was cloned",
                                    var.name
                                ),
                            ));
                        }
                        Err(SecretReadError::Failed(why)) => {
                            return Err(refuse(
                                Reason::SecretUnreadable,
                                format!(
                                    "env {}: reading Secret {id} failed: {why}; nothing was cloned",
                                    var.name
                                ),
                            ));
                        }
                    };
                    read.insert(secret.clone(), data);
                }
                let Some(value) = read[secret].get(key) else {
                    return Err(refuse(
                        Reason::SecretMissing,
                        format!("env {}: Secret {id} has no key {key:?}; nothing was cloned", var.name),
                    ));
                };
                if value.contains(&0) {
                    return Err(refuse(
                        Reason::SecretUnreadable,
                        format!(
                            "env {}: key {key:?} of Secret {id} holds a NUL byte, which no environment variable can \
                             carry (mount-style binary data is not supported; base64 it into another key); nothing \
                             was cloned",
                            var.name
                        ),
                    ));
                }
                if !value.is_empty() && value.len() < MIN_MASKED_LEN {
                    tracing::warn!(namespace, env = %var.name, secret = %id, %key, "secret value shorter than {MIN_MASKED_LEN} bytes: it is not masked in step logs");
                }
                secrets.push(value.clone());
                secret_names.insert(var.name.clone());
                value.clone()
            }
            (None, None) => unreachable!("check_env refuses an entry without a value"),
        };
        total += value.len();
        if total > ENV_MAX_TOTAL_BYTES {
            return Err(refuse(
                Reason::SecretUnreadable,
                format!(
                    "env: the values add up to more than {ENV_MAX_TOTAL_BYTES} bytes (at {}); nothing was cloned",
                    var.name
                ),
            ));
        }
        vars.push((var.name.clone(), value));
    }
    Ok(ResolvedEnv {
        vars,
        masker: Masker::new(secrets.iter().map(Vec::as_slice)),
        secret_names,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by an adversary: the end of one value is the start of another (or of itself); the
    /// greedy scan resumed after the first match and wrote the rest of the second in clear.
    #[test]
    fn overlapping_values_are_masked_as_one_run_streamed_or_windowed() {
        let m = Masker::new([&b"ghp_prefix1234"[..], &b"1234-super-secret-tail"[..]]);
        let out = b"token=ghp_prefix1234-super-secret-tail\n";
        assert_eq!(m.mask(out, true), (b"token=***\n".to_vec(), out.len()));
        assert_eq!(m.mask_window(out, 0), b"token=***\n".to_vec());
        // Split inside the second value: the run is held back until it can be decided.
        let (first, used) = m.mask(&out[..24], false);
        let (second, _) = m.mask(&out[used..], true);
        assert_eq!([first, second].concat(), b"token=***\n".to_vec());
        let own = Masker::new([&b"abab"[..]]);
        assert_eq!(own.mask(b"x ababab y", true).0, b"x *** y".to_vec());
    }

    /// The masking as it was written before the automaton (a scan trying every value at every
    /// byte): the reference the automaton's output must equal, byte for byte.
    fn reference_mask_range(
        values: &[Vec<u8>],
        bytes: &[u8],
        skip: usize,
        limit: usize,
        last: bool,
    ) -> (Vec<u8>, usize) {
        let mut longest_first = values.to_vec();
        longest_first.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        let match_at = |rest: &[u8]| longest_first.iter().find(|v| rest.starts_with(v)).map(Vec::len);
        let cut_at = |rest: &[u8]| {
            longest_first
                .iter()
                .any(|v| v.len() > rest.len() && v.starts_with(rest))
        };
        if values.is_empty() {
            return (bytes[skip.min(limit)..limit].to_vec(), limit);
        }
        let (mut out, mut i) = (Vec::new(), 0);
        while i < limit {
            if !last && cut_at(&bytes[i..]) {
                break;
            }
            match match_at(&bytes[i..]) {
                Some(len) => {
                    let (mut end, mut j, mut held) = (i + len, i + 1, false);
                    while j < end && j < limit {
                        if !last && cut_at(&bytes[j..]) {
                            held = true;
                            break;
                        }
                        if let Some(l) = match_at(&bytes[j..]) {
                            end = end.max(j + l);
                        }
                        j += 1;
                    }
                    if held {
                        break;
                    }
                    if end > skip {
                        out.extend_from_slice(MASK);
                    }
                    i = end;
                }
                None => {
                    if i >= skip {
                        out.push(bytes[i]);
                    }
                    i += 1;
                }
            }
        }
        (out, i)
    }

    /// Values and output over a three-letter alphabet (so values overlap, nest, repeat and are
    /// cut often), 20,000 of them: the automaton masks exactly as the reference scan, for every
    /// skip, limit and `last`. The counts check that the hard cases came up.
    #[test]
    fn the_automaton_masks_as_the_reference_scan() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(25);
        let word = |rng: &mut rand::rngs::StdRng, len: usize| -> Vec<u8> {
            (0..len)
                .map(|_| b"abc\n"[rng.random_range(0..if len > 7 { 4 } else { 3 })])
                .collect()
        };
        let (mut held, mut runs_past_limit, mut masked) = (0, 0, 0);
        for case in 0..4_000 {
            let values: Vec<Vec<u8>> = (0..rng.random_range(0..5))
                .map(|_| {
                    let len = rng.random_range(1..8);
                    word(&mut rng, len)
                })
                .collect();
            let masker = Masker::new(values.iter().map(Vec::as_slice));
            for _ in 0..5 {
                // Output made of values, their starts and other letters.
                let mut bytes = Vec::new();
                while bytes.len() < 30 {
                    match (rng.random_range(0..3), values.is_empty()) {
                        (0, false) => bytes.extend(&values[rng.random_range(0..values.len())]),
                        (1, false) => {
                            let v = &values[rng.random_range(0..values.len())];
                            bytes.extend(&v[..rng.random_range(0..v.len())]);
                        }
                        _ => bytes.extend(word(&mut rng, 2)),
                    }
                }
                let len = rng.random_range(0..=bytes.len());
                let bytes = &bytes[..len];
                let limit = rng.random_range(0..=len);
                let skip = rng.random_range(0..=limit);
                let last = rng.random_bool(0.5);
                let want = reference_mask_range(&masker.values, bytes, skip, limit, last);
                let got = masker.mask_range(bytes, skip, limit, last);
                assert_eq!(
                    got,
                    want,
                    "case {case}: values {:?}, bytes {:?}, skip {skip}, limit {limit}, last {last}",
                    masker
                        .values
                        .iter()
                        .map(|v| String::from_utf8_lossy(v))
                        .collect::<Vec<_>>(),
                    String::from_utf8_lossy(bytes)
                );
                held += usize::from(want.1 < limit);
                runs_past_limit += usize::from(want.1 > limit);
                masked += usize::from(want.0.windows(3).any(|w| w == MASK));
            }
        }
        assert!(
            held > 500 && runs_past_limit > 1500 && masked > 3000,
            "{held} {runs_past_limit} {masked}"
        );
    }

    /// The automaton is built with the masker, once: masking any number of pieces (and cloning
    /// the masker, as each step's follower does) builds none.
    #[test]
    fn masking_builds_no_matcher() {
        let built = || MATCHERS_BUILT.with(std::cell::Cell::get);
        let before = built();
        let bundle: Vec<u8> = (0..3000)
            .map(|i| format!("line-{i:05}-of-a-certificate-bundle"))
            .collect::<Vec<_>>()
            .join("\n")
            .into_bytes();
        let masker = Masker::new([bundle.as_slice()]);
        assert_eq!(built() - before, 1);
        assert_eq!(format!("{masker:?}"), "Masker(3002 value(s))");
        let out = b"x line-00042-of-a-certificate-bundle y\n".repeat(1000);
        for piece in out.chunks(97) {
            let copy = masker.clone();
            let (masked, _) = copy.mask(piece, false);
            assert!(!masked.windows(10).any(|w| w == b"line-00042"));
            copy.mask_window(piece, 3);
            copy.mask_until(piece, 50, true);
        }
        assert_eq!(built() - before, 1, "masking built a matcher");
        assert!(Masker::new([&b"ab"[..]]).is_empty());
        assert_eq!(built() - before, 1, "no values, no matcher");
    }

    fn m(values: &[&str]) -> Masker {
        Masker::new(values.iter().map(|v| v.as_bytes()))
    }

    fn all(masker: &Masker, text: &str) -> String {
        String::from_utf8(masker.mask(text.as_bytes(), true).0).unwrap()
    }

    #[test]
    fn values_are_masked_longest_first_and_short_ones_are_left() {
        let masker = m(&["hunter2", "hunter22-long", "abc"]);
        assert_eq!(all(&masker, "pw=hunter2 x=hunter22-long y=abc"), "pw=*** x=*** y=abc");
        assert_eq!(all(&masker, "hunter2hunter2"), "******");
        assert_eq!(all(&masker, "no secret"), "no secret");
        assert_eq!(format!("{masker:?}"), "Masker(2 value(s))");
    }

    #[test]
    fn each_line_of_a_multi_line_value_is_masked_too() {
        let masker = m(&["-----BEGIN KEY-----\r\nAAAABBBB\r\n-----END KEY-----"]);
        assert_eq!(all(&masker, "line: AAAABBBB\n"), "line: ***\n");
        assert_eq!(
            all(&masker, "-----BEGIN KEY-----\r\nAAAABBBB\r\n-----END KEY-----"),
            "***"
        );
    }

    /// A value is found wherever it is in a stream read in pieces, across any piece's end.
    #[test]
    fn a_value_is_found_in_a_stream_across_pieces() {
        let masker = m(&["not-this", "TOPSECRET"]);
        let mut text = b"x".repeat(100);
        text.extend_from_slice(b"TOPSECRET");
        text.extend(b"y".repeat(50));
        for piece in [1, 2, 5, 8, 9, 64, 1 << 20] {
            assert_eq!(masker.find_in(&text[..], piece).unwrap(), Some(100), "piece {piece}");
            assert_eq!(masker.find_in(&text[..108], piece).unwrap(), None, "piece {piece}");
        }
        assert_eq!(Masker::default().find_in(&text[..], 4).unwrap(), None);
        assert_eq!(masker.mask_text("a TOPSECRET b"), "a *** b");
    }

    /// Found by an adversary: a short multi-line value (lines too short to mask alone) was
    /// masked only when printed with the line ends it was written with.
    #[test]
    fn a_short_multi_line_value_is_masked_with_either_line_end() {
        for value in ["ab\ncd\nef", "ab\r\ncd\r\nef", "ab\ncd\r\nef\n"] {
            let masker = m(&[value]);
            let lf = value.replace("\r\n", "\n");
            let crlf = lf.replace('\n', "\r\n");
            for printed in [value.to_string(), lf, crlf] {
                assert_eq!(
                    all(&masker, &format!("<{printed}>")),
                    "<***>",
                    "{value:?} printed as {printed:?}"
                );
            }
        }
        // Long lines are masked each, whatever the line end between them.
        let masker = m(&["line-one\nline-two"]);
        assert_eq!(all(&masker, "line-one\r\nline-two"), "***");
        assert_eq!(all(&masker, "line-two line-one"), "*** ***");
    }

    #[test]
    fn a_value_split_across_pieces_is_held_back_until_it_is_whole() {
        let masker = m(&["s3cr3t-value"]);
        let stream = b"before s3cr3t-value after s3cr3t-val";
        // Every split point: feeding the stream in two pieces gives what one piece gives.
        for cut in 0..=stream.len() {
            let (mut out, used) = masker.mask(&stream[..cut], false);
            let rest = [&stream[used..cut], &stream[cut..]].concat();
            let (tail, used2) = masker.mask(&rest, true);
            assert_eq!(used2, rest.len());
            out.extend(tail);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                "before *** after s3cr3t-val",
                "cut {cut}"
            );
        }
        // Output that cannot start a value is not held.
        assert_eq!(masker.mask(b"plain text", false), (b"plain text".to_vec(), 10));
        assert_eq!(masker.mask(b"x s3cr", false), (b"x ".to_vec(), 2));
    }

    #[test]
    fn a_window_shows_a_value_reaching_into_it_as_masked() {
        let masker = m(&["topsecret"]);
        let text = b"aa topsecret bb topsecret";
        // Skip into the middle of the first value: it still shows as ***.
        assert_eq!(masker.mask_window(text, 6), b"*** bb ***");
        assert_eq!(masker.mask_window(text, 13), b"bb ***");
        assert_eq!(m(&[]).mask_window(text, 13), b"bb topsecret");
    }

    #[test]
    fn shell_quoting_survives_hostile_values() {
        assert_eq!(shell_quote(b"it's"), b"'it'\\''s'");
        let file = render_env_file(&[("A".into(), b"x".to_vec()), ("B".into(), b"$(id) `id` \"\n'".to_vec())]);
        assert_eq!(
            String::from_utf8(file).unwrap(),
            "export A='x'\nexport B='$(id) `id` \"\n'\\'''\n"
        );
    }

    /// The env file, sourced by a real `sh`, gives each value back byte for byte.
    #[test]
    fn sh_reads_back_every_hostile_value() {
        let hostile: Vec<Vec<u8>> = vec![
            b"plain".to_vec(),
            b"".to_vec(),
            b"it's \"quoted\" \\ back\\slash".to_vec(),
            b"$(touch /tmp/tartan-pwned) `touch /tmp/tartan-pwned` ${HOME} $1".to_vec(),
            b"line1\nline2\n\n".to_vec(),
            b"'''".to_vec(),
            (1u8..=255).collect(),
        ];
        let vars: Vec<(String, Vec<u8>)> = hostile
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("V{i}"), v.clone()))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("env");
        std::fs::write(&file, render_env_file(&vars)).unwrap();
        for (name, value) in &vars {
            // printf %s prints the value without adding anything; an `x` guards trailing newlines.
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!(". \"$1\" && printf '%sx' \"${name}\""))
                .arg("sh")
                .arg(&file)
                .env_clear()
                .output()
                .unwrap();
            assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
            assert_eq!(&out.stdout[..out.stdout.len() - 1], value.as_slice(), "{name}");
        }
        assert!(!std::path::Path::new("/tmp/tartan-pwned").exists());
    }

    #[test]
    fn the_env_file_parses_back_and_damage_is_refused_without_showing_values() {
        let vars: Vec<(String, Vec<u8>)> = vec![
            ("A".into(), b"x".to_vec()),
            ("EMPTY".into(), b"".to_vec()),
            ("B".into(), b"$(id) `id` \"\n'it''s'\n\nexport C='no'\n".to_vec()),
            ("ALL".into(), (1u8..=255).collect()),
        ];
        assert_eq!(parse_env_file(&render_env_file(&vars)).unwrap(), vars);
        assert_eq!(parse_env_file(b"").unwrap(), vec![]);
        for bad in [
            &b"export A='x'"[..],
            b"export A=x\n",
            b"export A='x\n",
            b"export ='x'\n",
            b"export A B='x'\n",
            b"A='x'\n",
            b"export A='x' \n",
            b"export A='topsecret'\nrm -rf /\n",
        ] {
            let e = parse_env_file(bad).unwrap_err();
            assert!(e.starts_with("byte "), "{e}");
            assert!(!e.contains("topsecret"), "{e}");
        }
    }

    #[test]
    fn the_write_reply_gives_the_earlier_file_back() {
        assert_eq!(parse_write(b"tartan-env written\n").unwrap(), Previous::None);
        let file = b"export T='old\nvalue'\n";
        let mut out = format!("tartan-env previous {}\n", file.len()).into_bytes();
        out.extend_from_slice(file);
        out.extend_from_slice(WRITTEN.as_bytes());
        assert_eq!(parse_write(&out).unwrap(), Previous::File(file.to_vec()));
        assert_eq!(
            parse_write(b"tartan-env previous-too-large 99999999\ntartan-env written\n").unwrap(),
            Previous::TooLarge(99_999_999)
        );
        for (bad, says) in [
            (&b"mkdir: x: Permission denied\n"[..], "Permission denied"),
            (b"tartan-env previous 5\nabc\ntartan-env written\n", "4 bytes follow"),
            (b"tartan-env previous x\ntartan-env written\n", "not a number"),
            (b"junk\ntartan-env written\n", "unexpected header"),
            (b"tartan-env previous 9\nT='secret'", "not shown"),
        ] {
            let e = parse_write(bad).unwrap_err();
            assert!(e.contains(says), "{e}");
            assert!(!e.contains("secret'"), "{e}");
        }
    }

    /// The write script, run by a real `sh`: the first write reports no earlier file, the
    /// second the first's bytes; the file is 0600.
    #[test]
    fn the_write_script_prints_the_file_it_replaces() {
        use std::io::Write as _;
        use std::os::unix::fs::PermissionsExt;
        let home = tempfile::tempdir().unwrap();
        let write = |file: &[u8]| {
            let argv = write_script_argv(".tartan/mb-x");
            let mut child = std::process::Command::new(&argv[0])
                .args(&argv[1..])
                .current_dir(home.path())
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            child.stdin.take().unwrap().write_all(file).unwrap();
            child.wait_with_output().unwrap().stdout
        };
        let v1 = render_env_file(&[("T".into(), b"first 'value'\n".to_vec())]);
        let v2 = render_env_file(&[("T".into(), b"second".to_vec())]);
        assert_eq!(parse_write(&write(&v1)).unwrap(), Previous::None);
        assert_eq!(parse_write(&write(&v2)).unwrap(), Previous::File(v1));
        let path = home.path().join(".tartan/mb-x").join(ENV_FILE);
        assert_eq!(std::fs::read(&path).unwrap(), v2);
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn an_earlier_files_changed_secret_values_are_masked_too() {
        let mut env = ResolvedEnv {
            vars: vec![
                ("TOKEN".into(), b"new-token".to_vec()),
                ("MODE".into(), b"Release".to_vec()),
            ],
            masker: Masker::new([&b"new-token"[..]]),
            secret_names: BTreeSet::from(["TOKEN".to_string()]),
        };
        // Unchanged: nothing to add.
        let same = render_env_file(&env.vars);
        assert_eq!(env.adopt_previous(&same), Ok(0));
        // Rotated: the old value (and each of its lines) is masked with the new one; a literal
        // that changed is no secret and stays as it is.
        let old = render_env_file(&[
            ("TOKEN".into(), b"old-token\nline-two".to_vec()),
            ("MODE".into(), b"Debug".to_vec()),
        ]);
        assert_eq!(env.adopt_previous(&old), Ok(1));
        assert_eq!(
            all(&env.masker, "new-token old-token line-two Debug"),
            "*** *** *** Debug"
        );
        // A file a step rewrote is refused, and adds nothing.
        let before = env.masker.clone();
        assert!(env.adopt_previous(b"export TOKEN=unquoted\n").is_err());
        assert_eq!(env.masker, before);
    }

    struct Fake(
        BTreeMap<String, BTreeMap<String, Vec<u8>>>,
        std::sync::Mutex<Vec<String>>,
    );

    impl SecretSource for Fake {
        fn get<'a>(
            &'a self,
            namespace: &'a str,
            name: &'a str,
        ) -> Pin<Box<dyn Future<Output = Result<SecretData, SecretReadError>> + Send + 'a>> {
            self.1.lock().unwrap().push(format!("{namespace}/{name}"));
            let found = self.0.get(name).cloned();
            Box::pin(async move {
                if name == "forbidden" {
                    return Err(SecretReadError::Forbidden("secrets \"forbidden\" is forbidden".into()));
                }
                Ok(found)
            })
        }
    }

    fn access(allowed: &[&str]) -> (SecretAccess, Arc<Fake>) {
        let mut data = BTreeMap::new();
        data.insert(
            "asc".to_string(),
            BTreeMap::from([
                ("key".to_string(), b"asc-secret-value".to_vec()),
                ("nul".to_string(), b"a\0b".to_vec()),
            ]),
        );
        data.insert("forbidden".to_string(), BTreeMap::new());
        let fake = Arc::new(Fake(data, Default::default()));
        (
            SecretAccess {
                allowed: allowed.iter().map(|s| s.to_string()).collect(),
                source: fake.clone(),
            },
            fake,
        )
    }

    #[tokio::test]
    async fn secrets_resolve_and_only_their_values_are_masked() {
        let (a, fake) = access(&["ci/asc"]);
        let env = vec![
            EnvVar {
                name: "MODE".into(),
                value: Some("Release".into()),
                value_from: None,
            },
            EnvVar::from_secret("ASC", "asc", "key"),
            EnvVar::from_secret("ASC2", "asc", "key"),
        ];
        let r = resolve(&env, "ci", Some(&a)).await.unwrap();
        assert_eq!(r.vars[0], ("MODE".into(), b"Release".to_vec()));
        assert_eq!(r.vars[1], ("ASC".into(), b"asc-secret-value".to_vec()));
        assert_eq!(all(&r.masker, "Release asc-secret-value"), "Release ***");
        assert_eq!(*fake.1.lock().unwrap(), vec!["ci/asc"], "one get per Secret");
        let debug = format!("{r:?}");
        assert!(!debug.contains("asc-secret-value") && debug.contains("ASC"), "{debug}");
    }

    #[tokio::test]
    async fn each_refusal_names_the_variable_secret_and_key_and_reads_nothing_not_allowed() {
        let (a, fake) = access(&["ci/asc", "ci/gone", "ci/forbidden"]);
        for (env, ns, reason, want) in [
            (
                EnvVar::from_secret("T", "other", "k"),
                "ci",
                Reason::SecretNotAllowed,
                "env T: Secret ci/other is not allowed",
            ),
            (
                EnvVar::from_secret("T", "asc", "key"),
                "prod",
                Reason::SecretNotAllowed,
                "Secret prod/asc is not allowed",
            ),
            (
                EnvVar::from_secret("T", "gone", "k"),
                "ci",
                Reason::SecretMissing,
                "env T: Secret ci/gone does not exist",
            ),
            (
                EnvVar::from_secret("T", "asc", "nokey"),
                "ci",
                Reason::SecretMissing,
                "Secret ci/asc has no key \"nokey\"",
            ),
            (
                EnvVar::from_secret("T", "asc", "nul"),
                "ci",
                Reason::SecretUnreadable,
                "NUL byte",
            ),
            (
                EnvVar::from_secret("T", "forbidden", "k"),
                "ci",
                Reason::SecretUnreadable,
                "refused",
            ),
        ] {
            let e = resolve(std::slice::from_ref(&env), ns, Some(&a)).await.unwrap_err();
            assert_eq!(e.reason, reason, "{env:?}: {}", e.message);
            assert!(
                e.message.contains(want) && e.message.contains("nothing was cloned"),
                "{}",
                e.message
            );
            assert!(!e.message.contains("asc-secret-value"));
        }
        let e = resolve(&[EnvVar::from_secret("T", "asc", "key")], "ci", None)
            .await
            .unwrap_err();
        assert_eq!(e.reason, Reason::SecretNotAllowed);
        assert!(
            !fake
                .1
                .lock()
                .unwrap()
                .iter()
                .any(|s| s == "ci/other" || s.starts_with("prod/")),
            "a Secret not allowed is never read"
        );
    }

    /// Adversary finding: the automaton's kind is left to the crate, which picks a DFA for a
    /// few values of moderate size, and building that DFA takes time quadratic in a periodic
    /// value's length (measured, debug build: `ab` repeated to 8 KiB 3.4 s, 16 KiB 14 s, 24 KiB
    /// 26 s; 32 KiB over 40 s; a NFA of the same value builds in milliseconds). `resolve` builds
    /// the masker on the async runtime's thread, so a Secret value that repeats a block (a
    /// padded key, a test fixture) stalls the agent's heartbeats for minutes at attempt start.
    /// On failure the build goes on burning a core until the test binary exits (the bound keeps
    /// the verdict).
    #[test]
    fn a_periodic_value_builds_its_masker_in_linear_time() {
        let value = b"ab".repeat(32 << 10);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(Masker::new([&value[..]]).max_len());
        });
        let built = rx.recv_timeout(Duration::from_secs(10));
        assert_eq!(
            built,
            Ok(64 << 10),
            "a 64 KiB periodic value's masker took over 10 s to build"
        );
    }

    /// Adversary finding (availability): each line of a multi-line value is a value of its own,
    /// so the public boilerplate lines of a Secret (a CA bundle's `-----BEGIN CERTIFICATE-----`,
    /// a service-account JSON's `  "type": "service_account",`) are searched for in every
    /// artifact: any artifact that holds such a line (a bundled public certificate, a sample
    /// config) is refused with ArtifactUploadFailed, though it holds nothing secret.
    #[test]
    fn an_artifact_holding_only_a_public_boilerplate_line_of_a_secret_is_not_refused() {
        let bundle =
            b"-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUSecretMaterial0123\n-----END CERTIFICATE-----\n";
        let masker = Masker::new([&bundle[..]]);
        let public_cert = b"-----BEGIN CERTIFICATE-----\nMIIBpublicPublicPublic\n-----END CERTIFICATE-----\n";
        assert_eq!(
            masker.find_in(&public_cert[..], 1 << 20).unwrap(),
            None,
            "an artifact holding another (public) certificate is refused"
        );
    }
}
