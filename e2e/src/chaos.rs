//! The chaos runner (`scripts/chaos`): the whole local stack with several agent hosts, a seeded
//! random schedule of every fault the harness can inject ([`plan`]), a healing phase with every
//! fault lifted, then every invariant and the run-wide checks ([`checks`]), one line each.

pub mod checks;
pub mod plan;

use crate::stack::{AgentOptions, ControllerOptions, KillMode, Stack};
use k8s_openapi::jiff::Timestamp;
use plan::{BuildPlan, Fault, Kill, Plan, Sizes, build_name, host_name};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::{Duration, Instant};

/// Everything `scripts/chaos` can set.
#[derive(Clone, Debug)]
pub struct Options {
    pub sizes: Sizes,
    /// Slots per host.
    pub slots: u8,
    /// The longest the healing phase waits for every CustomRun to end and every VM to go.
    pub heal: Duration,
    pub agent: AgentOptions,
    pub controller: ControllerOptions,
    /// Keep the work directory even when every check passes.
    pub keep: bool,
}

/// The run's log: every line printed with its time since the start and the wall clock, and kept
/// (the fault log printed again on failure).
struct Log {
    start: Instant,
    lines: Vec<String>,
}

impl Log {
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

/// What is in force right now (so overlapping faults of one kind are skipped, and healing lifts
/// exactly what is on).
#[derive(Default)]
struct InForce {
    /// Per host: killed (restart pending) or frozen.
    agent_down: BTreeMap<usize, Kill>,
    agent_frozen: BTreeMap<usize, ()>,
    controller_down: bool,
    availability: bool,
    latency: bool,
    refusing: bool,
    stalled: bool,
    /// Per host: tart-double faults by name (`delete_fails`, `clone_delay_secs`, ...).
    tart: BTreeMap<usize, BTreeMap<&'static str, Value>>,
}

enum Event {
    Create(usize),
    Strike(usize),
    Lift(usize),
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
    for h in &hosts {
        stack.add_agent(
            h,
            AgentOptions {
                slots: opts.slots,
                ..opts.agent.clone()
            },
        );
    }
    stack.start_controller(opts.controller.clone());
    for h in &hosts {
        stack.start_agent(h).await;
        stack.start_watchdog(h);
    }
    log.line("stack up: controller, agents and watchdogs running");

    let mut events: Vec<(Duration, u8, Event)> = vec![];
    for (i, b) in plan.builds.iter().enumerate() {
        events.push((b.at, 0, Event::Create(i)));
    }
    for (i, f) in plan.faults.iter().enumerate() {
        events.push((f.at, 1, Event::Strike(i)));
    }
    let t0 = Instant::now();
    let mut on = InForce::default();
    let mut findings = checks::Findings::default();
    let mut created: BTreeMap<usize, bool> = BTreeMap::new();
    let mut delivery_blocked = Vec::new();
    let mut last_sample = Instant::now();
    loop {
        events.sort_by_key(|(at, order, _)| (*at, *order));
        let now = t0.elapsed();
        let due = events.first().is_some_and(|(at, _, _)| *at <= now);
        if due {
            let (_, _, ev) = events.remove(0);
            match ev {
                Event::Create(i) => {
                    let b = &plan.builds[i];
                    match create(&stack, b).await {
                        Ok(()) => {
                            created.insert(i, true);
                            log.line(format!("created CustomRun {}", b.name));
                        }
                        Err(e) => {
                            log.line(format!("creating {} failed ({e}); again in 1s", b.name));
                            events.push((now + Duration::from_secs(1), 0, Event::Create(i)));
                        }
                    }
                }
                Event::Strike(i) => {
                    if let Some(lift_in) = strike(&mut stack, &plan, i, &mut on, &created, &mut log).await {
                        events.push((now + lift_in, 2, Event::Lift(i)));
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
            }
            continue;
        }
        if events.is_empty() {
            break;
        }
        if last_sample.elapsed() >= Duration::from_millis(300) {
            last_sample = Instant::now();
            sample(&mut stack, &hosts, &on, opts.slots, &mut findings, &mut log);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    log.line("healing: every fault lifted");
    heal(&mut stack, &mut on, &mut log).await;
    let healed = wait_healed(&mut stack, &hosts, &opts, &mut findings, &mut log).await;
    log.line(format!(
        "healing {} after {:.1}s",
        if healed { "done" } else { "gave up" },
        t0.elapsed().as_secs_f64()
    ));

    let world = crate::invariants::World {
        delivery_blocked,
        ..stack.world().await
    };
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

async fn create(stack: &Stack, b: &BuildPlan) -> Result<(), kube::Error> {
    let mut params = stack.build_params(false);
    if let Some((_, Value::Array(steps))) = params.iter_mut().find(|(n, _)| *n == "steps") {
        steps.insert(1, json!(format!("sleep {:.1}", b.step_secs)));
    }
    stack.try_create_run(&b.name, &params, b.timeout.as_deref()).await
}

/// Applies fault `i`; returns when to lift it (`None`: one-shot, or skipped).
async fn strike(
    stack: &mut Stack,
    plan: &Plan,
    i: usize,
    on: &mut InForce,
    created: &BTreeMap<usize, bool>,
    log: &mut Log,
) -> Option<Duration> {
    let fault = &plan.faults[i].fault;
    let skip = |log: &mut Log, why: &str| {
        log.line(format!("skip: {fault} ({why})"));
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
            if on.controller_down {
                return skip(log, "controller already down");
            }
            stack.kill_controller();
            on.controller_down = true;
        }
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
            let done = if matches!(fault, Fault::Cancel { .. }) {
                stack.try_cancel_run(&name).await
            } else {
                stack.try_delete_run(&name).await
            };
            if let Err(e) = done {
                log.line(format!("{fault}: failed ({e}); not retried"));
                return None;
            }
            log.line(format!("strike: {fault}"));
            return None;
        }
    }
    log.line(format!("strike: {fault}"));
    lasting.filter(|d| !d.is_zero())
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
            if on.controller_down {
                stack.restart_controller();
                on.controller_down = false;
            }
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
        Fault::WatchRestart | Fault::Cancel { .. } | Fault::DeleteOwner { .. } => return,
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
    if std::mem::take(&mut on.controller_down) {
        stack.restart_controller();
        log.line("heal: restart controller");
    }
    stack.cluster.emulator_faults(&json!({
        "availability": "up", "latencyMs": 0, "watchesStalled": false, "deny": []
    }));
    stack.allow_terminal_status().await;
    for host in on.tart.keys().copied().collect::<Vec<_>>() {
        on.tart.remove(&host);
        write_tart(stack, on, host);
    }
    *on = InForce::default();
}

/// Every 300 ms: VMs on disk per host (never more than its slots), and no process the runner
/// did not kill has exited (restarted if it has, and reported).
fn sample(stack: &mut Stack, hosts: &[String], on: &InForce, slots: u8, f: &mut checks::Findings, log: &mut Log) {
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
    if !on.controller_down
        && stack.controller_started()
        && let Some(status) = stack.controller_exit_status()
    {
        let crashed = crashed(status);
        let msg = format!(
            "controller exited on its own ({status}{}); restarted as its Deployment would",
            if crashed { ", a crash" } else { "" }
        );
        log.line(&msg);
        if crashed {
            f.exited.push(msg);
        }
        stack.forget_exited_controller();
        stack.restart_controller();
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
    f: &mut checks::Findings,
    log: &mut Log,
) -> bool {
    let start = Instant::now();
    let mut last_report = Instant::now();
    let on = InForce::default();
    loop {
        sample(stack, hosts, &on, opts.slots, f, log);
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
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
