//! `scripts/bench-controller`: the controller at N CustomRuns (issue 16), against the testkit's
//! emulator (in this process) or a real control plane from `KUBEBUILDER_ASSETS` (`--cluster real`).
//!
//! The controller under test is a separate `tartan-controller run` process (so it can be killed,
//! restarted, and its peak RSS and CPU read from /proc). This program plays Tekton (creates
//! CustomRuns) and the agents (a stand-in writes MacBuild status the way the real agent does:
//! a claim, then a terminal status with `VMDeleted=True`, each a JSON patch fenced on uid,
//! holder and attempt). Phases:
//!
//! 1. steady: N CustomRuns created, their MacBuilds claimed and Running, then each made terminal
//!    one at a time: latency MacBuild terminal write → CustomRun terminal (seen on a watch).
//!    The controller labels each finished run and its MacBuild out of its watches; the bench waits
//!    for those labels before going on.
//! 2. catch-up: N more CustomRuns brought to Running, the controller SIGKILLed, N terminal
//!    statuses written, the controller started → all N CustomRuns terminal (N finished present),
//!    then → all N labelled finished.
//! 3. single: one more build Running, controller killed, its terminal status written, controller
//!    started → its CustomRun terminal (2N finished CustomRuns present).
//!
//! Requests by the controller come from the emulator's request log (the bench's own requests
//! carry `fieldManager=tartan-bench` or a `tartan.dev/bench` label selector and are left out).
//! `--out FILE` saves the figures as JSON; `--compare A.json B.json ...` prints saved runs side by side.

use anyhow::{Context as _, bail};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, CustomResourceExt as _};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tartan_api::{FINISHED_LABEL, MacBuild};
use tartan_controller::customrun::CustomRun;
use tokio::sync::watch;

const NS: &str = "bench";
const MANAGER: &str = "tartan-bench";
const LABEL: &str = "tartan.dev/bench";
const AGENTS: usize = 50;
const IN_FLIGHT: usize = 16;

struct Args {
    runs: usize,
    real: bool,
    controller: PathBuf,
    controller_args: Vec<String>,
    label: String,
    out: Option<PathBuf>,
    compare: Vec<PathBuf>,
    wait: Duration,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        runs: 1000,
        real: false,
        controller: default_controller(),
        controller_args: vec![],
        label: "run".into(),
        out: None,
        compare: vec![],
        wait: Duration::from_secs(600),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--runs" => a.runs = val()?.parse().context("--runs takes a number")?,
            "--cluster" => {
                a.real = match val()?.as_str() {
                    "real" => true,
                    "emulator" => false,
                    other => bail!("--cluster is `emulator` or `real`, not {other}"),
                }
            }
            "--controller" => a.controller = val()?.into(),
            "--controller-arg" => a.controller_args.push(val()?),
            "--label" => a.label = val()?,
            "--out" => a.out = Some(val()?.into()),
            "--wait" => a.wait = Duration::from_secs(val()?.parse().context("--wait takes seconds")?),
            "--compare" => {
                a.compare.extend(it.by_ref().map(PathBuf::from));
            }
            "-h" | "--help" => {
                println!(
                    "usage: bench-controller [--runs N] [--cluster emulator|real] [--controller BIN] \
                     [--controller-arg ARG]... [--label NAME] [--out FILE.json] [--wait SECS]\n       \
                     bench-controller --compare A.json B.json ..."
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other} (see --help)"),
        }
    }
    Ok(a)
}

fn default_controller() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("release/tartan-controller")
}

/// The machine's load right now (`/proc/loadavg`: 1, 5, 15 min).
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

// ---------------------------------------------------------------------------------------------
// Backends

enum Backend {
    Emulator(tartan_testkit::EmulatorHandle),
    Real(tartan_testkit::RealCluster),
}

struct Cluster {
    backend: Backend,
    kubeconfig: PathBuf,
    client: Client,
    _dir: tempfile::TempDir,
}

