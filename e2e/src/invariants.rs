//! Tartan's nine invariants ([`TITLES`]), checked from what a scenario left behind: each agent's journal,
//! its watchdog record and the VMs in its tart home, the test's planted foreign VMs, and the
//! CustomRuns, MacBuilds and Leases of the stack's namespace. Pure: [`check`] takes a [`World`]
//! and returns every violation it finds, each naming its invariant and the evidence.

use k8s_openapi::jiff::Timestamp;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use tartan_agent::record::Record;
use tartan_api::{AttemptState, Outcome, Reason, VM_PREFIX};
use tartan_watchdog::{Action, Line};

/// Facts about one agent (one host: state dir + tart home).
#[derive(Clone, Debug, Default)]
pub struct AgentFacts {
    pub id: String,
    /// Every journal record, in sequence order.
    pub journal: Vec<Record>,
    /// `watchdog.jsonl` of its state dir.
    pub watchdog: Vec<Line>,
    /// VM names in its tart home at the end.
    pub vms_left: Vec<String>,
}

/// A VM the test created behind Tartan's back (no `mb-` prefix): it must survive.
#[derive(Clone, Debug)]
pub struct PlantedVm {
    pub agent: String,
    pub vm: String,
    pub present: bool,
}

#[derive(Clone, Debug, Default)]
pub struct World {
    pub agents: Vec<AgentFacts>,
    pub planted: Vec<PlantedVm>,
    /// CustomRuns, MacBuilds and Leases of the namespace, as JSON.
    pub custom_runs: Vec<Value>,
    pub macbuilds: Vec<Value>,
    pub leases: Vec<Value>,
    /// The scenario made the cluster refuse terminal `macbuilds/status` writes and never lifted
    /// it (invariant 6's exception: "unless the cluster refuses writes past the deadline"). Only
    /// then may a journaled result of a timed-out CustomRun stay undelivered.
    pub refused_terminal_status: bool,
    /// When the agents' status writes could not reach the cluster (API outages and refusals,
    /// agents killed or frozen): a chaos run's fault windows. A live holder's `unconfirmed`
    /// after a deletion it journaled is the truth when its confirmation was held up by one.
    pub delivery_blocked: Vec<(Timestamp, Timestamp)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub invariant: u8,
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invariant {} ({}): {}",
            self.invariant,
            TITLES[self.invariant as usize - 1],
            self.message
        )
    }
}

/// The design's seven invariants, then two issue 11 adds (both break the promise that a result is
/// never lost and a finished build never runs again).
pub const TITLES: [&str; 9] = [
    "no two admitted allocations overlap in one slot",
    "a slot is reused only after its VM's deletion is confirmed",
    "every cloned VM is deleted, or quarantined and named in status",
    "terminal CustomRun status never contradicts the journal",
    "attempts never exceed maxAttempts; retries only after Interrupted",
    "a journaled result reaches the cluster once per attempt",
    "nothing deletes a VM it did not create",
    "a CustomRun's results are the ones journaled at Retiring for its attempt",
    "no attempt is admitted twice and no VM is cloned twice",
];

/// Who occupies a slot: an attempt of a build, a warm VM of the pool, or an unaccounted VM.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Occupant {
    Attempt { uid: String, attempt: u32 },
    Warm { vm: String },
    Unknown { vm: String },
}

fn occupant(r: &Record) -> Option<Occupant> {
    match (&r.build, r.attempt, &r.vm) {
        (Some(b), Some(n), _) => Some(Occupant::Attempt {
            uid: b.uid.clone(),
            attempt: n,
        }),
        (None, _, Some(vm)) if r.warm.is_some() => Some(Occupant::Warm { vm: vm.clone() }),
        (None, _, Some(vm)) => Some(Occupant::Unknown { vm: vm.clone() }),
        _ => None,
    }
}

/// The warm VM an attempt's `Admitted` record adopts (the VM and its slot pass to the attempt).
fn adopts(r: &Record) -> Option<Occupant> {
    let vm = r.vm.clone()?;
    (r.build.is_some() && r.to == AttemptState::Admitted && r.warm.is_some()).then_some(Occupant::Warm { vm })
}

fn confirms_deletion(r: &Record) -> bool {
    r.to == AttemptState::Retired && matches!(r.reason, Some(Reason::VMDeleted | Reason::Resolved))
}

pub fn check(world: &World) -> Vec<Violation> {
    let mut v = Vec::new();
    for agent in &world.agents {
        slots(agent, &mut v);
        vms_accounted(agent, world, &mut v);
        deletes_only_own(agent, &mut v);
    }
    let ix = Index::of(world);
    attempts(&ix, &mut v);
    custom_runs(&ix, &mut v);
    delivery(&ix, &mut v);
    results(&ix, &mut v);
    admitted_once(world, &mut v);
    for p in &world.planted {
        if !p.present {
            v.push(Violation {
                invariant: 7,
                message: format!("VM {} planted by the test on {} is gone", p.vm, p.agent),
            });
        }
    }
    v
}

