//! The per-key resolvers and checks of [`Config::from_toml`](super::Config::from_toml): each
//! turns one raw value (or a few related ones) into its resolved form or a [`Refusal`] naming the
//! key and what to write instead. Agent identity and state directory, namespaces, slots, tart,
//! artifact folders and buckets, network, logs and disk, metrics, secrets and mounts.

use super::*;

/// A value that parses but is not allowed: its key, and why (what to write instead).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Refusal {
    pub(super) key: &'static str,
    pub(super) why: String,
}

pub(super) fn refuse(key: &'static str, why: impl Into<String>) -> Refusal {
    Refusal { key, why: why.into() }
}

pub(super) fn absolute(key: &'static str, p: PathBuf) -> Result<PathBuf, Refusal> {
    if p.is_absolute() {
        Ok(p)
    } else {
        Err(refuse(
            key,
            format!(
                "{} is not an absolute path (launchd expands neither ~ nor $HOME)",
                p.display()
            ),
        ))
    }
}

/// `agent_id`, by default from the host name.
pub(super) fn resolve_agent_id(raw: Option<String>, hostname: &str) -> Result<String, Refusal> {
    let agent_id = raw.unwrap_or_else(|| agent_id_from_hostname(hostname));
    check_agent_id(&agent_id).map_err(|e| refuse("agent_id", e.to_string()))?;
    Ok(agent_id)
}

/// `state_dir`, by default under `$HOME`.
pub(super) fn resolve_state_dir(raw: Option<PathBuf>, home: Option<&Path>) -> Result<PathBuf, Refusal> {
    match raw {
        Some(p) => absolute("state_dir", p),
        None => match home {
            Some(home) if home.is_absolute() => Ok(home.join("Library/Application Support/Tartan")),
            _ => Err(refuse(
                "state_dir",
                "not set and $HOME is unknown; set state_dir to an absolute path",
            )),
        },
    }
}

/// `context`, `namespaces` and `lease_namespace` (returned, `default` when not set).
pub(super) fn check_namespaces(
    context: Option<&str>,
    namespaces: &[String],
    lease_namespace: Option<String>,
) -> Result<String, Refusal> {
    if context == Some("") {
        return Err(refuse("context", "is empty; leave it out to use the current context"));
    }
    if namespaces.iter().any(String::is_empty) {
        return Err(refuse("namespaces", "contains an empty name"));
    }
    let lease_namespace = lease_namespace.unwrap_or_else(|| "default".into());
    if lease_namespace.is_empty() {
        return Err(refuse("lease_namespace", "is empty"));
    }
    Ok(lease_namespace)
}

pub(super) fn resolve_slots(raw: Option<i64>) -> Result<u8, Refusal> {
    match raw.unwrap_or(1) {
        n @ 1..=2 => Ok(n as u8),
        n if n > i64::from(MAX_SLOTS) => Err(refuse(
            "slots",
            format!("{n} is more than macOS allows: at most {MAX_SLOTS} macOS VMs run on one host"),
        )),
        n => Err(refuse("slots", format!("{n}: an agent needs 1 or 2 slots"))),
    }
}

pub(super) fn resolve_status_concurrency(raw: Option<i64>) -> Result<usize, Refusal> {
    match raw.unwrap_or(DEFAULT_STATUS_CONCURRENCY as i64) {
        n @ 1..=256 => Ok(n as usize),
        n => Err(refuse(
            "status_concurrency",
            format!("{n}: status writes in flight at once must be 1 to 256"),
        )),
    }
}

/// `tart`, `tart_home` and `vm_prefix`.
pub(super) fn resolve_tart(
    tart: Option<PathBuf>,
    tart_home: Option<PathBuf>,
    vm_prefix: Option<String>,
) -> Result<(PathBuf, Option<PathBuf>), Refusal> {
    let tart = tart.unwrap_or_else(|| PathBuf::from("tart"));
    // A bare program name is looked up on PATH; anything with a directory must be absolute.
    let tart = if tart.components().count() > 1 {
        absolute("tart", tart)?
    } else {
        tart
    };
    let tart_home = tart_home.map(|p| absolute("tart_home", p)).transpose()?;
    // The prefix is part of an on-disk contract shared with the watchdog and recovery (which
    // delete only `mb-` VMs and quarantine unaccounted ones): accept it spelt out, refuse
    // anything else rather than orphan or touch VMs the other parts do not expect.
    if let Some(prefix) = vm_prefix
        && prefix != VM_PREFIX
    {
        return Err(refuse(
            "vm_prefix",
            format!(
                "{prefix:?}: the VM prefix is fixed at {VM_PREFIX:?} (the watchdog and recovery only ever delete \
                 VMs with it); remove the key, or use a separate tart_home to keep agents apart"
            ),
        ));
    }
    Ok((tart, tart_home))
}

