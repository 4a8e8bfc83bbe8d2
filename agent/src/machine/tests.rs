//! Tests of the attempt machine: the state x event table, each rule, and the source's journal lines.

use super::*;
use AttemptState as S;

const DEADLINE: &str = "2026-10-05T02:56:06.653639Z";

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn secs(n: i64) -> SignedDuration {
    SignedDuration::from_secs(n)
}

fn mk_build() -> BuildRef {
    BuildRef {
        namespace: "ci".into(),
        name: "build-42-mac-build".into(),
        uid: "u-42".into(),
    }
}

/// An attempt of `mk_build` already in `state`, as replay would rebuild it.
fn mk_attempt(number: u32, state: AttemptState) -> Attempt {
    let mut a = Attempt::new(mk_build(), number, "mb-ci-build-42-mac-build-c49f62f4", 2);
    a.state = state;
    if state.holds_slot() || state == S::Retired {
        a.slot = Some(0);
    }
    // Admitted attempts have a deadline; so does a retry still in Requested (inherited).
    if state != S::Requested || number > 1 {
        a.deadline = Some(ts(DEADLINE));
    }
    // Past admission, as if it had booted (a refusal before the boot is tested on its own).
    a.boot_started = !matches!(state, S::Requested | S::Admitted);
    if matches!(state, S::Retiring | S::Quarantined | S::Retired) {
        a.outcome = Some(Outcome::Interrupted);
    }
    a
}

/// Drives one attempt like the runtime: step, journal (render the record), fold it back.
struct Driver {
    a: Attempt,
    seq: u64,
    lines: Vec<String>,
}

impl Driver {
    fn new(a: Attempt, seq: u64) -> Driver {
        Driver { a, seq, lines: vec![] }
    }
    fn journal(&mut self, t: &Transition) {
        let r = self.a.record(t, self.seq);
        self.seq += 1;
        self.lines.push(r.to_string());
        self.a.observe(&r);
    }
    fn go(&mut self, ev: Event, now: Timestamp) -> Vec<Action> {
        let t = step(&self.a, ev, now, &Config::default()).unwrap();
        self.journal(&t);
        t.actions
    }
}

fn vm() -> String {
    "mb-ci-build-42-mac-build-c49f62f4".to_string()
}

fn warm_vm() -> String {
    format!("{}17-0badcafe", tartan_api::WARM_VM_PREFIX)
}

fn warm_adoption() -> Adoption {
    Adoption {
        vm: warm_vm(),
        profile: crate::pool::WarmProfile::new("ghcr.io/cirruslabs/macos-sequoia-xcode:16", Some(4), None),
    }
}

/// A build admitted into a warm VM: its `Admitted` record names the warm VM and its profile, the
/// VM is the attempt's from then on, it is never cloned or booted, and the steps start once the
/// guest answers; interrupted there, the warm VM is deleted like any booted one.
#[test]
fn an_adopted_attempt_takes_the_warm_vm_and_never_boots() {
    let t0 = ts("2026-10-05T02:26:06.653639Z");
    let a = Attempt::new(mk_build(), 1, vm(), 2);
    let mut d = Driver::new(a.clone(), 40);
    d.journal(&request(&a, None, t0));
    let t = step(
        &d.a,
        Event::Adopt {
            slot: 1,
            slots: 2,
            timeout: secs(1800),
            adoption: warm_adoption(),
        },
        t0,
        &Config::default(),
    )
    .unwrap();
    let record = d.a.record(&t, 41);
    assert_eq!(record.vm.as_deref(), Some(warm_vm().as_str()));
    assert_eq!(record.warm, Some(warm_adoption().profile));
    assert_eq!(record.layout_version(), 2, "a record with `warm` is of layout 2");
    assert_eq!(
        t.actions,
        vec![
            Action::WriteDeadlineFile {
                vm: warm_vm(),
                deadline: ts(DEADLINE)
            },
            Action::DeliverStatus,
            Action::ProbeAdopted { vm: warm_vm() },
        ]
    );
    d.journal(&t);
    assert!(d.a.adopted && d.a.boot_started);
    assert_eq!(d.a.vm, warm_vm());
    assert_eq!(d.a.slot, Some(1));
    let refused = step(&d.a, Event::Boot, t0, &Config::default()).unwrap_err();
    assert_eq!(
        refused.to_string(),
        "Boot is not a transition of an attempt in state Admitted"
    );

    // Replayed from its records, the attempt is the same.
    let mut again = Attempt::new(mk_build(), 1, vm(), 2);
    again.observe(&a.record(&request(&a, None, t0), 40));
    again.observe(&record);
    assert!(again.adopted && again.vm == warm_vm());

    // Interrupted before the guest answered: the warm VM is deleted.
    let fault = step(&d.a, Event::AgentRestarted { killed: 0 }, t0, &Config::default()).unwrap();
    assert!(
        fault
            .actions
            .iter()
            .any(|x| matches!(x, Action::StopAndDeleteVm { vm, .. } if *vm == warm_vm())),
        "{:?}",
        fault.actions
    );

    let running = d.go(
        Event::Adopted {
            after: SignedDuration::from_millis(40),
        },
        t0 + secs(1),
    );
    assert_eq!(
        running,
        vec![
            Action::DeliverStatus,
            Action::RunStep {
                vm: warm_vm(),
                index: 0,
                since: t0 + secs(1)
            }
        ]
    );
    assert_eq!(d.a.step_since, Some(t0 + secs(1)), "step 0 counts from the adoption");
    assert!(
        d.lines[2].ends_with(&format!(
            "Admitted -> Running (Adopted) started from warm VM {}; tart exec answered after 0.04s",
            warm_vm()
        )),
        "{}",
        d.lines[2]
    );
    assert!(d.lines[1].contains(&format!(
        "slot 2/2, deadline {DEADLINE}, adopting warm VM {}",
        warm_vm()
    )));
}