/// Invariants 1 and 2 from one journal.
fn slots(agent: &AgentFacts, v: &mut Vec<Violation>) {
    let mut held: BTreeMap<u8, (Occupant, u64)> = BTreeMap::new();
    let mut slot_of: BTreeMap<Occupant, u8> = BTreeMap::new();
    for r in &agent.journal {
        let Some(who) = occupant(r) else { continue };
        // An adoption: the warm VM's slot passes to the attempt with the VM (not a reuse).
        if let (Some(warm), Some(slot)) = (adopts(r), r.slot)
            && held.get(&slot).is_some_and(|(holder, _)| *holder == warm)
        {
            slot_of.remove(&warm);
            held.remove(&slot);
        }
        if let Some(slot) = r.slot
            && r.to.holds_slot()
        {
            match held.get(&slot) {
                Some((other, since)) if *other != who => v.push(Violation {
                    invariant: 1,
                    message: format!(
                        "{}: #{} ({r}) takes slot {slot} while {other:?} holds it since #{since}",
                        agent.id, r.seq
                    ),
                }),
                Some(_) => {}
                None => {
                    held.insert(slot, (who.clone(), r.seq));
                    slot_of.insert(who.clone(), slot);
                }
            }
        }
        if r.to == AttemptState::Retired
            && let Some(slot) = slot_of.remove(&who)
        {
            held.remove(&slot);
            if !confirms_deletion(r) {
                v.push(Violation {
                    invariant: 2,
                    message: format!(
                        "{}: #{} releases slot {slot} without confirmed deletion: {r}",
                        agent.id, r.seq
                    ),
                });
            }
            if let Some(vm) = &r.vm
                && agent.vms_left.contains(vm)
            {
                v.push(Violation {
                    invariant: 2,
                    message: format!(
                        "{}: #{} released slot {slot} but VM {vm} is still on disk",
                        agent.id, r.seq
                    ),
                });
            }
        }
    }
}

/// The warm pool's VMs `journal` keeps open (their last record is not `Retired`): a live agent's
/// pool holds them, each with a deadline file.
pub fn open_warm_vms(journal: &[Record]) -> BTreeSet<String> {
    let mut last: BTreeMap<&str, AttemptState> = BTreeMap::new();
    for r in journal.iter().filter(|r| r.build.is_none() && r.warm.is_some()) {
        if let Some(vm) = &r.vm {
            last.insert(vm, r.to);
        }
    }
    last.into_iter()
        .filter(|(_, to)| *to != AttemptState::Retired)
        .map(|(vm, _)| vm.to_string())
        .collect()
}

/// Invariant 3: every `mb-` VM left on disk is quarantined in the journal and named in status,
/// or a warm VM of the pool its journal keeps (it has a deadline file, as any VM the agent makes).
fn vms_accounted(agent: &AgentFacts, world: &World, v: &mut Vec<Violation>) {
    for vm in agent.vms_left.iter().filter(|vm| vm.starts_with(VM_PREFIX)) {
        let last = agent.journal.iter().rev().find(|r| r.vm.as_deref() == Some(vm));
        match last {
            Some(r) if r.build.is_none() && r.warm.is_some() && r.to != AttemptState::Retired => {}
            Some(r) if r.to == AttemptState::Quarantined => {
                if let Some(b) = &r.build
                    && let Some(mb) = world.macbuilds.iter().find(|m| m["metadata"]["uid"] == b.uid.as_str())
                    && mb["status"]["vm"].as_str() != Some(vm.as_str())
                {
                    v.push(Violation {
                        invariant: 3,
                        message: format!(
                            "{}: VM {vm} is quarantined (#{}) but MacBuild {} names {:?}",
                            agent.id, r.seq, b, mb["status"]["vm"]
                        ),
                    });
                }
            }
            Some(r) => v.push(Violation {
                invariant: 3,
                message: format!(
                    "{}: VM {vm} is still on disk; the journal's last record on it is {r}",
                    agent.id
                ),
            }),
            None => v.push(Violation {
                invariant: 3,
                message: format!("{}: VM {vm} is on disk and the journal never names it", agent.id),
            }),
        }
    }
}

