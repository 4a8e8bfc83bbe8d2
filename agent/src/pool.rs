//! The warm pool's decisions, apart from any I/O: which warm VMs to delete or refill, and where a
//! claimed build runs (a warm VM it adopts, a free slot, or a slot a warm VM must give up first).
//!
//! A warm VM is a build VM booted ahead of a request. It holds a slot like any build VM, so the
//! host's "never more VMs than slots" holds with the pool on, and a slot a warm VM held is reused
//! only after that VM's deletion is confirmed (a deleting warm VM still holds its slot here). It
//! serves at most one build and is deleted after it, so nothing of one build reaches the next.
//!
//! What a warm VM can serve is fixed when it is cloned and booted: the image, the CPU and memory
//! (`tart set` before the boot), and the shared folders (`tart run` arguments). A warm VM is booted
//! with no shared folder, so only a build that asks for none can adopt it; the network is the
//! host's for every VM alike.
//!
//! Builds win over refills: no refill takes a slot while a claimed build waits for one, and a
//! configured number of slots (`cold_slots`) is never filled by the pool.

use std::time::Duration;
use tartan_api::MacBuildSpec;

use crate::cluster::placement::normalize_image;

/// What one kind of warm VM is: an image with the resources it is set to before its boot.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WarmProfile {
    /// As `tart list` names it ([`normalize_image`]).
    pub image: String,
    /// Virtual CPUs (`None`: the image's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<u32>,
    /// Memory in MiB (`None`: the image's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
}

impl WarmProfile {
    pub fn new(image: &str, cpu: Option<u32>, memory_mib: Option<u32>) -> Self {
        WarmProfile {
            image: normalize_image(image),
            cpu,
            memory_mib,
        }
    }

    /// How a ready VM of this profile is published on the Lease (`tartan.dev/warm-images`): the
    /// image, then the resources it was set to, if any (`<image> cpu=4 memory_mib=8192`).
    pub fn key(&self) -> String {
        let mut key = self.image.clone();
        if let Some(cpu) = self.cpu {
            key.push_str(&format!(" cpu={cpu}"));
        }
        if let Some(memory) = self.memory_mib {
            key.push_str(&format!(" memory_mib={memory}"));
        }
        key
    }

    /// The key a warm VM serving `spec` is published under, or `None` when none can serve it
    /// (it asks for shared folders).
    pub fn key_serving(spec: &MacBuildSpec) -> Option<String> {
        let resources = spec.resources.clone().unwrap_or_default();
        (spec.mounts.is_empty() && warm_spelling(&spec.image))
            .then(|| WarmProfile::new(&spec.image, resources.cpu, resources.memory_mib).key())
    }

    /// Whether a VM of this profile can run the build `spec` unchanged: the same image and
    /// resources, and no shared folder asked for.
    pub fn serves(&self, spec: &MacBuildSpec) -> bool {
        let resources = spec.resources.clone().unwrap_or_default();
        warm_spelling(&spec.image)
            && normalize_image(&spec.image) == self.image
            && resources.cpu == self.cpu
            && resources.memory_mib == self.memory_mib
            && spec.mounts.is_empty()
    }
}

/// Whether a build's image, as written, may meet a warm VM: its start (`check_image`) accepts it
/// whatever the local images, and it reads as a profile key (whose parts are space-separated).
/// Written exactly as `tart list` names it, it is a profile's image only if the config accepted
/// that (a local image included); any other spelling must be a registry reference on its own:
/// `org/base` normalises to a local `org/base:latest`, but its start refuses it.
fn warm_spelling(image: &str) -> bool {
    let plain = !image.is_empty() && !image.chars().any(char::is_whitespace);
    plain && (image == normalize_image(image) || tartan_api::names::check_image(image, &[]).is_ok())
}

/// One `[pool]` entry: keep `size` warm VMs of `profile`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolEntry {
    pub profile: WarmProfile,
    pub size: u8,
}

/// The pool as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSpec {
    pub entries: Vec<PoolEntry>,
    /// A warm VM this old (counted from its clone) is deleted and replaced.
    pub max_idle: Duration,
    /// Slots the pool never fills, kept for builds no warm VM serves.
    pub cold_slots: u8,
}

/// Where a warm VM is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarmPhase {
    /// Cloned, being set up or booting: it holds a slot but serves no build yet.
    Preparing,
    /// Booted and answering: a build may adopt it.
    Ready,
    /// Its deletion was asked for and is not confirmed: it still holds its slot.
    Deleting,
}

/// A warm VM as the agent's journal knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarmVm {
    pub name: String,
    pub profile: WarmProfile,
    pub phase: WarmPhase,
    /// Time since its clone began.
    pub age: Duration,
}

/// The host's slots apart from the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Occupancy {
    /// Slots VMs may use (a Mac runs at most two VMs).
    pub usable: u8,
    /// Slots held for builds (their VMs, or a build VM whose deletion is not confirmed).
    pub builds: u8,
    /// Claimed builds waiting for a slot (each will take one before any refill).
    pub waiting: u8,
}

impl Occupancy {
    /// Slots neither a build, a waiting build nor any warm VM in `warm` holds.
    pub fn free(&self, warm: &[WarmVm]) -> u8 {
        let held = usize::from(self.builds) + usize::from(self.waiting) + warm.len();
        u8::try_from(usize::from(self.usable).saturating_sub(held)).unwrap_or(0)
    }
}