/// A sample of each event kind, with the `now` at which it is sent.
fn sample(kind: EventKind) -> (Event, Timestamp) {
    let before = ts(DEADLINE) - secs(600);
    let after = ts(DEADLINE) + secs(120);
    let ev = match kind {
        EventKind::Admit => Event::Admit {
            slot: 0,
            slots: 1,
            timeout: secs(1800),
        },
        EventKind::Adopt => Event::Adopt {
            slot: 0,
            slots: 1,
            timeout: secs(1800),
            adoption: warm_adoption(),
        },
        EventKind::ClaimLost => Event::ClaimLost {
            holder: "mac-mini-08".into(),
        },
        EventKind::ClaimUnconfirmed => Event::ClaimUnconfirmed {
            error: "claiming MacBuild ci/build-42 failed: no answer within 4s".into(),
        },
        EventKind::Boot => Event::Boot,
        EventKind::Adopted => Event::Adopted {
            after: SignedDuration::from_millis(40),
        },
        EventKind::GuestReady => Event::GuestReady {
            after: SignedDuration::from_millis(13_910),
        },
        EventKind::StepStarting => Event::StepStarting {
            index: 1,
            of: 3,
            name: "build".into(),
            previous: "_checkout".into(),
        },
        EventKind::Detach => Event::Detach,
        EventKind::Resume => Event::Resume {
            after: secs(3),
            clone_again: false,
        },
        EventKind::StepsSucceeded => Event::StepsSucceeded { steps: 2 },
        EventKind::StepFailed => Event::StepFailed {
            step: "build".into(),
            exit_code: 65,
            output: "** BUILD FAILED **".into(),
        },
        EventKind::VmStartFailed => Event::VmStartFailed {
            error: "tart clone exited 2".into(),
        },
        EventKind::TestsPassed => Event::TestsPassed { passed: 2, total: 2 },
        EventKind::TestsFailed => Event::TestsFailed { failed: 1, total: 2 },
        EventKind::TestReportUnusable => Event::TestReportUnusable {
            error: "test report out/junit.xml is not well-formed XML".into(),
        },
        EventKind::ArtifactUploadFailed => Event::ArtifactUploadFailed { error: "s3 503".into() },
        EventKind::CancelRequested => Event::CancelRequested { at_start: None },
        EventKind::OwnerDeleted => Event::OwnerDeleted { at_start: None },
        EventKind::DeadlinePassed => return (Event::DeadlinePassed { at_start: None }, after),
        EventKind::WatchdogRemovedVm => return (Event::WatchdogRemovedVm, after),
        EventKind::AgentRestarted => Event::AgentRestarted { killed: 0 },
        EventKind::SpecChanged => Event::SpecChanged {
            change: "generation 1 at the attempt's start, 2 now".into(),
            at_start: Some(1),
        },
        EventKind::AgentFault => Event::AgentFault {
            message: "attempt to add with overflow".into(),
        },
        EventKind::VmDeleted => Event::VmDeleted {
            how: Deleted::Stopped { took: secs(6) },
        },
        EventKind::DeleteFailed => Event::DeleteFailed {
            context: DeleteContext::Normal,
            error: "tart delete exited 1".into(),
        },
        EventKind::MountRefused => Event::MountRefused {
            error: "mount \"pods\" is not declared by this agent's config ([[mounts]]: it declares spm); nothing was cloned"
                .into(),
        },
        EventKind::StepTimedOut => Event::StepTimedOut {
            step: "build".into(),
            timeout_seconds: 600,
            killed: "it was killed in the guest (2 process(es))".into(),
            output: "Compiling App.swift".into(),
        },
        EventKind::EnvRefused => Event::EnvRefused {
            reason: Reason::SecretMissing,
            error: "env T: Secret ci/gone does not exist; nothing was cloned".into(),
        },
    };
    (ev, before)
}

/// The allowed (state, event) pairs and where each leads; every other pair is refused.
fn expected(state: AttemptState, kind: EventKind) -> Option<AttemptState> {
    use EventKind as E;
    let open = matches!(state, S::Admitted | S::Booting | S::Running | S::Collecting);
    match (state, kind) {
        (S::Requested, E::Admit | E::Adopt) => Some(S::Admitted),
        (
            S::Requested,
            E::ClaimLost | E::ClaimUnconfirmed | E::CancelRequested | E::OwnerDeleted | E::DeadlinePassed,
        ) => Some(S::Retired),
        (_, E::ClaimLost) if open => Some(S::Retiring),
        (S::Admitted, E::Boot) => Some(S::Booting),
        (S::Admitted | S::Booting, E::VmStartFailed | E::MountRefused) => Some(S::Retiring),
        (S::Admitted | S::Booting | S::Running, E::EnvRefused) => Some(S::Retiring),
        (S::Booting, E::GuestReady) => Some(S::Running),
        (S::Running, E::StepsSucceeded) => Some(S::Collecting),
        (S::Running, E::StepStarting) => Some(S::Running),
        (S::Booting | S::Running | S::Collecting, E::Detach | E::Resume) => Some(state),
        (S::Running, E::StepFailed | E::StepTimedOut) => Some(S::Retiring),
        (S::Collecting, E::TestsPassed | E::TestsFailed | E::TestReportUnusable | E::ArtifactUploadFailed) => {
            Some(S::Retiring)
        }
        (
            _,
            E::CancelRequested
            | E::OwnerDeleted
            | E::DeadlinePassed
            | E::AgentRestarted
            | E::SpecChanged
            | E::AgentFault,
        ) if open => Some(S::Retiring),
        (S::Booting | S::Running | S::Collecting, E::WatchdogRemovedVm) => Some(S::Retiring),
        (S::Retiring | S::Quarantined, E::CancelRequested | E::OwnerDeleted) => Some(state),
        (S::Retiring, E::VmDeleted) => Some(S::Retired),
        (S::Retiring, E::DeleteFailed) => Some(S::Quarantined),
        (S::Quarantined, E::VmDeleted) => Some(S::Retired),
        _ => None,
    }
}

#[test]
fn every_state_event_pair_is_allowed_or_refused_by_name() {
    let mut allowed = 0;
    for &state in AttemptState::ALL {
        for &kind in EventKind::ALL {
            let (ev, now) = sample(kind);
            assert_eq!(ev.kind(), kind);
            let a = mk_attempt(if state == S::Requested { 2 } else { 1 }, state);
            match (step(&a, ev, now, &Config::default()), expected(state, kind)) {
                (Ok(t), Some(to)) => {
                    allowed += 1;
                    assert_eq!((t.from, t.to), (Some(state), to), "{state} x {kind}");
                    assert_eq!(t.at, now);
                    // Nothing rests in Retiring/Quarantined without the deletion that leads on
                    // to Retired (a withdrawal once left a quarantined VM for ever).
                    if matches!(to, S::Retiring | S::Quarantined) {
                        assert!(
                            t.actions.iter().any(|a| matches!(
                                a,
                                Action::StopAndDeleteVm { .. }
                                    | Action::RetryDeleteLater { .. }
                                    | Action::ConfirmVmGone { .. }
                            )),
                            "{state} x {kind} -> {to} owes no deletion: {:?}",
                            t.actions
                        );
                    }
                }
                (Err(r), None) => {
                    assert_eq!((r.state(), r.event()), (state, kind), "{r}");
                    let msg = r.to_string();
                    assert!(msg.contains(state.as_str()) && msg.contains(kind.as_str()), "{msg}");
                }
                (got, want) => panic!("{state} x {kind}: got {got:?}, want {want:?}"),
            }
        }
    }
    // (`Adopted` is allowed only to an attempt admitted into a warm VM: see the adoption test.)
    assert_eq!(allowed, 68, "the size of the allowed set");
}

