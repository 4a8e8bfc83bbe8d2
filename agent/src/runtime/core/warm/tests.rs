//! The pool's share of `Builds` over a real journal: refills, adoption, eviction (a build before a
//! refill), warm VMs of an earlier run, a torn hand-over, a failed deletion.

use super::*;
use crate::journal::{Journal, JournalOptions};
use crate::lock::StateLock;
use crate::machine::Attempt;
use crate::pool::PoolEntry;
use crate::record::BuildRef;

const IMAGE: &str = "ghcr.io/cirruslabs/macos-sequoia-xcode:16";
const OTHER: &str = "ghcr.io/cirruslabs/macos-sonoma-base:latest";

struct Rig {
    builds: Builds,
    dir: tempfile::TempDir,
    _lock: StateLock,
}

impl Rig {
    fn new() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let lock = StateLock::acquire(dir.path()).unwrap();
        let (journal, _) = Journal::open(&lock, JournalOptions::default()).unwrap();
        Rig {
            builds: Builds::new(journal),
            dir,
            _lock: lock,
        }
    }

    /// Every record on disk, as the next start replays them.
    fn records(&self) -> Vec<Record> {
        crate::journal::read_records(self.dir.path()).unwrap().records
    }

    async fn round(&self, spec: &PoolSpec, slots: u8) -> Vec<PoolWork> {
        self.builds.pool_round(spec, slots, Timestamp::now()).await.unwrap()
    }

    /// Refills the pool's one VM and records it ready; its name.
    async fn ready_vm(&self, spec: &PoolSpec, slots: u8) -> String {
        let work = self.round(spec, slots).await;
        let [PoolWork::Refill { vm, .. }] = work.as_slice() else {
            panic!("one refill expected: {work:?}")
        };
        self.builds
            .warm_booted(vm, Ok((SignedDuration::from_millis(300), Timestamp::now())))
            .await
            .unwrap();
        vm.clone()
    }
}

fn pool_of(image: &str, size: u8) -> PoolSpec {
    PoolSpec {
        entries: vec![PoolEntry {
            profile: WarmProfile::new(image, None, None),
            size,
        }],
        max_idle: Duration::from_secs(3600),
        cold_slots: 0,
    }
}

fn spec(image: &str) -> MacBuildSpec {
    MacBuildSpec::new(image, Vec::new())
}

