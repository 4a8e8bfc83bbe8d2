//! Adversary round 14: `WarmProfile::serves` / `key_serving` after the whitespace refusal, and a
//! peer's `tartan.dev/warm-images` keys. `..._held_...` tests guard attacks that failed; FINDING
//! tests fail on the current tree.

mod pool_common;

use tartan_agent::cluster::placement::{WARM_ANNOTATION, peer_of};
use tartan_agent::pool::WarmProfile;
use tartan_api::{MacBuildSpec, Resources};

const IMAGE: &str = "ghcr.io/cirruslabs/macos-sequoia-xcode:16";

fn spec(image: &str, cpu: Option<u32>, memory_mib: Option<u32>) -> MacBuildSpec {
    let mut s = MacBuildSpec::new(image, Vec::new());
    if cpu.is_some() || memory_mib.is_some() {
        s.resources = Some(Resources { cpu, memory_mib });
    }
    s
}

fn hostile_spellings(base: &str) -> Vec<String> {
    let mut v = Vec::new();
    for ws in [
        '\t', '\n', '\r', '\u{0b}', '\u{0c}', '\u{85}', '\u{a0}', '\u{1680}', '\u{2000}', '\u{2007}', '\u{2028}',
        '\u{2029}', '\u{202f}', '\u{205f}', '\u{3000}', ' ',
    ] {
        v.push(format!("{base}{ws}"));
        v.push(format!("{ws}{base}"));
        v.push(format!("{base}{ws}cpu=4"));
    }
    for odd in ['\0', '\u{1}', '\u{7f}', '\u{200b}', '\u{feff}', '\u{200e}', '\u{2060}'] {
        v.push(format!("{base}{odd}"));
        v.push(format!("{odd}{base}"));
    }
    v.push(base.to_uppercase());
    v.push(format!("{base}:latest"));
    v.push(format!("{base}@sha256:{}", "a".repeat(64)));
    v.push(format!("{}{base}", "x".repeat(600)));
    v.push("a".repeat(100_000));
    v.push(String::new());
    v
}

/// A warm VM may be taken only by a build the start checks would let run: `serves` ⇒ `check_image`.
fn assert_serves_implies_check(profile_image: &str, local: &[String], spelling: &str) -> Result<(), String> {
    let p = WarmProfile::new(profile_image, None, None);
    tartan_api::names::check_image(&p.image, local).map_err(|e| format!("profile itself refused: {e}"))?;
    let s = spec(spelling, None, None);
    if p.serves(&s)
        && let Err(e) = tartan_api::names::check_image(spelling, local)
    {
        return Err(format!(
            "{spelling:?} adopts a warm VM of {:?} but its start refuses it: {e}",
            p.image
        ));
    }
    Ok(())
}

#[test]
fn pool14_held_hostile_spellings_never_serve_a_refused_registry_build() {
    for base in [IMAGE, "ghcr.io/x/y", "localhost:5000/x/y", "localhost/y"] {
        for s in hostile_spellings(base) {
            assert_serves_implies_check(base, &[], &s).unwrap();
            // The peer key agrees with `serves` (no key for an image refused for whitespace).
            let p = WarmProfile::new(base, None, None);
            let sp = spec(&s, None, None);
            assert_eq!(
                p.serves(&sp),
                WarmProfile::key_serving(&sp).as_deref() == Some(p.key().as_str()),
                "{s:?}"
            );
            if s.chars().any(char::is_whitespace) {
                assert!(WarmProfile::key_serving(&sp).is_none(), "{s:?}");
            }
        }
    }
}

#[test]
fn pool14_held_local_image_without_slash() {
    let local = vec!["sequoia-base".to_string()];
    for s in hostile_spellings("sequoia-base") {
        assert_serves_implies_check("sequoia-base", &local, &s).unwrap();
    }
}