#[test]
fn refusals_after_the_outcome_is_fixed_say_so() {
    for state in [S::Retiring, S::Quarantined] {
        for kind in [EventKind::DeadlinePassed, EventKind::WatchdogRemovedVm] {
            let (ev, now) = sample(kind);
            let r = step(&mk_attempt(1, state), ev, now, &Config::default()).unwrap_err();
            assert_eq!(
                r,
                Refusal::OutcomeFixed {
                    state,
                    event: kind,
                    outcome: Some(Outcome::Interrupted)
                }
            );
            assert_eq!(
                r.to_string(),
                format!("{kind} refused in state {state}: outcome Interrupted is already recorded and is kept")
            );
        }
    }
    let r = step(
        &mk_attempt(1, S::Retired),
        Event::Boot,
        ts(DEADLINE),
        &Config::default(),
    )
    .unwrap_err();
    assert_eq!(r.to_string(), "Boot is not a transition of an attempt in state Retired");
}

#[test]
fn a_build_runs_end_to_end_with_the_sources_journal_lines_and_actions() {
    let t0 = ts("2026-10-05T02:26:06.653639Z");
    let a = Attempt::new(mk_build(), 1, vm(), 2);
    let mut d = Driver::new(a.clone(), 117);
    let first = request(&a, None, t0);
    assert_eq!(first.actions, vec![Action::ClaimBuild { attempt: 1 }]);
    d.journal(&first);
    let admit = d.go(
        Event::Admit {
            slot: 0,
            slots: 1,
            timeout: secs(1800),
        },
        t0,
    );
    assert_eq!(
        admit,
        vec![
            Action::WriteDeadlineFile {
                vm: vm(),
                deadline: ts(DEADLINE)
            },
            Action::DeliverStatus
        ]
    );
    let boot = d.go(Event::Boot, t0 + secs(1));
    assert_eq!(
        boot,
        vec![
            Action::CloneVm { vm: vm() },
            Action::SetVm { vm: vm() },
            Action::StartVm { vm: vm() },
            Action::ProbeReady { vm: vm() }
        ]
    );
    let ready = d.go(
        Event::GuestReady {
            after: SignedDuration::from_millis(13_910),
        },
        t0 + secs(15),
    );
    assert_eq!(
        ready,
        vec![
            Action::DeliverStatus,
            Action::RunStep {
                vm: vm(),
                index: 0,
                since: t0 + secs(15)
            }
        ]
    );
    let collect = d.go(Event::StepsSucceeded { steps: 2 }, t0 + secs(300));
    assert_eq!(
        collect,
        vec![
            Action::DeliverStatus,
            Action::CollectResults { vm: vm() },
            Action::UploadArtifacts { vm: vm() }
        ]
    );
    let retire = d.go(Event::TestsPassed { passed: 2, total: 2 }, t0 + secs(320));
    assert_eq!(
        retire,
        vec![
            Action::DeliverStatus,
            Action::StopAndDeleteVm {
                vm: vm(),
                context: DeleteContext::Normal
            }
        ]
    );
    let took = DeleteContext::Normal.deleted(SignedDuration::from_millis(6_030));
    let done = d.go(Event::VmDeleted { how: took }, t0 + secs(327));
    assert_eq!(
        done,
        vec![
            Action::RemoveDeadlineFile { vm: vm() },
            Action::ReleaseSlot { slot: 0 },
            Action::DeliverStatus,
            Action::RemoveFinalizer
        ]
    );
    assert_eq!(
        d.lines,
        vec![
            "#117 a1 [*] -> Requested claiming",
            "#118 a1 Requested -> Admitted (SlotFree) slot 1/1, deadline 2026-10-05T02:56:06.653639Z",
            "#119 a1 Admitted -> Booting cloning and starting mb-ci-build-42-mac-build-c49f62f4",
            "#120 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s",
            "#121 a1 Running -> Collecting 2 step(s) succeeded",
            "#122 a1 Collecting -> Retiring (TestsPassed) 2/2 tests passed outcome=Succeeded",
            "#123 a1 Retiring -> Retired (VMDeleted) stopped and deleted in 6.03s",
        ]
    );
    assert_eq!(d.a.outcome, Some(Outcome::Succeeded));
    assert_eq!(d.a.slot, Some(0));
    assert_eq!(d.a.deadline, Some(ts(DEADLINE)));
}

#[test]
fn every_ending_maps_to_its_outcome() {
    let cases = [
        (
            S::Collecting,
            EventKind::TestsPassed,
            Reason::TestsPassed,
            Outcome::Succeeded,
        ),
        (
            S::Collecting,
            EventKind::TestsFailed,
            Reason::TestsFailed,
            Outcome::Failed,
        ),
        (S::Running, EventKind::StepFailed, Reason::StepFailed, Outcome::Failed),
        (
            S::Running,
            EventKind::StepTimedOut,
            Reason::StepTimedOut,
            Outcome::Failed,
        ),
        (
            S::Admitted,
            EventKind::MountRefused,
            Reason::MountNotDeclared,
            Outcome::Failed,
        ),
        (
            S::Collecting,
            EventKind::TestReportUnusable,
            Reason::TestsFailed,
            Outcome::Failed,
        ),
        (
            S::Booting,
            EventKind::VmStartFailed,
            Reason::VMStartFailed,
            Outcome::Failed,
        ),
        (
            S::Admitted,
            EventKind::VmStartFailed,
            Reason::VMStartFailed,
            Outcome::Failed,
        ),
        (
            S::Admitted,
            EventKind::EnvRefused,
            Reason::SecretMissing,
            Outcome::Failed,
        ),
        (
            S::Collecting,
            EventKind::ArtifactUploadFailed,
            Reason::ArtifactUploadFailed,
            Outcome::Failed,
        ),
        (
            S::Running,
            EventKind::DeadlinePassed,
            Reason::DeadlinePassed,
            Outcome::Failed,
        ),
        (
            S::Running,
            EventKind::WatchdogRemovedVm,
            Reason::WatchdogDeadline,
            Outcome::Failed,
        ),
        (
            S::Admitted,
            EventKind::CancelRequested,
            Reason::CancelRequested,
            Outcome::Cancelled,
        ),
        (
            S::Booting,
            EventKind::CancelRequested,
            Reason::CancelRequested,
            Outcome::Cancelled,
        ),
        (
            S::Booting,
            EventKind::OwnerDeleted,
            Reason::OwnerDeleted,
            Outcome::Cancelled,
        ),
        (
            S::Running,
            EventKind::AgentRestarted,
            Reason::AgentRestarted,
            Outcome::Interrupted,
        ),
        (
            S::Collecting,
            EventKind::AgentFault,
            Reason::AgentFault,
            Outcome::Interrupted,
        ),
        (
            S::Running,
            EventKind::SpecChanged,
            Reason::AgentRestarted,
            Outcome::Interrupted,
        ),
        (
            S::Requested,
            EventKind::CancelRequested,
            Reason::CancelRequested,
            Outcome::Cancelled,
        ),
        (
            S::Requested,
            EventKind::DeadlinePassed,
            Reason::DeadlinePassed,
            Outcome::Failed,
        ),
    ];
    for (state, kind, reason, outcome) in cases {
        let (ev, now) = sample(kind);
        let t = step(&mk_attempt(2, state), ev, now, &Config::default()).unwrap();
        assert_eq!((t.reason, t.outcome), (Some(reason), Some(outcome)), "{state} x {kind}");
    }
}

