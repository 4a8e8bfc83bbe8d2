//! `scripts/bench-fleet`: N real agents (release builds, 2 slots each, own state dirs and
//! tart-double homes) racing for M MacBuilds created straight on the emulator, no controller.
//! Measures what the fleet costs: claim latency (MacBuild created → `Admitted` journaled), losing
//! claims (409/422 answers to `macbuilds/*/status` writes, from the emulator's answers log), API
//! requests per build by kind, agent RSS and idle CPU, the API's request rate, the spread of
//! builds over agents, and the machine's load meanwhile.

use crate::stack::{AgentOptions, IMAGE, Stack};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tartan_api::{AttemptState, MacBuild, MacBuildSpec, Step};

/// What one run does.
#[derive(Clone, Debug)]
pub struct FleetOptions {
    pub agents: usize,
    pub builds: usize,
    /// MacBuilds created per second.
    pub rate: f64,
    /// tart-double's boot delay.
    pub boot_secs: f64,
    /// How long the build's one step sleeps.
    pub step_secs: f64,
    /// How many agents (the first ones) hold the build's image at the start; the others pull it
    /// when they first clone it.
    pub holders: usize,
    /// The agents' `timing.claim_spread` and `timing.uncached_claim_delay`.
    pub claim_spread: &'static str,
    pub uncached_claim_delay: &'static str,
    /// How long the agents are watched idle after the last build.
    pub idle: Duration,
}

/// `p` (0..=100) percentile of sorted `values` (nearest rank); `None` when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The kind of an API request for counting: method (`WATCH`/`LIST` for collection reads) and
/// resource with subresource, e.g. `PATCH macbuilds/status`, `GET leases`, `WATCH macbuilds`.
pub fn request_kind(method: &str, uri: &str) -> String {
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    // /api/v1/namespaces/NS/RES[/NAME[/SUB]] or /apis/G/V/namespaces/NS/RES[/NAME[/SUB]], or the
    // same without namespaces/NS.
    let rest: &[&str] = match parts.as_slice() {
        ["api", _, rest @ ..] | ["apis", _, _, rest @ ..] => rest,
        _ => return format!("{method} {path}"),
    };
    let rest = match rest {
        ["namespaces", _, r @ ..] if !r.is_empty() => r,
        r => r,
    };
    let watch = query.split('&').any(|kv| kv == "watch=true" || kv == "watch=1");
    match rest {
        [resource] if method == "GET" => format!("{} {resource}", if watch { "WATCH" } else { "LIST" }),
        [resource] | [resource, _] => format!("{method} {resource}"),
        [resource, _, sub, ..] => format!("{method} {resource}/{sub}"),
        [] => format!("{method} {path}"),
    }
}

/// The MacBuild name a request is about, if it names one.
pub fn macbuild_of(uri: &str) -> Option<&str> {
    let path = uri.split_once('?').map_or(uri, |(p, _)| p);
    let mut it = path.split('/');
    it.by_ref().find(|p| *p == "macbuilds")?;
    it.next().filter(|n| !n.is_empty())
}

/// The kind of a `ClaimLost` record's detail (the claim module's reasons), for counting.
pub fn lost_reason_class(detail: &str) -> &'static str {
    if detail.contains("test failed") {
        "its claim's test failed (written on a stale read, or raced)"
    } else if detail.contains("not claimable") {
        "it was not claimable by then (nothing written)"
    } else if detail.contains("nobody confirmed") {
        "the claim was not confirmed (API error)"
    } else if detail.contains("deleted") {
        "the MacBuild was deleted"
    } else {
        "other"
    }
}

