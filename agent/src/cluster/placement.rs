//! Which images this host holds, and when a free agent claims a build.
//!
//! # Claim order: rendezvous delays
//!
//! Every agent watches every MacBuild. Claiming the moment a build appears makes every free agent
//! write at once, and all but one get 409/422 (a thundering herd: N−1 losing writes, N−1 journal
//! records and re-reads per build). Instead each agent waits [`claim_delay`] before its first
//! claim, set by a rendezvous hash: `score(build uid, agent id) / 2⁶⁴` is uniform and independent
//! over the agents, so the free agent with the lowest score claims first. No agent knows the
//! others; the wait is bounded by `claim_spread`, so a build is never left waiting while an agent
//! is free.
//!
//! The wait is logarithmic in the score, not proportional to it. A loser is an agent whose wait
//! ends before it has seen the winner's claim (the claim's write, the watch's delivery to it:
//! tens of milliseconds, more under load). With k free agents the two lowest of k uniform scores
//! lie about 1/k apart, so a proportional wait spaces the first two claimants `spread / k` apart
//! (10 ms at 50 agents and 500 ms: ten losers per build when the watch lags 100 ms). With
//! `spread × ln(S·u) / ln S` (u the score in [0, 1), S = [`SPACED_FOR`], 0 below u = 1/S) the
//! i-th and (i+1)-th claimants lie `spread × ln((i+1)/i) / ln S` apart whatever k is: the first
//! two 62 ms at 500 ms, at 2 free agents as at 200. The price: an agent with one free rival waits
//! 0.8 × spread on average instead of half (with none it does not wait: below).
//!
//! # Claim where the image already is
//!
//! An agent whose tart cache lacks the build's image would pull it (a macOS image is tens of GB:
//! many minutes), so it adds `uncached_claim_delay` to its wait and a free host holding the image
//! wins. After that delay anyone claims: a build whose image nobody holds waits that much once, and
//! is never stranded. What the host holds comes from `tart list` (OCI cache entries, and local VMs
//! that are not build VMs); the agent also publishes it, bounded, as the annotation
//! [`IMAGES_ANNOTATION`] on its Lease.
//!
//! # No wait when nobody else could take the build
//!
//! Both waits only pay off against another agent that could take the build. Each agent publishes
//! on its Lease, besides its images, its host labels ([`HOST_LABELS_ANNOTATION`]), the namespaces
//! it serves ([`NAMESPACES_ANNOTATION`]) and its free slots ([`FREE_SLOTS_ANNOTATION`], as of its
//! last renewal), and watches the others' Leases. [`claim_wait`] keeps the spread only while
//! another live agent eligible for the build (its selector and namespace match) with a slot free
//! competes in the same window, and the uncached delay only while an eligible agent, free or busy,
//! holds the image: a lone Mac, or one whose peers are expired, excluded, or busy without the
//! image, claims at once. What a Lease does not say (an older agent, an annotation too large)
//! counts as "could take it", and before the first list of the Leases, or after the watch failed,
//! every wait is as above. So it is in a fleet of more than [`MAX_WATCHED_PEERS`] other live
//! agents: every renewal is an event for every agent watching, and there some other agent almost
//! always could take the build; such an agent lists the Leases again every minute.

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tartan_api::MacBuild;
use tartan_tart::types::VmListEntry;

/// The Lease annotation listing the images this host holds (a JSON array of strings).
pub const IMAGES_ANNOTATION: &str = "tartan.dev/images";

/// At most this many images are published (the most recently used first)…
pub const MAX_PUBLISHED_IMAGES: usize = 32;
/// …in at most this many bytes of annotation value.
pub const MAX_PUBLISHED_BYTES: usize = 4096;

/// The Lease annotation with this host's labels (`host_labels`; a JSON object of strings).
pub const HOST_LABELS_ANNOTATION: &str = "tartan.dev/host-labels";
/// The Lease annotation with the namespaces this agent serves (a JSON array; empty: all).
pub const NAMESPACES_ANNOTATION: &str = "tartan.dev/namespaces";
/// The Lease annotation with this agent's free slots at its last renewal (a decimal number).
pub const FREE_SLOTS_ANNOTATION: &str = "tartan.dev/free-slots";
/// The Lease annotation with the images this agent has a ready warm VM of (a JSON array; absent:
/// none, as for an agent without a pool).
pub const WARM_ANNOTATION: &str = "tartan.dev/warm-images";

/// The two waits before a first claim (config `timing.claim_spread` and
/// `timing.uncached_claim_delay`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimTiming {
    pub spread: Duration,
    pub uncached: Duration,
}

