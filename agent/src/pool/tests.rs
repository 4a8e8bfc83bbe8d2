//! The pool's rules over every small host: up to two warm VMs of three kinds (two configured, one
//! not) in every phase and age, 0–2 usable slots, builds and waiting builds, sizes and cold slots.

use super::*;
use tartan_api::Step;
use tartan_api::crd::{MountRequest, Resources};

const MAX_IDLE: Duration = Duration::from_secs(600);

fn profile(kind: char) -> WarmProfile {
    match kind {
        'a' => WarmProfile::new("ghcr.io/x/sonoma", None, None),
        'b' => WarmProfile::new("ghcr.io/x/sequoia:15", Some(4), Some(8192)),
        _ => WarmProfile::new("ghcr.io/x/ventura:13", None, None),
    }
}

fn spec_for(image: &str, cpu: Option<u32>, memory_mib: Option<u32>) -> MacBuildSpec {
    MacBuildSpec {
        resources: Some(Resources { cpu, memory_mib }),
        ..MacBuildSpec::new(image, vec![Step::new("s", vec!["true".into()])])
    }
}

fn pool(size_a: u8, size_b: u8, cold_slots: u8) -> PoolSpec {
    PoolSpec {
        entries: vec![
            PoolEntry {
                profile: profile('a'),
                size: size_a,
            },
            PoolEntry {
                profile: profile('b'),
                size: size_b,
            },
        ],
        max_idle: MAX_IDLE,
        cold_slots,
    }
}

fn vm(name: &str, kind: char, phase: WarmPhase, age_secs: u64) -> WarmVm {
    WarmVm {
        name: name.into(),
        profile: profile(kind),
        phase,
        age: Duration::from_secs(age_secs),
    }
}

/// Every warm VM of one of the three kinds, in each phase, young or past `MAX_IDLE`.
fn every_vm(name: &str) -> Vec<WarmVm> {
    let mut out = Vec::new();
    for kind in ['a', 'b', 'c'] {
        for phase in [WarmPhase::Preparing, WarmPhase::Ready, WarmPhase::Deleting] {
            for age in [5, MAX_IDLE.as_secs()] {
                out.push(vm(name, kind, phase, age));
            }
        }
    }
    out
}

/// Every pool of at most two warm VMs.
fn every_pool() -> Vec<Vec<WarmVm>> {
    let mut out = vec![Vec::new()];
    for first in every_vm("mb-warm-1") {
        out.push(vec![first.clone()]);
        for second in every_vm("mb-warm-2") {
            out.push(vec![first.clone(), second]);
        }
    }
    out
}

fn every_occupancy() -> Vec<Occupancy> {
    let mut out = Vec::new();
    for usable in 0..=2 {
        for builds in 0..=2 {
            for waiting in 0..=2 {
                out.push(Occupancy {
                    usable,
                    builds,
                    waiting,
                });
            }
        }
    }
    out
}

/// Calls `check` on every (spec, warm VMs, occupancy) whose VMs fit its slots (more VMs than
/// usable slots is the state the pool exists never to reach).
fn for_every_host(mut check: impl FnMut(&PoolSpec, &[WarmVm], Occupancy)) -> usize {
    let mut cases = 0;
    for warm in every_pool() {
        for occupancy in every_occupancy() {
            if usize::from(occupancy.builds) + warm.len() > usize::from(occupancy.usable) {
                continue;
            }
            for (a, b, cold) in (0..=2).flat_map(|a| (0..=2).flat_map(move |b| (0..=2).map(move |c| (a, b, c)))) {
                check(&pool(a, b, cold), &warm, occupancy);
                cases += 1;
            }
        }
    }
    cases
}

fn refills(steps: &[PoolStep]) -> usize {
    steps.iter().filter(|s| matches!(s, PoolStep::Refill { .. })).count()
}

fn deleted(steps: &[PoolStep]) -> Vec<&str> {
    steps
        .iter()
        .filter_map(|s| match s {
            PoolStep::Delete { vm, .. } => Some(vm.as_str()),
            PoolStep::Refill { .. } => None,
        })
        .collect()
}

