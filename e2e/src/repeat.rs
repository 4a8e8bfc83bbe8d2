//! The summary of `scripts/e2e --repeat N`: per scenario, how many of its N runs passed, and the
//! median (the lower one for an even count) and longest run time.

/// One run of a scenario, as `scripts/e2e` records it.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    pub scenario: String,
    pub passed: bool,
    pub secs: f64,
}

/// Reads one record line, `NAME passed|FAILED SECONDS`.
pub fn parse_run(line: &str) -> Result<Run, String> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [scenario, status, secs] = fields[..] else {
        return Err(format!("{line:?} is not `NAME passed|FAILED SECONDS`"));
    };
    let passed = match status {
        "passed" => true,
        "FAILED" => false,
        other => return Err(format!("{line:?}: {other:?} is neither passed nor FAILED")),
    };
    let secs = secs
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .ok_or_else(|| format!("{line:?}: {secs:?} is not a number of seconds"))?;
    Ok(Run {
        scenario: scenario.to_string(),
        passed,
        secs,
    })
}

/// The table printed after the runs: a header, then one line per scenario in the order of its
/// first run: `passes/runs`, p50 and max seconds (one decimal).
pub fn summary(runs: &[Run], per_scenario: usize) -> String {
    let mut order: Vec<&str> = Vec::new();
    for r in runs {
        if !order.contains(&r.scenario.as_str()) {
            order.push(&r.scenario);
        }
    }
    let mut out = format!("{:<28} {:>9} {:>8} {:>8}\n", "scenario", "passes", "p50_s", "max_s");
    for name in order {
        let mut times: Vec<f64> = runs.iter().filter(|r| r.scenario == name).map(|r| r.secs).collect();
        times.sort_by(f64::total_cmp);
        let passes = runs.iter().filter(|r| r.scenario == name && r.passed).count();
        // The lower median: the middle run, or the first of the two middle ones.
        let p50 = times[times.len().div_ceil(2) - 1];
        let max = times[times.len() - 1];
        let passes = format!("{passes}/{per_scenario}");
        out.push_str(&format!("{name:<28} {passes:>9} {p50:>8.1} {max:>8.1}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(scenario: &str, passed: bool, secs: f64) -> Run {
        Run {
            scenario: scenario.into(),
            passed,
            secs,
        }
    }

    #[test]
    fn record_lines_parse_or_say_why_not() {
        assert_eq!(parse_run("happy-path passed 3.4"), Ok(run("happy-path", true, 3.4)));
        assert_eq!(parse_run("mac-sleep FAILED 61.0"), Ok(run("mac-sleep", false, 61.0)));
        for (bad, why) in [
            ("happy-path passed", "is not `NAME"),
            ("happy-path ok 3.4", "neither passed nor FAILED"),
            ("happy-path passed soon", "not a number of seconds"),
            ("happy-path passed -1", "not a number of seconds"),
        ] {
            let err = parse_run(bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn summary_has_passes_the_lower_median_and_the_max_per_scenario_in_run_order() {
        let runs = [
            run("b", true, 4.0),
            run("b", false, 1.5),
            run("b", true, 2.0),
            run("b", true, 9.25),
            run("a", true, 3.0),
        ];
        assert_eq!(
            summary(&runs, 4),
            "scenario                        passes    p50_s    max_s\n\
             b                                  3/4      2.0      9.2\n\
             a                                  1/4      3.0      3.0\n"
        );
        // One run: it is the median and the max.
        assert_eq!(
            summary(&[run("x", false, 7.0)], 1).lines().nth(1),
            Some("x                                  0/1      7.0      7.0")
        );
    }
}
