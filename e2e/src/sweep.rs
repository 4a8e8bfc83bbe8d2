//! The crash-point sweep (`scripts/sweep`): for every `crash_point!` in the agent's sources and
//! each kill style, a build whose agent dies at that point, is restarted, and must still end with
//! the outcome the build deserved, once, with every invariant holding.
//!
//! The points are found by scanning `agent/src` ([`scan`]); the plan is built from that scan
//! ([`plan`]), so a new point is swept without anyone keeping a list.

use crate::invariants::{self, result};
use crate::stack::condition_text;
use crate::{AgentOptions, ControllerOptions, KillMode, Stack};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tartan_agent::crash::{ENV, FIRED, PASSED, TRACE_ENV};

/// The macro the scan looks for.
const MACRO: &str = "crash_point!";

/// The file defining the macro (its own test point is not one of the agent's).
const DEFINING_FILE: &str = "crash.rs";

/// One `crash_point!("…")` in the sources.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Point {
    pub name: String,
    pub file: PathBuf,
    pub line: usize,
}

/// Whether `name` is `area.action.before` or `area.action.after` (lower case, `_` allowed).
pub fn well_formed(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    let word = |w: &str| {
        w.starts_with(|c: char| c.is_ascii_lowercase()) && w.chars().all(|c| c.is_ascii_lowercase() || c == '_')
    };
    matches!(parts.as_slice(), [area, action, "before" | "after"] if word(area) && word(action))
}

/// The points of one source text, in order; `Err` names a call whose argument is not a string
/// literal. Calls may be split over lines; mentions in `//` comments are not calls.
pub fn points_in(text: &str, file: &Path) -> Result<Vec<Point>, String> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find(MACRO).map(|i| from + i) {
        from = at + MACRO.len();
        let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
        if text[line_start..at].trim_start().starts_with("//") {
            continue;
        }
        let line = text[..at].matches('\n').count() + 1;
        let rest = text[from..].trim_start();
        // `macro_rules! crash_point {` and links in docs are not calls.
        let Some(args) = rest.strip_prefix('(') else { continue };
        let where_ = format!("{}:{line}", file.display());
        let Some(literal) = args.trim_start().strip_prefix('"') else {
            return Err(format!(
                "{where_}: {MACRO} takes a string literal (the sweep finds points by their names)"
            ));
        };
        let Some(end) = literal.find('"') else {
            return Err(format!("{where_}: unterminated point name"));
        };
        found.push(Point {
            name: literal[..end].to_string(),
            file: file.to_path_buf(),
            line,
        });
    }
    Ok(found)
}

/// Every point under `dir` (`**/*.rs`, but the macro's own file), sorted by name; `Err` lists
/// malformed and duplicate names.
pub fn scan(dir: &Path) -> Result<Vec<Point>, String> {
    let mut files = Vec::new();
    rust_files(dir, &mut files).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    let mut points = Vec::new();
    for file in files {
        if file.parent() == Some(dir) && file.file_name().is_some_and(|n| n == DEFINING_FILE) {
            continue;
        }
        let text = std::fs::read_to_string(&file).map_err(|e| format!("reading {}: {e}", file.display()))?;
        points.extend(points_in(&text, &file)?);
    }
    let mut problems = Vec::new();
    let mut seen: BTreeMap<&str, &Point> = BTreeMap::new();
    for p in &points {
        if !well_formed(&p.name) {
            problems.push(format!(
                "{}:{}: {:?} is not area.action.before|after",
                p.file.display(),
                p.line,
                p.name
            ));
        }
        if let Some(first) = seen.insert(&p.name, p) {
            problems.push(format!(
                "{:?} is placed twice: {}:{} and {}:{}",
                p.name,
                first.file.display(),
                first.line,
                p.file.display(),
                p.line
            ));
        }
    }
    if !problems.is_empty() {
        return Err(problems.join("\n"));
    }
    points.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(points)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The agent's sources in this workspace.
pub fn agent_sources() -> PathBuf {
    crate::bins::workspace_root().join("agent").join("src")
}

/// How the agent's death is completed once the point fired (the agent itself is already gone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// launchd without `AbandonProcessGroup`: the rest of its process group dies too.
    Group,
    /// The agent alone: its tart children live on.
    Alone,
}

