//! `spec.mounts`: the host folders a build asks for, by the names the agent's `[[mounts]]`
//! declare, turned into `tart run --dir` shares before anything is cloned.

use tartan_api::crd::{MountRequest, check_mount_requests};
use tartan_tart::DirShare;

use crate::config::MountConfig;

/// Whether `path` is `dir` or inside it, component by component, ignoring case: a Mac's default
/// file system (APFS, case-insensitive) takes `/Users/ci/Secret` and `/users/CI/secret` for one
/// folder, so an overlap check that compares case would miss it. Each component is folded with
/// Unicode lower-casing; not normalized (std has no NFC/NFD), so a name written precomposed on
/// one side and decomposed on the other is not seen as the same. Used where a wrong "apart"
/// would let a build reach the agent's or other builds' folders: a case-sensitive volume only
/// refuses more than it needs to.
pub fn within_ignoring_case(path: &std::path::Path, dir: &std::path::Path) -> bool {
    let fold = |c: std::path::Component<'_>| case_fold(&c.as_os_str().to_string_lossy());
    let mut path = path.components();
    dir.components()
        .all(|d| path.next().is_some_and(|p| fold(p) == fold(d)))
}

/// `name` case-folded as a case-insensitive Mac disk compares names, as far as std allows:
/// lower-cased, then the letters whose simple case folding differs from their lower case (long
/// s, final sigma, micro sign, the Greek symbol forms) mapped to their folded letter. No Unicode
/// normalization (std has none): a name written precomposed and another decomposed differ.
pub fn case_fold(name: &str) -> String {
    name.to_lowercase()
        .chars()
        .map(|c| match c {
            'ſ' => 's',
            'ς' => 'σ',
            'µ' => 'μ',
            'ϐ' => 'β',
            'ϑ' => 'θ',
            'ϕ' => 'φ',
            'ϖ' => 'π',
            'ϰ' => 'κ',
            'ϱ' => 'ρ',
            'ϵ' => 'ε',
            '\u{1E9B}' => '\u{1E61}',
            '\u{1FBE}' => 'ι',
            c => c,
        })
        .collect()
}

/// Why a build's mounts cannot be given to its VM. Either way nothing was cloned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MountRefused {
    /// The MacBuild asks for a name the agent's config does not declare, or its list is malformed
    /// (the pipeline's to fix: `MountNotDeclared`).
    #[error("{0}")]
    NotDeclared(String),
    /// A declared folder is gone or unusable now (the operator's to fix: the VM cannot start).
    #[error("{0}")]
    Unusable(String),
}

