//! A whole Tartan system for one scenario: the API, the controller, agents (each with its own
//! state dir and tart home, as separate Macs), watchdogs, and readers for every fact a scenario
//! waits on or the invariant checker needs.

use crate::bins::bin;
use crate::cluster::{Cluster, Credentials};
use crate::invariants::{self, AgentFacts, PlantedVm, World};
use crate::process::{Proc, kill_pids_with_env};
use crate::wait::{wait_for, wait_for_async};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tartan_agent::record::Record;

/// The image every build clones (tart-double synthesises it).
pub const IMAGE: &str = "ghcr.io/cirruslabs/macos-sequoia-xcode:16";

/// The `[pool]` of a host that keeps one warm VM of [`IMAGE`] (tart-double homes hold no image:
/// `prepull`).
pub const POOL_OF_ONE: &str = r#"images = [{ image = "ghcr.io/cirruslabs/macos-sequoia-xcode:16", size = 1 }]
prepull = true"#;

/// Timing of one agent; [`AgentOptions::default`] is shortened for tests,
/// [`AgentOptions::source_defaults`] is the source document's.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    pub slots: u8,
    pub lease_renew: &'static str,
    pub lease_duration: &'static str,
    pub api_timeout: &'static str,
    pub retry_min_window: &'static str,
    pub status_retry_initial: &'static str,
    pub status_retry_max: &'static str,
    /// The watchdog's `--grace`, also the agent's `watchdog_grace`.
    pub watchdog_grace: &'static str,
    /// tart-double: seconds from `run` until `exec` answers.
    pub boot_delay_secs: f64,
    /// `on_restart`: "resume" (the agent's default) or "restart".
    pub on_restart: &'static str,
    /// `timing.step_poll`.
    pub step_poll: &'static str,
    /// `timing.resume_probe`.
    pub resume_probe: &'static str,
    /// `timing.compaction_interval`.
    pub compaction_interval: &'static str,
    /// `[secrets] allowed`: names of Secrets in the stack's namespace builds may read.
    pub secrets: &'static [&'static str],
    /// `timing.claim_spread` (the agent's is 500ms; 100ms here keeps scenarios quick).
    pub claim_spread: &'static str,
    /// `timing.uncached_claim_delay`: 0s by default, as tart-double homes start without images
    /// and scenarios measure other things (the agent's is 5s).
    pub uncached_claim_delay: &'static str,
    /// `[disk] min_free_gib`: 0 (off) by default, as test machines may well have less free space
    /// than the agent's 20 GiB and tart-double's VMs take none.
    pub disk_min_free_gib: u64,
    /// The body of the `[pool]` section (TOML), empty for none (the pool off).
    pub pool: &'static str,
    /// The niceness the host's processes start with (the agent, its watchdog, and through them
    /// tart-double and the guests' shells); 0 leaves it alone. Every host of a run shares this
    /// machine's CPU with the API server and the controller, where real Macs have their own: a
    /// fleet-size run lowers the hosts' priority so the cluster side gets its share.
    pub nice: u8,
}

impl Default for AgentOptions {
    fn default() -> Self {
        AgentOptions {
            slots: 1,
            lease_renew: "1s",
            lease_duration: "4s",
            api_timeout: "900ms",
            retry_min_window: "10s",
            status_retry_initial: "200ms",
            status_retry_max: "1s",
            watchdog_grace: "3s",
            boot_delay_secs: 0.2,
            on_restart: "resume",
            step_poll: "200ms",
            resume_probe: "10s",
            compaction_interval: "10m",
            secrets: &[],
            claim_spread: "100ms",
            uncached_claim_delay: "0s",
            disk_min_free_gib: 0,
            pool: "",
            nice: 0,
        }
    }
}

impl AgentOptions {
    /// Lease 5 s / 20 s, retry window 120 s, status retries 1 s .. 30 s.
    pub fn source_defaults() -> Self {
        AgentOptions {
            lease_renew: "5s",
            lease_duration: "20s",
            api_timeout: "4s",
            retry_min_window: "120s",
            status_retry_initial: "1s",
            status_retry_max: "30s",
            watchdog_grace: "60s",
            step_poll: "1s",
            resume_probe: "30s",
            ..AgentOptions::default()
        }
    }
}

/// Flags of `tartan-controller run`; [`ControllerOptions::default`] is shortened for tests.
#[derive(Clone, Debug)]
pub struct ControllerOptions {
    pub grace: &'static str,
    pub lease_duration: &'static str,
    pub default_timeout: &'static str,
}

impl Default for ControllerOptions {
    fn default() -> Self {
        ControllerOptions {
            grace: "3s",
            lease_duration: "4s",
            default_timeout: "60m",
        }
    }
}

impl ControllerOptions {
    /// Grace 45 s, lease duration 20 s, default timeout 60 m.
    pub fn source_defaults() -> Self {
        ControllerOptions {
            grace: "45s",
            lease_duration: "20s",
            default_timeout: "60m",
        }
    }
}

/// Leader-election flags of the replicas [`Stack::start_replica`] starts; [`LeaderOptions::default`]
/// is shortened for tests.
#[derive(Clone, Debug)]
pub struct LeaderOptions {
    pub lease: Duration,
    pub renew_every: Duration,
    pub retry_every: Duration,
    pub margin: Duration,
}

impl Default for LeaderOptions {
    fn default() -> Self {
        LeaderOptions {
            lease: Duration::from_secs(4),
            renew_every: Duration::from_secs(1),
            retry_every: Duration::from_millis(500),
            margin: Duration::from_millis(1500),
        }
    }
}

impl LeaderOptions {
    /// The source's defaults: lease 15 s, renew every 5 s, poll every 2 s, margin 5 s.
    pub fn source_defaults() -> Self {
        LeaderOptions {
            lease: Duration::from_secs(15),
            renew_every: Duration::from_secs(5),
            retry_every: Duration::from_secs(2),
            margin: Duration::from_secs(5),
        }
    }

    /// The longest a standby may take to lead after the leader died: the lease duration from
    /// the last record it saw (seen at most one poll after it was written, and written before the
    /// death), then at most one poll until it looks again.
    pub fn failover_bound(&self) -> Duration {
        self.lease + 2 * self.retry_every
    }
}

/// The leader Lease of the replicas (`--leader-lease-name` default).
pub const LEADER_LEASE: &str = "tartan-controller";

/// How an agent dies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KillMode {
    /// `kill -9` of its process group: its tart children die too (launchd without
    /// `AbandonProcessGroup`).
    Group,
    /// `kill -9` of the agent alone: `tart run`/`exec` survive (an agent started with `nohup`).
    Alone,
    /// `kill -9` of its process group and of every tart process of its host: the VMs die with the
    /// agent (a `tart run` in its own session under `on_restart = "resume"` too), as when the Mac
    /// itself went down.
    GroupAndVms,
}

pub struct Agent {
    pub id: String,
    pub opts: AgentOptions,
    pub state_dir: PathBuf,
    pub tart_home: PathBuf,
    pub config: PathBuf,
    proc: Option<Proc>,
    watchdog: Option<Proc>,
    /// Killed processes, kept so their surviving group members die with the stack.
    dead: Vec<Proc>,
    starts: u32,
    /// Every journal record ever seen, by sequence number (see [`Stack::journal`]).
    history: JournalHistory,
    /// The `tartan-agent` program to start; `None` = the workspace's build.
    binary: Option<PathBuf>,
    /// Extra environment of its next starts (see [`Stack::set_agent_env`]).
    env: BTreeMap<String, String>,
}

