//! `tartan-agent doctor`: checks a Mac as the agent will use it, one line per check with what to
//! do when it fails (docs/runbook.md, "tartan-agent doctor").
//!
//! Each check reads or probes for real (the config file, `tart --version` and `tart list`, the
//! filesystems, a write + fsync in the journal's folder, a replay of the journal, the API server)
//! and never changes what the agent keeps: it takes no lock and writes only a probe file it
//! removes. Every step that may wait is bounded ([`TART_TIMEOUT`], the config's
//! `timing.api_timeout`). The verdicts and their rendering are pure ([`Report`]).

use crate::cluster::lease::lease_name;
use crate::config::Config;
use crate::host::disk::{self, Filesystem};
use crate::journal::{self, JOURNAL_DIR};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde::Serialize;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tartan_tart::Tart;

/// How long `tart --version` and `tart list` may take.
pub const TART_TIMEOUT: Duration = Duration::from_secs(30);
/// The clock skew against the API server beyond which the check fails. The agent's Lease renewals,
/// its status times and the host deadline are the Mac's clock; the controller judges them with
/// the cluster's. `Date` has whole seconds, so a second or two is reading noise.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(5);
/// The fewest open files the agent should be able to have (after raising its soft limit to the
/// hard one, as it does at start): each build holds the journal, a deadline file, step logs and
/// tart's pipes, and the metrics server and API connections hold more.
pub const MIN_OPEN_FILES: u64 = 1024;

/// A check's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
    /// Not applicable here (e.g. launchd off macOS) or not possible after an earlier failure.
    Skip,
}

/// One check: what was checked, what was found, and for a failure what to do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: String,
    pub verdict: Verdict,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    pub fn pass(name: impl Into<String>, detail: impl Into<String>) -> Self {
        Check {
            name: name.into(),
            verdict: Verdict::Pass,
            detail: detail.into(),
            fix: None,
        }
    }
    pub fn fail(name: impl Into<String>, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Check {
            name: name.into(),
            verdict: Verdict::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
    pub fn skip(name: impl Into<String>, detail: impl Into<String>) -> Self {
        Check {
            name: name.into(),
            verdict: Verdict::Skip,
            detail: detail.into(),
            fix: None,
        }
    }
}

/// Every check of one run, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// True when no check failed (skips do not fail the run).
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|c| c.verdict != Verdict::Fail)
    }

    /// One line per check (`✓`, `✗` or `-`, the name, what was found), a failure's fix indented
    /// under it, and a last line counting the failures.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            let mark = match c.verdict {
                Verdict::Pass => "✓",
                Verdict::Fail => "✗",
                Verdict::Skip => "-",
            };
            out.push_str(&format!("{mark} {}: {}\n", c.name, c.detail));
            if let Some(fix) = &c.fix {
                out.push_str(&format!("    fix: {fix}\n"));
            }
        }
        let failed = self.checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
        if failed == 0 {
            out.push_str("all checks passed\n");
        } else {
            out.push_str(&format!("{failed} of {} checks failed\n", self.checks.len()));
        }
        out
    }

    /// `{"ok": bool, "checks": [{name, verdict, detail, fix?}...]}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"ok": self.ok(), "checks": self.checks})
    }
}

/// Runs every check for the agent config at `config_path`. A config that does not load fails
/// its check and skips the others (they all need it).
pub async fn run(config_path: &Path) -> Report {
    let mut report = Report::default();
    let config = match Config::load(config_path) {
        Ok(c) => {
            report.checks.push(Check::pass(
                "config",
                format!("{} parses (agent {})", config_path.display(), c.agent_id),
            ));
            c
        }
        Err(e) => {
            report.checks.push(Check::fail(
                "config",
                format!("{}: {e}", config_path.display()),
                "correct the file (agent/examples/agent.toml documents every key), or pass the right one with --config",
            ));
            report
                .checks
                .push(Check::skip("the other checks", "they need a config that loads"));
            return report;
        }
    };
    let tart = Tart::new(&config.tart, config.tart_home.clone());
    let tart_ok = check_tart(&config.tart, &mut report).await;
    report.checks.push(if tart_ok {
        check_images(&config.local_images, &tart).await
    } else {
        Check::skip("images", "tart does not run")
    });
    let tart_home = tart.home().map_err(|e| e.to_string());
    report.checks.extend(check_disk(&config, &tart_home));
    report.checks.push(check_journal_writable(&config.state_dir));
    report.checks.push(check_journal_replays(&config.state_dir));
    report.checks.push(check_deadlines_dir(&config.state_dir));
    report.checks.extend(check_mounts(&config));
    if matches!(config.network, tartan_tart::RunNetwork::Softnet { .. }) {
        report.checks.push(check_softnet().await);
    }
    report.checks.push(check_open_files());
    report.checks.extend(check_launch_agents());
    report.checks.extend(check_cluster(&config).await);
    report
}

