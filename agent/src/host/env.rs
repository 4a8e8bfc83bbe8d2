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
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Masker {
    /// Longest first, so that the longest value matching at a position wins.
    values: Vec<Vec<u8>>,
}

impl fmt::Debug for Masker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Masker({} value(s))", self.values.len())
    }
}

impl Masker {
    /// A masker of `secrets`: each value of at least [`MIN_MASKED_LEN`] bytes, and each line
    /// (without its line end) of a multi-line value that long, since a tool may print such a
    /// value line by line or with other line ends.
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a [u8]>) -> Masker {
        let mut set = BTreeSet::new();
        for v in secrets {
            set.insert(v.to_vec());
            for line in v.split(|&b| b == b'\n') {
                set.insert(line.strip_suffix(b"\r").unwrap_or(line).to_vec());
            }
        }
        let mut values: Vec<Vec<u8>> = set.into_iter().filter(|v| v.len() >= MIN_MASKED_LEN).collect();
        values.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        Masker { values }
    }

    /// Whether there is nothing to mask.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The longest masked value's length (0 if none).
    pub fn max_len(&self) -> usize {
        self.values.first().map_or(0, Vec::len)
    }

    /// The length of the longest value at the start of `rest`.
    fn match_at(&self, rest: &[u8]) -> Option<usize> {
        self.values.iter().find(|v| rest.starts_with(v)).map(Vec::len)
    }

    /// Whether `rest` is the start of a value longer than it (more output may complete it).
    fn cut_at(&self, rest: &[u8]) -> bool {
        self.values.iter().any(|v| v.len() > rest.len() && v.starts_with(rest))
    }

    /// Masks `bytes`, a piece of a stream. Unless `last` (nothing follows), a piece that ends
    /// inside what may be a value is held back: returns the masked output and how many bytes of
    /// `bytes` it covers; the caller passes the rest again with what follows.
    pub fn mask(&self, bytes: &[u8], last: bool) -> (Vec<u8>, usize) {
        self.mask_from(bytes, 0, last)
    }

    /// Masks a window of a stream whose first `skip` bytes are only context: output starts at
    /// byte `skip` (a value that begins in the context and reaches past it still shows as
    /// [`MASK`]). The window is the stream's end.
    pub fn mask_window(&self, bytes: &[u8], skip: usize) -> Vec<u8> {
        self.mask_from(bytes, skip, true).0
    }

    fn mask_from(&self, bytes: &[u8], skip: usize, last: bool) -> (Vec<u8>, usize) {
        if self.values.is_empty() {
            return (bytes[skip.min(bytes.len())..].to_vec(), bytes.len());
        }
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let rest = &bytes[i..];
            if !last && self.cut_at(rest) {
                break;
            }
            match self.match_at(rest) {
                Some(len) => {
                    // A value that starts inside this match and reaches past it (two values
                    // overlapping, or one overlapping itself) is masked with it, as one run.
                    let mut end = i + len;
                    let mut j = i + 1;
                    let mut held = false;
                    while j < end {
                        if !last && self.cut_at(&bytes[j..]) {
                            held = true;
                            break;
                        }
                        if let Some(l) = self.match_at(&bytes[j..]) {
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

/// Writes stdin to `$1/env` with mode 0600 (made as `env.tmp`, then renamed, so a step never
/// sources half a file); prints one line, `tartan-env written`.
const WRITE_SCRIPT: &str = r#"exec 2>&1
umask 077
d=$1
mkdir -p "$d" || exit 1
cat >"$d/env.tmp" && chmod 600 "$d/env.tmp" && mv -f "$d/env.tmp" "$d/env" || exit 1
echo "tartan-env written"
"#;

/// What [`WRITE_SCRIPT`] prints on success.
pub const WRITTEN: &str = "tartan-env written\n";

/// The argv that writes the env file (given on stdin) into guest folder `dir`.
pub fn write_script_argv(dir: &str) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        WRITE_SCRIPT.into(),
        "tartan-env".into(),
        dir.into(),
    ]
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
}

impl fmt::Debug for ResolvedEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
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
}
