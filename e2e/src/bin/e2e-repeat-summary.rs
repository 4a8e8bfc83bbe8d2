//! `e2e-repeat-summary RUNS`: reads the runs of `scripts/e2e --repeat RUNS` on stdin, one
//! `NAME passed|FAILED SECONDS` a line, and prints the per-scenario table
//! ([`tartan_e2e::repeat::summary`]).

use std::io::Read;

fn main() {
    let runs_per_scenario: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        Some(Ok(n)) if n > 0 => n,
        _ => {
            eprintln!("usage: e2e-repeat-summary RUNS < records (RUNS: the --repeat count, 1 or more)");
            std::process::exit(2);
        }
    };
    let mut input = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut input) {
        eprintln!("e2e-repeat-summary: reading the records on stdin: {e}");
        std::process::exit(2);
    }
    let mut runs = Vec::new();
    for line in input.lines().filter(|l| !l.trim().is_empty()) {
        match tartan_e2e::repeat::parse_run(line) {
            Ok(run) => runs.push(run),
            Err(why) => {
                eprintln!("e2e-repeat-summary: {why}");
                std::process::exit(2);
            }
        }
    }
    print!("{}", tartan_e2e::repeat::summary(&runs, runs_per_scenario));
}