/// Why the pool deletes a warm VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhyDelete {
    /// It waited `max_idle` without a build.
    Expired,
    /// The configuration no longer asks for it (entry gone, or fewer of its kind).
    Unwanted,
}

/// One thing the pool should do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolStep {
    Delete {
        vm: String,
        why: WhyDelete,
    },
    /// Clone and boot one more warm VM of `spec.entries[entry]`.
    Refill {
        entry: usize,
    },
}

/// What the pool should do given its VMs (`warm`) and the host's other slots: delete what expired
/// or is no longer wanted, then refill entries short of their size, one VM per entry in turn, while
/// a slot beyond `cold_slots` is free. Deleting VMs are left alone (their deletion is under way)
/// and refills never count on a slot a deletion will free: it is free once confirmed.
pub fn plan(spec: &PoolSpec, warm: &[WarmVm], occupancy: Occupancy) -> Vec<PoolStep> {
    let mut steps = Vec::new();
    let mut kept: Vec<Vec<&WarmVm>> = vec![Vec::new(); spec.entries.len()];
    for vm in warm.iter().filter(|vm| vm.phase != WarmPhase::Deleting) {
        let entry = spec.entries.iter().position(|e| e.profile == vm.profile);
        match entry {
            _ if vm.age >= spec.max_idle => steps.push(delete(vm, WhyDelete::Expired)),
            Some(i) => kept[i].push(vm),
            None => steps.push(delete(vm, WhyDelete::Unwanted)),
        }
    }
    let mut deficits = Vec::with_capacity(spec.entries.len());
    for (entry, vms) in spec.entries.iter().zip(&mut kept) {
        // Too many of a kind (the size was lowered): the youngest go, the oldest serve first.
        vms.sort_by_key(|vm| std::cmp::Reverse(vm.age));
        for vm in vms.iter().skip(usize::from(entry.size)) {
            steps.push(delete(vm, WhyDelete::Unwanted));
        }
        deficits.push(usize::from(entry.size).saturating_sub(vms.len()));
    }
    let mut free = usize::from(occupancy.free(warm).saturating_sub(spec.cold_slots));
    while free > 0 && deficits.iter().any(|&d| d > 0) {
        for (entry, deficit) in deficits.iter_mut().enumerate() {
            if free > 0 && *deficit > 0 {
                steps.push(PoolStep::Refill { entry });
                *deficit -= 1;
                free -= 1;
            }
        }
    }
    steps
}

fn delete(vm: &WarmVm, why: WhyDelete) -> PoolStep {
    PoolStep::Delete {
        vm: vm.name.clone(),
        why,
    }
}

/// Where a claimed build runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// In this ready warm VM: no clone, no boot.
    Adopt(String),
    /// Cold, in a free slot.
    Cold,
    /// Cold, in the slot of this warm VM, once its deletion is confirmed.
    Evict(String),
    /// In this warm VM once it is ready: it serves the build and is booting, no slot is free,
    /// and its boot ends sooner than a cold start anywhere would.
    AwaitReady(String),
    /// Cold, in the slot a deleting warm VM frees once its deletion is confirmed.
    AwaitDeletion,
    /// No slot now: builds hold them all.
    Full,
}

/// Where the build `spec` runs, given the pool's VMs and the host's other slots (`occupancy`
/// without this build). A ready VM that serves it is adopted, the oldest first (it would expire
/// first); else a free slot; else one that serves it and is booting is waited for (its boot began
/// before any cold start could); else a warm VM gives its slot up: one still preparing before a
/// ready one (it is further from serving), the oldest first.
pub fn place(spec: &MacBuildSpec, warm: &[WarmVm], occupancy: Occupancy) -> Placement {
    let oldest = |phase: WarmPhase, serving: bool| {
        warm.iter()
            .filter(|vm| vm.phase == phase && vm.profile.serves(spec) == serving)
            .max_by_key(|vm| vm.age)
    };
    if let Some(vm) = oldest(WarmPhase::Ready, true) {
        return Placement::Adopt(vm.name.clone());
    }
    if occupancy.free(warm) > 0 {
        return Placement::Cold;
    }
    if let Some(vm) = oldest(WarmPhase::Preparing, true) {
        return Placement::AwaitReady(vm.name.clone());
    }
    let victim = [(WarmPhase::Preparing, false), (WarmPhase::Ready, false)]
        .into_iter()
        .find_map(|(phase, serving)| oldest(phase, serving));
    match victim {
        Some(vm) => Placement::Evict(vm.name.clone()),
        None if warm.iter().any(|vm| vm.phase == WarmPhase::Deleting) => Placement::AwaitDeletion,
        None => Placement::Full,
    }
}

/// The slots a build could be placed in now, warm ones included (each warm VM gives its slot up
/// to a build): what the host publishes as free for other agents' claim waits.
pub fn claimable_slots(warm: &[WarmVm], occupancy: Occupancy) -> u8 {
    let evictable = warm.iter().filter(|vm| vm.phase != WarmPhase::Deleting).count();
    let free = usize::from(occupancy.free(warm)) + evictable;
    u8::try_from(free).unwrap_or(u8::MAX)
}

/// What this host has a ready warm VM of, for its Lease: each profile's [`WarmProfile::key`].
pub fn ready_images(warm: &[WarmVm]) -> Vec<String> {
    let mut images: Vec<String> = warm
        .iter()
        .filter(|vm| vm.phase == WarmPhase::Ready)
        .map(|vm| vm.profile.key())
        .collect();
    images.sort();
    images.dedup();
    images
}

#[cfg(test)]
mod tests;