/// The rendezvous score of agent `agent` for build `uid`: FNV-1a over both (with a separator no
/// uid or agent id contains), finished by splitmix64's mixer so that near-identical inputs (agent
/// ids `mac-01`, `mac-02`) still land far apart. Fixed forever: every agent computes the same
/// scores.
pub fn rendezvous_score(uid: &str, agent: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in uid.bytes().chain(std::iter::once(0xff)).chain(agent.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The number of free agents per build the claim order is spaced for: below a score of
/// `2⁶⁴ / SPACED_FOR` the wait is zero, so only with more free agents than this do the first
/// claimants often go at once.
pub const SPACED_FOR: f64 = 256.0;

/// How long after a build became claimable agent `agent` waits before claiming it:
/// `spread × ln(SPACED_FOR × u) / ln(SPACED_FOR)` (0 when negative), u = score / 2⁶⁴ (see the
/// module's notes), plus `uncached` when the host does not hold the build's image. Increasing in
/// the score, and always less than `spread + uncached`.
pub fn claim_delay(uid: &str, agent: &str, holds_image: bool, timing: &ClaimTiming) -> Duration {
    let u = rendezvous_score(uid, agent) as f64 / 2f64.powi(64);
    let fraction = ((SPACED_FOR * u).ln() / SPACED_FOR.ln()).clamp(0.0, 1.0);
    // (The last score rounds to u = 1: the wait stays below the spread.)
    let ranked = timing
        .spread
        .mul_f64(fraction)
        .min(timing.spread.saturating_sub(Duration::from_nanos(1)));
    if holds_image {
        ranked
    } else {
        ranked.saturating_add(timing.uncached)
    }
}

/// What another agent's Lease says about it. `None` fields: not published (an older agent, a
/// value over [`MAX_PUBLISHED_BYTES`] or unreadable), which [`claim_wait`] reads as "could".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    /// `spec.holderIdentity`: the agent id.
    pub agent: String,
    /// `spec.renewTime` (else `acquireTime`).
    pub renewed: Option<Timestamp>,
    /// `spec.leaseDurationSeconds`.
    pub duration: Option<Duration>,
    pub images: Option<BTreeSet<String>>,
    pub host_labels: Option<BTreeMap<String, String>>,
    /// Empty: every namespace.
    pub namespaces: Option<Vec<String>>,
    pub free_slots: Option<u32>,
    /// Images it has a ready warm VM of (`None`: none published).
    pub warm: Option<BTreeSet<String>>,
}

/// The published annotation `key` of `lease`, parsed; `None` when absent, over
/// [`MAX_PUBLISHED_BYTES`] (another agent's value is read only that far) or not of type `T`.
fn annotation<T: serde::de::DeserializeOwned>(lease: &Lease, key: &str) -> Option<T> {
    let value = lease.metadata.annotations.as_ref()?.get(key)?;
    if value.len() > MAX_PUBLISHED_BYTES {
        return None;
    }
    serde_json::from_str(value).ok()
}

/// What `lease` says about its agent; `None` for a Lease nobody holds.
pub fn peer_of(lease: &Lease) -> Option<Peer> {
    let spec = lease.spec.as_ref()?;
    let agent = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
    Some(Peer {
        agent,
        renewed: spec.renew_time.as_ref().or(spec.acquire_time.as_ref()).map(|t| t.0),
        duration: spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs),
        images: annotation::<Vec<String>>(lease, IMAGES_ANNOTATION).map(|v| v.into_iter().collect()),
        host_labels: annotation(lease, HOST_LABELS_ANNOTATION),
        namespaces: annotation(lease, NAMESPACES_ANNOTATION),
        free_slots: annotation(lease, FREE_SLOTS_ANNOTATION),
        warm: annotation::<Vec<String>>(lease, WARM_ANNOTATION).map(|v| v.into_iter().collect()),
    })
}

impl Peer {
    /// Whether its Lease is live at `now` (renewed less than its duration ago; a Lease without
    /// a duration counts 20 s, the agent's default).
    pub fn live_at(&self, now: Timestamp) -> bool {
        let duration = self.duration.unwrap_or(Duration::from_secs(20));
        self.renewed.is_some_and(|at| {
            k8s_openapi::jiff::SignedDuration::try_from(duration)
                .ok()
                .and_then(|d| at.checked_add(d).ok())
                .is_none_or(|end| now < end)
        })
    }

    /// Whether it may ever claim `mb`, by what its Lease says: live, serving the namespace,
    /// matching `spec.hostSelector`. Unpublished facts count as matching.
    pub fn eligible_for(&self, mb: &MacBuild, now: Timestamp) -> bool {
        let ns = mb.metadata.namespace.as_deref().unwrap_or_default();
        let serves = self
            .namespaces
            .as_ref()
            .is_none_or(|served| served.is_empty() || served.iter().any(|n| n == ns));
        let selected = self
            .host_labels
            .as_ref()
            .is_none_or(|labels| mb.spec.host_selector.iter().all(|(k, v)| labels.get(k) == Some(v)));
        self.live_at(now) && serves && selected
    }

    /// Whether a slot was free at its last renewal (not published: may be).
    pub fn free(&self) -> bool {
        self.free_slots != Some(0)
    }

    /// Whether it may hold `image` (an unpublished list: may; a warm VM of it: does).
    pub fn may_hold(&self, image: &str) -> bool {
        let image = normalize_image(image);
        let warm_of = |key: &String| key.split(' ').next() == Some(image.as_str());
        holds_image(&image, self.images.as_ref()) || self.warm.as_ref().is_some_and(|w| w.iter().any(warm_of))
    }

    /// Whether it published a ready warm VM that serves `spec`: the same image and resources
    /// ([`WarmProfile::key`]), and the build asks for no shared folder (an unpublished list: none).
    pub fn warm_for(&self, spec: &tartan_api::MacBuildSpec) -> bool {
        let Some(key) = crate::pool::WarmProfile::key_serving(spec) else {
            return false;
        };
        self.warm.as_ref().is_some_and(|warm| warm.contains(&key))
    }
}

