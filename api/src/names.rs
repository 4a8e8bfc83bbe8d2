//! Names derived from a MacBuild: VM names, attempt ids, and the label and field-manager keys.

use crate::vocab::VM_PREFIX;

/// Label on a MacBuild (set by the claiming agent) and on an agent's Lease: the agent's name.
/// `kubectl get mb -l tartan.dev/agent=mac-mini-07` lists what one host holds.
pub const AGENT_LABEL: &str = "tartan.dev/agent";

/// Label on a MacBuild (set by the controller at creation): the name of the CustomRun it serves.
pub const CUSTOM_RUN_LABEL: &str = "tartan.dev/custom-run";

/// Label the controller puts on a CustomRun, and on its MacBuild, once the run is finished and
/// its status says everything: the controller watches only objects without it
/// ([`UNFINISHED_SELECTOR`]), so a restart does not list every finished run before acting.
/// A CustomRun created with it is taken as finished and ignored; the controller never copies
/// it onto a new MacBuild.
pub const FINISHED_LABEL: &str = "tartan.dev/finished";

/// Label selector of the objects the controller still has work on.
pub const UNFINISHED_SELECTOR: &str = "!tartan.dev/finished";

/// Field manager of the controller's writes (spec and labels of MacBuilds, CustomRun status).
pub const CONTROLLER_FIELD_MANAGER: &str = "tartan-controller";

/// Field manager of the agent's writes (MacBuild status, finalizer, Lease).
pub const AGENT_FIELD_MANAGER: &str = "tartan-agent";

/// Longest VM name [`vm_name`] produces. 63 keeps a VM name usable as a label value and a host
/// name; tart itself only needs a valid directory name.
pub const VM_NAME_MAX_LEN: usize = 63;

/// Length of the `-<8 hex>` suffix that makes each attempt's VM name unique.
const HASH_SUFFIX_LEN: usize = 9;

/// The tart VM name for one attempt: `mb-<namespace>-<name>-<8 hex>`.
///
/// The hex is a stable hash of the MacBuild's uid and the attempt number, so every attempt gets a
/// fresh name (tart silently overwrites an existing clone, so a name is never reused) and a
/// recreated MacBuild of the same name gets different ones. Characters outside `[a-z0-9-]` become
/// `-`, and the readable part is shortened so the whole name fits [`VM_NAME_MAX_LEN`]; the hash
/// keeps shortened names distinct.
pub fn vm_name(namespace: &str, name: &str, uid: &str, attempt: u32) -> String {
    let hash = fnv1a_32(format!("{uid}#{attempt}").as_bytes());
    let readable: String = format!("{namespace}-{name}")
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '-',
        })
        .take(VM_NAME_MAX_LEN - VM_PREFIX.len() - HASH_SUFFIX_LEN)
        .collect();
    let readable = readable.trim_matches('-');
    if readable.is_empty() {
        format!("{VM_PREFIX}{hash:08x}")
    } else {
        format!("{VM_PREFIX}{readable}-{hash:08x}")
    }
}

/// The start of a warm pool VM's name (`mb--warm-<seq>-<hex>`). No name [`vm_name`] makes starts
/// so: after the prefix comes a namespace, and a namespace starts with a letter or digit.
pub const WARM_VM_PREFIX: &str = "mb--warm-";

/// Whether `vm` is a warm pool VM's name (made by the agent's pool, not for one build).
pub fn is_warm_vm(vm: &str) -> bool {
    vm.starts_with(WARM_VM_PREFIX)
}

/// Checks that `vm` is a name Tartan may create, delete or name a file after: it starts with
/// [`VM_PREFIX`], is at most [`VM_NAME_MAX_LEN`] long and uses only `[a-z0-9-]` (so no `/`, no
/// `..`). Returns what is wrong otherwise. Every name [`vm_name`] returns passes.
pub fn check_vm_name(vm: &str) -> Result<(), &'static str> {
    if !vm.starts_with(VM_PREFIX) {
        return Err("does not start with the Tartan prefix \"mb-\"");
    }
    if vm.len() == VM_PREFIX.len() {
        return Err("has nothing after the prefix");
    }
    if vm.len() > VM_NAME_MAX_LEN {
        return Err("is longer than 63 characters");
    }
    if !vm.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-')) {
        return Err("contains characters other than a-z, 0-9 and '-'");
    }
    Ok(())
}

/// Longest label value and name part of a label key (Kubernetes: 63).
pub const LABEL_NAME_MAX_LEN: usize = 63;

/// Longest prefix of a label key (a DNS subdomain, Kubernetes: 253).
pub const LABEL_PREFIX_MAX_LEN: usize = 253;

