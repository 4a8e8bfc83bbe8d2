//! The agent's config file, read by `tartan-agent run --config FILE`.
//!
//! A small TOML file; every key is optional and documented below with its default
//! ([`Config::documented_example`] prints them all, and `agent/examples/agent.toml` is that text).
//! Unknown keys are refused, so a misspelt key is an error naming the file and line instead of a
//! silently ignored setting. Durations are written the humane way: `"500ms"`, `"5s"`, `"2m"`,
//! `"1h"`, `"7d"`, `"1m30s"`.
//!
//! Paths must be absolute: launchd, which starts the agent, expands neither `~` nor `$HOME`.

use crate::host::artifacts::{Destination, check_bucket};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tartan_api::VM_PREFIX;

/// The example config shipped as `agent/examples/agent.toml`: every key with its default.
const DOCUMENTED_EXAMPLE: &str = include_str!("../examples/agent.toml");

/// macOS's licence and Virtualization.framework allow at most two macOS VMs on one host.
pub const MAX_SLOTS: u8 = 2;

/// Default of `status_concurrency`.
pub const DEFAULT_STATUS_CONCURRENCY: usize = 8;

/// The parsed, checked config. Build it with [`Config::load`] or [`Config::from_toml`].
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// This agent's name: `status.claim.holder` of what it claims, its Lease
    /// `tartan-agent-<agent_id>` and the `tartan.dev/agent` label.
    pub agent_id: String,
    /// Where the journal, lock and deadline files live.
    pub state_dir: PathBuf,
    /// Kubeconfig file; `None` = standard inference (`$KUBECONFIG`, `~/.kube/config`, in-cluster).
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context; `None` = the current context.
    pub context: Option<String>,
    /// Namespaces whose MacBuilds this agent serves; empty = all.
    pub namespaces: Vec<String>,
    /// Namespace of the agent's Lease.
    pub lease_namespace: String,
    /// Concurrent VMs (1 or 2).
    pub slots: u8,
    /// Status writes in flight at once (8): a burst (200 redeliveries after a restart) queues here
    /// instead of at the API server, where the Lease renewal would wait behind it.
    pub status_concurrency: usize,
    /// Matched against each MacBuild's `spec.hostSelector`.
    pub host_labels: BTreeMap<String, String>,
    /// Local VM names a MacBuild may name as its image (tart clones a name without `/` from the
    /// local VMs); empty = only registry images.
    pub local_images: Vec<String>,
    /// The tart program.
    pub tart: PathBuf,
    /// `TART_HOME` for tart; `None` = tart's default.
    pub tart_home: Option<PathBuf>,
    /// Artifact publishing defaults.
    pub artifacts: ArtifactsConfig,
    /// How long step logs are kept.
    pub logs: LogsConfig,
    /// Where `/metrics` is served.
    pub metrics_address: SocketAddr,
    /// What a restart does to running builds.
    pub on_restart: OnRestart,
    /// Timing constants.
    pub timing: Timing,
    /// Host folders a MacBuild may mount by name (`[[mounts]]`), each checked at load.
    pub mounts: Vec<MountConfig>,
    /// The VMs' network (`network`, `softnet_allow`).
    pub network: tartan_tart::RunNetwork,
    /// The Secrets a MacBuild's `spec.env` may read.
    pub secrets: SecretsConfig,
}

/// One `[[mounts]]` entry: host folder `host_path` (resolved, existing), shared into a VM that
/// asks for `name` as `tart run --dir name:host_path[:ro]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountConfig {
    pub name: String,
    pub host_path: PathBuf,
    pub read_only: bool,
}

/// `[[mounts]]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMount {
    name: String,
    host_path: PathBuf,
    #[serde(default)]
    read_only: bool,
}

/// `network`: the VMs' network mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum NetworkMode {
    /// tart's shared (NAT) network.
    #[default]
    Shared,
    /// Softnet isolation (`tart run --net-softnet`).
    Softnet,
}

/// `[secrets]`: which Secrets builds on this agent may read into their environment. The agent's
/// RBAC must grant `get` on exactly these (`tartan-agent rbac --config FILE` prints it from this
/// list), and a MacBuild naming any other fails with `SecretNotAllowed` before its VM is cloned.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretsConfig {
    /// `namespace/name` of each Secret; the namespace is the MacBuild's own (a build reads only
    /// Secrets of its namespace). Empty: no build may use `valueFrom.secretKeyRef`.
    #[serde(default)]
    pub allowed: Vec<String>,
}

/// Checks one `[secrets] allowed` entry: `namespace/name`, both valid names.
pub fn check_allowed_secret(entry: &str) -> Result<(&str, &str), String> {
    let Some((ns, name)) = entry.split_once('/') else {
        return Err(format!("{entry:?} is not namespace/name"));
    };
    let ns_ok = !ns.is_empty()
        && ns.len() <= 63
        && ns.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-'))
        && !ns.starts_with('-')
        && !ns.ends_with('-');
    if !ns_ok {
        return Err(format!("{entry:?}: {ns:?} is not a namespace name"));
    }
    tartan_api::env::check_secret_name(name).map_err(|e| format!("{entry:?}: {e}"))?;
    Ok((ns, name))
}

/// What an agent restart does to the builds running on the host (`on_restart`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnRestart {
    /// `tart run` and the steps' guest jobs outlive the agent; the next start follows each
    /// build whose VM still runs and whose guest answers, as the same attempt.
    #[default]
    Resume,
    /// The VMs die with the agent; each interrupted build goes on as its next attempt.
    Restart,
}