/// The shares for `asked`, in the order asked, from `declared`.
pub fn shares_for(asked: &[MountRequest], declared: &[MountConfig]) -> Result<Vec<DirShare>, MountRefused> {
    check_mount_requests(asked).map_err(|e| MountRefused::NotDeclared(format!("spec.mounts: {e}")))?;
    let mut shares = Vec::new();
    for m in asked {
        let Some(d) = declared.iter().find(|d| d.name == m.name) else {
            let names: Vec<&str> = declared.iter().map(|d| d.name.as_str()).collect();
            let known = if names.is_empty() {
                "it declares none".to_string()
            } else {
                format!("it declares {}", names.join(", "))
            };
            return Err(MountRefused::NotDeclared(format!(
                "mount {:?} is not declared by this agent's config ([[mounts]]: {known})",
                m.name
            )));
        };
        // Resolved at load: resolving it again must give the same folder, or one of its
        // components was replaced by a link since (or it is gone).
        let still = std::fs::canonicalize(&d.host_path).is_ok_and(|now| now == d.host_path);
        if !still || !d.host_path.is_dir() {
            return Err(MountRefused::Unusable(format!(
                "mount {:?}: host folder {} is gone, not a folder, or now reached through a link (it was a \
                 plain folder when the agent started); nothing was cloned",
                d.name,
                d.host_path.display()
            )));
        }
        shares.push(DirShare {
            name: d.name.clone(),
            path: d.host_path.clone(),
            read_only: d.read_only,
        });
    }
    Ok(shares)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Found by an adversary: a folder declared as a mount, replaced by a link after the agent
    /// started (by a build given a mount around it, or anyone), was shared as what the link
    /// points to (`is_dir` follows it).
    #[test]
    fn a_mount_folder_replaced_by_a_link_since_the_start_is_not_shared() {
        let base = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(base.path()).unwrap();
        let (seed, elsewhere) = (base.join("seed"), base.join("state"));
        std::fs::create_dir_all(&seed).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        let declared = [MountConfig {
            name: "seed".into(),
            host_path: seed.clone(),
            read_only: true,
        }];
        let asked = [MountRequest { name: "seed".into() }];
        assert_eq!(shares_for(&asked, &declared).unwrap().len(), 1);
        std::fs::remove_dir(&seed).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &seed).unwrap();
        let refused = shares_for(&asked, &declared).unwrap_err();
        assert!(
            matches!(&refused, MountRefused::Unusable(why) if why.contains("through a link")),
            "{refused:?}"
        );
    }

    #[test]
    fn folders_overlap_whatever_their_case() {
        for (path, dir, inside) in [
            ("/users/CI/secret/x", "/Users/ci/Secret", true),
            ("/Users/ci/Secret", "/users/CI/secret", true),
            ("/Users/ci/Secret", "/Users/ci/Secret/x", false),
            ("/Users/ci/Secrets", "/Users/ci/Secret", false),
            ("/Users/ci/Secret", "/", true),
            ("/ÉTAT/a", "/état", true),
            ("/tmp/a//b/", "/tmp/a/b", true),
            ("/tmp/ab", "/tmp/a", false),
        ] {
            assert_eq!(
                within_ignoring_case(Path::new(path), Path::new(dir)),
                inside,
                "{path} in {dir}"
            );
        }
    }

    /// Adversary finding: APFS's case-insensitive names compare by Unicode case folding, which is
    /// not lower-casing: long s `ſ` folds to `s`, final sigma `ς` and `Σ` to `σ`, micro `µ` to
    /// `μ`, while `to_lowercase` keeps `ſ`, `ς` and `µ` as they are (and lowers a word-final `Σ`
    /// to `ς`). Each pair below names one folder on a Mac.
    #[test]
    fn folders_overlap_under_case_folding_not_only_lower_casing() {
        for (path, dir) in [
            ("/Users/ci/ſtate/x", "/Users/ci/state"),
            ("/Users/ci/δας/x", "/Users/ci/δασ"),
            ("/Users/ci/ΔΑΣ/x", "/Users/ci/δασ"),
            ("/Users/ci/µs/x", "/Users/ci/μs"),
        ] {
            assert!(within_ignoring_case(Path::new(path), Path::new(dir)), "{path} in {dir}");
        }
    }

    /// Found by an adversary: the config compared mount folders with the agent's own folders and
    /// artifact roots case by case, while a Mac's disk ignores case.
    #[test]
    fn a_mount_differing_only_in_case_from_a_protected_folder_is_refused_at_load() {
        let base = tempfile::tempdir().unwrap();
        let b = base.path().canonicalize().unwrap();
        // On a case-sensitive disk (Linux) these are two folders; on a Mac one.
        let protected = b.join("Users/ci/Secret");
        let mount = b.join("users/CI/secret/x");
        let around = b.join("users/CI");
        for d in [&protected, &mount] {
            std::fs::create_dir_all(d).unwrap();
        }
        let load = |head: &str, folder: &Path| {
            let text = format!("{head}[[mounts]]\nname = \"m\"\nhost_path = {folder:?}\n");
            crate::config::Config::from_toml(Path::new("/etc/agent.toml"), &text, "mac", Some(Path::new("/Users/ci")))
        };
        let state = format!("state_dir = {protected:?}\ntart_home = {:?}\n", b.join("tart"));
        let roots = format!(
            "state_dir = {:?}\ntart_home = {:?}\n[artifacts]\nallowed_file_roots = [{protected:?}]\n",
            b.join("state"),
            b.join("tart")
        );
        for (head, folder, says) in [
            (&state, &mount, "is inside state_dir"),
            (&state, &around, "holds state_dir"),
            (&roots, &mount, "is inside artifacts.allowed_file_roots"),
            (&roots, &around, "holds artifacts.allowed_file_roots"),
        ] {
            // The [artifacts] table must come last: the mount goes before it.
            let (top, table) = head.split_at(head.find("[artifacts]").unwrap_or(head.len()));
            let text = format!("{top}[[mounts]]\nname = \"m\"\nhost_path = {folder:?}\n{table}");
            let e = crate::config::Config::from_toml(
                Path::new("/etc/agent.toml"),
                &text,
                "mac",
                Some(Path::new("/Users/ci")),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains(says), "{}: {e}", folder.display());
        }
        // Apart, whatever the case.
        std::fs::create_dir_all(b.join("users/ci/other")).unwrap();
        load(&state, &b.join("users/ci/other")).unwrap();
    }

    fn asked(names: &[&str]) -> Vec<MountRequest> {
        names.iter().map(|n| MountRequest { name: n.to_string() }).collect()
    }

    #[test]
    fn asked_names_must_be_declared_and_keep_their_mode() {
        let dir = tempfile::tempdir().unwrap();
        let declared = vec![
            MountConfig {
                name: "spm".into(),
                host_path: dir.path().to_path_buf(),
                read_only: false,
            },
            MountConfig {
                name: "seed".into(),
                host_path: dir.path().to_path_buf(),
                read_only: true,
            },
        ];
        let got = shares_for(&asked(&["seed", "spm"]), &declared).unwrap();
        assert_eq!(
            got.iter().map(|s| (s.name.as_str(), s.read_only)).collect::<Vec<_>>(),
            [("seed", true), ("spm", false)]
        );
        assert!(shares_for(&[], &declared).unwrap().is_empty());
        assert_eq!(
            shares_for(&asked(&["pods"]), &declared).unwrap_err(),
            MountRefused::NotDeclared(
                "mount \"pods\" is not declared by this agent's config ([[mounts]]: it declares spm, seed)".into()
            )
        );
        assert_eq!(
            shares_for(&asked(&["spm"]), &[]).unwrap_err().to_string(),
            "mount \"spm\" is not declared by this agent's config ([[mounts]]: it declares none)"
        );
        // What only a MacBuild written around the API's schema can carry.
        for hostile in [&["spm", "spm"][..], &["../etc"], &["spm:/etc:rw"], &[""]] {
            assert!(
                matches!(shares_for(&asked(hostile), &declared), Err(MountRefused::NotDeclared(m)) if m.starts_with("spec.mounts: ")),
                "{hostile:?}"
            );
        }
        let gone = vec![MountConfig {
            name: "spm".into(),
            host_path: dir.path().join("gone"),
            read_only: false,
        }];
        assert!(matches!(
            shares_for(&asked(&["spm"]), &gone),
            Err(MountRefused::Unusable(_))
        ));
    }
}
