//! The chaos runner (`scripts/chaos`): the whole local stack with several agent hosts, a seeded
//! random schedule of every fault the harness can inject ([`plan`]), a healing phase with every
//! fault lifted, then every invariant and the run-wide checks ([`checks`]), one line each.

pub mod checks;
pub mod controllers;
pub mod plan;
pub mod reaper;
pub mod usage;

use crate::stack::{AgentOptions, ControllerOptions, KillMode, Stack};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use plan::{BuildPlan, Fault, Kill, Plan, Sizes, build_name, host_name};
use serde_json::{Value, json};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::io::Write as _;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Everything `scripts/chaos` can set.
#[derive(Clone, Debug)]
pub struct Options {
    pub sizes: Sizes,
    /// Slots per host.
    pub slots: u8,
    /// The first this many hosts keep a warm pool (`[pool]`: one VM of the builds' image).
    pub pool_hosts: usize,
    /// The longest the healing phase waits for every CustomRun to end and every VM to go.
    pub heal: Duration,
    pub agent: AgentOptions,
    pub controller: ControllerOptions,
    /// Controller processes: 1 without leader election, more as replicas under it.
    pub controller_replicas: usize,
    /// Keep the work directory even when every check passes.
    pub keep: bool,
    /// How often the runner samples every host (VMs on disk, processes that exited).
    pub sample_every: Duration,
}

/// The run's log: every line printed with its time since the start and the wall clock, and kept
/// (the fault log printed again on failure).
struct Log {
    start: Instant,
    lines: Vec<String>,
    /// Per fault kind: how many struck and how many were skipped (one of its kind in force).
    tally: BTreeMap<&'static str, [u32; 2]>,
}

impl Log {
    fn struck(&mut self, fault: &Fault) {
        self.tally.entry(fault.kind()).or_default()[0] += 1;
        self.line(format!("strike: {fault}"));
    }

    fn skipped(&mut self, fault: &Fault, why: &str) {
        self.tally.entry(fault.kind()).or_default()[1] += 1;
        self.line(format!("skip: {fault} ({why})"));
    }

    /// One line per fault kind: struck and skipped.
    fn tally_lines(&self) -> Vec<String> {
        self.tally
            .iter()
            .map(|(kind, [struck, skipped])| format!("faults {kind}: {struck} struck, {skipped} skipped"))
            .collect()
    }

    fn line(&mut self, msg: impl AsRef<str>) {
        let l = format!(
            "+{:8.3}s {} {}",
            self.start.elapsed().as_secs_f64(),
            Timestamp::now().strftime("%H:%M:%S%.3f"),
            msg.as_ref()
        );
        println!("{l}");
        let _ = std::io::stdout().flush();
        self.lines.push(l);
    }
}

/// How often the run's processes' CPU and memory are read (see [`usage`]).
const USAGE_EVERY: Duration = Duration::from_secs(3);

/// What is in force right now (so overlapping faults of one kind are skipped, and healing lifts
/// exactly what is on).
#[derive(Default)]
struct InForce {
    /// Per host: killed (restart pending) or frozen.
    agent_down: BTreeMap<usize, Kill>,
    agent_frozen: BTreeMap<usize, ()>,
    /// The controller processes, and which of them are down.
    controllers: controllers::Controllers,
    availability: bool,
    latency: bool,
    refusing: bool,
    stalled: bool,
    /// A rack cut off from the API, the API saturated, a rolling upgrade under way.
    partitioned: bool,
    busy: bool,
    upgrading: bool,
    /// Per host: tart-double faults by name (`delete_fails`, `clone_delay_secs`, ...).
    tart: BTreeMap<usize, BTreeMap<&'static str, Value>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Create(usize),
    Strike(usize),
    Lift(usize),
    /// A rolling upgrade's stop and start of one host (the fault's index, the host); the last
    /// host's ends the upgrade.
    Upgrade(usize, usize),
}

/// The schedule: events by due time (creates before strikes before lifts at the same time, then
/// in the order pushed). A heap, as a 100-host run has tens of thousands of events.
#[derive(Default)]
struct Schedule {
    heap: BinaryHeap<Reverse<(Duration, u8, u64, Event)>>,
    pushed: u64,
}

impl Schedule {
    fn push(&mut self, at: Duration, ev: Event) {
        let order = match ev {
            Event::Create(_) => 0,
            Event::Strike(_) => 1,
            Event::Lift(_) | Event::Upgrade(..) => 2,
        };
        self.pushed += 1;
        self.heap.push(Reverse((at, order, self.pushed, ev)));
    }

