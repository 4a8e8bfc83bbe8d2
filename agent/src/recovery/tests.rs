//! Tests of the recovery planner: one per case of the source document, run through a small
//! scripted runtime so the journal lines the plan produces can be compared with the source's.

use super::*;
use crate::machine::{Action, Deleted, Refusal, Transition, request, step};
use AttemptState as S;
use k8s_openapi::jiff::SignedDuration;

const DEADLINE: &str = "2026-10-05T02:56:06.653639Z";
const ME: &str = "mac-mini-07";

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}
fn secs(n: i64) -> SignedDuration {
    SignedDuration::from_secs(n)
}
fn deadline() -> Timestamp {
    ts(DEADLINE)
}
/// First admission: the deadline is 1800 s later.
fn t0() -> Timestamp {
    deadline() - secs(1800)
}
fn me() -> AgentId {
    AgentId(ME.into())
}
fn mk_build() -> BuildRef {
    BuildRef {
        namespace: "ci".into(),
        name: "build-42-mac-build".into(),
        uid: "u-42".into(),
    }
}
fn vm_of(n: u32) -> String {
    format!("mb-ci-build-42-mac-build-a{n}")
}
fn key(n: u32) -> AttemptKey {
    AttemptKey {
        build: mk_build(),
        attempt: n,
    }
}
fn mk_vm(name: &str, running: bool) -> ObservedVm {
    ObservedVm {
        name: name.into(),
        running,
    }
}
/// The MacBuild as the cluster shows it: claimed by us for `attempt`, status at `seq`.
fn mk_view(attempt: u32, seq: u64) -> BuildView {
    BuildView {
        namespace: "ci".into(),
        name: "build-42-mac-build".into(),
        uid: "u-42".into(),
        owner_deleted: false,
        deletion_requested: false,
        cancel_requested: false,
        claim: Some(ClaimView {
            holder: ME.into(),
            attempt,
        }),
        journal_seq: Some(seq),
        max_attempts: None,
        timeout_seconds: 1800,
        has_finalizer: true,
        generation: None,
    }
}
fn mk_cluster(views: Vec<BuildView>) -> ClusterView {
    ClusterView {
        builds: views,
        assumed: false,
    }
}

/// Writes a journal by driving the real machine, so replayed inputs are ones it produces.
struct Journal {
    recs: Vec<Record>,
    seq: u64,
    views: BTreeMap<u32, Attempt>,
}

impl Journal {
    fn new(first_seq: u64) -> Journal {
        Journal {
            recs: vec![],
            seq: first_seq,
            views: BTreeMap::new(),
        }
    }
    fn push(&mut self, n: u32, t: &Transition) {
        let a = self.views.get_mut(&n).unwrap();
        let r = a.record(t, self.seq);
        self.seq += 1;
        a.observe(&r);
        self.recs.push(r);
    }
    fn request(&mut self, n: u32, retry_deadline: Option<Timestamp>, at: Timestamp) -> &mut Self {
        let a = Attempt::new(mk_build(), n, vm_of(n), 2);
        let next = retry_deadline.map(|deadline| NextAttempt {
            build: mk_build(),
            attempt: n,
            deadline,
        });
        let t = request(&a, next.as_ref(), at);
        self.views.insert(n, a);
        self.push(n, &t);
        self
    }
    fn go(&mut self, n: u32, ev: Event, at: Timestamp) -> &mut Self {
        let t = step(&self.views[&n], ev, at, &Config::default()).unwrap();
        self.push(n, &t);
        self
    }
    /// Attempt `n` from its request along the normal path until it is in `upto`.
    fn run_to(&mut self, n: u32, upto: AttemptState) -> &mut Self {
        let path = [
            (
                S::Admitted,
                Event::Admit {
                    slot: 0,
                    slots: 1,
                    timeout: secs(1800),
                },
                0,
            ),
            (S::Booting, Event::Boot, 1),
            (
                S::Running,
                Event::GuestReady {
                    after: SignedDuration::from_millis(13_910),
                },
                15,
            ),
            (S::Collecting, Event::StepsSucceeded { steps: 2 }, 600),
        ];
        let retry = if n > 1 { Some(deadline()) } else { None };
        self.request(n, retry, t0());
        for (state, ev, at) in path {
            if self.views[&n].state == upto {
                break;
            }
            assert!(S::ALL.contains(&state));
            self.go(n, ev, t0() + secs(at));
        }
        assert_eq!(self.views[&n].state, upto);
        self
    }
    fn lines(&self) -> Vec<String> {
        self.recs.iter().map(|r| r.to_string()).collect()
    }
}

/// A scripted host: tart processes left per VM, VMs present, deletes that fail.
#[derive(Default)]
struct World {
    procs: BTreeMap<String, u32>,
    present: BTreeSet<String>,
    failing_deletes: BTreeMap<String, u32>,
    /// VMs whose `tart run` still runs (a subset of `present`).
    running: BTreeSet<String>,
    /// Whether the guests of running VMs answer `tart exec`.
    guest_answers: bool,
}

/// A test-only runtime: performs recovery actions and machine actions against `World`,
/// journaling through `step`, and logs journal lines and I/O in order.
struct Runtime {
    rp: Replay,
    cluster: ClusterView,
    seq: u64,
    now: Timestamp,
    cfg: Config,
    world: World,
    log: Vec<String>,
}

impl Runtime {
    fn new(j: &Journal, cluster: ClusterView, world: World, now: Timestamp) -> Runtime {
        let cfg = Config::default();
        let mut rp = replay(&j.recs, &cfg);
        rp.see(&cluster, &cfg);
        Runtime {
            rp,
            cluster,
            seq: j.seq,
            now,
            cfg,
            world,
            log: vec![],
        }
    }

    fn idx(&self, k: &AttemptKey) -> usize {
        self.rp.attempts.iter().position(|a| a.key() == *k).unwrap()
    }

    fn journal(&mut self, i: usize, t: &Transition) {
        let r = self.rp.attempts[i].record(t, self.seq);
        self.seq += 1;
        self.log.push(r.to_string());
        self.rp.attempts[i].observe(&r);
    }

    fn step(&mut self, k: &AttemptKey, ev: Event) {
        let i = self.idx(k);
        let t = step(&self.rp.attempts[i], ev, self.now, &self.cfg).unwrap();
        self.journal(i, &t);
        for act in t.actions {
            self.act(k, act);
        }
    }

    fn delete(&mut self, vm: &str, context: DeleteContext) -> Event {
        self.log.push(format!("tart stop+delete {vm}"));
        match self.world.failing_deletes.get_mut(vm) {
            Some(n) if *n > 0 => {
                *n -= 1;
                Event::DeleteFailed {
                    context,
                    error: format!("tart delete {vm}: exit 1"),
                }
            }
            _ => {
                self.world.present.remove(vm);
                Event::VmDeleted {
                    how: context.deleted(SignedDuration::from_millis(5_010)),
                }
            }
        }
    }

    fn request(&mut self, next: &NextAttempt) {
        let a = Attempt::new(next.build.clone(), next.attempt, vm_of(next.attempt), 2);
        let t = request(&a, Some(next), self.now);
        self.rp.attempts.push(a);
        let i = self.rp.attempts.len() - 1;
        self.rp.see(&self.cluster.clone(), &self.cfg);
        self.journal(i, &t);
        for act in t.actions {
            self.act(&next_key(next), act);
        }
    }

    fn admit(&mut self, k: &AttemptKey, timeout: SignedDuration) {
        let Some(slot) = free_slot(self.cfg.slots, &self.rp.slot_holders()) else {
            self.log.push(format!("a{} waits for a free slot", k.attempt));
            return;
        };
        let i = self.idx(k);
        let ev = Event::Admit {
            slot,
            slots: self.cfg.slots,
            timeout,
        };
        match step(&self.rp.attempts[i], ev.clone(), self.now, &self.cfg) {
            Err(Refusal::RetryWindowClosed { .. }) => self.step(k, Event::DeadlinePassed { at_start: None }),
            _ => self.step(k, ev),
        }
    }