/// `VmRSS` and `VmHWM` (KiB) of `pid`.
pub fn memory_kib(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU ticks (user + system) `pid` has used.
pub fn cpu_ticks(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let after = text.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = after.split_whitespace().filter_map(|v| v.parse().ok()).collect();
    // `after` starts at field 3 (state, not a number, skipped): utime is then f[10], stime f[11].
    f.get(10).copied().unwrap_or(0) + f.get(11).copied().unwrap_or(0)
}

/// Busy and total jiffies of the whole machine.
fn machine_ticks() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu: Vec<u64> = text
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = cpu.iter().sum();
    let idle = cpu.get(3).copied().unwrap_or(0) + cpu.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

fn build_name(i: usize) -> String {
    format!("fleet-{i:04}")
}

/// Runs the benchmark and prints its report.
pub async fn run(opts: FleetOptions) {
    let mut stack = Stack::new("bench-fleet").await;
    let ids: Vec<String> = (0..opts.agents).map(|i| format!("mac-{i:02}")).collect();
    for id in &ids {
        stack.add_agent(
            id,
            AgentOptions {
                slots: 2,
                boot_delay_secs: opts.boot_secs,
                // Lease as the e2e runs them (1 s / 4 s), steps polled often: the claim path is
                // what is measured.
                step_poll: "100ms",
                claim_spread: opts.claim_spread,
                uncached_claim_delay: opts.uncached_claim_delay,
                ..AgentOptions::default()
            },
        );
    }
    // Holders get the image into their tart cache (a clone pulls it; the clone itself goes).
    for id in ids.iter().take(opts.holders) {
        for args in [vec!["clone", IMAGE, "warm"], vec!["delete", "warm"]] {
            let out = stack.tart(id, &args);
            assert!(out.status.success(), "tart-double {args:?} for {id}: {out:?}");
        }
    }
    let start_load = loadavg();
    eprintln!("[bench] starting {} agents (load {start_load})", opts.agents);
    for id in &ids {
        stack.start_agent(id).await;
    }
    // Settle: every agent has listed, renewed and gone idle.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let api: Api<MacBuild> = Api::namespaced(stack.client.clone(), &stack.ns);
    let (busy0, total0) = machine_ticks();
    let started = Instant::now();
    let mut created: BTreeMap<String, Timestamp> = BTreeMap::new();
    let mut max_load = 0f64;
    let step = vec!["sleep".to_string(), opts.step_secs.to_string()];
    for i in 0..opts.builds {
        let due = started + Duration::from_secs_f64(i as f64 / opts.rate);
        tokio::time::sleep_until(due.into()).await;
        let name = build_name(i);
        let mut mb = MacBuild::new(&name, MacBuildSpec::new(IMAGE, vec![Step::new("work", step.clone())]));
        mb.metadata.namespace = Some(stack.ns.clone());
        let at = Timestamp::now();
        api.create(&PostParams::default(), &mb)
            .await
            .unwrap_or_else(|e| panic!("creating MacBuild {name}: {e}"));
        created.insert(name, at);
        if i % 10 == 0 {
            let one: f64 = loadavg().split(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
            max_load = max_load.max(one);
        }
    }
    // All terminal (each build takes boot + step + cleanup).
    let limit = Duration::from_secs(240) + Duration::from_secs_f64(opts.builds as f64 / opts.rate);
    let deadline = Instant::now() + limit;
    let mut unfinished = 0;
    loop {
        let list = api.list(&Default::default()).await.expect("listing MacBuilds");
        let done = list
            .items
            .iter()
            .filter(|m| m.status.as_ref().and_then(|s| s.phase).is_some_and(|p| p.is_terminal()))
            .count();
        if done == opts.builds {
            break;
        }
        let one: f64 = loadavg().split(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
        max_load = max_load.max(one);
        if Instant::now() >= deadline {
            // Reported, not fatal: what did finish is still measured.
            unfinished = opts.builds - done;
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let elapsed = started.elapsed();
    let (busy1, total1) = machine_ticks();
    let busy_pct = 100.0 * (busy1 - busy0) as f64 / (total1 - total0).max(1) as f64;
    let end_load = loadavg();

    // Idle: nothing waits; the agents only renew and watch.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pids: Vec<(String, u32)> = ids
        .iter()
        .map(|id| (id.clone(), stack.agent_pid(id).expect("agent runs")))
        .collect();
    let before: Vec<u64> = pids.iter().map(|(_, p)| cpu_ticks(*p)).collect();
    let idle_started = Instant::now();
    tokio::time::sleep(opts.idle).await;
    let idle_secs = idle_started.elapsed().as_secs_f64();
    let hz = ticks_per_second();
    let idle_cpu: Vec<f64> = pids
        .iter()
        .zip(&before)
        .map(|((_, p), b)| 100.0 * (cpu_ticks(*p) - b) as f64 / hz / idle_secs)
        .collect();
    let memory: Vec<(u64, u64)> = pids.iter().map(|(_, p)| memory_kib(*p)).collect();

    // Claim latency and spread from the journals.
    let mut latency = Vec::new();
    let mut per_agent: BTreeMap<String, usize> = ids.iter().map(|id| (id.clone(), 0)).collect();
    let mut holder_of: BTreeMap<String, String> = BTreeMap::new();
    let mut claim_lost = 0usize;
    // Claim attempts per (agent, build) and when each began (`[*] -> Requested` is journaled
    // right before the claim's write); why each lost claim was lost.
    let mut requested: BTreeMap<(String, String), Vec<Timestamp>> = BTreeMap::new();
    let mut lost_by: Vec<(String, String)> = Vec::new();
    let mut lost_reasons: BTreeMap<String, usize> = BTreeMap::new();
    for id in &ids {
        for r in stack.journal(id) {
            let Some(b) = r.build.as_ref() else { continue };
            if !created.contains_key(&b.name) {
                continue;
            }
            if r.from.is_none() && r.to == AttemptState::Requested {
                requested.entry((id.clone(), b.name.clone())).or_default().push(r.time);
            }
            if r.reason == Some(tartan_api::Reason::ClaimLost) {
                claim_lost += 1;
                lost_by.push((id.clone(), b.name.clone()));
                *lost_reasons
                    .entry(lost_reason_class(&r.detail).to_string())
                    .or_default() += 1;
            }
            if r.to != AttemptState::Admitted {
                continue;
            }
            if let Some(at) = created.get(&b.name) {
                let ms = (r.time.as_millisecond() - at.as_millisecond()) as f64;
                latency.push(ms);
                *per_agent.entry(id.clone()).or_default() += 1;
                holder_of.insert(b.name.clone(), id.clone());
            }
        }
    }
    latency.sort_by(|a, b| a.total_cmp(b));
    // How long after the winner began its claim each loser began its own: a loser that began
    // well after it had not seen the claim yet (its watch lagged); one that began before or at
    // about the same time raced it.
    let mut lag_after_winner: Vec<f64> = lost_by
        .iter()
        .filter_map(|(agent, build)| {
            let winner = holder_of.get(build)?;
            let won_at = requested.get(&(winner.clone(), build.clone()))?.first()?;
            let lost_at = requested.get(&(agent.clone(), build.clone()))?.first()?;
            Some((lost_at.as_millisecond() - won_at.as_millisecond()) as f64)
        })
        .collect();
    lag_after_winner.sort_by(|a, b| a.total_cmp(b));
    let attempts_max = requested.values().map(Vec::len).max().unwrap_or(0);
    let repeated = requested.values().filter(|v| v.len() > 1).count();

    // Requests from the emulator's answers log.
    let answers = stack
        .cluster
        .emulator_answers()
        .expect("the bench runs on the emulator");
    let dropped = answers["dropped"].as_u64().unwrap_or(0);
    let list: Vec<&Value> = answers["answers"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let t0 = created.values().next().map_or(0, |t| t.as_millisecond()) as u64;
    let t1 = t0 + elapsed.as_millis() as u64;
    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    let mut losing = 0u64;
    let mut losing_by_build: BTreeMap<String, u64> = BTreeMap::new();
    let mut in_run = 0u64;
    let mut per_second: BTreeMap<u64, u64> = BTreeMap::new();
    for a in &list {
        let at = a["at_ms"].as_u64().unwrap_or(0);
        let user = a["user"].as_str().unwrap_or_default();
        if (t0..=t1).contains(&at) {
            in_run += 1;
            *per_second.entry((at - t0) / 1000).or_default() += 1;
        }
        if !user.contains("tartan-agent") {
            continue;
        }
        let (method, uri) = (a["method"].as_str().unwrap_or(""), a["uri"].as_str().unwrap_or(""));
        let kind = request_kind(method, uri);
        let code = a["code"].as_u64().unwrap_or(0);
        if (t0..=t1).contains(&at) {
            *kinds.entry(kind.clone()).or_default() += 1;
        }
        if kind == "PATCH macbuilds/status"
            && matches!(code, 409 | 422)
            && let Some(b) = macbuild_of(uri)
            && created.contains_key(b)
        {
            losing += 1;
            *losing_by_build.entry(b.to_string()).or_default() += 1;
        }
    }

    // Report.
    let n = opts.builds as f64;
    if unfinished > 0 {
        println!(
            "!! {unfinished} of {} MacBuilds were not terminal {limit:?} after the first was created",
            opts.builds
        );
    }
    let ms = |p: f64| percentile(&latency, p).map_or("-".into(), |v| format!("{v:.0} ms"));
    println!(
        "== bench-fleet: {} agents x 2 slots, {} builds at {}/s, boot {}s, step {}s, {} holding the image",
        opts.agents, opts.builds, opts.rate, opts.boot_secs, opts.step_secs, opts.holders
    );
    println!(
        "agents: claim_spread {}, uncached_claim_delay {}",
        opts.claim_spread, opts.uncached_claim_delay
    );
    println!(
        "claim latency (created -> Admitted journaled), n={}: p50 {} p99 {} max {}   (goal p99 <= 1000 ms)",
        latency.len(),
        ms(50.0),
        ms(99.0),
        ms(100.0)
    );
    let worst = losing_by_build.values().max().copied().unwrap_or(0);
    println!(
        "losing claims (409/422 on macbuilds/*/status): {losing} = {:.2} per build (max {worst} on one build)   (goal <= 2)",
        losing as f64 / n
    );
    println!(
        "ClaimLost journaled (an agent wrote a claim, or found the build taken after journaling Requested): {claim_lost} = {:.2} per build",
        claim_lost as f64 / n
    );
    for (class, count) in &lost_reasons {
        println!("  lost because {class}: {count}");
    }
    let lag = |p: f64| percentile(&lag_after_winner, p).map_or("-".into(), |v| format!("{v:.0} ms"));
    println!(
        "  loser's claim began after the winner's: p50 {} p99 {} max {} (min {}); claims begun per agent and build: max {attempts_max}, {repeated} pairs more than once",
        lag(50.0),
        lag(99.0),
        lag(100.0),
        lag(0.0)
    );
    println!("agent API requests per build during the run, by kind:");
    for (k, v) in &kinds {
        println!("  {k:<28} {:>8.2}  ({v})", *v as f64 / n);
    }
    let total_agent: u64 = kinds.values().sum();
    println!("  {:<28} {:>8.2}  ({total_agent})", "all", total_agent as f64 / n);
    let peak = per_second.values().max().copied().unwrap_or(0);
    println!(
        "API server: {in_run} requests in {:.1} s = {:.0}/s (peak {peak}/s){}",
        elapsed.as_secs_f64(),
        in_run as f64 / elapsed.as_secs_f64(),
        if dropped > 0 {
            format!(" ({dropped} oldest answers not kept)")
        } else {
            String::new()
        }
    );
    if let Some(pid) = stack.cluster.emulator_pid() {
        let (rss, hwm) = memory_kib(pid);
        println!(
            "emulator RSS {:.1} MiB (peak {:.1} MiB)",
            rss as f64 / 1024.0,
            hwm as f64 / 1024.0
        );
    }
    let counts: Vec<usize> = per_agent.values().copied().collect();
    let (min, max) = (
        counts.iter().min().copied().unwrap_or(0),
        counts.iter().max().copied().unwrap_or(0),
    );
    let idle_agents: Vec<&String> = per_agent.iter().filter(|(_, c)| **c == 0).map(|(id, _)| id).collect();
    println!(
        "spread: builds per agent min {min} max {max} mean {:.1}; agents with none: {}",
        n / opts.agents as f64,
        idle_agents.len()
    );
    println!(
        "  per agent: {}",
        per_agent
            .iter()
            .map(|(id, c)| format!("{}={c}", id.trim_start_matches("mac-")))
            .collect::<Vec<_>>()
            .join(" ")
    );
    if opts.holders > 0 && opts.holders < opts.agents {
        let holders: Vec<&String> = ids.iter().take(opts.holders).collect();
        let on = holder_of.values().filter(|h| holders.contains(h)).count();
        println!(
            "image-aware: {on}/{} builds = {:.1} % landed on the {} agents holding the image   (goal >= 95 %)",
            holder_of.len(),
            100.0 * on as f64 / holder_of.len().max(1) as f64,
            opts.holders
        );
    }
    let mut rss: Vec<f64> = memory.iter().map(|(r, _)| *r as f64 / 1024.0).collect();
    let mut hwm: Vec<f64> = memory.iter().map(|(_, h)| *h as f64 / 1024.0).collect();
    let mut cpu = idle_cpu.clone();
    for v in [&mut rss, &mut hwm, &mut cpu] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    let stat = |v: &[f64]| {
        format!(
            "min {:.2} p50 {:.2} max {:.2}",
            v.first().unwrap_or(&0.0),
            percentile(v, 50.0).unwrap_or(0.0),
            v.last().unwrap_or(&0.0)
        )
    };
    println!("agent RSS MiB: {}; peak (VmHWM) {}", stat(&rss), stat(&hwm));
    println!("agent idle CPU % of one core over {idle_secs:.1} s: {}", stat(&cpu));
    println!(
        "machine: {} cores, load {start_load} before, max 1-min load {max_load:.2} during, {end_load} after; CPU busy {busy_pct:.0} % during the run ({:.1} s)",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        elapsed.as_secs_f64()
    );
    // Not `finish`: without a controller there is nothing for the invariant checker, and the
    // journals of hundreds of builds are no report; dropping stops every process.
    drop(stack);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_kinds_name_resource_and_subresource() {
        let ns = "/apis/tartan.dev/v1alpha1/namespaces/e2e/macbuilds";
        assert_eq!(
            request_kind("PATCH", &format!("{ns}/b/status")),
            "PATCH macbuilds/status"
        );
        assert_eq!(request_kind("PATCH", &format!("{ns}/b")), "PATCH macbuilds");
        assert_eq!(request_kind("GET", &format!("{ns}/b")), "GET macbuilds");
        assert_eq!(
            request_kind("GET", &format!("{ns}?watch=true&resourceVersion=5")),
            "WATCH macbuilds"
        );
        assert_eq!(request_kind("GET", ns), "LIST macbuilds");
        assert_eq!(
            request_kind("GET", "/apis/tartan.dev/v1alpha1/macbuilds?watch=1"),
            "WATCH macbuilds"
        );
        assert_eq!(
            request_kind(
                "PATCH",
                "/apis/coordination.k8s.io/v1/namespaces/e2e/leases/tartan-agent-a"
            ),
            "PATCH leases"
        );
        assert_eq!(
            request_kind("POST", "/apis/events.k8s.io/v1/namespaces/e2e/events"),
            "POST events"
        );
        assert_eq!(request_kind("GET", "/version"), "GET /version");
        assert_eq!(macbuild_of(&format!("{ns}/b/status?x=1")), Some("b"));
        assert_eq!(macbuild_of(ns), None);
        assert_eq!(macbuild_of("/api/v1/namespaces/e2e/events"), None);
    }

    #[test]
    fn lost_claims_are_classed_by_the_claim_modules_reasons() {
        assert!(
            lost_reason_class(
                "claim lost to the claim's test failed (422); it is now claimed by mac-01 for b#1 (epoch 1); nothing cloned"
            )
            .starts_with("its claim's test")
        );
        assert!(lost_reason_class("claim lost to not claimable: Claimed").starts_with("it was not"));
        assert!(lost_reason_class("claim lost to nobody confirmed: x").starts_with("the claim was not"));
        assert_eq!(
            lost_reason_class("claim lost to the MacBuild was deleted"),
            "the MacBuild was deleted"
        );
        assert_eq!(lost_reason_class("something new"), "other");
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
    }
}