/// Runs `program args` with a bound; stdout and stderr as text, or why it did not run.
async fn run_bounded(program: &Path, args: &[&str], limit: Duration) -> Result<(bool, String, String), String> {
    let child = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(limit, child).await {
        Err(_) => Err(format!("no answer within {limit:?} (killed)")),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(out)) => Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        )),
    }
}

async fn check_tart(program: &Path, report: &mut Report) -> bool {
    let check = match run_bounded(program, &["--version"], TART_TIMEOUT).await {
        Ok((true, version, _)) if !version.is_empty() => {
            report.checks.push(Check::pass(
                "tart",
                format!("{} runs, version {version}", program.display()),
            ));
            return true;
        }
        Ok((ok, stdout, stderr)) => Check::fail(
            "tart",
            format!(
                "`{} --version` {} (stdout {stdout:?}, stderr {stderr:?})",
                program.display(),
                if ok { "printed no version" } else { "failed" }
            ),
            "reinstall tart (brew install cirruslabs/cli/tart), or set `tart` in the config to its path",
        ),
        Err(e) => Check::fail(
            "tart",
            format!("cannot run `{} --version`: {e}", program.display()),
            "install tart (brew install cirruslabs/cli/tart) or set `tart` in the config to its absolute path (launchd's PATH is short)",
        ),
    };
    report.checks.push(check);
    false
}

async fn check_images(local_images: &[String], tart: &Tart) -> Check {
    if local_images.is_empty() {
        return Check::pass("images", "no local_images configured (builds use registry images only)");
    }
    let listed = match tokio::time::timeout(TART_TIMEOUT, tart.list()).await {
        Err(_) => {
            return Check::fail(
                "images",
                format!("`tart list` gave no answer within {TART_TIMEOUT:?}"),
                "see whether tart hangs (`tart list`); a full disk or a stuck VM can block it",
            );
        }
        Ok(Err(e)) => {
            return Check::fail(
                "images",
                format!("`tart list` failed: {e}"),
                "run `tart list` to see why",
            );
        }
        Ok(Ok(entries)) => entries,
    };
    let missing: Vec<&str> = local_images
        .iter()
        .filter(|image| !listed.iter().any(|e| e.is_local() && &e.name == *image))
        .map(String::as_str)
        .collect();
    if missing.is_empty() {
        Check::pass(
            "images",
            format!("every local_images entry is a local VM: {}", local_images.join(", ")),
        )
    } else {
        Check::fail(
            "images",
            format!("not local VMs here (tart list): {}", missing.join(", ")),
            "create them (`tart clone <registry image> <name>`) or remove them from local_images; a MacBuild naming one fails at clone",
        )
    }
}

fn check_disk(config: &Config, tart_home: &Result<PathBuf, String>) -> Vec<Check> {
    let floor = config.disk.min_free_bytes;
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30));
    let mut out = Vec::new();
    for (fs, path) in [
        (Filesystem::StateDir, Ok(config.state_dir.clone())),
        (Filesystem::TartHome, tart_home.clone()),
    ] {
        let name = format!("disk {}", fs.as_str());
        let path = match path {
            Ok(p) => p,
            Err(e) => {
                out.push(Check::fail(
                    name,
                    format!("tart's home is unknown: {e}"),
                    "set tart_home in the config, or HOME for tart's default ~/.tart",
                ));
                continue;
            }
        };
        // A folder the agent has not created yet: its filesystem is its nearest existing ancestor's.
        let probe = nearest_existing(&path);
        out.push(match disk::free_bytes(&probe) {
            Err(e) => Check::fail(
                name,
                format!("cannot read the free space of {}: {e}", probe.display()),
                "check that the folder exists and is readable by the agent's user",
            ),
            Ok(free) if free < floor => Check::fail(
                name,
                format!(
                    "{} has {} free, below [disk] min_free_gib ({}): the agent would claim no build",
                    path.display(),
                    gib(free),
                    gib(floor)
                ),
                "free space (tart prune, delete unused images, shorter [logs] max_age) or lower min_free_gib",
            ),
            Ok(free) => Check::pass(
                name,
                format!(
                    "{} has {} free (floor {})",
                    path.display(),
                    gib(free),
                    if floor == 0 { "off".to_string() } else { gib(floor) }
                ),
            ),
        });
    }
    out
}