    fn act(&mut self, k: &AttemptKey, act: Action) {
        match act {
            Action::DeliverStatus => self.log.push("deliver status".into()),
            Action::StopAndDeleteVm { vm, context } => {
                let ev = self.delete(&vm, context);
                self.step(k, ev);
            }
            Action::ConfirmVmGone { vm } => {
                self.log.push(format!("confirm {vm} gone"));
                let ev = if self.world.present.contains(&vm) {
                    Event::DeleteFailed {
                        context: DeleteContext::Watchdog,
                        error: "still listed".into(),
                    }
                } else {
                    Event::VmDeleted {
                        how: Deleted::ByWatchdog,
                    }
                };
                self.step(k, ev);
            }
            // The timer fires at once here: one retry.
            Action::RetryDeleteLater { vm, .. } => {
                self.log.push(format!("retry deleting {vm} later"));
                self.retry_delete(k, &vm);
            }
            Action::RemoveDeadlineFile { vm } => self.log.push(format!("rm deadline file of {vm}")),
            Action::ReleaseSlot { slot } => self.log.push(format!("release slot {}", slot + 1)),
            Action::RemoveFinalizer => self.log.push("remove finalizer".into()),
            Action::AdmitNextAttempt { attempt, deadline } => {
                self.log.push(format!("admit a{attempt} next"));
                let next = NextAttempt {
                    build: k.build.clone(),
                    attempt,
                    deadline,
                };
                self.request(&next);
                self.admit(&next_key(&next), secs(1800));
            }
            Action::ClaimBuild { attempt } => self.log.push(format!("claim for a{attempt}")),
            Action::WriteDeadlineFile { vm, .. } => self.log.push(format!("write deadline file of {vm}")),
            other => self.log.push(format!("{other:?}")),
        }
    }

    fn retry_delete(&mut self, k: &AttemptKey, vm: &str) {
        match self.delete(vm, DeleteContext::Retry) {
            ev @ Event::VmDeleted { .. } => self.step(k, ev),
            _ => self.log.push(format!("{vm} still there; will retry")),
        }
    }

    fn perform(&mut self, plan: &[RecoveryAction]) {
        for a in plan {
            match a {
                RecoveryAction::QuarantineUnknownVm { vm, slot, .. } => {
                    let r = a.record(self.seq, self.now).unwrap();
                    self.seq += 1;
                    self.log.push(r.to_string());
                    self.rp.unknown.push(UnknownVm {
                        vm: vm.clone(),
                        slot: *slot,
                    });
                }
                RecoveryAction::ResolveUnknownVm { vm, .. } => {
                    let r = a.record(self.seq, self.now).unwrap();
                    self.seq += 1;
                    self.log.push(r.to_string());
                    self.rp.unknown.retain(|u| &u.vm != vm);
                }
                RecoveryAction::KillVmProcesses { attempt, vm, then, .. } => {
                    let killed = self.world.procs.remove(vm).unwrap_or(0);
                    self.log.push(format!("kill tart processes of {vm}: {killed}"));
                    self.step(attempt, then.event(killed));
                }
                RecoveryAction::Resume {
                    attempt,
                    vm,
                    clone_again: true,
                    ..
                } => {
                    let killed = self.world.procs.remove(vm).unwrap_or(0);
                    self.log.push(format!("kill tart processes of {vm}: {killed}"));
                    self.step(
                        attempt,
                        Event::Resume {
                            after: secs(2),
                            clone_again: true,
                        },
                    );
                }
                RecoveryAction::Resume { attempt, vm, found, .. } => {
                    // A boot's guest is not asked: the resumed boot's readiness probe waits for it.
                    let answers = self.world.guest_answers || *found == S::Booting;
                    if answers && self.world.running.contains(vm) {
                        self.log.push(format!("guest of {vm} answers"));
                        self.step(
                            attempt,
                            Event::Resume {
                                after: secs(2),
                                clone_again: false,
                            },
                        );
                    } else {
                        self.log.push(format!("guest of {vm} does not answer"));
                        let killed = self.world.procs.remove(vm).unwrap_or(0);
                        self.log.push(format!("kill tart processes of {vm}: {killed}"));
                        self.step(attempt, Event::AgentRestarted { killed });
                    }
                }
                RecoveryAction::Step { attempt, event } => self.step(attempt, event.clone()),
                RecoveryAction::DeleteVm { attempt, vm, context } => {
                    if *context == DeleteContext::Retry {
                        self.retry_delete(attempt, vm);
                    } else {
                        let ev = self.delete(vm, *context);
                        self.step(attempt, ev);
                    }
                }
                RecoveryAction::ConfirmVmGone { attempt, vm } => {
                    self.act(attempt, Action::ConfirmVmGone { vm: vm.clone() })
                }
                RecoveryAction::ResumeAdmission { attempt, timeout } => self.admit(attempt, *timeout),
                RecoveryAction::RedeliverStatus { seq, .. } => self.log.push(format!("redeliver record {seq}")),
                RecoveryAction::AdmitNextAttempt { next } => self.request(next),
                RecoveryAction::RemoveFinalizer { .. } => self.log.push("remove finalizer".into()),
            }
        }
    }
}

fn next_key(next: &NextAttempt) -> AttemptKey {
    AttemptKey {
        build: next.build.clone(),
        attempt: next.attempt,
    }
}

fn world(vms: &[&str]) -> World {
    World {
        present: vms.iter().map(|s| s.to_string()).collect(),
        ..World::default()
    }
}

fn observed(w: &World) -> Vec<ObservedVm> {
    w.present.iter().map(|n| mk_vm(n, w.running.contains(n))).collect()
}

/// Plans with the default config and performs the plan; returns (plan, log).
fn recover(j: &Journal, cluster: ClusterView, w: World, now: Timestamp) -> (Vec<RecoveryAction>, Vec<String>) {
    let plan = plan(&j.recs, &observed(&w), &cluster, &me(), now, &Config::default());
    let mut rt = Runtime::new(j, cluster, w, now);
    rt.perform(&plan);
    (plan, rt.log)
}

fn assert_lines(got: &[String], want: &[&str]) {
    let got: Vec<&str> = got.iter().map(String::as_str).collect();
    assert_eq!(got, want);
}

#[test]
fn kill_9_mid_build_deletes_clone_then_admits_attempt_2() {
    let mut j = Journal::new(117);
    j.run_to(1, S::Running);
    assert_eq!(
        j.lines().last().unwrap(),
        "#120 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s"
    );
    // launchd already killed tart run/exec; the clone is still on disk.
    let w = world(&[&vm_of(1)]);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, 120)]), w, ts("2026-10-05T02:41:58.395Z"));
    assert_eq!(
        plan,
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Running,
            vm: vm_of(1),
            then: Ending::AgentRestarted
        }]
    );
    assert_lines(
        &log,
        &[
            "kill tart processes of mb-ci-build-42-mac-build-a1: 0",
            "#121 a1 Running -> Retiring (AgentRestarted) found Running at agent start; killed 0 tart process(es) \
             outcome=Interrupted",
            "deliver status",
            "tart stop+delete mb-ci-build-42-mac-build-a1",
            "#122 a1 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start",
            "rm deadline file of mb-ci-build-42-mac-build-a1",
            "release slot 1",
            "deliver status",
            "admit a2 next",
            "#123 a2 [*] -> Requested retry after a1 was interrupted; deadline 2026-10-05T02:56:06.653639Z kept",
            "claim for a2",
            "#124 a2 Requested -> Admitted (SlotFree) slot 1/1, deadline 2026-10-05T02:56:06.653639Z",
            "write deadline file of mb-ci-build-42-mac-build-a2",
            "deliver status",
        ],
    );
}

#[test]
fn surviving_tart_processes_are_killed_and_counted_before_the_retry() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Collecting);
    let mut w = world(&[&vm_of(1)]);
    w.procs.insert(vm_of(1), 2);
    let (_, log) = recover(&j, mk_cluster(vec![mk_view(1, 5)]), w, t0() + secs(700));
    assert_eq!(log[0], "kill tart processes of mb-ci-build-42-mac-build-a1: 2");
    assert_eq!(
        log[1],
        "#6 a1 Collecting -> Retiring (AgentRestarted) found Collecting at agent start; killed 2 tart process(es) \
         outcome=Interrupted"
    );
    // Deletion is confirmed before the next attempt is even requested.
    let deleted = log.iter().position(|l| l.contains("(VMDeleted)")).unwrap();
    let admitted = log.iter().position(|l| l.contains("a2 Requested -> Admitted")).unwrap();
    assert!(deleted < admitted);
}