/// The whole history of one agent's journal. A (re)started agent compacts finished builds away,
/// so reading the journal at the end sees too little: a thread follows it with the agent's own
/// [`tartan_agent::journal::Tail`] (which reads a compacted-away file to its end), and every read
/// of the files on disk is merged in too (sequence numbers are never reused, compaction keeps them).
struct JournalHistory {
    records: std::sync::Arc<std::sync::Mutex<BTreeMap<u64, Record>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl JournalHistory {
    fn follow(state_dir: &Path) -> JournalHistory {
        use std::sync::atomic::Ordering;
        let records = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::new()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let (records, stop) = (records.clone(), stop.clone());
            let mut tail = tartan_agent::journal::Tail::new(state_dir);
            let dir = state_dir.to_path_buf();
            std::thread::spawn(move || {
                let mut warned = false;
                loop {
                    let last_round = stop.load(Ordering::SeqCst);
                    match tail.poll() {
                        Ok(new) => {
                            let mut all = records.lock().expect("history lock");
                            for r in new {
                                all.insert(r.seq, r);
                            }
                        }
                        // Reads of the files at each start and each query still merge in.
                        Err(e) if !warned => {
                            warned = true;
                            eprintln!(
                                "[e2e] following the journal in {} failed: {e}; it is polled again",
                                dir.display()
                            );
                        }
                        Err(_) => {}
                    }
                    if last_round {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        JournalHistory {
            records,
            stop,
            thread: Some(thread),
        }
    }

    fn merge(&self, records: Vec<Record>) -> Vec<Record> {
        let mut all = self.records.lock().expect("history lock");
        for r in records {
            all.insert(r.seq, r);
        }
        all.values().cloned().collect()
    }
}

impl Drop for JournalHistory {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub struct Stack {
    pub name: String,
    pub ns: String,
    pub dir: PathBuf,
    tempdir: Option<tempfile::TempDir>,
    pub cluster: Cluster,
    /// The harness's client (admin).
    pub client: kube::Client,
    /// The kubeconfigs the controller and the agents run with.
    credentials: Credentials,
    controller: Option<Proc>,
    controller_opts: ControllerOptions,
    controller_starts: u32,
    /// Controller replicas under leader election, by identity ([`Stack::start_replica`]).
    replicas: BTreeMap<String, Proc>,
    agents: BTreeMap<String, Agent>,
    planted: Vec<(String, String)>,
    dead: Vec<Proc>,
    /// Whether [`Stack::deny_terminal_status`] is in force (told to the invariant checker).
    refusing_terminal_status: bool,
}

fn customruns_resource() -> ApiResource {
    ApiResource {
        group: "tekton.dev".into(),
        version: "v1beta1".into(),
        api_version: "tekton.dev/v1beta1".into(),
        kind: "CustomRun".into(),
        plural: "customruns".into(),
    }
}

fn macbuilds_resource() -> ApiResource {
    ApiResource {
        group: "tartan.dev".into(),
        version: "v1alpha1".into(),
        api_version: "tartan.dev/v1alpha1".into(),
        kind: "MacBuild".into(),
        plural: "macbuilds".into(),
    }
}

impl Stack {
    /// A fresh API (emulator or `$KUBECONFIG`'s cluster) and namespace (with `deploy/rbac.yaml` in
    /// it on a real cluster); nothing else runs yet.
    pub async fn new(name: &str) -> Stack {
        let tempdir = tempfile::Builder::new()
            .prefix(&format!("tartan-e2e-{name}-"))
            .tempdir()
            .expect("temp dir");
        let dir = tempdir.path().to_path_buf();
        let cluster = Cluster::start(&dir).await;
        let client = cluster.client().await;
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..6];
        let ns = format!("e2e-{}-{suffix}", name.replace('_', "-"))
            .chars()
            .take(63)
            .collect::<String>();
        let credentials = cluster.prepare_namespace(&client, &ns).await;
        eprintln!(
            "[e2e] {name}: dir {} namespace {ns} on the {}",
            dir.display(),
            cluster.backend()
        );
        Stack {
            name: name.into(),
            ns,
            dir,
            tempdir: Some(tempdir),
            cluster,
            client,
            credentials,
            controller: None,
            controller_opts: ControllerOptions::default(),
            controller_starts: 0,
            replicas: BTreeMap::new(),
            agents: BTreeMap::new(),
            planted: vec![],
            dead: vec![],
            refusing_terminal_status: false,
        }
    }

    // ---- cluster faults ----

    /// Makes the cluster refuse terminal `macbuilds/status` writes (see
    /// [`Cluster::deny_terminal_status`]) and tells the invariant checker, so that a result
    /// refused past the deadline is the exception of invariant 6, not a violation.
    pub async fn deny_terminal_status(&mut self) {
        self.cluster.deny_terminal_status(&self.ns).await;
        self.refusing_terminal_status = true;
    }

    /// Lifts [`Stack::deny_terminal_status`].
    pub async fn allow_terminal_status(&mut self) {
        self.cluster.allow_terminal_status(&self.ns).await;
        self.refusing_terminal_status = false;
    }

    /// Every API request fails until [`Stack::api_up`] (see [`Cluster::api_down`]).
    pub async fn api_down(&mut self) {
        self.cluster.api_down();
    }

    pub async fn api_up(&mut self) {
        self.cluster.api_up();
    }

    /// The agents cannot reach the API (their requests and watches get no answer) while the
    /// controller and the harness can, until [`Stack::heal_partition`]. Emulator only.
    pub fn partition_agents(&self) {
        self.cluster
            .partition(&self.ns, Some(crate::cluster::AGENT_SERVICE_ACCOUNT));
        eprintln!("[e2e] the agents are partitioned from the API");
    }

    /// Ends [`Stack::partition_agents`].
    pub fn heal_partition(&self) {
        self.cluster.partition(&self.ns, None);
        eprintln!("[e2e] the partition is healed");
    }

    // ---- controller ----

    pub fn start_controller(&mut self, opts: ControllerOptions) {
        assert!(self.controller.is_none(), "controller already running");
        self.controller_opts = opts.clone();
        self.controller_starts += 1;
        let cmd = self.controller_command(&opts, "e2e-controller");
        let log = self.dir.join(format!("controller-{}.log", self.controller_starts));
        self.controller = Some(Proc::spawn("tartan-controller", cmd, &log));
    }

    /// `kill -9` of the controller (a force-deleted pod).
    pub fn kill_controller(&mut self) {
        let mut p = self.controller.take().expect("controller running");
        p.kill9_group();
        self.dead.push(p);
    }

    pub fn restart_controller(&mut self) {
        self.start_controller(self.controller_opts.clone());
    }

    /// The `tartan-controller run` command of [`Stack::start_controller`].
    fn controller_command(&self, opts: &ControllerOptions, instance: &str) -> Command {
        let mut cmd = Command::new(bin("tartan-controller"));
        cmd.arg("run")
            .arg("--kubeconfig")
            .arg(&self.credentials.controller)
            .args(["-n", &self.ns, "--agent-lease-namespace", &self.ns])
            .args(["--grace", opts.grace, "--lease-duration", opts.lease_duration])
            .args(["--default-timeout", opts.default_timeout])
            .args(["--metrics-address", "127.0.0.1:0", "--instance", instance])
            .env("RUST_LOG", "info");
        cmd
    }

    /// Starts controller replica `id` with `--leader-elect` (identity `id`, leader Lease in the
    /// stack's namespace): one of several, as in a two-replica Deployment.
    pub fn start_replica(&mut self, id: &str, opts: ControllerOptions, leader: &LeaderOptions) {
        assert!(!self.replicas.contains_key(id), "replica {id} already running");
        self.controller_starts += 1;
        let mut cmd = self.controller_command(&opts, id);
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        cmd.args([
            "--leader-elect",
            "--leader-lease-namespace",
            &self.ns,
            "--leader-identity",
            id,
        ])
        .args([
            "--leader-lease",
            &ms(leader.lease),
            "--leader-renew-every",
            &ms(leader.renew_every),
        ])
        .args([
            "--leader-retry-every",
            &ms(leader.retry_every),
            "--leader-margin",
            &ms(leader.margin),
        ]);
        let log = self.dir.join(format!("controller-{id}-{}.log", self.controller_starts));
        self.replicas.insert(
            id.to_string(),
            Proc::spawn(&format!("tartan-controller {id}"), cmd, &log),
        );
    }

    fn replica(&self, id: &str) -> &Proc {
        self.replicas
            .get(id)
            .unwrap_or_else(|| panic!("no controller replica {id} running"))
    }

    /// `kill -9` of replica `id` (a node lost with its pod).
    pub fn kill_replica(&mut self, id: &str) {
        let mut p = self.replicas.remove(id).expect("replica running");
        p.kill9_group();
        eprintln!("[e2e] kill -9 controller replica {id}");
        self.dead.push(p);
    }

    /// Whether replica `id` was started and not killed, stopped or forgotten since.
    pub fn replica_started(&self, id: &str) -> bool {
        self.replicas.contains_key(id)
    }

    /// How replica `id`'s process ended, if it has (it may exit on its own).
    pub fn replica_exit_status(&mut self, id: &str) -> Option<std::process::ExitStatus> {
        self.replicas.get_mut(id).and_then(|p| p.exit_status())
    }

    /// Moves replica `id`, which exited on its own, to the dead (so it can be started again).
    pub fn forget_exited_replica(&mut self, id: &str) {
        if let Some(p) = self.replicas.remove(id) {
            self.dead.push(p);
        }
    }

    /// SIGSTOP of replica `id` (a frozen node, a long GC pause, a paused VM).
    pub fn freeze_replica(&self, id: &str) {
        self.replica(id).signal(Signal::SIGSTOP);
        eprintln!("[e2e] SIGSTOP controller replica {id}");
    }

    pub fn thaw_replica(&self, id: &str) {
        self.replica(id).signal(Signal::SIGCONT);
        eprintln!("[e2e] SIGCONT controller replica {id}");
    }

    /// SIGTERM of replica `id` (a rollout or drain deleting its pod); waits for it to exit.
    pub fn terminate_replica(&mut self, id: &str) {
        let mut p = self.replicas.remove(id).expect("replica running");
        eprintln!("[e2e] SIGTERM controller replica {id}");
        p.terminate(Duration::from_secs(10));
        self.dead.push(p);
    }

    /// `GET path` on replica `id`'s /metrics, /healthz, /readyz server: status and body.
    pub fn replica_http(&self, id: &str, path: &str) -> (u16, String) {
        let log = std::fs::read_to_string(self.replica(id).log()).unwrap_or_default();
        served_get(&log, &format!("replica {id}"), path)
    }

    /// `GET path` on agent `id`'s /metrics, /healthz server (its current run).
    pub fn agent_http(&self, id: &str, path: &str) -> (u16, String) {
        served_get(&self.agent_log(id), &format!("agent {id}"), path)
    }

    /// The log of replica `id` (running or killed) so far.
    pub fn replica_log(&self, id: &str) -> String {
        let name = format!("tartan-controller {id}");
        self.replicas
            .values()
            .chain(self.dead.iter())
            .filter(|p| p.name() == name)
            .map(|p| std::fs::read_to_string(p.log()).unwrap_or_default())
            .collect()
    }

    /// The controllers' leader Lease, if it exists; an error when the API did not answer within
    /// 10 s (a chaos run reads it while the API may be down, and the client retries a 503 for
    /// minutes).
    pub async fn leader_lease(&self) -> Result<Option<Lease>, String> {
        const LIMIT: Duration = Duration::from_secs(10);
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        let failed = |e: String| format!("reading the leader Lease {}/{LEADER_LEASE} failed: {e}", self.ns);
        match tokio::time::timeout(LIMIT, api.get_opt(LEADER_LEASE)).await {
            Ok(read) => read.map_err(|e| failed(e.to_string())),
            Err(_) => Err(failed(format!("no answer within {LIMIT:?}"))),
        }
    }

    /// Waits until the leader Lease names `id`; returns the Lease.
    pub async fn wait_leader(&self, id: &str, limit: Duration) -> Lease {
        crate::wait_for_async(
            &format!("controller replica {id} to hold the leader Lease"),
            limit,
            || async {
                let lease = self.leader_lease().await?;
                let holder = lease
                    .as_ref()
                    .and_then(|l| l.spec.as_ref())
                    .and_then(|s| s.holder_identity.clone());
                match (lease, holder) {
                    (Some(l), Some(h)) if h == id => Ok(l),
                    (_, h) => Err(format!("held by {h:?}")),
                }
            },
        )
        .await
    }

    /// The API requests the emulator saw (`METHOD /path?query ua=USER-AGENT`); `None` on a real cluster.
    pub fn api_requests(&self) -> Option<Vec<String>> {
        self.cluster.api_requests()
    }

    // ---- agents ----

    /// Registers an agent (its state dir, tart home and config file); [`Stack::start_agent`] runs it.
    pub fn add_agent(&mut self, id: &str, opts: AgentOptions) -> &Agent {
        let root = self.dir.join(id);
        let state_dir = root.join("state");
        let tart_home = root.join("tart");
        std::fs::create_dir_all(&state_dir).unwrap();
        std::fs::create_dir_all(tart_home.join("vms")).unwrap();
        let config = root.join("agent.toml");
        let toml = format!(
            r#"# generated by tartan-e2e for scenario {scenario}
agent_id = "{id}"
state_dir = "{state}"
kubeconfig = "{kubeconfig}"
namespaces = ["{ns}"]
lease_namespace = "{ns}"
slots = {slots}
tart = "{tart}"
tart_home = "{home}"
metrics_address = "127.0.0.1:0"
on_restart = "{on_restart}"

[artifacts]
destination = "file://{artifacts}/"

[disk]
min_free_gib = {min_free_gib}

[timing]
lease_renew = "{renew}"
lease_duration = "{duration}"
api_timeout = "{api}"
retry_min_window = "{window}"
status_retry_initial = "{sri}"
status_retry_max = "{srm}"
watchdog_grace = "{wg}"
step_poll = "{step_poll}"
resume_probe = "{resume_probe}"
compaction_interval = "{compaction_interval}"
claim_spread = "{claim_spread}"
uncached_claim_delay = "{uncached_claim_delay}"

[secrets]
allowed = [{secrets}]

[pool]
{pool}
"#,
            scenario = self.name,
            state = state_dir.display(),
            kubeconfig = self.credentials.agent.display(),
            ns = self.ns,
            slots = opts.slots,
            tart = bin("tart-double").display(),
            home = tart_home.display(),
            artifacts = self.artifacts_dir().display(),
            renew = opts.lease_renew,
            duration = opts.lease_duration,
            api = opts.api_timeout,
            window = opts.retry_min_window,
            sri = opts.status_retry_initial,
            srm = opts.status_retry_max,
            wg = opts.watchdog_grace,
            on_restart = opts.on_restart,
            step_poll = opts.step_poll,
            resume_probe = opts.resume_probe,
            compaction_interval = opts.compaction_interval,
            secrets = opts
                .secrets
                .iter()
                .map(|n| format!("\"{}/{n}\"", self.ns))
                .collect::<Vec<_>>()
                .join(", "),
            claim_spread = opts.claim_spread,
            uncached_claim_delay = opts.uncached_claim_delay,
            min_free_gib = opts.disk_min_free_gib,
            pool = opts.pool,
        );
        std::fs::write(&config, toml).unwrap();
        let state_dir_for_history = state_dir.clone();
        self.agents.insert(
            id.to_string(),
            Agent {
                id: id.into(),
                opts,
                state_dir,
                tart_home,
                config,
                proc: None,
                watchdog: None,
                dead: vec![],
                starts: 0,
                history: JournalHistory::follow(&state_dir_for_history),
                binary: None,
                env: BTreeMap::new(),
            },
        );
        &self.agents[id]
    }

    /// The log of agent `id`'s current (or last) run.
    pub fn agent_log(&self, id: &str) -> String {
        let a = self.agent(id);
        let log = a.state_dir.parent().unwrap().join(format!("agent-{}.log", a.starts));
        std::fs::read_to_string(log).unwrap_or_default()
    }

    pub fn agent(&self, id: &str) -> &Agent {
        self.agents.get(id).unwrap_or_else(|| panic!("no agent {id}"))
    }

    fn agent_mut(&mut self, id: &str) -> &mut Agent {
        self.agents.get_mut(id).unwrap_or_else(|| panic!("no agent {id}"))
    }

    /// Where `file://` artifacts land.
    pub fn artifacts_dir(&self) -> PathBuf {
        self.dir.join("artifacts")
    }

    /// Starts (or restarts) `tartan-agent run --config` and waits until it renews its Lease.
    pub async fn start_agent(&mut self, id: &str) {
        let started = k8s_openapi::jiff::Timestamp::now();
        self.spawn_agent(id);
        self.wait_lease_renewed(id, started).await;
    }

    /// Starts (or restarts) `tartan-agent run --config` without waiting for anything (the API
    /// may be down: the chaos runner restarts agents in the middle of outages).
    pub fn spawn_agent(&mut self, id: &str) {
        // The agent compacts finished builds away as it starts: keep what the files hold now.
        self.journal(id);
        let a = self.agent_mut(id);
        assert!(a.proc.is_none(), "agent {id} already running");
        a.starts += 1;
        let mut cmd = host_command(a.binary.clone().unwrap_or_else(|| bin("tartan-agent")), a.opts.nice);
        cmd.arg("run")
            .arg("--config")
            .arg(&a.config)
            .env("TART_HOME", &a.tart_home)
            .env("TART_DOUBLE_BOOT_DELAY_SECS", a.opts.boot_delay_secs.to_string())
            .env("RUST_LOG", "info")
            .envs(&a.env);
        let log = a.state_dir.parent().unwrap().join(format!("agent-{}.log", a.starts));
        a.proc = Some(Proc::spawn(&format!("tartan-agent {id}"), cmd, &log));
    }

    /// Waits until agent `id` renews its Lease at or after `started`.
    pub async fn wait_lease_renewed(&self, id: &str, started: k8s_openapi::jiff::Timestamp) {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        let name = format!("tartan-agent-{id}");
        let limit = Duration::from_secs(30);
        wait_for_async(&format!("agent {id} to renew its Lease {name}"), limit, || {
            let leases = leases.clone();
            let name = name.clone();
            let alive = self
                .agents
                .get(id)
                .and_then(|a| a.proc.as_ref())
                .map(|p| p.log().to_path_buf());
            async move {
                let lease = leases.get_opt(&name).await.map_err(|e| e.to_string())?;
                let renewed = lease
                    .as_ref()
                    .and_then(|l| l.spec.as_ref())
                    .and_then(|s| s.renew_time.as_ref())
                    .map(|t| t.0);
                match renewed {
                    // API stamps may have whole seconds.
                    Some(t) if t.as_second() >= started.as_second() => Ok(()),
                    other => Err(format!(
                        "lease renewTime {other:?}; agent log tail:\n{}",
                        alive.map(|l| crate::process::tail(&l, 15)).unwrap_or_default()
                    )),
                }
            }
        })
        .await;
    }

    /// Kills the agent (see [`KillMode`]) and waits until it is reaped.
    pub fn kill_agent(&mut self, id: &str, mode: KillMode) {
        let a = self.agent_mut(id);
        let mut p = a.proc.take().unwrap_or_else(|| panic!("agent {id} not running"));
        match mode {
            KillMode::Group | KillMode::GroupAndVms => p.kill9_group(),
            KillMode::Alone => p.kill9_alone(),
        }
        eprintln!("[e2e] kill -9 agent {id} pid {} ({mode:?})", p.pid());
        a.dead.push(p);
        if mode == KillMode::GroupAndVms {
            for pid in self.tart_pids(id) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            }
            let started = std::time::Instant::now();
            while !self.tart_pids(id).is_empty() {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "the tart processes of {id} survived SIGKILL for 10 s: {:?}",
                    self.tart_pids(id)
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// launchd's stop (`bootout`, an upgrade): SIGTERM to the agent, then, once it exits, SIGKILL
    /// to what is left of its process group (launchd without `AbandonProcessGroup`). Returns how
    /// long the agent took to exit; panics if it did not within `exit_time_out` (launchd's
    /// `ExitTimeOut`, after which it would SIGKILL the agent).
    pub fn stop_agent(&mut self, id: &str, exit_time_out: Duration) -> Duration {
        let a = self.agent_mut(id);
        let mut p = a.proc.take().unwrap_or_else(|| panic!("agent {id} not running"));
        let started = std::time::Instant::now();
        // A frozen agent would only see the SIGTERM once continued.
        p.signal(Signal::SIGCONT);
        p.signal(Signal::SIGTERM);
        while p.alive() {
            assert!(
                started.elapsed() < exit_time_out,
                "agent {id} did not exit within ExitTimeOut {exit_time_out:?} of SIGTERM; log tail:\n{}",
                p.log_tail(20)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let took = started.elapsed();
        eprintln!("[e2e] SIGTERM agent {id} pid {}: exited after {took:?}", p.pid());
        p.kill9_group();
        a.dead.push(p);
        took
    }

    /// The program the next start of agent `id` runs (an upgrade: a different binary).
    pub fn set_agent_binary(&mut self, id: &str, binary: &Path) {
        self.agent_mut(id).binary = Some(binary.to_path_buf());
    }

    /// Sets (`Some`) or unsets (`None`) variable `key` for the next starts of agent `id` (the crash
    /// sweep's `TARTAN_CRASH_AT`).
    pub fn set_agent_env(&mut self, id: &str, key: &str, value: Option<&str>) {
        let env = &mut self.agent_mut(id).env;
        match value {
            Some(v) => env.insert(key.to_string(), v.to_string()),
            None => env.remove(key),
        };
    }

    /// The path of agent `id`'s log of its current (or last) run.
    pub fn agent_log_path(&self, id: &str) -> PathBuf {
        let a = self.agent(id);
        a.state_dir.parent().unwrap().join(format!("agent-{}.log", a.starts))
    }

    /// SIGSTOP: the agent freezes (and keeps its lock); its tart children go on.
    pub fn freeze_agent(&mut self, id: &str) {
        let p = self.agent(id).proc.as_ref().expect("agent running");
        p.signal(Signal::SIGSTOP);
        eprintln!("[e2e] SIGSTOP agent {id} pid {}", p.pid());
    }

    pub fn thaw_agent(&mut self, id: &str) {
        let p = self.agent(id).proc.as_ref().expect("agent running");
        p.signal(Signal::SIGCONT);
        eprintln!("[e2e] SIGCONT agent {id} pid {}", p.pid());
    }

    /// The pid of agent `id`'s current process, if it runs.
    pub fn agent_pid(&self, id: &str) -> Option<u32> {
        self.agent(id).proc.as_ref().map(|p| p.pid())
    }

    /// The ids of the registered agents.
    pub fn agent_ids(&self) -> Vec<String> {
        self.agents.keys().cloned().collect()
    }

    /// Whether the agent was started and not killed by the harness (it may have exited).
    pub fn agent_started(&self, id: &str) -> bool {
        self.agent(id).proc.is_some()
    }

    /// How the agent's process ended, if it has (it may exit on its own).
    pub fn agent_exit_status(&mut self, id: &str) -> Option<std::process::ExitStatus> {
        self.agent_mut(id).proc.as_mut().and_then(|p| p.exit_status())
    }

    /// Whether the controller was started and not killed by the harness.
    pub fn controller_started(&self) -> bool {
        self.controller.is_some()
    }

    /// How the controller's process ended, if it has (it may exit on its own).
    pub fn controller_exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.controller.as_mut().and_then(|p| p.exit_status())
    }

    /// Whether agent `id`'s watchdog process is running.
    pub fn watchdog_alive(&mut self, id: &str) -> bool {
        self.agent_mut(id).watchdog.as_mut().is_some_and(|p| p.alive())
    }

    /// The logs of every process the stack started for agent `id` (agent runs and watchdogs).
    pub fn agent_logs(&self, id: &str) -> Vec<PathBuf> {
        let a = self.agent(id);
        a.proc
            .iter()
            .chain(a.watchdog.iter())
            .chain(a.dead.iter())
            .map(|p| p.log().to_path_buf())
            .collect()
    }

    /// Moves an agent process that exited on its own among the dead, so it can be started again.
    pub fn forget_exited_agent(&mut self, id: &str) {
        let a = self.agent_mut(id);
        if let Some(p) = a.proc.take() {
            a.dead.push(p);
        }
    }

    /// Moves a watchdog that exited on its own among the dead, so it can be started again.
    pub fn forget_exited_watchdog(&mut self, id: &str) {
        let a = self.agent_mut(id);
        if let Some(p) = a.watchdog.take() {
            a.dead.push(p);
        }
    }

    /// Moves a controller that exited on its own among the dead, so it can be started again.
    pub fn forget_exited_controller(&mut self) {
        if let Some(p) = self.controller.take() {
            self.dead.push(p);
        }
    }

    /// Keeps the stack's directory when it is dropped (the chaos runner keeps it on failure).
    pub fn keep_files(&mut self) -> PathBuf {
        if let Some(t) = self.tempdir.take() {
            let _ = t.keep();
        }
        self.dir.clone()
    }

    pub fn agent_alive(&mut self, id: &str) -> bool {
        self.agent_mut(id).proc.as_mut().is_some_and(|p| p.alive())
    }

    /// Starts `tartan-agent watchdog` on the agent's state dir and tart home, with the grace the
    /// agent was configured with.
    pub fn start_watchdog(&mut self, id: &str) {
        let a = self.agent_mut(id);
        let grace = a.opts.watchdog_grace;
        assert!(a.watchdog.is_none(), "watchdog of {id} already running");
        let mut cmd = host_command(bin("tartan-agent"), a.opts.nice);
        cmd.arg("watchdog")
            .arg("--state-dir")
            .arg(&a.state_dir)
            .args(["--grace", grace])
            .arg("--tart")
            .arg(bin("tart-double"))
            .args(["--retry-base", "500ms", "--retry-cap", "2s"])
            .env("TART_HOME", &a.tart_home)
            .env("RUST_LOG", "info");
        let n = a.dead.len() + 1;
        let log = a.state_dir.parent().unwrap().join(format!("watchdog-{n}.log"));
        a.watchdog = Some(Proc::spawn(&format!("watchdog {id}"), cmd, &log));
    }

    pub fn kill_watchdog(&mut self, id: &str) {
        let a = self.agent_mut(id);
        let mut p = a.watchdog.take().expect("watchdog running");
        p.kill9_group();
        a.dead.push(p);
    }

    // ---- the whole host ----

    /// Pids of every live process of agent `id`'s Mac: the agent, its watchdog, the tart-double
    /// processes and the guest processes of its VMs (all of them carry the host's TART_HOME).
    pub fn host_pids(&self, id: &str) -> Vec<i32> {
        crate::process::pids_with_env("TART_HOME", &self.agent(id).tart_home.to_string_lossy())
    }

    /// A reboot of agent `id`'s Mac: the agent and its group, the watchdog, every tart process
    /// (`tart run` too) and every guest process SIGKILLed; the VM folders, deadline files and the
    /// journal stay on disk. Waits until nothing of the host is left.
    pub fn reboot_host(&mut self, id: &str) {
        self.kill_agent(id, KillMode::GroupAndVms);
        if self.agent(id).watchdog.is_some() {
            self.kill_watchdog(id);
        }
        let started = std::time::Instant::now();
        loop {
            let left = self.host_pids(id);
            if left.is_empty() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "processes of {id}'s host survived SIGKILL for 10 s: {left:?}"
            );
            for pid in left {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!(
            "[e2e] host {id} rebooted: every process killed, VMs left: {:?}",
            self.vms(id)
        );
    }

    /// The Mac of agent `id` goes to sleep: SIGSTOP to every process of the host ([`Stack::host_pids`]),
    /// scanning again until no new one appears (a process may fork between scans), then waiting
    /// until none can run ([`crate::process::is_asleep`]: a `vfork` parent whose child was stopped
    /// before its exec never reaches `T`). Returns the pids, for [`Stack::wake_host`].
    pub fn sleep_host(&mut self, id: &str) -> Vec<i32> {
        let mut stopped: Vec<i32> = vec![];
        loop {
            let fresh: Vec<i32> = self
                .host_pids(id)
                .into_iter()
                .filter(|p| !stopped.contains(p))
                .collect();
            if fresh.is_empty() {
                break;
            }
            for pid in fresh {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGSTOP);
                stopped.push(pid);
            }
        }
        let started = std::time::Instant::now();
        loop {
            let running: Vec<i32> = stopped
                .iter()
                .copied()
                .filter(|p| !crate::process::is_asleep(*p))
                .collect();
            if running.is_empty() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "processes of {id}'s host still run 10 s after SIGSTOP: {running:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!(
            "[e2e] host {id} asleep: SIGSTOP to {} process(es) {stopped:?}",
            stopped.len()
        );
        stopped
    }

    /// The Mac wakes: SIGCONT to the processes [`Stack::sleep_host`] stopped.
    pub fn wake_host(&mut self, id: &str, pids: &[i32]) {
        for pid in pids {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), Signal::SIGCONT);
        }
        eprintln!("[e2e] host {id} awake: SIGCONT to {} process(es)", pids.len());
    }

    // ---- tart ----

    /// Runs tart-double with the agent's TART_HOME.
    pub fn tart(&self, id: &str, args: &[&str]) -> std::process::Output {
        Command::new(bin("tart-double"))
            .args(args)
            .env("TART_HOME", &self.agent(id).tart_home)
            .output()
            .expect("tart-double runs")
    }

    /// VM names in the agent's tart home (`vms/`).
    pub fn vms(&self, id: &str) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.agent(id).tart_home.join("vms"))
            .map(|d| d.flatten().filter_map(|e| e.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        names.sort();
        names
    }

    /// `tart list --format json`, parsed.
    pub fn tart_list(&self, id: &str) -> Value {
        let out = self.tart(id, &["list", "--format", "json"]);
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }

    /// Clones a VM behind Tartan's back. Names without `mb-` must survive everything (invariant 7).
    pub fn plant_vm(&mut self, id: &str, vm: &str) {
        let out = self.tart(id, &["clone", IMAGE, vm]);
        assert!(
            out.status.success(),
            "planting {vm}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.planted.push((id.into(), vm.into()));
    }

    /// Deletes a VM as an operator would.
    pub fn operator_delete_vm(&self, id: &str, vm: &str) {
        let out = self.tart(id, &["delete", vm]);
        assert!(
            out.status.success(),
            "deleting {vm}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Writes tart-double's fault file (`{"global": {...}, "vms": {...}}`).
    pub fn tart_faults(&self, id: &str, faults: Value) {
        let home = &self.agent(id).tart_home;
        let tmp = home.join(".faults.tmp");
        std::fs::write(&tmp, faults.to_string()).unwrap();
        std::fs::rename(&tmp, home.join("double-faults.json")).unwrap();
    }

    /// Pids of tart-double processes (run/exec) of this agent's tart home.
    pub fn tart_pids(&self, id: &str) -> Vec<i32> {
        crate::process::pids_with_env("TART_HOME", &self.agent(id).tart_home.to_string_lossy())
            .into_iter()
            .filter(|pid| {
                std::fs::read_link(format!("/proc/{pid}/exe"))
                    .is_ok_and(|p| p.file_name().is_some_and(|n| n == "tart-double"))
            })
            .collect()
    }

    /// The argv of each tart-double process of this agent's tart home (e.g. to see a `delete`
    /// in flight), by pid.
    pub fn tart_commands(&self, id: &str) -> Vec<(i32, Vec<String>)> {
        self.tart_pids(id)
            .into_iter()
            .filter_map(|pid| {
                let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                let argv = raw
                    .split(|b| *b == 0)
                    .filter(|a| !a.is_empty())
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                Some((pid, argv))
            })
            .collect()
    }

    // ---- journal and watchdog record ----

    /// Every record agent `id` ever journaled in this stack, in sequence order, including those a
    /// restart compacted away (see [`JournalHistory`]).
    pub fn journal(&self, id: &str) -> Vec<Record> {
        let a = self.agent(id);
        a.history.merge(self.journal_on_disk(id))
    }

    /// The records agent `id`'s journal files hold now (after compactions).
    pub fn journal_on_disk(&self, id: &str) -> Vec<Record> {
        // A compaction running meanwhile removes files between the listing and their reading:
        // read again (a few times, a moment apart) before calling the journal unreadable.
        let mut tries = 0;
        loop {
            match tartan_agent::journal::read_records(&self.agent(id).state_dir) {
                Ok(replay) => return replay.records,
                Err(_) if !self.agent(id).state_dir.join("journal").exists() => return vec![],
                Err(e) if tries >= 20 => panic!("cannot read the journal of {id} ({tries} tries): {e}"),
                Err(_) => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    pub fn journal_text(&self, id: &str) -> String {
        self.journal(id).iter().map(|r| format!("{r}\n")).collect()
    }

    /// Waits until a journal record of agent `id` matches `pred`; returns it.
    pub async fn wait_journal(&self, id: &str, what: &str, limit: Duration, pred: impl Fn(&Record) -> bool) -> Record {
        wait_for(&format!("{id}'s journal: {what}"), limit, || {
            let records = self.journal(id);
            records.iter().find(|r| pred(r)).cloned().ok_or_else(|| {
                let tail: Vec<String> = records.iter().rev().take(8).rev().map(|r| r.to_string()).collect();
                format!("journal ends:\n{}", tail.join("\n"))
            })
        })
        .await
    }

    pub fn watchdog_lines(&self, id: &str) -> Vec<tartan_watchdog::Line> {
        tartan_watchdog::read_lines(&self.agent(id).state_dir.join(tartan_watchdog::RECORD_FILE)).unwrap_or_default()
    }

    /// The raw text of `watchdog.jsonl`.
    pub fn watchdog_text(&self, id: &str) -> String {
        std::fs::read_to_string(self.agent(id).state_dir.join(tartan_watchdog::RECORD_FILE)).unwrap_or_default()
    }

    // ---- cluster ----

    pub fn customruns(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.ns, &customruns_resource())
    }

    pub fn macbuilds(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.ns, &macbuilds_resource())
    }

    /// The params of a build that passes 2/2 tests and publishes `out/App.ipa`. With `gate`, its
    /// first step waits until [`Stack::open_gate`] (so a test can act mid-build).
    pub fn build_params(&self, gate: bool) -> Vec<(&'static str, Value)> {
        let dir = self.dir.display();
        let mut steps = vec![format!("echo \"$PWD\" >> {dir}/started")];
        if gate {
            steps.push(format!("while [ ! -e {dir}/gate ]; do sleep 0.1; done"));
        }
        steps.push(
            "mkdir -p out && printf '<testsuite name=\"App\" tests=\"2\" failures=\"0\"><testcase name=\"a\"/><testcase name=\"b\"/></testsuite>' > out/junit.xml && echo app > out/App.ipa".into(),
        );
        vec![
            ("image", json!(IMAGE)),
            ("steps", json!(steps)),
            ("test-report", json!("out/junit.xml")),
            ("artifact-paths", json!(["out/App.ipa"])),
            (
                "artifact-destination",
                json!(format!("file://{}/", self.artifacts_dir().display())),
            ),
        ]
    }

    /// `kubectl-tartan ARGS` as a user of this scenario's namespace runs it (the harness's
    /// kubeconfig, `-n <namespace>`).
    pub fn kubectl_tartan(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin("kubectl-tartan"));
        cmd.arg("--kubeconfig")
            .arg(self.cluster.kubeconfig())
            .args(["-n", &self.ns])
            .args(args)
            .env_remove("KUBECONFIG");
        cmd
    }

    /// As an operator: creates Secret `name` with `data` in the stack's namespace (as the admin)
    /// and, when `grant`, lets the agents get it (a Role with `resourceNames` on a real cluster).
    pub async fn create_secret(&self, name: &str, data: &[(&str, &[u8])], grant: bool) {
        use base64::Engine as _;
        let data: serde_json::Map<String, Value> = data
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    json!(base64::engine::general_purpose::STANDARD.encode(v)),
                )
            })
            .collect();
        let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": self.ns}, "data": data});
        let api: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(self.client.clone(), &self.ns);
        api.create(&PostParams::default(), &serde_json::from_value(secret).unwrap())
            .await
            .unwrap_or_else(|e| panic!("creating Secret {name}: {e}"));
        if grant {
            self.cluster.grant_secrets(&self.ns, &[name]);
        }
    }

    /// Lets gated builds go on.
    pub fn open_gate(&self) {
        std::fs::write(self.dir.join("gate"), b"open").unwrap();
    }

    /// How many build steps started (one line per attempt that got past boot).
    pub fn builds_started(&self) -> usize {
        std::fs::read_to_string(self.dir.join("started"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    /// Creates a CustomRun as Tekton does; `timeout` is its `spec.timeout` (Go duration).
    pub async fn create_run(&self, name: &str, params: &[(&str, Value)], timeout: Option<&str>) {
        self.try_create_run(name, params, timeout)
            .await
            .unwrap_or_else(|e| panic!("creating CustomRun {name}: {e}"));
        eprintln!("[e2e] created CustomRun {name}");
    }

    /// [`Stack::create_run`], returning the API's error instead of panicking.
    pub async fn try_create_run(
        &self,
        name: &str,
        params: &[(&str, Value)],
        timeout: Option<&str>,
    ) -> Result<(), kube::Error> {
        let params: Vec<Value> = params.iter().map(|(n, v)| json!({"name": n, "value": v})).collect();
        let mut spec = json!({
            "customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"},
            "params": params,
            "serviceAccountName": "default",
        });
        if let Some(t) = timeout {
            spec["timeout"] = json!(t);
        }
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
            "metadata": {"name": name, "namespace": self.ns,
                         "labels": {"tekton.dev/pipelineRun": "e2e", "tekton.dev/pipelineTask": "mac-build"}},
            "spec": spec,
        }))
        .unwrap();
        self.customruns().create(&PostParams::default(), &obj).await.map(|_| ())
    }

    /// Tekton's cancel: `spec.status: RunCancelled`.
    pub async fn cancel_run(&self, name: &str) {
        self.try_cancel_run(name)
            .await
            .unwrap_or_else(|e| panic!("cancelling {name}: {e}"));
    }

    /// [`Stack::cancel_run`], returning the API's error instead of panicking.
    pub async fn try_cancel_run(&self, name: &str) -> Result<(), kube::Error> {
        self.customruns()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"status": "RunCancelled"}})),
            )
            .await
            .map(|_| ())
    }