    /// The first event due at `now`, with its due time.
    fn pop_due(&mut self, now: Duration) -> Option<(Duration, Event)> {
        let Reverse((at, ..)) = self.heap.peek()?;
        if *at > now {
            return None;
        }
        self.heap.pop().map(|Reverse((at, _, _, ev))| (at, ev))
    }

    fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

/// What a request the loop sent off (so that a slow API delays no other event) came back with.
enum Answer {
    Created(usize, Result<(), String>),
    /// A one-shot fault's request (cancel, owner deleted) went through.
    Struck,
    /// A one-shot fault's request failed.
    StrikeFailed(usize, String),
}

/// The harness's kill for `k`; `None` for launchd's stop, which is not a kill.
fn mode(k: Kill) -> Option<KillMode> {
    match k {
        Kill::Group => Some(KillMode::Group),
        Kill::Alone => Some(KillMode::Alone),
        Kill::WithVms => Some(KillMode::GroupAndVms),
        Kill::Term => None,
    }
}

/// Runs the plan for `opts`; prints the checks and a summary; returns whether all passed.
pub async fn run(opts: Options) -> bool {
    let plan = plan::plan(&opts.sizes);
    let mut stack = Stack::new("chaos").await;
    assert!(
        stack.cluster.is_emulator(),
        "the chaos runner injects API faults, which needs the emulator: unset KUBECONFIG or set TARTAN_E2E_CLUSTER=emulator"
    );
    let mut log = Log {
        start: Instant::now(),
        lines: vec![],
        tally: BTreeMap::new(),
    };
    log.line(format!(
        "chaos seed {} builds {} hosts {} window {:.0}s faults {}; work dir {}",
        opts.sizes.seed,
        opts.sizes.builds,
        opts.sizes.hosts,
        opts.sizes.window.as_secs_f64(),
        opts.sizes.faults,
        stack.dir.display()
    ));
    for b in &plan.builds {
        log.line(format!(
            "plan +{:.1}s create {} (step {:.1}s{})",
            b.at.as_secs_f64(),
            b.name,
            b.step_secs,
            b.timeout.as_ref().map(|t| format!(", timeout {t}")).unwrap_or_default()
        ));
    }
    for f in &plan.faults {
        log.line(format!("plan +{:.1}s {}", f.at.as_secs_f64(), f.fault));
    }

    let hosts: Vec<String> = (0..opts.sizes.hosts).map(host_name).collect();
    for (i, h) in hosts.iter().enumerate() {
        stack.add_agent(
            h,
            AgentOptions {
                slots: opts.slots,
                pool: if i < opts.pool_hosts {
                    crate::stack::POOL_OF_ONE
                } else {
                    ""
                },
                ..opts.agent.clone()
            },
        );
        if opts.sizes.fleet {
            own_api_user(&stack, i).unwrap_or_else(|e| panic!("giving {h} an API user of its own: {e}"));
        }
    }
    let mut on = InForce {
        controllers: controllers::Controllers::new(opts.controller.clone(), opts.controller_replicas),
        ..InForce::default()
    };
    on.controllers.start(&mut stack);
    for h in &hosts {
        stack.start_agent(h).await;
        stack.start_watchdog(h);
    }
    log.line("stack up: controller, agents and watchdogs running");
    // For the reaper's test: the run's own code keeps its thread busy, as a 100-host run's
    // healing phase did; SIGTERM must still be seen.
    if let Some(secs) = std::env::var("TARTAN_CHAOS_TEST_BUSY_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        std::thread::sleep(Duration::from_secs(secs));
    }

    let mut events = Schedule::default();
    for (i, b) in plan.builds.iter().enumerate() {
        events.push(b.at, Event::Create(i));
    }
    for (i, f) in plan.faults.iter().enumerate() {
        events.push(f.at, Event::Strike(i));
    }
    let t0 = Instant::now();
    let mut findings = checks::Findings::default();
    let mut created: BTreeMap<usize, bool> = BTreeMap::new();
    let mut delivery_blocked = Vec::new();
    let mut last_sample = Instant::now();
    // API requests (creates, cancels, deletes) run as tasks of their own: awaited here, one
    // request under an injected latency or outage held up every later event, so faults lasted
    // many times their planned length (a 3.8 s controller kill lasted 38 s at 8 hosts).
    let (answers, mut answered) = mpsc::unbounded_channel::<Answer>();
    let mut in_flight = 0usize;
    let mut lateness: Vec<Duration> = vec![];
    // The run's processes carry the marker when the runner set it (scripts/chaos does).
    let marker = std::env::var(reaper::RUN_MARKER).ok();
    let mut usage = usage::Usage::default();
    let mut last_usage = Instant::now();
    loop {
        if let Some(m) = &marker
            && last_usage.elapsed() >= USAGE_EVERY
        {
            last_usage = Instant::now();
            usage.sample(m);
        }
        while let Ok(answer) = answered.try_recv() {
            in_flight -= 1;
            match answer {
                Answer::Created(i, Ok(())) => {
                    created.insert(i, true);
                    log.line(format!("created CustomRun {}", plan.builds[i].name));
                }
                Answer::Created(i, Err(e)) => {
                    log.line(format!("creating {} failed ({e}); again in 1s", plan.builds[i].name));
                    events.push(t0.elapsed() + Duration::from_secs(1), Event::Create(i));
                }
                Answer::Struck => {}
                Answer::StrikeFailed(i, e) => {
                    log.line(format!("{}: failed ({e}); not retried", plan.faults[i].fault));
                }
            }
        }
        // Sampled even while events are due: a process that exited on its own (the controller
        // at start during an outage) is restarted at once, not after a burst of events (at 20
        // hosts a controller stayed down 60 s that way).
        if last_sample.elapsed() >= opts.sample_every {
            last_sample = Instant::now();
            sample(&mut stack, &hosts, &mut on, opts.slots, &mut findings, &mut log);
        }
        let now = t0.elapsed();
        if let Some((at, ev)) = events.pop_due(now) {
            lateness.push(now.saturating_sub(at));
            match ev {
                Event::Create(i) => {
                    let api = stack.customruns();
                    let run = run_object(&stack, &plan.builds[i]);
                    let answers = answers.clone();
                    in_flight += 1;
                    tokio::spawn(async move {
                        let done = api.create(&PostParams::default(), &run).await;
                        let _ = answers.send(Answer::Created(i, done.map(|_| ()).map_err(|e| e.to_string())));
                    });
                }
                Event::Strike(i) if matches!(plan.faults[i].fault, Fault::RollingUpgrade { .. }) => {
                    let Fault::RollingUpgrade { gap } = plan.faults[i].fault else {
                        unreachable!("matched above")
                    };
                    if on.upgrading {
                        log.skipped(&plan.faults[i].fault, "an upgrade is under way");
                        continue;
                    }
                    on.upgrading = true;
                    log.struck(&plan.faults[i].fault);
                    for host in 0..hosts.len() {
                        events.push(now + gap * host as u32, Event::Upgrade(i, host));
                    }
                }
                Event::Strike(i) => {
                    let sent = Sent {
                        api: stack.customruns(),
                        answers: &answers,
                        in_flight: &mut in_flight,
                    };
                    if let Some(lift_in) = strike(&mut stack, &plan, i, &mut on, &created, sent, &mut log).await {
                        events.push(now + lift_in, Event::Lift(i));
                        if plan.faults[i].fault.blocks_delivery() {
                            let from = Timestamp::now();
                            let to = k8s_openapi::jiff::SignedDuration::try_from(lift_in)
                                .ok()
                                .and_then(|d| from.checked_add(d).ok())
                                .unwrap_or(from);
                            delivery_blocked.push((from, to));
                        }
                    }
                }
                Event::Lift(i) => lift(&mut stack, &plan.faults[i].fault, &mut on, &mut log).await,
                Event::Upgrade(i, host) => {
                    upgrade(&mut stack, host, &on, &mut log);
                    if host + 1 == hosts.len() {
                        on.upgrading = false;
                        log.line(format!("lift: {}", plan.faults[i].fault));
                    }
                }
            }
            continue;
        }
        if events.is_empty() && in_flight == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    log.line(format!("schedule kept: {}", lateness_summary(&mut lateness)));
    log.line("healing: every fault lifted");
    heal(&mut stack, &mut on, &mut log).await;
    let healed = wait_healed(&mut stack, &hosts, &opts, &mut on, &mut findings, &mut usage, &mut log).await;
    log.line(format!(
        "healing {} after {:.1}s",
        if healed { "done" } else { "gave up" },
        t0.elapsed().as_secs_f64()
    ));

    let world = crate::invariants::World {
        delivery_blocked,
        ..stack.world().await
    };
    findings.step_starts = std::fs::read_to_string(stack.dir.join("started"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    for line in checks::latency_report(&world) {
        log.line(line);
    }
    if let Some(m) = &marker {
        usage.sample(m);
        for line in usage.report(opts.sizes.builds) {
            log.line(line);
        }
    }
    for line in log.tally_lines() {
        log.line(line);
    }
    log.line(format!("wall time {:.1}s", log.start.elapsed().as_secs_f64()));
    let results = checks::all(&world, &findings, opts.slots);
    let mut failed = 0;
    for c in &results {
        match &c.failure {
            None => println!("PASS {}", c.name),
            Some(why) => {
                failed += 1;
                println!("FAIL {}: {why}", c.name);
            }
        }
    }
    println!(
        "chaos seed {}: {} passed, {failed} failed",
        opts.sizes.seed,
        results.len() - failed
    );
    if failed > 0 || opts.keep {
        let dir = stack.keep_files();
        let fault_log = dir.join("chaos.log");
        let _ = std::fs::write(&fault_log, log.lines.join("\n") + "\n");
        write_journals(&stack, &hosts, &dir);
        if failed > 0 {
            println!("--- seed {} fault log:", opts.sizes.seed);
            for l in log.lines.iter().filter(|l| !l.contains(" plan +")) {
                println!("{l}");
            }
            println!(
                "--- kept {} (chaos.log, journal-<host>.txt, agent/controller/watchdog logs); rerun: scripts/chaos --seed {} --builds {} --hosts {} --minutes {}",
                dir.display(),
                opts.sizes.seed,
                opts.sizes.builds,
                opts.sizes.hosts,
                opts.sizes.window.as_secs_f64() / 60.0
            );
        } else {
            println!("--- kept {}", dir.display());
        }
    }
    failed == 0
}

/// Each host's whole journal history, one record a line, prefixed with the build's name (the
/// record's own form names only the attempt).
fn write_journals(stack: &Stack, hosts: &[String], dir: &std::path::Path) {
    for h in hosts {
        let text: String = stack
            .journal(h)
            .iter()
            .map(|r| {
                let build = r.build.as_ref().map(|b| b.name.as_str()).unwrap_or("-");
                format!("{} {build} {r}\n", r.time)
            })
            .collect();
        let _ = std::fs::write(dir.join(format!("journal-{h}.txt")), text);
    }
}

/// How late events ran against the plan (p50, p99, max): a loaded machine or a slow harness
/// shows here, and a fault then lasted longer than planned.
fn lateness_summary(lateness: &mut [Duration]) -> String {
    lateness.sort();
    let at = |q: f64| {
        let i = ((lateness.len() as f64 * q).ceil() as usize).clamp(1, lateness.len().max(1)) - 1;
        lateness.get(i).copied().unwrap_or_default().as_secs_f64()
    };
    format!(
        "{} events, late by p50 {:.2}s p99 {:.2}s max {:.2}s",
        lateness.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    )
}

/// The CustomRun of `b`: the stack's build (as `Stack::try_create_run` makes it) with a `sleep`
/// step of the planned length.
fn run_object(stack: &Stack, b: &BuildPlan) -> DynamicObject {
    let mut params = stack.build_params(false);
    if let Some((_, Value::Array(steps))) = params.iter_mut().find(|(n, _)| *n == "steps") {
        steps.insert(1, json!(format!("sleep {:.1}", b.step_secs)));
    }
    let params: Vec<Value> = params.iter().map(|(n, v)| json!({"name": n, "value": v})).collect();
    let mut spec = json!({
        "customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"},
        "params": params,
        "serviceAccountName": "default",
    });
    if let Some(t) = &b.timeout {
        spec["timeout"] = json!(t);
    }
    serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
        "metadata": {"name": b.name, "namespace": stack.ns,
                     "labels": {"tekton.dev/pipelineRun": "e2e", "tekton.dev/pipelineTask": "mac-build"}},
        "spec": spec,
    }))
    .expect("a CustomRun is a DynamicObject")
}