/// The agent's own folders: no artifact destination may be inside or around them. Tart's home is
/// the configured one or tart's default under $HOME (the runtime checks the resolved folders
/// again for each build).
pub(super) fn protected_folders(
    state_dir: &Path,
    tart_home: Option<&Path>,
    home: Option<&Path>,
) -> Vec<(&'static str, PathBuf)> {
    let mut protected: Vec<(&'static str, PathBuf)> = vec![("state_dir", state_dir.to_path_buf())];
    match (tart_home, home) {
        (Some(t), _) => protected.push(("tart_home", t.to_path_buf())),
        (None, Some(h)) if h.is_absolute() => protected.push(("tart_home", h.join(".tart"))),
        (None, _) => {}
    }
    protected
}

/// `[artifacts] destination` and `allowed_file_roots`; returns the folders artifacts are written
/// to, each with its key: no mount may overlap them (see [`check_mounts`]).
pub(super) fn check_artifact_folders(
    artifacts: &ArtifactsConfig,
    protected: &[(&'static str, PathBuf)],
) -> Result<Vec<(&'static str, PathBuf)>, Refusal> {
    let mut artifact_folders: Vec<(&'static str, PathBuf)> = Vec::new();
    if let Some(dest) = &artifacts.destination {
        match Destination::parse(dest) {
            Err(e) => {
                return Err(refuse(
                    "artifacts.destination",
                    format!("{e}; write s3://bucket/prefix/ or file:///absolute/dir/"),
                ));
            }
            Ok(Destination::File { dir }) => {
                if let Some(why) = overlaps(&dir, protected, true) {
                    return Err(refuse("artifacts.destination", why));
                }
                artifact_folders.push(("artifacts.destination", dir));
            }
            Ok(Destination::S3 { .. }) => {}
        }
    }
    for root in &artifacts.allowed_file_roots {
        let root = absolute("artifacts.allowed_file_roots", root.clone())?;
        if root.components().any(|c| c == std::path::Component::ParentDir) {
            return Err(refuse(
                "artifacts.allowed_file_roots",
                format!("{} contains '..'; write the folder plainly", root.display()),
            ));
        }
        // A root around the state dir is allowed (its other folders are fine); a destination
        // inside it that also holds the state dir is refused per build.
        if let Some(why) = overlaps(&root, protected, false) {
            return Err(refuse("artifacts.allowed_file_roots", why));
        }
        artifact_folders.push(("artifacts.allowed_file_roots", root));
    }
    Ok(artifact_folders)
}

/// `[artifacts] allowed_buckets`: each can name an S3 bucket.
pub(super) fn check_buckets(buckets: &[String]) -> Result<(), Refusal> {
    for bucket in buckets {
        check_bucket(bucket).map_err(|why| {
            refuse(
                "artifacts.allowed_buckets",
                format!("{bucket:?} cannot name an S3 bucket: it {why}"),
            )
        })?;
    }
    Ok(())
}

/// `network` and `softnet_allow`.
pub(super) fn resolve_network(mode: NetworkMode, softnet_allow: &[String]) -> Result<tartan_tart::RunNetwork, Refusal> {
    let mut allow = Vec::new();
    for cidr in softnet_allow {
        allow.push(
            cidr.parse::<tartan_tart::Ipv4Cidr>()
                .map_err(|e| refuse("softnet_allow", e))?,
        );
    }
    match mode {
        NetworkMode::Softnet => Ok(tartan_tart::RunNetwork::Softnet { allow }),
        NetworkMode::Shared if allow.is_empty() => Ok(tartan_tart::RunNetwork::Shared),
        NetworkMode::Shared => Err(refuse(
            "softnet_allow",
            "is set but network is \"shared\"; set network = \"softnet\" (the list only opens Softnet's isolation)",
        )),
    }
}

/// `mib` MiB (or GiB, with `unit` and `shift`) in bytes, refused when it does not fit in 64 bits.
pub(super) fn bytes_of(key: &'static str, n: u64, shift: u32, unit: &str) -> Result<u64, Refusal> {
    n.checked_mul(1 << shift)
        .ok_or_else(|| refuse(key, format!("{n} {unit} is more bytes than fit in 64 bits")))
}

impl LogsConfig {
    /// `[logs]`.
    pub(super) fn resolve(raw: RawLogs) -> Result<LogsConfig, Refusal> {
        let d = LogsConfig::default();
        let logs = LogsConfig {
            max_age: raw.max_age.map_or(d.max_age, |h| h.0),
            max_total_bytes: match raw.max_total_mib {
                None => d.max_total_bytes,
                Some(mib) => bytes_of("logs.max_total_mib", mib, 20, "MiB")?,
            },
            max_build_bytes: match raw.max_build_mib {
                None => d.max_build_bytes,
                Some(0) => return Err(refuse("logs.max_build_mib", "0 would keep no step output at all")),
                Some(mib) => bytes_of("logs.max_build_mib", mib, 20, "MiB")?,
            },
            ship_interval: raw.ship_interval.map_or(d.ship_interval, |h| h.0),
        };
        if !(Duration::from_secs(1)..=Duration::from_secs(60)).contains(&logs.ship_interval) {
            return Err(refuse(
                "logs.ship_interval",
                format!(
                    "{:?} must be 1s to 60s (a follower sees a running step's output one interval late)",
                    logs.ship_interval
                ),
            ));
        }
        if logs.max_age > MAX_LOG_AGE {
            return Err(refuse(
                "logs.max_age",
                format!(
                    "{}s is more than 365d: a VM's step logs would be kept for over a year",
                    logs.max_age.as_secs_f64()
                ),
            ));
        }
        Ok(logs)
    }
}

impl DiskConfig {
    /// `[disk]`.
    pub(super) fn resolve(raw: RawDisk) -> Result<DiskConfig, Refusal> {
        Ok(DiskConfig {
            min_free_bytes: match raw.min_free_gib {
                None => DiskConfig::default().min_free_bytes,
                Some(gib) => bytes_of("disk.min_free_gib", gib, 30, "GiB")?,
            },
        })
    }
}

/// `metrics_address`, `metrics_max_connections` and `metrics_idle_timeout`.
pub(super) fn resolve_metrics(
    address: Option<String>,
    max_connections: Option<i64>,
    idle_timeout: Option<HumaneDuration>,
) -> Result<(SocketAddr, tartan_serve::Limits), Refusal> {
    let address = match address {
        None => SocketAddr::from(([127, 0, 0, 1], 9464)),
        Some(a) => a.parse().map_err(|e| {
            refuse(
                "metrics_address",
                format!("{a:?} is not an address like 127.0.0.1:9464: {e}"),
            )
        })?,
    };
    let limits = tartan_serve::Limits {
        max_connections: match max_connections {
            None => tartan_serve::DEFAULT_MAX_CONNECTIONS,
            Some(n @ 1..=4096) => n as usize,
            Some(n) => {
                return Err(refuse(
                    "metrics_max_connections",
                    format!("{n}: connections held at once must be 1 to 4096"),
                ));
            }
        },
        idle_timeout: idle_timeout.map_or(tartan_serve::DEFAULT_IDLE_TIMEOUT, |h| h.0),
    };
    if !(Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&limits.idle_timeout) {
        return Err(refuse(
            "metrics_idle_timeout",
            format!(
                "{:?} must be 100ms to 1h (a connection without a finished request for this long is closed)",
                limits.idle_timeout
            ),
        ));
    }
    Ok((address, limits))
}

/// `[secrets] allowed`: each `namespace/name`, in a namespace this agent serves, listed once.
pub(super) fn check_secrets(secrets: &SecretsConfig, namespaces: &[String]) -> Result<(), Refusal> {
    let mut seen = std::collections::BTreeSet::new();
    for entry in &secrets.allowed {
        let (ns, _) = check_allowed_secret(entry).map_err(|e| refuse("secrets.allowed", e.to_string()))?;
        if !namespaces.is_empty() && !namespaces.iter().any(|n| n == ns) {
            return Err(refuse(
                "secrets.allowed",
                format!(
                    "{entry:?} is in namespace {ns:?}, which this agent does not serve (namespaces); a build \
                     reads only Secrets of its own namespace"
                ),
            ));
        }
        if !seen.insert(entry.as_str()) {
            return Err(refuse("secrets.allowed", format!("{entry:?} is listed twice")));
        }
    }
    Ok(())
}

/// Why `dir` may not hold artifacts: it is inside one of the `protected` folders (or, with
/// `around`, one is inside it). Compared as written, component by component, ignoring case (a
/// Mac's disk does: [`within_ignoring_case`]).
pub(super) fn overlaps(dir: &Path, protected: &[(&'static str, PathBuf)], around: bool) -> Option<String> {
    protected.iter().find_map(|(key, p)| {
        if within_ignoring_case(dir, p) {
            Some(format!(
                "{} is inside {key} {}; a MacBuild may never write into the agent's own folders",
                dir.display(),
                p.display()
            ))
        } else if around && within_ignoring_case(p, dir) {
            Some(format!(
                "{} holds {key} {}; a MacBuild may never write around the agent's own folders",
                dir.display(),
                p.display()
            ))
        } else {
            None
        }
    })
}

/// Checks `[[mounts]]`: unique names a MacBuild can ask for, host folders that are absolute,
/// plainly written (no `..`), existing, fit for tart's `--dir` syntax, not overlapping each other,
/// neither inside nor around the agent's own folders (`protected`, as for artifact destinations) nor the folders artifacts
/// go to (`artifact_folders`: the `file://` default destination and the allowed roots), each
/// checked as written and resolved. Returns them with their folders resolved.
///
/// A mount overlapping an artifact folder is refused read-only too: read-write, a build could
/// plant links there for the agent's writes to follow (into the state dir, another VM's files);
/// read-only, it could read every other build's artifacts.
pub(super) fn check_mounts(
    raw: Vec<RawMount>,
    protected: &[(&'static str, PathBuf)],
    artifact_folders: &[(&'static str, PathBuf)],
) -> Result<Vec<MountConfig>, Refusal> {
    let mut out: Vec<MountConfig> = Vec::new();
    for m in raw {
        tartan_api::crd::check_mount_name(&m.name).map_err(|why| refuse("mounts", why))?;
        if out.iter().any(|o| o.name == m.name) {
            return Err(refuse("mounts", format!("mount {:?} is declared twice", m.name)));
        }
        let at = |detail: String| refuse("mounts", format!("mount {:?}: host_path {}", m.name, detail));
        let written = m.host_path.clone();
        if !written.is_absolute() {
            return Err(at(format!(
                "{} is not an absolute path (launchd expands neither ~ nor $HOME)",
                written.display()
            )));
        }
        if written.components().any(|c| c == std::path::Component::ParentDir) {
            return Err(at(format!(
                "{} contains '..'; write the folder plainly",
                written.display()
            )));
        }
        let resolved = std::fs::canonicalize(&written)
            .map_err(|e| at(format!("{}: {e}; create the folder first", written.display())))?;
        if !resolved.is_dir() {
            return Err(at(format!("{} is not a folder", written.display())));
        }
        let resolved_protected: Vec<(&'static str, PathBuf)> = protected
            .iter()
            .map(|(k, p)| (*k, std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())))
            .collect();
        if let Some(detail) =
            overlaps(&written, protected, true).or_else(|| overlaps(&resolved, &resolved_protected, true))
        {
            return Err(at(detail));
        }
        for (key, folder) in artifact_folders {
            let folder_resolved = crate::real_path::resolve(folder).unwrap_or_else(|_| folder.clone());
            let relation = [(&written, folder), (&resolved, &folder_resolved)]
                .into_iter()
                .find_map(|(mount, folder)| {
                    if within_ignoring_case(mount, folder) {
                        Some("is inside")
                    } else if within_ignoring_case(folder, mount) {
                        Some("holds")
                    } else {
                        None
                    }
                });
            if let Some(relation) = relation {
                return Err(at(format!(
                    "{} {relation} {key} {}; a mount may not overlap a folder artifacts are written to (a build \
                     could plant links there for the agent's writes to follow, or read other builds' artifacts): \
                     move the mount or the artifact folder apart",
                    written.display(),
                    folder.display()
                )));
            }
        }
        // One strictly inside the other (the same folder twice, say read-write and read-only, is
        // the operator's choice: a share's own folder cannot be replaced from the guest).
        let nested = |o: &&MountConfig| {
            let (inside, around) = (
                within_ignoring_case(&resolved, &o.host_path),
                within_ignoring_case(&o.host_path, &resolved),
            );
            inside != around
        };
        if let Some(other) = out.iter().find(nested) {
            return Err(at(format!(
                "{} overlaps mount {:?} ({}); one mount may not be inside another (a build given the outer one \
                 could replace the inner one's folder with a link): move them apart",
                written.display(),
                other.name,
                other.host_path.display()
            )));
        }
        let share = tartan_tart::DirShare {
            name: m.name.clone(),
            path: resolved.clone(),
            read_only: m.read_only,
        };
        share.render().map_err(|e| at(format!("cannot be shared: {e}")))?;
        out.push(MountConfig {
            name: m.name,
            host_path: resolved,
            read_only: m.read_only,
        });
    }
    Ok(out)
}