    pub async fn delete_run(&self, name: &str) {
        self.try_delete_run(name)
            .await
            .unwrap_or_else(|e| panic!("deleting {name}: {e}"));
    }

    /// [`Stack::delete_run`], returning the API's error instead of panicking.
    pub async fn try_delete_run(&self, name: &str) -> Result<(), kube::Error> {
        self.customruns()
            .delete(name, &DeleteParams::background())
            .await
            .map(|_| ())
    }

    pub async fn customrun(&self, name: &str) -> Option<Value> {
        let o = self.customruns().get_opt(name).await.expect("get CustomRun");
        o.map(|o| serde_json::to_value(o).unwrap())
    }

    pub async fn macbuild(&self, name: &str) -> Option<Value> {
        let o = self.macbuilds().get_opt(name).await.expect("get MacBuild");
        o.map(|o| serde_json::to_value(o).unwrap())
    }

    /// Waits until the CustomRun's `Succeeded` condition is `status/reason`; returns the run.
    pub async fn wait_run(&self, name: &str, status: &str, reason: &str, limit: Duration) -> Value {
        wait_for_async(&format!("CustomRun {name} {status}/{reason}"), limit, || async {
            let run = self.customrun(name).await;
            let c = run
                .as_ref()
                .map(|r| r["status"]["conditions"][0].clone())
                .unwrap_or(Value::Null);
            if c["status"] == status && c["reason"] == reason {
                Ok(run.unwrap())
            } else {
                let mb = self.macbuild(name).await.map(|m| m["status"].clone());
                Err(format!(
                    "CustomRun condition {c}; MacBuild status {}",
                    mb.map(|s| s.to_string()).unwrap_or("(no MacBuild)".into())
                ))
            }
        })
        .await
    }