/// Invariant 7: deletions are of VMs this host's agent created.
fn deletes_only_own(agent: &AgentFacts, v: &mut Vec<Violation>) {
    // Attempts' VMs, and the pool's (its `[*] -> Booting` records, before their clones).
    let created: BTreeSet<&str> = agent
        .journal
        .iter()
        .filter(|r| {
            (r.build.is_some() && r.to == AttemptState::Admitted)
                || (r.warm.is_some() && r.build.is_none() && r.from.is_none())
        })
        .filter_map(|r| r.vm.as_deref())
        .collect();
    for r in agent.journal.iter().filter(|r| r.to == AttemptState::Retired) {
        if let Some(vm) = &r.vm
            && r.reason == Some(Reason::VMDeleted)
            && !created.contains(vm.as_str())
        {
            v.push(Violation {
                invariant: 7,
                message: format!(
                    "{}: #{} deleted VM {vm}, which no attempt of this agent admitted",
                    agent.id, r.seq
                ),
            });
        }
    }
    for line in agent.watchdog.iter().filter(|l| l.action == Action::Deleted) {
        if !line.vm.starts_with(VM_PREFIX) || !created.contains(line.vm.as_str()) {
            v.push(Violation {
                invariant: 7,
                message: format!(
                    "{}: the watchdog deleted {}, which this agent never admitted",
                    agent.id, line.vm
                ),
            });
        }
    }
}

/// The world's records and objects, looked up by build: one pass over every journal, so that the
/// checks per build or per CustomRun read only that build's records (at 10,000 builds a scan of
/// every journal per CustomRun took most of a chaos run's checking time).
struct Index<'a> {
    world: &'a World,
    /// Every record of a build, by uid, over all agents (in agent then journal order).
    by_uid: BTreeMap<&'a str, Vec<(&'a str, &'a Record)>>,
    /// The same, by build name (all uids under that name).
    by_name: BTreeMap<&'a str, Vec<(&'a str, &'a Record)>>,
    macbuilds: BTreeMap<&'a str, &'a Value>,
    runs: BTreeMap<&'a str, &'a Value>,
}

impl<'a> Index<'a> {
    fn of(world: &'a World) -> Index<'a> {
        let mut by_uid: BTreeMap<&str, Vec<(&str, &Record)>> = BTreeMap::new();
        let mut by_name: BTreeMap<&str, Vec<(&str, &Record)>> = BTreeMap::new();
        for a in &world.agents {
            for r in &a.journal {
                if let Some(b) = &r.build {
                    by_uid.entry(&b.uid).or_default().push((&a.id, r));
                    by_name.entry(&b.name).or_default().push((&a.id, r));
                }
            }
        }
        let named = |objects: &'a [Value], field: &str| -> BTreeMap<&'a str, &'a Value> {
            let mut m = BTreeMap::new();
            for o in objects {
                if let Some(key) = o["metadata"][field].as_str() {
                    // The first one wins, as a search in list order would find it.
                    m.entry(key).or_insert(o);
                }
            }
            m
        };
        Index {
            world,
            by_uid,
            by_name,
            macbuilds: named(&world.macbuilds, "uid"),
            runs: named(&world.custom_runs, "name"),
        }
    }

    /// Every record of the builds named `name`, with the agent id.
    fn named(&self, name: &str) -> impl Iterator<Item = (&'a str, &'a Record)> + '_ {
        self.by_name.get(name).into_iter().flatten().copied()
    }

    /// The records of attempt id `attempt` (`<name>#<n>`).
    fn of_attempt(&self, attempt: &'a str) -> impl Iterator<Item = &'a Record> + '_ {
        let name = attempt.rsplit_once('#').map_or(attempt, |(name, _)| name);
        self.named(name)
            .map(|(_, r)| r)
            .filter(move |r| r.attempt_id().as_deref() == Some(attempt))
    }

    fn macbuild(&self, uid: &str) -> Option<&'a Value> {
        self.macbuilds.get(uid).copied()
    }

    fn run(&self, name: &str) -> Option<&'a Value> {
        self.runs.get(name).copied()
    }
}

/// `max-attempts` of a build: its MacBuild's spec, else its CustomRun's param, else the default.
fn max_attempts(ix: &Index, uid: &str, name: &str) -> u64 {
    if let Some(n) = ix.macbuild(uid).and_then(|m| m["spec"]["maxAttempts"].as_u64()) {
        return n;
    }
    ix.run(name)
        .and_then(|r| r["spec"]["params"].as_array())
        .and_then(|ps| ps.iter().find(|p| p["name"] == "max-attempts"))
        .and_then(|p| p["value"].as_str())
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::from(tartan_api::DEFAULT_MAX_ATTEMPTS))
}

/// The outcome an attempt was given (its `Retiring` record, or a `Retired` with an outcome).
fn outcome_of<'a>(records: &[(&str, &'a Record)], attempt: u32) -> Option<(Outcome, &'a Record)> {
    records
        .iter()
        .filter(|(_, r)| r.attempt == Some(attempt))
        .find_map(|(_, r)| r.outcome.map(|o| (o, *r)))
}