#[test]
fn cancel_during_boot_is_cancelled_deleted_and_never_retried() {
    let mut d = Driver::new(mk_attempt(1, S::Booting), 40);
    let now = ts(DEADLINE) - secs(1500);
    let acts = d.go(Event::CancelRequested { at_start: None }, now);
    assert_eq!(
        acts,
        vec![
            Action::DeliverStatus,
            Action::StopAndDeleteVm {
                vm: vm(),
                context: DeleteContext::Normal
            }
        ]
    );
    let acts = d.go(
        Event::VmDeleted {
            how: Deleted::Stopped {
                took: SignedDuration::from_millis(820),
            },
        },
        now,
    );
    assert!(!acts.iter().any(|a| matches!(a, Action::AdmitNextAttempt { .. })));
    assert_eq!(acts.last(), Some(&Action::RemoveFinalizer));
    assert_eq!(
        d.lines,
        vec![
            "#40 a1 Booting -> Retiring (CancelRequested) cancel requested outcome=Cancelled",
            "#41 a1 Retiring -> Retired (VMDeleted) stopped and deleted in 0.82s",
        ]
    );
}

#[test]
fn outcome_recorded_at_retiring_is_kept_through_later_events() {
    let mut a = mk_attempt(1, S::Retiring);
    a.outcome = Some(Outcome::Succeeded);
    let mut d = Driver::new(a, 300);
    let now = ts(DEADLINE) + secs(5);
    assert_eq!(
        d.go(Event::OwnerDeleted { at_start: None }, now),
        vec![Action::StopAndDeleteVm {
            vm: vm(),
            context: DeleteContext::Normal
        }]
    );
    assert_eq!(d.a.outcome, Some(Outcome::Succeeded));
    assert_eq!(d.a.withdrawn, Some(Reason::OwnerDeleted));
    // A second withdrawal and a late deadline are refused: nothing changes the outcome.
    for ev in [
        Event::CancelRequested { at_start: None },
        Event::DeadlinePassed { at_start: None },
    ] {
        let r = step(&d.a, ev, now, &Config::default()).unwrap_err();
        assert!(
            matches!(
                r,
                Refusal::OutcomeFixed {
                    outcome: Some(Outcome::Succeeded),
                    ..
                }
            ),
            "{r}"
        );
    }
    let acts = d.go(
        Event::VmDeleted {
            how: Deleted::AtAgentStart,
        },
        now,
    );
    assert_eq!(acts.last(), Some(&Action::RemoveFinalizer));
    assert_eq!(d.a.outcome, Some(Outcome::Succeeded));
    assert_eq!(
        d.lines,
        vec![
            "#300 a1 Retiring -> Retiring (OwnerDeleted) owner deleted; outcome Succeeded already recorded and kept; no retry",
            "#301 a1 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start",
        ]
    );
}

#[test]
fn cancel_after_an_interruption_stops_the_retry() {
    let mut d = Driver::new(mk_attempt(1, S::Retiring), 10);
    let now = ts(DEADLINE) - secs(900);
    d.go(Event::CancelRequested { at_start: None }, now);
    let acts = d.go(
        Event::VmDeleted {
            how: Deleted::AtAgentStart,
        },
        now,
    );
    assert_eq!(
        acts,
        vec![
            Action::RemoveDeadlineFile { vm: vm() },
            Action::ReleaseSlot { slot: 0 },
            Action::DeliverStatus,
            Action::RemoveFinalizer
        ]
    );
    assert_eq!(
        d.lines[1],
        "#11 a1 Retiring -> Retired (VMDeleted) deleted (or already absent) at agent start; \
         no retry: CancelRequested was recorded; a withdrawn build is never retried"
    );
}

#[test]
fn interrupted_attempt_with_time_left_admits_the_next_one_keeping_the_deadline() {
    let mut d = Driver::new(mk_attempt(1, S::Retiring), 122);
    let now = ts("2026-10-05T02:41:58.9Z");
    let acts = d.go(
        Event::VmDeleted {
            how: Deleted::AtAgentStart,
        },
        now,
    );
    assert_eq!(
        acts,
        vec![
            Action::RemoveDeadlineFile { vm: vm() },
            Action::ReleaseSlot { slot: 0 },
            Action::DeliverStatus,
            Action::AdmitNextAttempt {
                attempt: 2,
                deadline: ts(DEADLINE)
            }
        ]
    );
    // The retry is requested with the kept deadline and admitted without a new one.
    let next = decide_retry(&d.a, now, &Config::default()).unwrap();
    let a2 = Attempt::new(mk_build(), 2, "mb-ci-build-42-mac-build-5d0e11a2", 2);
    let mut d2 = Driver::new(a2.clone(), 123);
    d2.journal(&request(&a2, Some(&next), now));
    let acts = d2.go(
        Event::Admit {
            slot: 0,
            slots: 1,
            timeout: secs(1800),
        },
        now + secs(1),
    );
    assert_eq!(
        acts[0],
        Action::WriteDeadlineFile {
            vm: a2.vm.clone(),
            deadline: ts(DEADLINE)
        }
    );
    assert_eq!(
        d2.lines,
        vec![
            "#123 a2 [*] -> Requested retry after a1 was interrupted; deadline 2026-10-05T02:56:06.653639Z kept",
            "#124 a2 Requested -> Admitted (SlotFree) slot 1/1, deadline 2026-10-05T02:56:06.653639Z",
        ]
    );
}