#[test]
fn admitted_attempt_found_at_start_gets_the_same_cleanup() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Admitted);
    let restart = Config {
        resume_after_restart: false,
        ..Config::default()
    };
    let cluster = mk_cluster(vec![mk_view(1, 2)]);
    let p = plan(&j.recs, &[], &cluster, &me(), t0() + secs(30), &restart);
    assert_eq!(
        p,
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Admitted,
            vm: vm_of(1),
            then: Ending::AgentRestarted
        }]
    );
    let mut rt = Runtime::new(&j, cluster.clone(), world(&[]), t0() + secs(30));
    rt.cfg = restart;
    rt.perform(&p);
    assert!(
        rt.log
            .contains(&"#4 a1 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start".into())
    );
    // Resuming, nothing was cloned yet: the same attempt boots (its deadline file first).
    let (p, log) = recover(&j, cluster, world(&[]), t0() + secs(30));
    assert_eq!(
        p,
        vec![RecoveryAction::Resume {
            attempt: key(1),
            found: S::Admitted,
            vm: vm_of(1),
            clone_again: true,
        }]
    );
    assert!(log[1].starts_with("#3 a1 Admitted -> Admitted (Resumed) "), "{log:?}");
    assert_eq!(log[2], "write deadline file of mb-ci-build-42-mac-build-a1");
    assert!(!log.iter().any(|l| l.contains("Retiring")), "{log:?}");
}

#[test]
fn agent_died_after_retiring_succeeded_keeps_outcome_and_never_reruns() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Collecting)
        .go(1, Event::TestsPassed { passed: 2, total: 2 }, t0() + secs(640));
    let w = world(&[&vm_of(1)]);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, 6)]), w, t0() + secs(650));
    assert_eq!(
        plan,
        vec![RecoveryAction::DeleteVm {
            attempt: key(1),
            vm: vm_of(1),
            context: DeleteContext::AgentStart
        }]
    );
    assert_lines(
        &log,
        &[
            "tart stop+delete mb-ci-build-42-mac-build-a1",
            "#7 a1 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start",
            "rm deadline file of mb-ci-build-42-mac-build-a1",
            "release slot 1",
            "deliver status",
            "remove finalizer",
        ],
    );
    let mut rp = replay(&j.recs, &Config::default());
    rp.see(&mk_cluster(vec![mk_view(1, 6)]), &Config::default());
    assert_eq!(rp.attempts[0].outcome, Some(tartan_api::Outcome::Succeeded));
}

#[test]
fn refused_terminal_status_is_redelivered_after_restart() {
    let mut j = Journal::new(213);
    j.run_to(1, S::Collecting)
        .go(1, Event::TestsPassed { passed: 2, total: 2 }, t0() + secs(640))
        .go(
            1,
            Event::VmDeleted {
                how: Deleted::Stopped {
                    took: SignedDuration::from_millis(5_010),
                },
            },
            t0() + secs(646),
        );
    let lines = j.lines();
    assert_eq!(
        lines[5],
        "#218 a1 Collecting -> Retiring (TestsPassed) 2/2 tests passed outcome=Succeeded"
    );
    assert_eq!(
        lines[6],
        "#219 a1 Retiring -> Retired (VMDeleted) stopped and deleted in 5.01s"
    );
    // The admission policy refused both terminal writes: the API still shows Collecting (#217).
    let mut view = mk_view(1, 217);
    view.has_finalizer = false;
    let now = t0() + secs(700);
    let (plan, log) = recover(&j, mk_cluster(vec![view.clone()]), world(&[]), now);
    assert_eq!(
        plan,
        vec![RecoveryAction::RedeliverStatus {
            attempt: key(1),
            seq: 219
        }]
    );
    assert_eq!(
        plan[0].to_string(),
        "status behind journal (record 219); delivering it again"
    );
    assert_lines(&log, &["redeliver record 219"]);

    // Not when the cluster is current, names another holder or attempt, or the build is gone.
    let p = |v: Option<BuildView>| {
        let c = mk_cluster(v.into_iter().collect());
        super::plan(&j.recs, &[], &c, &me(), now, &Config::default())
    };
    assert_eq!(
        p(Some(BuildView {
            journal_seq: Some(219),
            ..view.clone()
        })),
        vec![]
    );
    let other = ClaimView {
        holder: "mac-mini-08".into(),
        attempt: 1,
    };
    assert_eq!(
        p(Some(BuildView {
            claim: Some(other),
            ..view.clone()
        })),
        vec![]
    );
    let later = ClaimView {
        holder: ME.into(),
        attempt: 2,
    };
    assert_eq!(
        p(Some(BuildView {
            claim: Some(later),
            ..view.clone()
        })),
        vec![]
    );
    assert_eq!(p(None), vec![]);
    // Never delivered at all: redelivered too; a finalizer still on comes off after it.
    let fresh = BuildView {
        journal_seq: None,
        has_finalizer: true,
        ..view
    };
    assert_eq!(
        p(Some(fresh)),
        vec![
            RecoveryAction::RedeliverStatus {
                attempt: key(1),
                seq: 219
            },
            RecoveryAction::RemoveFinalizer { build: mk_build() }
        ]
    );
}

#[test]
fn failed_delete_quarantines_then_resolves() {
    let vm = "mb-default-build-7-c49f62f4";
    let mut j = Journal::new(257);
    j.run_to(1, S::Running);
    // The tests' VM names differ from the source's; rename this attempt's VM.
    for r in &mut j.recs {
        r.vm = Some(vm.into());
    }
    j.views.get_mut(&1).unwrap().vm = vm.into();
    let mut w = world(&[vm]);
    w.failing_deletes.insert(vm.into(), 1);
    let now = t0() + secs(300);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, 260)]), w, now);
    assert_eq!(
        plan,
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Running,
            vm: vm.into(),
            then: Ending::AgentRestarted
        }]
    );
    assert_lines(
        &log[..9],
        &[
            "kill tart processes of mb-default-build-7-c49f62f4: 0",
            "#261 a1 Running -> Retiring (AgentRestarted) found Running at agent start; killed 0 tart process(es) \
             outcome=Interrupted",
            "deliver status",
            "tart stop+delete mb-default-build-7-c49f62f4",
            "#262 a1 Retiring -> Quarantined (DeleteFailed) could not delete at agent start, slot quarantined: \
             tart delete mb-default-build-7-c49f62f4: exit 1",
            "deliver status",
            "retry deleting mb-default-build-7-c49f62f4 later",
            "tart stop+delete mb-default-build-7-c49f62f4",
            "#263 a1 Quarantined -> Retired (Resolved) clone directory gone (deleted on retry); slot released",
        ],
    );
    // Only then is the slot free and attempt 2 admitted.
    assert_eq!(
        log[9..13],
        [
            "rm deadline file of mb-default-build-7-c49f62f4",
            "release slot 1",
            "deliver status",
            "admit a2 next"
        ]
    );
    assert_eq!(
        log[13],
        "#264 a2 [*] -> Requested retry after a1 was interrupted; deadline 2026-10-05T02:56:06.653639Z kept"
    );
    assert_eq!(
        log[15],
        "#265 a2 Requested -> Admitted (SlotFree) slot 1/1, deadline 2026-10-05T02:56:06.653639Z"
    );

    // Restarted while quarantined: the slot stays blocked and the deletion is retried.
    let quarantined: Vec<Record> = {
        let mut rp = replay(&j.recs, &Config::default());
        let mut recs = j.recs.clone();
        let a = &mut rp.attempts[0];
        for (ev, seq) in [
            (Event::AgentRestarted { killed: 0 }, 261),
            (
                Event::DeleteFailed {
                    context: DeleteContext::AgentStart,
                    error: "exit 1".into(),
                },
                262,
            ),
        ] {
            let r = a.record(&step(a, ev, now, &Config::default()).unwrap(), seq);
            a.observe(&r);
            recs.push(r);
        }
        recs
    };
    assert_eq!(
        free_slot(1, &replay(&quarantined, &Config::default()).slot_holders()),
        None
    );
    let j3 = Journal {
        recs: quarantined,
        seq: 263,
        views: BTreeMap::new(),
    };
    let (plan, log) = recover(&j3, mk_cluster(vec![mk_view(1, 262)]), world(&[vm]), now + secs(60));
    assert_eq!(
        plan,
        vec![RecoveryAction::DeleteVm {
            attempt: key(1),
            vm: vm.into(),
            context: DeleteContext::Retry
        }]
    );
    assert_eq!(
        log[1],
        "#263 a1 Quarantined -> Retired (Resolved) clone directory gone (deleted on retry); slot released"
    );
    assert!(
        log.iter()
            .any(|l| l.starts_with("#265 a2 Requested -> Admitted (SlotFree)"))
    );
}