#[test]
fn refills_never_take_a_slot_held_or_kept_for_builds() {
    let cases = for_every_host(|spec, warm, occ| {
        let steps = plan(spec, warm, occ);
        let held = usize::from(occ.builds) + usize::from(occ.waiting) + warm.len();
        let after = held + refills(&steps);
        // A deleting VM, or one the plan deletes, still holds its slot until confirmed.
        if refills(&steps) > 0 {
            assert!(
                after + usize::from(spec.cold_slots) <= usize::from(occ.usable),
                "{spec:?} {warm:?} {occ:?}: {steps:?}"
            );
        }
    });
    assert!(cases > 30_000, "{cases} cases");
}

#[test]
fn every_expired_or_unwanted_vm_is_deleted_once_and_a_deleting_one_left_alone() {
    for_every_host(|spec, warm, occ| {
        let steps = plan(spec, warm, occ);
        let gone = deleted(&steps);
        let mut unique = gone.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), gone.len(), "deleted twice: {steps:?}");
        for vm in warm {
            let configured = spec.entries.iter().any(|e| e.profile == vm.profile && e.size > 0);
            let must_go = vm.phase != WarmPhase::Deleting && (vm.age >= MAX_IDLE || !configured);
            if must_go {
                assert!(gone.contains(&vm.name.as_str()), "{vm:?} kept: {steps:?}");
            }
            if vm.phase == WarmPhase::Deleting {
                assert!(!gone.contains(&vm.name.as_str()), "{vm:?} deleted again: {steps:?}");
            }
        }
    });
}

#[test]
fn after_the_plan_no_kind_has_more_than_its_size_and_none_fewer_while_a_slot_is_spare() {
    for_every_host(|spec, warm, occ| {
        let steps = plan(spec, warm, occ);
        let gone = deleted(&steps);
        let spare = usize::from(occ.free(warm)).saturating_sub(usize::from(spec.cold_slots)) > refills(&steps);
        for (i, entry) in spec.entries.iter().enumerate() {
            let kept = warm
                .iter()
                .filter(|vm| vm.phase != WarmPhase::Deleting && vm.profile == entry.profile)
                .filter(|vm| !gone.contains(&vm.name.as_str()))
                .count();
            let added = steps.iter().filter(|s| **s == PoolStep::Refill { entry: i }).count();
            assert!(
                kept + added <= usize::from(entry.size),
                "{spec:?} {warm:?} {occ:?}: {steps:?}"
            );
            if spare {
                assert_eq!(
                    kept + added,
                    usize::from(entry.size),
                    "{spec:?} {warm:?} {occ:?}: {steps:?}"
                );
            }
        }
    });
}

#[test]
fn refills_are_shared_between_kinds_in_turn() {
    let steps = plan(
        &pool(2, 2, 0),
        &[],
        Occupancy {
            usable: 2,
            builds: 0,
            waiting: 0,
        },
    );
    assert_eq!(steps, [PoolStep::Refill { entry: 0 }, PoolStep::Refill { entry: 1 }]);
}

#[test]
fn a_waiting_build_stops_every_refill() {
    let occ = Occupancy {
        usable: 2,
        builds: 0,
        waiting: 2,
    };
    assert_eq!(plan(&pool(2, 2, 0), &[], occ), []);
}

#[test]
fn a_lowered_size_deletes_the_youngest_first() {
    let warm = [
        vm("old", 'a', WarmPhase::Ready, 300),
        vm("young", 'a', WarmPhase::Ready, 10),
    ];
    let occ = Occupancy {
        usable: 2,
        builds: 0,
        waiting: 0,
    };
    let steps = plan(&pool(1, 0, 0), &warm, occ);
    assert_eq!(
        steps,
        [PoolStep::Delete {
            vm: "young".into(),
            why: WhyDelete::Unwanted
        }]
    );
}