/// Checks `key` as Kubernetes checks a label key (`IsQualifiedName`): an optional DNS-subdomain
/// prefix and `/`, then a name of 1–63 characters from `[A-Za-z0-9-_.]` that starts and ends
/// with a letter or digit. Returns what is wrong otherwise, as the apiserver would say it.
pub fn check_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split('/').collect::<Vec<_>>().as_slice() {
        [name] => (None, *name),
        [prefix, name] => (Some(*prefix), *name),
        _ => {
            return Err(format!(
                "label key {key:?} has more than one '/': a key is an optional DNS subdomain prefix and '/' \
                 followed by a name (e.g. 'example.com/MyName')"
            ));
        }
    };
    if let Some(prefix) = prefix {
        if prefix.is_empty() {
            return Err(format!("label key {key:?}: the prefix before '/' must be non-empty"));
        }
        check_dns_subdomain(prefix).map_err(|why| format!("label key {key:?}: the prefix {why}"))?;
    }
    if name.is_empty() {
        return Err(format!("label key {key:?}: the name part must be non-empty"));
    }
    check_label_name(name).map_err(|why| format!("label key {key:?}: the name part {why}"))
}

/// Longest `spec.image` accepted.
pub const IMAGE_MAX_LEN: usize = 512;

/// Checks that `image` is what a MacBuild may clone from: a registry image
/// (`host/repository[:tag|@digest]`, which tart pulls), or one of the operator's `local` VM names.
/// To tart a name without `/` is a local VM, so a MacBuild naming one could clone another build's
/// VM (its disk and secrets) or anything else on the Mac; an agent's own `mb-` VMs are never an
/// image, and nothing that tart could read as an option (`-…`) reaches its argv.
pub fn check_image(image: &str, local: &[String]) -> Result<(), String> {
    // Any part naming one of our VMs (tart may read `./mb-x` as a local path), case-insensitively
    // (APFS usually ignores case).
    if image
        .split('/')
        .any(|part| part.to_ascii_lowercase().starts_with(VM_PREFIX))
    {
        return Err(format!(
            "{image:?} names one of the agents' own VMs ({VM_PREFIX}…), never an image"
        ));
    }
    if local.iter().any(|l| l == image) {
        return Ok(());
    }
    if image.is_empty() || image.len() > IMAGE_MAX_LEN {
        return Err(format!(
            "an image name has 1 to {IMAGE_MAX_LEN} bytes, not {}",
            image.len()
        ));
    }
    if image.starts_with('-') || image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "{image:?} is not an image reference (a leading '-', a space or a control character)"
        ));
    }
    // The first part must look like a registry host (a name with a dot or a port, or
    // `localhost`): `./base` or `a/b` would let tart read a local VM or path.
    let host = image.split('/').next().unwrap_or_default();
    let host_like = host == "localhost"
        || ((host.contains('.') || host.contains(':'))
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':'))
            && host.chars().next().is_some_and(|c| c.is_ascii_alphanumeric()));
    if !image.contains('/') || !host_like || image.split('/').any(|part| matches!(part, "" | "." | "..")) {
        return Err(format!(
            "{image:?} is not a registry image (host/repository[:tag]); local VM names are refused unless the \
             agent's config lists them in local_images"
        ));
    }
    Ok(())
}

/// Checks `value` as Kubernetes checks a label value (`IsValidLabelValue`): empty, or 1–63
/// characters from `[A-Za-z0-9-_.]` that start and end with a letter or digit.
pub fn check_label_value(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Ok(());
    }
    check_label_name(value).map_err(|why| format!("label value {value:?} {why}"))
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`, at most 63 characters.
fn check_label_name(name: &str) -> Result<(), String> {
    if name.len() > LABEL_NAME_MAX_LEN {
        return Err(format!("must be no more than {LABEL_NAME_MAX_LEN} characters"));
    }
    let inner = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
    let ends = name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
    if !ends || !name.bytes().all(inner) {
        return Err(
            "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with \
                    an alphanumeric character"
                .to_string(),
        );
    }
    Ok(())
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*`, at most 253 characters.
pub(crate) fn check_dns_subdomain(s: &str) -> Result<(), String> {
    if s.len() > LABEL_PREFIX_MAX_LEN {
        return Err(format!("must be no more than {LABEL_PREFIX_MAX_LEN} characters"));
    }
    let label_ok = |l: &str| {
        let b = l.as_bytes();
        let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        !b.is_empty() && alnum(&b[0]) && alnum(&b[b.len() - 1]) && b.iter().all(|c| alnum(c) || *c == b'-')
    };
    if !s.split('.').all(label_ok) {
        return Err(format!(
            "{s:?} must be a lowercase RFC 1123 subdomain: lowercase alphanumeric characters, '-' or '.', \
             starting and ending with an alphanumeric character"
        ));
    }
    Ok(())
}