fn nearest_existing(path: &Path) -> PathBuf {
    path.ancestors()
        .find(|p| p.exists())
        .map_or_else(|| PathBuf::from("/"), Path::to_path_buf)
}

/// Writes, fsyncs and removes a probe file in `dir` (or, if `dir` does not exist yet, in its
/// nearest existing ancestor, where the agent would create it). Says what it did, where.
pub fn probe_write(dir: &Path) -> Result<String, String> {
    let (at, note) = if dir.is_dir() {
        (
            dir.to_path_buf(),
            format!("wrote and fsynced a file in {}", dir.display()),
        )
    } else if dir.exists() {
        return Err(format!("{} exists and is not a directory", dir.display()));
    } else {
        let parent = nearest_existing(dir);
        if !parent.is_dir() {
            return Err(format!(
                "{} does not exist and {} is not a directory",
                dir.display(),
                parent.display()
            ));
        }
        let note = format!(
            "{} does not exist yet (the agent creates it); wrote and fsynced a file in {}",
            dir.display(),
            parent.display()
        );
        (parent, note)
    };
    let probe = at.join(format!(".tartan-doctor-{}", std::process::id()));
    let result = (|| -> Result<(), String> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&probe)
            .map_err(|e| format!("creating {}: {e}", probe.display()))?;
        file.write_all(b"tartan-agent doctor probe\n")
            .map_err(|e| format!("writing {}: {e}", probe.display()))?;
        // On macOS std's sync_all is F_FULLFSYNC, as the journal's own sync.
        file.sync_all()
            .map_err(|e| format!("fsync of {}: {e}", probe.display()))?;
        Ok(())
    })();
    let removed = std::fs::remove_file(&probe);
    result?;
    removed.map_err(|e| format!("removing the probe {}: {e}", probe.display()))?;
    Ok(note)
}

fn check_journal_writable(state_dir: &Path) -> Check {
    let dir = state_dir.join(JOURNAL_DIR);
    match probe_write(&dir) {
        Ok(done) => Check::pass("journal writable", done),
        Err(e) => Check::fail(
            "journal writable",
            e,
            "give the agent's user a writable state_dir on a local disk (chown/chmod, free space, remount)",
        ),
    }
}

fn check_journal_replays(state_dir: &Path) -> Check {
    if !state_dir.join(JOURNAL_DIR).exists() {
        return Check::pass("journal replays", "no journal yet (the agent starts one)");
    }
    match journal::read_records(state_dir) {
        Ok(replay) if replay.warnings.is_empty() => Check::pass(
            "journal replays",
            format!("{} record(s) read cleanly", replay.records.len()),
        ),
        Ok(replay) => Check::pass(
            "journal replays",
            format!(
                "{} record(s); the agent will repair at open: {}",
                replay.records.len(),
                replay.warnings.join("; ")
            ),
        ),
        Err(e) => Check::fail(
            "journal replays",
            e.to_string(),
            "see `tartan-agent journal --state-dir <state_dir>` and docs/runbook.md; never delete the journal (it says which VMs to retire and which results to deliver)",
        ),
    }
}

fn check_deadlines_dir(state_dir: &Path) -> Check {
    let dir = state_dir.join(tartan_watchdog::run::DEADLINES_DIR);
    match probe_write(&dir) {
        Ok(done) => Check::pass("watchdog deadlines", done),
        Err(e) => Check::fail(
            "watchdog deadlines",
            e,
            "the agent writes each VM's deadline there and the watchdog reads it: make it a writable directory of the agent's user",
        ),
    }
}

fn check_mounts(config: &Config) -> Vec<Check> {
    config
        .mounts
        .iter()
        .map(|m| {
            let name = format!("mount {}", m.name);
            if m.host_path.is_dir() {
                Check::pass(
                    name,
                    format!(
                        "{} is a directory ({})",
                        m.host_path.display(),
                        if m.read_only { "read-only" } else { "read-write" }
                    ),
                )
            } else {
                Check::fail(
                    name,
                    format!("{} is not a directory", m.host_path.display()),
                    "create the folder or correct host_path in [[mounts]]; a build asking for this mount would fail",
                )
            }
        })
        .collect()
}