#[test]
fn retry_decision_names_why_not() {
    let cfg = Config::default();
    let deadline = ts(DEADLINE);
    let ok_now = deadline - secs(120);
    let base = mk_attempt(1, S::Retired);
    assert_eq!(
        decide_retry(&base, ok_now, &cfg),
        Ok(NextAttempt {
            build: mk_build(),
            attempt: 2,
            deadline
        })
    );
    let late = ok_now + SignedDuration::from_millis(1);
    assert_eq!(
        decide_retry(&base, late, &cfg),
        Err(NoRetry::TooLittleTime {
            deadline,
            left: SignedDuration::from_millis(119_999),
            needed: secs(120)
        })
    );
    let mut a = base.clone();
    a.number = 2;
    assert_eq!(
        decide_retry(&a, ok_now, &cfg),
        Err(NoRetry::MaxAttemptsReached { attempt: 2, max: 2 })
    );
    a.max_attempts = 3;
    assert_eq!(decide_retry(&a, ok_now, &cfg).unwrap().attempt, 3);
    a.max_attempts = 4;
    assert_eq!(
        decide_retry(&a, ok_now, &cfg),
        Err(NoRetry::InvalidMaxAttempts { max: 4 })
    );
    a.max_attempts = 0;
    assert_eq!(
        decide_retry(&a, ok_now, &cfg),
        Err(NoRetry::InvalidMaxAttempts { max: 0 })
    );
    let mut a = base.clone();
    a.max_attempts = 1;
    assert_eq!(
        decide_retry(&a, ok_now, &cfg),
        Err(NoRetry::MaxAttemptsReached { attempt: 1, max: 1 })
    );
    for outcome in [Outcome::Succeeded, Outcome::Failed, Outcome::Cancelled] {
        let mut a = base.clone();
        a.outcome = Some(outcome);
        assert_eq!(
            decide_retry(&a, ok_now, &cfg),
            Err(NoRetry::NotInterrupted { outcome: Some(outcome) })
        );
    }
    let mut a = base.clone();
    a.withdrawn = Some(Reason::OwnerDeleted);
    assert_eq!(
        decide_retry(&a, ok_now, &cfg),
        Err(NoRetry::Withdrawn {
            reason: Reason::OwnerDeleted
        })
    );
    let mut a = base.clone();
    a.build_gone = true;
    assert_eq!(decide_retry(&a, ok_now, &cfg), Err(NoRetry::BuildGone));
    let mut a = base.clone();
    a.deadline = None;
    assert_eq!(decide_retry(&a, ok_now, &cfg), Err(NoRetry::NoDeadline));
    // The minimum is a parameter.
    let cfg = Config {
        retry_min_remaining: secs(30),
        ..Config::default()
    };
    assert!(decide_retry(&base, late, &cfg).is_ok());
    assert_eq!(
        NoRetry::TooLittleTime {
            deadline,
            left: secs(95),
            needed: secs(120)
        }
        .to_string(),
        "95s left before the deadline 2026-10-05T02:56:06.653639Z, a retry needs 120s"
    );
}

#[test]
fn admission_fixes_the_deadline_or_refuses() {
    let cfg = Config::default();
    let now = ts("2026-10-05T02:26:06.653639Z");
    let a1 = mk_attempt(1, S::Requested);
    let t = step(
        &a1,
        Event::Admit {
            slot: 1,
            slots: 2,
            timeout: secs(1800),
        },
        now,
        &cfg,
    )
    .unwrap();
    assert_eq!((t.slot, t.deadline), (Some(1), Some(ts(DEADLINE))));
    assert_eq!(t.detail, "slot 2/2, deadline 2026-10-05T02:56:06.653639Z");
    for (slot, slots) in [(1, 1), (2, 2), (0, 0), (0, 3)] {
        let r = step(
            &a1,
            Event::Admit {
                slot,
                slots,
                timeout: secs(1800),
            },
            now,
            &cfg,
        )
        .unwrap_err();
        assert_eq!(
            r,
            Refusal::BadSlot {
                state: S::Requested,
                event: EventKind::Admit,
                slot,
                slots
            }
        );
    }
    // A retry inherits the deadline; with less than 120 s left it is refused by name.
    let a2 = mk_attempt(2, S::Requested);
    let late = ts(DEADLINE) - secs(95);
    let r = step(
        &a2,
        Event::Admit {
            slot: 0,
            slots: 1,
            timeout: secs(1800),
        },
        late,
        &cfg,
    )
    .unwrap_err();
    assert_eq!(
        r.to_string(),
        "Admit refused in state Requested: retry a2 needs 120s before the deadline 2026-10-05T02:56:06.653639Z, \
         95s left; send DeadlinePassed to close it"
    );
    let t = step(&a2, Event::DeadlinePassed { at_start: None }, late, &cfg).unwrap();
    assert_eq!(t.actions, vec![Action::DeliverStatus, Action::RemoveFinalizer]);
    assert_eq!(
        t.detail,
        "not admitted: 95s left before the deadline 2026-10-05T02:56:06.653639Z, a retry needs 120s"
    );
    // ... but not while the window is still open, nor without a deadline.
    let early = ts(DEADLINE) - secs(121);
    let r = step(&a2, Event::DeadlinePassed { at_start: None }, early, &cfg).unwrap_err();
    assert!(matches!(r, Refusal::DeadlineNotReached { .. }), "{r}");
    let r = step(&a1, Event::DeadlinePassed { at_start: None }, early, &cfg).unwrap_err();
    assert_eq!(
        r,
        Refusal::NoDeadline {
            state: S::Requested,
            event: EventKind::DeadlinePassed
        }
    );
}

#[test]
fn deadline_and_watchdog_events_are_refused_before_the_deadline() {
    let before = ts(DEADLINE) - secs(1);
    for ev in [Event::DeadlinePassed { at_start: None }, Event::WatchdogRemovedVm] {
        let r = step(&mk_attempt(1, S::Running), ev, before, &Config::default()).unwrap_err();
        assert!(
            matches!(r, Refusal::DeadlineNotReached { state: S::Running, .. }),
            "{r}"
        );
    }
}

#[test]
fn claim_loser_clones_nothing_and_records_no_outcome() {
    let mut d = Driver::new(Attempt::new(mk_build(), 1, vm(), 2), 5);
    let now = ts("2026-10-05T02:26:06Z");
    let acts = d.go(
        Event::ClaimLost {
            holder: "mac-mini-08".into(),
        },
        now,
    );
    assert_eq!(acts, vec![]);
    assert_eq!(
        d.lines,
        vec!["#5 a1 Requested -> Retired (ClaimLost) claim lost to mac-mini-08; nothing cloned"]
    );
    assert_eq!((d.a.outcome, d.a.slot), (None, None));
    assert_eq!(
        decide_retry(&d.a, now, &Config::default()),
        Err(NoRetry::NotInterrupted { outcome: None })
    );
}