/// Invariant 5.
fn attempts(ix: &Index, v: &mut Vec<Violation>) {
    for (uid, records) in &ix.by_uid {
        let name = records[0].1.build.as_ref().map(|b| b.name.clone()).unwrap_or_default();
        let admitted: BTreeSet<u32> = records
            .iter()
            .filter(|(_, r)| r.to == AttemptState::Admitted)
            .filter_map(|(_, r)| r.attempt)
            .collect();
        let max = max_attempts(ix, uid, &name);
        if let Some(&top) = admitted.iter().max()
            && u64::from(top) > max
        {
            v.push(Violation {
                invariant: 5,
                message: format!("{name}: attempt {top} admitted, maxAttempts is {max}"),
            });
        }
        let admitted_by = |n: u32| -> BTreeSet<&str> {
            records
                .iter()
                .filter(|(_, r)| r.to == AttemptState::Admitted && r.attempt == Some(n))
                .map(|(agent, _)| *agent)
                .collect()
        };
        for &n in admitted.iter().filter(|&&n| n > 1) {
            // A hand-over (the claim reset, another host claiming anew) is not a retry: the
            // attempt before ran on another host, and may even still run there.
            let before = admitted_by(n - 1);
            if !before.is_empty() && before.is_disjoint(&admitted_by(n)) {
                continue;
            }
            // The outcome of attempt n - 1 is its holder's: a host that only tried to claim it
            // may journal its own claim as cancelled (the MacBuild deleted meanwhile).
            let held: Vec<(&str, &Record)> = records
                .iter()
                .filter(|(agent, _)| before.is_empty() || before.contains(agent))
                .copied()
                .collect();
            match outcome_of(&held, n - 1) {
                Some((Outcome::Interrupted, _)) => {}
                Some((o, r)) => v.push(Violation {
                    invariant: 5,
                    message: format!("{name}: attempt {n} follows attempt {} which ended {o} ({r})", n - 1),
                }),
                None => v.push(Violation {
                    invariant: 5,
                    message: format!(
                        "{name}: attempt {n} admitted but attempt {} has no recorded outcome",
                        n - 1
                    ),
                }),
            }
        }
    }
}

fn condition(run: &Value) -> Option<(&str, &str, &str)> {
    let c = run["status"]["conditions"].as_array()?.first()?;
    (c["type"] == "Succeeded").then_some(())?;
    Some((
        c["status"].as_str().unwrap_or(""),
        c["reason"].as_str().unwrap_or(""),
        c["message"].as_str().unwrap_or(""),
    ))
}

/// A CustomRun result by name.
pub fn result<'a>(run: &'a Value, name: &str) -> Option<&'a str> {
    run["status"]["results"]
        .as_array()?
        .iter()
        .find(|r| r["name"] == name)?["value"]
        .as_str()
}

/// The journal's last outcome for the build named `name` (any uid, newest record last).
///
/// Only a host that admitted the attempt speaks for its outcome: a host that was still trying to
/// claim it when the MacBuild went away journals its claim `Cancelled` (nothing cloned).
fn last_outcome<'a>(ix: &Index<'a>, name: &str) -> Option<(&'a str, &'a Record)> {
    let admitted: BTreeSet<(&str, u32)> = ix
        .named(name)
        .filter(|(_, r)| r.to == AttemptState::Admitted)
        .filter_map(|(agent, r)| Some((agent, r.attempt?)))
        .collect();
    ix.named(name)
        .filter(|(agent, r)| r.attempt.is_some_and(|n| admitted.contains(&(*agent, n))) && r.outcome.is_some())
        .max_by_key(|(_, r)| (r.time, r.seq))
}

