//! A LaunchAgent property list (launchd.plist(5)), written and read with the `plist` crate.
//!
//! Only the keys Tartan uses are modelled. Keys are PascalCase as launchd spells them; an `Option`
//! that is `None` is left out of the file (a plist has no null), so launchd applies its default.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::Error;

/// One LaunchAgent job: the content of `~/Library/LaunchAgents/<Label>.plist`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct LaunchAgent {
    /// Unique job name; the file must be named `<Label>.plist`.
    pub label: String,
    /// The argv launchd hands to execvp: absolute paths, since launchd expands neither `~` nor `$HOME`.
    pub program_arguments: Vec<String>,
    /// Start the job as soon as it is loaded (and again when a `gui/<uid>` session is recreated).
    pub run_at_load: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive: Option<KeepAlive>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_type: Option<ProcessType>,
    /// Seconds between SIGTERM and SIGKILL when launchd stops the job (launchd's default: 20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_time_out: Option<u32>,
    /// Minimum seconds between two spawns (launchd's default: 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle_interval: Option<u32>,
    /// Soft resource limits launchd sets before starting the job (setrlimit(2)); launchd's own
    /// soft limit on open files is 256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soft_resource_limits: Option<ResourceLimits>,
    /// When unset (false), launchd kills every process left in the job's process group when the
    /// job dies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abandon_process_group: Option<bool>,
    /// `Aqua` loads the job only into a GUI login session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_load_to_session_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_directory: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub environment_variables: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standard_out_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standard_error_path: Option<String>,
}

/// `KeepAlive`: `<true/>`/`<false/>`, or a dictionary of conditions (ORed by launchd).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum KeepAlive {
    Always(bool),
    Conditions(KeepAliveConditions),
}

/// The `KeepAlive` conditions Tartan may use; any one that holds restarts the job.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct KeepAliveConditions {
    /// `false`: restart after a non-zero exit (and imply RunAtLoad).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub successful_exit: Option<bool>,
    /// `true`: restart after the job was killed by a crash signal (SIGSEGV, SIGILL, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crashed: Option<bool>,
}

/// `SoftResourceLimits` / `HardResourceLimits`: the limits Tartan sets (others keep launchd's).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ResourceLimits {
    /// `RLIMIT_NOFILE`: how many file descriptors the job may hold open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number_of_files: Option<u64>,
}

/// `ProcessType`: how much launchd throttles the job's CPU and I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProcessType {
    /// Heavier resource limits than `Standard`.
    Background,
    /// The default: light resource limits.
    Standard,
    /// Resource limits depend on XPC activity.
    Adaptive,
    /// No throttling, as for an app in front of the user.
    Interactive,
}

impl LaunchAgent {
    /// The file name launchd expects: `<Label>.plist`.
    pub fn file_name(&self) -> String {
        format!("{}.plist", self.label)
    }

    /// The Apple-DTD XML form (tab-indented, trailing newline), as written to disk.
    pub fn to_xml(&self) -> Result<Vec<u8>, Error> {
        let mut xml = Vec::new();
        plist::to_writer_xml(&mut xml, self).map_err(|source| Error::Serialize {
            label: self.label.clone(),
            source,
        })?;
        if xml.last() != Some(&b'\n') {
            xml.push(b'\n');
        }
        Ok(xml)
    }

    /// [`to_xml`](Self::to_xml) with an XML comment right after the `<plist>` tag, for people who
    /// open the file. Readers ignore it. A comment may not contain `--`.
    pub fn to_xml_with_comment(&self, comment: &str) -> Result<Vec<u8>, Error> {
        let xml = self.to_xml()?;
        const TAG: &[u8] = b"<plist version=\"1.0\">\n";
        let at = xml
            .windows(TAG.len())
            .position(|w| w == TAG)
            .map(|i| i + TAG.len())
            .filter(|_| !comment.contains("--"))
            .ok_or_else(|| Error::Comment {
                label: self.label.clone(),
            })?;
        let mut out = xml[..at].to_vec();
        out.extend_from_slice(format!("<!--\n{}\n-->\n", comment.trim_end()).as_bytes());
        out.extend_from_slice(&xml[at..]);
        Ok(out)
    }