/// Where a strike sends an API request it does not wait for.
struct Sent<'a> {
    api: Api<DynamicObject>,
    answers: &'a mpsc::UnboundedSender<Answer>,
    in_flight: &'a mut usize,
}

/// Applies fault `i`; returns when to lift it (`None`: one-shot, or skipped).
async fn strike(
    stack: &mut Stack,
    plan: &Plan,
    i: usize,
    on: &mut InForce,
    created: &BTreeMap<usize, bool>,
    sent: Sent<'_>,
    log: &mut Log,
) -> Option<Duration> {
    let fault = &plan.faults[i].fault;
    let skip = |log: &mut Log, why: &str| {
        log.skipped(fault, why);
        None
    };
    let lasting = Some(fault.duration());
    match fault {
        Fault::KillAgent { host, kill, .. } => {
            if on.agent_down.contains_key(host) {
                return skip(log, "agent already down");
            }
            on.agent_frozen.remove(host);
            match mode(*kill) {
                Some(mode) => stack.kill_agent(&host_name(*host), mode),
                // launchd's ExitTimeOut for the agent.
                None => {
                    stack.stop_agent(&host_name(*host), Duration::from_secs(60));
                }
            }
            on.agent_down.insert(*host, *kill);
        }
        Fault::FreezeAgent { host, .. } => {
            if on.agent_down.contains_key(host) || on.agent_frozen.contains_key(host) {
                return skip(log, "agent down or frozen");
            }
            stack.freeze_agent(&host_name(*host));
            on.agent_frozen.insert(*host, ());
        }
        Fault::KillController { .. } => {
            if on.controllers.all_down() {
                return skip(log, "controller already down");
            }
            on.controllers.kill_all(stack);
        }
        Fault::ControllerFailover { .. } => match on.controllers.kill_leader(stack).await {
            Ok(leader) => log.line(format!("the leader was {leader}")),
            Err(why) => return skip(log, &why),
        },
        Fault::ApiUnavailable { for_ } | Fault::ApiRefuses { for_ } => {
            if on.availability {
                return skip(log, "an outage is in force");
            }
            let a = if matches!(fault, Fault::ApiUnavailable { .. }) {
                "unavailable"
            } else {
                "refuse"
            };
            // The emulator restores itself after `forMs` (its control port would be unreachable).
            stack
                .cluster
                .emulator_faults(&json!({"availability": a, "forMs": for_.as_millis() as u64}));
            on.availability = true;
        }
        Fault::ApiLatency { latency, .. } => {
            if on.latency {
                return skip(log, "latency in force");
            }
            stack
                .cluster
                .emulator_faults(&json!({"latencyMs": latency.as_millis() as u64}));
            on.latency = true;
        }
        Fault::RefuseTerminalStatus { .. } => {
            if on.refusing {
                return skip(log, "already refusing");
            }
            stack.deny_terminal_status().await;
            on.refusing = true;
        }
        Fault::WatchStall { .. } => {
            if on.stalled {
                return skip(log, "watches already stalled");
            }
            stack.cluster.emulator_faults(&json!({"watchesStalled": true}));
            on.stalled = true;
        }
        Fault::WatchRestart => {
            stack.cluster.compact_watch_history();
            if !on.availability {
                stack
                    .cluster
                    .emulator_faults(&json!({"availability": "refuse", "forMs": 300}));
            }
        }
        Fault::RackPartition { hosts, .. } => {
            if on.partitioned {
                return skip(log, "a rack is already cut off");
            }
            let users: Vec<String> = hosts.iter().map(|h| agent_user(stack, *h)).collect();
            stack.cluster.emulator_faults(&json!({ "partitioned": users }));
            on.partitioned = true;
        }
        Fault::ApiBusy { busy, .. } => {
            if on.busy {
                return skip(log, "the API is already busy");
            }
            stack
                .cluster
                .emulator_faults(&json!({"busyMs": busy.as_millis() as u64}));
            on.busy = true;
        }
        Fault::RollingUpgrade { .. } => return skip(log, "run by the event loop"),
        Fault::TartDeleteFails { host, .. } => {
            if !set_tart(stack, on, *host, &[("delete_fails", json!(true))]) {
                return skip(log, "in force");
            }
        }
        Fault::TartSlow {
            host, clone, delete, ..
        } => {
            let faults = [("clone_delay_secs", json!(clone)), ("delete_delay_secs", json!(delete))];
            if !set_tart(stack, on, *host, &faults) {
                return skip(log, "in force");
            }
        }
        Fault::TartExecHangs { host, .. } => {
            if !set_tart(stack, on, *host, &[("exec_hangs", json!(true))]) {
                return skip(log, "in force");
            }
        }
        Fault::TartRunDies { host, after, .. } => {
            if !set_tart(stack, on, *host, &[("run_dies_after_secs", json!(after))]) {
                return skip(log, "in force");
            }
        }
        Fault::TartCloneTmpRace { host, gap, .. } => {
            if !set_tart(stack, on, *host, &[("clone_tmp_unlocked_secs", json!(gap))]) {
                return skip(log, "in force");
            }
        }
        Fault::Cancel { build } | Fault::DeleteOwner { build } => {
            if !created.contains_key(build) {
                return skip(log, "not created yet");
            }
            let name = build_name(*build);
            let cancel = matches!(fault, Fault::Cancel { .. });
            let (api, answers) = (sent.api, sent.answers.clone());
            *sent.in_flight += 1;
            // Tekton's cancel (`spec.status: RunCancelled`), or the owner deleted.
            tokio::spawn(async move {
                let done = if cancel {
                    let patch = Patch::Merge(json!({"spec": {"status": "RunCancelled"}}));
                    api.patch(&name, &PatchParams::default(), &patch).await.map(|_| ())
                } else {
                    api.delete(&name, &DeleteParams::background()).await.map(|_| ())
                };
                let _ = answers.send(match done {
                    Ok(()) => Answer::Struck,
                    Err(e) => Answer::StrikeFailed(i, e.to_string()),
                });
            });
            log.struck(fault);
            return None;
        }
    }
    log.struck(fault);
    lasting.filter(|d| !d.is_zero())
}