/// A claim whose answer never came may have landed: like a lost claim it clones nothing and has
/// no outcome, but it answers for the claim (status, finalizer), fenced so a claim that did not
/// land refuses both.
#[test]
fn an_unconfirmed_claim_clones_nothing_and_still_answers_for_the_claim() {
    let mut d = Driver::new(Attempt::new(mk_build(), 1, vm(), 2), 5);
    let now = ts("2026-10-05T02:26:06Z");
    let acts = d.go(
        Event::ClaimUnconfirmed {
            error: "no answer within 4s".into(),
        },
        now,
    );
    assert_eq!(acts, vec![Action::DeliverStatus, Action::RemoveFinalizer]);
    assert_eq!(
        d.lines,
        vec!["#5 a1 Requested -> Retired (ClaimUnconfirmed) claim not confirmed (no answer within 4s); nothing cloned"]
    );
    // An older agent cannot decode the reason: the record's layout makes it refuse the journal
    // instead of dropping the record as damage.
    let requested = Attempt::new(mk_build(), 1, vm(), 2);
    let t = step(
        &requested,
        Event::ClaimUnconfirmed { error: "x".into() },
        now,
        &Config::default(),
    )
    .unwrap();
    assert_eq!(requested.record(&t, 6).layout_version(), 3);
    assert_eq!((d.a.outcome, d.a.slot), (None, None));
    assert_eq!(
        decide_retry(&d.a, now, &Config::default()),
        Err(NoRetry::NotInterrupted { outcome: None })
    );
}

#[test]
fn watchdog_removal_fails_the_attempt_without_touching_the_vm() {
    let mut d = Driver::new(mk_attempt(1, S::Running), 70);
    let now = ts(DEADLINE) + secs(90);
    let acts = d.go(Event::WatchdogRemovedVm, now);
    assert_eq!(acts, vec![Action::DeliverStatus, Action::ConfirmVmGone { vm: vm() }]);
    let acts = d.go(
        Event::VmDeleted {
            how: DeleteContext::Watchdog.deleted(secs(0)),
        },
        now,
    );
    assert_eq!(acts.last(), Some(&Action::RemoveFinalizer));
    assert_eq!(
        d.lines,
        vec![
            "#70 a1 Running -> Retiring (WatchdogDeadline) mb-ci-build-42-mac-build-c49f62f4 gone after the deadline \
             2026-10-05T02:56:06.653639Z: deleted by the watchdog outcome=Failed",
            "#71 a1 Retiring -> Retired (VMDeleted) already deleted by the watchdog",
        ]
    );
}

#[test]
fn failed_delete_quarantines_keeps_the_slot_and_resolves_on_retry() {
    let mut a = mk_attempt(1, S::Retiring);
    a.outcome = Some(Outcome::Failed);
    let mut d = Driver::new(a, 50);
    let now = ts(DEADLINE) - secs(600);
    let acts = d.go(
        Event::DeleteFailed {
            context: DeleteContext::Normal,
            error: "exit 1".into(),
        },
        now,
    );
    assert_eq!(
        acts,
        vec![
            Action::DeliverStatus,
            Action::RetryDeleteLater {
                vm: vm(),
                after: secs(30)
            }
        ]
    );
    assert_eq!(
        free_slot(1, &attempt_holders([&d.a])),
        None,
        "Quarantined keeps the slot"
    );
    let acts = d.go(Event::VmDeleted { how: Deleted::OnRetry }, now + secs(30));
    assert_eq!(
        acts,
        vec![
            Action::RemoveDeadlineFile { vm: vm() },
            Action::ReleaseSlot { slot: 0 },
            Action::DeliverStatus,
            Action::RemoveFinalizer
        ]
    );
    assert_eq!(free_slot(1, &attempt_holders([&d.a])), Some(0));
    assert_eq!(
        d.lines,
        vec![
            "#50 a1 Retiring -> Quarantined (DeleteFailed) could not delete, slot quarantined: exit 1",
            "#51 a1 Quarantined -> Retired (Resolved) clone directory gone (deleted on retry); slot released",
        ]
    );
}

#[test]
fn a_gone_build_gets_no_status_and_no_finalizer_removal() {
    let mut a = mk_attempt(1, S::Running);
    a.build_gone = true;
    let t = step(
        &a,
        Event::CancelRequested { at_start: Some(1) },
        ts(DEADLINE),
        &Config::default(),
    )
    .unwrap();
    assert_eq!(
        t.actions,
        vec![Action::StopAndDeleteVm {
            vm: vm(),
            context: DeleteContext::AgentStart
        }]
    );
    assert_eq!(
        t.detail,
        "MacBuild deleted; found Running at agent start; killed 1 tart process(es)"
    );
    let mut a = mk_attempt(1, S::Retiring);
    a.build_gone = true;
    let t = step(
        &a,
        Event::VmDeleted {
            how: Deleted::AtAgentStart,
        },
        ts(DEADLINE),
        &Config::default(),
    )
    .unwrap();
    assert_eq!(
        t.actions,
        vec![Action::RemoveDeadlineFile { vm: vm() }, Action::ReleaseSlot { slot: 0 }]
    );
}

#[test]
fn replay_keeps_outcome_slot_and_deadline_when_later_records_omit_them() {
    let mut a = mk_attempt(1, S::Running);
    a.outcome = None;
    let t = step(
        &a,
        Event::AgentRestarted { killed: 2 },
        ts(DEADLINE),
        &Config::default(),
    )
    .unwrap();
    let r1 = a.record(&t, 1);
    assert_eq!(
        r1.to_string(),
        "#1 a1 Running -> Retiring (AgentRestarted) found Running at agent start; killed 2 tart process(es) \
         outcome=Interrupted"
    );
    let mut replayed = Attempt::from_record(&r1, 2).unwrap();
    let t = step(
        &replayed,
        Event::VmDeleted {
            how: Deleted::AtAgentStart,
        },
        ts(DEADLINE),
        &Config::default(),
    );
    let mut r2 = replayed.record(&t.unwrap(), 2);
    r2.slot = None;
    r2.deadline = None;
    replayed.observe(&r2);
    assert_eq!(replayed.state, S::Retired);
    assert_eq!(replayed.outcome, Some(Outcome::Interrupted));
    // The cause is the detail of the record that fixed the outcome, not of the last one.
    assert_eq!(replayed.cause.as_deref(), Some(r1.detail.as_str()));
    assert_eq!((replayed.slot, replayed.deadline), (Some(0), Some(ts(DEADLINE))));
    assert_eq!(replayed.last_seq, Some(2));
    let mut unknown = r1.clone();
    unknown.build = None;
    assert_eq!(Attempt::from_record(&unknown, 2), None);
}

