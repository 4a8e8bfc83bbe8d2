//! `scripts/e2e` finds the scenarios in their files: a `// scenario: NAME [FLAG]...` line above a
//! test, or a `//! scenario: NAME [FLAG]...` line in a file's header for all of its tests. This
//! checks that every test of this binary is one of them (a test without its line could never be
//! run by name, nor by `scripts/e2e all`) and that every scenario names a test that exists.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

fn stdout_of(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

#[test]
fn every_test_is_a_scenario_and_every_scenario_names_a_test() {
    let exe = std::env::current_exe().expect("the test binary's path");
    let listed = stdout_of(Command::new(&exe).args(["--list", "--format", "terse"]));
    let tests: BTreeSet<&str> = listed.lines().filter_map(|l| l.strip_suffix(": test")).collect();
    assert!(tests.len() > 50, "too few tests listed: {listed}");

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/e2e");
    let table = stdout_of(Command::new("bash").arg(&script).arg("table"));
    let mut names = BTreeSet::new();
    let mut covered = BTreeSet::new();
    for row in table.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = row.split_whitespace().collect();
        let [name, module, test, ..] = fields[..] else {
            panic!("scripts/e2e table: {row:?} is not `name module test [flag]`");
        };
        assert!(
            names.insert(name.trim_end_matches('*')),
            "scenario {name} is named twice"
        );
        let runs: Vec<&str> = if test == "-" {
            let prefix = format!("{module}::");
            tests.iter().copied().filter(|t| t.starts_with(&prefix)).collect()
        } else {
            let path = format!("{module}::{test}");
            tests.iter().copied().filter(|t| *t == path).collect()
        };
        assert!(
            !runs.is_empty(),
            "scenario {name} names {module}::{test}, which is no test of this binary"
        );
        covered.extend(runs);
    }
    let missing: Vec<&&str> = tests.difference(&covered).collect();
    assert!(
        missing.is_empty(),
        "tests that are no scenario (add a `// scenario: NAME` line above each): {missing:?}"
    );
}