    /// Waits until the CustomRun's `Succeeded` condition is no longer `Unknown`; returns the run.
    pub async fn wait_run_ended(&self, name: &str, limit: Duration) -> Value {
        wait_for_async(&format!("CustomRun {name} to end"), limit, || async {
            let run = self.customrun(name).await;
            let c = run
                .as_ref()
                .map(|r| r["status"]["conditions"][0].clone())
                .unwrap_or(Value::Null);
            if c["status"] == "True" || c["status"] == "False" {
                Ok(run.unwrap())
            } else {
                Err(format!("CustomRun condition {c}"))
            }
        })
        .await
    }

    /// Waits until a `watchdog.jsonl` line of agent `id` matches `pred`; returns it.
    pub async fn wait_watchdog(
        &self,
        id: &str,
        what: &str,
        limit: Duration,
        pred: impl Fn(&tartan_watchdog::Line) -> bool,
    ) -> tartan_watchdog::Line {
        wait_for(&format!("{id}'s watchdog: {what}"), limit, || {
            let lines = self.watchdog_lines(id);
            lines
                .iter()
                .find(|l| pred(l))
                .cloned()
                .ok_or_else(|| format!("watchdog.jsonl: {:?}", self.watchdog_text(id)))
        })
        .await
    }

    /// The VM and host execution deadline of the first admitted attempt in `id`'s journal.
    pub async fn admitted_vm(&self, id: &str) -> (String, k8s_openapi::jiff::Timestamp) {
        let r = self
            .wait_journal(id, "an attempt admitted", Duration::from_secs(60), |r| {
                r.to == tartan_api::AttemptState::Admitted && r.vm.is_some() && r.deadline.is_some()
            })
            .await;
        (r.vm.unwrap(), r.deadline.unwrap())
    }