/// Artifact publishing: the destination used when a MacBuild names none, and S3 settings.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArtifactsConfig {
    /// `s3://bucket/prefix/` or `file:///absolute/dir/`; `None` = a MacBuild without
    /// `spec.artifacts.destination` publishes nothing.
    #[serde(default)]
    pub destination: Option<String>,
    /// S3 region; `None` = `$AWS_REGION`.
    #[serde(default)]
    pub s3_region: Option<String>,
    /// S3 endpoint URL for S3-compatible stores (MinIO, R2); `None` = AWS.
    #[serde(default)]
    pub s3_endpoint: Option<String>,
    /// Access key id; `None` = `$AWS_ACCESS_KEY_ID`.
    #[serde(default)]
    pub s3_access_key_id: Option<String>,
    /// Secret key; `None` = `$AWS_SECRET_ACCESS_KEY`. Prefer the environment; if you put it here,
    /// make the file readable by its owner only.
    #[serde(default)]
    pub s3_secret_access_key: Option<String>,
    /// Host folders a MacBuild's own `file://` destination may lie in (absolute). Empty: a
    /// `file://` destination is accepted only if it is `destination` itself. Whatever they say,
    /// no destination may be inside or around `state_dir` or tart's home.
    #[serde(default)]
    pub allowed_file_roots: Vec<PathBuf>,
    /// S3 buckets a MacBuild's own `s3://` destination may name; empty = any bucket (the
    /// credentials decide). The bucket of `destination` is always allowed.
    #[serde(default)]
    pub allowed_buckets: Vec<String>,
}

impl fmt::Debug for ArtifactsConfig {
    // The secret never reaches a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArtifactsConfig")
            .field("destination", &self.destination)
            .field("s3_region", &self.s3_region)
            .field("s3_endpoint", &self.s3_endpoint)
            .field("s3_access_key_id", &self.s3_access_key_id)
            .field(
                "s3_secret_access_key",
                &self.s3_secret_access_key.as_ref().map(|_| "<redacted>"),
            )
            .field("allowed_file_roots", &self.allowed_file_roots)
            .field("allowed_buckets", &self.allowed_buckets)
            .finish()
    }
}

/// Retention of the step logs under `<state_dir>/logs/<vm>/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogsConfig {
    /// A VM's log folder older than this is removed (7 days).
    pub max_age: Duration,
    /// Above this many bytes in all, the oldest VM folders are removed first (5 GiB).
    pub max_total_bytes: u64,
    /// How often the new output of a running build's step logs is shipped to its artifact
    /// destination (5 s; 1 s to 60 s).
    pub ship_interval: Duration,
}

impl Default for LogsConfig {
    fn default() -> Self {
        LogsConfig {
            max_age: Duration::from_secs(7 * 24 * 3600),
            max_total_bytes: 5 << 30,
            ship_interval: Duration::from_secs(5),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLogs {
    max_age: Option<HumaneDuration>,
    max_total_mib: Option<u64>,
    ship_interval: Option<HumaneDuration>,
}

/// Timing constants; defaults are the source document's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timing {
    /// How often the Lease is renewed (5 s).
    pub lease_renew: Duration,
    /// `leaseDurationSeconds` of the Lease, and how long after the last successful renewal the
    /// agent stops claiming (20 s).
    pub lease_duration: Duration,
    /// Longest wait for one Kubernetes API request (4 s); shorter than `lease_renew`, so a hung
    /// renewal never skips the next one.
    pub api_timeout: Duration,
    /// A retry starts only with at least this much left before the host execution deadline (120 s).
    pub retry_min_window: Duration,
    /// The watchdog's `--grace` (60 s): an attempt whose VM is gone this long after its deadline
    /// was retired by the watchdog (`WatchdogDeadline`). Keep it equal to the watchdog's.
    pub watchdog_grace: Duration,
    /// First wait before a refused or failed status write is sent again (1 s); doubles per try.
    pub status_retry_initial: Duration,
    /// Longest wait between two tries of a status write (30 s).
    pub status_retry_max: Duration,
    /// At start, how long a still-running VM's guest has to answer before its attempt is given
    /// up as interrupted (30 s).
    pub resume_probe: Duration,
    /// How often a running step's output and exit status are read from the guest (1 s).
    pub step_poll: Duration,
    /// How often finished, delivered builds are dropped from the journal (10 min; the first one
    /// an interval after the start).
    pub compaction_interval: Duration,
    /// The window of the rendezvous wait before a first claim (500 ms): each agent waits a fixed,
    /// logarithmically spaced share of it per build, so the free agents do not all write at once
    /// (`cluster::placement`). 0 claims at once.
    pub claim_spread: Duration,
    /// The extra wait before claiming a build whose image this host does not hold (5 s), so that a
    /// free host holding it claims first; after it, anyone claims.
    pub uncached_claim_delay: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            lease_renew: Duration::from_secs(5),
            lease_duration: Duration::from_secs(20),
            api_timeout: Duration::from_secs(4),
            retry_min_window: Duration::from_secs(120),
            watchdog_grace: Duration::from_secs(60),
            status_retry_initial: Duration::from_secs(1),
            status_retry_max: Duration::from_secs(30),
            resume_probe: Duration::from_secs(30),
            step_poll: Duration::from_secs(1),
            compaction_interval: Duration::from_secs(600),
            claim_spread: Duration::from_millis(500),
            uncached_claim_delay: Duration::from_secs(5),
        }
    }
}

/// What went wrong reading the config; the message names the file and what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}; the agent cannot start without it")]
    Read { path: PathBuf, source: std::io::Error },
    /// A TOML syntax error, an unknown key or a value of the wrong type; `detail` carries toml's
    /// line and column.
    #[error("config file {path}: {detail}")]
    Parse { path: PathBuf, detail: String },
    /// A value that parses but is not allowed.
    #[error("config file {path}: {key}: {detail}")]
    Invalid {
        path: PathBuf,
        key: &'static str,
        detail: String,
    },
}