fn build_ref(uid: &str) -> BuildRef {
    BuildRef {
        namespace: "ci".into(),
        name: format!("b-{uid}"),
        uid: uid.into(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refill_journals_its_slot_and_deadline_before_any_clone_and_a_ready_vm_is_claimable() {
    let rig = Rig::new();
    let pool = pool_of(IMAGE, 1);
    let work = rig.round(&pool, 1).await;
    let [PoolWork::Refill { vm, slot, deadline, .. }] = work.as_slice() else {
        panic!("{work:?}")
    };
    assert!(
        tartan_api::is_warm_vm(vm) && tartan_api::check_vm_name(vm).is_ok(),
        "{vm}"
    );
    let first = &rig.records()[0];
    assert_eq!(
        (first.to, first.slot, first.deadline),
        (AttemptState::Booting, Some(*slot), Some(*deadline))
    );
    assert_eq!((first.layout_version(), first.version), (2, 2));
    assert!(
        rig.round(&pool, 1).await.is_empty(),
        "its refill task has it; nothing more to do"
    );
    assert_eq!(
        rig.builds.claimable_slots(1).await,
        1,
        "a booting warm VM gives its slot to a build"
    );
    assert!(rig.builds.ready_warm_profiles().await.is_empty());
    rig.builds
        .warm_booted(vm, Ok((SignedDuration::from_millis(300), Timestamp::now())))
        .await
        .unwrap();
    assert_eq!(
        rig.builds.ready_warm_profiles().await,
        vec![WarmProfile::new(IMAGE, None, None)]
    );
    assert_eq!(rig.builds.ready_warm_images().await, vec![IMAGE.to_string()]);
    assert_eq!(rig.builds.free_slots(1).await, 0, "it holds its slot");
    assert_eq!(rig.builds.claimable_slots(1).await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_serving_build_reserves_the_ready_vm_and_the_hand_over_record_follows_its_admission() {
    let rig = Rig::new();
    let pool = pool_of(IMAGE, 1);
    let vm = rig.ready_vm(&pool, 1).await;
    let Placed::Reserved(reservation) = rig.builds.place("u1", 1, &spec(IMAGE)).await else {
        panic!("the ready VM is adopted")
    };
    let adoption = reservation.adoption().cloned().expect("with the warm VM");
    assert_eq!(adoption.vm, vm);
    assert_eq!(
        rig.builds.free_slots(1).await,
        0,
        "the VM counts once, as the reservation"
    );
    assert!(
        rig.builds.ready_warm_profiles().await.is_empty(),
        "reserved: no longer offered"
    );
    assert!(matches!(rig.builds.place("u2", 1, &spec(IMAGE)).await, Placed::Full));
    assert!(
        rig.round(&pool, 1).await.is_empty(),
        "a reserved VM is neither expired nor evicted"
    );

    // The attempt's admission, and the VM's hand-over that is journaled with it.
    let a = Attempt::new(build_ref("u1"), 1, "mb-ci-b-u1-1", 2);
    let t = crate::machine::step(
        &a,
        crate::machine::Event::Adopt {
            slot: reservation.slot(),
            slots: 1,
            timeout: SignedDuration::from_secs(600),
            adoption,
        },
        Timestamp::now(),
        &crate::machine::Config::default(),
    )
    .unwrap();
    let admitted = a.record(&t, 3);
    let mut core = rig.builds.core.lock().await;
    let handed = core.handed_over(&admitted).expect("a hand-over record");
    assert_eq!(
        (handed.from, handed.to, handed.reason, handed.slot),
        (
            Some(AttemptState::Running),
            AttemptState::Retired,
            Some(Reason::Adopted),
            admitted.slot
        )
    );
    assert!(handed.detail.contains("ci/b-u1 a1"), "{}", handed.detail);
    core.take_in_handed_over(&handed);
    assert!(core.warm.is_empty());
    core.count_admission(&admitted, true);
    assert_eq!(core.pool_tally.adoptions, 1);
    drop(core);
    // (The attempt's `Admitted` record would end the reservation; dropped here, it frees the slot.)
    drop(reservation);
    assert_eq!(rig.builds.free_slots(1).await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_build_of_another_image_evicts_and_gets_the_slot_before_any_refill() {
    let rig = Rig::new();
    let pool = pool_of(IMAGE, 1);
    let vm = rig.ready_vm(&pool, 1).await;
    assert!(matches!(rig.builds.place("u1", 1, &spec(OTHER)).await, Placed::Waiting));
    let work = rig.round(&pool, 1).await;
    assert_eq!(work, vec![PoolWork::Delete { vm: vm.clone() }]);
    let last = rig.records().pop().unwrap();
    assert_eq!((last.to, last.reason), (AttemptState::Retiring, Some(Reason::Evicted)));
    assert!(last.detail.contains("u1"), "{}", last.detail);
    // Until the deletion is confirmed, the slot stays the VM's.
    assert!(matches!(rig.builds.place("u1", 1, &spec(OTHER)).await, Placed::Waiting));
    rig.builds.warm_deleted(&vm, Ok(())).await.unwrap();
    assert!(rig.round(&pool, 1).await.is_empty(), "the waiting build comes first");
    let Placed::Reserved(r) = rig.builds.place("u1", 1, &spec(OTHER)).await else {
        panic!("the freed slot is the build's")
    };
    assert!(r.adoption().is_none());
    assert!(rig.round(&pool, 1).await.is_empty(), "the slot is reserved");
    drop(r);
    assert!(matches!(
        rig.round(&pool, 1).await.as_slice(),
        [PoolWork::Refill { .. }]
    ));
    assert_eq!(rig.builds.pool_tally().await.evictions, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_booting_vm_that_serves_the_build_is_waited_for_and_one_that_does_not_is_cancelled() {
    let rig = Rig::new();
    let pool = pool_of(IMAGE, 1);
    let work = rig.round(&pool, 1).await;
    let [PoolWork::Refill { vm, .. }] = work.as_slice() else {
        panic!("{work:?}")
    };
    assert!(matches!(
        rig.builds.place("same", 1, &spec(IMAGE)).await,
        Placed::Waiting
    ));
    assert!(rig.round(&pool, 1).await.is_empty(), "nothing to cancel: it will serve");
    rig.builds.retain_waiting(&BTreeSet::new()).await;
    assert!(matches!(
        rig.builds.place("other", 1, &spec(OTHER)).await,
        Placed::Waiting
    ));
    assert_eq!(
        rig.round(&pool, 1).await,
        vec![PoolWork::CancelRefill { vm: vm.clone() }]
    );
    assert!(rig.round(&pool, 1).await.is_empty(), "cancelled once");
}

#[tokio::test(flavor = "multi_thread")]
async fn warm_vms_of_an_earlier_run_are_deleted_and_never_adopted() {
    let rig = Rig::new();
    let pool = pool_of(IMAGE, 1);
    let vm = rig.ready_vm(&pool, 1).await;
    // The agent restarts: a fresh state over the same journal.
    let records = rig.records();
    let replayed = crate::recovery::replay(&records, &crate::machine::Config::default());
    assert_eq!(replayed.warm.len(), 1);
    let fresh = Rig::new();
    fresh.builds.load_replay(&replayed, &records).await;
    assert!(fresh.builds.ready_warm_profiles().await.is_empty(), "never offered");
    assert!(matches!(
        fresh.builds.place("u1", 1, &spec(IMAGE)).await,
        Placed::Waiting
    ));
    let work = fresh.round(&pool, 1).await;
    assert_eq!(work, vec![PoolWork::Delete { vm: vm.clone() }]);
    let last = fresh.records().pop().unwrap();
    assert_eq!(
        (last.to, last.reason),
        (AttemptState::Retiring, Some(Reason::AgentRestarted))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hand_over_torn_after_the_admission_leaves_the_vm_to_its_attempt() {
    let rig = Rig::new();
    let pool = pool_of(IMAGE, 1);
    let vm = rig.ready_vm(&pool, 1).await;
    let mut records = rig.records();
    let mut admitted = records[0].clone();
    admitted.build = Some(build_ref("u1"));
    admitted.attempt = Some(1);
    admitted.from = Some(AttemptState::Requested);
    admitted.to = AttemptState::Admitted;
    admitted.seq = 3;
    records.push(admitted);
    let replayed = crate::recovery::replay(&records, &crate::machine::Config::default());
    assert_eq!(replayed.warm.len(), 1, "the hand-over record is missing");
    let fresh = Rig::new();
    fresh.builds.load_replay(&replayed, &records).await;
    assert!(
        fresh.round(&pool, 1).await.is_empty(),
        "the VM is the attempt's: not deleted, no refill"
    );
    assert_eq!(fresh.builds.free_slots(1).await, 0, "held once, by the attempt");
    assert!(fresh.builds.open_vms().await.contains(&vm));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_deletion_quarantines_the_vm_keeps_its_slot_and_is_tried_again_later() {
    let rig = Rig::new();
    let pool = pool_of(IMAGE, 1);
    let vm = rig.ready_vm(&pool, 1).await;
    let empty = pool_of(IMAGE, 0);
    assert_eq!(rig.round(&empty, 1).await, vec![PoolWork::Delete { vm: vm.clone() }]);
    rig.builds
        .warm_deleted(&vm, Err("tart delete exited 1".into()))
        .await
        .unwrap();
    let last = rig.records().pop().unwrap();
    assert_eq!(
        (last.to, last.reason),
        (AttemptState::Quarantined, Some(Reason::DeleteFailed))
    );
    assert_eq!(rig.builds.free_slots(1).await, 0);
    assert!(rig.round(&empty, 1).await.is_empty(), "not before the retry delay");
    rig.builds.core.lock().await.warm.get_mut(&vm).unwrap().retry_from = Some(std::time::Instant::now());
    let n = rig.records().len();
    assert_eq!(rig.round(&empty, 1).await, vec![PoolWork::Delete { vm: vm.clone() }]);
    assert_eq!(rig.records().len(), n, "a retry journals nothing new");
    rig.builds.warm_deleted(&vm, Ok(())).await.unwrap();
    assert_eq!(rig.builds.free_slots(1).await, 1);
    assert!(rig.builds.pool_tally().await.idle_slot_seconds > 0.0);
}