/// Invariant 4.
fn custom_runs(ix: &Index, v: &mut Vec<Violation>) {
    let world = ix.world;
    for run in &world.custom_runs {
        let name = run["metadata"]["name"].as_str().unwrap_or("?");
        let Some((status, reason, message)) = condition(run) else {
            continue;
        };
        if status == "Unknown" {
            continue;
        }
        let retirement = result(run, "vmRetirement");
        let mut bad = |m: String| {
            v.push(Violation {
                invariant: 4,
                message: format!("CustomRun {name} {status}/{reason}: {m}"),
            })
        };
        if retirement == Some("unconfirmed") {
            if !matches!(reason, "CustomRunTimedOut" | "CustomRunCancelled") {
                bad("vmRetirement=unconfirmed on a run that neither timed out nor was cancelled".into());
            }
            // With a live holder, `unconfirmed` is the truth only when no confirmation came (issue
            // 6: "unconfirmed when no confirmation came, e.g. the cluster refuses the agent's
            // status writes"): the cluster refused it, or the holder had not journaled the VM
            // deleted when the run ended (a quarantined VM), or only just (its confirmation on its
            // way); otherwise the lease must have expired.
            if world.refused_terminal_status
                || (message.contains("lease is live")
                    && (!deletion_confirmable_before_end(ix, name, run) || confirmation_held_up(ix, name, run)))
            {
                continue;
            }
            if !message.contains("lease expired") {
                bad(format!(
                    "vmRetirement=unconfirmed but the message does not say the holder's lease expired: {message}"
                ));
            }
            lease_really_expired(run, message, world, &mut bad);
            continue;
        }
        // `none` says no agent ever claimed the build, so no VM was created: false once a host
        // admitted it before the run ended.
        if retirement == Some("none")
            && let Some((agent, r)) = admitted_before_end(ix, name, run)
        {
            bad(format!(
                "vmRetirement=none but {agent} admitted the build before the run ended: {r}"
            ));
        }
        // A timed-out run says `deleted` only when its agent confirmed the deletion in time.
        let confirmed_in_time = retirement == Some("deleted") && deletion_journaled_before_end(ix, name, run);
        if reason == "CustomRunTimedOut" && retirement != Some("none") && !confirmed_in_time {
            bad(format!(
                "timed out with vmRetirement={retirement:?}, expected unconfirmed, none, or deleted as confirmed \
                 by a journaled deletion: {message}"
            ));
        }
        let journal = last_outcome(ix, name);
        let want = match (status, reason) {
            ("True", _) => Some(Outcome::Succeeded),
            ("False", "CustomRunCancelled") => Some(Outcome::Cancelled),
            ("False", "CustomRunTimedOut") => None,
            ("False", r) if r.starts_with("Invalid") || r == "RetriesNotSupported" => None,
            ("False", _) => Some(Outcome::Failed),
            _ => None,
        };
        match (want, journal) {
            (Some(Outcome::Failed), Some((_, r))) if r.outcome == Some(Outcome::Interrupted) => {}
            (Some(Outcome::Cancelled), Some((_, r)))
                if r.outcome == Some(Outcome::Interrupted) && ended_before_a_withdrawn_retry(ix, name, run) => {}
            (Some(w), Some((agent, r))) if r.outcome != Some(w) => {
                bad(format!("the journal of {agent} ends the build with {r}"))
            }
            (Some(_), None) if retirement == Some("deleted") => bad("no journal records an outcome for it".into()),
            _ => {}
        }
        if status == "True"
            && let Some(attempt) = result(run, "attempt")
        {
            let retired = ix.of_attempt(attempt).any(confirms_deletion);
            if !retired {
                bad(format!(
                    "result attempt={attempt} but no journal records that attempt Retired"
                ));
            }
        }
    }
}

/// When a CustomRun ended: its `completionTime`, else its condition's last transition.
fn run_ended(run: &Value) -> Option<Timestamp> {
    run["status"]["completionTime"]
        .as_str()
        .or_else(|| run["status"]["conditions"][0]["lastTransitionTime"].as_str())
        .and_then(|s| s.parse::<Timestamp>().ok())
}

/// Whether the first journaled confirmation of a deletion for build `name` could not reach the
/// cluster before the run ended: a [`World::delivery_blocked`] window overlaps the time from that
/// record (less a delivery retry's slack) to the run's end.
fn confirmation_held_up(ix: &Index, name: &str, run: &Value) -> bool {
    // Status retries back off up to seconds after a window lifts.
    const SLACK: k8s_openapi::jiff::SignedDuration = k8s_openapi::jiff::SignedDuration::from_secs(5);
    let ended = run_ended(run);
    let confirmed = ix
        .named(name)
        .filter(|(_, r)| confirms_deletion(r))
        .map(|(_, r)| r.time)
        .min();
    let (Some(ended), Some(confirmed)) = (ended, confirmed) else {
        return false;
    };
    ix.world
        .delivery_blocked
        .iter()
        .any(|(from, to)| *from <= ended + SLACK && *to + SLACK >= confirmed)
}

/// The first `Admitted` record of build `name` in any journal, if it is no later than the
/// CustomRun's end (unknown end: any).
fn admitted_before_end<'a>(ix: &Index<'a>, name: &str, run: &Value) -> Option<(&'a str, &'a Record)> {
    let ended = run_ended(run);
    ix.named(name)
        .filter(|(_, r)| {
            r.to == AttemptState::Admitted
                && r.from != Some(AttemptState::Admitted)
                // API stamps have whole seconds.
                && ended.is_none_or(|e| r.time.as_second() <= e.as_second())
        })
        .min_by_key(|(_, r)| (r.time, r.seq))
}

/// Whether some journal confirmed a VM of build `name` deleted (`Retired (VMDeleted|Resolved)`)
/// no later than the CustomRun's end (unknown end: assumed so, the stricter reading).
fn deletion_journaled_before_end(ix: &Index, name: &str, run: &Value) -> bool {
    deletion_journaled_by(ix, name, run_ended(run))
}

/// How long a confirmation journaled by a live holder may take to reach the controller: its
/// status write and the controller's read, on a machine the fleet keeps loaded. One journaled
/// 1.7 s before its run timed out (seed 61001, 50 hosts) was still on its way.
const CONFIRMATION_IN_FLIGHT: k8s_openapi::jiff::SignedDuration = k8s_openapi::jiff::SignedDuration::from_secs(5);