impl Style {
    pub const BOTH: [Style; 2] = [Style::Group, Style::Alone];

    fn kill_mode(self) -> KillMode {
        match self {
            Style::Group => KillMode::Group,
            Style::Alone => KillMode::Alone,
        }
    }
}

impl fmt::Display for Style {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Style::Group => "group",
            Style::Alone => "alone",
        })
    }
}

/// One run of the sweep: a point (`name[#n]`), a kill style, the agent's slots, and whether it
/// keeps a warm pool of one VM (then the builds are created once a warm VM is ready, so that the
/// first adopts it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub point: String,
    pub style: Style,
    pub slots: u8,
    pub pool: bool,
}

/// Points only an agent start passes: the first start crashes at [`LEAD_IN`] (a VM cloned but not
/// started: nothing to resume, so recovery kills its survivors and interrupts the attempt), the
/// second at the point itself.
const RECOVERY_AREA: &str = "recover.";

/// Where a recovery row's first start dies.
pub const LEAD_IN: &str = "tart.set.after";

/// In a pool row, points only the deletion of a warm VM passes, which a build that adopts its VM
/// never asks for: they are reached at a restart, when the warm VM of the first start (dead at
/// [`LEAD_IN`], in its refill) is deleted as stale.
const STALE_WARM_POINTS: [&str; 4] = [
    "warm.evict.before",
    "warm.evict.after",
    "warm.deleted.before",
    "warm.deleted.after",
];

/// Every point × style, at `slots`, each point at its first hit.
pub fn plan(points: &[Point], styles: &[Style], slots: u8, pool: bool) -> Vec<Row> {
    plan_hits(points, &BTreeMap::new(), 1, styles, slots, pool)
}

/// Every point × hit × style, at `slots`: a point a build passes `n` times (`counts`, from
/// [`count_hits`]) is crashed at each of its hits up to `max_hits`; a point not counted (one only
/// a restart passes) at its first.
pub fn plan_hits(
    points: &[Point],
    counts: &BTreeMap<String, u64>,
    max_hits: u64,
    styles: &[Style],
    slots: u8,
    pool: bool,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for p in points {
        let hits = counts.get(&p.name).copied().unwrap_or(0).clamp(1, max_hits.max(1));
        for hit in 1..=hits {
            let point = if hit == 1 {
                p.name.clone()
            } else {
                format!("{}#{hit}", p.name)
            };
            rows.extend(styles.iter().map(|&style| Row {
                point: point.clone(),
                style,
                slots,
                pool,
            }));
        }
    }
    rows
}

/// How many times each point was passed, from an agent log written with `TARTAN_CRASH_TRACE`.
pub fn count_passes(log: &str) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for line in log.lines() {
        if let Some(rest) = line.strip_prefix(PASSED) {
            *counts.entry(rest.trim().to_string()).or_insert(0) += 1;
        }
    }
    counts
}

/// Runs the row's builds once without a crash, tracing the points: how often each is passed.
pub async fn count_hits(binary: PathBuf, slots: u8, pool: bool) -> BTreeMap<String, u64> {
    let (mut s, names) = row_stack("sweep-count", slots, pool, &binary).await;
    s.set_agent_env(AGENT, TRACE_ENV, Some("1"));
    s.spawn_agent(AGENT);
    if pool {
        create_runs_when_warm(&mut s, &names).await;
    }
    match wait_fired(&mut s, &names, "(none)").await {
        Ok(_) => {}
        Err(e) => panic!("the counting run failed: {e}"),
    }
    let log = std::fs::read_to_string(s.agent_log_path(AGENT)).unwrap_or_default();
    count_passes(&log)
}

/// How a row ended.
#[derive(Clone, Debug)]
pub struct RowResult {
    pub row: Row,
    /// Whether the point fired (false: the builds ended without reaching it).
    pub fired: bool,
    /// Each run's `status/reason`, in run order.
    pub outcomes: Vec<String>,
    /// Each run's attempt number as its results name it.
    pub attempts: Vec<String>,
    pub secs: f64,
    pub invariants_ok: bool,
    /// Why the row failed; empty when it passed.
    pub failures: Vec<String>,
    /// Where its files were kept (failed rows).
    pub kept: Option<PathBuf>,
}