    /// Waits until the first build step has started `n` times (it appends a line per start).
    pub async fn wait_builds_started(&self, n: usize, limit: Duration) {
        wait_for(&format!("{n} build step start(s)"), limit, || {
            let got = self.builds_started();
            (got >= n).then_some(()).ok_or(format!("{got} started"))
        })
        .await
    }

    /// Waits until the MacBuild satisfies `pred`; returns it.
    pub async fn wait_macbuild(&self, name: &str, what: &str, limit: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        wait_for_async(&format!("MacBuild {name}: {what}"), limit, || async {
            match self.macbuild(name).await {
                Some(mb) if pred(&mb) => Ok(mb),
                Some(mb) => Err(format!("status {}", mb["status"])),
                None => Err("no MacBuild".into()),
            }
        })
        .await
    }

    /// Waits until the CustomRun shows `HostUnreachable=True` after a `Succeeded` condition
    /// (Tekton reads `conditions[0]`); returns the run.
    pub async fn wait_host_unreachable(&self, name: &str, limit: Duration) -> Value {
        wait_for_async(
            &format!("HostUnreachable=True after Succeeded on CustomRun {name}"),
            limit,
            || async {
                let run = self.customrun(name).await.ok_or("no CustomRun")?;
                let first = &run["status"]["conditions"][0];
                let unreachable = condition_of(&run, "HostUnreachable");
                match unreachable {
                    Some((i, c)) if i > 0 && c["status"] == "True" && first["type"] == "Succeeded" => Ok(run),
                    other => Err(format!("conditions[0] {first}; HostUnreachable {other:?}")),
                }
            },
        )
        .await
    }