/// Whether the deletion was journaled so long before the run ended that the controller must
/// have had the confirmation ([`CONFIRMATION_IN_FLIGHT`]).
fn deletion_confirmable_before_end(ix: &Index, name: &str, run: &Value) -> bool {
    deletion_journaled_by(ix, name, run_ended(run).map(|e| e - CONFIRMATION_IN_FLIGHT))
}

/// Whether some journal confirmed a VM of build `name` deleted no later than `by` (`None`:
/// at any time).
fn deletion_journaled_by(ix: &Index, name: &str, by: Option<Timestamp>) -> bool {
    ix.named(name).any(|(_, r)| {
        confirms_deletion(r)
            // API stamps have whole seconds.
            && by.is_none_or(|by| r.time.as_second() <= by.as_second())
    })
}

/// For `vmRetirement=unconfirmed`: the holder's last renewal (named in the message) was more
/// than its lease duration before the CustomRun ended.
fn lease_really_expired(run: &Value, message: &str, world: &World, bad: &mut impl FnMut(String)) {
    let Some(renewed) = message
        .split("last renewed ")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .and_then(|s| s.parse::<Timestamp>().ok())
    else {
        return;
    };
    let ended = run_ended(run);
    let Some(ended) = ended else { return };
    let agent = message
        .split("agent ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .unwrap_or("");
    let duration = world
        .leases
        .iter()
        .find(|l| l["spec"]["holderIdentity"] == agent)
        .and_then(|l| l["spec"]["leaseDurationSeconds"].as_i64())
        .unwrap_or(20);
    // API stamps have whole seconds.
    if ended.as_second() - renewed.as_second() < duration - 1 {
        bad(format!(
            "ended {ended} only {}s after {agent}'s last renewal {renewed}; its lease lasts {duration}s",
            ended.as_second() - renewed.as_second()
        ));
    }
}

/// Invariant 6: the last terminal journal record of each build is what the cluster shows. A
/// record whose snapshot names another holder than the MacBuild's claim is a stale holder's (the
/// build was handed on): the fence refuses its writes by design, so it is not owed to the cluster.
fn delivery(ix: &Index, v: &mut Vec<Violation>) {
    let world = ix.world;
    for (uid, records) in &ix.by_uid {
        let Some((agent, r)) = last_owed_result(ix, uid, records) else {
            continue;
        };
        let name = r.build.as_ref().map(|b| b.name.as_str()).unwrap_or("?");
        let run = ix.run(name);
        if world.refused_terminal_status
            && run
                .and_then(condition)
                .is_some_and(|(_, reason, _)| reason == "CustomRunTimedOut")
        {
            continue; // the cluster refused the result past the deadline: the timeout stands
        }
        match ix.macbuild(uid) {
            Some(mb) => {
                let seq = mb["status"]["journalSeq"].as_u64();
                if seq != Some(r.seq) {
                    v.push(Violation {
                        invariant: 6,
                        message: format!(
                            "MacBuild {name} shows journalSeq {seq:?}, {agent}'s journal ends it with #{}: {r}",
                            r.seq
                        ),
                    });
                }
                let phase = mb["status"]["phase"].as_str();
                let want = r.status.as_ref().and_then(|s| s["phase"].as_str());
                if phase != want {
                    v.push(Violation {
                        invariant: 6,
                        message: format!(
                            "MacBuild {name} shows phase {phase:?}, the journal {want:?} (#{})",
                            r.seq
                        ),
                    });
                }
                let mut numbers: Vec<u64> = mb["status"]["attempts"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|x| x["number"].as_u64()).collect())
                    .unwrap_or_default();
                let n = numbers.len();
                numbers.dedup();
                if numbers.len() != n {
                    v.push(Violation {
                        invariant: 6,
                        message: format!("MacBuild {name} lists an attempt twice: {:?}", mb["status"]["attempts"]),
                    });
                }
            }
            None => {
                if let Some(run) = run
                    && condition(run).is_none_or(|(s, _, _)| s == "Unknown")
                {
                    v.push(Violation {
                        invariant: 6,
                        message: format!(
                            "MacBuild {name} is gone and CustomRun {name} never ended, though the journal ended it with {r}"
                        ),
                    });
                }
            }
        }
        // A host whose claim never got to admission (the MacBuild deleted under it) journals
        // it ended, nothing cloned: a run saying no attempt and no VM tells that truth.
        let never_admitted = !records
            .iter()
            .any(|(_, a)| a.to == AttemptState::Admitted && a.attempt == r.attempt);
        let says_nothing_ran =
            run.is_some_and(|run| result(run, "attempt") == Some("") && result(run, "vmRetirement") == Some("none"));
        if let Some(run) = run
            && condition(run).is_some_and(|(s, _, _)| s != "Unknown")
            && let Some(got) = result(run, "attempt")
            && Some(got) != r.attempt_id().as_deref()
            && !(never_admitted
                && (says_nothing_ran || names_the_interrupted_attempt_before(records, (agent, r), run, got)))
        {
            v.push(Violation {
                invariant: 6,
                message: format!(
                    "CustomRun {name} reports attempt {got}, the journal's result is {:?}",
                    r.attempt_id()
                ),
            });
        }
    }
}