#[test]
fn place_adopts_only_a_ready_vm_that_serves_and_evicts_only_when_no_slot_is_free() {
    let builds = [
        spec_for("ghcr.io/x/sonoma:latest", None, None),
        spec_for("ghcr.io/x/sequoia:15", Some(4), Some(8192)),
        spec_for("ghcr.io/x/sequoia:15", Some(2), Some(8192)),
        spec_for("ghcr.io/x/other", None, None),
    ];
    for_every_host(|_, warm, occ| {
        for build in &builds {
            let placed = place(build, warm, occ);
            let named = |name: &str| warm.iter().find(|vm| vm.name == name).unwrap();
            let can_adopt = warm
                .iter()
                .any(|vm| vm.phase == WarmPhase::Ready && vm.profile.serves(build));
            match &placed {
                Placement::Adopt(name) => {
                    let vm = named(name);
                    assert!(vm.phase == WarmPhase::Ready && vm.profile.serves(build), "{vm:?}");
                }
                Placement::Cold => assert!(!can_adopt && occ.free(warm) > 0, "{warm:?} {occ:?}"),
                Placement::Evict(name) => {
                    assert!(!can_adopt && occ.free(warm) == 0, "{warm:?} {occ:?}");
                    assert!(
                        !named(name).profile.serves(build),
                        "a VM that will serve it is waited for"
                    );
                    assert_ne!(named(name).phase, WarmPhase::Deleting);
                }
                Placement::AwaitReady(name) => {
                    assert!(!can_adopt && occ.free(warm) == 0, "{warm:?} {occ:?}");
                    let vm = named(name);
                    assert!(vm.phase == WarmPhase::Preparing && vm.profile.serves(build), "{vm:?}");
                }
                Placement::AwaitDeletion => {
                    assert!(!can_adopt && occ.free(warm) == 0);
                    assert!(warm.iter().all(|vm| vm.phase == WarmPhase::Deleting));
                }
                Placement::Full => assert!(warm.is_empty() && occ.free(warm) == 0),
            }
        }
    });
}

#[test]
fn a_build_with_shared_folders_or_other_resources_is_a_miss() {
    let a = profile('a');
    let mut with_mount = spec_for("ghcr.io/x/sonoma", None, None);
    assert!(a.serves(&with_mount));
    with_mount.mounts = vec![MountRequest { name: "cache".into() }];
    assert!(!a.serves(&with_mount));
    assert!(!profile('b').serves(&spec_for("ghcr.io/x/sequoia:15", Some(4), None)));
    assert!(profile('b').serves(&spec_for("ghcr.io/x/sequoia:15", Some(4), Some(8192))));
}

#[test]
fn eviction_prefers_a_vm_further_from_serving() {
    let occ = Occupancy {
        usable: 2,
        builds: 0,
        waiting: 0,
    };
    let build = spec_for("ghcr.io/x/sonoma", None, None);
    let warm = [
        vm("ready-other", 'b', WarmPhase::Ready, 100),
        vm("preparing-other", 'b', WarmPhase::Preparing, 5),
    ];
    assert_eq!(place(&build, &warm, occ), Placement::Evict("preparing-other".into()));
    let warm = [
        vm("preparing-same", 'a', WarmPhase::Preparing, 100),
        vm("ready-other", 'b', WarmPhase::Ready, 5),
    ];
    // Its boot is under way: waiting for it beats a cold start in the other VM's slot.
    assert_eq!(
        place(&build, &warm, occ),
        Placement::AwaitReady("preparing-same".into())
    );
    let warm = [
        vm("ready-other", 'b', WarmPhase::Ready, 5),
        vm("ready-b", 'b', WarmPhase::Ready, 9),
    ];
    assert_eq!(
        place(&build, &warm, occ),
        Placement::Evict("ready-b".into()),
        "the oldest goes"
    );
}

#[test]
fn claimable_slots_count_warm_slots_and_ready_images_only_ready_vms() {
    let occ = Occupancy {
        usable: 2,
        builds: 1,
        waiting: 0,
    };
    let warm = [vm("w", 'a', WarmPhase::Preparing, 5)];
    assert_eq!(claimable_slots(&warm, occ), 1);
    assert_eq!(ready_images(&warm), Vec::<String>::new());
    let warm = [vm("w", 'a', WarmPhase::Deleting, 5)];
    assert_eq!(claimable_slots(&warm, occ), 0);
    let warm = [vm("w", 'a', WarmPhase::Ready, 5)];
    assert_eq!(ready_images(&warm), ["ghcr.io/x/sonoma:latest"]);
}