#[test]
fn unknown_vm_is_quarantined_and_blocks_slot() {
    // An earlier build finished and retired cleanly; a stray clone with our prefix remains,
    // next to a VM that is not ours.
    let mut j = Journal::new(1);
    j.run_to(1, S::Collecting)
        .go(1, Event::TestsPassed { passed: 2, total: 2 }, t0() + secs(640))
        .go(
            1,
            Event::VmDeleted {
                how: Deleted::Stopped { took: secs(6) },
            },
            t0() + secs(646),
        );
    let mut view = mk_view(1, 7);
    view.has_finalizer = false;
    let stray = "mb-ci-stray-9";
    let w = world(&[stray, "macos-sequoia-base", &vm_of(1)]);
    let now = t0() + secs(900);
    let (plan, log) = recover(&j, mk_cluster(vec![view.clone()]), w, now);
    // The retired attempt's own VM reappearing is as unaccounted for as any stray.
    assert_eq!(
        plan,
        vec![
            RecoveryAction::QuarantineUnknownVm {
                vm: vm_of(1),
                running: false,
                slot: Some(0)
            },
            RecoveryAction::QuarantineUnknownVm {
                vm: stray.into(),
                running: false,
                slot: None
            },
        ]
    );
    assert_lines(
        &log,
        &[
            "#8 - [*] -> Quarantined (UnknownVM) mb-ci-build-42-mac-build-a1 (stopped) has no open attempt; \
             left to an operator, slot 1 blocked",
            "#9 - [*] -> Quarantined (UnknownVM) mb-ci-stray-9 (stopped) has no open attempt; left to an operator, \
             one slot blocked",
        ],
    );
    // Journal them: the slot is blocked, and a second start neither re-quarantines nor deletes.
    let mut recs = j.recs.clone();
    recs.extend(
        plan.iter()
            .enumerate()
            .map(|(i, a)| a.record(8 + i as u64, now).unwrap()),
    );
    let rp = replay(&recs, &Config::default());
    assert_eq!(rp.unknown.len(), 2);
    assert_eq!(free_slot(1, &rp.slot_holders()), None);
    let c = mk_cluster(vec![view]);
    let vms = [mk_vm(stray, true), mk_vm(&vm_of(1), false)];
    assert_eq!(plan_for(&recs, &vms, &c, now), vec![]);
    // The operator deleted one: its slot is released, the other still blocks it.
    let left = [mk_vm(stray, true)];
    let p = plan_for(&recs, &left, &c, now);
    assert_eq!(
        p,
        vec![RecoveryAction::ResolveUnknownVm {
            vm: vm_of(1),
            slot: Some(0)
        }]
    );
    assert_eq!(
        p[0].record(10, now).unwrap().to_string(),
        "#10 - Quarantined -> Retired (Resolved) mb-ci-build-42-mac-build-a1 is gone (removed by an operator); \
         slot released"
    );
    recs.push(p[0].record(10, now).unwrap());
    assert_eq!(free_slot(1, &replay(&recs, &Config::default()).slot_holders()), None);
    recs.push(plan_for(&recs, &[], &c, now)[0].record(11, now).unwrap());
    assert_eq!(free_slot(1, &replay(&recs, &Config::default()).slot_holders()), Some(0));
}

fn plan_for(recs: &[Record], vms: &[ObservedVm], c: &ClusterView, now: Timestamp) -> Vec<RecoveryAction> {
    plan(recs, vms, c, &me(), now, &Config::default())
}

#[test]
fn unknown_vm_makes_the_retry_wait_for_its_slot() {
    let mut j = Journal::new(120);
    j.run_to(1, S::Running);
    let w = world(&[&vm_of(1), "mb-ci-stray-9"]);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, 124)]), w, t0() + secs(900));
    assert_eq!(
        plan[0],
        RecoveryAction::QuarantineUnknownVm {
            vm: "mb-ci-stray-9".into(),
            running: false,
            slot: None
        }
    );
    assert!(matches!(plan[1], RecoveryAction::KillVmProcesses { .. }));
    assert!(!log.iter().any(|l| l.contains("mb-ci-stray-9") && l.contains("delete")));
    assert_eq!(log.last().unwrap(), "a2 waits for a free slot");
    // With two slots it takes the one the running attempt does not hold.
    let cfg = Config {
        slots: 2,
        ..Config::default()
    };
    let vms = [mk_vm(&vm_of(1), true), mk_vm("mb-ci-stray-9", true)];
    let p = super::plan(
        &j.recs,
        &vms,
        &mk_cluster(vec![mk_view(1, 124)]),
        &me(),
        t0() + secs(900),
        &cfg,
    );
    assert_eq!(
        p[0],
        RecoveryAction::QuarantineUnknownVm {
            vm: "mb-ci-stray-9".into(),
            running: true,
            slot: Some(1)
        }
    );
}

#[test]
fn owner_deleted_while_down_is_cancelled_not_retried() {
    let mut j = Journal::new(30);
    j.run_to(1, S::Running);
    let mut view = mk_view(1, 33);
    view.owner_deleted = true;
    view.deletion_requested = true;
    let (plan, log) = recover(&j, mk_cluster(vec![view]), world(&[&vm_of(1)]), t0() + secs(400));
    assert_eq!(
        plan,
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Running,
            vm: vm_of(1),
            then: Ending::OwnerDeleted
        }]
    );
    assert_lines(
        &log,
        &[
            "kill tart processes of mb-ci-build-42-mac-build-a1: 0",
            "#34 a1 Running -> Retiring (OwnerDeleted) owner deleted; found Running at agent start; \
             killed 0 tart process(es) outcome=Cancelled",
            "deliver status",
            "tart stop+delete mb-ci-build-42-mac-build-a1",
            "#35 a1 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start",
            "rm deadline file of mb-ci-build-42-mac-build-a1",
            "release slot 1",
            "deliver status",
            "remove finalizer",
        ],
    );
}

#[test]
fn cancel_while_down_during_quarantine_is_recorded_and_the_delete_retried() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running)
        .go(1, Event::AgentRestarted { killed: 0 }, t0() + secs(60))
        .go(
            1,
            Event::DeleteFailed {
                context: DeleteContext::AgentStart,
                error: "exit 1".into(),
            },
            t0() + secs(61),
        );
    let mut view = mk_view(1, 6);
    view.cancel_requested = true;
    let (plan, log) = recover(&j, mk_cluster(vec![view]), world(&[&vm_of(1)]), t0() + secs(120));
    assert_eq!(
        plan,
        vec![
            // The withdrawal's transition carries the retry of the delete: nothing may rest
            // in Quarantined without one (a restart once planned it apart and never ran it).
            RecoveryAction::Step {
                attempt: key(1),
                event: Event::CancelRequested { at_start: Some(0) }
            },
        ]
    );
    assert_lines(
        &log,
        &[
            "#7 a1 Quarantined -> Quarantined (CancelRequested) cancel requested; outcome Interrupted already \
             recorded and kept; no retry",
            "retry deleting mb-ci-build-42-mac-build-a1 later",
            "tart stop+delete mb-ci-build-42-mac-build-a1",
            "#8 a1 Quarantined -> Retired (Resolved) clone directory gone (deleted on retry); slot released; \
             no retry: CancelRequested was recorded; a withdrawn build is never retried",
            "rm deadline file of mb-ci-build-42-mac-build-a1",
            "release slot 1",
            "deliver status",
            "remove finalizer",
        ],
    );
}

#[test]
fn owner_deleted_after_an_interruption_was_recorded_stops_the_retry() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running)
        .go(1, Event::AgentRestarted { killed: 0 }, t0() + secs(300));
    let mut view = mk_view(1, 5);
    view.owner_deleted = true;
    let (plan, log) = recover(&j, mk_cluster(vec![view]), world(&[&vm_of(1)]), t0() + secs(310));
    assert_eq!(
        plan,
        vec![RecoveryAction::Step {
            attempt: key(1),
            event: Event::OwnerDeleted { at_start: Some(0) }
        },]
    );
    assert_eq!(
        log[0],
        "#6 a1 Retiring -> Retiring (OwnerDeleted) owner deleted; outcome Interrupted already recorded and kept; no retry"
    );
    assert_eq!(
        log[2],
        "#7 a1 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start; \
         no retry: OwnerDeleted was recorded; a withdrawn build is never retried"
    );
    assert_eq!(log.last().unwrap(), "remove finalizer");
}