/// The terminal record (`Retired` with a result) the cluster owes the build `uid`: the latest, by
/// claim epoch and then by time, of those its claim's holder journaled. The holder is the
/// MacBuild's, or once the MacBuild is gone, the one of the highest epoch among the snapshots:
/// a stale holder (the build handed on) may end its copy after the new holder, and its writes
/// are fenced out.
fn last_owed_result<'a>(ix: &Index, uid: &str, records: &[(&'a str, &'a Record)]) -> Option<(&'a str, &'a Record)> {
    let claim_of = |r: &Record| r.status.as_ref().map(|s| s["claim"].clone()).unwrap_or_default();
    let epoch = |r: &Record| claim_of(r)["epoch"].as_u64().unwrap_or(0);
    let terminal: Vec<(&str, &Record)> = records
        .iter()
        .copied()
        .filter(|(_, r)| {
            r.to == AttemptState::Retired
                && r.status
                    .as_ref()
                    .and_then(|s| s["phase"].as_str())
                    .is_some_and(|p| matches!(p, "Succeeded" | "Failed" | "Cancelled"))
        })
        .collect();
    let holder: Option<String> = match ix.macbuild(uid) {
        Some(mb) => mb["status"]["claim"]["holder"].as_str().map(str::to_string),
        None => terminal
            .iter()
            .max_by_key(|(_, r)| epoch(r))
            .and_then(|(_, r)| claim_of(r)["holder"].as_str().map(str::to_string)),
    };
    let fenced_out = |r: &Record| {
        let of = claim_of(r);
        matches!((holder.as_deref(), of["holder"].as_str()), (Some(h), Some(o)) if h != o)
    };
    terminal
        .into_iter()
        .filter(|(_, r)| !fenced_out(r))
        .max_by_key(|(_, r)| (epoch(r), r.time, r.seq))
}

/// Whether the build's last record is a retry its host withdrew before admission and the run
/// names the interrupted attempt before it ([`names_the_interrupted_attempt_before`]).
fn ended_before_a_withdrawn_retry(ix: &Index, name: &str, run: &Value) -> bool {
    let records: Vec<(&str, &Record)> = ix.named(name).collect();
    let last = records
        .iter()
        .filter(|(_, r)| r.to == AttemptState::Retired)
        .max_by_key(|(_, r)| (r.time, r.seq));
    let Some(&(agent, last)) = last else { return false };
    let admitted = records
        .iter()
        .any(|(_, r)| r.to == AttemptState::Admitted && r.attempt == last.attempt);
    !admitted
        && result(run, "attempt")
            .is_some_and(|got| names_the_interrupted_attempt_before(&records, (agent, last), run, got))
}

/// Whether a cancelled run names the attempt before a retry that was withdrawn before its
/// admission: the host journaled attempt N-1 admitted and interrupted (an agent restart) and its
/// retry N `Cancelled` before admission, nothing cloned (seed 81043, chaos-2928: the controller
/// ended the run on N-1, the claim the MacBuild showed, while N was not yet claimed). N-1 is then
/// the last attempt that had a VM; a run saying `deleted` needs N-1's deletion journaled.
fn names_the_interrupted_attempt_before(
    records: &[(&str, &Record)],
    (agent, last): (&str, &Record),
    run: &Value,
    got: &str,
) -> bool {
    let withdrawn = last.outcome == Some(Outcome::Cancelled)
        && matches!(last.reason, Some(Reason::CancelRequested | Reason::OwnerDeleted));
    let cancelled =
        condition(run).is_some_and(|(_, reason, _)| matches!(reason, "CustomRunCancelled" | "CustomRunTimedOut"));
    let Some(before) = last.attempt.and_then(|n| n.checked_sub(1)) else {
        return false;
    };
    let before_id = last.build.as_ref().map(|b| format!("{}#{before}", b.name));
    let of_before: Vec<&Record> = records
        .iter()
        .filter(|(a, r)| *a == agent && r.attempt == Some(before) && r.seq < last.seq)
        .map(|(_, r)| *r)
        .collect();
    let admitted = of_before.iter().any(|r| r.to == AttemptState::Admitted);
    let interrupted = of_before.iter().any(|r| r.outcome == Some(Outcome::Interrupted));
    let deleted = of_before.iter().any(|r| confirms_deletion(r));
    withdrawn
        && cancelled
        && before_id.as_deref() == Some(got)
        && admitted
        && interrupted
        && (deleted || result(run, "vmRetirement") != Some("deleted"))
}