async fn start_cluster(real: bool) -> anyhow::Result<Cluster> {
    let dir = tempfile::Builder::new().prefix("bench-controller-").tempdir()?;
    let mb_crd = serde_json::to_value(MacBuild::crd())?;
    if real {
        let cluster = tartan_testkit::RealCluster::start("bench-controller --cluster real")?
            .context("no real control plane: set KUBEBUILDER_ASSETS (or USE_EXISTING_CLUSTER=true with KUBECONFIG)")?;
        let tekton = std::fs::read_to_string(tartan_testkit::customrun_crd())?;
        cluster.apply(&tekton)?;
        cluster.apply(&serde_json::to_string(&mb_crd)?)?;
        cluster.kubectl(
            &[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "crd/macbuilds.tartan.dev",
                "crd/customruns.tekton.dev",
            ],
            None,
        )?;
        let client = cluster.admin_client().await?;
        let kubeconfig = cluster.admin_kubeconfig();
        Ok(Cluster {
            backend: Backend::Real(cluster),
            kubeconfig,
            client,
            _dir: dir,
        })
    } else {
        let tekton = tartan_testkit::customrun_crd();
        let emu = tartan_testkit::start(tartan_testkit::Options::default().crd_file(tekton)).await?;
        emu.install_crd(mb_crd)?;
        let kubeconfig = dir.path().join("kubeconfig");
        emu.write_kubeconfig(&kubeconfig)?;
        let client = emu.client();
        Ok(Cluster {
            backend: Backend::Emulator(emu),
            kubeconfig,
            client,
            _dir: dir,
        })
    }
}

impl Cluster {
    fn name(&self) -> String {
        match &self.backend {
            Backend::Emulator(_) => "emulator".into(),
            Backend::Real(c) => format!("real kube-apiserver 1.24 ({})", c.api_url()),
        }
    }

