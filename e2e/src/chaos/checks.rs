//! The checks after a chaos run (pure, over a [`World`] and what was sampled during the run):
//! every invariant, one line each, and the run-wide ones issue 11 asks for.

use crate::invariants::{self, World};
use k8s_openapi::jiff::Timestamp;
use std::collections::BTreeMap;
use tartan_agent::record::Record;
use tartan_api::AttemptState;

/// What the runner saw while faults were in force.
#[derive(Clone, Debug, Default)]
pub struct Findings {
    /// Samples with more `mb-` VMs on a host's disk than it has slots.
    pub over_slots: Vec<String>,
    /// Processes that crashed (agents, the controller) or exited (watchdogs) without being
    /// killed by the runner.
    pub exited: Vec<String>,
    /// The `started` file's lines: the path of the VM folder each first step ran in, one line
    /// per start.
    pub step_starts: Vec<String>,
}

/// One check: its name and, if it failed, why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub failure: Option<String>,
}

fn check(name: impl Into<String>, problems: Vec<String>) -> Check {
    const SHOWN: usize = 6;
    let failure = (!problems.is_empty()).then(|| {
        let mut text = problems.iter().take(SHOWN).cloned().collect::<Vec<_>>().join("\n    ");
        if problems.len() > SHOWN {
            text.push_str(&format!("\n    ... and {} more", problems.len() - SHOWN));
        }
        format!("{} problem(s)\n    {text}", problems.len())
    });
    Check {
        name: name.into(),
        failure,
    }
}

/// Every check, in a fixed order.
pub fn all(world: &World, found: &Findings, slots: u8) -> Vec<Check> {
    let violations = invariants::check(world);
    let mut out: Vec<Check> = invariants::TITLES
        .iter()
        .enumerate()
        .map(|(i, title)| {
            let n = i as u8 + 1;
            let mine = violations
                .iter()
                .filter(|v| v.invariant == n)
                .map(|v| v.message.clone())
                .collect();
            check(format!("invariant {n}: {title}"), mine)
        })
        .collect();
    out.push(check("every CustomRun ended", not_ended(world)));
    out.push(check("every attempt retired after healing", open_attempts(world)));
    out.push(check(
        format!("never more than {slots} VMs on a host's disk (sampled)"),
        found.over_slots.clone(),
    ));
    out.push(check("no build held by two hosts at once", held_by_two_hosts(world)));
    out.push(check(
        "no attempt of a MacBuild admitted on two hosts, ever",
        admitted_on_two_hosts(world),
    ));
    out.push(check("no VM of a build left on any host", vms_left(world)));
    out.push(check(
        "every ended CustomRun states its vmRetirement",
        without_vm_retirement(world),
    ));
    out.push(check(
        "no build's step started more often than the build was admitted",
        steps_beyond_admissions(world, &found.step_starts),
    ));
    out.push(check(
        "no process crashed unless the runner killed it (exits with an error code are restarted)",
        found.exited.clone(),
    ));
    out
}

/// Attempts with an `Admitted` record in the journals of two hosts (one claim won twice).
pub fn admitted_on_two_hosts(world: &World) -> Vec<String> {
    let mut hosts: BTreeMap<(String, u32), Vec<&str>> = BTreeMap::new();
    for a in &world.agents {
        for r in &a.journal {
            if let (Some(b), Some(n), AttemptState::Admitted) = (&r.build, r.attempt, r.to) {
                let on = hosts.entry((b.uid.clone(), n)).or_default();
                if !on.contains(&a.id.as_str()) {
                    on.push(&a.id);
                }
            }
        }
    }
    let name = |uid: &str| {
        world
            .agents
            .iter()
            .flat_map(|a| &a.journal)
            .find_map(|r| r.build.as_ref().filter(|b| b.uid == uid).map(|b| b.name.clone()))
            .unwrap_or_default()
    };
    hosts
        .iter()
        .filter(|(_, on)| on.len() > 1)
        .map(|((uid, n), on)| format!("{} attempt {n} admitted on {}", name(uid), on.join(" and ")))
        .collect()
}