/// Where `program` is on `PATH` (as tart looks it up), if anywhere.
fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// Softnet's set-up as tart checks it before `tart run --net-softnet` (docs/build-options.md):
/// the binary, resolved through its symlinks, owned by root with the SUID bit, else
/// `sudo --non-interactive softnet --help` working. `sudo_works` is asked only when needed.
pub fn softnet_verdict(found: Option<(&Path, u32, u32)>, sudo_works: impl FnOnce() -> Result<(), String>) -> Check {
    let Some((binary, owner, mode)) = found else {
        return Check::fail(
            "softnet",
            "network = \"softnet\" but no softnet on PATH (tart runs it from the agent's PATH)",
            "brew install cirruslabs/cli/softnet, and make sure the LaunchAgent's PATH has its folder (e.g. /opt/homebrew/bin)",
        );
    };
    if owner == 0 && mode & 0o4000 != 0 {
        return Check::pass("softnet", format!("{} is root's with the SUID bit", binary.display()));
    }
    match sudo_works() {
        Ok(()) => Check::pass(
            "softnet",
            format!("{} runs through sudo without a password", binary.display()),
        ),
        Err(e) => Check::fail(
            "softnet",
            format!(
                "{} is not root's with the SUID bit (owner uid {owner}, mode {:o}) and `sudo --non-interactive softnet --help` failed: {e}",
                binary.display(),
                mode & 0o7777
            ),
            format!(
                "sudo chown root {0} && sudo chmod u+s {0} (again after each brew upgrade softnet), or a sudoers rule for softnet",
                binary.display()
            ),
        ),
    }
}

async fn check_softnet() -> Check {
    use std::os::unix::fs::MetadataExt;
    let resolved = on_path("softnet").and_then(|p| std::fs::canonicalize(&p).ok());
    let meta = resolved.as_ref().and_then(|p| std::fs::metadata(p).ok());
    let found = resolved
        .as_deref()
        .zip(meta.as_ref())
        .map(|(p, m)| (p, m.uid(), m.mode()));
    let sudo = match found {
        Some((_, 0, mode)) if mode & 0o4000 != 0 => Ok(()),
        None => Ok(()),
        Some(_) => match on_path("sudo") {
            None => Err("no sudo on PATH".to_string()),
            Some(sudo) => match run_bounded(&sudo, &["--non-interactive", "softnet", "--help"], TART_TIMEOUT).await {
                Ok((true, _, _)) => Ok(()),
                Ok((false, _, stderr)) => Err(stderr),
                Err(e) => Err(e),
            },
        },
    };
    softnet_verdict(found, || sudo)
}

/// The open-files limit the agent will have: its soft limit raised toward the hard one.
pub fn open_files_verdict(soft: u64, hard: u64) -> Check {
    let will_have = tartan_serve::open_files_target(soft, hard).unwrap_or(soft);
    let detail = format!("soft {soft}, hard {hard}: the agent raises it to {will_have}");
    if will_have >= MIN_OPEN_FILES {
        Check::pass("open files", detail)
    } else {
        Check::fail(
            "open files",
            format!("{detail}, below {MIN_OPEN_FILES}"),
            "raise the hard limit (launchctl limit maxfiles, or the plist's HardResourceLimits: tartan-agent install writes them)",
        )
    }
}

fn check_open_files() -> Check {
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) => open_files_verdict(soft, hard),
        Err(e) => Check::fail(
            "open files",
            format!("reading RLIMIT_NOFILE: {e}"),
            "none known; the agent logs its limit at start",
        ),
    }
}

fn check_launch_agents() -> Vec<Check> {
    match crate::service::launch_agent_states() {
        None => vec![Check::skip(
            "LaunchAgents",
            format!("launchd exists only on macOS (this is {})", std::env::consts::OS),
        )],
        Some(Err(e)) => vec![Check::fail(
            "LaunchAgents",
            format!("{e:#}"),
            "see `tartan-agent service-status`",
        )],
        Some(Ok(states)) => states
            .into_iter()
            .map(|(label, state)| match state {
                Ok(detail) => Check::pass(format!("LaunchAgent {label}"), detail),
                Err(detail) => Check::fail(
                    format!("LaunchAgent {label}"),
                    detail,
                    "`tartan-agent install --config <file>` (re)installs and starts both; logs in ~/Library/Logs/Tartan/",
                ),
            })
            .collect(),
    }
}