    fn requests(&self) -> Option<Vec<String>> {
        match &self.backend {
            Backend::Emulator(e) => Some(e.requests()),
            Backend::Real(_) => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The emulator's request log, accumulated (it keeps 10,000-20,000 lines and drops the oldest
// 10,000 when full; polled often enough that fewer than 10,000 arrive between polls).

#[derive(Default)]
struct RequestTally {
    seen: usize,
    controller: BTreeMap<String, u64>,
    bench: u64,
}

impl RequestTally {
    fn absorb(&mut self, log: &[String]) {
        let start = if log.len() >= self.seen {
            self.seen
        } else {
            self.seen.saturating_sub(10_000)
        };
        for line in log.iter().skip(start) {
            if line.contains(MANAGER) || line.contains("tartan.dev%2Fbench") || line.contains(LABEL) {
                self.bench += 1;
            } else {
                *self.controller.entry(classify(line)).or_default() += 1;
            }
        }
        self.seen = log.len();
    }
}

/// `GET /apis/g/v/namespaces/ns/customruns/x?...` → `get customruns`; lists and watches apart.
fn classify(line: &str) -> String {
    let (method, uri) = line.split_once(' ').unwrap_or((line, ""));
    // The log line goes on after the URI (the client's User-Agent).
    let uri = uri.split(' ').next().unwrap_or(uri);
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    // After "namespaces/<ns>" (or the group/version), the resource, name, subresource.
    let rest: Vec<&str> = match segs.iter().position(|s| *s == "namespaces") {
        Some(i) if segs.len() > i + 2 => segs[i + 2..].to_vec(),
        _ => {
            let skip = if segs.first() == Some(&"api") { 2 } else { 3 };
            segs.iter().skip(skip).copied().collect()
        }
    };
    let resource = match rest.as_slice() {
        [r] | [r, _] => r.to_string(),
        [r, _, sub, ..] => format!("{r}/{sub}"),
        [] => path.to_string(),
    };
    let verb = match method {
        "GET" if query.contains("watch=true") || query.contains("watch=1") => "watch",
        "GET" if rest.len() == 1 => "list",
        "GET" => "get",
        "POST" => "create",
        "PATCH" => "patch",
        "PUT" => "update",
        "DELETE" => "delete",
        other => other,
    };
    format!("{verb} {resource}")
}

fn tally_task(cluster: Arc<Cluster>, tally: Arc<Mutex<RequestTally>>) -> Option<tokio::task::JoinHandle<()>> {
    cluster.requests()?;
    Some(tokio::spawn(async move {
        loop {
            if let Some(log) = cluster.requests() {
                tally.lock().unwrap().absorb(&log);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }))
}

fn tally_now(cluster: &Cluster, tally: &Mutex<RequestTally>) -> Option<BTreeMap<String, u64>> {
    let log = cluster.requests()?;
    let mut t = tally.lock().unwrap();
    t.absorb(&log);
    Some(t.controller.clone())
}

fn diff(
    after: &Option<BTreeMap<String, u64>>,
    before: &Option<BTreeMap<String, u64>>,
) -> Option<BTreeMap<String, u64>> {
    let (a, b) = (after.as_ref()?, before.as_ref()?);
    Some(
        a.iter()
            .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect(),
    )
}

// ---------------------------------------------------------------------------------------------
// What the bench sees, from its own watches.

#[derive(Default, Clone)]
struct Seen {
    build_uid: Option<String>,
    reason: Option<String>,
    terminal_at: Option<Instant>,
    /// The controller labelled the CustomRun, and its MacBuild, finished.
    run_marked: bool,
    build_marked: bool,
}

fn marked(meta: &kube::api::ObjectMeta) -> bool {
    meta.labels.as_ref().is_some_and(|l| l.contains_key(FINISHED_LABEL))
}

#[derive(Clone)]
struct World {
    seen: Arc<Mutex<HashMap<String, Seen>>>,
    tick: watch::Receiver<u64>,
}

fn start_watches(client: &Client) -> World {
    let seen: Arc<Mutex<HashMap<String, Seen>>> = Arc::default();
    let (tx, rx) = watch::channel(0u64);
    let tx = Arc::new(tx);
    let cfg = watcher::Config::default().labels(LABEL);
    let runs: Api<CustomRun> = Api::namespaced(client.clone(), NS);
    let (s, t) = (seen.clone(), tx.clone());
    tokio::spawn(async move {
        let mut events = watcher(runs, cfg.clone()).default_backoff().applied_objects().boxed();
        while let Some(ev) = events.next().await {
            let Ok(run) = ev else { continue };
            let now = Instant::now();
            let name = run.metadata.name.clone().unwrap_or_default();
            let cond = run.status.as_ref().and_then(|st| st.succeeded().cloned());
            let mut map = s.lock().unwrap();
            let e = map.entry(name).or_default();
            e.run_marked = marked(&run.metadata);
            e.reason = cond.as_ref().and_then(|c| c.reason.clone());
            if cond.is_some_and(|c| c.status != "Unknown") && e.terminal_at.is_none() {
                e.terminal_at = Some(now);
            }
            drop(map);
            t.send_modify(|n| *n += 1);
        }
    });
    let builds: Api<MacBuild> = Api::namespaced(client.clone(), NS);
    let (s, t) = (seen.clone(), tx);
    tokio::spawn(async move {
        let mut events = watcher(builds, watcher::Config::default().labels(LABEL))
            .default_backoff()
            .applied_objects()
            .boxed();
        while let Some(ev) = events.next().await {
            let Ok(mb) = ev else { continue };
            let name = mb.metadata.name.clone().unwrap_or_default();
            let mut map = s.lock().unwrap();
            let e = map.entry(name).or_default();
            e.build_uid = mb.metadata.uid.clone();
            e.build_marked = marked(&mb.metadata);
            drop(map);
            t.send_modify(|n| *n += 1);
        }
    });
    World { seen, tick: rx }
}

impl World {
    /// Waits until `done` holds for every name, or fails after `limit` saying how many are missing.
    async fn until(
        &self,
        what: &str,
        names: &[String],
        limit: Duration,
        done: impl Fn(&Seen) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + limit;
        let mut tick = self.tick.clone();
        loop {
            let missing = {
                let map = self.seen.lock().unwrap();
                names.iter().filter(|n| !map.get(*n).is_some_and(&done)).count()
            };
            if missing == 0 {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, tick.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => bail!("the bench's watches stopped while waiting for {what}"),
                Err(_) => bail!("{what}: {missing} of {} still missing after {limit:?}", names.len()),
            }
        }
    }

    fn get(&self, name: &str) -> Seen {
        self.seen.lock().unwrap().get(name).cloned().unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------------------------
// Tekton and agent stand-ins.

fn agent_of(i: usize) -> String {
    format!("bench-{:02}", i % AGENTS)
}

fn pm() -> PatchParams {
    PatchParams {
        field_manager: Some(MANAGER.into()),
        ..Default::default()
    }
}

fn pp() -> PostParams {
    PostParams {
        field_manager: Some(MANAGER.into()),
        ..Default::default()
    }
}

async fn create_leases(client: &Client) -> anyhow::Result<()> {
    let ns: Api<Namespace> = Api::all(client.clone());
    let obj: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}}))?;
    match ns.create(&pp(), &obj).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e).context("creating namespace bench"),
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    for i in 0..AGENTS {
        let agent = agent_of(i);
        // Long-lived and not renewed during the bench: a renewal would wake every run its
        // agent holds, which is another benchmark (the fleet's).
        let lease: Lease = serde_json::from_value(json!({
            "metadata": {"name": format!("tartan-agent-{agent}"), "labels": {"tartan.dev/agent": agent, LABEL: "lease"}},
            "spec": {"holderIdentity": agent, "leaseDurationSeconds": 86400,
                     "renewTime": Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()},
        }))?;
        leases.create(&pp(), &lease).await.context("creating an agent Lease")?;
    }
    Ok(())
}

fn run_object(name: &str) -> anyhow::Result<CustomRun> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
        "metadata": {"name": name, "labels": {
            LABEL: "run", "tekton.dev/pipelineRun": name, "tekton.dev/pipelineTask": "mac-build"}},
        "spec": {
            "customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"},
            "params": [
                {"name": "image", "value": "ghcr.io/cirruslabs/macos-sequoia-xcode:16"},
                {"name": "steps", "value": ["xcodebuild build", "xcodebuild test"]},
            ],
            "serviceAccountName": "default",
            "timeout": "1h0m0s",
        },
    }))?)
}