    pub async fn lease(&self, id: &str) -> Option<Lease> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        leases.get_opt(&format!("tartan-agent-{id}")).await.expect("get Lease")
    }

    // ---- the end ----

    /// Everything the invariant checker looks at, now.
    pub async fn world(&self) -> World {
        let lp = ListParams::default();
        let to_values = |l: Vec<DynamicObject>| l.into_iter().map(|o| serde_json::to_value(o).unwrap()).collect();
        let custom_runs = to_values(self.customruns().list(&lp).await.expect("list CustomRuns").items);
        let macbuilds = to_values(self.macbuilds().list(&lp).await.expect("list MacBuilds").items);
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        let leases = leases
            .list(&lp)
            .await
            .expect("list Leases")
            .items
            .into_iter()
            .map(|l| serde_json::to_value(l).unwrap())
            .collect();
        World {
            agents: self
                .agents
                .keys()
                .map(|id| AgentFacts {
                    id: id.clone(),
                    journal: self.journal(id),
                    watchdog: self.watchdog_lines(id),
                    vms_left: self.vms(id),
                })
                .collect(),
            planted: self
                .planted
                .iter()
                .map(|(a, vm)| PlantedVm {
                    agent: a.clone(),
                    vm: vm.clone(),
                    present: self.vms(a).contains(vm),
                })
                .collect(),
            custom_runs,
            macbuilds,
            leases,
            refused_terminal_status: self.refusing_terminal_status,
            delivery_blocked: Vec::new(),
        }
    }

    /// Checks all the invariants ([`invariants::TITLES`]); panics listing every violation with the journals.
    pub async fn check_invariants(&self) {
        let world = self.world().await;
        let violations = invariants::check(&world);
        if !violations.is_empty() {
            let list: Vec<String> = violations.iter().map(|v| format!("  - {v}")).collect();
            panic!(
                "{}: {} invariant violation(s):\n{}\njournals:\n{}",
                self.name,
                violations.len(),
                list.join("\n"),
                self.journals_text()
            );
        }
        eprintln!("[e2e] {}: all {} invariants hold", self.name, invariants::TITLES.len());
    }

    /// Every log of the controller and agents (all runs).
    fn component_logs(&self) -> Vec<PathBuf> {
        let mut logs: Vec<PathBuf> = self
            .controller
            .iter()
            .chain(self.replicas.values())
            .chain(self.dead.iter())
            .map(|p| p.log().to_path_buf())
            .collect();
        for id in self.agents.keys() {
            logs.extend(self.agent_logs(id));
        }
        logs
    }

    /// Panics if a component's log shows a request RBAC refused: `deploy/rbac.yaml` must let the
    /// controller and agents do everything a scenario asks of them.
    fn check_nothing_forbidden(&self) {
        let refused: Vec<String> = self
            .component_logs()
            .iter()
            .flat_map(|log| {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                text.lines()
                    .filter(|l| l.contains(" is forbidden: User "))
                    .map(|l| format!("{}: {l}", log.display()))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert!(
            refused.is_empty(),
            "{}: RBAC refused the components {} request(s) (deploy/rbac.yaml lacks a rule); first:\n{}",
            self.name,
            refused.len(),
            refused.iter().take(3).cloned().collect::<Vec<_>>().join("\n")
        );
    }

    fn journals_text(&self) -> String {
        self.agents
            .keys()
            .map(|id| format!("--- {id}\n{}", self.journal_text(id)))
            .collect()
    }

    /// Checks the invariants (and, on a real cluster, that RBAC refused the components nothing),
    /// prints the journals, then stops everything.
    pub async fn finish(mut self) {
        self.check_invariants().await;
        if !self.cluster.is_emulator() {
            self.check_nothing_forbidden();
        }
        eprint!("{}", self.journals_text());
        self.stop_all();
    }

    fn stop_all(&mut self) {
        if let Some(mut c) = self.controller.take() {
            c.terminate(Duration::from_secs(2));
        }
        for (_, mut c) in std::mem::take(&mut self.replicas) {
            // A frozen replica cannot act on SIGTERM.
            c.signal(Signal::SIGCONT);
            c.terminate(Duration::from_secs(2));
        }
        for a in self.agents.values_mut() {
            if let Some(mut p) = a.proc.take() {
                p.terminate(Duration::from_secs(2));
            }
            a.watchdog.take();
            a.dead.clear();
            kill_pids_with_env("TART_HOME", &a.tart_home.to_string_lossy());
        }
        self.dead.clear();
    }

    fn dump_on_failure(&mut self) {
        eprintln!("[e2e] {} FAILED; files kept in {}", self.name, self.dir.display());
        let mut logs: Vec<(String, PathBuf)> = vec![];
        if let Some(c) = &self.controller {
            logs.push((c.name().into(), c.log().into()));
        }
        for c in self.replicas.values() {
            logs.push((c.name().into(), c.log().into()));
        }
        for a in self.agents.values() {
            for p in a.proc.iter().chain(a.watchdog.iter()).chain(a.dead.iter()) {
                logs.push((p.name().into(), p.log().into()));
            }
        }
        for (name, log) in logs {
            eprintln!(
                "--- {name}: {} (last lines)\n{}",
                log.display(),
                crate::process::tail(&log, 25)
            );
        }
        eprint!("{}", self.journals_text());
        if let Some(t) = self.tempdir.take() {
            let _ = t.keep();
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_on_failure();
        }
        self.stop_all();
        self.cluster.teardown(&self.ns);
    }
}

/// The `Succeeded` condition of a CustomRun as `status/reason: message`.
pub fn condition_text(run: &Value) -> String {
    let c = &run["status"]["conditions"][0];
    format!(
        "{}/{}: {}",
        c["status"].as_str().unwrap_or("?"),
        c["reason"].as_str().unwrap_or("?"),
        c["message"].as_str().unwrap_or("")
    )
}

/// The condition of `type_` on a CustomRun (or MacBuild), with its index in `conditions`.
pub fn condition_of<'a>(object: &'a Value, type_: &str) -> Option<(usize, &'a Value)> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .enumerate()
        .find(|(_, c)| c["type"] == type_)
}

