//! `scripts/bench-agent`: one real agent (release build, 2 slots, its own state dir and
//! tart-double home) on the API emulator, measured on what issue 16 found:
//! - idle CPU and memory (VmRSS, VmHWM) over a window, with no MacBuilds and with 1,000 finished
//!   MacBuilds another agent holds in its namespace (figure 4), also with `namespaces = []`;
//! - recovery at start with a journal of a few records and of ~1,400 (figure 5): from the
//!   process's exec to its `recovery planned` log line, and from `agent starting` (journal
//!   replayed) to it;
//! - redelivery (figure 3): 200 terminal statuses the API refused, journaled, then the agent
//!   restarted with the API accepting them: time until all are on the MacBuilds, and the longest
//!   gap between the agent's Lease renewals meanwhile (from the emulator's answers log).
//!
//! The journals are real: the agent runs the builds (tart-double, short boot, `true` as the one
//! step), so any agent binary (`--agent-bin`, e.g. one built from an older commit) is measured on
//! journals it wrote itself.

use crate::fleet::{cpu_ticks, loadavg, memory_kib, percentile, ticks_per_second};
use crate::stack::{AgentOptions, IMAGE, Stack};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tartan_api::{AttemptState, Claim, MacBuild, MacBuildSpec, MacBuildStatus, Outcome, Phase, Step};

/// The agent under test.
const ID: &str = "mac-00";
/// The agent that "holds" the foreign MacBuilds (no process: only their status names it).
const OTHER: &str = "mac-other";
/// The label every MacBuild this bench creates carries, with its group as value.
const GROUP_LABEL: &str = "bench-agent/group";

/// What one run measures.
#[derive(Clone, Debug)]
pub struct AgentBenchOptions {
    /// How long the agent is watched idle for each idle figure.
    pub idle: Duration,
    /// Finished MacBuilds held by another agent, for the second idle figure.
    pub foreign: usize,
    /// Journal records wanted for the large recovery figure.
    pub records: usize,
    /// Undelivered terminal statuses at the restart of the redelivery figure.
    pub redeliver: usize,
    /// Restarts measured per recovery figure.
    pub repeats: usize,
    /// Before each figure, wait (up to 2 min) for the 1-minute load to drop below this.
    pub max_load: f64,
    /// Also measure idle with `namespaces = []` (the agent watches every namespace).
    pub all_namespaces: bool,
    /// Keep the stack's files (journals, logs) after the run.
    pub keep: bool,
}

/// One measured figure: what, its value, and the machine's 1-minute load before and after.
#[derive(Clone, Debug)]
pub struct Figure {
    pub name: String,
    pub value: String,
    pub load: String,
}

/// The figures of one agent binary.
#[derive(Clone, Debug)]
pub struct Report {
    pub label: String,
    pub binary: String,
    pub notes: Vec<String>,
    pub figures: Vec<Figure>,
}

impl Report {
    fn push(&mut self, name: impl Into<String>, value: impl Into<String>, load: &str) {
        let figure = Figure {
            name: name.into(),
            value: value.into(),
            load: format!("{load} -> {}", one_minute_load()),
        };
        eprintln!("[bench-agent] {}: {} (load {})", figure.name, figure.value, figure.load);
        self.figures.push(figure);
    }
}

/// `text` (an agent config) without field `field`: its `field = ...` line, or its `[field]`
/// table (the header and the lines up to the next header).
pub fn without_field(text: &str, field: &str) -> String {
    let mut out = String::new();
    let mut in_table = false;
    for l in text.lines() {
        let t = l.trim();
        if t.starts_with('[') {
            in_table = t.trim_matches(|c| c == '[' || c == ']').trim() == field;
        }
        let key = t.split('=').next().unwrap_or_default().trim();
        if in_table || (t.contains('=') && key == field) {
            continue;
        }
        out.push_str(l);
        out.push('\n');
    }
    out
}

