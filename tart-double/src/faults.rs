//! Fault injection and tunables of `tart-double`, read from `$TART_HOME/double-faults.json` on every invocation
//! (so a test can change them while an agent is running).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// File name of the fault file inside `TART_HOME`.
pub const FAULTS_FILE: &str = "double-faults.json";

/// One set of faults. Unset fields fall back to the global set (for a VM entry) or to "no fault".
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// `delete` of the VM fails with exit 1 and an `Error: …` message, leaving the VM in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_fails: Option<bool>,
    /// `clone` onto the VM sleeps this long while holding the global lock and its temp dir lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_delay_secs: Option<f64>,
    /// `clone` onto the VM sleeps this long between creating its `tmp/<uuid>` and locking it (a
    /// window real tart has too, see the module documentation of `double`), so a concurrent
    /// command's garbage collection removes it and the clone fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_tmp_unlocked_secs: Option<f64>,
    /// `exec` in the VM hangs (without running the command) until this fault is lifted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_hangs: Option<bool>,
    /// `run` of the VM kills itself with SIGKILL this long after taking the VM lock (a crashed VM process).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_dies_after_secs: Option<f64>,
    /// The guest agent answers `exec` (and `ip` finds an address) only this long after `run` started.
    /// Overrides `TART_DOUBLE_BOOT_DELAY_SECS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_delay_secs: Option<f64>,
    /// `delete` of the VM sleeps this long before touching anything (holding no lock, so it can be killed
    /// mid-way), then proceeds normally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_delay_secs: Option<f64>,
}

impl Fault {
    /// `self` with every unset field taken from `fallback`.
    pub fn or(&self, fallback: &Fault) -> Fault {
        Fault {
            delete_fails: self.delete_fails.or(fallback.delete_fails),
            clone_delay_secs: self.clone_delay_secs.or(fallback.clone_delay_secs),
            clone_tmp_unlocked_secs: self.clone_tmp_unlocked_secs.or(fallback.clone_tmp_unlocked_secs),
            exec_hangs: self.exec_hangs.or(fallback.exec_hangs),
            run_dies_after_secs: self.run_dies_after_secs.or(fallback.run_dies_after_secs),
            boot_delay_secs: self.boot_delay_secs.or(fallback.boot_delay_secs),
            delete_delay_secs: self.delete_delay_secs.or(fallback.delete_delay_secs),
        }
    }
}

/// The whole fault file: `{"global": {...}, "vms": {"mb-x": {...}}}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    #[serde(default)]
    pub global: Fault,
    #[serde(default)]
    pub vms: BTreeMap<String, Fault>,
}

impl Faults {
    /// `<home>/double-faults.json`.
    pub fn path(home: &Path) -> PathBuf {
        home.join(FAULTS_FILE)
    }

    /// Reads the fault file; a missing file means no faults.
    pub fn load(home: &Path) -> Result<Faults, String> {
        let path = Self::path(home);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| format!("tart-double: fault file {} is not valid: {e}", path.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Faults::default()),
            Err(e) => Err(format!("tart-double: cannot read fault file {}: {e}", path.display())),
        }
    }

    /// Writes the fault file atomically (temp file + rename), so a concurrent `tart-double` never reads half.
    pub fn store(&self, home: &Path) -> io::Result<()> {
        let path = Self::path(home);
        let tmp = home.join(format!(".{FAULTS_FILE}.{}.tmp", uuid::Uuid::new_v4().simple()));
        std::fs::write(&tmp, serde_json::to_vec_pretty(self).map_err(io::Error::other)?)?;
        std::fs::rename(&tmp, &path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }

    /// The faults that apply to `vm`: its own entry, then the global one.
    pub fn for_vm(&self, vm: &str) -> Fault {
        match self.vms.get(vm) {
            Some(f) => f.or(&self.global),
            None => self.global.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_entry_overrides_global_field_by_field() {
        let faults: Faults = serde_json::from_str(
            r#"{"global": {"boot_delay_secs": 5, "delete_fails": true, "delete_delay_secs": 2}, "vms": {"mb-x": {"delete_fails": false, "delete_delay_secs": 0.5}}}"#,
        )
        .unwrap();
        let x = faults.for_vm("mb-x");
        assert_eq!(x.delete_fails, Some(false));
        assert_eq!(x.boot_delay_secs, Some(5.0));
        assert_eq!(x.delete_delay_secs, Some(0.5));
        assert_eq!(faults.for_vm("mb-y").delete_delay_secs, Some(2.0));
        assert_eq!(faults.for_vm("mb-y").delete_fails, Some(true));
        assert!(serde_json::from_str::<Faults>(r#"{"global": {"typo": 1}}"#).is_err());
    }

    #[test]
    fn store_then_load_round_trips_and_missing_is_empty() {
        let home = tempfile::tempdir().unwrap();
        assert_eq!(Faults::load(home.path()).unwrap(), Faults::default());
        let mut f = Faults::default();
        f.vms.insert(
            "mb-x".into(),
            Fault {
                exec_hangs: Some(true),
                ..Fault::default()
            },
        );
        f.store(home.path()).unwrap();
        assert_eq!(Faults::load(home.path()).unwrap(), f);
        std::fs::write(Faults::path(home.path()), "{").unwrap();
        assert!(Faults::load(home.path()).unwrap_err().contains("not valid"));
    }
}