fn cond(type_: &str, status: &str, reason: &str, message: &str, at: &str) -> Value {
    json!({"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": at})
}

fn now_text() -> String {
    Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// The agent's claim and boot, as one status write: `Running` on `agent`, attempt 1.
fn running_status(name: &str, agent: &str) -> Value {
    let at = now_text();
    let vm = format!("mb-{NS}-{name}-1");
    json!({
        "phase": "Running",
        "claim": {"holder": agent, "attempt": format!("{name}#1"), "epoch": 1},
        "conditions": [
            cond("Claimed", "True", "SlotFree", &format!("held by {agent}"), &at),
            cond("VMReady", "True", "GuestReady", "guest answers tart exec", &at),
            cond("VMDeleted", "False", "Running", &format!("VM {vm} exists or may exist"), &at),
            cond("Succeeded", "Unknown", "Running", "attempt 1 is Running", &at),
        ],
        "attempts": [{"number": 1, "id": format!("{name}#1"), "vm": vm, "host": agent, "startedAt": at}],
        "vm": vm,
        "journalSeq": 4,
        "message": format!("attempt 1 is running on {agent}"),
    })
}

/// The agent's last write: outcome Succeeded, VM deleted (`VMDeleted=True`), results.
fn terminal_status(name: &str, agent: &str) -> Value {
    let at = now_text();
    let vm = format!("mb-{NS}-{name}-1");
    json!({
        "phase": "Succeeded",
        "outcome": "Succeeded",
        "claim": {"holder": agent, "attempt": format!("{name}#1"), "epoch": 1},
        "conditions": [
            cond("Claimed", "True", "SlotFree", &format!("held by {agent}"), &at),
            cond("VMReady", "False", "Retired", "attempt 1 is Retired", &at),
            cond("VMDeleted", "True", "VMDeleted", "", &at),
            cond("Succeeded", "True", "TestsPassed", "attempt 1 succeeded", &at),
        ],
        "attempts": [{"number": 1, "id": format!("{name}#1"), "vm": vm, "host": agent, "startedAt": at,
                      "finishedAt": at, "outcome": "Succeeded", "reason": "TestsPassed"}],
        "vm": vm,
        "journalSeq": 9,
        "results": {"testsPassed": 2, "testsTotal": 2, "artifactUrl": format!("s3://bench/{name}.ipa")},
        "message": "attempt 1 succeeded; VM deleted",
    })
}

/// A status write the way the agent's delivery makes it: fenced on uid (and on the claim once it exists).
async fn agent_write(
    builds: &Api<MacBuild>,
    name: &str,
    uid: &str,
    status: Value,
    claimed: bool,
) -> anyhow::Result<()> {
    let mut ops = vec![json!({"op": "test", "path": "/metadata/uid", "value": uid})];
    if claimed {
        ops.push(json!({"op": "test", "path": "/status/claim/holder", "value": status["claim"]["holder"]}));
        ops.push(json!({"op": "test", "path": "/status/claim/attempt", "value": status["claim"]["attempt"]}));
        ops.push(json!({"op": "replace", "path": "/status", "value": status}));
    } else {
        ops.push(json!({"op": "add", "path": "/status", "value": status}));
    }
    let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops))?;
    builds
        .patch_status(name, &pm(), &Patch::Json::<()>(patch))
        .await
        .with_context(|| format!("agent stand-in writing MacBuild {name} status"))?;
    Ok(())
}

