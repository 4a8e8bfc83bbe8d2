//! `spec.env`: what a MacBuild may put into its steps' environment, checked the same way by the
//! controller (before a MacBuild exists) and the agent (before any VM is cloned).

use crate::crd::EnvVar;
use std::collections::BTreeSet;

/// Most entries in `spec.env`.
pub const ENV_MAX_ENTRIES: usize = 100;

/// Longest variable name.
pub const ENV_NAME_MAX_LEN: usize = 128;

/// Longest literal `value` (a secret value is bounded by the Secret's own 1 MiB limit).
pub const ENV_VALUE_MAX_LEN: usize = 32 << 10;

/// Names a build may not set, and why: each one would change how the guest runs the steps rather
/// than what the steps see. `PATH` is replaced, not extended, by an env entry, and the step
/// wrapper needs `mkdir`, `mv` and `wc` from it (a step that wants more on its PATH runs
/// `sh -c 'PATH=/opt/x/bin:$PATH exec …'`); `IFS`, `ENV`, `BASH_ENV` and `CDPATH` change how the
/// wrapper's `sh` parses and starts; `HOME`, `USER`, `LOGNAME`, `SHELL`, `PWD` and `OLDPWD`
/// describe the guest user and its working directory, which the steps rely on; `TARTAN_*` is
/// kept for the agent.
pub const RESERVED_NAMES: &[&str] = &[
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "IFS", "ENV", "BASH_ENV", "CDPATH",
];

/// Prefix of names kept for Tartan itself.
pub const RESERVED_PREFIX: &str = "TARTAN_";

/// Checks a variable name: `[A-Za-z_][A-Za-z0-9_]*`, at most [`ENV_NAME_MAX_LEN`], not reserved.
pub fn check_env_name(name: &str) -> Result<(), String> {
    let b = name.as_bytes();
    if b.is_empty() {
        return Err("an env entry has an empty name".into());
    }
    if b.len() > ENV_NAME_MAX_LEN {
        return Err(format!(
            "env name {:?}… is longer than {ENV_NAME_MAX_LEN} characters",
            &name[..name.char_indices().nth(32).map_or(name.len(), |(i, _)| i)]
        ));
    }
    let first_ok = b[0].is_ascii_alphabetic() || b[0] == b'_';
    if !first_ok || !b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_') {
        return Err(format!(
            "env name {name:?} is not a shell variable name: use letters, digits and '_', not starting with a digit"
        ));
    }
    if RESERVED_NAMES.contains(&name) {
        return Err(format!(
            "env name {name:?} is reserved: setting it would break how the guest runs the steps \
             (reserved: {})",
            RESERVED_NAMES.join(", ")
        ));
    }
    if name.starts_with(RESERVED_PREFIX) {
        return Err(format!(
            "env name {name:?} is reserved: names starting with {RESERVED_PREFIX} are Tartan's"
        ));
    }
    Ok(())
}

/// Checks a Secret's name: a DNS subdomain, as Kubernetes names Secrets.
pub fn check_secret_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the Secret name is empty".into());
    }
    crate::names::check_dns_subdomain(name).map_err(|why| format!("Secret name {why}"))
}

/// Checks a key of a Secret's `data`: `[-._a-zA-Z0-9]+`, at most 253 characters.
pub fn check_secret_key(key: &str) -> Result<(), String> {
    let ok = !key.is_empty()
        && key.len() <= 253
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    if !ok {
        return Err(format!(
            "Secret key {key:?} is not a valid key: use 1 to 253 of a-z, A-Z, 0-9, '-', '.' and '_'"
        ));
    }
    Ok(())
}