/// The file as written: every field optional.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    agent_id: Option<String>,
    state_dir: Option<PathBuf>,
    kubeconfig: Option<PathBuf>,
    context: Option<String>,
    #[serde(default)]
    namespaces: Vec<String>,
    lease_namespace: Option<String>,
    slots: Option<i64>,
    status_concurrency: Option<i64>,
    #[serde(default)]
    host_labels: BTreeMap<String, String>,
    #[serde(default)]
    local_images: Vec<String>,
    tart: Option<PathBuf>,
    tart_home: Option<PathBuf>,
    vm_prefix: Option<String>,
    #[serde(default)]
    artifacts: ArtifactsConfig,
    metrics_address: Option<String>,
    #[serde(default)]
    on_restart: OnRestart,
    #[serde(default)]
    logs: RawLogs,
    #[serde(default)]
    timing: RawTiming,
    #[serde(default)]
    mounts: Vec<RawMount>,
    #[serde(default)]
    network: NetworkMode,
    #[serde(default)]
    softnet_allow: Vec<String>,
    #[serde(default)]
    secrets: SecretsConfig,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTiming {
    lease_renew: Option<HumaneDuration>,
    lease_duration: Option<HumaneDuration>,
    api_timeout: Option<HumaneDuration>,
    retry_min_window: Option<HumaneDuration>,
    watchdog_grace: Option<HumaneDuration>,
    status_retry_initial: Option<HumaneDuration>,
    status_retry_max: Option<HumaneDuration>,
    resume_probe: Option<HumaneDuration>,
    step_poll: Option<HumaneDuration>,
    compaction_interval: Option<HumaneDuration>,
    claim_spread: Option<HumaneDuration>,
    uncached_claim_delay: Option<HumaneDuration>,
}

/// A duration written as `"5s"`, `"500ms"`, `"2m"`, `"1h"`, `"7d"` or a sum such as `"1m30s"`.
struct HumaneDuration(Duration);

impl<'de> Deserialize<'de> for HumaneDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text)
            .map(HumaneDuration)
            .map_err(serde::de::Error::custom)
    }
}

/// Parses `"5s"`, `"500ms"`, `"2m"`, `"1h"`, `"7d"`, `"1m30s"`: numbers each followed by `ms`, `s`,
/// `m`, `h` or `d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration; write e.g. \"500ms\", \"5s\", \"2m\" or \"1m30s\"");
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let part = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.checked_mul(60).ok_or_else(bad)?),
            "h" => Duration::from_secs(n.checked_mul(3600).ok_or_else(bad)?),
            "d" => Duration::from_secs(n.checked_mul(24 * 3600).ok_or_else(bad)?),
            _ => return Err(bad()),
        };
        total = total.checked_add(part).ok_or_else(bad)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// Whether `id` can name an agent: a Lease name suffix and a label value, so at most 63
/// characters of `[a-z0-9.-]`, starting and ending with a letter or digit.
pub fn check_agent_id(id: &str) -> Result<(), String> {
    let ok_chars = id.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.'));
    let ends_ok = id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
    if id.is_empty() || id.len() > 63 || !ok_chars || !ends_ok {
        return Err(format!(
            "{id:?} cannot name an agent: use 1 to 63 characters of a-z, 0-9, '-' and '.', starting and ending \
             with a letter or digit (it becomes the Lease tartan-agent-<agent_id> and a label value)"
        ));
    }
    Ok(())
}

/// The default agent id from the host name: its first label, lowercased (`Mac-Mini-07.local` →
/// `mac-mini-07`).
pub fn agent_id_from_hostname(hostname: &str) -> String {
    hostname.split('.').next().unwrap_or_default().to_ascii_lowercase()
}