/// Tartan's VMs (`mb-`) still on a host's disk at the end, but the warm VMs its pool keeps.
pub fn vms_left(world: &World) -> Vec<String> {
    world
        .agents
        .iter()
        .flat_map(|a| {
            let warm = crate::invariants::open_warm_vms(&a.journal);
            a.vms_left
                .iter()
                .filter(move |v| v.starts_with(tartan_api::VM_PREFIX) && !warm.contains(*v))
                .map(move |v| format!("{} on {}", v, a.id))
        })
        .collect()
}

/// Ended CustomRuns without a `vmRetirement` result (the pipeline is not told what became of
/// the VM).
pub fn without_vm_retirement(world: &World) -> Vec<String> {
    world
        .custom_runs
        .iter()
        .filter(|r| matches!(r["status"]["conditions"][0]["status"].as_str(), Some("True" | "False")))
        .filter(|r| {
            !r["status"]["results"]
                .as_array()
                .is_some_and(|rs| rs.iter().any(|x| x["name"] == "vmRetirement" && x["value"].is_string()))
        })
        .map(|r| {
            let c = &r["status"]["conditions"][0];
            format!(
                "{} {}/{}",
                r["metadata"]["name"].as_str().unwrap_or("?"),
                c["status"].as_str().unwrap_or("-"),
                c["reason"].as_str().unwrap_or("-")
            )
        })
        .collect()
}

/// Builds whose first step started (a line of `starts`, naming the VM folder) more often than
/// the build had attempts admitted on any host: a step run twice in one attempt.
pub fn steps_beyond_admissions(world: &World, starts: &[String]) -> Vec<String> {
    let mut admitted: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    // The VM each admission names (an adopted warm VM's name does not carry the build's).
    let mut build_of_vm: BTreeMap<&str, &str> = BTreeMap::new();
    for r in world.agents.iter().flat_map(|a| &a.journal) {
        if let (Some(b), Some(n), AttemptState::Admitted) = (&r.build, r.attempt, r.to) {
            let a = admitted.entry(b.name.as_str()).or_default();
            if !a.contains(&n) {
                a.push(n);
            }
            if let Some(vm) = &r.vm {
                build_of_vm.insert(vm, b.name.as_str());
            }
        }
    }
    let mut started: BTreeMap<&str, usize> = BTreeMap::new();
    for line in starts {
        let vm = line.rsplit('/').next().unwrap_or(line);
        let named = build_of_vm.get(vm).copied();
        if let Some(name) = named.or_else(|| admitted.keys().copied().find(|name| vm.contains(&format!("-{name}-")))) {
            *started.entry(name).or_default() += 1;
        } else {
            *started.entry(line.as_str()).or_default() += 1;
        }
    }
    started
        .iter()
        .filter(|(name, n)| **n > admitted.get(*name).map_or(0, Vec::len))
        .map(|(name, n)| {
            format!(
                "{name}: its step started {n} times, {} attempt(s) admitted",
                admitted.get(name).map_or(0, Vec::len)
            )
        })
        .collect()
}

/// Per build, from the CustomRun's creation (or the first claim) to the first `Admitted`
/// record on any host: queue wait (creation to admission) and claim latency (an agent's first
/// `Requested` to its `Admitted`). Reported, not checked.
pub fn latency_report(world: &World) -> Vec<String> {
    let created: BTreeMap<&str, Timestamp> = world
        .custom_runs
        .iter()
        .filter_map(|r| {
            let name = r["metadata"]["name"].as_str()?;
            let at = r["metadata"]["creationTimestamp"].as_str()?.parse().ok()?;
            Some((name, at))
        })
        .collect();
    // build -> (first Requested, first Admitted)
    let mut firsts: BTreeMap<&str, (Option<Timestamp>, Option<Timestamp>)> = BTreeMap::new();
    for r in world.agents.iter().flat_map(|a| &a.journal) {
        let Some(b) = &r.build else { continue };
        let f = firsts.entry(b.name.as_str()).or_default();
        match r.to {
            AttemptState::Requested => f.0 = Some(f.0.map_or(r.time, |t| t.min(r.time))),
            AttemptState::Admitted => f.1 = Some(f.1.map_or(r.time, |t| t.min(r.time))),
            _ => {}
        }
    }
    let secs = |from: Timestamp, to: Timestamp| to.duration_since(from).as_secs_f64().max(0.0);
    let mut queue: Vec<f64> = vec![];
    let mut claim: Vec<f64> = vec![];
    for (name, (requested, admitted)) in &firsts {
        if let (Some(c), Some(a)) = (created.get(name), admitted) {
            queue.push(secs(*c, *a));
        }
        if let (Some(q), Some(a)) = (requested, admitted) {
            claim.push(secs(*q, *a));
        }
    }
    let never = created
        .keys()
        .filter(|n| firsts.get(*n).is_none_or(|f| f.1.is_none()))
        .count();
    vec![
        format!(
            "queue wait (CustomRun created to first Admitted): {}",
            quantiles(&mut queue)
        ),
        format!("claim latency (first Requested to Admitted): {}", quantiles(&mut claim)),
        format!("builds never admitted (timed out, cancelled or deleted in the queue): {never}"),
        outcome_report(world),
    ]
}

