//! The double's `run` flags beyond `--no-graphics`, checked as tart checks them and recorded so
//! tests can assert what was asked for: each accepted `run` appends one JSON line to
//! `$TART_HOME/double-runs.jsonl` ([`RUNS_FILE`]), which outlives the VM.
//!
//! tart's rules (`Sources/tart/Commands/Run.swift`): `--dir [name:]path[:options]` is split at
//! `:`, its last part read as comma-separated options (`ro`, `tag=T`) when one of them is an
//! option; shares with the same mount tag must all be named when there is more than one
//! (`ValidationError`, a usage error); `--net-softnet-allow|-block|-expose` imply
//! `--net-softnet`; `--net-bridged`, `--net-softnet` and `--net-host` are mutually exclusive
//! (`ValidationError`). Softnet validates its CIDRs itself and dies on a bad one, which tart
//! reports as a start failure (exit 1). A share whose folder does not exist fails the VM's
//! configuration (exit 1; *inferred*, not checked against a Mac).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// The record file under `TART_HOME`.
pub const RUNS_FILE: &str = "double-runs.jsonl";

/// macOS's automount tag, tart's default.
const AUTOMOUNT_TAG: &str = "com.apple.virtio-fs.automount";

/// One `--dir` as tart reads it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Share {
    pub name: Option<String>,
    pub path: String,
    pub read_only: bool,
    pub tag: String,
}

/// Parses one `--dir` value the way tart's `DirectoryShare(parseFrom:)` does.
pub fn parse_share(raw: &str) -> Share {
    let mut parts: Vec<&str> = raw.split(':').collect();
    let (mut read_only, mut tag, mut found) = (false, AUTOMOUNT_TAG.to_string(), false);
    for option in parts.last().copied().unwrap_or_default().split(',') {
        if option == "ro" {
            read_only = true;
            found = true;
        } else if let Some(t) = option.strip_prefix("tag=") {
            tag = t.to_string();
            found = true;
        }
    }
    if found {
        parts.pop();
    }
    let rest = parts.join(":");
    let (name, path) = match rest.split_once(':') {
        Some((name, path)) if !(rest.starts_with("http:") || rest.starts_with("https:")) => {
            (Some(name.to_string()), path.to_string())
        }
        _ => (None, rest),
    };
    Share {
        name,
        path,
        read_only,
        tag,
    }
}

/// What one accepted `run` asked for (one line of [`RUNS_FILE`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RunRecord {
    pub vm: String,
    pub dir: Vec<Share>,
    pub net_softnet: bool,
    pub net_softnet_allow: Option<String>,
    pub net_softnet_block: Option<String>,
}

/// How the flags were refused: a usage error (tart's `ValidationError`, exit 64) or a start
/// failure (exit 1).
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Usage(String),
    Start(String),
}

/// The network flags as given.
pub struct NetFlags<'a> {
    pub bridged: &'a [String],
    pub softnet: bool,
    pub softnet_allow: Option<&'a str>,
    pub softnet_block: Option<&'a str>,
    pub softnet_expose: Option<&'a str>,
    pub host: bool,
}

/// Checks the flags of `run VM`; returns what to record.
pub fn check(vm: &str, dirs: &[String], net: &NetFlags<'_>) -> Result<RunRecord, Refused> {
    let shares: Vec<Share> = dirs.iter().map(|d| parse_share(d)).collect();
    let mut by_tag: BTreeMap<&str, Vec<&Share>> = BTreeMap::new();
    for s in &shares {
        by_tag.entry(s.tag.as_str()).or_default().push(s);
    }
    if by_tag
        .values()
        .any(|group| group.len() > 1 && group.iter().any(|s| s.name.is_none()))
    {
        return Err(Refused::Usage(
            "invalid --dir syntax: for multiple directory shares each one of them should be named".into(),
        ));
    }
    let softnet =
        net.softnet || net.softnet_allow.is_some() || net.softnet_block.is_some() || net.softnet_expose.is_some();
    let modes = usize::from(!net.bridged.is_empty()) + usize::from(softnet) + usize::from(net.host);
    if modes > 1 {
        return Err(Refused::Usage(
            "--net-bridged, --net-softnet and --net-host are mutually exclusive".into(),
        ));
    }
    for s in &shares {
        if !Path::new(&s.path).is_dir() {
            return Err(Refused::Start(format!(
                "directory share {:?}: {} is not an existing folder",
                s.name.as_deref().unwrap_or(""),
                s.path
            )));
        }
    }
    for list in [net.softnet_allow, net.softnet_block].into_iter().flatten() {
        for cidr in list.split(',') {
            if !cidr_ok(cidr) {
                return Err(Refused::Start(format!("Softnet failed: invalid CIDR {cidr:?}")));
            }
        }
    }
    Ok(RunRecord {
        vm: vm.to_string(),
        dir: shares,
        net_softnet: softnet,
        net_softnet_allow: net.softnet_allow.map(String::from),
        net_softnet_block: net.softnet_block.map(String::from),
    })
}