/// The attempt id used outside the journal: `<macbuild>#<n>` (e.g. `build-42#2`), as in
/// `status.claim.attempt` and the CustomRun's results.
pub fn attempt_id(macbuild: &str, attempt: u32) -> String {
    format!("{macbuild}#{attempt}")
}

/// Splits an attempt id into the MacBuild name and the attempt number (at least 1).
pub fn parse_attempt_id(id: &str) -> Option<(&str, u32)> {
    let (name, digits) = id.rsplit_once('#')?;
    // One spelling per attempt: no sign, no leading zero, no attempt 0.
    let canonical = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && !digits.starts_with('0');
    if name.is_empty() || !canonical {
        return None;
    }
    Some((name, digits.parse().ok()?))
}

/// 32-bit FNV-1a: tiny, stable across releases and platforms (unlike `std`'s hasher), and good
/// enough to tell attempts apart; it is not a security boundary.
fn fnv1a_32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |hash, &b| {
        (hash ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unfinished_selector_excludes_exactly_the_finished_label() {
        assert_eq!(UNFINISHED_SELECTOR, format!("!{FINISHED_LABEL}"));
        assert_eq!(check_label_key(FINISHED_LABEL), Ok(()));
    }

    #[test]
    fn label_keys_and_values_follow_the_kubernetes_rules() {
        for ok in [
            "xcode",
            "a",
            "Arch_1.x-y",
            "tartan.dev/agent",
            "k8s.io/a",
            "a-b.c/N",
            &"x".repeat(63),
            &format!("{}/n", "a".repeat(253)),
        ] {
            assert_eq!(check_label_key(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("", "name part must be non-empty"),
            ("/x", "prefix before '/' must be non-empty"),
            ("a/", "name part must be non-empty"),
            ("a/b/c", "more than one '/'"),
            ("-a", "must start and end"),
            ("a_", "must start and end"),
            ("a=b", "must consist of"),
            ("a b", "must consist of"),
            ("Example.com/x", "lowercase RFC 1123"),
            ("a..b/x", "lowercase RFC 1123"),
            ("-a.b/x", "lowercase RFC 1123"),
            ("é", "must consist of"),
            (&"x".repeat(64), "no more than 63"),
            (&format!("{}/n", "a".repeat(254)), "no more than 253"),
        ] {
            let e = check_label_key(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        for ok in ["", "16", "arm64", "a.b_c-d", &"v".repeat(63)] {
            assert_eq!(check_label_value(ok), Ok(()), "{ok}");
        }
        for bad in ["b=c", "-x", "x.", " 16", "a/b", "\u{0}", &"v".repeat(64)] {
            assert!(check_label_value(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        assert_eq!(fnv1a_32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a_32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a_32(b"foobar"), 0xbf9c_f968);
    }

    #[test]
    fn vm_name_has_the_documented_shape() {
        let vm = vm_name("ci", "build-42-mac-build", "6f1c0e2a-1111-2222-3333-444455556666", 1);
        let (readable, hex) = vm.rsplit_once('-').unwrap();
        assert_eq!(readable, "mb-ci-build-42-mac-build");
        assert_eq!(hex.len(), 8);
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(check_vm_name(&vm), Ok(()));
    }

    #[test]
    fn vm_name_is_stable_and_differs_per_attempt_and_uid() {
        let a1 = vm_name("ci", "b", "uid-1", 1);
        assert_eq!(a1, vm_name("ci", "b", "uid-1", 1));
        assert_ne!(a1, vm_name("ci", "b", "uid-1", 2));
        assert_ne!(a1, vm_name("ci", "b", "uid-2", 1));
    }

    #[test]
    fn vm_name_is_pinned_so_a_restarted_agent_finds_its_vms() {
        // The hash is part of an on-disk contract: a changed algorithm would orphan live VMs.
        assert_eq!(
            vm_name("ci", "b", "uid-1", 1),
            format!("mb-ci-b-{:08x}", fnv1a_32(b"uid-1#1"))
        );
        assert_eq!(vm_name("ci", "b", "uid-1", 1), "mb-ci-b-995ab9c3");
    }

    #[test]
    fn long_names_are_shortened_to_63_and_stay_distinct() {
        let name = "x".repeat(253);
        let a = vm_name("some-long-namespace-name", &name, "uid-a", 1);
        let b = vm_name("some-long-namespace-name", &name, "uid-b", 1);
        assert_eq!(a.len(), VM_NAME_MAX_LEN);
        assert_eq!(b.len(), VM_NAME_MAX_LEN);
        assert_ne!(a, b);
        assert_eq!(check_vm_name(&a), Ok(()));
    }

    #[test]
    fn dots_slashes_and_capitals_are_sanitized() {
        let vm = vm_name("Team.A", "app/v1.2", "u", 3);
        assert!(vm.starts_with("mb-team-a-app-v1-2-"), "{vm}");
        assert!(!vm.contains('/'));
        assert_eq!(check_vm_name(&vm), Ok(()));
    }

    #[test]
    fn truncation_never_leaves_a_double_dash_before_the_hash() {
        // 51 readable characters would end on the '-' between namespace and name.
        let ns = "n".repeat(50);
        let vm = vm_name(&ns, "name", "u", 1);
        assert!(!vm.contains("--"), "{vm}");
        assert_eq!(check_vm_name(&vm), Ok(()));
    }

    #[test]
    fn an_all_symbol_name_still_gives_a_valid_vm_name() {
        let vm = vm_name("...", "___", "u", 1);
        assert_eq!(vm.len(), VM_PREFIX.len() + 8);
        assert_eq!(check_vm_name(&vm), Ok(()));
    }

    #[test]
    fn no_build_vm_name_is_a_warm_vm_name_and_warm_names_are_valid() {
        for ns in ["pool", "warm", "a", "0", "x-warm"] {
            for name in ["-warm-1", "warm", "b"] {
                let vm = vm_name(ns, name, "u", 1);
                assert!(!is_warm_vm(&vm), "{vm}");
            }
        }
        let warm = format!("{WARM_VM_PREFIX}123-0badcafe");
        assert!(is_warm_vm(&warm));
        assert_eq!(check_vm_name(&warm), Ok(()));
    }

    #[test]
    fn check_vm_name_refuses_what_tartan_must_never_touch() {
        assert!(check_vm_name("ubuntu-base").is_err());
        assert!(check_vm_name("mb-").is_err());
        assert!(check_vm_name("mb-../../etc").is_err());
        assert!(check_vm_name("mb-a/b").is_err());
        assert!(check_vm_name("mb-UPPER").is_err());
        assert!(check_vm_name(&format!("mb-{}", "a".repeat(61))).is_err());
        assert!(check_vm_name(&format!("mb-{}", "a".repeat(60))).is_ok());
        for hostile in [
            "mb-..",
            "mb-a/../../b",
            "/mb-a",
            "mb-a\0b",
            "mb-\0",
            "mb-a\nb",
            "..",
            "/",
        ] {
            assert!(check_vm_name(hostile).is_err(), "{hostile:?}");
        }
        assert!(check_vm_name(&format!("mb-{}", "a".repeat(10_000))).is_err());
    }

    #[test]
    fn hostile_macbuild_names_still_give_safe_vm_names() {
        for (ns, name) in [
            ("..", ".."),
            ("/", "/etc/passwd"),
            ("a\0b", "c\0d"),
            ("x", &"y".repeat(10_000)),
        ] {
            let vm = vm_name(ns, name, "uid", 1);
            assert_eq!(check_vm_name(&vm), Ok(()), "{ns:?}/{name:?} -> {vm}");
        }
    }

    #[test]
    fn attempt_ids_round_trip() {
        assert_eq!(attempt_id("build-42", 2), "build-42#2");
        assert_eq!(parse_attempt_id("build-42#2"), Some(("build-42", 2)));
        assert_eq!(parse_attempt_id("a#b#3"), Some(("a#b", 3)));
        for bad in ["build-42", "#1", "b#0", "b#-1", "b#+1", "b#01", "b#", "b#x"] {
            assert_eq!(parse_attempt_id(bad), None, "{bad}");
        }
    }
}

#[cfg(test)]
mod image_tests {
    use super::*;

    #[test]
    fn only_registry_images_or_the_operators_local_ones_are_clonable() {
        let local = vec!["sequoia-base".to_string(), "mb-x".to_string()];
        for ok in [
            "ghcr.io/cirruslabs/macos-sequoia-xcode:16",
            "registry.local:5000/ci/xcode@sha256:abc",
            "sequoia-base",
        ] {
            assert_eq!(check_image(ok, &local), Ok(()), "{ok}");
        }
        for bad in [
            "mb-ci-victim-a44c2fbd", // another build's VM
            "mb-x",                  // ours, even if an operator listed it
            "sequoia-base-2",        // a local VM the operator did not list
            "",
            "--insecure",
            "-x/y",
            "ghcr.io/a b",
            "ghcr.io/a\nb",
            "ghcr.io//x",
            "ghcr.io/../../x",
            "/abs/path",
            "host/",
            "./mb-ci-victim-a44c2fbd",
            "./sequoia-base",
            "a/./b",
            "ghcr.io/MB-CI-victim",
            "ghcr.io/x/mb-y",
            "acme/app",
            "../x/y",
        ] {
            assert!(check_image(bad, &local).is_err(), "{bad:?} accepted");
        }
        assert!(check_image(&format!("ghcr.io/{}", "a".repeat(IMAGE_MAX_LEN)), &local).is_err());
    }
}