impl Config {
    /// Every key with its default and meaning, as TOML (the text of `agent/examples/agent.toml`).
    pub fn documented_example() -> &'static str {
        DOCUMENTED_EXAMPLE
    }

    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let hostname = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_default();
        let home = std::env::var_os("HOME").map(PathBuf::from);
        Config::from_toml(path, &text, &hostname, home.as_deref())
    }

    /// Parses `text` (read from `path`, which only names it in errors); `hostname` and `home` give
    /// the defaults of `agent_id` and `state_dir`.
    pub fn from_toml(path: &Path, text: &str, hostname: &str, home: Option<&Path>) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            detail: e.to_string().trim_end().to_string(),
        })?;
        let invalid = |key: &'static str, detail: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            key,
            detail,
        };
        let absolute = |key: &'static str, p: PathBuf| -> Result<PathBuf, ConfigError> {
            if p.is_absolute() {
                Ok(p)
            } else {
                Err(invalid(
                    key,
                    format!(
                        "{} is not an absolute path (launchd expands neither ~ nor $HOME)",
                        p.display()
                    ),
                ))
            }
        };

        let agent_id = match raw.agent_id {
            Some(id) => id,
            None => agent_id_from_hostname(hostname),
        };
        check_agent_id(&agent_id).map_err(|d| invalid("agent_id", d))?;

        let state_dir = match raw.state_dir {
            Some(p) => absolute("state_dir", p)?,
            None => match home {
                Some(home) if home.is_absolute() => home.join("Library/Application Support/Tartan"),
                _ => {
                    return Err(invalid(
                        "state_dir",
                        "not set and $HOME is unknown; set state_dir to an absolute path".into(),
                    ));
                }
            },
        };
        let kubeconfig = raw.kubeconfig.map(|p| absolute("kubeconfig", p)).transpose()?;
        if raw.context.as_deref() == Some("") {
            return Err(invalid(
                "context",
                "is empty; leave it out to use the current context".into(),
            ));
        }
        for ns in &raw.namespaces {
            if ns.is_empty() {
                return Err(invalid("namespaces", "contains an empty name".into()));
            }
        }
        let lease_namespace = raw.lease_namespace.unwrap_or_else(|| "default".into());
        if lease_namespace.is_empty() {
            return Err(invalid("lease_namespace", "is empty".into()));
        }

        let slots = match raw.slots.unwrap_or(1) {
            n @ 1..=2 => n as u8,
            n if n > i64::from(MAX_SLOTS) => {
                return Err(invalid(
                    "slots",
                    format!("{n} is more than macOS allows: at most {MAX_SLOTS} macOS VMs run on one host"),
                ));
            }
            n => return Err(invalid("slots", format!("{n}: an agent needs 1 or 2 slots"))),
        };

        let status_concurrency = match raw.status_concurrency.unwrap_or(DEFAULT_STATUS_CONCURRENCY as i64) {
            n @ 1..=256 => n as usize,
            n => {
                return Err(invalid(
                    "status_concurrency",
                    format!("{n}: status writes in flight at once must be 1 to 256"),
                ));
            }
        };

        let tart = raw.tart.unwrap_or_else(|| PathBuf::from("tart"));
        // A bare program name is looked up on PATH; anything with a directory must be absolute.
        let tart = if tart.components().count() > 1 {
            absolute("tart", tart)?
        } else {
            tart
        };
        let tart_home = raw.tart_home.map(|p| absolute("tart_home", p)).transpose()?;

        // The prefix is part of an on-disk contract shared with the watchdog and recovery (which
        // delete only `mb-` VMs and quarantine unaccounted ones): accept it spelt out, refuse
        // anything else rather than orphan or touch VMs the other parts do not expect.
        if let Some(prefix) = raw.vm_prefix
            && prefix != VM_PREFIX
        {
            return Err(invalid(
                "vm_prefix",
                format!(
                    "{prefix:?}: the VM prefix is fixed at {VM_PREFIX:?} (the watchdog and recovery only ever delete \
                     VMs with it); remove the key, or use a separate tart_home to keep agents apart"
                ),
            ));
        }

        // The agent's own folders: no artifact destination may be inside or around them. Tart's
        // home is the configured one or tart's default under $HOME (the runtime checks the
        // resolved folders again for each build).
        let mut protected: Vec<(&'static str, PathBuf)> = vec![("state_dir", state_dir.clone())];
        match (&tart_home, home) {
            (Some(t), _) => protected.push(("tart_home", t.clone())),
            (None, Some(h)) if h.is_absolute() => protected.push(("tart_home", h.join(".tart"))),
            (None, _) => {}
        }
        if let Some(dest) = &raw.artifacts.destination {
            match Destination::parse(dest) {
                Err(e) => {
                    return Err(invalid(
                        "artifacts.destination",
                        format!("{e}; write s3://bucket/prefix/ or file:///absolute/dir/"),
                    ));
                }
                Ok(Destination::File { dir }) => {
                    if let Some(detail) = overlaps(&dir, &protected, true) {
                        return Err(invalid("artifacts.destination", detail));
                    }
                }
                Ok(Destination::S3 { .. }) => {}
            }
        }
        for root in &raw.artifacts.allowed_file_roots {
            let root = absolute("artifacts.allowed_file_roots", root.clone())?;
            if root.components().any(|c| c == std::path::Component::ParentDir) {
                return Err(invalid(
                    "artifacts.allowed_file_roots",
                    format!("{} contains '..'; write the folder plainly", root.display()),
                ));
            }
            // A root around the state dir is allowed (its other folders are fine); a destination
            // inside it that also holds the state dir is refused per build.
            if let Some(detail) = overlaps(&root, &protected, false) {
                return Err(invalid("artifacts.allowed_file_roots", detail));
            }
        }
        let mounts = check_mounts(raw.mounts, &protected).map_err(|d| invalid("mounts", d))?;
        let mut allow = Vec::new();
        for cidr in &raw.softnet_allow {
            allow.push(
                cidr.parse::<tartan_tart::Ipv4Cidr>()
                    .map_err(|e| invalid("softnet_allow", e))?,
            );
        }
        let network = match raw.network {
            NetworkMode::Softnet => tartan_tart::RunNetwork::Softnet { allow },
            NetworkMode::Shared if allow.is_empty() => tartan_tart::RunNetwork::Shared,
            NetworkMode::Shared => {
                return Err(invalid(
                    "softnet_allow",
                    "is set but network is \"shared\"; set network = \"softnet\" (the list only opens Softnet's isolation)"
                        .into(),
                ));
            }
        };

        for bucket in &raw.artifacts.allowed_buckets {
            check_bucket(bucket).map_err(|why| {
                invalid(
                    "artifacts.allowed_buckets",
                    format!("{bucket:?} cannot name an S3 bucket: it {why}"),
                )
            })?;
        }

        let d = LogsConfig::default();
        let logs = LogsConfig {
            max_age: raw.logs.max_age.map_or(d.max_age, |h| h.0),
            max_total_bytes: match raw.logs.max_total_mib {
                None => d.max_total_bytes,
                Some(mib) => mib.checked_mul(1 << 20).ok_or_else(|| {
                    invalid(
                        "logs.max_total_mib",
                        format!("{mib} MiB is more bytes than fit in 64 bits"),
                    )
                })?,
            },
            ship_interval: raw.logs.ship_interval.map_or(d.ship_interval, |h| h.0),
        };
        if !(Duration::from_secs(1)..=Duration::from_secs(60)).contains(&logs.ship_interval) {
            return Err(invalid(
                "logs.ship_interval",
                format!(
                    "{:?} must be 1s to 60s (a follower sees a running step's output one interval late)",
                    logs.ship_interval
                ),
            ));
        }

        let metrics_address = match raw.metrics_address {
            None => SocketAddr::from(([127, 0, 0, 1], 9464)),
            Some(a) => a.parse().map_err(|e| {
                invalid(
                    "metrics_address",
                    format!("{a:?} is not an address like 127.0.0.1:9464: {e}"),
                )
            })?,
        };

        let d = Timing::default();
        let t = raw.timing;
        let pick = |v: Option<HumaneDuration>, default: Duration| v.map_or(default, |h| h.0);
        let timing = Timing {
            lease_renew: pick(t.lease_renew, d.lease_renew),
            lease_duration: pick(t.lease_duration, d.lease_duration),
            api_timeout: pick(t.api_timeout, d.api_timeout),
            retry_min_window: pick(t.retry_min_window, d.retry_min_window),
            watchdog_grace: pick(t.watchdog_grace, d.watchdog_grace),
            status_retry_initial: pick(t.status_retry_initial, d.status_retry_initial),
            status_retry_max: pick(t.status_retry_max, d.status_retry_max),
            resume_probe: pick(t.resume_probe, d.resume_probe),
            step_poll: pick(t.step_poll, d.step_poll),
            compaction_interval: pick(t.compaction_interval, d.compaction_interval),
            claim_spread: pick(t.claim_spread, d.claim_spread),
            uncached_claim_delay: pick(t.uncached_claim_delay, d.uncached_claim_delay),
        };
        timing.check().map_err(|(key, detail)| invalid(key, detail))?;

        let mut seen = std::collections::BTreeSet::new();
        for entry in &raw.secrets.allowed {
            let (ns, _) = check_allowed_secret(entry).map_err(|d| invalid("secrets.allowed", d))?;
            if !raw.namespaces.is_empty() && !raw.namespaces.iter().any(|n| n == ns) {
                return Err(invalid(
                    "secrets.allowed",
                    format!(
                        "{entry:?} is in namespace {ns:?}, which this agent does not serve (namespaces); a build \
                         reads only Secrets of its own namespace"
                    ),
                ));
            }
            if !seen.insert(entry.as_str()) {
                return Err(invalid("secrets.allowed", format!("{entry:?} is listed twice")));
            }
        }

        Ok(Config {
            agent_id,
            state_dir,
            kubeconfig,
            context: raw.context,
            namespaces: raw.namespaces,
            lease_namespace,
            slots,
            status_concurrency,
            host_labels: raw.host_labels,
            local_images: raw.local_images,
            tart,
            tart_home,
            artifacts: raw.artifacts,
            logs,
            metrics_address,
            on_restart: raw.on_restart,
            timing,
            mounts,
            network,
            secrets: raw.secrets,
        })
    }

    /// Whether this agent serves MacBuilds of `namespace`.
    pub fn serves_namespace(&self, namespace: &str) -> bool {
        self.namespaces.is_empty() || self.namespaces.iter().any(|n| n == namespace)
    }
}