/// The CustomRuns by how they ended (`status/reason` of `Succeeded`; `-` for none), most first.
fn outcome_report(world: &World) -> String {
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for run in &world.custom_runs {
        let conditions = run["status"]["conditions"].as_array();
        let succeeded = conditions.and_then(|cs| cs.iter().find(|c| c["type"] == "Succeeded"));
        let said = succeeded.map_or("-/-".to_string(), |c| {
            let part = |k: &str| c[k].as_str().unwrap_or("-").to_string();
            format!("{}/{}", part("status"), part("reason"))
        });
        *by.entry(said).or_default() += 1;
    }
    let mut counts: Vec<(String, usize)> = by.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let counts: Vec<String> = counts.iter().map(|(said, n)| format!("{said} {n}")).collect();
    format!("CustomRuns by outcome: {}", counts.join(", "))
}

/// `n, p50, p99, max` of `values` in seconds.
pub fn quantiles(values: &mut [f64]) -> String {
    values.sort_by(f64::total_cmp);
    if values.is_empty() {
        return "none".into();
    }
    let at = |q: f64| values[((values.len() as f64 * q).ceil() as usize).clamp(1, values.len()) - 1];
    format!(
        "n {} p50 {:.1}s p99 {:.1}s max {:.1}s",
        values.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    )
}

/// CustomRuns whose `Succeeded` condition is not `True`/`False`.
pub fn not_ended(world: &World) -> Vec<String> {
    world
        .custom_runs
        .iter()
        .filter(|r| {
            let s = r["status"]["conditions"][0]["status"].as_str();
            !matches!(s, Some("True" | "False"))
        })
        .map(|r| {
            let c = &r["status"]["conditions"][0];
            format!(
                "{} {}/{}",
                r["metadata"]["name"].as_str().unwrap_or("?"),
                c["status"].as_str().unwrap_or("-"),
                c["reason"].as_str().unwrap_or("-")
            )
        })
        .collect()
}

/// Whose records these are: an attempt of a build, or an unaccounted VM.
fn key(r: &Record) -> String {
    match (&r.build, r.attempt) {
        (Some(b), Some(n)) => tartan_api::attempt_id(&b.name, n),
        _ => format!("VM {}", r.vm.as_deref().unwrap_or("?")),
    }
}

/// Attempts (and unknown VMs) whose last journal record is not `Retired`, per host.
pub fn open_attempts(world: &World) -> Vec<String> {
    let mut out = vec![];
    for a in &world.agents {
        let mut last: BTreeMap<String, &Record> = BTreeMap::new();
        for r in &a.journal {
            last.insert(key(r), r);
        }
        // A warm VM booting or ready is the pool's to keep; one being deleted is still open.
        let kept_warm = |r: &Record| {
            r.build.is_none() && r.warm.is_some() && matches!(r.to, AttemptState::Booting | AttemptState::Running)
        };
        out.extend(
            last.iter()
                .filter(|(_, r)| r.to != AttemptState::Retired && !kept_warm(r))
                .map(|(k, r)| format!("{} {k}: {r}", a.id)),
        );
    }
    out
}