    /// Parse a LaunchAgent plist (XML or binary); `what` names the source in the error.
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Self, Error> {
        plist::from_bytes(bytes).map_err(|source| Error::Parse {
            what: what.to_owned(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minimal() -> LaunchAgent {
        LaunchAgent {
            label: "dev.tartan.test".into(),
            program_arguments: vec!["/bin/sleep".into(), "60".into()],
            run_at_load: true,
            keep_alive: None,
            process_type: None,
            exit_time_out: None,
            throttle_interval: None,
            soft_resource_limits: None,
            abandon_process_group: None,
            limit_load_to_session_type: None,
            working_directory: None,
            environment_variables: BTreeMap::new(),
            standard_out_path: None,
            standard_error_path: None,
        }
    }

    #[test]
    fn none_fields_are_left_out_of_the_xml() {
        let xml = String::from_utf8(minimal().to_xml().unwrap()).unwrap();
        for key in ["Label", "ProgramArguments", "RunAtLoad"] {
            assert!(xml.contains(&format!("<key>{key}</key>")), "{key} missing in:\n{xml}");
        }
        for key in [
            "KeepAlive",
            "ProcessType",
            "ExitTimeOut",
            "SoftResourceLimits",
            "AbandonProcessGroup",
            "EnvironmentVariables",
        ] {
            assert!(!xml.contains(key), "{key} should be absent when unset:\n{xml}");
        }
        assert!(xml.starts_with("<?xml"), "{xml}");
        assert!(
            xml.contains("<!DOCTYPE plist PUBLIC \"-//Apple//DTD PLIST 1.0//EN\""),
            "{xml}"
        );
    }

    #[test]
    fn keep_alive_is_a_bool_or_a_dictionary() {
        let mut job = minimal();
        job.keep_alive = Some(KeepAlive::Always(true));
        let xml = String::from_utf8(job.to_xml().unwrap()).unwrap();
        assert!(xml.contains("<key>KeepAlive</key>\n\t<true/>"), "{xml}");
        assert_eq!(LaunchAgent::from_bytes(xml.as_bytes(), "test").unwrap(), job);

        job.keep_alive = Some(KeepAlive::Conditions(KeepAliveConditions {
            successful_exit: Some(false),
            crashed: Some(true),
        }));
        job.process_type = Some(ProcessType::Background);
        let xml = String::from_utf8(job.to_xml().unwrap()).unwrap();
        assert!(xml.contains("<key>KeepAlive</key>\n\t<dict>"), "{xml}");
        assert!(xml.contains("<key>SuccessfulExit</key>\n\t\t<false/>"), "{xml}");
        assert!(xml.contains("<key>Crashed</key>\n\t\t<true/>"), "{xml}");
        assert!(
            xml.contains("<key>ProcessType</key>\n\t<string>Background</string>"),
            "{xml}"
        );
        assert_eq!(LaunchAgent::from_bytes(xml.as_bytes(), "test").unwrap(), job);
    }

    #[test]
    fn a_comment_is_placed_inside_the_plist_element_and_ignored_by_the_reader() {
        let job = minimal();
        let xml = job.to_xml_with_comment("  why: because\n  more").unwrap();
        let text = String::from_utf8(xml.clone()).unwrap();
        assert!(
            text.contains("<plist version=\"1.0\">\n<!--\n  why: because\n  more\n-->\n<dict>"),
            "{text}"
        );
        assert_eq!(LaunchAgent::from_bytes(&xml, "test").unwrap(), job);
        assert!(job.to_xml_with_comment("a -- b").is_err());
    }

    #[test]
    fn a_plist_without_label_is_refused_with_its_source_named() {
        let xml = b"<?xml version=\"1.0\"?><plist version=\"1.0\"><dict><key>RunAtLoad</key><true/></dict></plist>";
        let err = LaunchAgent::from_bytes(xml, "/tmp/x.plist").unwrap_err().to_string();
        assert!(err.contains("/tmp/x.plist"), "{err}");
    }
}