async fn for_all<F, Fut>(names: &[String], f: F) -> anyhow::Result<()>
where
    F: Fn(usize, String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    futures::stream::iter(names.iter().cloned().enumerate().map(|(i, n)| f(i, n)))
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The controller process.

struct Controller {
    child: tokio::process::Child,
    pid: u32,
    started: Instant,
}

#[derive(Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
struct ProcStats {
    hwm_mib: f64,
    rss_mib: f64,
    cpu_s: f64,
}

fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

impl Controller {
    async fn start(bin: &Path, kubeconfig: &Path, extra: &[String], log: &Path) -> anyhow::Result<Controller> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
        let child = tokio::process::Command::new(bin)
            .args([
                "run",
                "--namespace",
                NS,
                "--metrics-address",
                "127.0.0.1:0",
                "--kubeconfig",
            ])
            .arg(kubeconfig)
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("BENCH_CONTROLLER_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (build it: cargo build --release -p tartan-controller)",
                    bin.display()
                )
            })?;
        let pid = child.id().context("controller pid")?;
        Ok(Controller {
            child,
            pid,
            started: Instant::now(),
        })
    }

    fn stats(&self) -> ProcStats {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        let kb = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        // Fields after the `(comm)`: state is field 3, utime 14, stime 15.
        let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let f: Vec<&str> = after.split_whitespace().collect();
        let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        ProcStats {
            hwm_mib: kb("VmHWM:") / 1024.0,
            rss_mib: kb("VmRSS:") / 1024.0,
            cpu_s: (ticks(11) + ticks(12)) / clock_ticks(),
        }
    }

    async fn kill(mut self) -> anyhow::Result<ProcStats> {
        let stats = self.stats();
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!("the controller exited early ({status}); see its log");
        }
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(stats)
    }
}

// ---------------------------------------------------------------------------------------------
// Figures.

#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Report {
    label: String,
    backend: String,
    runs: usize,
    controller: String,
    uptime_start: String,
    create_s: f64,
    create_load: String,
    latency_ms: Vec<f64>,
    steady_load: String,
    steady_proc: ProcStats,
    steady_requests: Option<BTreeMap<String, u64>>,
    catchup_s: f64,
    /// The bench's own N terminal MacBuild status writes while the controller was down: what
    /// this API server takes for N writes (with the bench's watches open), the floor under
    /// `catchup_s` (which needs N CustomRun status writes).
    #[serde(default)]
    catchup_floor_s: f64,
    catchup_load: String,
    catchup_proc: ProcStats,
    catchup_requests: Option<BTreeMap<String, u64>>,
    /// Controller start → every caught-up run and its MacBuild labelled finished (after the
    /// CustomRuns are terminal: the label trails the status).
    #[serde(default)]
    catchup_marked_s: f64,
    single_s: f64,
    /// The bench's own list of every CustomRun and every MacBuild (at once, resourceVersion=0,
    /// as the controller's watches list them) just before the restart: the floor under
    /// `single_s`, since no reconcile starts before the caches hold their first list.
    #[serde(default)]
    single_list_s: f64,
    single_load: String,
    single_proc: ProcStats,
    single_requests: Option<BTreeMap<String, u64>>,
    uptime_end: String,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn lat(r: &Report) -> (f64, f64, f64) {
    let mut v = r.latency_ms.clone();
    v.sort_by(|a, b| a.total_cmp(b));
    (pct(&v, 0.5), pct(&v, 0.99), v.last().copied().unwrap_or(f64::NAN))
}

fn per_run(reqs: &Option<BTreeMap<String, u64>>, n: usize) -> String {
    match reqs {
        None => "n/a (no request log)".into(),
        Some(m) => {
            let total: u64 = m.values().sum();
            let mut parts: Vec<(u64, &String)> = m.iter().map(|(k, v)| (*v, k)).collect();
            parts.sort_by_key(|p| std::cmp::Reverse(p.0));
            let top: Vec<String> = parts
                .iter()
                .take(8)
                .map(|(v, k)| format!("{k} {:.2}", *v as f64 / n.max(1) as f64))
                .collect();
            format!(
                "{:.2}/run ({total} in all): {}",
                total as f64 / n.max(1) as f64,
                top.join(", ")
            )
        }
    }
}