#[test]
fn retry_refused_with_less_than_120s_left() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    let now = deadline() - secs(95);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, 4)]), world(&[&vm_of(1)]), now);
    assert_eq!(
        plan,
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Running,
            vm: vm_of(1),
            then: Ending::AgentRestarted
        }]
    );
    assert_eq!(
        log[4],
        "#6 a1 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start; no retry: \
         95s left before the deadline 2026-10-05T02:56:06.653639Z, a retry needs 120s"
    );
    assert_eq!(log.last().unwrap(), "remove finalizer");
    assert!(!log.iter().any(|l| l.contains("a2")));
}

#[test]
fn retry_refused_at_max_attempts() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running)
        .go(1, Event::AgentRestarted { killed: 0 }, t0() + secs(60));
    j.go(
        1,
        Event::VmDeleted {
            how: Deleted::AtAgentStart,
        },
        t0() + secs(61),
    );
    j.run_to(2, S::Running);
    let now = t0() + secs(600);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(2, 10)]), world(&[&vm_of(2)]), now);
    assert_eq!(
        plan.len(),
        1,
        "a1 is retired and current; only a2 needs recovery: {plan:?}"
    );
    assert_eq!(
        log[4],
        "#12 a2 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start; \
         no retry: attempt 2 of 2 used (maxAttempts 2)"
    );
    assert!(!log.iter().any(|l| l.contains("a3")));
    // maxAttempts 3 would have allowed a third.
    let mut view = mk_view(2, 10);
    view.max_attempts = Some(3);
    let (_, log) = recover(&j, mk_cluster(vec![view]), world(&[&vm_of(2)]), now);
    assert!(
        log.iter()
            .any(|l| l.starts_with("#14 a3 Requested -> Admitted (SlotFree)")),
        "{log:?}"
    );
}

#[test]
fn watchdog_removed_vm_fails_with_watchdog_deadline_without_touching_it() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    // The agent was frozen; the watchdog deleted the VM 63.75 s after the deadline.
    let now = deadline() + SignedDuration::from_millis(100_190);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, 4)]), world(&[]), now);
    assert_eq!(
        plan,
        vec![RecoveryAction::Step {
            attempt: key(1),
            event: Event::WatchdogRemovedVm
        }]
    );
    assert_lines(
        &log,
        &[
            "#5 a1 Running -> Retiring (WatchdogDeadline) mb-ci-build-42-mac-build-a1 gone after the deadline \
             2026-10-05T02:56:06.653639Z: deleted by the watchdog outcome=Failed",
            "deliver status",
            "confirm mb-ci-build-42-mac-build-a1 gone",
            "#6 a1 Retiring -> Retired (VMDeleted) already deleted by the watchdog",
            "rm deadline file of mb-ci-build-42-mac-build-a1",
            "release slot 1",
            "deliver status",
            "remove finalizer",
        ],
    );
    // Restarted again mid-way: still only a confirmation, never a delete.
    let mut j2 = Journal::new(5);
    j2.recs = j.recs.clone();
    j2.views = j.views.clone();
    j2.go(1, Event::WatchdogRemovedVm, now);
    let p = plan_for(&j2.recs, &[], &mk_cluster(vec![mk_view(1, 5)]), now);
    assert_eq!(
        p,
        vec![RecoveryAction::ConfirmVmGone {
            attempt: key(1),
            vm: vm_of(1)
        }]
    );
}

#[test]
fn overdue_vm_still_present_fails_with_deadline_passed() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    // nohup case without the watchdog: the guest processes survived the agent.
    let mut w = world(&[&vm_of(1)]);
    w.procs.insert(vm_of(1), 2);
    let now = deadline() + SignedDuration::from_millis(100_190);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, 4)]), w, now);
    assert_eq!(
        plan,
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Running,
            vm: vm_of(1),
            then: Ending::DeadlinePassed
        }]
    );
    assert_eq!(
        log[1],
        "#5 a1 Running -> Retiring (DeadlinePassed) host execution deadline 2026-10-05T02:56:06.653639Z passed; \
         found Running at agent start; killed 2 tart process(es) outcome=Failed"
    );
    assert_eq!(log.last().unwrap(), "remove finalizer");
}

/// The executor's rule (a cancel seen only after the deadline ends the attempt on the deadline)
/// holds for an agent that was down rather than paused: both are seen at start, its time was up
/// first, and the watchdog may have deleted the VM since. Before the fix recovery recorded
/// `CancelRequested` (Cancelled) here, and "deleted (or already absent) at agent start" for a VM
/// the watchdog had deleted: what a paused agent with the same facts no longer tells the pipeline.
#[test]
fn a_cancel_found_at_start_after_the_deadline_ends_the_attempt_on_the_deadline() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    let now = deadline() + SignedDuration::from_millis(100_190);
    // A cancel, or a deletion of the MacBuild alone (its owner kept).
    for (cancel, deleted) in [(true, false), (false, true)] {
        let mut view = mk_view(1, 4);
        view.cancel_requested = cancel;
        view.deletion_requested = deleted;
        let c = mk_cluster(vec![view]);
        // The watchdog took the VM: only confirmed gone, reported as the watchdog's deadline.
        assert_eq!(
            plan_for(&j.recs, &[], &c, now),
            vec![RecoveryAction::Step {
                attempt: key(1),
                event: Event::WatchdogRemovedVm
            }],
            "cancel {cancel}, deleted {deleted}"
        );
        // The VM is still there: killed and deleted, Failed on the deadline.
        let present = observed(&world(&[&vm_of(1)]));
        assert_eq!(
            plan_for(&j.recs, &present, &c, now),
            vec![RecoveryAction::KillVmProcesses {
                attempt: key(1),
                found: S::Running,
                vm: vm_of(1),
                then: Ending::DeadlinePassed
            }],
            "cancel {cancel}, deleted {deleted}"
        );
        // Before the deadline the withdrawal is the reason, as before.
        let p = plan_for(&j.recs, &present, &c, deadline() - secs(600));
        assert!(
            matches!(
                p[..],
                [RecoveryAction::KillVmProcesses {
                    then: Ending::CancelRequested,
                    ..
                }]
            ),
            "{p:?}"
        );
    }
    // An owner deleted while the agent was down is recorded Cancelled, past the deadline too.
    let mut view = mk_view(1, 4);
    view.owner_deleted = true;
    view.deletion_requested = true;
    let p = plan_for(&j.recs, &[], &mk_cluster(vec![view]), now);
    assert!(
        matches!(
            p[..],
            [RecoveryAction::KillVmProcesses {
                then: Ending::OwnerDeleted,
                ..
            }]
        ),
        "{p:?}"
    );
}

#[test]
fn vm_gone_before_the_watchdog_grace_is_an_ordinary_restart() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    let c = mk_cluster(vec![mk_view(1, 4)]);
    let within_grace = deadline() + secs(30);
    let p = plan_for(&j.recs, &[], &c, within_grace);
    assert!(
        matches!(
            p[..],
            [RecoveryAction::KillVmProcesses {
                then: Ending::DeadlinePassed,
                ..
            }]
        ),
        "{p:?}"
    );
    let before = deadline() - secs(600);
    let p = plan_for(&j.recs, &[], &c, before);
    assert!(
        matches!(
            p[..],
            [RecoveryAction::KillVmProcesses {
                then: Ending::AgentRestarted,
                ..
            }]
        ),
        "{p:?}"
    );
}

#[test]
fn non_prefixed_vms_are_ignored() {
    let vms = [
        mk_vm("macos-sequoia-base", true),
        mk_vm("ubuntu", false),
        mk_vm("MB-upper", false),
    ];
    assert_eq!(plan_for(&[], &vms, &ClusterView::default(), t0()), vec![]);
}

#[test]
fn gone_macbuild_is_cleaned_up_without_delivery() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    let (plan, log) = recover(&j, ClusterView::default(), world(&[&vm_of(1)]), t0() + secs(300));
    assert_eq!(
        plan,
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Running,
            vm: vm_of(1),
            then: Ending::CancelRequested
        }]
    );
    assert_lines(
        &log,
        &[
            "kill tart processes of mb-ci-build-42-mac-build-a1: 0",
            "#5 a1 Running -> Retiring (CancelRequested) MacBuild deleted; found Running at agent start; \
             killed 0 tart process(es) outcome=Cancelled",
            "tart stop+delete mb-ci-build-42-mac-build-a1",
            "#6 a1 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start",
            "rm deadline file of mb-ci-build-42-mac-build-a1",
            "release slot 1",
        ],
    );
    // A recreated MacBuild of the same name is another build.
    let recreated = BuildView {
        uid: "u-43".into(),
        ..mk_view(1, 4)
    };
    let p = plan_for(
        &j.recs,
        &[mk_vm(&vm_of(1), false)],
        &mk_cluster(vec![recreated]),
        t0() + secs(300),
    );
    assert!(
        matches!(
            p[..],
            [RecoveryAction::KillVmProcesses {
                then: Ending::CancelRequested,
                ..
            }]
        ),
        "{p:?}"
    );
}

