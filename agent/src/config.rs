//! The agent's config file, read by `tartan-agent run --config FILE`.
//!
//! A small TOML file; every key is optional and documented below with its default
//! ([`Config::documented_example`] prints them all, and `agent/examples/agent.toml` is that text).
//! Unknown keys are refused, so a misspelt key is an error naming the file and line instead of a
//! silently ignored setting. Durations are written the humane way: `"500ms"`, `"5s"`, `"2m"`,
//! `"1h"`, `"7d"`, `"1m30s"`.
//!
//! Paths must be absolute: launchd, which starts the agent, expands neither `~` nor `$HOME`.

use crate::host::mounts::within_ignoring_case;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tartan_api::VM_PREFIX;
use tartan_api::destination::{Destination, check_bucket};

mod pool;
mod resolve;
mod timing;

pub use pool::{DEFAULT_POOL_MAX_IDLE, PoolConfig};
use resolve::*;

/// The example config shipped as `agent/examples/agent.toml`: every key with its default.
const DOCUMENTED_EXAMPLE: &str = include_str!("../examples/agent.toml");

/// macOS's licence and Virtualization.framework allow at most two macOS VMs on one host.
pub const MAX_SLOTS: u8 = 2;

/// Default of `[logs] max_build_mib`, in bytes: four steps at the 64 MiB per-step cap.
pub const DEFAULT_BUILD_LOG_BYTES: u64 = 256 << 20;

/// Default of `[disk] min_free_gib`, in bytes: a macOS VM clone needs tens of GiB.
pub const DEFAULT_DISK_MIN_FREE_BYTES: u64 = 20 << 30;

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
    /// The free-space floor below which no new build is claimed.
    pub disk: DiskConfig,
    /// Where `/metrics` is served.
    pub metrics_address: SocketAddr,
    /// Bounds of that server (`metrics_max_connections`, `metrics_idle_timeout`).
    pub metrics_limits: tartan_serve::Limits,
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
    /// `[pool]`: warm VMs booted ahead of builds (off unless it lists images).
    pub pool: PoolConfig,
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

/// Why an entry of `[secrets] allowed` (or `rbac --secret`) cannot name a Secret.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllowedSecretError {
    #[error("{entry:?} is not namespace/name")]
    NotNamespaceSlashName { entry: String },
    #[error("{entry:?}: {ns:?} is not a namespace name")]
    Namespace { entry: String, ns: String },
    #[error("{entry:?}: {why}")]
    SecretName { entry: String, why: String },
}

/// Checks one `[secrets] allowed` entry: `namespace/name`, both valid names.
pub fn check_allowed_secret(entry: &str) -> Result<(&str, &str), AllowedSecretError> {
    let Some((ns, name)) = entry.split_once('/') else {
        return Err(AllowedSecretError::NotNamespaceSlashName { entry: entry.into() });
    };
    let ns_ok = !ns.is_empty()
        && ns.len() <= 63
        && ns.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-'))
        && !ns.starts_with('-')
        && !ns.ends_with('-');
    if !ns_ok {
        return Err(AllowedSecretError::Namespace {
            entry: entry.into(),
            ns: ns.into(),
        });
    }
    tartan_api::env::check_secret_name(name).map_err(|why| AllowedSecretError::SecretName {
        entry: entry.into(),
        why,
    })?;
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
    /// Step logs of one build together hold at most this many bytes (256 MiB); a step's output
    /// beyond it is dropped with one note line, as beyond the 64 MiB per-step cap.
    pub max_build_bytes: u64,
    /// How often the new output of a running build's step logs is shipped to its artifact
    /// destination (5 s; 1 s to 60 s).
    pub ship_interval: Duration,
}

impl Default for LogsConfig {
    fn default() -> Self {
        LogsConfig {
            max_age: Duration::from_secs(7 * 24 * 3600),
            max_total_bytes: 5 << 30,
            max_build_bytes: DEFAULT_BUILD_LOG_BYTES,
            ship_interval: Duration::from_secs(5),
        }
    }
}

/// The longest `[logs] max_age` accepted: a year.
const MAX_LOG_AGE: Duration = Duration::from_secs(365 * 24 * 3600);

/// `[disk]`: the free space the agent keeps on the filesystems of `state_dir` and tart's home.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    /// Below this many free bytes on either filesystem the agent claims no new build (20 GiB);
    /// builds it already runs go on. 0 turns the floor off.
    pub min_free_bytes: u64,
}