fn cidr_ok(cidr: &str) -> bool {
    let Some((addr, len)) = cidr.split_once('/') else {
        return false;
    };
    addr.parse::<std::net::Ipv4Addr>().is_ok() && len.parse::<u8>().is_ok_and(|l| l <= 32)
}

/// Appends `record` to `home`'s [`RUNS_FILE`].
pub fn record(home: &Path, record: &RunRecord) -> std::io::Result<()> {
    use std::io::Write;
    let mut line = serde_json::to_string(record).map_err(std::io::Error::other)?;
    line.push('\n');
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(runs_file(home))?
        .write_all(line.as_bytes())
}

/// `home`'s [`RUNS_FILE`].
pub fn runs_file(home: &Path) -> PathBuf {
    home.join(RUNS_FILE)
}

/// Every recorded run of `vm` under `home`, oldest first, as JSON values (for tests).
pub fn runs_of(home: &Path, vm: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(runs_file(home))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["vm"] == vm)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_parse_as_tart_parses_them() {
        let s = parse_share("spm:/c/spm:ro");
        assert_eq!(
            (s.name.as_deref(), s.path.as_str(), s.read_only),
            (Some("spm"), "/c/spm", true)
        );
        assert_eq!(s.tag, AUTOMOUNT_TAG);
        let s = parse_share("/c/plain");
        assert_eq!((s.name, s.path.as_str(), s.read_only), (None, "/c/plain", false));
        let s = parse_share("b:/c/b:ro,tag=build");
        assert_eq!((s.read_only, s.tag.as_str()), (true, "build"));
        // A path holding ',' is read as options, as in tart: the share becomes folder "x" with
        // tag "evil" (why the agent refuses ',' and ':' in paths).
        let s = parse_share("x:/c/ro,tag=evil");
        assert_eq!((s.name, s.path.as_str(), s.tag.as_str()), (None, "x", "evil"));
        let s = parse_share("https://example.com/a.tar.gz");
        assert_eq!(s.name, None);
    }

    #[test]
    fn flags_are_refused_as_tart_refuses_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let none: [String; 0] = [];
        let net = |softnet: bool, allow: Option<&'static str>, host: bool| NetFlags {
            bridged: &[],
            softnet,
            softnet_allow: allow,
            softnet_block: None,
            softnet_expose: None,
            host,
        };
        let ok = check(
            "vm",
            &[format!("a:{d}"), format!("b:{d}:ro")],
            &net(false, Some("10.0.0.0/8"), false),
        )
        .unwrap();
        assert!(ok.net_softnet, "--net-softnet-allow implies --net-softnet");
        assert_eq!(ok.dir.len(), 2);
        assert!(matches!(
            check("vm", &[d.clone(), format!("b:{d}")], &net(false, None, false)),
            Err(Refused::Usage(m)) if m.contains("each one of them should be named")
        ));
        assert!(
            matches!(check("vm", &none, &net(true, None, true)), Err(Refused::Usage(m)) if m.contains("mutually exclusive"))
        );
        assert!(matches!(
            check("vm", &[format!("a:{d}/missing")], &net(false, None, false)),
            Err(Refused::Start(_))
        ));
        assert!(
            matches!(check("vm", &none, &net(true, Some("10.0.0.0/8,bad"), false)), Err(Refused::Start(m)) if m.contains("bad"))
        );
    }

    #[test]
    fn what_the_driver_renders_the_double_reads_back() {
        for (name, path, ro) in [("spm", "/Users/ci/cache/spm", false), ("seed", "/srv/a b/seed", true)] {
            let share = tartan_tart::DirShare {
                name: name.into(),
                path: path.into(),
                read_only: ro,
            };
            let parsed = parse_share(&share.render().unwrap());
            assert_eq!(
                (parsed.name.as_deref(), parsed.path.as_str(), parsed.read_only),
                (Some(name), path, ro)
            );
            assert_eq!(parsed.tag, AUTOMOUNT_TAG);
        }
    }
}