/// What this host has of a build's image, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holding {
    /// A ready warm VM of it: the build starts without clone or boot.
    Warm,
    /// The image in tart's cache: a clone, no pull.
    Cached,
    /// Neither: the image must be pulled first.
    Uncached,
}

/// Above this many other live agents an agent stops watching the Leases (every renewal is an
/// event for every agent: N² events) and claims as if every other agent could take each build:
/// in such a fleet one almost always can.
pub const MAX_WATCHED_PEERS: usize = 8;

/// Whether `peers` (the Leases of the Lease namespace) hold more than [`MAX_WATCHED_PEERS`] live
/// agents besides `me`, judged at [`liveness_reference`] of them and `wall`.
pub fn too_many_peers(peers: &[Peer], me: &str, wall: Timestamp) -> bool {
    let at = liveness_reference(peers, wall);
    peers.iter().filter(|p| p.agent != me && p.live_at(at)).count() > MAX_WATCHED_PEERS
}

/// The moment the Leases in `peers` (this agent's own included) are judged live at: the newest
/// renewal among them, but never after `wall` (a peer whose clock runs ahead). The watch that
/// delivers them may lag (an API server under load, a slow Mac): judged against the wall clock,
/// every peer would look expired after the Lease duration of lag and every agent would claim at
/// once. The agent's own renewals come through the same watch, so the newest renewal lags alike
/// and a peer counts as expired only when it fell behind the others.
pub fn liveness_reference(peers: &[Peer], wall: Timestamp) -> Timestamp {
    peers
        .iter()
        .filter_map(|p| p.renewed)
        .max()
        .map_or(wall, |newest| newest.min(wall))
}

/// How long agent `me` (holding the image or not: `holds`) waits before its first claim on `mb`,
/// given the agents' Leases (`peers`, its own may be among them; `None`: not known, then
/// [`claim_delay`] as before), judged live at `now` ([`liveness_reference`]).
///
/// Only other agents eligible for `mb` ([`Peer::eligible_for`]) count. The uncached delay is added
/// only when one of them may hold the image, free or busy: a busy holder is still waited for, as a
/// pull takes minutes and its slot may free within the delay (with only free holders counted, the
/// image-aware fleet bench put 6 % of its builds on agents without the image). The rendezvous
/// spread applies only when an eligible agent with a free slot competes in this agent's window:
/// any when this agent lacks the image, one that may hold it when this agent holds it (the others
/// wait the uncached delay on top of their spread). Otherwise the wait is zero.
pub fn claim_wait(
    mb: &MacBuild,
    me: &str,
    holds: bool,
    peers: Option<&[Peer]>,
    now: Timestamp,
    timing: &ClaimTiming,
) -> Duration {
    let holding = if holds { Holding::Cached } else { Holding::Uncached };
    claim_wait_holding(mb, me, holding, peers, now, timing)
}

/// [`claim_wait`] with the warm pool: a host with a ready warm VM of the image claims at once
/// (its start takes no clone and no boot); a host that holds the image cached waits at least the
/// whole spread while an eligible peer published a warm VM of it, so the warm one wins; the rest
/// is as [`claim_wait`]. No wait grows past today's bounds (`spread`, `spread + uncached`): should
/// the warm peer not claim, the build is claimed as before.
pub fn claim_wait_holding(
    mb: &MacBuild,
    me: &str,
    holding: Holding,
    peers: Option<&[Peer]>,
    now: Timestamp,
    timing: &ClaimTiming,
) -> Duration {
    if holding == Holding::Warm {
        return Duration::ZERO;
    }
    let holds = holding == Holding::Cached;
    let uid = mb.metadata.uid.as_deref().unwrap_or_default();
    let Some(peers) = peers else {
        return claim_delay(uid, me, holds, timing);
    };
    let image = &mb.spec.image;
    let eligible: Vec<&Peer> = peers
        .iter()
        .filter(|p| p.agent != me && p.eligible_for(mb, now))
        .collect();
    let contested = eligible.iter().any(|p| p.free() && (!holds || p.may_hold(image)));
    let ranked = if holds && eligible.iter().any(|p| p.warm_for(&mb.spec)) {
        timing.spread
    } else if contested {
        claim_delay(uid, me, true, timing)
    } else {
        Duration::ZERO
    };
    if !holds && eligible.iter().any(|p| p.may_hold(image)) {
        ranked.saturating_add(timing.uncached)
    } else {
        ranked
    }
}

/// The annotations this agent publishes on its Lease besides its images: host labels and
/// namespaces (each left out when over [`MAX_PUBLISHED_BYTES`]: then read as "any") and the free
/// slots.
pub fn published_facts(
    host_labels: &BTreeMap<String, String>,
    namespaces: &[String],
    free_slots: u32,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let labels = serde_json::to_string(host_labels).unwrap_or_default();
    if !labels.is_empty() && labels.len() <= MAX_PUBLISHED_BYTES {
        out.insert(HOST_LABELS_ANNOTATION.to_string(), labels);
    }
    let namespaces = serde_json::to_string(namespaces).unwrap_or_default();
    if !namespaces.is_empty() && namespaces.len() <= MAX_PUBLISHED_BYTES {
        out.insert(NAMESPACES_ANNOTATION.to_string(), namespaces);
    }
    out.insert(FREE_SLOTS_ANNOTATION.to_string(), free_slots.to_string());
    out
}

