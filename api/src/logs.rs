//! Where an attempt's step logs are shipped, as the agent writes them and `kubectl tartan logs`
//! reads them (pure; no I/O).
//!
//! Under the build's artifact destination each attempt has its own folder, `<dest>/<vm>/logs/`
//! (the VM name carries the build and the attempt). While the build runs the agent adds the new
//! bytes of each host step log `<step>.log` as numbered parts, `<step>.log.part000001`,
//! `<step>.log.part000002`, …: S3 cannot append to an object and rewriting a whole log every few
//! seconds costs its size each time, so parts are written once and never changed, on S3 and on a
//! `file://` folder alike. The step's output is the parts' bytes in number order. When the attempt
//! ends (whatever the outcome) the agent writes the whole log once more as `<step>.log`; that
//! object exists only once the step's log is complete.

/// The folder of an attempt's logs under its destination.
pub const LOGS_FOLDER: &str = "logs";

/// Digits of a part number: parts sort by name in number order up to 999999.
pub const PART_DIGITS: usize = 6;

/// `<vm>/logs/`: the key prefix (relative to the destination) of attempt `vm`'s logs.
pub fn logs_prefix(vm: &str) -> String {
    format!("{vm}/{LOGS_FOLDER}/")
}

/// The name of the whole log of `step` (a host log's file stem): `<step>.log`.
pub fn whole_name(step: &str) -> String {
    format!("{step}.log")
}

/// The name of part `n` (1-based) of `step`'s log: `<step>.log.partNNNNNN`.
pub fn part_name(step: &str, n: u32) -> String {
    format!("{step}.log.part{n:0width$}", width = PART_DIGITS)
}

/// One object of an attempt's logs folder.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogObject {
    /// `<step>.log`: the whole log, written when the attempt ended.
    Whole { step: String },
    /// `<step>.log.partNNNNNN`: part `n` of the log, written while it ran.
    Part { step: String, n: u32 },
}

impl LogObject {
    pub fn step(&self) -> &str {
        match self {
            LogObject::Whole { step } | LogObject::Part { step, .. } => step,
        }
    }
}

/// Longest step name kept in a log file name (the file name stays within 255 bytes).
pub const STEP_LOG_NAME_MAX: usize = 100;

/// `name` as one harmless path component, as the agent names a step's host log and its guest job
/// folder: characters other than ASCII letters, digits, `-` and `_` become `_` (so no `/`, no `.`,
/// no `..`), cut to [`STEP_LOG_NAME_MAX`] characters. Readers map a spec step name the same way.
pub fn safe_name(name: &str) -> String {
    name.chars()
        .take(STEP_LOG_NAME_MAX)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Whether `step` can name a step log: ASCII letters, digits, `-` and `_` (what the agent's host
/// log names are made of), 1 to 100 of them.
pub fn is_step_log_name(step: &str) -> bool {
    (1..=STEP_LOG_NAME_MAX).contains(&step.len())
        && step
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Reads an object name of the logs folder (no `/`); `None` for anything else (temp files,
/// foreign objects), which readers skip.
pub fn parse_object_name(name: &str) -> Option<LogObject> {
    if let Some(step) = name.strip_suffix(".log") {
        return is_step_log_name(step).then(|| LogObject::Whole { step: step.to_string() });
    }
    let (log, number) = name.rsplit_once(".part")?;
    let step = log.strip_suffix(".log")?;
    if !is_step_log_name(step) || number.len() < PART_DIGITS || !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u32 = number.parse().ok()?;
    (n >= 1).then(|| LogObject::Part {
        step: step.to_string(),
        n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_strangers_are_skipped() {
        assert_eq!(logs_prefix("mb-ci-b-1"), "mb-ci-b-1/logs/");
        assert_eq!(part_name("build", 7), "build.log.part000007");
        assert_eq!(part_name("build", 1_234_567), "build.log.part1234567");
        for (step, n) in [("build", 1), ("_checkout", 42), ("a-b_c", 999_999), ("x", 1_234_567)] {
            assert_eq!(
                parse_object_name(&part_name(step, n)),
                Some(LogObject::Part { step: step.into(), n })
            );
        }
        assert_eq!(
            parse_object_name(&whole_name("_tart-run")),
            Some(LogObject::Whole {
                step: "_tart-run".into()
            })
        );
        // Parts sort by name in number order (the width is fixed).
        let mut names: Vec<String> = [10, 2, 1, 100].iter().map(|n| part_name("s", *n)).collect();
        names.sort();
        assert_eq!(
            names,
            [
                "s.log.part000001",
                "s.log.part000002",
                "s.log.part000010",
                "s.log.part000100"
            ]
        );
        for stranger in [
            ".build.log.12.part",
            "build.log.part",
            "build.log.part12",
            "build.log.part000000",
            "build.log.part0000x1",
            "build.log.follow",
            "build.txt",
            ".log",
            "a/b.log",
            "../x.log",
            "build.log.part-00001",
        ] {
            assert_eq!(parse_object_name(stranger), None, "{stranger}");
        }
        assert!(!is_step_log_name(&"s".repeat(101)));
    }
}