#[test]
fn requested_attempt_resumes_its_claim_or_records_claim_lost() {
    let mut j = Journal::new(1);
    j.request(1, None, t0());
    let now = t0() + secs(5);
    let p = plan_for(&j.recs, &[], &mk_cluster(vec![mk_view(1, 0)]), now);
    assert_eq!(
        p,
        vec![RecoveryAction::ResumeAdmission {
            attempt: key(1),
            timeout: secs(1800)
        }]
    );
    let mut other = mk_view(1, 0);
    other.claim = Some(ClaimView {
        holder: "mac-mini-08".into(),
        attempt: 1,
    });
    let (p, log) = recover(&j, mk_cluster(vec![other]), world(&[]), now);
    assert_eq!(
        p,
        vec![RecoveryAction::Step {
            attempt: key(1),
            event: Event::ClaimLost {
                holder: "mac-mini-08 (a1)".into()
            }
        }]
    );
    // The loser clones nothing and writes nothing.
    assert_lines(
        &log,
        &["#2 a1 Requested -> Retired (ClaimLost) claim lost to mac-mini-08 (a1); nothing cloned"],
    );
    let mut cancelled = mk_view(1, 0);
    cancelled.cancel_requested = true;
    let (_, log) = recover(&j, mk_cluster(vec![cancelled]), world(&[]), now);
    assert_lines(
        &log,
        &[
            "#2 a1 Requested -> Retired (CancelRequested) cancel requested before admission; nothing cloned \
             outcome=Cancelled",
            "deliver status",
            "remove finalizer",
        ],
    );
}

/// Found by the crash-point sweep (journal.append.after, claim.status.before): the agent died
/// between journaling `Requested` and its claim write. Nobody holds the build, so the claim never
/// happened: it is made now, not recorded as lost (a lost a1 could never be claimed again by this
/// agent, whose journal already has it, and the build waited for ever).
#[test]
fn a_first_attempt_whose_claim_never_reached_the_cluster_claims_it_now() {
    let mut j = Journal::new(1);
    j.request(1, None, t0());
    let mut unclaimed = mk_view(1, 0);
    unclaimed.claim = None;
    let p = plan_for(&j.recs, &[], &mk_cluster(vec![unclaimed.clone()]), t0() + secs(5));
    assert_eq!(
        p,
        vec![RecoveryAction::ResumeAdmission {
            attempt: key(1),
            timeout: secs(1800)
        }]
    );
    // A retry always finds the claim naming its previous attempt; without one it is not ours.
    let mut retry = Journal::new(1);
    retry.request(2, Some(deadline()), t0());
    let p = plan_for(&retry.recs, &[], &mk_cluster(vec![unclaimed]), t0() + secs(5));
    assert!(
        matches!(
            &p[..],
            [RecoveryAction::Step {
                event: Event::ClaimLost { .. },
                ..
            }]
        ),
        "{p:?}"
    );
}

#[test]
fn retry_owed_by_the_last_record_is_requested_after_a_crash() {
    // Died right after #122, before journaling a2.
    let mut j = Journal::new(117);
    j.run_to(1, S::Running)
        .go(1, Event::AgentRestarted { killed: 0 }, ts("2026-10-05T02:41:58.5Z"))
        .go(
            1,
            Event::VmDeleted {
                how: Deleted::AtAgentStart,
            },
            ts("2026-10-05T02:41:58.6Z"),
        );
    let next = NextAttempt {
        build: mk_build(),
        attempt: 2,
        deadline: deadline(),
    };
    let now = ts("2026-10-05T02:43:00Z");
    let (p, log) = recover(&j, mk_cluster(vec![mk_view(1, 122)]), world(&[]), now);
    assert_eq!(
        p,
        vec![
            RecoveryAction::AdmitNextAttempt { next: next.clone() },
            RecoveryAction::ResumeAdmission {
                attempt: key(2),
                timeout: secs(1800)
            },
        ]
    );
    assert_eq!(
        log[2],
        "#124 a2 Requested -> Admitted (SlotFree) slot 1/1, deadline 2026-10-05T02:56:06.653639Z"
    );
    // Restarted too late for the retry: a2 is closed with DeadlinePassed, so the build ends.
    let late = deadline() - secs(60);
    let (p, log) = recover(&j, mk_cluster(vec![mk_view(1, 122)]), world(&[]), late);
    assert_eq!(
        p[1],
        RecoveryAction::Step {
            attempt: key(2),
            event: Event::DeadlinePassed { at_start: None }
        }
    );
    assert_eq!(
        log[2],
        "#124 a2 Requested -> Retired (DeadlinePassed) not admitted: 60s left before the deadline \
         2026-10-05T02:56:06.653639Z, a retry needs 120s outcome=Failed"
    );
    // Cancelled while down: a2 is closed as Cancelled.
    let mut view = mk_view(1, 122);
    view.cancel_requested = true;
    let (p, _) = recover(&j, mk_cluster(vec![view]), world(&[]), now);
    assert_eq!(
        p[1],
        RecoveryAction::Step {
            attempt: key(2),
            event: Event::CancelRequested { at_start: None }
        }
    );
    // A retry that is already requested (claim still names a1) is resumed, not re-requested.
    j.request(2, Some(deadline()), ts("2026-10-05T02:41:58.7Z"));
    let p = plan_for(&j.recs, &[], &mk_cluster(vec![mk_view(1, 122)]), now);
    assert_eq!(
        p,
        vec![RecoveryAction::ResumeAdmission {
            attempt: key(2),
            timeout: secs(1800)
        }]
    );
}

#[test]
fn recovery_action_log_lines_name_what_happens() {
    let next = NextAttempt {
        build: mk_build(),
        attempt: 2,
        deadline: deadline(),
    };
    assert_eq!(
        RecoveryAction::AdmitNextAttempt { next }.to_string(),
        "ci/build-42-mac-build a1 was interrupted; requesting a2 (deadline 2026-10-05T02:56:06.653639Z kept)"
    );
    let kill = RecoveryAction::KillVmProcesses {
        attempt: key(1),
        found: S::Running,
        vm: vm_of(1),
        then: Ending::AgentRestarted,
    };
    assert_eq!(
        kill.to_string(),
        "ci/build-42-mac-build a1 found Running at agent start; killing tart processes of \
         mb-ci-build-42-mac-build-a1 (AgentRestarted)"
    );
    assert_eq!(kill.record(1, t0()), None);
}

/// The cluster is unreachable at agent start: the host side (kill, retire, delete) is planned from
/// the journal alone, under the `maxAttempts` the journal recorded, and nothing that needs the
/// cluster (claims, redelivery, owed retries of retired attempts) is in it.
#[test]
fn host_side_recovery_needs_no_cluster_and_keeps_the_journals_max_attempts() {
    let mut j = Journal::new(117);
    j.run_to(1, S::Running);
    // A default that differs from the journaled 2: the journal's value must win.
    let cfg = Config {
        default_max_attempts: 1,
        ..Config::default()
    };
    let rp = replay(&j.recs, &cfg);
    assert_eq!(
        rp.attempts[0].max_attempts, 2,
        "maxAttempts comes from the Requested record"
    );
    assert_eq!(host_side(&rp), BTreeSet::from(["u-42".to_string()]));
    let assumed = ClusterView::as_journaled(&rp, &me());
    let (plan, log) = recover(&j, assumed, world(&[&vm_of(1)]), ts("2026-10-05T02:41:58.395Z"));
    assert_eq!(
        plan,
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Running,
            vm: vm_of(1),
            then: Ending::AgentRestarted
        }]
    );
    assert!(log.iter().any(|l| l == "admit a2 next"), "{log:?}");

    // Retired with a retry owed, or just requested: both wait for the cluster.
    let mut retired = Journal::new(1);
    retired
        .run_to(1, S::Running)
        .go(1, Event::AgentRestarted { killed: 0 }, t0() + secs(60))
        .go(
            1,
            Event::VmDeleted {
                how: Deleted::AtAgentStart,
            },
            t0() + secs(61),
        );
    assert!(host_side(&replay(&retired.recs, &cfg)).is_empty());
    let mut requested = Journal::new(1);
    requested.request(1, None, t0());
    assert!(host_side(&replay(&requested.recs, &cfg)).is_empty());
}