fn print_report(r: &Report) {
    let (p50, p99, max) = lat(r);
    println!(
        "== bench-controller [{}] {} CustomRuns on the {} ==",
        r.label, r.runs, r.backend
    );
    println!("controller: {}", r.controller);
    println!("uptime at start: {}", r.uptime_start);
    println!(
        "creating {} CustomRuns → all MacBuilds created: {:.2} s (load {})",
        r.runs, r.create_s, r.create_load
    );
    println!(
        "steady status latency MacBuild terminal → CustomRun terminal (n={}): p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms \
         [goal p50 ≤ 50, p99 ≤ 200] (load {})",
        r.latency_ms.len(),
        r.steady_load
    );
    println!(
        "  controller: peak RSS {:.1} MiB, CPU {:.2} s; requests {}",
        r.steady_proc.hwm_mib,
        r.steady_proc.cpu_s,
        per_run(&r.steady_requests, r.runs)
    );
    println!(
        "catch-up after restart (N={} terminal while down, {} finished present) → all terminal: {:.2} s [goal ≤ 10 s at 1,000, ≤ 30 s at 10,000] (load {})",
        r.runs, r.runs, r.catchup_s, r.catchup_load
    );
    println!(
        "  controller: peak RSS {:.1} MiB [goal ≤ 64 MiB at 1,000, ≤ 128 at 10,000], CPU {:.2} s; requests {}",
        r.catchup_proc.hwm_mib,
        r.catchup_proc.cpu_s,
        per_run(&r.catchup_requests, r.runs)
    );
    println!(
        "  the bench's own {} MacBuild status writes while the controller was down ({IN_FLIGHT} at a time): {:.2} s (the API server's floor)",
        r.runs, r.catchup_floor_s
    );
    println!(
        "  every caught-up run and its MacBuild labelled finished: {:.2} s after the start",
        r.catchup_marked_s
    );
    println!(
        "single build after restart ({} finished present) → its CustomRun terminal: {:.3} s [goal ≤ 0.2 s] (load {})",
        2 * r.runs,
        r.single_s,
        r.single_load
    );
    println!(
        "  controller: peak RSS {:.1} MiB, CPU {:.2} s; requests {}",
        r.single_proc.hwm_mib,
        r.single_proc.cpu_s,
        per_run(&r.single_requests, 2 * r.runs + 1)
    );
    println!(
        "  the bench listing every CustomRun and MacBuild just before that restart: {:.3} s (the floor)",
        r.single_list_s
    );
    println!("uptime at end: {}", r.uptime_end);
}