/// The emulator's user (its bearer token) of host `host`'s agent: each host has its own (see
/// [`own_api_user`]), so a rack can be cut off alone.
fn agent_user(stack: &Stack, host: usize) -> String {
    format!(
        "{}:{}",
        crate::cluster::service_account_user(&stack.ns, crate::cluster::AGENT_SERVICE_ACCOUNT),
        host_name(host)
    )
}

/// Gives host `host`'s agent a kubeconfig of its own whose token is [`agent_user`] (the
/// emulator authenticates nobody: a request's user is its token), written next to its config,
/// which is pointed at it.
fn own_api_user(stack: &Stack, host: usize) -> Result<(), String> {
    let agent = stack.agent(&host_name(host));
    let config = std::fs::read_to_string(&agent.config).map_err(|e| format!("{}: {e}", agent.config.display()))?;
    let shared = config
        .lines()
        .find_map(|l| l.strip_prefix("kubeconfig = \"").and_then(|l| l.strip_suffix('"')))
        .ok_or_else(|| format!("{}: no kubeconfig line", agent.config.display()))?;
    let mut kubeconfig: Value =
        serde_json::from_str(&std::fs::read_to_string(shared).map_err(|e| format!("{shared}: {e}"))?)
            .map_err(|e| format!("{shared}: {e}"))?;
    let users = kubeconfig["users"]
        .as_array_mut()
        .ok_or_else(|| format!("{shared}: no users"))?;
    for u in users {
        u["user"]["token"] = json!(agent_user(stack, host));
    }
    let own = agent.config.with_file_name("agent.kubeconfig");
    std::fs::write(&own, kubeconfig.to_string()).map_err(|e| format!("{}: {e}", own.display()))?;
    let config = config.replace(
        &format!("kubeconfig = \"{shared}\""),
        &format!("kubeconfig = \"{}\"", own.display()),
    );
    std::fs::write(&agent.config, config).map_err(|e| format!("{}: {e}", agent.config.display()))
}