/// The field an agent refused its config for (serde's ``unknown field `X` ``), from its log.
pub fn unknown_field(log: &str) -> Option<String> {
    let rest = log.split("unknown field `").nth(1)?;
    Some(rest.split('`').next()?.to_string())
}

/// `text` (an agent config) with its `namespaces` line set to `value` (a TOML array).
pub fn with_namespaces(text: &str, value: &str) -> String {
    text.lines()
        .map(|l| {
            if l.split('=').next().unwrap_or_default().trim() == "namespaces" {
                format!("namespaces = {value}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect()
}

/// The time of the first line of an agent's text log that contains `needle` (lines start with
/// an RFC 3339 timestamp).
pub fn log_time(log: &str, needle: &str) -> Option<Timestamp> {
    log.lines()
        .find(|l| l.contains(needle))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|t| t.parse().ok())
}

/// Successful renewals (`PUT`/`PATCH` answered 2xx) of Lease `name` in the emulator's answers,
/// as milliseconds since the epoch, in order; and how many such writes failed in `window`.
pub fn lease_renewals(answers: &Value, name: &str, window: std::ops::RangeInclusive<u64>) -> (Vec<u64>, usize) {
    let suffix = format!("/leases/{name}");
    let mut ok = Vec::new();
    let mut failed = 0;
    for a in answers["answers"].as_array().into_iter().flatten() {
        let method = a["method"].as_str().unwrap_or_default();
        let path = a["uri"]
            .as_str()
            .unwrap_or_default()
            .split('?')
            .next()
            .unwrap_or_default();
        if !matches!(method, "PUT" | "PATCH") || !path.ends_with(&suffix) {
            continue;
        }
        let at = a["at_ms"].as_u64().unwrap_or(0);
        if (200..300).contains(&a["code"].as_u64().unwrap_or(0)) {
            ok.push(at);
        } else if window.contains(&at) {
            failed += 1;
        }
    }
    ok.sort_unstable();
    (ok, failed)
}

/// The longest gap between successive renewals in `renewals` (sorted) from the first at or
/// after `from` (the agent's exec: an earlier one is its previous run's) through the first after
/// `to`, which closes the last gap; and that first renewal.
pub fn longest_gap(renewals: &[u64], from: u64, to: u64) -> (Option<u64>, Option<u64>) {
    let mine: Vec<u64> = renewals.iter().copied().filter(|&t| t >= from).collect();
    let until = mine.iter().position(|&t| t > to).map_or(mine.len(), |i| i + 1);
    let gap = mine[..until].windows(2).map(|w| w[1] - w[0]).max();
    (gap, mine.first().copied())
}

fn one_minute_load() -> String {
    loadavg().split(' ').next().unwrap_or("?").to_string()
}

/// Waits (up to 2 minutes) for the 1-minute load to drop below `max`; returns it.
async fn calm(max: f64) -> String {
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let load = one_minute_load();
        let now: f64 = load.parse().unwrap_or(0.0);
        if now < max || Instant::now() >= until {
            if now >= max {
                eprintln!("[bench-agent] load {load} still >= {max} after 2 min: measuring anyway");
            }
            return load;
        }
        eprintln!("[bench-agent] load {load} >= {max}: waiting");
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

fn ms(d: f64) -> String {
    format!("{d:.0} ms")
}

fn now_ms() -> u64 {
    Timestamp::now().as_millisecond() as u64
}

/// Idle CPU (% of one core), VmRSS and VmHWM (since its start: the agent is restarted before
/// each idle figure but the first) of the agent over `window`, and the API requests it made
/// meanwhile.
async fn idle(stack: &Stack, window: Duration) -> String {
    let pid = stack.agent_pid(ID).expect("the agent runs");
    let from = now_ms();
    let ticks0 = cpu_ticks(pid);
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let secs = started.elapsed().as_secs_f64();
    let ticks = cpu_ticks(pid) - ticks0;
    let to = now_ms();
    let (rss, hwm) = memory_kib(pid);
    let requests = stack.cluster.emulator_answers().map_or(0, |answers| {
        answers["answers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| {
                a["user"].as_str().unwrap_or_default().contains("tartan-agent")
                    && (from..=to).contains(&a["at_ms"].as_u64().unwrap_or(0))
            })
            .count()
    });
    format!(
        "CPU {:.3} % ({ticks} ticks in {secs:.0} s), RSS {:.1} MiB, VmHWM {:.1} MiB, {:.0} API requests/min",
        100.0 * ticks as f64 / ticks_per_second() / secs,
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0,
        requests as f64 * 60.0 / secs
    )
}

fn macbuild(stack: &Stack, name: &str, group: &str) -> MacBuild {
    let mut mb = MacBuild::new(
        name,
        MacBuildSpec::new(IMAGE, vec![Step::new("work", vec!["true".to_string()])]),
    );
    mb.metadata.namespace = Some(stack.ns.clone());
    mb.metadata.labels = Some(BTreeMap::from([(GROUP_LABEL.to_string(), group.to_string())]));
    mb
}

/// Creates `names` (group `group`), 16 requests in flight; with `status`, writes it to each too.
async fn create_all(stack: &Stack, group: &str, names: &[String], status: Option<fn(&str) -> MacBuildStatus>) {
    let api: Api<MacBuild> = Api::namespaced(stack.client.clone(), &stack.ns);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, name) in names.iter().enumerate() {
        if i >= 16 {
            tasks.join_next().await.expect("a task").expect("creating a MacBuild");
        }
        let (api, mb, name) = (api.clone(), macbuild(stack, name, group), name.clone());
        tasks.spawn(async move {
            api.create(&PostParams::default(), &mb)
                .await
                .unwrap_or_else(|e| panic!("creating MacBuild {name}: {e}"));
            if let Some(status) = status {
                let patch = Patch::Merge(json!({ "status": status(&name) }));
                api.patch_status(&name, &PatchParams::default(), &patch)
                    .await
                    .unwrap_or_else(|e| panic!("writing the status of MacBuild {name}: {e}"));
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("creating a MacBuild");
    }
}

/// A finished build another agent held.
fn foreign_status(name: &str) -> MacBuildStatus {
    MacBuildStatus {
        phase: Some(Phase::Succeeded),
        outcome: Some(Outcome::Succeeded),
        claim: Some(Claim {
            holder: OTHER.to_string(),
            attempt: tartan_api::attempt_id(name, 1),
            epoch: 1,
        }),
        journal_seq: Some(12),
        ..MacBuildStatus::default()
    }
}

/// How many MacBuilds of `group` have a terminal phase on the API.
async fn terminal_in(stack: &Stack, group: &str) -> Result<usize, String> {
    let api: Api<MacBuild> = Api::namespaced(stack.client.clone(), &stack.ns);
    let list = api
        .list(&ListParams::default().labels(&format!("{GROUP_LABEL}={group}")))
        .await
        .map_err(|e| format!("listing MacBuilds of {group}: {e}"))?;
    Ok(list
        .items
        .iter()
        .filter(|m| m.status.as_ref().and_then(|s| s.phase).is_some_and(|p| p.is_terminal()))
        .count())
}

/// Creates `n` builds of `group` and waits until each is terminal on the API (or, with
/// `journaled_only`, until the agent journaled each one's `Retired`: the API refuses the status).
async fn run_builds(stack: &Stack, group: &str, n: usize, journaled_only: bool) {
    let names: Vec<String> = (0..n).map(|i| format!("{group}-{i:04}")).collect();
    create_all(stack, group, &names, None).await;
    let wanted: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    // Two slots, about half a second a build on tart-double, and a margin for a loaded machine.
    let limit = Duration::from_secs(120) + Duration::from_secs(2) * n as u32;
    let started = Instant::now();
    let wanted = &wanted;
    crate::wait_for_async(&format!("{n} builds of {group} to finish"), limit, || async move {
        let done = if journaled_only {
            let retired: BTreeSet<String> = stack
                .journal(ID)
                .into_iter()
                .filter(|r| r.to == AttemptState::Retired)
                .filter_map(|r| r.build.map(|b| b.name))
                .filter(|name| wanted.contains(name.as_str()))
                .collect();
            retired.len()
        } else {
            terminal_in(stack, group).await?
        };
        if done == n {
            Ok(())
        } else {
            Err(format!("{done} of {n} finished"))
        }
    })
    .await;
    eprintln!(
        "[bench-agent] {n} builds of {group} finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Restarts the agent `repeats` times (SIGTERM, then start): per start, milliseconds from its
/// exec to `recovery planned` and from `agent starting` to it.
async fn recovery(stack: &mut Stack, repeats: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut total, mut cluster) = (vec![], vec![]);
    for _ in 0..repeats {
        stack.stop_agent(ID, Duration::from_secs(60));
        let planned = restart(stack).await;
        total.push(planned.0);
        cluster.push(planned.1);
    }
    total.sort_by(f64::total_cmp);
    cluster.sort_by(f64::total_cmp);
    (total, cluster)
}

/// Starts the (stopped) agent; waits for its `recovery planned` line and its first Lease renewal.
/// Returns milliseconds from exec to that line and from `agent starting` to it.
async fn restart(stack: &mut Stack) -> (f64, f64) {
    stack.spawn_agent(ID);
    // Taken once the exec happened (std's spawn returns after it).
    let exec = Timestamp::now();
    let (starting, planned) = crate::wait_for(
        &format!("agent {ID} to plan its recovery"),
        Duration::from_secs(120),
        || {
            let log = stack.agent_log(ID);
            match (log_time(&log, "agent starting"), log_time(&log, "recovery planned")) {
                (Some(s), Some(p)) => Ok((s, p)),
                _ => Err(format!(
                    "no `recovery planned` yet; log tail:\n{}",
                    log.lines().rev().take(5).collect::<Vec<_>>().join("\n")
                )),
            }
        },
    )
    .await;
    stack.wait_lease_renewed(ID, exec).await;
    let since = |t: Timestamp, from: Timestamp| (t.as_microsecond() - from.as_microsecond()) as f64 / 1000.0;
    (since(planned, exec), since(planned, starting))
}

/// Starts the agent and waits until it renews its Lease; `Err(field)` if it exited refusing
/// its config for an unknown `field` (then it is forgotten, ready to start again).
async fn start_or_refused(stack: &mut Stack) -> Result<(), String> {
    let started = Timestamp::now();
    stack.spawn_agent(ID);
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(stack.client.clone(), &stack.ns);
    let limit = Instant::now() + Duration::from_secs(60);
    loop {
        if stack.agent_exit_status(ID).is_some() {
            let log = stack.agent_log(ID);
            let field = unknown_field(&log).unwrap_or_else(|| panic!("agent {ID} exited at its start; log:\n{log}"));
            stack.forget_exited_agent(ID);
            return Err(field);
        }
        let renewed = leases
            .get_opt(&format!("tartan-agent-{ID}"))
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec?.renew_time)
            .is_some_and(|t| t.0.as_second() >= started.as_second());
        if renewed {
            return Ok(());
        }
        assert!(
            Instant::now() < limit,
            "agent {ID} did not renew its Lease within 60 s of its start; log:\n{}",
            stack.agent_log(ID)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn spread(v: &[f64]) -> String {
    format!(
        "median {} (min {}, max {}; n={})",
        ms(percentile(v, 50.0).unwrap_or(0.0)),
        ms(v.first().copied().unwrap_or(0.0)),
        ms(v.last().copied().unwrap_or(0.0)),
        v.len()
    )
}

/// Runs every figure for the agent at `binary` (`None`: the workspace's release build).
pub async fn run(label: &str, binary: Option<PathBuf>, opts: &AgentBenchOptions) -> Report {
    let mut stack = Stack::new("bench-agent").await;
    stack.add_agent(
        ID,
        AgentOptions {
            slots: 2,
            boot_delay_secs: 0.05,
            step_poll: "100ms",
            claim_spread: "0s",
            uncached_claim_delay: "0s",
            compaction_interval: "1h",
            ..AgentOptions::default()
        },
    );
    let shown = binary
        .as_ref()
        .map_or_else(|| crate::bins::bin("tartan-agent"), Clone::clone);
    let mut report = Report {
        label: label.to_string(),
        binary: shown.display().to_string(),
        notes: vec![],
        figures: vec![],
    };
    let config_path = stack.agent(ID).config.clone();
    let read_config = || std::fs::read_to_string(&config_path).expect("the agent's config is readable");
    if let Some(b) = &binary {
        stack.set_agent_binary(ID, b);
    }
    // An older agent refuses fields it does not know: each one it names is left out, and it is
    // started again.
    while let Err(field) = start_or_refused(&mut stack).await {
        std::fs::write(&config_path, without_field(&read_config(), &field)).expect("writing the agent's config");
        report.notes.push(format!(
            "it does not know the config field `{field}`: left out (the bench sets claim_spread and uncached_claim_delay to 0s, secrets to none)"
        ));
    }
    eprintln!(
        "[bench-agent] {label}: agent {} runs in namespace {}",
        shown.display(),
        stack.ns
    );

    // Figure 4: idle.
    let settle = Duration::from_secs(6);
    tokio::time::sleep(settle).await;
    let load = calm(opts.max_load).await;
    let value = idle(&stack, opts.idle).await;
    report.push("idle, no MacBuilds", value, &load);

    // Created while the agent is stopped: a MacBuild's status is written after its creation,
    // and a running agent would race to claim it in between (and journal its lost claims).
    let names: Vec<String> = (0..opts.foreign).map(|i| format!("foreign-{i:04}")).collect();
    stack.stop_agent(ID, Duration::from_secs(60));
    let started = Instant::now();
    create_all(&stack, "foreign", &names, Some(foreign_status)).await;
    eprintln!(
        "[bench-agent] {} finished MacBuilds held by {OTHER} created in {:.1} s",
        opts.foreign,
        started.elapsed().as_secs_f64()
    );
    stack.start_agent(ID).await;
    // The agent has listed them all and rescanned at least once (every 5 s; 0.5 s before).
    tokio::time::sleep(settle).await;
    let load = calm(opts.max_load).await;
    let value = idle(&stack, opts.idle).await;
    report.push(
        format!("idle, {} finished MacBuilds of another agent", opts.foreign),
        value,
        &load,
    );

    if opts.all_namespaces {
        let set = read_config();
        stack.stop_agent(ID, Duration::from_secs(60));
        std::fs::write(&config_path, with_namespaces(&set, "[]")).expect("writing the agent's config");
        stack.start_agent(ID).await;
        tokio::time::sleep(settle).await;
        let load = calm(opts.max_load).await;
        let value = idle(&stack, opts.idle).await;
        report.push(
            format!("idle, {} finished of another agent, namespaces = []", opts.foreign),
            value,
            &load,
        );
        stack.stop_agent(ID, Duration::from_secs(60));
        std::fs::write(&config_path, set).expect("writing the agent's config");
        stack.start_agent(ID).await;
    }

    // Figure 5: recovery with one build's records, then with ~`records`.
    run_builds(&stack, "one", 1, false).await;
    let per_build = stack.journal_on_disk(ID).len().max(1);
    let load = calm(opts.max_load).await;
    let (total, cluster) = recovery(&mut stack, opts.repeats).await;
    report.push(
        "recovery, one build journaled: exec -> recovery planned",
        format!("{per_build} records: {}", spread(&total)),
        &load,
    );
    report.push("  of which agent starting -> recovery planned", spread(&cluster), &load);

    let more = opts.records.saturating_sub(per_build).div_ceil(per_build);
    run_builds(&stack, "many", more, false).await;
    let records = stack.journal_on_disk(ID).len();
    let load = calm(opts.max_load).await;
    let (total, cluster) = recovery(&mut stack, opts.repeats).await;
    report.push(
        format!(
            "recovery, ~{} records journaled: exec -> recovery planned",
            opts.records
        ),
        format!("{records} records, {} builds: {}", more + 1, spread(&total)),
        &load,
    );
    report.push("  of which agent starting -> recovery planned", spread(&cluster), &load);

    // Figure 3: redelivery of statuses the API refused, after a restart.
    let n = opts.redeliver;
    stack.deny_terminal_status().await;
    run_builds(&stack, "redeliver", n, true).await;
    stack.stop_agent(ID, Duration::from_secs(60));
    stack.allow_terminal_status().await;
    let load = calm(opts.max_load).await;
    let records = stack.journal_on_disk(ID).len();
    let from = now_ms();
    stack.spawn_agent(ID);
    let exec = Instant::now();
    let limit = Duration::from_secs(300);
    let mut delivered = 0;
    while exec.elapsed() < limit {
        delivered = terminal_in(&stack, "redeliver").await.unwrap_or(delivered);
        if delivered == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = exec.elapsed();
    let to = now_ms();
    // One renewal after the end closes the last gap.
    stack.wait_lease_renewed(ID, Timestamp::now()).await;
    let planned = log_time(&stack.agent_log(ID), "recovery planned")
        .map(|t| (t.as_millisecond() as u64).saturating_sub(from) as f64);
    let answers = stack
        .cluster
        .emulator_answers()
        .expect("the bench runs on the emulator");
    let (renewals, failed) = lease_renewals(&answers, &format!("tartan-agent-{ID}"), from..=to);
    let (gap, first) = longest_gap(&renewals, from, to);
    let value = if delivered == n {
        format!("all {n} in {:.2} s", took.as_secs_f64())
    } else {
        format!("only {delivered} of {n} after {:.0} s", took.as_secs_f64())
    };
    report.push(
        format!("redelivery, {n} refused statuses after a restart"),
        value,
        &load,
    );
    report.push(
        "  longest gap between Lease renewals meanwhile",
        format!(
            "{} (first renewal {} after exec; {failed} failed renewals)",
            gap.map_or("-".into(), |g| ms(g as f64)),
            first.map_or("-".into(), |f| ms(f.saturating_sub(from) as f64)),
        ),
        &load,
    );
    report.push(
        "  exec -> recovery planned at that restart",
        format!("{records} records: {}", planned.map_or("-".into(), ms)),
        &load,
    );
    if opts.keep {
        eprintln!("[bench-agent] {label}: files kept in {}", stack.keep_files().display());
    }
    drop(stack);
    report
}

/// Prints `reports` side by side: one row per figure, one column per report.
pub fn print(reports: &[Report]) {
    println!("== bench-agent: one agent (2 slots) on the API emulator, issue 16 figures 3, 4 and 5");
    for r in reports {
        println!("{}: {}", r.label, r.binary);
        for n in &r.notes {
            println!("  note: {n}");
        }
    }
    println!(
        "machine: {} cores; each value is followed by the 1-minute load before -> after it",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let names: Vec<&str> = reports
        .first()
        .map(|r| r.figures.iter().map(|f| f.name.as_str()).collect())
        .unwrap_or_default();
    for (i, name) in names.iter().enumerate() {
        println!("{name}");
        for r in reports {
            match r.figures.get(i) {
                Some(f) => println!("  {:<8} {}   [load {}]", r.label, f.value, f.load),
                None => println!("  {:<8} -", r.label),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_fields_are_left_out_or_replaced_by_name() {
        let text = "agent_id = \"a\"\nnamespaces = [\"e2e\"]\n[timing]\nclaim_spread = \"0s\"\nstep_poll = \"1s\"\n\n[secrets]\nallowed = []\n[logs]\nmax_age = \"1d\"\n";
        assert_eq!(
            without_field(text, "claim_spread"),
            text.replace("claim_spread = \"0s\"\n", "")
        );
        assert_eq!(
            without_field(text, "secrets"),
            text.replace("[secrets]\nallowed = []\n", "")
        );
        assert_eq!(without_field(text, "absent"), text);
        assert_eq!(
            with_namespaces(text, "[]"),
            text.replace("namespaces = [\"e2e\"]", "namespaces = []")
        );
        let log = "2026-12-02T01:14:51Z ERROR tartan_agent: config file a.toml: TOML parse error at line 28\nunknown field `secrets`, expected one of `agent_id`, `state_dir`\n";
        assert_eq!(unknown_field(log).as_deref(), Some("secrets"));
        assert_eq!(unknown_field("all fine"), None);
    }

    #[test]
    fn log_times_come_from_the_first_matching_line() {
        let log = "2026-12-02T00:55:01.100000Z  INFO agent starting records=3\n\
                   2026-12-02T00:55:01.250000Z  INFO recovery: recovery planned records=3\n\
                   2026-12-02T00:55:09.000000Z  INFO recovery: recovery planned again\n";
        let t = log_time(log, "recovery planned").expect("found");
        assert_eq!(t.to_string(), "2026-12-02T00:55:01.25Z");
        assert_eq!(log_time(log, "absent"), None);
    }

    #[test]
    fn lease_gaps_count_from_the_restarted_agents_first_renewal_and_failures_in_the_window() {
        let answers = json!({"answers": [
            {"at_ms": 1000, "method": "PUT", "uri": "/apis/coordination.k8s.io/v1/namespaces/n/leases/tartan-agent-a", "code": 200},
            {"at_ms": 1500, "method": "GET", "uri": "/apis/coordination.k8s.io/v1/namespaces/n/leases/tartan-agent-a", "code": 200},
            {"at_ms": 2500, "method": "PATCH", "uri": "/apis/coordination.k8s.io/v1/namespaces/n/leases/tartan-agent-a?fieldManager=x", "code": 409},
            {"at_ms": 4000, "method": "PATCH", "uri": "/apis/coordination.k8s.io/v1/namespaces/n/leases/tartan-agent-a?fieldManager=x", "code": 200},
            {"at_ms": 4500, "method": "PUT", "uri": "/apis/coordination.k8s.io/v1/namespaces/n/leases/tartan-agent-b", "code": 200},
            {"at_ms": 5000, "method": "PUT", "uri": "/apis/coordination.k8s.io/v1/namespaces/n/leases/tartan-agent-a", "code": 200},
            {"at_ms": 9000, "method": "PUT", "uri": "/apis/coordination.k8s.io/v1/namespaces/n/leases/tartan-agent-a", "code": 200},
        ]});
        let (ok, failed) = lease_renewals(&answers, "tartan-agent-a", 2000..=6000);
        assert_eq!(ok, vec![1000, 4000, 5000, 9000]);
        assert_eq!(failed, 1);
        // 1000 is the previous run's; 5000 -> 9000 closes the window.
        assert_eq!(longest_gap(&ok, 2000, 6000), (Some(4000), Some(4000)));
        assert_eq!(longest_gap(&ok, 2000, 4500), (Some(1000), Some(4000)));
        assert_eq!(longest_gap(&ok, 4500, 4600), (None, Some(5000)));
        assert_eq!(longest_gap(&[], 0, 10), (None, None));
    }
}