fn compare(files: &[PathBuf]) -> anyhow::Result<()> {
    let reports: Vec<Report> = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {}", f.display()))
        })
        .collect::<anyhow::Result<_>>()?;
    let total = |m: &Option<BTreeMap<String, u64>>, n: usize| {
        m.as_ref()
            .map(|m| format!("{:.2}", m.values().sum::<u64>() as f64 / n.max(1) as f64))
            .unwrap_or_else(|| "n/a".into())
    };
    let mut rows: Vec<(String, String, Vec<String>)> = vec![];
    let mut row = |name: &str, goal: &str, f: &dyn Fn(&Report) -> String| {
        rows.push((name.into(), goal.into(), reports.iter().map(f).collect()));
    };
    row("backend", "", &|r| r.backend.clone());
    row("CustomRuns (N)", "", &|r| r.runs.to_string());
    row("N MacBuilds created (s)", "", &|r| format!("{:.2}", r.create_s));
    row("latency p50 (ms)", "≤ 50", &|r| format!("{:.1}", lat(r).0));
    row("latency p99 (ms)", "≤ 200", &|r| format!("{:.1}", lat(r).1));
    row("latency max (ms)", "", &|r| format!("{:.1}", lat(r).2));
    row("steady: peak RSS (MiB)", "", &|r| {
        format!("{:.1}", r.steady_proc.hwm_mib)
    });
    row("steady: CPU (s)", "", &|r| format!("{:.2}", r.steady_proc.cpu_s));
    row("steady: requests/run", "", &|r| total(&r.steady_requests, r.runs));
    row("load during steady", "", &|r| r.steady_load.clone());
    row("catch-up N (s)", "≤ 10 (1k) / 30 (10k)", &|r| {
        format!("{:.2}", r.catchup_s)
    });
    row("catch-up: the bench's N writes (s)", "", &|r| {
        // 0: a report from before the figure was measured.
        if r.catchup_floor_s > 0.0 {
            format!("{:.2}", r.catchup_floor_s)
        } else {
            "–".into()
        }
    });
    row("catch-up: peak RSS (MiB)", "≤ 64 (1k) / 128 (10k)", &|r| {
        format!("{:.1}", r.catchup_proc.hwm_mib)
    });
    row("catch-up: all labelled finished (s)", "", &|r| {
        format!("{:.2}", r.catchup_marked_s)
    });
    row("catch-up: CPU (s)", "", &|r| format!("{:.2}", r.catchup_proc.cpu_s));
    row("catch-up: requests/run", "", &|r| total(&r.catchup_requests, r.runs));
    row("load during catch-up", "", &|r| r.catchup_load.clone());
    row("single build (s)", "≤ 0.2", &|r| format!("{:.3}", r.single_s));
    row("single: the bench's list of all (s)", "", &|r| {
        format!("{:.3}", r.single_list_s)
    });
    row("single: requests (all)", "", &|r| total(&r.single_requests, 1));
    row("load during single", "", &|r| r.single_load.clone());
    let w0 = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r.1.chars().count()).max().unwrap_or(0).max(4);
    let wc: Vec<usize> = (0..reports.len())
        .map(|i| {
            rows.iter()
                .map(|r| r.2[i].chars().count())
                .chain([reports[i].label.chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let pad = |s: &str, w: usize| format!("{s}{}", " ".repeat(w.saturating_sub(s.chars().count())));
    let mut head = format!("{} | {}", pad("figure", w0), pad("goal", w1));
    for (i, r) in reports.iter().enumerate() {
        head += &format!(" | {}", pad(&r.label, wc[i]));
    }
    println!("{head}");
    for (name, goal, vals) in &rows {
        let mut line = format!("{} | {}", pad(name, w0), pad(goal, w1));
        for (i, v) in vals.iter().enumerate() {
            line += &format!(" | {}", pad(v, wc[i]));
        }
        println!("{line}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------

async fn bring_to_running(
    client: &Client,
    world: &World,
    names: &[String],
    offset: usize,
    limit: Duration,
) -> anyhow::Result<f64> {
    let runs: Api<CustomRun> = Api::namespaced(client.clone(), NS);
    let builds: Api<MacBuild> = Api::namespaced(client.clone(), NS);
    let t0 = Instant::now();
    for_all(names, |_, n| {
        let runs = runs.clone();
        async move {
            runs.create(&pp(), &run_object(&n)?)
                .await
                .with_context(|| format!("creating CustomRun {n}"))?;
            Ok(())
        }
    })
    .await?;
    world
        .until("MacBuilds created", names, limit, |s| s.build_uid.is_some())
        .await?;
    let created = t0.elapsed().as_secs_f64();
    for_all(names, |i, n| {
        let (builds, world) = (builds.clone(), world.clone());
        async move {
            let uid = world.get(&n).build_uid.unwrap_or_default();
            agent_write(&builds, &n, &uid, running_status(&n, &agent_of(offset + i)), false).await
        }
    })
    .await?;
    world
        .until("CustomRuns Running", names, limit, |s| {
            s.reason.as_deref() == Some("Running")
        })
        .await?;
    Ok(created)
}

/// Seconds to list every CustomRun and every MacBuild at once, the way the controller's watches
/// start (resourceVersion=0, pages of 500).
async fn list_everything(client: &Client) -> anyhow::Result<f64> {
    let runs: Api<CustomRun> = Api::namespaced(client.clone(), NS);
    let builds: Api<MacBuild> = Api::namespaced(client.clone(), NS);
    async fn all<K>(api: &Api<K>) -> anyhow::Result<usize>
    where
        K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let mut lp = ListParams::default().match_any().limit(500);
        let mut n = 0;
        loop {
            let page = api.list(&lp).await.context("the bench listing everything")?;
            n += page.items.len();
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(c) => lp = lp.continue_token(&c),
                None => return Ok(n),
            }
        }
    }
    let t0 = Instant::now();
    let (r, b) = futures::join!(all(&runs), all(&builds));
    let (r, b) = (r?, b?);
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("[bench] listing {r} CustomRuns and {b} MacBuilds took {secs:.3} s");
    Ok(secs)
}

async fn bench(args: &Args) -> anyhow::Result<Report> {
    let uptime = || {
        std::process::Command::new("uptime")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|_| load())
    };
    let mut r = Report {
        label: args.label.clone(),
        runs: args.runs,
        controller: format!("{} {}", args.controller.display(), args.controller_args.join(" ")),
        uptime_start: uptime(),
        ..Default::default()
    };
    if !args.controller.is_file() {
        bail!(
            "no controller binary at {} (cargo build --release -p tartan-controller, or pass --controller)",
            args.controller.display()
        );
    }
    let cluster = Arc::new(start_cluster(args.real).await?);
    r.backend = cluster.name();
    eprintln!("[bench] {} up; load {}", r.backend, load());
    let client = cluster.client.clone();
    create_leases(&client).await?;
    let world = start_watches(&client);
    let tally = Arc::new(Mutex::new(RequestTally::default()));
    let _poller = tally_task(cluster.clone(), tally.clone());
    let log = match std::env::var_os("BENCH_CONTROLLER_LOGFILE") {
        Some(f) => PathBuf::from(f),
        None => cluster._dir.path().join("controller.log"),
    };
    let builds: Api<MacBuild> = Api::namespaced(client.clone(), NS);
    let n = args.runs;

    // 1. steady state
    let base = tally_now(&cluster, &tally);
    let c1 = Controller::start(&args.controller, &cluster.kubeconfig, &args.controller_args, &log).await?;
    let batch1: Vec<String> = (0..n).map(|i| format!("a-{i:05}")).collect();
    r.create_s = bring_to_running(&client, &world, &batch1, 0, args.wait).await?;
    r.create_load = load();
    eprintln!("[bench] {n} MacBuilds created in {:.2} s; all Running", r.create_s);
    for (i, name) in batch1.iter().enumerate() {
        let uid = world.get(name).build_uid.unwrap_or_default();
        let t0 = Instant::now();
        agent_write(&builds, name, &uid, terminal_status(name, &agent_of(i)), true).await?;
        world
            .until(
                "a CustomRun terminal",
                std::slice::from_ref(name),
                Duration::from_secs(60),
                |s| s.terminal_at.is_some(),
            )
            .await?;
        let at = world.get(name).terminal_at.expect("checked");
        r.latency_ms.push(at.duration_since(t0).as_secs_f64() * 1000.0);
    }
    // The finished runs leave the controller's watches before the next phase, as they would
    // in a steady fleet.
    world
        .until("steady: runs labelled finished", &batch1, args.wait, |s| {
            s.run_marked && s.build_marked
        })
        .await?;
    r.steady_load = load();
    r.steady_proc = c1.stats();
    let after1 = tally_now(&cluster, &tally);
    r.steady_requests = diff(&after1, &base);
    eprintln!("[bench] steady done; load {}", r.steady_load);

    // 2. catch-up
    let batch2: Vec<String> = (0..n).map(|i| format!("b-{i:05}")).collect();
    bring_to_running(&client, &world, &batch2, n, args.wait).await?;
    c1.kill().await?;
    let writes = Instant::now();
    for_all(&batch2, |i, name| {
        let (builds, world) = (builds.clone(), world.clone());
        async move {
            let uid = world.get(&name).build_uid.unwrap_or_default();
            agent_write(&builds, &name, &uid, terminal_status(&name, &agent_of(n + i)), true).await
        }
    })
    .await?;
    r.catchup_floor_s = writes.elapsed().as_secs_f64();
    let base = tally_now(&cluster, &tally);
    let c2 = Controller::start(&args.controller, &cluster.kubeconfig, &args.controller_args, &log).await?;
    world
        .until("catch-up: CustomRuns terminal", &batch2, args.wait, |s| {
            s.terminal_at.is_some()
        })
        .await?;
    r.catchup_s = c2.started.elapsed().as_secs_f64();
    r.catchup_proc = c2.stats();
    r.catchup_load = load();
    let after2 = tally_now(&cluster, &tally);
    r.catchup_requests = diff(&after2, &base);
    eprintln!("[bench] catch-up {:.2} s; load {}", r.catchup_s, r.catchup_load);
    world
        .until("catch-up: runs labelled finished", &batch2, args.wait, |s| {
            s.run_marked && s.build_marked
        })
        .await?;
    r.catchup_marked_s = c2.started.elapsed().as_secs_f64();
    eprintln!("[bench] catch-up: all labelled finished at {:.2} s", r.catchup_marked_s);

    // 3. a single running build behind 2N finished ones
    let one = vec!["c-00000".to_string()];
    bring_to_running(&client, &world, &one, 2 * n, args.wait).await?;
    c2.kill().await?;
    let uid = world.get(&one[0]).build_uid.unwrap_or_default();
    agent_write(&builds, &one[0], &uid, terminal_status(&one[0], &agent_of(2 * n)), true).await?;
    r.single_list_s = list_everything(&client).await?;
    let base = tally_now(&cluster, &tally);
    let c3 = Controller::start(&args.controller, &cluster.kubeconfig, &args.controller_args, &log).await?;
    world
        .until("single: CustomRun terminal", &one, args.wait, |s| {
            s.terminal_at.is_some()
        })
        .await?;
    r.single_s = world
        .get(&one[0])
        .terminal_at
        .expect("checked")
        .duration_since(c3.started)
        .as_secs_f64();
    r.single_load = load();
    // Give the restarted controller time to finish its pass over the 2N finished runs before
    // counting its requests (a bench, not a test: nothing to wait on but quiet).
    tokio::time::sleep(Duration::from_secs(3)).await;
    r.single_proc = c3.stats();
    let after3 = tally_now(&cluster, &tally);
    r.single_requests = diff(&after3, &base);
    c3.kill().await?;
    r.uptime_end = uptime();
    Ok(r)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    if !args.compare.is_empty() {
        return compare(&args.compare);
    }
    let r = bench(&args).await?;
    print_report(&r);
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&r)?).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("[bench] figures saved to {}", out.display());
    }
    Ok(())
}