/// The results an attempt's journal records give it: those of the snapshot journaled with its
/// outcome (its first `Retiring` record, or a `Retired` one for an attempt that ended before a VM
/// existed), as the CustomRun shows them (`""` when absent).
pub fn journaled_results<'a>(world: &'a World, attempt: &str) -> Option<([String; 3], &'a Record)> {
    let records: Vec<&Record> = world
        .agents
        .iter()
        .flat_map(|a| &a.journal)
        .filter(|r| r.attempt_id().as_deref() == Some(attempt))
        .collect();
    results_of(&records)
}

/// [`journaled_results`] from the attempt's own records.
fn results_of<'a>(attempt_records: &[&'a Record]) -> Option<([String; 3], &'a Record)> {
    let records = || attempt_records.iter().copied().filter(|r| r.outcome.is_some());
    let first_of = |to: AttemptState| records().filter(|r| r.to == to).min_by_key(|r| (r.time, r.seq));
    let r = first_of(AttemptState::Retiring).or_else(|| first_of(AttemptState::Retired))?;
    let results = r.status.as_ref().map(|s| &s["results"]).unwrap_or(&Value::Null);
    let text = |v: &Value| match v {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        _ => String::new(),
    };
    Some((
        [
            text(&results["testsPassed"]),
            text(&results["testsTotal"]),
            text(&results["artifactUrl"]),
        ],
        r,
    ))
}

/// Invariant 8: a CustomRun that ended on a result (not a timeout, not an unconfirmed retirement)
/// shows the results journaled with its attempt's outcome. Later records (a recovery that retires
/// the VM) may not replace them with less.
fn results(ix: &Index, v: &mut Vec<Violation>) {
    for run in &ix.world.custom_runs {
        let name = run["metadata"]["name"].as_str().unwrap_or("?");
        let Some((status, reason, _)) = condition(run) else {
            continue;
        };
        if status == "Unknown" || reason == "CustomRunTimedOut" || result(run, "vmRetirement") == Some("unconfirmed") {
            continue;
        }
        let Some(attempt) = result(run, "attempt").filter(|a| !a.is_empty()) else {
            continue;
        };
        let records: Vec<&Record> = ix.of_attempt(attempt).collect();
        let Some((want, r)) = results_of(&records) else {
            continue;
        };
        let got = ["testsPassed", "testsTotal", "artifact"].map(|n| result(run, n).unwrap_or("").to_string());
        if got != want {
            v.push(Violation {
                invariant: 8,
                message: format!(
                    "CustomRun {name} {status}/{reason} shows testsPassed/testsTotal/artifact {got:?} for {attempt}; the journal recorded {want:?} with its outcome ({r})"
                ),
            });
        }
    }
}

/// Invariant 9: over the whole history of every journal, each attempt is admitted once and each
/// VM name is cloned (`Admitted -> Booting`) once. A second admission means a finished attempt
/// was claimed and run again.
fn admitted_once(world: &World, v: &mut Vec<Violation>) {
    let mut admitted: BTreeMap<(String, u32), Vec<(&str, &Record)>> = BTreeMap::new();
    let mut cloned: BTreeMap<&str, Vec<(&str, &Record)>> = BTreeMap::new();
    for a in &world.agents {
        for r in &a.journal {
            // A resume or detach found in Admitted stays there: not a second admission.
            if r.to == AttemptState::Admitted
                && r.from != Some(AttemptState::Admitted)
                && let (Some(b), Some(n)) = (&r.build, r.attempt)
            {
                admitted.entry((b.uid.clone(), n)).or_default().push((&a.id, r));
            }
            if r.to == AttemptState::Booting
                && r.from != Some(AttemptState::Booting)
                && let Some(vm) = &r.vm
            {
                cloned.entry(vm).or_default().push((&a.id, r));
            }
        }
    }
    let list = |rs: &[(&str, &Record)]| {
        rs.iter()
            .map(|(a, r)| format!("{a}: {r}"))
            .collect::<Vec<_>>()
            .join("; ")
    };
    for rs in admitted.values().filter(|rs| rs.len() > 1) {
        let id = rs[0].1.attempt_id().unwrap_or_default();
        v.push(Violation {
            invariant: 9,
            message: format!("attempt {id} admitted {} times: {}", rs.len(), list(rs)),
        });
    }
    for (vm, rs) in cloned.iter().filter(|(_, rs)| rs.len() > 1) {
        v.push(Violation {
            invariant: 9,
            message: format!("VM {vm} cloned {} times: {}", rs.len(), list(rs)),
        });
    }
}

#[cfg(test)]
mod tests;