/// One host of a rolling upgrade: launchd's stop of its agent (SIGTERM, waiting for it to exit)
/// and a start of the same program (the harness has one build). A host whose agent is down or
/// frozen by another fault is left as it is.
fn upgrade(stack: &mut Stack, host: usize, on: &InForce, log: &mut Log) {
    let name = host_name(host);
    if on.agent_down.contains_key(&host) || on.agent_frozen.contains_key(&host) || !stack.agent_alive(&name) {
        log.line(format!("upgrade: {name} skipped (its agent is down or frozen)"));
        return;
    }
    let took = stack.stop_agent(&name, Duration::from_secs(60));
    stack.spawn_agent(&name);
    log.line(format!(
        "upgrade: {name} stopped in {:.2}s and started again",
        took.as_secs_f64()
    ));
}

/// Sets tart-double faults on a host unless one of them is already in force.
fn set_tart(stack: &Stack, on: &mut InForce, host: usize, faults: &[(&'static str, Value)]) -> bool {
    let current = on.tart.entry(host).or_default();
    if faults.iter().any(|(k, _)| current.contains_key(k)) {
        return false;
    }
    for (k, v) in faults {
        current.insert(k, v.clone());
    }
    write_tart(stack, on, host);
    true
}

fn write_tart(stack: &Stack, on: &InForce, host: usize) {
    let global: serde_json::Map<String, Value> = on
        .tart
        .get(&host)
        .map(|m| m.iter().map(|(k, v)| (k.to_string(), v.clone())).collect())
        .unwrap_or_default();
    stack.tart_faults(&host_name(host), json!({"global": global}));
}

async fn lift(stack: &mut Stack, fault: &Fault, on: &mut InForce, log: &mut Log) {
    match fault {
        Fault::KillAgent { host, .. } => {
            if on.agent_down.remove(host).is_some() {
                stack.spawn_agent(&host_name(*host));
            }
        }
        Fault::FreezeAgent { host, .. } => {
            if on.agent_frozen.remove(host).is_some() {
                stack.thaw_agent(&host_name(*host));
            }
        }
        Fault::KillController { .. } => {
            if on.controllers.all_down() {
                on.controllers.restart_all(stack);
            }
        }
        Fault::ControllerFailover { .. } => {
            let restarted = on.controllers.restart_failed_over(stack);
            if !restarted.is_empty() {
                log.line(format!(
                    "lift: {fault} (restarted {} as a standby)",
                    restarted.join(", ")
                ));
            }
            return;
        }
        // Restored by the emulator itself after `forMs`.
        Fault::ApiUnavailable { .. } | Fault::ApiRefuses { .. } => on.availability = false,
        Fault::ApiLatency { .. } => {
            stack.cluster.emulator_faults(&json!({"latencyMs": 0}));
            on.latency = false;
        }
        Fault::RefuseTerminalStatus { .. } => {
            on.refusing = false;
            // Deny rules are lifted through the stack so the checker is told.
            stack.allow_terminal_status().await;
        }
        Fault::WatchStall { .. } => {
            stack.cluster.emulator_faults(&json!({"watchesStalled": false}));
            on.stalled = false;
        }
        Fault::TartDeleteFails { host, .. } => unset_tart(stack, on, *host, &["delete_fails"]),
        Fault::TartSlow { host, .. } => unset_tart(stack, on, *host, &["clone_delay_secs", "delete_delay_secs"]),
        Fault::TartExecHangs { host, .. } => unset_tart(stack, on, *host, &["exec_hangs"]),
        Fault::TartRunDies { host, .. } => unset_tart(stack, on, *host, &["run_dies_after_secs"]),
        Fault::TartCloneTmpRace { host, .. } => unset_tart(stack, on, *host, &["clone_tmp_unlocked_secs"]),
        Fault::RackPartition { .. } => {
            stack.cluster.emulator_faults(&json!({ "partitioned": [] }));
            on.partitioned = false;
        }
        Fault::ApiBusy { .. } => {
            stack.cluster.emulator_faults(&json!({"busyMs": 0}));
            on.busy = false;
        }
        Fault::WatchRestart | Fault::Cancel { .. } | Fault::DeleteOwner { .. } | Fault::RollingUpgrade { .. } => return,
    }
    log.line(format!("lift: {fault}"));
}

fn unset_tart(stack: &Stack, on: &mut InForce, host: usize, keys: &[&'static str]) {
    if let Some(m) = on.tart.get_mut(&host) {
        for k in keys {
            m.remove(k);
        }
    }
    write_tart(stack, on, host);
}

/// Lifts everything in force: agents restarted or thawed, the controller restarted, the API
/// healthy, tart-double without faults.
async fn heal(stack: &mut Stack, on: &mut InForce, log: &mut Log) {
    for (host, _) in std::mem::take(&mut on.agent_frozen) {
        stack.thaw_agent(&host_name(host));
        log.line(format!("heal: SIGCONT {}", host_name(host)));
    }
    for (host, _) in std::mem::take(&mut on.agent_down) {
        stack.spawn_agent(&host_name(host));
        log.line(format!("heal: restart agent {}", host_name(host)));
    }
    if on.controllers.heal(stack) {
        log.line("heal: restart the controller processes that were down");
    }
    stack.cluster.emulator_faults(&json!({
        "availability": "up", "latencyMs": 0, "watchesStalled": false, "deny": [], "partitioned": [], "busyMs": 0
    }));
    stack.allow_terminal_status().await;
    for host in on.tart.keys().copied().collect::<Vec<_>>() {
        on.tart.remove(&host);
        write_tart(stack, on, host);
    }
    *on = InForce {
        controllers: std::mem::take(&mut on.controllers),
        ..InForce::default()
    };
}

/// Every 300 ms: VMs on disk per host (never more than its slots), and no process the runner
/// did not kill has exited (restarted if it has, and reported).
fn sample(stack: &mut Stack, hosts: &[String], on: &mut InForce, slots: u8, f: &mut checks::Findings, log: &mut Log) {
    for (i, h) in hosts.iter().enumerate() {
        let vms: Vec<String> = stack
            .vms(h)
            .into_iter()
            .filter(|v| v.starts_with(tartan_api::VM_PREFIX))
            .collect();
        if vms.len() > usize::from(slots) {
            f.over_slots.push(format!(
                "+{:.1}s {h}: {} VMs on disk ({}) with {slots} slots",
                log.start.elapsed().as_secs_f64(),
                vms.len(),
                vms.join(", ")
            ));
        }
        if !on.agent_down.contains_key(&i)
            && stack.agent_started(h)
            && let Some(status) = stack.agent_exit_status(h)
        {
            let log_file = stack.agent_logs(h).into_iter().next().unwrap_or_default();
            let crashed = crashed(status);
            let msg = format!(
                "agent {h} exited on its own ({status}{}; log {}); restarted as launchd would",
                if crashed { ", a crash" } else { "" },
                log_file.display()
            );
            log.line(&msg);
            if crashed {
                f.exited.push(msg);
            }
            stack.forget_exited_agent(h);
            stack.spawn_agent(h);
        }
        if !stack.watchdog_alive(h) {
            let msg = format!("watchdog of {h} exited on its own; restarted");
            log.line(&msg);
            f.exited.push(msg);
            stack.forget_exited_watchdog(h);
            stack.start_watchdog(h);
        }
    }
    for (name, status) in on.controllers.restart_exited(stack) {
        let crashed = crashed(status);
        let msg = format!(
            "{name} exited on its own ({status}{}); restarted as its Deployment would",
            if crashed { ", a crash" } else { "" }
        );
        log.line(&msg);
        if crashed {
            f.exited.push(msg);
        }
    }
}

/// An exit with an error code is the agent's and the controller's documented way out when the
/// API is unreachable at start (launchd or the Deployment restarts them, as the runner does); a
/// signal or a panic (101) is a crash.
fn crashed(status: std::process::ExitStatus) -> bool {
    status.code().is_none_or(|c| c == 101)
}

/// Waits (bounded by `opts.heal`) until every CustomRun has ended and every attempt in every
/// journal is retired (a quarantine resolves once `tart delete` works again).
async fn wait_healed(
    stack: &mut Stack,
    hosts: &[String],
    opts: &Options,
    on: &mut InForce,
    f: &mut checks::Findings,
    usage: &mut usage::Usage,
    log: &mut Log,
) -> bool {
    let start = Instant::now();
    let marker = std::env::var(reaper::RUN_MARKER).ok();
    let mut last_report = Instant::now();
    loop {
        sample(stack, hosts, on, opts.slots, f, log);
        if let Some(m) = &marker {
            usage.sample(m);
        }
        let world = stack.world().await;
        let open = checks::not_ended(&world);
        let unretired = checks::open_attempts(&world);
        if open.is_empty() && unretired.is_empty() {
            return true;
        }
        if start.elapsed() >= opts.heal {
            log.line(format!(
                "healing: still open after {:.0}s: runs {open:?}; attempts {unretired:?}",
                opts.heal.as_secs_f64()
            ));
            return false;
        }
        if last_report.elapsed() >= Duration::from_secs(15) {
            last_report = Instant::now();
            log.line(format!("healing: waiting for runs {open:?}; attempts {unretired:?}"));
        }
        // Each look reads every journal and lists every object: less often with more hosts.
        tokio::time::sleep(Duration::from_millis(500).max(Duration::from_millis(100) * hosts.len() as u32)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_gives_due_events_by_time_then_create_strike_lift_then_push_order() {
        let s = |ms| Duration::from_millis(ms);
        let mut events = Schedule::default();
        events.push(s(300), Event::Lift(1));
        events.push(s(100), Event::Lift(0));
        events.push(s(100), Event::Strike(4));
        events.push(s(100), Event::Create(7));
        events.push(s(100), Event::Create(2));
        events.push(s(200), Event::Strike(5));
        assert_eq!(events.pop_due(s(50)), None);
        let mut order = vec![];
        while let Some(e) = events.pop_due(s(250)) {
            order.push(e);
        }
        assert_eq!(
            order,
            vec![
                (s(100), Event::Create(7)),
                (s(100), Event::Create(2)),
                (s(100), Event::Strike(4)),
                (s(100), Event::Lift(0)),
                (s(200), Event::Strike(5)),
            ]
        );
        assert!(!events.is_empty());
        assert_eq!(events.pop_due(s(300)), Some((s(300), Event::Lift(1))));
        assert!(events.is_empty());
    }

    #[test]
    fn lateness_is_summarised_by_p50_p99_and_max() {
        let mut none: Vec<Duration> = vec![];
        assert_eq!(
            lateness_summary(&mut none),
            "0 events, late by p50 0.00s p99 0.00s max 0.00s"
        );
        let mut late: Vec<Duration> = (1..=100).rev().map(|i| Duration::from_millis(i * 10)).collect();
        assert_eq!(
            lateness_summary(&mut late),
            "100 events, late by p50 0.50s p99 0.99s max 1.00s"
        );
    }
}