/// From the journals: while one host holds a build (from its `Admitted` record to its
/// `Retired` one, or the end), no other host holds it.
pub fn held_by_two_hosts(world: &World) -> Vec<String> {
    // uid -> (host, from, until, attempt)
    let mut held: BTreeMap<String, Vec<(&str, Timestamp, Timestamp, String)>> = BTreeMap::new();
    for a in &world.agents {
        let mut open: BTreeMap<String, (Timestamp, String)> = BTreeMap::new();
        for r in &a.journal {
            let Some(b) = &r.build else { continue };
            if r.to == AttemptState::Admitted {
                open.entry(b.uid.clone()).or_insert((r.time, key(r)));
            }
            if r.to == AttemptState::Retired
                && let Some((from, id)) = open.remove(&b.uid)
            {
                held.entry(b.uid.clone()).or_default().push((&a.id, from, r.time, id));
            }
        }
        for (uid, (from, id)) in open {
            held.entry(uid).or_default().push((&a.id, from, Timestamp::MAX, id));
        }
    }
    let mut out = vec![];
    for spans in held.values() {
        for (i, x) in spans.iter().enumerate() {
            for y in &spans[i + 1..] {
                if x.0 != y.0 && x.1 < y.2 && y.1 < x.2 {
                    out.push(format!(
                        "{} held by {} ({} {} .. {}) and by {} ({} {} .. {})",
                        x.3, x.0, x.3, x.1, x.2, y.0, y.3, y.1, y.2
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::invariants::AgentFacts;
    use tartan_agent::record::{BuildRef, RECORD_VERSION};

    fn rec(seq: u64, secs: i64, attempt: u32, to: AttemptState) -> Record {
        Record {
            version: RECORD_VERSION,
            seq,
            time: Timestamp::from_second(1_800_000_000 + secs).unwrap(),
            build: Some(BuildRef {
                namespace: "ns".into(),
                name: "b1".into(),
                uid: "u1".into(),
            }),
            attempt: Some(attempt),
            vm: Some(format!("mb-ns-b1-{attempt}")),
            from: None,
            to,
            reason: None,
            detail: String::new(),
            outcome: None,
            slot: Some(0),
            deadline: None,
            max_attempts: None,
            step: None,
            generation: None,
            status: None,
            warm: None,
        }
    }

    fn host(id: &str, journal: Vec<Record>) -> AgentFacts {
        AgentFacts {
            id: id.into(),
            journal,
            ..AgentFacts::default()
        }
    }

    #[test]
    fn a_build_held_by_two_hosts_at_once_is_found_and_one_after_the_other_is_not() {
        use AttemptState::*;
        let a = host("host-1", vec![rec(1, 0, 1, Admitted), rec(2, 10, 1, Retired)]);
        let later = host("host-2", vec![rec(1, 11, 2, Admitted), rec(2, 20, 2, Retired)]);
        let world = World {
            agents: vec![a.clone(), later],
            ..World::default()
        };
        assert_eq!(held_by_two_hosts(&world), Vec::<String>::new());
        let overlapping = host("host-2", vec![rec(1, 5, 2, Admitted)]);
        let world = World {
            agents: vec![a, overlapping],
            ..World::default()
        };
        let found = held_by_two_hosts(&world);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("host-1") && found[0].contains("host-2"), "{found:?}");
    }

    #[test]
    fn open_attempts_are_those_not_retired() {
        use AttemptState::*;
        let world = World {
            agents: vec![host(
                "host-1",
                vec![rec(1, 0, 1, Admitted), rec(2, 1, 1, Retired), rec(3, 2, 2, Quarantined)],
            )],
            ..World::default()
        };
        let open = open_attempts(&world);
        assert_eq!(open.len(), 1, "{open:?}");
        assert!(open[0].contains("b1#2"), "{open:?}");
    }

    #[test]
    fn every_invariant_and_run_wide_check_has_a_line() {
        let checks = all(&World::default(), &Findings::default(), 2);
        assert_eq!(checks.len(), invariants::TITLES.len() + 9);
        assert!(checks.iter().all(|c| c.failure.is_none()), "{checks:?}");
        let found = Findings {
            over_slots: vec!["3 VMs".into()],
            ..Findings::default()
        };
        let checks = all(&World::default(), &found, 2);
        assert_eq!(checks.iter().filter(|c| c.failure.is_some()).count(), 1);
    }

    #[test]
    fn an_attempt_admitted_on_two_hosts_is_found_and_a_retry_elsewhere_is_not() {
        use AttemptState::*;
        let first = host("host-1", vec![rec(1, 0, 1, Admitted), rec(2, 10, 1, Retired)]);
        let retry = host("host-2", vec![rec(1, 11, 2, Admitted), rec(2, 20, 2, Retired)]);
        let world = World {
            agents: vec![first.clone(), retry],
            ..World::default()
        };
        assert_eq!(admitted_on_two_hosts(&world), Vec::<String>::new());
        let twice = host("host-3", vec![rec(1, 30, 1, Admitted)]);
        let world = World {
            agents: vec![first, twice],
            ..World::default()
        };
        assert_eq!(
            admitted_on_two_hosts(&world),
            vec!["b1 attempt 1 admitted on host-1 and host-3"]
        );
    }

    #[test]
    fn a_step_started_more_often_than_its_build_was_admitted_is_found() {
        use AttemptState::*;
        let world = World {
            agents: vec![host("host-1", vec![rec(1, 0, 1, Admitted), rec(2, 5, 2, Admitted)])],
            ..World::default()
        };
        let start = |a: u32| format!("/w/host-1/tart/vms/mb-ns-b1-{a}");
        assert_eq!(
            steps_beyond_admissions(&world, &[start(1), start(2)]),
            Vec::<String>::new()
        );
        assert_eq!(
            steps_beyond_admissions(&world, &[start(1), start(2), start(2)]),
            vec!["b1: its step started 3 times, 2 attempt(s) admitted"]
        );
        // A start no journal admitted at all.
        let stray = "/w/host-1/tart/vms/mb-ns-zz-1".to_string();
        assert_eq!(steps_beyond_admissions(&world, std::slice::from_ref(&stray)).len(), 1);
    }

    #[test]
    fn vms_left_and_runs_without_vm_retirement_are_found() {
        let world = World {
            agents: vec![AgentFacts {
                vms_left: vec!["mb-ns-b1-1".into(), "operator-vm".into()],
                ..host("host-1", vec![])
            }],
            custom_runs: vec![
                serde_json::json!({"metadata": {"name": "told"}, "status": {
                    "conditions": [{"status": "True", "reason": "Succeeded"}],
                    "results": [{"name": "vmRetirement", "value": "deleted"}]}}),
                serde_json::json!({"metadata": {"name": "untold"}, "status": {
                    "conditions": [{"status": "False", "reason": "Failed"}], "results": []}}),
                serde_json::json!({"metadata": {"name": "running"}, "status": {
                    "conditions": [{"status": "Unknown", "reason": "Running"}]}}),
            ],
            ..World::default()
        };
        assert_eq!(vms_left(&world), vec!["mb-ns-b1-1 on host-1"]);
        assert_eq!(without_vm_retirement(&world), vec!["untold False/Failed"]);
    }

    #[test]
    fn queue_wait_and_claim_latency_are_reported_by_quantile() {
        use AttemptState::*;
        let world = World {
            agents: vec![host("host-1", vec![rec(1, 4, 1, Requested), rec(2, 6, 1, Admitted)])],
            custom_runs: vec![serde_json::json!({"metadata": {"name": "b1",
                "creationTimestamp": Timestamp::from_second(1_800_000_000).unwrap().to_string()}})],
            ..World::default()
        };
        assert_eq!(
            latency_report(&world),
            vec![
                "queue wait (CustomRun created to first Admitted): n 1 p50 6.0s p99 6.0s max 6.0s",
                "claim latency (first Requested to Admitted): n 1 p50 2.0s p99 2.0s max 2.0s",
                "builds never admitted (timed out, cancelled or deleted in the queue): 0",
                "CustomRuns by outcome: -/- 1",
            ]
        );
        let ended = |status: &str, reason: &str| serde_json::json!({"status": {"conditions": [{"type": "Succeeded", "status": status, "reason": reason}]}});
        let world = World {
            custom_runs: vec![
                ended("True", "Succeeded"),
                ended("False", "CustomRunTimedOut"),
                ended("True", "Succeeded"),
            ],
            ..World::default()
        };
        assert_eq!(
            outcome_report(&world),
            "CustomRuns by outcome: True/Succeeded 2, False/CustomRunTimedOut 1"
        );
        assert_eq!(quantiles(&mut []), "none");
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantiles(&mut v), "n 100 p50 50.0s p99 99.0s max 100.0s");
    }
}
