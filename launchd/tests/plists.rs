//! The generated plists parse as LaunchAgents both with the `plist` crate and with Python's
//! `plistlib` (a second, independent reader), and the copies shipped in `launchd/` match the code.
//!
//! If the shipped copies drift, regenerate them with
//! `TARTAN_BLESS=1 cargo test -p tartan-launchd --test plists` and review the diff.

use std::path::{Path, PathBuf};
use std::process::Command;

use tartan_launchd::tartan::{self, Layout};
use tartan_launchd::{KeepAlive, LaunchAgent, ProcessType};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn test_layout() -> Layout {
    let home = Path::new("/Users/ci user");
    Layout {
        binary: "/opt/homebrew/bin/tartan-agent".into(),
        config: "/Users/ci user/.config/tartan/agent.toml".into(),
        state_dir: Layout::default_state_dir(home),
        log_dir: Layout::default_log_dir(home),
    }
}

#[test]
fn plists_round_trip_through_the_plist_crate() {
    for job in tartan::jobs(&test_layout()).unwrap() {
        let xml = tartan::render(&job).unwrap();
        assert_eq!(LaunchAgent::from_bytes(&xml, &job.label).unwrap(), job);
        // And through the untyped reader: nothing extra, nothing missing.
        let value: plist::Value = plist::from_bytes(&xml).unwrap();
        let dict = value.as_dictionary().unwrap();
        let mut keys: Vec<_> = dict.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "EnvironmentVariables",
                "ExitTimeOut",
                "KeepAlive",
                "Label",
                "LimitLoadToSessionType",
                "ProcessType",
                "ProgramArguments",
                "RunAtLoad",
                "SoftResourceLimits",
                "StandardErrorPath",
                "StandardOutPath",
            ],
            "{}: AbandonProcessGroup must stay unset",
            job.label
        );
        assert_eq!(dict["KeepAlive"].as_boolean(), Some(true));
        assert_eq!(dict["RunAtLoad"].as_boolean(), Some(true));
        let limits = dict["SoftResourceLimits"].as_dictionary().unwrap();
        assert_eq!(
            limits["NumberOfFiles"].as_signed_integer(),
            Some(8192),
            "{}: launchd's default of 256 open files is too few",
            job.label
        );
    }
}

/// Python's plistlib reads the XML and prints it back as JSON (`sort_keys`, so the text is stable).
fn plistlib(xml_path: &Path) -> String {
    let script = "import json, plistlib, sys\n\
                  with open(sys.argv[1], 'rb') as f:\n    d = plistlib.load(f)\n\
                  print(json.dumps(d, sort_keys=True))";
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(xml_path)
        .output()
        .unwrap_or_else(|e| panic!("could not run python3 (needed to cross-check the plists): {e}"));
    assert!(
        out.status.success(),
        "plistlib refused {}: {}",
        xml_path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The JSON Python prints (`json.dumps(..., sort_keys=True)`) for a Tartan job.
fn expected_json(job: &LaunchAgent) -> String {
    let args = job
        .program_arguments
        .iter()
        .map(|a| json_str(a))
        .collect::<Vec<_>>()
        .join(", ");
    let process_type = match job.process_type.unwrap() {
        ProcessType::Interactive => "Interactive",
        ProcessType::Background => "Background",
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(job.keep_alive, Some(KeepAlive::Always(true)));
    format!(
        "{{\"EnvironmentVariables\": {{\"PATH\": {path}}}, \"ExitTimeOut\": {exit}, \"KeepAlive\": true, \
         \"Label\": {label}, \"LimitLoadToSessionType\": \"Aqua\", \"ProcessType\": \"{process_type}\", \
         \"ProgramArguments\": [{args}], \"RunAtLoad\": true, \
         \"SoftResourceLimits\": {{\"NumberOfFiles\": {files}}}, \"StandardErrorPath\": {err}, \
         \"StandardOutPath\": {out}}}",
        path = json_str(tartan::PATH),
        exit = job.exit_time_out.unwrap(),
        label = json_str(&job.label),
        files = tartan::SOFT_NUMBER_OF_FILES,
        err = json_str(job.standard_error_path.as_deref().unwrap()),
        out = json_str(job.standard_out_path.as_deref().unwrap()),
    )
}

#[test]
fn plists_parse_with_python_plistlib() {
    let dir = tempfile::tempdir().unwrap();
    let [agent, watchdog] = tartan::jobs(&test_layout()).unwrap();
    for job in [&agent, &watchdog] {
        let path = dir.path().join(job.file_name());
        std::fs::write(&path, tartan::render(job).unwrap()).unwrap();
        assert_eq!(plistlib(&path), expected_json(job), "{}", job.label);
    }
    // Spot-check the values the design fixes, as Python sees them.
    let agent_json = expected_json(&agent);
    assert!(agent_json.contains("\"ProgramArguments\": [\"/opt/homebrew/bin/tartan-agent\", \"run\", \"--config\", \"/Users/ci user/.config/tartan/agent.toml\"]"));
    assert!(agent_json.contains("\"ProcessType\": \"Interactive\"") && agent_json.contains("\"ExitTimeOut\": 60"));
    let watchdog_json = expected_json(&watchdog);
    assert!(
        watchdog_json.contains("\"watchdog\", \"--state-dir\", \"/Users/ci user/Library/Application Support/Tartan\"]")
    );
    assert!(watchdog_json.contains("\"ProcessType\": \"Background\""));
}

#[test]
fn shipped_plists_match_the_code() {
    let bless = std::env::var_os("TARTAN_BLESS").is_some_and(|v| v == "1");
    let mut drifted = Vec::new();
    for job in tartan::jobs(&Layout::canonical()).unwrap() {
        let path = crate_dir().join(job.file_name());
        let want = tartan::render(&job).unwrap();
        if bless {
            std::fs::write(&path, &want).unwrap();
        }
        let have = std::fs::read(&path).unwrap_or_default();
        if have == want {
            // The shipped file must be readable by plistlib too.
            plistlib(&path);
        } else {
            drifted.push(path.display().to_string());
        }
    }
    assert!(
        drifted.is_empty(),
        "{} differ from what launchd/src/tartan.rs generates for Layout::canonical(); regenerate with \
         `TARTAN_BLESS=1 cargo test -p tartan-launchd --test plists` and review the diff",
        drifted.join(", ")
    );
}