impl Default for DiskConfig {
    fn default() -> Self {
        DiskConfig {
            min_free_bytes: DEFAULT_DISK_MIN_FREE_BYTES,
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDisk {
    min_free_gib: Option<u64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLogs {
    max_age: Option<HumaneDuration>,
    max_total_mib: Option<u64>,
    max_build_mib: Option<u64>,
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
    metrics_max_connections: Option<i64>,
    metrics_idle_timeout: Option<HumaneDuration>,
    #[serde(default)]
    on_restart: OnRestart,
    #[serde(default)]
    logs: RawLogs,
    #[serde(default)]
    disk: RawDisk,
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
    #[serde(default)]
    pool: pool::RawPool,
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
    tartan_api::duration::parse_unit_duration(text)
}

/// An id that cannot name an agent, and what to write instead.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} cannot name an agent: use 1 to 63 characters of a-z, 0-9, '-' and '.', starting and ending with a \
     letter or digit (it becomes the Lease tartan-agent-<agent_id> and a label value)"
)]
pub struct AgentIdError(pub String);

/// Whether `id` can name an agent: a Lease name suffix and a label value, so at most 63
/// characters of `[a-z0-9.-]`, starting and ending with a letter or digit.
pub fn check_agent_id(id: &str) -> Result<(), AgentIdError> {
    let ok_chars = id.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.'));
    let ends_ok = id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
    if id.is_empty() || id.len() > 63 || !ok_chars || !ends_ok {
        return Err(AgentIdError(id.into()));
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
        Config::resolve(raw, hostname, home).map_err(|Refusal { key, why }| ConfigError::Invalid {
            path: path.to_path_buf(),
            key,
            detail: why,
        })
    }

    /// The config of `raw`, section by section, in the order the keys are checked.
    fn resolve(raw: RawConfig, hostname: &str, home: Option<&Path>) -> Result<Config, Refusal> {
        let agent_id = resolve_agent_id(raw.agent_id, hostname)?;
        let state_dir = resolve_state_dir(raw.state_dir, home)?;
        let kubeconfig = raw.kubeconfig.map(|p| absolute("kubeconfig", p)).transpose()?;
        let lease_namespace = check_namespaces(raw.context.as_deref(), &raw.namespaces, raw.lease_namespace)?;
        let slots = resolve_slots(raw.slots)?;
        let status_concurrency = resolve_status_concurrency(raw.status_concurrency)?;
        let (tart, tart_home) = resolve_tart(raw.tart, raw.tart_home, raw.vm_prefix)?;
        let protected = protected_folders(&state_dir, tart_home.as_deref(), home);
        let artifact_folders = check_artifact_folders(&raw.artifacts, &protected)?;
        let mounts = check_mounts(raw.mounts, &protected, &artifact_folders)?;
        let network = resolve_network(raw.network, &raw.softnet_allow)?;
        check_buckets(&raw.artifacts.allowed_buckets)?;
        let logs = LogsConfig::resolve(raw.logs)?;
        let disk = DiskConfig::resolve(raw.disk)?;
        let (metrics_address, metrics_limits) = resolve_metrics(
            raw.metrics_address,
            raw.metrics_max_connections,
            raw.metrics_idle_timeout,
        )?;
        let timing = Timing::resolve(raw.timing)?;
        check_secrets(&raw.secrets, &raw.namespaces)?;
        let pool = PoolConfig::resolve(raw.pool, slots, &raw.local_images)?;
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
            disk,
            metrics_address,
            metrics_limits,
            on_restart: raw.on_restart,
            timing,
            mounts,
            network,
            secrets: raw.secrets,
            pool,
        })
    }