/// FINDING (low): the ":latest" elision lets a build adopt a warm VM that its own start refuses.
/// Operator config: `local_images = ["org/base:latest"]`, `[[pool.images]] image = "org/base:latest"`
/// (config accepts it: the profile passes `check_image` through the local list). A MacBuild with
/// `spec.image = "org/base"` normalizes to "org/base:latest", so `serves` is true and `place` adopts
/// the ready warm VM; then `write_deadline`'s `check_image("org/base", local)` refuses it (not in the
/// local list, "org" is no registry host). The warm VM is spent on a build that is refused: the same
/// class as the whitespace case this change fixed (a refused image must not take a warm VM first).
/// Requires a local VM name containing '/', which tart may not allow — hence low.
/// Fixed: `serves` takes a spelling other than the profile's exact image only when `check_image`
/// accepts it with no local images.
#[test]
fn pool14_finding_latest_elision_adopts_for_a_refused_local_image() {
    let local = vec!["org/base:latest".to_string()];
    assert_serves_implies_check("org/base:latest", &local, "org/base").unwrap();
}

fn warm_peer(keys: &[&str]) -> tartan_agent::cluster::placement::Peer {
    let lease = pool_common::lease("peer", &[(WARM_ANNOTATION, serde_json::to_string(keys).unwrap())]);
    peer_of(&lease).unwrap()
}

#[test]
fn pool14_held_peer_keys_cannot_spoof_another_profile() {
    let spoofs = [
        format!("{IMAGE}\tcpu=4"),
        format!("{IMAGE}  cpu=4"),
        format!("{IMAGE} cpu=4 "),
        format!(" {IMAGE} cpu=4"),
        format!("{IMAGE} cpu=04"),
        format!("{IMAGE} cpu=+4"),
        format!("{IMAGE} memory_mib=8192 cpu=4"),
        format!("{IMAGE}\u{a0}cpu=4"),
        format!("{IMAGE} cpu=4\0"),
        IMAGE.to_uppercase() + " cpu=4",
    ];
    let refs: Vec<&str> = spoofs.iter().map(String::as_str).collect();
    let peer = warm_peer(&refs);
    assert!(!peer.warm_for(&spec(IMAGE, Some(4), None)));
    assert!(!peer.warm_for(&spec(IMAGE, None, None)));
    assert!(!peer.warm_for(&spec(IMAGE, Some(4), Some(8192))));
    // Whitespace-bearing build images never read as a key, whatever the peer publishes.
    let keyish = [
        format!("{IMAGE} cpu=4"),
        format!("{IMAGE}\tcpu=4"),
        format!("{IMAGE}\u{a0}cpu=4"),
    ];
    let refs: Vec<&str> = keyish.iter().map(String::as_str).collect();
    let peer = warm_peer(&refs);
    for k in &keyish {
        assert!(!peer.warm_for(&spec(k, None, None)), "{k:?}");
    }
    // An exact key still matches (no regression).
    let key = format!("{IMAGE} cpu=4");
    assert!(warm_peer(&[&key]).warm_for(&spec(IMAGE, Some(4), None)));
}

#[test]
fn pool14_held_huge_or_odd_peer_annotation_is_ignored_without_panic() {
    let big: Vec<String> = (0..50_000).map(|i| format!("{IMAGE}{i}")).collect();
    let lease = pool_common::lease("peer", &[(WARM_ANNOTATION, serde_json::to_string(&big).unwrap())]);
    let peer = peer_of(&lease).unwrap();
    assert!(!peer.warm_for(&spec(IMAGE, None, None)));
    for raw in [
        "",
        "null",
        "{}",
        "[1]",
        "[null]",
        "\"x\"",
        "[\"\\u0000\"]",
        "[[]]",
        "[\"\"]",
    ] {
        let lease = pool_common::lease("peer", &[(WARM_ANNOTATION, raw.to_string())]);
        let peer = peer_of(&lease).unwrap();
        assert!(!peer.warm_for(&spec(IMAGE, None, None)), "{raw}");
        let _ = peer.may_hold(IMAGE);
        let _ = peer.may_hold("");
    }
}