/// Whether `path` exists (for artifact checks).
pub fn exists(path: &Path) -> bool {
    path.exists()
}

/// `GET path` on the address a tartan process logged it serves on (`serving /metrics, ... on ADDR`).
fn served_get(log: &str, who: &str, path: &str) -> (u16, String) {
    let addr = log
        .lines()
        .filter(|l| l.contains("serving /metrics"))
        .find_map(|l| l.rsplit_once(" on ").map(|(_, rest)| rest))
        .and_then(|rest| rest.split(|c: char| c.is_whitespace() || c == '\u{1b}').next())
        .unwrap_or_else(|| panic!("{who} logged no \"serving /metrics, ... on <address>\" line yet"));
    crate::cluster::http_get(addr, path)
}

/// `program`, started through `nice -n <nice>` when `nice` is above 0 (`nice` execs it, so the
/// pid, the process group and `/proc/<pid>/cmdline` stay the program's).
fn host_command(program: PathBuf, nice: u8) -> Command {
    if nice == 0 {
        return Command::new(program);
    }
    let mut cmd = Command::new("nice");
    cmd.arg("-n").arg(nice.to_string()).arg(program);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    fn niceness_seen(nice: u8) -> i32 {
        let out = host_command(PathBuf::from("/bin/sh"), nice)
            .args(["-c", "nice"])
            .output()
            .expect("sh runs");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("nice prints a number")
    }

    #[test]
    fn a_host_process_starts_at_the_niceness_asked_for_and_zero_leaves_it_alone() {
        let own = niceness_seen(0);
        assert_eq!(niceness_seen(7), (own + 7).min(19));
    }
}