#[test]
fn free_slot_never_hands_out_a_held_slot() {
    use SlotHolder::{Slot, Unnumbered};
    assert_eq!(free_slot(1, &[]), Some(0));
    assert_eq!(free_slot(1, &[Slot(0)]), None);
    assert_eq!(free_slot(2, &[Slot(0)]), Some(1));
    assert_eq!(free_slot(2, &[Slot(1)]), Some(0));
    assert_eq!(free_slot(2, &[Slot(0), Slot(1)]), None);
    assert_eq!(free_slot(2, &[Slot(1), Unnumbered]), None);
    assert_eq!(free_slot(2, &[Unnumbered]), Some(0));
    assert_eq!(free_slot(1, &[Unnumbered]), None);
    assert_eq!(free_slot(2, &[Unnumbered, Unnumbered]), None);
    // More slots than tart can run are never offered.
    assert_eq!(free_slot(3, &[Slot(0), Slot(1)]), None);
    // Only slot-holding states count.
    let states: Vec<_> = AttemptState::ALL.iter().map(|&s| mk_attempt(1, s)).collect();
    let held = attempt_holders(&states);
    assert_eq!(held.len(), 6);
    assert_eq!(free_slot(1, &held), None);
    let idle = [mk_attempt(1, S::Requested), mk_attempt(1, S::Retired)];
    assert_eq!(free_slot(1, &attempt_holders(&idle)), Some(0));
}

#[test]
fn a_failing_step_records_why_and_the_cause_survives_replay() {
    let mut d = Driver::new(mk_attempt(1, S::Running), 7);
    let before = ts(DEADLINE) - secs(600);
    d.go(
        Event::StepFailed {
            step: "build".into(),
            exit_code: 3,
            output: "…\nerror: \u{1b}[31mno such module\u{1b}[0m\0 'Foo'".into(),
        },
        before,
    );
    let cause = "step build exited 3; its output ends:\n…\nerror: no such module 'Foo'";
    assert_eq!(d.a.cause.as_deref(), Some(cause));
    d.go(
        Event::VmDeleted {
            how: Deleted::Stopped { took: secs(2) },
        },
        before,
    );
    // The deletion's record does not replace the cause.
    assert_eq!(d.a.cause.as_deref(), Some(cause));

    // A step that could not be run says tart's error; an unusable report says the parser's.
    let a = mk_attempt(1, S::Running);
    let t = step(
        &a,
        Event::StepFailed {
            step: "build".into(),
            exit_code: -1,
            output: "could not start `tart exec` for vm: Argument list too long".into(),
        },
        before,
        &Config::default(),
    )
    .unwrap();
    assert_eq!(
        t.detail,
        "step build could not be run: could not start `tart exec` for vm: Argument list too long"
    );
    let t = step(
        &mk_attempt(1, S::Collecting),
        Event::TestReportUnusable {
            error: "test report r.xml cannot be trusted: 5 failures + 0 errors + 0 skipped exceed its 1 tests".into(),
        },
        before,
        &Config::default(),
    )
    .unwrap();
    assert_eq!(
        (t.reason, t.outcome),
        (Some(Reason::TestsFailed), Some(Outcome::Failed))
    );
    assert!(
        t.detail
            .starts_with("test report unusable, so the build is not counted as passed: ")
    );

    // Whatever tart printed, a detail is clean text of bounded size.
    let t = step(
        &mk_attempt(1, S::Booting),
        Event::VmStartFailed {
            error: format!("tart clone: \u{1b}]0;x\u{7}{}\u{0}\u{ff}", "y".repeat(64 << 10)),
        },
        before,
        &Config::default(),
    )
    .unwrap();
    assert!(t.detail.len() <= DETAIL_MAX, "{} bytes", t.detail.len());
    assert!(
        t.detail.starts_with("VM did not start: tart clone: yyy"),
        "{}",
        &t.detail[..40]
    );
    assert!(t.detail.chars().all(|c| !c.is_control()));
}

#[test]
fn each_step_is_started_once_and_in_order() {
    let now = ts(DEADLINE) - secs(600);
    let starting = |index| Event::StepStarting {
        index,
        of: 4,
        name: format!("s{index}"),
        previous: format!("s{}", index - 1),
    };
    let mut a = mk_attempt(1, S::Running);
    for index in [0, 2, 5] {
        let r = step(&a, starting(index.max(1)), now, &Config::default());
        if index == 0 {
            // Step 0 starts with Running itself; index 1 is the next one.
            assert!(r.is_ok());
            continue;
        }
        assert_eq!(
            r.unwrap_err(),
            Refusal::StepNotNext {
                state: S::Running,
                event: EventKind::StepStarting,
                index,
                current: 0
            }
        );
    }
    let t = step(&a, starting(1), now, &Config::default()).unwrap();
    assert_eq!(t.step, Some(1));
    assert_eq!(
        t.actions,
        vec![Action::RunStep {
            vm: vm(),
            index: 1,
            since: now
        }]
    );
    let r = a.record(&t, 9);
    assert_eq!(r.step, Some(1));
    assert_eq!(
        r.to_string(),
        "#9 a1 Running -> Running (StepStarted) step s0 exited 0; starting s1 (2/4)"
    );
    a.observe(&r);
    // The same step again (a replayed event after a crash) is refused: it never runs twice.
    let again = step(&a, starting(1), now, &Config::default()).unwrap_err();
    assert_eq!(
        again.to_string(),
        "StepStarting refused in state Running: step 1 is not the one after step 1; a step is never started twice"
    );
    // A later record without a step keeps the one the journal started, and its start time: a
    // resumed step's timeoutSeconds counts from its first start, not from the resume.
    let detach = step(&a, Event::Detach, now + secs(100), &Config::default()).unwrap();
    a.observe(&a.record(&detach, 10));
    assert_eq!(a.current_step(), 1);
    assert_eq!(a.step_since, Some(now));
    let resume = step(
        &a,
        Event::Resume {
            after: secs(4),
            clone_again: false,
        },
        now + secs(300),
        &Config::default(),
    )
    .unwrap();
    assert_eq!(
        resume.actions,
        vec![Action::RunStep {
            vm: vm(),
            index: 1,
            since: now
        }]
    );
    assert_eq!(
        (resume.from, resume.to, resume.reason),
        (Some(S::Running), S::Running, Some(Reason::Resumed))
    );
    assert!(
        resume.actions.iter().all(|x| *x != Action::DeliverStatus),
        "a resume writes no status before the step"
    );
}