/// Why `dir` may not hold artifacts: it is inside one of the `protected` folders (or, with
/// `around`, one is inside it). Compared as written, component by component.
fn overlaps(dir: &Path, protected: &[(&'static str, PathBuf)], around: bool) -> Option<String> {
    protected.iter().find_map(|(key, p)| {
        if dir.starts_with(p) {
            Some(format!(
                "{} is inside {key} {}; a MacBuild may never write into the agent's own folders",
                dir.display(),
                p.display()
            ))
        } else if around && p.starts_with(dir) {
            Some(format!(
                "{} holds {key} {}; a MacBuild may never write around the agent's own folders",
                dir.display(),
                p.display()
            ))
        } else {
            None
        }
    })
}

/// Checks `[[mounts]]`: unique names a MacBuild can ask for, host folders that are absolute,
/// plainly written (no `..`), existing, fit for tart's `--dir` syntax, and neither inside nor
/// around the agent's own folders (`protected`, as for artifact destinations: checked as written
/// and resolved). Returns them with their folders resolved.
fn check_mounts(raw: Vec<RawMount>, protected: &[(&'static str, PathBuf)]) -> Result<Vec<MountConfig>, String> {
    let mut out: Vec<MountConfig> = Vec::new();
    for m in raw {
        tartan_api::crd::check_mount_name(&m.name)?;
        if out.iter().any(|o| o.name == m.name) {
            return Err(format!("mount {:?} is declared twice", m.name));
        }
        let at = |detail: String| format!("mount {:?}: host_path {}", m.name, detail);
        let written = m.host_path.clone();
        if !written.is_absolute() {
            return Err(at(format!(
                "{} is not an absolute path (launchd expands neither ~ nor $HOME)",
                written.display()
            )));
        }
        if written.components().any(|c| c == std::path::Component::ParentDir) {
            return Err(at(format!(
                "{} contains '..'; write the folder plainly",
                written.display()
            )));
        }
        let resolved = std::fs::canonicalize(&written)
            .map_err(|e| at(format!("{}: {e}; create the folder first", written.display())))?;
        if !resolved.is_dir() {
            return Err(at(format!("{} is not a folder", written.display())));
        }
        let resolved_protected: Vec<(&'static str, PathBuf)> = protected
            .iter()
            .map(|(k, p)| (*k, std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())))
            .collect();
        if let Some(detail) =
            overlaps(&written, protected, true).or_else(|| overlaps(&resolved, &resolved_protected, true))
        {
            return Err(at(detail));
        }
        let share = tartan_tart::DirShare {
            name: m.name.clone(),
            path: resolved.clone(),
            read_only: m.read_only,
        };
        share.render().map_err(|e| at(format!("cannot be shared: {e}")))?;
        out.push(MountConfig {
            name: m.name,
            host_path: resolved,
            read_only: m.read_only,
        });
    }
    Ok(out)
}

impl Timing {
    /// The relations the agent relies on; returns the offending key and why.
    fn check(&self) -> Result<(), (&'static str, String)> {
        let secs = |d: Duration| format!("{}s", d.as_secs_f64());
        if self.lease_renew.is_zero() {
            return Err(("timing.lease_renew", "must be more than 0".into()));
        }
        if self.lease_duration.as_secs() == 0 || self.lease_duration.subsec_nanos() != 0 {
            return Err((
                "timing.lease_duration",
                format!(
                    "{} must be a whole number of seconds, at least 1 (leaseDurationSeconds)",
                    secs(self.lease_duration)
                ),
            ));
        }
        if self.lease_renew >= self.lease_duration {
            return Err((
                "timing.lease_renew",
                format!(
                    "{} must be shorter than timing.lease_duration ({}), or the Lease expires between renewals",
                    secs(self.lease_renew),
                    secs(self.lease_duration)
                ),
            ));
        }
        if self.api_timeout.is_zero() || self.api_timeout >= self.lease_renew {
            return Err((
                "timing.api_timeout",
                format!(
                    "{} must be more than 0 and shorter than timing.lease_renew ({})",
                    secs(self.api_timeout),
                    secs(self.lease_renew)
                ),
            ));
        }
        if self.status_retry_initial.is_zero() || self.status_retry_initial > self.status_retry_max {
            return Err((
                "timing.status_retry_initial",
                format!(
                    "{} must be more than 0 and at most timing.status_retry_max ({})",
                    secs(self.status_retry_initial),
                    secs(self.status_retry_max)
                ),
            ));
        }
        if self.step_poll.is_zero() || self.step_poll > Duration::from_secs(60) {
            return Err((
                "timing.step_poll",
                format!(
                    "{} must be more than 0 and at most 60s (a finished step is noticed one poll late)",
                    secs(self.step_poll)
                ),
            ));
        }
        if self.resume_probe.is_zero() {
            return Err(("timing.resume_probe", "must be more than 0".into()));
        }
        if self.compaction_interval.is_zero() {
            return Err(("timing.compaction_interval", "must be more than 0".into()));
        }
        if self.claim_spread > Duration::from_secs(60) {
            return Err((
                "timing.claim_spread",
                format!(
                    "{} is more than 60s: every claim would wait up to that long",
                    secs(self.claim_spread)
                ),
            ));
        }
        if self.uncached_claim_delay > Duration::from_secs(3600) {
            return Err((
                "timing.uncached_claim_delay",
                format!(
                    "{} is more than 1h: a build whose image no free host holds would wait that long",
                    secs(self.uncached_claim_delay)
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(
            Path::new("/etc/agent.toml"),
            text,
            "Mac-Mini-07.local",
            Some(Path::new("/Users/ci")),
        )
    }

    #[test]
    fn an_empty_file_gives_the_documented_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.agent_id, "mac-mini-07");
        assert_eq!(c.state_dir, Path::new("/Users/ci/Library/Application Support/Tartan"));
        assert_eq!(c.kubeconfig, None);
        assert_eq!(c.context, None);
        assert!(c.namespaces.is_empty());
        assert!(c.serves_namespace("anything"));
        assert_eq!(c.lease_namespace, "default");
        assert_eq!(c.slots, 1);
        assert!(c.host_labels.is_empty());
        assert_eq!(c.tart, Path::new("tart"));
        assert_eq!(c.tart_home, None);
        assert_eq!(c.artifacts, ArtifactsConfig::default());
        assert!(c.artifacts.allowed_file_roots.is_empty() && c.artifacts.allowed_buckets.is_empty());
        assert_eq!(c.logs.max_age, Duration::from_secs(7 * 24 * 3600));
        assert_eq!(c.logs.max_total_bytes, 5 << 30);
        assert_eq!(c.metrics_address.to_string(), "127.0.0.1:9464");
        assert_eq!(c.timing, Timing::default());
        assert_eq!(c.timing.lease_renew, Duration::from_secs(5));
        assert_eq!(c.timing.lease_duration, Duration::from_secs(20));
        assert_eq!(c.timing.retry_min_window, Duration::from_secs(120));
    }

    #[test]
    fn the_documented_example_parses_to_the_defaults() {
        assert_eq!(parse(Config::documented_example()).unwrap(), parse("").unwrap());
        for key in [
            "agent_id",
            "state_dir",
            "kubeconfig",
            "lease_namespace",
            "slots",
            "vm_prefix",
            "allowed_file_roots",
            "allowed_buckets",
            "[logs]",
            "max_age",
            "max_total_mib",
            "[timing]",
            "network",
            "softnet_allow",
            "[[mounts]]",
            "read_only",
        ] {
            assert!(Config::documented_example().contains(key), "{key}");
        }
    }

    #[test]
    fn every_key_can_be_set() {
        let c = parse(
            r#"
agent_id = "mac-mini-07"
state_dir = "/var/tartan"
kubeconfig = "/Users/ci/.config/tartan/kubeconfig"
context = "tartan"
namespaces = ["ci", "release"]
lease_namespace = "tartan-system"
slots = 2
host_labels = { xcode = "16", arch = "arm64" }
tart = "/opt/homebrew/bin/tart"
tart_home = "/Users/ci/.tart"
vm_prefix = "mb-"
metrics_address = "0.0.0.0:9100"

[artifacts]
destination = "s3://ci-artifacts/app/"
s3_region = "eu-west-1"
s3_endpoint = "https://minio.example:9000"
s3_access_key_id = "AKIA"
s3_secret_access_key = "hunter2"
allowed_file_roots = ["/Volumes/ci/artifacts", "/srv/builds/"]
allowed_buckets = ["ci-artifacts", "release.builds"]

[logs]
max_age = "2d"
max_total_mib = 100

[timing]
lease_renew = "2s"
lease_duration = "10s"
api_timeout = "1500ms"
retry_min_window = "3m"
status_retry_initial = "250ms"
status_retry_max = "1m30s"
compaction_interval = "90s"
claim_spread = "250ms"
uncached_claim_delay = "30s"
"#,
        )
        .unwrap();
        assert_eq!(
            c.kubeconfig.as_deref(),
            Some(Path::new("/Users/ci/.config/tartan/kubeconfig"))
        );
        assert_eq!(c.context.as_deref(), Some("tartan"));
        assert!(c.serves_namespace("ci") && !c.serves_namespace("default"));
        assert_eq!(c.lease_namespace, "tartan-system");
        assert_eq!(c.slots, 2);
        assert_eq!(c.host_labels["xcode"], "16");
        assert_eq!(c.tart, Path::new("/opt/homebrew/bin/tart"));
        assert_eq!(c.artifacts.s3_region.as_deref(), Some("eu-west-1"));
        assert!(!format!("{:?}", c.artifacts).contains("hunter2"));
        assert_eq!(
            c.artifacts.allowed_file_roots,
            vec![PathBuf::from("/Volumes/ci/artifacts"), PathBuf::from("/srv/builds/")]
        );
        assert_eq!(c.artifacts.allowed_buckets, vec!["ci-artifacts", "release.builds"]);
        assert_eq!(c.logs.max_age, Duration::from_secs(2 * 24 * 3600));
        assert_eq!(c.logs.max_total_bytes, 100 << 20);
        assert_eq!(c.metrics_address.port(), 9100);
        assert_eq!(c.timing.api_timeout, Duration::from_millis(1500));
        assert_eq!(c.timing.retry_min_window, Duration::from_secs(180));
        assert_eq!(c.timing.status_retry_max, Duration::from_secs(90));
        assert_eq!(c.timing.compaction_interval, Duration::from_secs(90));
        assert_eq!(c.timing.claim_spread, Duration::from_millis(250));
        assert_eq!(c.timing.uncached_claim_delay, Duration::from_secs(30));
    }

    #[test]
    fn status_concurrency_defaults_to_8_and_is_bounded() {
        assert_eq!(parse("").unwrap().status_concurrency, DEFAULT_STATUS_CONCURRENCY);
        assert_eq!(parse("status_concurrency = 32").unwrap().status_concurrency, 32);
        for bad in ["status_concurrency = 0", "status_concurrency = 257"] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains("status_concurrency") && err.contains("1 to 256"), "{err}");
        }
    }

    #[test]
    fn more_than_two_slots_is_refused_naming_macos() {
        let err = parse("slots = 3").unwrap_err().to_string();
        assert!(err.contains("/etc/agent.toml") && err.contains("slots"), "{err}");
        assert!(err.contains("at most 2 macOS VMs"), "{err}");
        assert!(parse("slots = 0").unwrap_err().to_string().contains("1 or 2"));
    }

    #[test]
    fn unknown_keys_are_refused_with_file_and_line() {
        let err = parse("slots = 1\nlease_renw = \"5s\"\n").unwrap_err().to_string();
        assert!(err.starts_with("config file /etc/agent.toml:"), "{err}");
        assert!(err.contains("line 2"), "{err}");
        assert!(err.contains("lease_renw"), "{err}");
        let err = parse("[timing]\nrenew = \"5s\"\n").unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("renew"), "{err}");
        let err = parse("[artifacts]\nbucket = \"x\"\n").unwrap_err().to_string();
        assert!(err.contains("bucket"), "{err}");
    }

    #[test]
    fn bad_values_are_refused_with_the_key() {
        for (text, key) in [
            ("vm_prefix = \"ci-\"", "vm_prefix"),
            ("state_dir = \"~/tartan\"", "state_dir"),
            ("kubeconfig = \"kube/config\"", "kubeconfig"),
            ("tart = \"bin/tart\"", "tart"),
            ("agent_id = \"Mac_Mini\"", "agent_id"),
            ("metrics_address = \"localhost\"", "metrics_address"),
            ("[artifacts]\ndestination = \"http://x\"", "artifacts.destination"),
            ("[timing]\nlease_renew = \"20s\"", "timing.lease_renew"),
            ("[timing]\nlease_duration = \"1500ms\"", "timing.lease_duration"),
            ("[timing]\napi_timeout = \"5s\"", "timing.api_timeout"),
            ("[timing]\nstatus_retry_initial = \"1m\"", "timing.status_retry_initial"),
            ("[timing]\ncompaction_interval = \"0s\"", "timing.compaction_interval"),
            ("[timing]\nclaim_spread = \"61s\"", "timing.claim_spread"),
            ("[timing]\nuncached_claim_delay = \"2h\"", "timing.uncached_claim_delay"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
        let err = parse("[timing]\nlease_renew = \"5 seconds\"").unwrap_err().to_string();
        assert!(err.contains("not a duration") && err.contains("line 2"), "{err}");
        let err = parse("slots = \"two\"").unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
    }

    #[test]
    fn artifact_roots_and_destinations_never_reach_the_agents_own_folders() {
        let base = "state_dir = \"/var/tartan\"\ntart_home = \"/Users/ci/.tart\"\n[artifacts]\n";
        let refused = |extra: &str, key: &str, why: &str| {
            let err = parse(&format!("{base}{extra}")).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(why), "{extra}: {err}");
        };
        // A root inside (or equal to) the state dir or tart's home, whatever the spelling.
        refused(
            "allowed_file_roots = [\"/var/tartan/journal\"]",
            "artifacts.allowed_file_roots",
            "is inside state_dir /var/tartan",
        );
        refused(
            "allowed_file_roots = [\"/var/tartan/\"]",
            "artifacts.allowed_file_roots",
            "is inside state_dir",
        );
        refused(
            "allowed_file_roots = [\"/var//tartan/./deadlines\"]",
            "artifacts.allowed_file_roots",
            "is inside state_dir",
        );
        refused(
            "allowed_file_roots = [\"/Users/ci/.tart/vms\"]",
            "artifacts.allowed_file_roots",
            "is inside tart_home /Users/ci/.tart",
        );
        refused(
            "allowed_file_roots = [\"/srv/a/../../var/tartan\"]",
            "artifacts.allowed_file_roots",
            "contains '..'",
        );
        refused(
            "allowed_file_roots = [\"srv/artifacts\"]",
            "artifacts.allowed_file_roots",
            "not an absolute path",
        );
        refused(
            "allowed_buckets = [\"Bad_Bucket\"]",
            "artifacts.allowed_buckets",
            "may contain only lowercase",
        );
        // The default destination too, and around the folders as well as inside.
        refused(
            "destination = \"file:///var/tartan/deadlines/\"",
            "artifacts.destination",
            "is inside state_dir",
        );
        refused(
            "destination = \"file:///var/\"",
            "artifacts.destination",
            "holds state_dir",
        );
        refused(
            "destination = \"file:///srv/%2e%2e/var/tartan/\"",
            "artifacts.destination",
            "percent-escapes",
        );
        // A sibling with the same prefix is another folder; a root around the state dir is fine.
        let c = parse(&format!(
            "{base}allowed_file_roots = [\"/var/tartan-artifacts\", \"/var\"]\ndestination = \"file:///var/tartan-out/\""
        ))
        .unwrap();
        assert_eq!(c.artifacts.allowed_file_roots.len(), 2);
        // Without tart_home, tart's default under $HOME is protected.
        let err = parse("[artifacts]\nallowed_file_roots = [\"/Users/ci/.tart/tmp\"]")
            .unwrap_err()
            .to_string();
        assert!(err.contains("is inside tart_home /Users/ci/.tart"), "{err}");
    }

    #[test]
    fn log_retention_is_checked() {
        let err = parse("[logs]\nmax_total_mib = 18446744073709551615")
            .unwrap_err()
            .to_string();
        assert!(err.contains("logs.max_total_mib"), "{err}");
        for bad in ["0s", "500ms", "61s"] {
            let err = parse(&format!("[logs]\nship_interval = \"{bad}\""))
                .unwrap_err()
                .to_string();
            assert!(err.contains("logs.ship_interval") && err.contains("1s to 60s"), "{err}");
        }
        assert_eq!(
            parse("[logs]\nship_interval = \"2s\"").unwrap().logs.ship_interval,
            Duration::from_secs(2)
        );
        let err = parse("[logs]\nmax_age = \"forever\"").unwrap_err().to_string();
        assert!(err.contains("not a duration") && err.contains("line 2"), "{err}");
        let err = parse("[logs]\nkeep = 3").unwrap_err().to_string();
        assert!(err.contains("keep"), "{err}");
    }

    #[test]
    fn state_dir_needs_home_when_not_set() {
        let err = Config::from_toml(Path::new("a.toml"), "", "h", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("state_dir") && err.contains("$HOME"), "{err}");
    }

    #[test]
    fn durations_parse_the_humane_way() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 24 * 3600)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        for bad in ["", "5", "s", "5x", "-5s", "5 s", "1.5s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn agent_id_defaults_to_the_short_lowercased_host_name() {
        assert_eq!(agent_id_from_hostname("Mac-Mini-07.local"), "mac-mini-07");
        assert_eq!(agent_id_from_hostname("builder"), "builder");
        // A host name that cannot name an agent asks for agent_id.
        let err = Config::from_toml(Path::new("a.toml"), "", "my_mac", Some(Path::new("/h")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("agent_id"), "{err}");
    }

    #[test]
    fn mounts_are_checked_at_load_and_hostile_ones_refused() {
        let base = tempfile::tempdir().unwrap();
        let b = base.path().canonicalize().unwrap();
        let state = b.join("state");
        let home = b.join("tart");
        let cache = b.join("cache/spm");
        std::fs::create_dir_all(&cache).unwrap();
        std::fs::create_dir_all(state.join("logs")).unwrap();
        std::fs::create_dir_all(&home).unwrap();
        std::os::unix::fs::symlink(state.join("logs"), b.join("sneaky")).unwrap();
        std::fs::write(b.join("file"), b"x").unwrap();
        let odd = b.join("a,ro");
        std::fs::create_dir_all(&odd).unwrap();
        let head = format!("state_dir = {:?}\ntart_home = {:?}\n", state, home);
        let load = |mounts: &str| parse(&format!("{head}{mounts}"));
        let c = load(&format!(
            "[[mounts]]\nname = \"spm\"\nhost_path = {cache:?}\n[[mounts]]\nname = \"seed\"\nhost_path = {cache:?}\nread_only = true\n"
        ))
        .unwrap();
        assert_eq!(
            c.mounts,
            vec![
                MountConfig {
                    name: "spm".into(),
                    host_path: cache.clone(),
                    read_only: false
                },
                MountConfig {
                    name: "seed".into(),
                    host_path: cache.clone(),
                    read_only: true
                },
            ]
        );
        assert!(parse("").unwrap().mounts.is_empty());
        let one = |name: &str, path: &str| load(&format!("[[mounts]]\nname = {name:?}\nhost_path = {path:?}\n"));
        let cases: Vec<(String, String, &str)> = vec![
            ("SPM".into(), cache.display().to_string(), "mount name \"SPM\" must be"),
            ("a:b".into(), cache.display().to_string(), "mount name \"a:b\""),
            ("".into(), cache.display().to_string(), "mount name \"\""),
            ("x".repeat(5000), cache.display().to_string(), "must be 1-63"),
            ("spm".into(), "cache/spm".into(), "is not an absolute path"),
            (
                "spm".into(),
                format!("{}/cache/../cache/spm", b.display()),
                "contains '..'",
            ),
            (
                "spm".into(),
                b.join("missing").display().to_string(),
                "create the folder first",
            ),
            ("spm".into(), b.join("file").display().to_string(), "is not a folder"),
            (
                "spm".into(),
                state.join("logs").display().to_string(),
                "is inside state_dir",
            ),
            (
                "spm".into(),
                home.join("vms").display().to_string(),
                "create the folder first",
            ),
            ("spm".into(), home.display().to_string(), "is inside tart_home"),
            ("spm".into(), b.display().to_string(), "holds state_dir"),
            (
                "spm".into(),
                b.join("sneaky").display().to_string(),
                "is inside state_dir",
            ),
            ("spm".into(), odd.display().to_string(), "cannot be shared"),
        ];
        for (name, path, want) in cases {
            let e = one(&name, &path).unwrap_err().to_string();
            assert!(e.contains("mounts: ") && e.contains(want), "{name:?} {path:?}: {e}");
            assert!(e.len() < 1000, "{e}");
        }
        let twice = load(&format!(
            "[[mounts]]\nname = \"spm\"\nhost_path = {cache:?}\n[[mounts]]\nname = \"spm\"\nhost_path = {cache:?}\n"
        ));
        assert!(
            twice
                .unwrap_err()
                .to_string()
                .contains("mount \"spm\" is declared twice")
        );
        let unknown = load(&format!(
            "[[mounts]]\nname = \"spm\"\nhost_path = {cache:?}\nmode = \"rw\"\n"
        ));
        assert!(unknown.unwrap_err().to_string().contains("unknown field `mode`"));
    }

    #[test]
    fn network_is_shared_or_softnet_with_checked_cidrs() {
        use tartan_tart::RunNetwork;
        assert_eq!(parse("").unwrap().network, RunNetwork::Shared);
        assert_eq!(parse("network = \"shared\"").unwrap().network, RunNetwork::Shared);
        assert_eq!(
            parse("network = \"softnet\"").unwrap().network,
            RunNetwork::Softnet { allow: vec![] }
        );
        let c = parse("network = \"softnet\"\nsoftnet_allow = [\"10.0.0.0/8\", \"192.168.1.0/24\"]").unwrap();
        assert_eq!(
            c.network,
            RunNetwork::Softnet {
                allow: vec!["10.0.0.0/8".parse().unwrap(), "192.168.1.0/24".parse().unwrap()]
            }
        );
        for (text, want) in [
            ("network = \"bridged\"", "unknown variant `bridged`"),
            (
                "network = \"softnet\"\nsoftnet_allow = [\"10.0.0.1/8\"]",
                "write 10.0.0.0/8",
            ),
            (
                "network = \"softnet\"\nsoftnet_allow = [\"10.0.0.0/8,0.0.0.0/0\"]",
                "not an IPv4 CIDR",
            ),
            (
                "network = \"softnet\"\nsoftnet_allow = [\"fd00::/8\"]",
                "not an IPv4 CIDR",
            ),
            ("softnet_allow = [\"10.0.0.0/8\"]", "set network = \"softnet\""),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
    }
}