/// `image` as `tart list` names it: a registry reference without tag or digest means `:latest`
/// (tart's default); local VM names stay as they are.
pub fn normalize_image(image: &str) -> String {
    let image = image.trim();
    let Some((_, last)) = image.rsplit_once('/') else {
        return image.to_string();
    };
    if image.contains('@') || last.contains(':') {
        image.to_string()
    } else {
        format!("{image}:latest")
    }
}

/// Whether the host holds `image`, by the last listing (`None`: not listed yet, or listing
/// failed — then no wait is added: not knowing is no reason to slow every claim).
pub fn holds_image(image: &str, held: Option<&BTreeSet<String>>) -> bool {
    held.is_none_or(|held| held.contains(&normalize_image(image)))
}

/// The images in `tart list`'s entries: every OCI cache entry (by tag and by digest), and local
/// VMs except build VMs (named `vm_prefix…`); most recently accessed first.
pub fn images_of(entries: &[VmListEntry], vm_prefix: &str) -> Vec<String> {
    let mut images: Vec<&VmListEntry> = entries
        .iter()
        .filter(|e| !e.is_local() || !e.name.starts_with(vm_prefix))
        .collect();
    // Newest first; entries without an access time last, then by name for a stable order.
    images.sort_by(|a, b| b.accessed_at().cmp(&a.accessed_at()).then_with(|| a.name.cmp(&b.name)));
    let mut seen = BTreeSet::new();
    images
        .into_iter()
        .filter(|e| seen.insert(e.name.clone()))
        .map(|e| e.name.clone())
        .collect()
}

