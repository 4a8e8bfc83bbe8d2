//! Adversary 20 (quick): recovery of an unclaimed retry's end when attempt 1's end is undelivered too.
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::collections::BTreeMap;
use tartan_agent::machine::{Attempt, AttemptKey, Config, Deleted, Event, NextAttempt, Transition, request, step};
use tartan_agent::record::{BuildRef, Record};
use tartan_agent::recovery::{AgentId, BuildView, ClaimView, ClusterView, RecoveryAction, plan};
use tartan_api::AttemptState;

const ME: &str = "mac-a";

fn ts(s: &str) -> Timestamp {
    s.parse().unwrap()
}
fn secs(n: i64) -> SignedDuration {
    SignedDuration::from_secs(n)
}
fn rbuild() -> BuildRef {
    BuildRef {
        namespace: "ci".into(),
        name: "chaos-2928".into(),
        uid: "u-2928".into(),
    }
}

struct Journal {
    recs: Vec<Record>,
    seq: u64,
    views: BTreeMap<u32, Attempt>,
}

impl Journal {
    fn push(&mut self, n: u32, t: &Transition) {
        let a = self.views.get_mut(&n).unwrap();
        let r = a.record(t, self.seq);
        self.seq += 1;
        a.observe(&r);
        self.recs.push(r);
    }
    fn request(&mut self, n: u32, retry: Option<NextAttempt>, at: Timestamp) -> &mut Self {
        let a = Attempt::new(rbuild(), n, format!("mb-ci-chaos-2928-a{n}"), 2);
        let t = request(&a, retry.as_ref(), at);
        self.views.insert(n, a);
        self.push(n, &t);
        self
    }
    fn go(&mut self, n: u32, ev: Event, at: Timestamp) -> &mut Self {
        let t = step(&self.views[&n], ev, at, &Config::default()).unwrap();
        self.push(n, &t);
        self
    }
}

#[test]
fn q1_a1_end_undelivered_too_only_the_retrys_end_is_redelivered() {
    let t0 = ts("2026-10-05T02:26:06Z");
    let mut j = Journal {
        recs: vec![],
        seq: 600,
        views: BTreeMap::new(),
    };
    j.request(1, None, t0)
        .go(
            1,
            Event::Admit {
                slot: 0,
                slots: 1,
                timeout: secs(1800),
            },
            t0 + secs(1),
        )
        .go(1, Event::Boot, t0 + secs(2))
        .go(1, Event::AgentRestarted { killed: 0 }, t0 + secs(60))
        .go(
            1,
            Event::VmDeleted {
                how: Deleted::AtAgentStart,
            },
            t0 + secs(61),
        );
    let a1 = j.views[&1].clone();
    assert_eq!(a1.state, AttemptState::Retired);
    let a1_last = j.seq - 1;
    let deadline = a1.deadline.unwrap();
    j.request(
        2,
        Some(NextAttempt {
            build: rbuild(),
            attempt: 2,
            deadline,
        }),
        t0 + secs(62),
    )
    .go(2, Event::CancelRequested { at_start: None }, t0 + secs(63));
    assert_eq!(j.views[&2].state, AttemptState::Retired);
    let a2_end = j.seq - 1;
    // The agent restarts before the retry's end was delivered: the MacBuild still shows our
    // claim of attempt 1 (the retry's claim was never written), at a1's last record, with our
    // finalizer, and the cancel.
    let cluster = ClusterView {
        builds: vec![BuildView {
            namespace: "ci".into(),
            name: "chaos-2928".into(),
            uid: "u-2928".into(),
            owner_deleted: false,
            deletion_requested: false,
            cancel_requested: true,
            claim: Some(ClaimView {
                holder: ME.into(),
                attempt: 1,
            }),
            journal_seq: Some(a1_last - 2),
            max_attempts: Some(2),
            timeout_seconds: 1800,
            has_finalizer: true,
            generation: Some(1),
        }],
        assumed: false,
    };
    let p = plan(
        &j.recs,
        &[],
        &cluster,
        &AgentId(ME.into()),
        t0 + secs(120),
        &Config::default(),
    );
    let key2 = AttemptKey {
        build: rbuild(),
        attempt: 2,
    };
    assert!(
        p.contains(&RecoveryAction::RedeliverStatus {
            attempt: key2,
            seq: a2_end
        }),
        "the retry's journaled end (record {a2_end}) is not redelivered after a restart; plan: {p:?}"
    );
    assert!(
        p.contains(&RecoveryAction::RemoveFinalizer { build: rbuild() }),
        "our finalizer is left on the ended build; plan: {p:?}"
    );
    let redeliveries: Vec<_> = p
        .iter()
        .filter(|a| matches!(a, RecoveryAction::RedeliverStatus { .. }))
        .collect();
    assert_eq!(
        redeliveries.len(),
        1,
        "more than one redelivery for one build (a1_last={a1_last}); plan: {p:?}"
    );
}