impl RowResult {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

const AGENT: &str = "agent-a";
/// A build's limit to reach the point or end.
const LIMIT: Duration = Duration::from_secs(90);
/// After the builds ended, how long a point that comes later (a status write) still may fire.
const AFTER_END: Duration = Duration::from_secs(3);

/// Runs `row` with the crash-points agent `binary`; a harness panic is a failed row.
pub async fn run_row(row: Row, binary: PathBuf, index: usize) -> RowResult {
    let started = Instant::now();
    let task = tokio::spawn(sweep_row(row.clone(), binary, index));
    match task.await {
        Ok(result) => result,
        Err(e) => {
            let why = if e.is_panic() {
                let p = e.into_panic();
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into())
            } else {
                e.to_string()
            };
            RowResult {
                row,
                fired: false,
                outcomes: vec![],
                attempts: vec![],
                secs: started.elapsed().as_secs_f64(),
                invariants_ok: false,
                failures: vec![format!("harness: {}", why.lines().next().unwrap_or(""))],
                kept: None,
            }
        }
    }
}

/// The runs of a row: `build-1` plain; with 2 slots also `build-2`, held at a gate in its first
/// step until the point fired (or build-1 ended), so that both are in flight at the crash.
fn runs(slots: u8) -> Vec<&'static str> {
    if slots >= 2 {
        vec!["build-1", "build-2"]
    } else {
        vec!["build-1"]
    }
}

/// A stack for a row: the agent (crash-points `binary`, `slots`, a warm pool of one with
/// `pool`), the controller, and, without a pool, the row's CustomRuns with their MacBuilds
/// created; the agent is not started.
async fn row_stack(name: &str, slots: u8, pool: bool, binary: &Path) -> (Stack, Vec<&'static str>) {
    let mut s = Stack::new(name).await;
    s.add_agent(
        AGENT,
        AgentOptions {
            slots,
            // Compaction runs soon after a build ended, so that its points are swept too.
            compaction_interval: "1s",
            pool: if pool { crate::stack::POOL_OF_ONE } else { "" },
            ..AgentOptions::default()
        },
    );
    s.set_agent_binary(AGENT, binary);
    s.start_controller(ControllerOptions::default());
    let names = runs(slots);
    if !pool {
        create_runs(&s, &names).await;
    }
    (s, names)
}