/// The Mac's clock against the API server's `Date` (whole seconds), read at `local` (the middle
/// of the request).
pub fn skew_verdict(server_date: &str, local: Timestamp) -> Check {
    let server = match k8s_openapi::jiff::fmt::rfc2822::parse(server_date) {
        Ok(zoned) => zoned.timestamp(),
        Err(e) => {
            return Check::fail(
                "clock",
                format!("the API server's Date {server_date:?} does not parse: {e}"),
                "none needed for the agent; check the server or proxy in between",
            );
        }
    };
    let skew = local.duration_since(server);
    let limit = SignedDuration::try_from(MAX_CLOCK_SKEW).unwrap_or(SignedDuration::MAX);
    let shown = format!("{:.1}s", skew.as_secs_f64());
    if skew.abs() <= limit {
        Check::pass(
            "clock",
            format!("{shown} from the API server's Date (limit {MAX_CLOCK_SKEW:?})"),
        )
    } else {
        Check::fail(
            "clock",
            format!(
                "this Mac's clock is {shown} {} the API server's (limit {MAX_CLOCK_SKEW:?})",
                if skew.is_negative() { "behind" } else { "ahead of" }
            ),
            "turn on network time (System Settings > General > Date & Time; `sntp -sS time.apple.com`): Lease renewals, status times and deadlines are judged by the cluster's clock",
        )
    }
}

async fn check_cluster(config: &Config) -> Vec<Check> {
    let limit = config.timing.api_timeout;
    let fix_kubeconfig = "check the config's kubeconfig/context (docs/install-on-mac.md): the server address, its CA and the token of the agent's ServiceAccount";
    let client = match tokio::time::timeout(limit, crate::cluster::client(config)).await {
        Err(_) => Err(format!("loading the kubeconfig took over {limit:?}")),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Ok(Ok(c)) => Ok(c),
    };
    let (client, server) = match client {
        Ok(c) => c,
        Err(e) => {
            return vec![
                Check::fail("API server", e, fix_kubeconfig),
                Check::skip("clock", "no API server to compare with"),
                Check::skip("Lease", "no API server"),
                Check::skip("RBAC", "no API server"),
            ];
        }
    };
    let mut out = Vec::new();
    let request = axum::http::Request::get("/version")
        .body(kube::client::Body::empty())
        .expect("a constant request is valid");
    let before = Timestamp::now();
    let answer = tokio::time::timeout(limit, client.send(request)).await;
    let after = Timestamp::now();
    let middle = before.checked_add(after.duration_since(before) / 2).unwrap_or(after);
    match answer {
        Err(_) => {
            out.push(Check::fail(
                "API server",
                format!("{server}: no answer within {limit:?} (timing.api_timeout)"),
                "check that this Mac reaches the API server (network, VPN, firewall) and the address in the kubeconfig",
            ));
            out.push(Check::skip("clock", "no answer from the API server"));
            out.push(Check::skip("Lease", "no answer from the API server"));
            out.push(Check::skip("RBAC", "no answer from the API server"));
            return out;
        }
        Ok(Err(e)) => {
            out.push(Check::fail("API server", format!("{server}: {e}"), fix_kubeconfig));
            out.push(Check::skip("clock", "no answer from the API server"));
            out.push(Check::skip("Lease", "no answer from the API server"));
            out.push(Check::skip("RBAC", "no answer from the API server"));
            return out;
        }
        Ok(Ok(response)) => {
            out.push(Check::pass(
                "API server",
                format!("{server} answers (GET /version: {})", response.status()),
            ));
            out.push(match response.headers().get("date").and_then(|d| d.to_str().ok()) {
                Some(date) => skew_verdict(date, middle),
                None => Check::skip("clock", "the API server's answer has no Date header"),
            });
        }
    }
    let name = lease_name(&config.agent_id);
    let at = format!("{}/{name}", config.lease_namespace);
    let leases: kube::Api<Lease> = kube::Api::namespaced(client.clone(), &config.lease_namespace);
    out.push(match tokio::time::timeout(limit, leases.get_opt(&name)).await {
        Err(_) => Check::fail(
            "Lease",
            format!("reading {at}: no answer within {limit:?}"),
            "the API server is slow or unreachable; try again",
        ),
        Ok(Ok(Some(lease))) => {
            let spec = lease.spec.unwrap_or_default();
            Check::pass(
                "Lease",
                format!(
                    "{at} readable (holder {}, renewed {})",
                    spec.holder_identity.as_deref().unwrap_or("none"),
                    spec.renew_time.map_or_else(|| "never".to_string(), |t| t.0.to_string())
                ),
            )
        }
        Ok(Ok(None)) => Check::pass("Lease", format!("{at} readable, not created yet (the agent creates it)")),
        Ok(Err(kube::Error::Api(status))) if status.code == 401 || status.code == 403 => Check::fail(
            "Lease",
            format!("reading {at}: {} {}", status.code, status.message),
            format!(
                "apply this agent's RBAC: `tartan-agent rbac --agent-id {} --namespace <ns> --lease-namespace {} | kubectl apply -f -`, and use its token in the kubeconfig",
                config.agent_id, config.lease_namespace
            ),
        ),
        Ok(Err(e)) => Check::fail("Lease", format!("reading {at}: {e}"), fix_kubeconfig),
    });
    out.push(check_access(&client, config).await);
    out
}

