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
//! two 62 ms at 500 ms, at 2 free agents as at 200. The price: a lone free agent waits
//! 0.8 × spread on average instead of half.
//!
//! # Claim where the image already is
//!
//! An agent whose tart cache lacks the build's image would pull it (a macOS image is tens of GB:
//! many minutes), so it adds `uncached_claim_delay` to its wait and a free host holding the image
//! wins. After that delay anyone claims: a build whose image nobody holds waits that much once, and
//! is never stranded. What the host holds comes from `tart list` (OCI cache entries, and local VMs
//! that are not build VMs); the agent also publishes it, bounded, as the annotation
//! [`IMAGES_ANNOTATION`] on its Lease.

use std::collections::BTreeSet;
use std::time::Duration;
use tartan_tart::types::VmListEntry;

/// The Lease annotation listing the images this host holds (a JSON array of strings).
pub const IMAGES_ANNOTATION: &str = "tartan.dev/images";

/// At most this many images are published (the most recently used first)…
pub const MAX_PUBLISHED_IMAGES: usize = 32;
/// …in at most this many bytes of annotation value.
pub const MAX_PUBLISHED_BYTES: usize = 4096;

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
