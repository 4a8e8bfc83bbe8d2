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
        "no process crashed unless the runner killed it (exits with an error code are restarted)",
        found.exited.clone(),
    ));
    out
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
        out.extend(
            last.iter()
                .filter(|(_, r)| r.to != AttemptState::Retired)
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
            status: None,
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
        assert_eq!(checks.len(), invariants::TITLES.len() + 5);
        assert!(checks.iter().all(|c| c.failure.is_none()), "{checks:?}");
        let found = Findings {
            over_slots: vec!["3 VMs".into()],
            exited: vec![],
        };
        let checks = all(&World::default(), &found, 2);
        assert_eq!(checks.iter().filter(|c| c.failure.is_some()).count(), 1);
    }
}