/// Where an API call of the agent goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallScope {
    /// Each served namespace (`namespaces`), or all namespaces when that is empty.
    Served,
    /// The Lease namespace.
    LeaseNamespace,
    /// The agent's own Lease, by name.
    OwnLease,
    /// Each Secret of `[secrets] allowed`, by name.
    AllowedSecret,
}

/// Every kind of API request the agent makes: (group, resource, subresource, verb, where).
/// `agent/tests/rbac_real.rs` checks it against its table of the calls in the code, which it
/// greps the code for, so a new call cannot be missed here.
pub const AGENT_API_CALLS: &[(&str, &str, &str, &str, CallScope)] = &[
    ("tartan.dev", "macbuilds", "", "list", CallScope::Served),
    ("tartan.dev", "macbuilds", "", "watch", CallScope::Served),
    ("tartan.dev", "macbuilds", "", "get", CallScope::Served),
    ("tartan.dev", "macbuilds", "", "patch", CallScope::Served),
    ("tartan.dev", "macbuilds", "status", "patch", CallScope::Served),
    ("events.k8s.io", "events", "", "create", CallScope::Served),
    ("coordination.k8s.io", "leases", "", "create", CallScope::LeaseNamespace),
    ("coordination.k8s.io", "leases", "", "list", CallScope::LeaseNamespace),
    ("coordination.k8s.io", "leases", "", "watch", CallScope::LeaseNamespace),
    ("coordination.k8s.io", "leases", "", "get", CallScope::OwnLease),
    ("coordination.k8s.io", "leases", "", "patch", CallScope::OwnLease),
    ("", "secrets", "", "get", CallScope::AllowedSecret),
];

/// Each access review to ask for `config`: [`AGENT_API_CALLS`] made concrete (namespace, name).
pub fn access_reviews(config: &Config) -> Vec<ResourceAttributes> {
    let mut out = Vec::new();
    for &(group, resource, subresource, verb, scope) in AGENT_API_CALLS {
        let at = |namespace: Option<&str>, name: Option<&str>| ResourceAttributes {
            group: Some(group.to_string()),
            resource: Some(resource.to_string()),
            subresource: (!subresource.is_empty()).then(|| subresource.to_string()),
            verb: Some(verb.to_string()),
            namespace: namespace.map(str::to_string),
            name: name.map(str::to_string),
            ..Default::default()
        };
        match scope {
            CallScope::Served if config.namespaces.is_empty() => out.push(at(None, None)),
            CallScope::Served => out.extend(config.namespaces.iter().map(|ns| at(Some(ns), None))),
            CallScope::LeaseNamespace => out.push(at(Some(&config.lease_namespace), None)),
            CallScope::OwnLease => out.push(at(Some(&config.lease_namespace), Some(&lease_name(&config.agent_id)))),
            CallScope::AllowedSecret => out.extend(
                config
                    .secrets
                    .allowed
                    .iter()
                    .filter_map(|entry| crate::config::check_allowed_secret(entry).ok())
                    .map(|(ns, name)| at(Some(ns), Some(name))),
            ),
        }
    }
    out
}