/// Checks `spec.env`: at most [`ENV_MAX_ENTRIES`] entries, valid unique names, exactly one of
/// `value` and `valueFrom` each, literal values without NUL and at most [`ENV_VALUE_MAX_LEN`]
/// bytes, valid Secret names and keys. Returns what is wrong with the first bad entry.
pub fn check_env(env: &[EnvVar]) -> Result<(), String> {
    if env.len() > ENV_MAX_ENTRIES {
        return Err(format!(
            "env has {} entries; at most {ENV_MAX_ENTRIES} are allowed",
            env.len()
        ));
    }
    let mut seen = BTreeSet::new();
    for var in env {
        check_env_name(&var.name)?;
        if !seen.insert(var.name.as_str()) {
            return Err(format!("env name {:?} is given twice", var.name));
        }
        match (&var.value, &var.value_from) {
            (Some(_), Some(_)) => {
                return Err(format!("env {:?} has both value and valueFrom; give one", var.name));
            }
            (None, None) => {
                return Err(format!(
                    "env {:?} has neither value nor valueFrom.secretKeyRef; give one (an empty value is \"\")",
                    var.name
                ));
            }
            (Some(value), None) => {
                if value.len() > ENV_VALUE_MAX_LEN {
                    return Err(format!(
                        "env {:?}: value is {} bytes, more than the {ENV_VALUE_MAX_LEN} allowed",
                        var.name,
                        value.len()
                    ));
                }
                if value.contains('\0') {
                    return Err(format!(
                        "env {:?}: value contains a NUL byte, which no environment can hold",
                        var.name
                    ));
                }
            }
            (None, Some(from)) => {
                let r = &from.secret_key_ref;
                check_secret_name(&r.name).map_err(|e| format!("env {:?}: {e}", var.name))?;
                check_secret_key(&r.key).map_err(|e| format!("env {:?}: {e}", var.name))?;
            }
        }
    }
    Ok(())
}

/// Parses a `secret/key` reference (the `secret-env` param's right-hand side).
pub fn parse_secret_ref(text: &str) -> Result<(String, String), String> {
    let Some((name, key)) = text.split_once('/') else {
        return Err(format!("{text:?} is not secret/key"));
    };
    check_secret_name(name).map_err(|e| format!("{text:?}: {e}"))?;
    check_secret_key(key).map_err(|e| format!("{text:?}: {e}"))?;
    Ok((name.to_string(), key.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{EnvVarSource, SecretKeySelector};

    fn lit(name: &str, value: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: Some(value.into()),
            value_from: None,
        }
    }

    fn secret(name: &str, s: &str, k: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: None,
            value_from: Some(EnvVarSource {
                secret_key_ref: SecretKeySelector {
                    name: s.into(),
                    key: k.into(),
                },
            }),
        }
    }

    #[test]
    fn good_env_passes() {
        let env = vec![
            lit("CONFIGURATION", "Release"),
            lit("_X1", ""),
            lit("QUOTED", "it's \"$(x)\" `y`\nz"),
            secret("ASC_KEY", "asc-key", "key.p8"),
        ];
        assert_eq!(check_env(&env), Ok(()));
    }

    #[test]
    fn bad_env_is_refused_naming_the_entry() {
        let both = EnvVar {
            value: Some("x".into()),
            ..secret("BOTH", "s", "k")
        };
        let neither = EnvVar {
            name: "NEITHER".into(),
            value: None,
            value_from: None,
        };
        for (env, want) in [
            (vec![lit("", "x")], "empty name"),
            (vec![lit("1X", "x")], "not a shell variable name"),
            (vec![lit("A-B", "x")], "not a shell variable name"),
            (vec![lit("A B", "x")], "not a shell variable name"),
            (vec![lit("PATH", "/bin")], "\"PATH\" is reserved"),
            (vec![lit("IFS", "x")], "\"IFS\" is reserved"),
            (vec![lit("TARTAN_X", "x")], "TARTAN_"),
            (vec![lit(&"N".repeat(129), "x")], "longer than 128"),
            (vec![lit("A", "1"), secret("A", "s", "k")], "\"A\" is given twice"),
            (vec![both], "both value and valueFrom"),
            (vec![neither], "neither value nor valueFrom"),
            (vec![lit("BIG", &"x".repeat(ENV_VALUE_MAX_LEN + 1))], "more than the"),
            (vec![lit("NUL", "a\0b")], "NUL"),
            (vec![secret("S", "Bad_Name", "k")], "RFC 1123"),
            (vec![secret("S", "", "k")], "Secret name is empty"),
            (vec![secret("S", "ok", "a/b")], "not a valid key"),
            (vec![secret("S", "ok", "")], "not a valid key"),
            (
                (0..=ENV_MAX_ENTRIES).map(|i| lit(&format!("V{i}"), "")).collect(),
                "at most 100",
            ),
        ] {
            let e = check_env(&env).unwrap_err();
            assert!(e.contains(want), "{env:?}: {e} lacks {want:?}");
        }
    }

    #[test]
    fn secret_refs_parse_as_secret_slash_key() {
        assert_eq!(
            parse_secret_ref("asc-key/key.p8"),
            Ok(("asc-key".into(), "key.p8".into()))
        );
        for (bad, want) in [
            ("nokey", "not secret/key"),
            ("/k", "empty"),
            ("s/", "not a valid key"),
            ("S/k", "RFC 1123"),
            ("s/k/x", "not a valid key"),
        ] {
            let e = parse_secret_ref(bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }
}
