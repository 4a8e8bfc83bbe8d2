//! `spec.mounts`: the host folders a build asks for, by the names the agent's `[[mounts]]`
//! declare, turned into `tart run --dir` shares before anything is cloned.

use tartan_api::crd::{MountRequest, check_mount_requests};
use tartan_tart::DirShare;

use crate::config::MountConfig;

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
        if !d.host_path.is_dir() {
            return Err(MountRefused::Unusable(format!(
                "mount {:?}: host folder {} is gone or not a folder (it was when the agent started)",
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