/// The watchdog took the VM (`Retiring (WatchdogDeadline)`), then a cancel was recorded while it
/// was being confirmed (`Retiring -> Retiring (CancelRequested)`, which owes the confirmation),
/// and the agent restarted. The deletion still owed is the watchdog's confirmation: recovery
/// must never stop and delete a VM the watchdog took. `continue_retirement` keys on the last
/// record's reason, which the withdrawal replaced, so recovery (and `after_fault`) plans a
/// `tart stop` + `tart delete` "at agent start" instead, and the status then says the agent
/// deleted it at its start instead of the watchdog.
#[test]
fn a_withdrawal_after_the_watchdog_took_the_vm_still_only_confirms_it_gone() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    let now = deadline() + SignedDuration::from_millis(100_190);
    j.go(1, Event::WatchdogRemovedVm, now);
    let withdrawal = step(
        &j.views[&1],
        Event::CancelRequested { at_start: None },
        now,
        &Config::default(),
    )
    .unwrap();
    assert_eq!(
        withdrawal.actions,
        vec![Action::ConfirmVmGone { vm: vm_of(1) }],
        "the live withdrawal owes the confirmation"
    );
    j.push(1, &withdrawal);
    let mut view = mk_view(1, 6);
    view.cancel_requested = true;
    let p = plan_for(&j.recs, &[], &mk_cluster(vec![view]), now + secs(5));
    assert_eq!(
        p,
        vec![RecoveryAction::ConfirmVmGone {
            attempt: key(1),
            vm: vm_of(1)
        }],
        "journal:\n{}",
        j.lines().join("\n")
    );
}

/// A world where the attempt's VM still runs (its `tart run` outlived the agent).
fn running_world(vm: &str, guest_answers: bool) -> World {
    let mut w = world(&[vm]);
    w.running.insert(vm.to_string());
    w.procs.insert(vm.to_string(), 1);
    w.guest_answers = guest_answers;
    w
}

#[test]
fn a_running_vm_whose_guest_answers_is_resumed_as_the_same_attempt() {
    for (found, follow) in [
        (S::Booting, "ProbeReady { vm: \"mb-ci-build-42-mac-build-a1\" }"),
        (
            S::Running,
            "RunStep { vm: \"mb-ci-build-42-mac-build-a1\", index: 0, since: 2026-10-05T02:26:21.653639Z }",
        ),
        (S::Collecting, "CollectResults { vm: \"mb-ci-build-42-mac-build-a1\" }"),
    ] {
        let mut j = Journal::new(1);
        j.run_to(1, found);
        let seq = j.seq - 1;
        let w = running_world(&vm_of(1), true);
        let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, seq)]), w, t0() + secs(700));
        assert_eq!(
            plan,
            vec![RecoveryAction::Resume {
                attempt: key(1),
                found,
                vm: vm_of(1),
                clone_again: false,
            }],
            "{found}"
        );
        assert_eq!(log[0], "guest of mb-ci-build-42-mac-build-a1 answers");
        assert!(
            log[1].starts_with(&format!("#{} a1 {found} -> {found} (Resumed) ", j.seq)),
            "{log:?}"
        );
        assert_eq!(log[2], follow, "{found}: {log:?}");
        // Nothing retired, nothing deleted, no attempt 2.
        assert!(
            !log.iter()
                .any(|l| l.contains("Retiring") || l.contains("stop+delete") || l.contains("a2")),
            "{log:?}"
        );
    }
}

#[test]
fn a_resumed_running_attempt_goes_on_with_the_step_the_journal_started() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    j.go(
        1,
        Event::StepStarting {
            index: 1,
            of: 3,
            name: "build".into(),
            previous: "_checkout".into(),
        },
        t0() + secs(100),
    );
    j.go(
        1,
        Event::StepStarting {
            index: 2,
            of: 3,
            name: "test".into(),
            previous: "build".into(),
        },
        t0() + secs(400),
    );
    assert_eq!(
        j.lines().last().unwrap(),
        "#6 a1 Running -> Running (StepStarted) step build exited 0; starting test (3/3)"
    );
    let w = running_world(&vm_of(1), true);
    let (_, log) = recover(&j, mk_cluster(vec![mk_view(1, 4)]), w, t0() + secs(500));
    assert_lines(
        &log,
        &[
            "guest of mb-ci-build-42-mac-build-a1 answers",
            "#7 a1 Running -> Running (Resumed) mb-ci-build-42-mac-build-a1 running and its guest answering 2.00s \
             after the agent started; following step 3 again",
            // The step's own start (its StepStarted record), not the resume: its timeout counts from it.
            "RunStep { vm: \"mb-ci-build-42-mac-build-a1\", index: 2, since: 2026-10-05T02:32:46.653639Z }",
        ],
    );
}

#[test]
fn a_booting_vm_is_resumed_without_asking_its_guest() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Booting);
    let w = running_world(&vm_of(1), false);
    let (_, log) = recover(&j, mk_cluster(vec![mk_view(1, 3)]), w, t0() + secs(100));
    assert_lines(
        &log,
        &[
            "guest of mb-ci-build-42-mac-build-a1 answers",
            "#4 a1 Booting -> Booting (Resumed) mb-ci-build-42-mac-build-a1 running 2.00s after the agent started; \
             following the boot again",
            "ProbeReady { vm: \"mb-ci-build-42-mac-build-a1\" }",
        ],
    );
}

#[test]
fn a_running_vm_whose_guest_is_silent_is_interrupted_as_before() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    let w = running_world(&vm_of(1), false);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, 4)]), w, t0() + secs(700));
    assert!(matches!(plan[..], [RecoveryAction::Resume { .. }]));
    assert_eq!(log[1], "kill tart processes of mb-ci-build-42-mac-build-a1: 1");
    assert_eq!(
        log[2],
        "#5 a1 Running -> Retiring (AgentRestarted) found Running at agent start; killed 1 tart process(es) \
         outcome=Interrupted"
    );
    assert!(log.iter().any(|l| l.contains("a2 [*] -> Requested")), "{log:?}");
}

/// What may not be resumed goes the old way even though the VM runs: each case with the Ending it gets.
#[test]
fn resume_needs_the_clusters_word_a_running_vm_time_left_and_the_resume_mode() {
    let run = |view: BuildView, cluster_assumed: bool, now: Timestamp, cfg: &Config| {
        let mut j = Journal::new(1);
        j.run_to(1, S::Running);
        let w = running_world(&vm_of(1), true);
        let cluster = ClusterView {
            builds: vec![view],
            assumed: cluster_assumed,
        };
        plan(&j.recs, &observed(&w), &cluster, &me(), now, cfg)
    };
    let kill = |then| {
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Running,
            vm: vm_of(1),
            then,
        }]
    };
    let now = t0() + secs(700);
    let cfg = Config::default();
    let cancelled = BuildView {
        cancel_requested: true,
        ..mk_view(1, 4)
    };
    assert_eq!(run(cancelled, false, now, &cfg), kill(Ending::CancelRequested));
    let deleting = BuildView {
        deletion_requested: true,
        ..mk_view(1, 4)
    };
    assert_eq!(run(deleting, false, now, &cfg), kill(Ending::CancelRequested));
    let other = BuildView {
        claim: Some(ClaimView {
            holder: "mac-mini-09".into(),
            attempt: 2,
        }),
        ..mk_view(1, 4)
    };
    assert_eq!(run(other, false, now, &cfg), kill(Ending::AgentRestarted));
    assert_eq!(
        run(mk_view(1, 4), false, deadline(), &cfg),
        kill(Ending::DeadlinePassed)
    );
    // The cluster could not be read: never resumed on the journal's assumption.
    assert_eq!(run(mk_view(1, 4), true, now, &cfg), kill(Ending::AgentRestarted));
    let restart = Config {
        resume_after_restart: false,
        ..Config::default()
    };
    assert_eq!(run(mk_view(1, 4), false, now, &restart), kill(Ending::AgentRestarted));
    // The MacBuild is gone: cancelled, as before.
    let gone = {
        let mut j = Journal::new(1);
        j.run_to(1, S::Running);
        let w = running_world(&vm_of(1), true);
        plan(&j.recs, &observed(&w), &mk_cluster(vec![]), &me(), now, &cfg)
    };
    assert_eq!(gone, kill(Ending::CancelRequested));
}