    /// Whether this agent serves MacBuilds of `namespace`.
    pub fn serves_namespace(&self, namespace: &str) -> bool {
        self.namespaces.is_empty() || self.namespaces.iter().any(|n| n == namespace)
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
        assert_eq!(c.disk.min_free_bytes, 20 << 30);
        assert_eq!(c.metrics_address.to_string(), "127.0.0.1:9464");
        assert_eq!(c.metrics_limits, tartan_serve::Limits::default());
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
            "max_build_mib",
            "[disk]",
            "min_free_gib",
            "[timing]",
            "network",
            "softnet_allow",
            "[[mounts]]",
            "read_only",
            "metrics_max_connections",
            "metrics_idle_timeout",
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
metrics_max_connections = 8
metrics_idle_timeout = "2s"

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
max_build_mib = 32

[disk]
min_free_gib = 50

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
        assert_eq!(c.logs.max_build_bytes, 32 << 20);
        assert_eq!(c.disk.min_free_bytes, 50 << 30);
        assert_eq!(c.metrics_address.port(), 9100);
        assert_eq!(
            c.metrics_limits,
            tartan_serve::Limits {
                max_connections: 8,
                idle_timeout: Duration::from_secs(2)
            }
        );
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
            ("metrics_max_connections = 0", "metrics_max_connections"),
            ("[logs]\nmax_build_mib = 0", "logs.max_build_mib"),
            ("[disk]\nmin_free_gib = 17179869184", "disk.min_free_gib"),
            ("[disk]\nmin_free_gib = -1", "min_free_gib"),
            ("metrics_max_connections = 5000", "metrics_max_connections"),
            ("metrics_idle_timeout = \"10ms\"", "metrics_idle_timeout"),
            ("metrics_idle_timeout = \"2h\"", "metrics_idle_timeout"),
            ("[artifacts]\ndestination = \"http://x\"", "artifacts.destination"),
            ("[timing]\nlease_renew = \"20s\"", "timing.lease_renew"),
            ("[timing]\nlease_duration = \"1500ms\"", "timing.lease_duration"),
            // Found by the adversary: a Lease that never expires, and an Instant overflow.
            (
                "[timing]\nlease_duration = \"200000000000000d\"",
                "timing.lease_duration",
            ),
            ("[timing]\nlease_duration = \"3601s\"", "timing.lease_duration"),
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
    fn durations_bounded_by_nothing_else_have_an_upper_bound() {
        // A mistyped or hostile value is refused at load, never left to overflow a timer's or a
        // deadline's arithmetic (a huge compaction_interval panicked tokio's interval).
        for (section, key, max, more) in [
            ("timing", "retry_min_window", "1d", "is more than 1d"),
            ("timing", "watchdog_grace", "1h", "is more than 1h"),
            ("timing", "status_retry_max", "1h", "is more than 1h"),
            ("timing", "resume_probe", "1h", "is more than 1h"),
            ("timing", "compaction_interval", "1d", "is more than 1d"),
            ("logs", "max_age", "365d", "is more than 365d"),
        ] {
            let full_key = format!("{section}.{key}");
            assert!(
                parse(&format!("[{section}]\n{key} = \"{max}\"")).is_ok(),
                "{full_key} = {max} is allowed"
            );
            for value in [format!("{max}1s"), "200000000000000d".to_string()] {
                let err = parse(&format!("[{section}]\n{key} = \"{value}\""))
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.contains(&format!("{full_key}: ")) && err.contains(more),
                    "{full_key} = {value}: {err}"
                );
            }
        }
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
        // One inside another, either way round: refused (adversary round 7).
        let inner = cache.join("seed");
        std::fs::create_dir_all(&inner).unwrap();
        for (first, second) in [(&cache, &inner), (&inner, &cache)] {
            let err = load(&format!(
                "[[mounts]]\nname = \"a\"\nhost_path = {first:?}\n[[mounts]]\nname = \"b\"\nhost_path = {second:?}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains("one mount may not be inside another"), "{err}");
        }
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

    /// The adversary's setup: a read-write mount inside an allowed root let a build plant links
    /// the artifact upload followed. Any overlap with an artifact folder, either way, written or
    /// resolved, read-only too, is refused at load, naming the key.
    #[test]
    fn mounts_may_not_overlap_a_folder_artifacts_are_written_to() {
        let base = tempfile::tempdir().unwrap();
        let b = base.path().canonicalize().unwrap();
        let roots = b.join("area/artifacts");
        let shared = roots.join("shared");
        let default = b.join("out/default");
        let apart = b.join("cache");
        for d in [&shared, &default, &apart, &b.join("state")] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::os::unix::fs::symlink(&roots, b.join("roots-link")).unwrap();
        std::os::unix::fs::symlink(&shared, b.join("shared-link")).unwrap();
        let head = format!("state_dir = {:?}\ntart_home = {:?}\n", b.join("state"), b.join("tart"));
        let load = |artifacts: &str, mount: &Path, ro: bool| {
            parse(&format!(
                "{head}[[mounts]]\nname = \"m\"\nhost_path = {mount:?}\nread_only = {ro}\n[artifacts]\n{artifacts}"
            ))
        };
        let roots_key = format!("allowed_file_roots = [{roots:?}]\n");
        let via_link = format!("allowed_file_roots = [{:?}]\n", b.join("roots-link"));
        let dest_key = format!("destination = \"file://{}/\"\n", default.display());
        let later = format!("allowed_file_roots = [{:?}]\n", b.join("cache/not-yet/x"));
        for (artifacts, mount, ro, key, relation) in [
            (&roots_key, &shared, false, "artifacts.allowed_file_roots", "is inside"),
            (&roots_key, &shared, true, "artifacts.allowed_file_roots", "is inside"),
            (&roots_key, &roots, false, "artifacts.allowed_file_roots", "is inside"),
            (
                &roots_key,
                &b.join("area"),
                false,
                "artifacts.allowed_file_roots",
                "holds",
            ),
            (
                &roots_key,
                &b.join("shared-link"),
                false,
                "artifacts.allowed_file_roots",
                "is inside",
            ),
            (&via_link, &shared, false, "artifacts.allowed_file_roots", "is inside"),
            (&dest_key, &default, false, "artifacts.destination", "is inside"),
            (&dest_key, &b.join("out"), true, "artifacts.destination", "holds"),
            (&later, &apart, false, "artifacts.allowed_file_roots", "holds"),
        ] {
            let e = load(artifacts, mount, ro).unwrap_err().to_string();
            assert!(
                e.contains("mounts: mount \"m\": host_path")
                    && e.contains(&format!("{relation} {key}"))
                    && e.contains("may not overlap a folder artifacts are written to"),
                "{artifacts} {}: {e}",
                mount.display()
            );
        }
        // Apart is fine, and a sibling sharing a prefix is apart.
        let c = load(&format!("{roots_key}{dest_key}"), &apart, false).unwrap();
        assert_eq!(c.mounts.len(), 1);
        std::fs::create_dir_all(b.join("area/artifacts-cache")).unwrap();
        assert!(load(&roots_key, &b.join("area/artifacts-cache"), false).is_ok());
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
