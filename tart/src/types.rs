//! tart's JSON output, with tart's exact field names (`tart list --format json`, `tart get NAME --format json`).

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// A VM's state as tart reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Running,
    Suspended,
    Stopped,
    /// A state this crate does not know (a newer tart).
    #[serde(other)]
    Unknown,
}

/// One entry of `tart list --format json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct VmListEntry {
    /// `"local"` or `"OCI"`.
    pub source: String,
    pub name: String,
    /// Disk size in whole GB (apparent size).
    pub disk: u64,
    /// Allocated size on disk in whole GB.
    pub size: u64,
    /// Last access, ISO-8601 UTC (absent in tart ≤ 2.30, which printed `SizeOnDisk` instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accessed: Option<String>,
    pub running: bool,
    pub state: VmState,
}

impl VmListEntry {
    /// True for VMs in `vms/` (as opposed to OCI cache entries).
    pub fn is_local(&self) -> bool {
        self.source == "local"
    }

    /// `Accessed` parsed, if present and well-formed.
    pub fn accessed_at(&self) -> Option<Timestamp> {
        self.accessed.as_deref()?.parse().ok()
    }
}

/// `tart get NAME --format json`. Newer tart versions add fields (e.g. `VideoToolbox`); they are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    /// `darwin` or `linux`.
    #[serde(rename = "OS")]
    pub os: String,
    #[serde(rename = "CPU")]
    pub cpu: u32,
    /// Memory in MB.
    #[serde(rename = "Memory")]
    pub memory: u64,
    /// Disk size in whole GB.
    #[serde(rename = "Disk")]
    pub disk: u64,
    /// `raw` or `asif`.
    #[serde(rename = "DiskFormat", default, skip_serializing_if = "Option::is_none")]
    pub disk_format: Option<String>,
    /// Allocated size in GB, formatted `"%.3f"` (a string in tart's output).
    #[serde(rename = "Size")]
    pub size: String,
    /// `"WxH"`.
    #[serde(rename = "Display")]
    pub display: String,
    #[serde(rename = "Running")]
    pub running: bool,
    #[serde(rename = "State")]
    pub state: VmState,
}