/// The plan is exactly "kill the survivors, then `AgentRestarted`" (the attempt is interrupted).
fn assert_interrupted(p: &[RecoveryAction]) {
    assert!(
        matches!(
            p[..],
            [RecoveryAction::KillVmProcesses {
                then: Ending::AgentRestarted,
                ..
            }]
        ),
        "{p:?}"
    );
}

/// Nothing is resumed on a VM that is not ours to continue: an Admitted attempt whose VM already
/// exists (it never cloned it; an Admitted attempt with no VM is resumed by booting, see
/// `Resume { clone_again }`), or a Running attempt whose VM is stopped.
#[test]
fn an_admitted_attempt_with_a_vm_already_there_or_a_stopped_vm_is_never_resumed() {
    let now = t0() + secs(700);
    let mut j = Journal::new(1);
    j.run_to(1, S::Admitted);
    let w = running_world(&vm_of(1), true);
    assert_interrupted(&plan(
        &j.recs,
        &observed(&w),
        &mk_cluster(vec![mk_view(1, 2)]),
        &me(),
        now,
        &Config::default(),
    ));
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    assert_interrupted(&plan(
        &j.recs,
        &observed(&world(&[&vm_of(1)])),
        &mk_cluster(vec![mk_view(1, 4)]),
        &me(),
        now,
        &Config::default(),
    ));
}

#[test]
fn a_detached_attempt_is_resumed_like_a_running_one() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    j.go(1, Event::Detach, t0() + secs(300));
    assert_eq!(
        j.lines().last().unwrap(),
        "#5 a1 Running -> Running (Detached) agent stopping; step 1 runs on in mb-ci-build-42-mac-build-a1 and is \
         resumed at the next start"
    );
    let w = running_world(&vm_of(1), true);
    let (plan, log) = recover(&j, mk_cluster(vec![mk_view(1, 4)]), w, t0() + secs(310));
    assert!(matches!(plan[..], [RecoveryAction::Resume { .. }]));
    assert_eq!(
        log[2],
        "RunStep { vm: \"mb-ci-build-42-mac-build-a1\", index: 0, since: 2026-10-05T02:26:21.653639Z }"
    );
}

#[test]
fn a_boot_stopped_before_its_clone_finished_is_resumed_with_the_clone() {
    let now = t0() + secs(700);
    let mut j = Journal::new(1);
    j.run_to(1, S::Booting);
    j.go(1, Event::Detach, t0() + secs(60));
    let (p, log) = recover(&j, mk_cluster(vec![mk_view(1, 3)]), world(&[]), now);
    assert_eq!(
        p,
        vec![RecoveryAction::Resume {
            attempt: key(1),
            found: S::Booting,
            vm: vm_of(1),
            clone_again: true,
        }]
    );
    assert_eq!(
        p[0].to_string(),
        "ci/build-42-mac-build a1 found Booting at agent start before mb-ci-build-42-mac-build-a1 was cloned; \
         cloning it once the Lease is live"
    );
    assert!(log[1].contains("a1 Booting -> Booting (Resumed)"), "{log:?}");
    assert_eq!(log[2], "CloneVm { vm: \"mb-ci-build-42-mac-build-a1\" }");
    assert!(
        !log.iter().any(|l| l.contains("Retiring") || l.contains("a2")),
        "{log:?}"
    );
    // Not without the cluster's word, not in restart mode, not past the deadline, and not with
    // a VM that exists but is stopped (it may be half set up): interrupted as before.
    let kill = |p: Vec<RecoveryAction>| matches!(p[..], [RecoveryAction::KillVmProcesses { .. }]);
    let assumed = ClusterView {
        assumed: true,
        ..mk_cluster(vec![mk_view(1, 3)])
    };
    let cfg = Config::default();
    let restart = Config {
        resume_after_restart: false,
        ..Config::default()
    };
    assert!(kill(plan(&j.recs, &[], &assumed, &me(), now, &cfg)));
    assert!(kill(plan(
        &j.recs,
        &[],
        &mk_cluster(vec![mk_view(1, 3)]),
        &me(),
        now,
        &restart
    )));
    assert!(kill(plan(
        &j.recs,
        &[],
        &mk_cluster(vec![mk_view(1, 3)]),
        &me(),
        deadline(),
        &cfg
    )));
    let stopped = observed(&world(&[&vm_of(1)]));
    assert!(kill(plan(
        &j.recs,
        &stopped,
        &mk_cluster(vec![mk_view(1, 3)]),
        &me(),
        now,
        &cfg
    )));
}

/// Adversarial: the MacBuild's status (written by a stale writer, or anyone with status access)
/// names this agent as holder of attempt 4294967295 while the journal holds a requested a1.
/// The claim names neither a1 nor its predecessor, so a1's claim is lost; recovery must say so,
/// not overflow (`overflow-checks` are on in release too: a panic here fails every restart).
#[test]
fn a_claim_naming_attempt_u32_max_does_not_overflow_recovery() {
    let mut j = Journal::new(1);
    j.request(1, None, t0());
    let mut huge = mk_view(1, 0);
    huge.claim = Some(ClaimView {
        holder: ME.into(),
        attempt: u32::MAX,
    });
    let p = plan_for(&j.recs, &[], &mk_cluster(vec![huge]), t0() + secs(5));
    assert!(
        matches!(
            &p[..],
            [RecoveryAction::Step {
                event: Event::ClaimLost { .. },
                ..
            }]
        ),
        "{p:?}"
    );
}

/// An admin patch changed the MacBuild's spec (removed the running step) while the agent was
/// stopped: the attempt is not followed on the new spec from the old step's index; it is
/// interrupted, saying why, and its VM deleted. The same generation resumes; a journal from
/// before generations were recorded resumes as before (the executor guards the step index).
#[test]
fn an_attempt_whose_macbuild_spec_changed_meanwhile_is_interrupted_not_resumed() {
    let mut j = Journal::new(1);
    j.run_to(1, S::Running);
    let old_journal = j.recs.clone();
    for r in &mut j.recs {
        r.generation = Some(1);
    }
    let seq = j.seq - 1;
    let now = t0() + secs(700);
    let at = |generation| BuildView {
        generation: Some(generation),
        ..mk_view(1, seq)
    };
    let w = running_world(&vm_of(1), true);
    let (plan, log) = recover(&j, mk_cluster(vec![at(2)]), w, now);
    assert_eq!(
        plan,
        vec![RecoveryAction::KillVmProcesses {
            attempt: key(1),
            found: S::Running,
            vm: vm_of(1),
            then: Ending::SpecChanged { then: 1, now: 2 },
        }]
    );
    let retired = log
        .iter()
        .find(|l| l.contains("Running -> Retiring"))
        .unwrap_or_else(|| panic!("{log:?}"));
    assert!(
        retired.contains(
            "(AgentRestarted) the MacBuild's spec changed while the agent was stopped (generation 1 when the attempt \
             started, 2 now); the attempt is not resumed; found Running at agent start; killed 1 tart process(es)"
        ) && retired.ends_with("outcome=Interrupted"),
        "{retired}"
    );
    assert!(!log.iter().any(|l| l.contains("Resumed")), "{log:?}");
    // The same generation is resumed.
    let resumed = plan_for(
        &j.recs,
        &observed(&running_world(&vm_of(1), true)),
        &mk_cluster(vec![at(1)]),
        now,
    );
    assert!(matches!(resumed[..], [RecoveryAction::Resume { .. }]), "{resumed:?}");
    // A journal without generations cannot tell: resumed as before.
    let old = plan_for(
        &old_journal,
        &observed(&running_world(&vm_of(1), true)),
        &mk_cluster(vec![at(2)]),
        now,
    );
    assert!(matches!(old[..], [RecoveryAction::Resume { .. }]), "{old:?}");
    // A withdrawal or the deadline still names the ending first.
    let cancelled = BuildView {
        cancel_requested: true,
        ..at(2)
    };
    let p = plan_for(
        &j.recs,
        &observed(&running_world(&vm_of(1), true)),
        &mk_cluster(vec![cancelled]),
        now,
    );
    assert!(
        matches!(
            p[..],
            [RecoveryAction::KillVmProcesses {
                then: Ending::CancelRequested,
                ..
            }]
        ),
        "{p:?}"
    );
}