/// Creates the row's CustomRuns and waits for their MacBuilds.
async fn create_runs(s: &Stack, names: &[&'static str]) {
    for (i, name) in names.iter().enumerate() {
        if s.customrun(name).await.is_some() {
            continue;
        }
        let mut params = s.build_params(i == 1);
        params.push(("timeout-seconds", serde_json::json!("600")));
        s.create_run(name, &params, None).await;
    }
    // Every MacBuild exists before the agent takes them up, so that it takes them up together.
    for name in names {
        s.wait_macbuild(name, "created", LIMIT, |_| true).await;
    }
}

/// A pool row: creates the runs once the agent has a warm VM ready (the first build adopts it),
/// or once it died first (a point of the refill fired; the restarted agent gets them).
async fn create_runs_when_warm(s: &mut Stack, names: &[&'static str]) {
    let started = Instant::now();
    loop {
        let ready = s
            .journal(AGENT)
            .iter()
            .any(|r| r.build.is_none() && r.warm.is_some() && r.to == tartan_api::AttemptState::Running);
        if ready || s.agent_exit_status(AGENT).is_some() || started.elapsed() >= LIMIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    create_runs(s, names).await;
}

async fn sweep_row(row: Row, binary: PathBuf, index: usize) -> RowResult {
    let started = Instant::now();
    let (mut s, names) = row_stack(&format!("sweep-{index}"), row.slots, row.pool, &binary).await;
    let mut failures = Vec::new();
    let name = row.point.split('#').next().unwrap_or_default().to_string();
    if name.starts_with(RECOVERY_AREA) || (row.pool && STALE_WARM_POINTS.contains(&name.as_str())) {
        // The first start dies with a claimed attempt that recovery must interrupt.
        s.set_agent_env(AGENT, ENV, Some(LEAD_IN));
        s.spawn_agent(AGENT);
        if row.pool {
            create_runs_when_warm(&mut s, &names).await;
        }
        match wait_fired(&mut s, &names, LEAD_IN).await {
            Ok(true) => s.kill_agent(AGENT, row.style.kill_mode()),
            Ok(false) => failures.push(format!("the lead-in point {LEAD_IN} was not reached")),
            Err(e) => failures.push(e),
        }
    }
    let mut fired = false;
    if failures.is_empty() {
        s.set_agent_env(AGENT, ENV, Some(&row.point));
        s.spawn_agent(AGENT);
        if row.pool {
            create_runs_when_warm(&mut s, &names).await;
        }
        match wait_fired(&mut s, &names, &row.point).await {
            Ok(f) => fired = f,
            Err(e) => failures.push(e),
        }
    }
    if s.agent_started(AGENT) {
        if fired {
            s.kill_agent(AGENT, row.style.kill_mode());
        } else if !s.agent_alive(AGENT) {
            s.forget_exited_agent(AGENT);
        }
    }
    s.open_gate();
    s.set_agent_env(AGENT, ENV, None);
    if !s.agent_started(AGENT) {
        s.start_agent(AGENT).await;
    }
    let mut ended = Vec::new();
    for name in &names {
        ended.push(s.wait_run_ended(name, Duration::from_secs(120)).await);
    }
    let outcomes: Vec<String> = ended.iter().map(status_reason).collect();
    let attempts: Vec<String> = ended
        .iter()
        .map(|r| {
            result(r, "attempt")
                .and_then(|a| a.rsplit('#').next())
                .unwrap_or("?")
                .to_string()
        })
        .collect();
    for ((name, run), attempt) in names.iter().zip(&ended).zip(&attempts) {
        if status_reason(run) != "True/TestsPassed" {
            failures.push(format!("{name} ended {}", condition_text(run)));
        }
        if !matches!(attempt.as_str(), "1" | "2") {
            failures.push(format!(
                "{name} ended as attempt {attempt} (one crash costs at most one)"
            ));
        }
    }
    // A run ends with its attempt's outcome (Retiring); its VM's deletion and the Retired record
    // follow. The invariants are checked once every attempt has settled.
    if let Err(e) = wait_settled(&s).await {
        failures.push(e);
    }
    let world = s.world().await;
    let violations = invariants::check(&world);
    for v in &violations {
        failures.push(v.to_string());
    }
    // Ended once: nothing about the ending changes while the agent goes on.
    for (name, before) in names.iter().zip(&ended) {
        let now = s.customrun(name).await;
        let same = now.as_ref().is_some_and(|n| n["status"] == before["status"]);
        if !same {
            failures.push(format!("{name}'s status changed after it ended"));
        }
    }
    if s.agent_started(AGENT) && !s.agent_alive(AGENT) {
        failures.push(format!(
            "the restarted agent exited: {}",
            crate::process::tail(&s.agent_log_path(AGENT), 5)
        ));
    }
    let kept = if failures.is_empty() {
        None
    } else {
        eprintln!(
            "[sweep] {} {}: journal\n{}",
            row.point,
            row.style,
            s.journal_text(AGENT)
        );
        Some(s.keep_files())
    };
    RowResult {
        row,
        fired,
        outcomes,
        attempts,
        secs: started.elapsed().as_secs_f64(),
        invariants_ok: violations.is_empty(),
        failures,
        kept,
    }
}

/// How long the attempts may take to settle after the runs ended.
const SETTLE: Duration = Duration::from_secs(30);

/// Waits until every attempt in the agent's journal is Retired and its host has no VM left.
async fn wait_settled(s: &Stack) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let mut last: BTreeMap<(String, u32), tartan_api::AttemptState> = BTreeMap::new();
        for r in s.journal(AGENT) {
            if let (Some(b), Some(n)) = (&r.build, r.attempt) {
                last.insert((b.name.clone(), n), r.to);
            }
        }
        let open: Vec<String> = last
            .iter()
            .filter(|(_, state)| **state != tartan_api::AttemptState::Retired)
            .map(|((name, n), state)| format!("{name}#{n} {state}"))
            .collect();
        // The pool's own VMs stay (its journal keeps them; the invariants check that).
        let warm_open = invariants::open_warm_vms(&s.journal(AGENT));
        let vms: Vec<String> = s
            .vms(AGENT)
            .into_iter()
            .filter(|v| v.starts_with("mb-") && !warm_open.contains(v))
            .collect();
        if open.is_empty() && vms.is_empty() {
            return Ok(());
        }
        if started.elapsed() >= SETTLE {
            return Err(format!(
                "not settled {SETTLE:?} after the runs ended: open attempts {open:?}, VMs {vms:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn status_reason(run: &Value) -> String {
    let c = &run["status"]["conditions"][0];
    format!(
        "{}/{}",
        c["status"].as_str().unwrap_or("?"),
        c["reason"].as_str().unwrap_or("?")
    )
}

/// Waits until the agent died at `point` (`Ok(true)`), or every run ended and [`AFTER_END`]
/// passed without it (`Ok(false)`); `Err` if the agent died otherwise or nothing happened.
/// With 2 slots the gate opens once `build-1` ended.
async fn wait_fired(s: &mut Stack, names: &[&str], point: &str) -> Result<bool, String> {
    let started = Instant::now();
    let mut all_ended_at: Option<Instant> = None;
    loop {
        if let Some(status) = s.agent_exit_status(AGENT) {
            let log = std::fs::read_to_string(s.agent_log_path(AGENT)).unwrap_or_default();
            let (name, hit) = point.split_once('#').unwrap_or((point, "1"));
            let line = format!("{FIRED} {name}#{hit}");
            return if log.contains(&line) {
                Ok(true)
            } else {
                Err(format!(
                    "the agent exited ({status}) without firing {point}: {}",
                    crate::process::tail(&s.agent_log_path(AGENT), 5)
                ))
            };
        }
        let mut ended = 0;
        for name in names {
            if s.customrun(name)
                .await
                .as_ref()
                .is_some_and(|r| matches!(r["status"]["conditions"][0]["status"].as_str(), Some("True" | "False")))
            {
                ended += 1;
                if *name == "build-1" {
                    s.open_gate();
                }
            }
        }
        if ended == names.len() {
            let at = *all_ended_at.get_or_insert_with(Instant::now);
            if at.elapsed() >= AFTER_END {
                return Ok(false);
            }
        }
        if started.elapsed() >= LIMIT {
            return Err(format!(
                "within {LIMIT:?} the agent neither died at {point} nor ended the builds"
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The table: point × style → fired, outcome, attempts, seconds, invariants, verdict.
pub fn table(results: &[RowResult]) -> String {
    let width = results.iter().map(|r| r.row.point.len()).max().unwrap_or(5).max(5);
    let mut out = format!(
        "{:<width$}  {:<5}  {:>5}  {:<11}  {:<33}  {:>8}  {:>5}  {:>10}  result\n",
        "point", "style", "slots", "fired", "outcome", "attempts", "secs", "invariants"
    );
    for r in results {
        out.push_str(&format!(
            "{:<width$}  {:<5}  {:>5}  {:<11}  {:<33}  {:>8}  {:>5.1}  {:>10}  {}\n",
            r.row.point,
            r.row.style.to_string(),
            r.row.slots,
            if r.fired { "yes" } else { "not reached" },
            r.outcomes.join(" "),
            r.attempts.join(" "),
            r.secs,
            if r.invariants_ok { "ok" } else { "VIOLATED" },
            if r.passed() {
                "pass".to_string()
            } else {
                format!("FAIL: {}", r.failures.join("; "))
            }
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_area_action_before_or_after() {
        assert!(well_formed("journal.append.before"));
        assert!(well_formed("claim.finalizer_add.after"));
        for bad in [
            "journal.append",
            "journal.append.during",
            "Journal.append.before",
            "a..before",
            "a.b.c.before",
        ] {
            assert!(!well_formed(bad), "{bad}");
        }
    }

    #[test]
    fn calls_are_found_even_split_over_lines_and_comments_are_not_calls() {
        let text = "fn f() {\n    crate::crash_point!(\"a.b.before\");\n    // crash_point!(\"not.a.before\")\n    crate::crash_point!(\n        \"a.b.after\"\n    );\n}\nmacro_rules! crash_point { () => {} }\n";
        let found = points_in(text, Path::new("x.rs")).unwrap();
        let names: Vec<(&str, usize)> = found.iter().map(|p| (p.name.as_str(), p.line)).collect();
        assert_eq!(names, vec![("a.b.before", 2), ("a.b.after", 4)]);
        let err = points_in("crash_point!(NAME);", Path::new("y.rs")).unwrap_err();
        assert!(err.contains("y.rs:1"), "{err}");
    }

    #[test]
    fn the_agent_has_unique_well_formed_points_at_each_kind_of_change() {
        let points = scan(&agent_sources()).unwrap();
        let names: Vec<&str> = points.iter().map(|p| p.name.as_str()).collect();
        for expected in [
            "journal.append.before",
            "journal.append.after",
            "status.write.after",
            "claim.finalizer_remove.before",
            "tart.clone.after",
            "step.poll.before",
            "recover.kill_survivors.before",
            LEAD_IN,
        ] {
            assert!(names.contains(&expected), "{expected} missing from {names:?}");
        }
        // Every point comes as a before/after pair.
        for p in &names {
            let other = p
                .strip_suffix(".before")
                .map(|a| format!("{a}.after"))
                .or_else(|| p.strip_suffix(".after").map(|a| format!("{a}.before")))
                .unwrap();
            let pair_exempt = p.starts_with("journal.compact");
            assert!(pair_exempt || names.contains(&other.as_str()), "{p} has no {other}");
        }
    }

    #[test]
    fn repeated_points_are_crashed_at_each_hit_up_to_the_limit() {
        let p = |n: &str| Point {
            name: n.into(),
            file: PathBuf::from("x.rs"),
            line: 1,
        };
        let points = [p("a.b.before"), p("c.d.after")];
        let log = format!("x\n{PASSED} a.b.before\n{PASSED} a.b.before\nnoise\n{PASSED} a.b.before\n");
        let counts = count_passes(&log);
        assert_eq!(counts.get("a.b.before"), Some(&3));
        let names = |rows: Vec<Row>| rows.into_iter().map(|r| r.point).collect::<Vec<_>>();
        assert_eq!(
            names(plan_hits(&points, &counts, 2, &[Style::Group], 1, false)),
            ["a.b.before", "a.b.before#2", "c.d.after"]
        );
        assert_eq!(
            names(plan_hits(&points, &counts, 5, &[Style::Group], 1, false)).len(),
            4
        );
        assert_eq!(
            plan_hits(&points, &counts, 1, &Style::BOTH, 2, false),
            plan(&points, &Style::BOTH, 2, false)
        );
    }

    #[test]
    fn duplicates_and_malformed_names_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("a.rs"),
            "crash_point!(\"x.y.before\"); crash_point!(\"x.y.before\");",
        )
        .unwrap();
        std::fs::write(dir.path().join("b.rs"), "crash_point!(\"nope\");").unwrap();
        let err = scan(dir.path()).unwrap_err();
        assert!(err.contains("placed twice") && err.contains("\"nope\""), "{err}");
    }

    /// The sweep runs every point the sources have, in both styles; a point added to the sources
    /// is in the plan with nothing else to change.
    #[test]
    fn the_plan_covers_every_point_and_follows_the_sources() {
        let real = scan(&agent_sources()).unwrap();
        let rows = plan(&real, &Style::BOTH, 1, false);
        for p in &real {
            for style in Style::BOTH {
                assert!(
                    rows.iter().any(|r| r.point == p.name && r.style == style),
                    "{} {style} is not swept",
                    p.name
                );
            }
        }
        let copy = tempfile::tempdir().unwrap();
        copy_tree(&agent_sources(), copy.path());
        std::fs::write(
            copy.path().join("host").join("planted.rs"),
            "fn f() {\n    crate::crash_point!(\n        \"planted.thing.before\"\n    );\n}\n",
        )
        .unwrap();
        let planted = plan(&scan(copy.path()).unwrap(), &Style::BOTH, 1, false);
        assert_eq!(planted.len(), rows.len() + 2);
        let extra: Vec<&Row> = planted.iter().filter(|r| !rows.contains(r)).collect();
        assert_eq!(extra.len(), 2, "{extra:?}");
        assert!(extra.iter().all(|r| r.point == "planted.thing.before"));
    }

    fn copy_tree(from: &Path, to: &Path) {
        for entry in std::fs::read_dir(from).unwrap() {
            let path = entry.unwrap().path();
            let target = to.join(path.file_name().unwrap());
            if path.is_dir() {
                std::fs::create_dir_all(&target).unwrap();
                copy_tree(&path, &target);
            } else {
                std::fs::copy(&path, &target).unwrap();
            }
        }
    }
}