/// The annotation value for `images` (in order of preference): a JSON array of the first ones that
/// fit [`MAX_PUBLISHED_IMAGES`] and [`MAX_PUBLISHED_BYTES`].
pub fn published(images: &[String]) -> String {
    let mut kept: Vec<&str> = Vec::new();
    for image in images.iter().take(MAX_PUBLISHED_IMAGES) {
        kept.push(image);
        if serde_json::to_string(&kept).map_or(usize::MAX, |s| s.len()) > MAX_PUBLISHED_BYTES {
            kept.pop();
            break;
        }
    }
    serde_json::to_string(&kept).unwrap_or_else(|_| "[]".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn timing(spread_ms: u64, uncached_ms: u64) -> ClaimTiming {
        ClaimTiming {
            spread: Duration::from_millis(spread_ms),
            uncached: Duration::from_millis(uncached_ms),
        }
    }

    const PINNED: u64 = 13_291_832_855_455_206_376;

    fn agents(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("mac-{i:02}")).collect()
    }

    #[test]
    fn the_score_is_pinned_so_every_agent_and_version_agrees() {
        // Agents of different versions in one fleet must rank alike: the function never changes.
        assert_eq!(rendezvous_score("uid-1", "mac-mini-07"), PINNED);
        assert_ne!(rendezvous_score("uid-1", "mac-mini-08"), PINNED);
        assert_ne!(rendezvous_score("uid-2", "mac-mini-07"), PINNED);
        // The separator keeps (uid, agent) pairs apart that concatenate alike.
        assert_ne!(rendezvous_score("ab", "c"), rendezvous_score("a", "bc"));
    }

    #[test]
    fn no_spread_means_no_wait_and_the_image_delay_adds_on() {
        for a in agents(50) {
            assert_eq!(claim_delay("uid", &a, true, &timing(0, 5000)), Duration::ZERO);
            assert_eq!(claim_delay("uid", &a, false, &timing(0, 5000)), Duration::from_secs(5));
            let cached = claim_delay("uid", &a, true, &timing(500, 5000));
            assert_eq!(
                claim_delay("uid", &a, false, &timing(500, 5000)),
                cached + Duration::from_secs(5)
            );
        }
    }

    #[test]
    fn each_agent_ranks_first_for_about_its_share_of_builds() {
        // 50 agents, 20,000 builds: each should rank first for about 400 (binomial, sd ≈ 20).
        let fleet = agents(50);
        let mut firsts = vec![0u32; fleet.len()];
        for b in 0..20_000 {
            let uid = format!("0b6e{b:08x}-7d1c-4d3e-9a7b-{b:012x}");
            let first = (0..fleet.len())
                .min_by_key(|&i| rendezvous_score(&uid, &fleet[i]))
                .unwrap();
            firsts[first] += 1;
        }
        let (min, max) = (firsts.iter().min().unwrap(), firsts.iter().max().unwrap());
        assert!(*min >= 300 && *max <= 500, "first-ranked counts {firsts:?}");
    }

    #[test]
    fn delays_are_logarithmic_in_the_score() {
        // One agent over many builds: P(wait < spread × t) = SPACED_FOR^(t − 1).
        let t = timing(1000, 0);
        let n = 20_000;
        let delays: Vec<Duration> = (0..n)
            .map(|b| claim_delay(&format!("uid-{b}"), "mac-mini-07", true, &t))
            .collect();
        for (at, expected) in [(0.0, 1.0 / SPACED_FOR), (0.25, 0.0156), (0.5, 0.0625), (0.75, 0.25)] {
            let below = if at == 0.0 {
                delays.iter().filter(|d| d.is_zero()).count()
            } else {
                delays.iter().filter(|d| d.as_secs_f64() < at).count()
            };
            let share = below as f64 / n as f64;
            assert!(
                (share - expected).abs() < 0.15 * expected + 0.002,
                "below {at}: {share} (expected {expected})"
            );
        }
    }

    /// Over `builds` builds with `free` agents: the median wait of the first claimant and the
    /// median gap between the first and the second (ms, at a 500 ms spread).
    fn first_two(free: usize, builds: usize) -> (f64, f64) {
        let t = timing(500, 0);
        let fleet = agents(free);
        let (mut firsts, mut gaps) = (Vec::new(), Vec::new());
        for b in 0..builds {
            let uid = format!("0b6e{b:08x}-7d1c-4d3e-9a7b-{b:012x}");
            let mut d: Vec<f64> = fleet
                .iter()
                .map(|a| claim_delay(&uid, a, true, &t).as_secs_f64() * 1000.0)
                .collect();
            d.sort_by(f64::total_cmp);
            firsts.push(d[0]);
            gaps.push(d[1] - d[0]);
        }
        firsts.sort_by(f64::total_cmp);
        gaps.sort_by(f64::total_cmp);
        (firsts[builds / 2], gaps[builds / 2])
    }

    #[test]
    fn the_first_two_claimants_stay_apart_however_many_agents_are_free() {
        // The second claimant loses unless the first one's claim reached it (write + watch
        // delivery, tens of ms). A wait proportional to the score spaced them 500 ms / (k + 1):
        // 10 ms at 50 free agents, so most of the fleet wrote a losing claim under load.
        for free in [2, 10, 50, 100] {
            let (first, gap) = first_two(free, 2000);
            assert!(gap >= 40.0, "{free} free agents: median gap {gap:.1} ms");
            // And the first one still goes early (latency goal: p99 ≤ 1 s).
            assert!(first <= 450.0, "{free} free agents: first claim after {first:.1} ms");
        }
        let (first, _) = first_two(50, 2000);
        assert!(first <= 150.0, "50 free agents: first claim after {first:.1} ms");
    }

    proptest! {
        #[test]
        fn the_delay_is_deterministic_and_bounded(
            uid in "[a-f0-9-]{1,40}",
            agent in "[a-z0-9.-]{1,63}",
            spread_ms in 0u64..100_000,
            uncached_ms in 0u64..1_000_000,
            holds in any::<bool>(),
        ) {
            let t = timing(spread_ms, uncached_ms);
            let d = claim_delay(&uid, &agent, holds, &t);
            prop_assert_eq!(d, claim_delay(&uid, &agent, holds, &t));
            // Never waits forever: below the spread (plus the image delay, once).
            let limit = if holds { t.spread } else { t.spread + t.uncached };
            prop_assert!(d <= limit);
            if spread_ms > 0 {
                prop_assert!(d < limit);
            }
            // Holding the image never makes an agent slower.
            prop_assert!(claim_delay(&uid, &agent, true, &t) <= claim_delay(&uid, &agent, false, &t));
        }

        #[test]
        fn a_holder_free_within_the_window_always_goes_before_any_non_holder(
            uid in "[a-f0-9-]{1,40}",
            holder in "[a-z0-9]{1,20}",
            other in "[a-z0-9]{1,20}",
            spread_ms in 0u64..10_000,
        ) {
            // uncached_claim_delay at least the spread: the holder's whole window ends first.
            let t = timing(spread_ms, spread_ms);
            prop_assert!(claim_delay(&uid, &holder, true, &t) <= claim_delay(&uid, &other, false, &t));
        }
    }

    const IMG: &str = "ghcr.io/x/y:16";

    fn build(uid: &str, selector: &[(&str, &str)]) -> MacBuild {
        let mut mb = MacBuild::new(
            "b",
            tartan_api::MacBuildSpec {
                host_selector: selector.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                ..tartan_api::MacBuildSpec::new(IMG, vec![tartan_api::Step::new("s", vec!["true".into()])])
            },
        );
        mb.metadata.namespace = Some("ci".into());
        mb.metadata.uid = Some(uid.into());
        mb
    }

    fn now() -> Timestamp {
        "2026-10-05T03:00:00Z".parse().unwrap()
    }

    /// A current agent's Lease, renewed 2 s ago with 20 s, free, serving every namespace,
    /// `xcode=16`, holding `IMG` or not.
    fn peer(agent: &str, holds: bool) -> Peer {
        Peer {
            agent: agent.into(),
            renewed: Some(now() - k8s_openapi::jiff::SignedDuration::from_secs(2)),
            duration: Some(Duration::from_secs(20)),
            images: Some(if holds {
                [IMG.to_string()].into()
            } else {
                BTreeSet::new()
            }),
            host_labels: Some([("xcode".to_string(), "16".to_string())].into()),
            namespaces: Some(vec![]),
            free_slots: Some(2),
            warm: None,
        }
    }

    fn with(mut p: Peer, f: impl FnOnce(&mut Peer)) -> Peer {
        f(&mut p);
        p
    }

    #[test]
    fn a_claim_waits_only_for_another_agent_that_could_take_the_build_now() {
        let t = timing(500, 5000);
        let uid = "0b6e0001-7d1c-4d3e-9a7b-000000000001";
        let mb = build(uid, &[("xcode", "16")]);
        let spread = claim_delay(uid, "me", true, &t);
        assert!(spread > Duration::ZERO, "the table needs a non-zero rank: {spread:?}");
        let uncached = spread + t.uncached;
        let expired = |p| {
            with(p, |p| {
                p.renewed = Some(now() - k8s_openapi::jiff::SignedDuration::from_secs(20))
            })
        };
        let full = |p| with(p, |p| p.free_slots = Some(0));
        let excluded = |p| {
            with(p, |p| {
                p.host_labels = Some([("xcode".to_string(), "15".to_string())].into())
            })
        };
        let elsewhere = |p| with(p, |p| p.namespaces = Some(vec!["other".into()]));
        let older = |p: Peer| Peer {
            agent: p.agent,
            renewed: p.renewed,
            duration: p.duration,
            ..Peer::default()
        };
        let many =
            |holders: usize| -> Vec<Peer> { (0..49).map(|i| peer(&format!("mac-{i:02}"), i < holders)).collect() };
        #[rustfmt::skip]
        let table: Vec<(&str, Vec<Peer>, Duration, Duration)> = vec![
            // (case, other agents' Leases, wait holding the image, wait without it)
            ("alone", vec![], Duration::ZERO, Duration::ZERO),
            ("only its own Lease", vec![peer("me", true)], Duration::ZERO, Duration::ZERO),
            ("the other holds it but is full: waited for, without a spread", vec![full(peer("b", true))], Duration::ZERO, t.uncached),
            ("the other is full without it", vec![full(peer("b", false))], Duration::ZERO, Duration::ZERO),
            ("the other holds it but expired", vec![expired(peer("b", true))], Duration::ZERO, Duration::ZERO),
            ("the other holds it but its labels do not match", vec![excluded(peer("b", true))], Duration::ZERO, Duration::ZERO),
            ("the other holds it but serves other namespaces", vec![elsewhere(peer("b", true))], Duration::ZERO, Duration::ZERO),
            ("the other is free and holds it", vec![peer("b", true)], spread, uncached),
            ("the other is free without it", vec![peer("b", false)], Duration::ZERO, spread),
            ("an older agent publishing nothing: may take it", vec![older(peer("b", false))], spread, uncached),
            ("49 others, 3 holding it", many(3), spread, uncached),
            ("49 others, none holding it", many(0), Duration::ZERO, spread),
            ("49 others, the 3 holding it full", {
                let mut v = many(3);
                for p in &mut v[..3] { p.free_slots = Some(0); }
                v
            }, Duration::ZERO, uncached),
            ("49 others, all full or expired", many(49).into_iter().enumerate()
                .map(|(i, p)| if i % 2 == 0 { full(p) } else { expired(p) }).collect(), Duration::ZERO, t.uncached),
            ("49 others without it, all full or expired", many(0).into_iter().enumerate()
                .map(|(i, p)| if i % 2 == 0 { full(p) } else { expired(p) }).collect(), Duration::ZERO, Duration::ZERO),
        ];
        for (case, peers, cached_wait, uncached_wait) in table {
            assert_eq!(
                claim_wait(&mb, "me", true, Some(&peers), now(), &t),
                cached_wait,
                "{case}, holding the image"
            );
            assert_eq!(
                claim_wait(&mb, "me", false, Some(&peers), now(), &t),
                uncached_wait,
                "{case}, without the image"
            );
        }
        // Before the Leases are listed (or while their watch fails): the waits as before.
        for holds in [true, false] {
            assert_eq!(
                claim_wait(&mb, "me", holds, None, now(), &t),
                claim_delay(uid, "me", holds, &t)
            );
        }
        // A build without a selector excludes nobody by labels.
        let open = build(uid, &[]);
        assert_eq!(
            claim_wait(&open, "me", false, Some(&[excluded(peer("b", true))]), now(), &t),
            uncached
        );
    }

    #[test]
    fn leases_are_judged_live_against_the_newest_renewal_the_watch_delivered() {
        let t = timing(500, 5000);
        let uid = "0b6e0001-7d1c-4d3e-9a7b-000000000001";
        let mb = build(uid, &[("xcode", "16")]);
        let secs = k8s_openapi::jiff::SignedDuration::from_secs;
        let at = |p: Peer, ago: i64| with(p, |p| p.renewed = Some(now() - secs(ago)));
        // The watch lags 30 s: this agent's own Lease and a free holder's were renewed 30-31 s
        // before the wall clock says. Judged at the wall clock both look expired (claim at once,
        // with every other agent); judged at the newest renewal the holder is live.
        let lagging = [at(peer("me", false), 30), at(peer("b", true), 31)];
        let reference = liveness_reference(&lagging, now());
        assert_eq!(reference, now() - secs(30));
        assert_eq!(
            claim_wait(&mb, "me", false, Some(&lagging), reference, &t),
            claim_delay(uid, "me", true, &t) + t.uncached
        );
        assert_eq!(claim_wait(&mb, "me", false, Some(&lagging), now(), &t), Duration::ZERO);
        // A peer that fell behind the others by its duration is expired.
        let dead = [at(peer("me", false), 30), at(peer("b", true), 50)];
        let reference = liveness_reference(&dead, now());
        assert_eq!(claim_wait(&mb, "me", false, Some(&dead), reference, &t), Duration::ZERO);
        // A peer whose clock runs ahead does not move the reference past the wall clock.
        assert_eq!(liveness_reference(&[at(peer("b", true), -60)], now()), now());
        assert_eq!(liveness_reference(&[], now()), now());
    }

    #[test]
    fn past_the_watched_fleet_size_the_leases_are_not_watched() {
        let secs = k8s_openapi::jiff::SignedDuration::from_secs;
        let fleet = |live: usize, dead: usize| -> Vec<Peer> {
            let mut v = vec![peer("me", true)];
            v.extend((0..live).map(|i| peer(&format!("live-{i}"), true)));
            v.extend((0..dead).map(|i| with(peer(&format!("dead-{i}"), true), |p| p.renewed = Some(now() - secs(60)))));
            v
        };
        assert!(!too_many_peers(&fleet(0, 0), "me", now()));
        assert!(
            !too_many_peers(&fleet(MAX_WATCHED_PEERS, 40), "me", now()),
            "expired Leases do not count"
        );
        assert!(too_many_peers(&fleet(MAX_WATCHED_PEERS + 1, 0), "me", now()));
    }

    #[test]
    fn what_an_agent_publishes_reads_back_from_its_lease() {
        use k8s_openapi::api::coordination::v1::LeaseSpec;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
        let labels: BTreeMap<String, String> = [("xcode".to_string(), "16".to_string())].into();
        let mut annotations = published_facts(&labels, &["ci".to_string()], 1);
        annotations.insert(IMAGES_ANNOTATION.into(), published(&[IMG.to_string()]));
        let mut lease = Lease {
            metadata: kube::api::ObjectMeta {
                annotations: Some(annotations),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some("mac-b".into()),
                renew_time: Some(MicroTime(now())),
                lease_duration_seconds: Some(20),
                ..Default::default()
            }),
        };
        assert_eq!(
            peer_of(&lease),
            Some(Peer {
                agent: "mac-b".into(),
                renewed: Some(now()),
                duration: Some(Duration::from_secs(20)),
                images: Some([IMG.to_string()].into()),
                host_labels: Some(labels.clone()),
                namespaces: Some(vec!["ci".into()]),
                free_slots: Some(1),
                warm: None,
            })
        );
        let p = peer_of(&lease).unwrap();
        assert!(p.live_at(now() + k8s_openapi::jiff::SignedDuration::from_secs(19)));
        assert!(!p.live_at(now() + k8s_openapi::jiff::SignedDuration::from_secs(20)));
        // Unreadable or oversized values are not published facts; a Lease nobody holds is no agent.
        let a = lease.metadata.annotations.as_mut().unwrap();
        a.insert(FREE_SLOTS_ANNOTATION.into(), "many".into());
        a.insert(
            HOST_LABELS_ANNOTATION.into(),
            format!(r#"{{"k":"{}"}}"#, "v".repeat(MAX_PUBLISHED_BYTES)),
        );
        let p = peer_of(&lease).unwrap();
        assert_eq!((p.free_slots, p.host_labels), (None, None));
        lease.spec.as_mut().unwrap().holder_identity = None;
        assert_eq!(peer_of(&lease), None);
        // Labels too large to publish are left out (read as "any"), the free slots always go.
        let huge: BTreeMap<String, String> = [("k".to_string(), "v".repeat(MAX_PUBLISHED_BYTES))].into();
        let facts = published_facts(&huge, &[], 0);
        assert!(!facts.contains_key(HOST_LABELS_ANNOTATION));
        assert_eq!(facts[NAMESPACES_ANNOTATION], "[]");
        assert_eq!(facts[FREE_SLOTS_ANNOTATION], "0");
    }

    #[test]
    fn images_are_named_as_tart_lists_them() {
        assert_eq!(
            normalize_image("ghcr.io/cirruslabs/macos-sequoia-xcode"),
            "ghcr.io/cirruslabs/macos-sequoia-xcode:latest"
        );
        assert_eq!(
            normalize_image("ghcr.io/cirruslabs/macos-sequoia-xcode:16"),
            "ghcr.io/cirruslabs/macos-sequoia-xcode:16"
        );
        assert_eq!(normalize_image("localhost:5000/macos"), "localhost:5000/macos:latest");
        assert_eq!(normalize_image("ghcr.io/x/y@sha256:ab"), "ghcr.io/x/y@sha256:ab");
        assert_eq!(normalize_image("sequoia-base"), "sequoia-base");
        let held: BTreeSet<String> = ["ghcr.io/x/y:latest".to_string(), "base".to_string()].into();
        assert!(holds_image("ghcr.io/x/y", Some(&held)));
        assert!(holds_image("base", Some(&held)));
        assert!(!holds_image("ghcr.io/x/y:16", Some(&held)));
        assert!(!holds_image("ghcr.io/x/z", Some(&BTreeSet::new())));
        // Not listed yet: no wait.
        assert!(holds_image("ghcr.io/x/z", None));
    }

    fn entry(source: &str, name: &str, accessed: Option<&str>) -> VmListEntry {
        VmListEntry {
            source: source.into(),
            name: name.into(),
            disk: 50,
            size: 20,
            accessed: accessed.map(str::to_string),
            running: false,
            state: tartan_tart::types::VmState::Stopped,
        }
    }

    #[test]
    fn held_images_are_cache_entries_and_local_vms_other_than_build_vms() {
        let entries = [
            entry("local", "mb-ci-b-1234-a1", Some("2026-01-03T00:00:00Z")),
            entry("local", "sequoia-base", Some("2026-01-01T00:00:00Z")),
            entry("OCI", "ghcr.io/x/y:16", Some("2026-01-02T00:00:00Z")),
            entry("OCI", "ghcr.io/x/y@sha256:ab", Some("2026-01-02T00:00:00Z")),
            entry("OCI", "ghcr.io/x/old:1", None),
        ];
        assert_eq!(
            images_of(&entries, "mb-"),
            [
                "ghcr.io/x/y:16",
                "ghcr.io/x/y@sha256:ab",
                "sequoia-base",
                "ghcr.io/x/old:1"
            ]
        );
    }

    #[test]
    fn a_warm_host_claims_at_once_and_a_cached_one_leaves_it_the_whole_spread() {
        let t = timing(500, 30_000);
        let mb = build("u-warm", &[]);
        let wait = |holding, peers: &[Peer]| claim_wait_holding(&mb, "me", holding, Some(peers), now(), &t);
        // Warm, with a list of images that no longer names it (it is bounded): still a holder.
        let warm = Peer {
            warm: Some([IMG.to_string()].into()),
            ..peer("b", false)
        };
        for peers in [vec![], vec![peer("b", true)], vec![warm.clone()]] {
            assert_eq!(wait(Holding::Warm, &peers), Duration::ZERO, "{peers:?}");
        }
        assert_eq!(
            claim_wait_holding(&mb, "me", Holding::Warm, None, now(), &t),
            Duration::ZERO
        );
        assert_eq!(wait(Holding::Cached, std::slice::from_ref(&warm)), t.spread);
        let against_a_holder = claim_wait(&mb, "me", false, Some(&[peer("b", true)]), now(), &t);
        assert_eq!(wait(Holding::Uncached, std::slice::from_ref(&warm)), against_a_holder);
        // A warm VM of another image, or a warm peer that expired, changes nothing.
        let other = Peer {
            warm: Some(["ghcr.io/x/other:1".to_string()].into()),
            ..peer("b", false)
        };
        let gone = Peer {
            renewed: Some(now() - k8s_openapi::jiff::SignedDuration::from_secs(60)),
            ..warm.clone()
        };
        for (holding, holds) in [(Holding::Cached, true), (Holding::Uncached, false)] {
            let before = claim_wait(&mb, "me", holds, Some(&[peer("b", false)]), now(), &t);
            assert_eq!(wait(holding, std::slice::from_ref(&other)), before);
            assert_eq!(wait(holding, std::slice::from_ref(&gone)), Duration::ZERO);
        }
        // Never beyond today's bounds, whoever is warm.
        for peers in [vec![warm.clone(), peer("c", true)], vec![warm.clone(), other.clone()]] {
            assert!(wait(Holding::Cached, &peers) <= t.spread);
            assert!(wait(Holding::Uncached, &peers) <= t.spread + t.uncached);
        }
    }

    #[test]
    fn a_published_warm_list_is_read_and_an_absent_one_means_none() {
        let mut lease = Lease {
            spec: Some(k8s_openapi::api::coordination::v1::LeaseSpec {
                holder_identity: Some("mac-1".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(peer_of(&lease).unwrap().warm, None);
        let spec = |image: &str| tartan_api::MacBuildSpec::new(image, Vec::new());
        assert!(!peer_of(&lease).unwrap().warm_for(&spec(IMG)));
        lease.metadata.annotations = Some([(WARM_ANNOTATION.to_string(), format!(r#"["{IMG}"]"#))].into());
        assert!(peer_of(&lease).unwrap().warm_for(&spec("ghcr.io/x/y:16")));
        assert!(!peer_of(&lease).unwrap().warm_for(&spec("ghcr.io/x/y:15")));
        // Other resources, or shared folders: that warm VM cannot serve it.
        let mut sized = spec("ghcr.io/x/y:16");
        sized.resources = Some(tartan_api::Resources {
            cpu: Some(4),
            memory_mib: None,
        });
        assert!(!peer_of(&lease).unwrap().warm_for(&sized));
        lease.metadata.annotations = Some([(WARM_ANNOTATION.to_string(), format!(r#"["{IMG} cpu=4"]"#))].into());
        assert!(peer_of(&lease).unwrap().warm_for(&sized));
        assert!(
            peer_of(&lease).unwrap().may_hold(IMG),
            "a warm VM of it holds the image"
        );
        sized.mounts = vec![tartan_api::crd::MountRequest { name: "cache".into() }];
        assert!(!peer_of(&lease).unwrap().warm_for(&sized));
    }

    #[test]
    fn the_published_list_is_bounded_in_count_and_bytes() {
        assert_eq!(published(&[]), "[]");
        assert_eq!(published(&["a".into(), "b".into()]), r#"["a","b"]"#);
        let many: Vec<String> = (0..100).map(|i| format!("ghcr.io/x/image-{i}:1")).collect();
        let list: Vec<String> = serde_json::from_str(&published(&many)).unwrap();
        assert_eq!(list, many[..MAX_PUBLISHED_IMAGES]);
        let long: Vec<String> = (0..20).map(|i| format!("ghcr.io/{}/{i}:1", "x".repeat(500))).collect();
        let value = published(&long);
        assert!(value.len() <= MAX_PUBLISHED_BYTES, "{}", value.len());
        let list: Vec<String> = serde_json::from_str(&value).unwrap();
        assert_eq!(list, long[..list.len()]);
        assert!(!list.is_empty());
    }
}