/// `verb group/resource[/subresource] [name] in namespace`, as a person reads it.
fn describe_access(a: &ResourceAttributes) -> String {
    let group = a.group.as_deref().filter(|g| !g.is_empty()).unwrap_or("core");
    let mut what = format!(
        "{} {group}/{}",
        a.verb.as_deref().unwrap_or("?"),
        a.resource.as_deref().unwrap_or("?")
    );
    if let Some(sub) = &a.subresource {
        what.push_str(&format!("/{sub}"));
    }
    if let Some(name) = &a.name {
        what.push_str(&format!(" {name}"));
    }
    match &a.namespace {
        Some(ns) => what.push_str(&format!(" in {ns}")),
        None => what.push_str(" in all namespaces"),
    }
    what
}

/// Asks the API server whether the agent's account may make each of its calls
/// (`SelfSubjectAccessReview`). An API server that does not serve the review says nothing.
async fn check_access(client: &kube::Client, config: &Config) -> Check {
    let limit = config.timing.api_timeout;
    let reviews: kube::Api<SelfSubjectAccessReview> = kube::Api::all(client.clone());
    let wanted = access_reviews(config);
    let mut denied = Vec::new();
    for attributes in &wanted {
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(attributes.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        let what = describe_access(attributes);
        match tokio::time::timeout(limit, reviews.create(&kube::api::PostParams::default(), &review)).await {
            Err(_) => {
                return Check::fail(
                    "RBAC",
                    format!("asking whether it may {what}: no answer within {limit:?}"),
                    "the API server is slow or unreachable; try again",
                );
            }
            Ok(Err(kube::Error::Api(status))) if status.code == 404 => {
                return Check::skip(
                    "RBAC",
                    "the API server does not serve SelfSubjectAccessReview (authorization.k8s.io/v1)",
                );
            }
            Ok(Err(e)) => {
                return Check::fail(
                    "RBAC",
                    format!("asking whether it may {what}: {e}"),
                    "check the kubeconfig's credentials",
                );
            }
            Ok(Ok(answer)) => {
                if !answer.status.is_some_and(|s| s.allowed) {
                    denied.push(what);
                }
            }
        }
    }
    if denied.is_empty() {
        Check::pass(
            "RBAC",
            format!("all {} kinds of request the agent makes are allowed", wanted.len()),
        )
    } else {
        Check::fail(
            "RBAC",
            format!("not allowed: {}", denied.join("; ")),
            format!(
                "apply this agent's RBAC: `tartan-agent rbac --agent-id {} --namespace <ns>... --lease-namespace {} --config <this file> | kubectl apply -f -`",
                config.agent_id, config.lease_namespace
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_fails_on_any_failure_and_renders_each_check_with_its_fix() {
        let mut r = Report {
            checks: vec![
                Check::pass("tart", "tart runs, version 2.28.1"),
                Check::skip("LaunchAgents", "launchd exists only on macOS (this is linux)"),
            ],
        };
        assert!(r.ok());
        assert_eq!(
            r.render_text(),
            "✓ tart: tart runs, version 2.28.1\n- LaunchAgents: launchd exists only on macOS (this is linux)\nall checks passed\n"
        );
        r.checks
            .push(Check::fail("clock", "9.0s ahead", "turn on network time"));
        assert!(!r.ok());
        assert!(
            r.render_text()
                .ends_with("✗ clock: 9.0s ahead\n    fix: turn on network time\n1 of 3 checks failed\n"),
            "{}",
            r.render_text()
        );
        let json = r.to_json();
        assert_eq!(json["ok"], false);
        assert_eq!(json["checks"][2]["verdict"], "fail");
        assert_eq!(json["checks"][2]["fix"], "turn on network time");
        assert!(json["checks"][0].get("fix").is_none());
    }

    #[test]
    fn skew_beyond_the_limit_fails_either_way_and_a_bad_date_is_said() {
        let local: Timestamp = "2026-10-05T02:00:10Z".parse().unwrap();
        for (date, verdict, needle) in [
            ("Mon, 05 Oct 2026 02:00:10 GMT", Verdict::Pass, "0.0s"),
            ("Mon, 05 Oct 2026 02:00:06 GMT", Verdict::Pass, "4.0s"),
            ("Mon, 05 Oct 2026 02:00:15 GMT", Verdict::Pass, "-5.0s"),
            ("Mon, 05 Oct 2026 02:00:16 GMT", Verdict::Fail, "-6.0s behind"),
            ("Mon, 05 Oct 2026 01:58:10 GMT", Verdict::Fail, "120.0s ahead of"),
            ("yesterday", Verdict::Fail, "does not parse"),
        ] {
            let c = skew_verdict(date, local);
            assert_eq!(c.verdict, verdict, "{date}: {c:?}");
            assert!(c.detail.contains(needle), "{date}: {needle:?} not in {}", c.detail);
        }
    }

    #[test]
    fn softnet_needs_root_and_suid_or_sudo() {
        let bin = Path::new("/opt/homebrew/Cellar/softnet/0.10/bin/softnet");
        let no_sudo = || Err("sudo: a password is required".to_string());
        for (found, sudo, verdict, needle) in [
            (None, Ok(()), Verdict::Fail, "no softnet on PATH"),
            (
                Some((bin, 0, 0o104755)),
                Err("never asked".to_string()),
                Verdict::Pass,
                "SUID",
            ),
            (
                Some((bin, 501, 0o104755)),
                no_sudo(),
                Verdict::Fail,
                "owner uid 501, mode 4755",
            ),
            (
                Some((bin, 0, 0o100755)),
                no_sudo(),
                Verdict::Fail,
                "a password is required",
            ),
            (Some((bin, 501, 0o100755)), Ok(()), Verdict::Pass, "through sudo"),
        ] {
            let c = softnet_verdict(found, || sudo);
            assert_eq!(c.verdict, verdict, "{found:?}: {c:?}");
            assert!(c.detail.contains(needle), "{needle:?} not in {}", c.detail);
        }
    }

    #[test]
    fn access_reviews_name_each_served_namespace_the_own_lease_and_the_allowed_secrets() {
        let config = |extra: &str| {
            Config::from_toml(
                Path::new("/etc/tartan/agent.toml"),
                &format!("agent_id = \"mac-1\"\nstate_dir = \"/var/tartan\"\n{extra}"),
                "mac-1",
                None,
            )
            .unwrap()
        };
        let shown = |c: &Config| access_reviews(c).iter().map(describe_access).collect::<Vec<_>>();
        let two = config(
            "namespaces = [\"ci\", \"nightly\"]\nlease_namespace = \"tartan\"\n[secrets]\nallowed = [\"ci/signing\"]",
        );
        assert_eq!(
            shown(&two),
            [
                "list tartan.dev/macbuilds in ci",
                "list tartan.dev/macbuilds in nightly",
                "watch tartan.dev/macbuilds in ci",
                "watch tartan.dev/macbuilds in nightly",
                "get tartan.dev/macbuilds in ci",
                "get tartan.dev/macbuilds in nightly",
                "patch tartan.dev/macbuilds in ci",
                "patch tartan.dev/macbuilds in nightly",
                "patch tartan.dev/macbuilds/status in ci",
                "patch tartan.dev/macbuilds/status in nightly",
                "create events.k8s.io/events in ci",
                "create events.k8s.io/events in nightly",
                "create coordination.k8s.io/leases in tartan",
                "list coordination.k8s.io/leases in tartan",
                "watch coordination.k8s.io/leases in tartan",
                "get coordination.k8s.io/leases tartan-agent-mac-1 in tartan",
                "patch coordination.k8s.io/leases tartan-agent-mac-1 in tartan",
                "get core/secrets signing in ci",
            ]
        );
        let everywhere = shown(&config("lease_namespace = \"tartan\""));
        assert_eq!(everywhere[0], "list tartan.dev/macbuilds in all namespaces");
        assert_eq!(everywhere.len(), 11, "{everywhere:?}");
    }

    #[test]
    fn open_files_count_what_the_agent_raises_to() {
        for (soft, hard, verdict) in [
            (256, u64::MAX, Verdict::Pass),
            (256, 1024, Verdict::Pass),
            (256, 512, Verdict::Fail),
            (2048, 2048, Verdict::Pass),
            (256, 256, Verdict::Fail),
        ] {
            assert_eq!(
                open_files_verdict(soft, hard).verdict,
                verdict,
                "soft {soft} hard {hard}"
            );
        }
    }

    #[test]
    fn the_write_probe_leaves_nothing_and_names_a_folder_to_be_created() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            probe_write(dir.path()).unwrap(),
            format!("wrote and fsynced a file in {}", dir.path().display())
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let later = dir.path().join("state/journal");
        let said = probe_write(&later).unwrap();
        assert!(said.contains("does not exist yet"), "{said}");
        assert!(!dir.path().join("state").exists());
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(probe_write(&file).unwrap_err().contains("not a directory"));
    }
}