#[test]
fn a_boot_stopped_before_its_clone_finished_resumes_with_the_clone() {
    let now = ts("2026-02-01T10:20:00Z");
    let again = |clone_again| Event::Resume {
        after: secs(1),
        clone_again,
    };
    let t = step(&mk_attempt(1, S::Booting), again(true), now, &Config::default()).unwrap();
    assert_eq!(
        t.actions,
        vec![
            Action::CloneVm { vm: vm() },
            Action::SetVm { vm: vm() },
            Action::StartVm { vm: vm() },
            Action::ProbeReady { vm: vm() },
        ]
    );
    assert_eq!((t.to, t.reason, t.outcome), (S::Booting, Some(Reason::Resumed), None));
    assert!(t.detail.contains("not cloned yet"), "{}", t.detail);
    // Admitted: the deadline file again, then (the drive loop's) Boot.
    let mut admitted = mk_attempt(1, S::Admitted);
    admitted.deadline = Some(ts("2026-02-01T11:00:00Z"));
    let t = step(&admitted, again(true), now, &Config::default()).unwrap();
    assert_eq!(
        t.actions,
        vec![Action::WriteDeadlineFile {
            vm: vm(),
            deadline: ts("2026-02-01T11:00:00Z")
        }]
    );
    assert_eq!((t.to, t.reason), (S::Admitted, Some(Reason::Resumed)));
    // Past the boot the VM exists: nothing there is cloned again.
    for state in [S::Running, S::Collecting] {
        let r = step(&mk_attempt(1, state), again(true), now, &Config::default());
        assert!(matches!(r, Err(Refusal::NotAllowed { .. })), "{state}: {r:?}");
    }
}

#[test]
fn a_timed_out_step_fails_the_build_naming_the_step_and_its_limit() {
    let a = mk_attempt(1, S::Running);
    let (ev, now) = sample(EventKind::StepTimedOut);
    let t = step(&a, ev, now, &Config::default()).unwrap();
    assert_eq!(
        (t.to, t.reason, t.outcome),
        (S::Retiring, Some(Reason::StepTimedOut), Some(Outcome::Failed))
    );
    assert_eq!(
        t.detail,
        "step build ran longer than its timeoutSeconds (600s); it was killed in the guest (2 process(es)); \
         its output ends:\nCompiling App.swift"
    );
}

#[test]
fn the_step_start_is_the_time_of_the_record_that_started_it() {
    let mut a = mk_attempt(1, S::Booting);
    a.step_since = None;
    let t0 = ts(DEADLINE) - secs(900);
    let ready = step(&a, Event::GuestReady { after: secs(12) }, t0, &Config::default()).unwrap();
    a.observe(&a.record(&ready, 20));
    assert_eq!(a.step_since, Some(t0));
    let next = step(
        &a,
        Event::StepStarting {
            index: 1,
            of: 2,
            name: "test".into(),
            previous: "build".into(),
        },
        t0 + secs(40),
        &Config::default(),
    )
    .unwrap();
    a.observe(&a.record(&next, 21));
    assert_eq!(a.step_since, Some(t0 + secs(40)));
}

/// A build refused before its boot (a mount or a Secret refused while Admitted) had no VM: its
/// retirement says so, not that a VM was stopped and deleted. One refused after its boot started
/// had one.
#[test]
fn a_refusal_before_the_boot_says_no_vm_was_cloned() {
    let now = ts(DEADLINE) - secs(1500);
    let refused = Event::MountRefused {
        error:
            "mount \"pods\" is not declared by this agent's config ([[mounts]]: it declares none); nothing was cloned"
                .into(),
    };
    let deleted = Event::VmDeleted {
        how: Deleted::Stopped { took: secs(0) },
    };
    let mut d = Driver::new(mk_attempt(1, S::Admitted), 10);
    d.go(refused.clone(), now);
    d.go(deleted.clone(), now);
    assert_eq!(
        d.lines.last().unwrap(),
        "#11 a1 Retiring -> Retired (VMDeleted) no VM was cloned for attempt 1: nothing to delete"
    );
    let mut d = Driver::new(mk_attempt(1, S::Admitted), 10);
    d.go(Event::Boot, now);
    d.go(refused, now);
    d.go(deleted, now);
    assert_eq!(
        d.lines.last().unwrap(),
        "#12 a1 Retiring -> Retired (VMDeleted) stopped and deleted in 0.00s"
    );
}

/// A holder fenced out while its attempt ran (its claim moved to another agent): it stops and
/// deletes its own VM and frees its slot, and owes the MacBuild nothing: no status, no finalizer
/// release, no retry (the build is the new holder's).
#[test]
fn a_claim_lost_while_running_deletes_the_vm_frees_the_slot_and_writes_nothing() {
    let now = ts(DEADLINE) - secs(1500);
    for state in [S::Admitted, S::Booting, S::Running, S::Collecting] {
        let mut d = Driver::new(mk_attempt(1, state), 30);
        let acts = d.go(
            Event::ClaimLost {
                holder: "mac-mini-08 (a2)".into(),
            },
            now,
        );
        assert_eq!(
            acts,
            vec![Action::StopAndDeleteVm {
                vm: vm(),
                context: DeleteContext::Normal
            }],
            "{state}"
        );
        assert_eq!(
            d.lines[0],
            format!(
                "#30 a1 {state} -> Retiring (ClaimLost) claim moved to mac-mini-08 (a2); this attempt stops and deletes its VM"
            )
        );
        assert_eq!(d.a.outcome, None);
        let acts = d.go(
            Event::VmDeleted {
                how: Deleted::Stopped { took: secs(4) },
            },
            now,
        );
        assert_eq!(
            acts,
            vec![Action::RemoveDeadlineFile { vm: vm() }, Action::ReleaseSlot { slot: 0 }],
            "{state}"
        );
        assert_eq!(d.a.state, S::Retired);
        // A withdrawal seen on the way changes nothing of that.
        let mut d = Driver::new(mk_attempt(1, state), 30);
        d.go(Event::ClaimLost { holder: "x".into() }, now);
        let acts = d.go(Event::CancelRequested { at_start: None }, now);
        assert!(
            !acts
                .iter()
                .any(|a| matches!(a, Action::DeliverStatus | Action::RemoveFinalizer)),
            "{acts:?}"
        );
    }
}
