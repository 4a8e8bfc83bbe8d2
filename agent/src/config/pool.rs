//! The `[pool]` section: warm VMs booted ahead of builds (docs/warm-pool.md). Off unless
//! `images` lists one.

use super::*;
use crate::pool::{PoolEntry, PoolSpec, WarmProfile};

/// Default of `[pool] max_idle`: a warm VM older than this is deleted and replaced.
pub const DEFAULT_POOL_MAX_IDLE: Duration = Duration::from_secs(3600);

/// The shortest and longest `[pool] max_idle` accepted.
const MIN_POOL_MAX_IDLE: Duration = Duration::from_secs(10);
const MAX_POOL_MAX_IDLE: Duration = Duration::from_secs(7 * 24 * 3600);

/// `[pool]` as resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    pub spec: PoolSpec,
    /// A warm VM of an image the host does not hold may be cloned (tart pulls it first).
    pub prepull: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            spec: PoolSpec {
                entries: Vec::new(),
                max_idle: DEFAULT_POOL_MAX_IDLE,
                cold_slots: 0,
            },
            prepull: false,
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPool {
    #[serde(default)]
    images: Vec<RawPoolImage>,
    max_idle: Option<HumaneDuration>,
    #[serde(default)]
    prepull: bool,
    cold_slots: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPoolImage {
    image: String,
    size: Option<i64>,
    cpu: Option<i64>,
    memory_mib: Option<i64>,
}

impl PoolConfig {
    /// `[pool]`, for a host of `slots` slots (at most 2 are used) and its `local_images`.
    pub(super) fn resolve(raw: RawPool, slots: u8, local_images: &[String]) -> Result<PoolConfig, Refusal> {
        let usable = i64::from(slots.min(2));
        let cold_slots = raw.cold_slots.unwrap_or(0);
        if !(0..=usable).contains(&cold_slots) {
            return Err(refuse(
                "pool.cold_slots",
                format!("{cold_slots} is not between 0 and the {usable} slot(s) this host uses"),
            ));
        }
        let max_idle = raw.max_idle.map_or(DEFAULT_POOL_MAX_IDLE, |d| d.0);
        if !(MIN_POOL_MAX_IDLE..=MAX_POOL_MAX_IDLE).contains(&max_idle) {
            return Err(refuse("pool.max_idle", "must be between 10s and 7d"));
        }
        let mut entries: Vec<PoolEntry> = Vec::new();
        for (i, e) in raw.images.into_iter().enumerate() {
            let entry = resolve_entry(e).map_err(|why| refuse("pool.images", format!("entry {}: {why}", i + 1)))?;
            tartan_api::names::check_image(&entry.profile.image, local_images)
                .map_err(|why| refuse("pool.images", format!("entry {}: {why}", i + 1)))?;
            if entries.iter().any(|o| o.profile == entry.profile) {
                return Err(refuse(
                    "pool.images",
                    format!(
                        "entry {}: {} with these resources is listed twice; give one entry its size",
                        i + 1,
                        entry.profile.image
                    ),
                ));
            }
            entries.push(entry);
        }
        let total: i64 = entries.iter().map(|e| i64::from(e.size)).sum();
        if total > usable - cold_slots {
            return Err(refuse(
                "pool.images",
                format!(
                    "the sizes add up to {total} warm VM(s), more than the {} slot(s) left after cold_slots = {cold_slots} \
                     on a host of {usable} slot(s)",
                    usable - cold_slots
                ),
            ));
        }
        Ok(PoolConfig {
            spec: PoolSpec {
                entries,
                max_idle,
                cold_slots: u8::try_from(cold_slots).unwrap_or(0),
            },
            prepull: raw.prepull,
        })
    }
}

/// One `[[pool.images]]` entry: its image, size (1 or 2, default 1) and resources (the CRD's
/// ranges: 1–64 CPUs, 2048–1048576 MiB).
fn resolve_entry(e: RawPoolImage) -> Result<PoolEntry, String> {
    let size = e.size.unwrap_or(1);
    if !(1..=2).contains(&size) {
        return Err(format!("size {size} is not 1 or 2 (a Mac runs at most two VMs)"));
    }
    let within = |what: &str, v: Option<i64>, lo: i64, hi: i64| -> Result<Option<u32>, String> {
        match v {
            None => Ok(None),
            Some(v) if (lo..=hi).contains(&v) => Ok(u32::try_from(v).ok()),
            Some(v) => Err(format!("{what} {v} is not between {lo} and {hi}")),
        }
    };
    let cpu = within("cpu", e.cpu, 1, 64)?;
    let memory_mib = within("memory_mib", e.memory_mib, 2048, 1_048_576)?;
    if e.image.trim().is_empty() {
        return Err("image is empty".to_string());
    }
    Ok(PoolEntry {
        profile: WarmProfile::new(&e.image, cpu, memory_mib),
        size: u8::try_from(size).unwrap_or(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(text: &str, slots: u8) -> Result<PoolConfig, Refusal> {
        let raw: RawPool = toml::from_str(text).expect("parses");
        PoolConfig::resolve(raw, slots, &[])
    }

    #[test]
    fn off_by_default_and_entries_resolve_with_their_defaults() {
        assert_eq!(pool("", 2).unwrap(), PoolConfig::default());
        let p = pool(
            r#"images = [{ image = "ghcr.io/cirruslabs/macos-sequoia-xcode:16", cpu = 4, memory_mib = 8192 }]
               max_idle = "30m"
               prepull = true"#,
            2,
        )
        .unwrap();
        assert_eq!(p.spec.entries.len(), 1);
        assert_eq!(p.spec.entries[0].size, 1);
        assert_eq!(p.spec.entries[0].profile.cpu, Some(4));
        assert_eq!(p.spec.max_idle, Duration::from_secs(1800));
        assert!(p.prepull);
    }

    #[test]
    fn refuses_what_cannot_be_kept_warm_and_names_the_key() {
        let img = r#"image = "ghcr.io/x/y:1""#;
        for (text, slots, key, says) in [
            (
                format!("images = [{{ {img}, size = 3 }}]"),
                2,
                "pool.images",
                "not 1 or 2",
            ),
            (
                format!("images = [{{ {img}, size = 2 }}]"),
                1,
                "pool.images",
                "more than the 1 slot",
            ),
            (
                format!("images = [{{ {img} }}]\ncold_slots = 2"),
                2,
                "pool.images",
                "more than the 0 slot",
            ),
            (
                format!("images = [{{ {img} }}, {{ {img} }}]"),
                2,
                "pool.images",
                "listed twice",
            ),
            (format!("images = [{{ {img}, cpu = 0 }}]"), 2, "pool.images", "cpu 0"),
            (
                format!("images = [{{ {img}, memory_mib = 1024 }}]"),
                2,
                "pool.images",
                "memory_mib 1024",
            ),
            (
                "images = [{ image = \"ubuntu;rm\" }]".to_string(),
                2,
                "pool.images",
                "entry 1",
            ),
            (
                "cold_slots = 3".to_string(),
                2,
                "pool.cold_slots",
                "between 0 and the 2",
            ),
            (
                "max_idle = \"9s\"".to_string(),
                2,
                "pool.max_idle",
                "between 10s and 7d",
            ),
        ] {
            let refused = pool(&text, slots).expect_err(&text);
            assert_eq!(refused.key, key, "{text}");
            assert!(refused.why.contains(says), "{text}: {}", refused.why);
        }
    }
}
