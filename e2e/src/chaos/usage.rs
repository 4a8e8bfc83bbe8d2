//! What a chaos run costs: CPU seconds and peak RSS of every process of the run, by kind, from
//! `/proc` (the processes carry the run's marker, see [`super::reaper`]). Sampled every few
//! seconds: a process's CPU counts up to its last sample, and what a process reaped from its
//! children (an agent's `tart-double exec` and the guest's shells) counts as that process's
//! `children` figure.

use std::collections::BTreeMap;

/// One process's last figures.
#[derive(Clone, Debug, Default, PartialEq)]
struct Seen {
    kind: &'static str,
    cpu: f64,
    children: f64,
    peak_rss_kib: u64,
}

/// Per kind: CPU seconds, CPU seconds of reaped children, the largest peak RSS of one process,
/// and how many processes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Figures {
    pub cpu: f64,
    pub children: f64,
    pub peak_rss_kib: u64,
    pub processes: usize,
}

#[derive(Default)]
pub struct Usage {
    /// By (pid, start time in ticks): a pid may be reused.
    seen: BTreeMap<(i32, u64), Seen>,
}

/// The kind of process `argv` is (the harness's names).
pub fn kind(argv: &[String]) -> &'static str {
    let program = argv.first().map(|p| p.rsplit('/').next().unwrap_or(p)).unwrap_or("");
    match program {
        "tartan-agent" if argv.get(1).map(String::as_str) == Some("watchdog") => "watchdog",
        "tartan-agent" => "agent",
        "tartan-controller" => "controller",
        "kube-emulator" => "emulator",
        "tart-double" => "tart-double",
        _ => "other",
    }
}

/// `(utime + stime, cutime + cstime, start time, rss pages)` from a `/proc/<pid>/stat` line.
pub fn parse_stat(stat: &str) -> Option<(u64, u64, u64, u64)> {
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3 of stat(5), so field n is f[n - 3].
    let n = |i: usize| f.get(i - 3).and_then(|v| v.parse::<u64>().ok());
    Some((n(14)? + n(15)?, n(16)? + n(17)?, n(22)?, n(24)?))
}

impl Usage {
    /// Reads every live process carrying `RUN_MARKER=marker`.
    pub fn sample(&mut self, marker: &str) {
        let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .unwrap_or(100) as f64;
        let page_kib = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .unwrap_or(4096) as u64
            / 1024;
        for pid in crate::process::pids_with_env(super::reaper::RUN_MARKER, marker) {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let Some((cpu, children, start, rss)) = parse_stat(&stat) else {
                continue;
            };
            let argv: Vec<String> = std::fs::read(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let entry = self.seen.entry((pid, start)).or_default();
            entry.kind = kind(&argv);
            entry.cpu = cpu as f64 / ticks;
            entry.children = children as f64 / ticks;
            entry.peak_rss_kib = entry.peak_rss_kib.max(rss * page_kib);
        }
    }

    /// The figures by kind.
    pub fn by_kind(&self) -> BTreeMap<&'static str, Figures> {
        let mut out: BTreeMap<&'static str, Figures> = BTreeMap::new();
        for s in self.seen.values() {
            let f = out.entry(s.kind).or_default();
            f.cpu += s.cpu;
            f.children += s.children;
            f.peak_rss_kib = f.peak_rss_kib.max(s.peak_rss_kib);
            f.processes += 1;
        }
        out
    }

    /// One line per kind, and the total CPU (own and reaped children) per build.
    pub fn report(&self, builds: usize) -> Vec<String> {
        let by_kind = self.by_kind();
        let mut lines: Vec<String> = by_kind
            .iter()
            .map(|(kind, f)| {
                format!(
                    "cpu {kind}: {:.1}s (+{:.1}s of reaped children), peak RSS {:.1} MiB, {} process(es)",
                    f.cpu,
                    f.children,
                    f.peak_rss_kib as f64 / 1024.0,
                    f.processes
                )
            })
            .collect();
        let total: f64 = by_kind.values().map(|f| f.cpu + f.children).sum();
        lines.push(format!(
            "cpu total of the run's processes: {total:.1}s, {:.2}s per build",
            total / builds.max(1) as f64
        ));
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_come_from_the_program_and_its_mode() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(kind(&argv(&["/t/debug/tartan-agent", "run", "--config", "x"])), "agent");
        assert_eq!(kind(&argv(&["/t/debug/tartan-agent", "watchdog"])), "watchdog");
        assert_eq!(kind(&argv(&["tartan-controller", "run"])), "controller");
        assert_eq!(kind(&argv(&["/x/kube-emulator", "--port", "0"])), "emulator");
        assert_eq!(kind(&argv(&["/x/tart-double", "run"])), "tart-double");
        assert_eq!(kind(&argv(&["sh", "-c", "sleep 1"])), "other");
        assert_eq!(kind(&[]), "other");
    }

    #[test]
    fn stat_lines_give_cpu_children_start_and_rss_even_with_spaces_in_the_name() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
        // utime stime cutime cstime priority nice threads itrealvalue starttime vsize rss
        let line = "42 (a b) c) S 1 42 42 0 -1 4194560 10 0 0 0 150 50 7 3 20 0 1 0 9000 1000 256";
        assert_eq!(parse_stat(line), Some((200, 10, 9000, 256)));
        assert_eq!(parse_stat("42 (x) S 1"), None);
    }

    #[test]
    fn the_report_sums_by_kind_and_per_build() {
        let mut u = Usage::default();
        let seen = |kind, cpu, children, rss| Seen {
            kind,
            cpu,
            children,
            peak_rss_kib: rss,
        };
        u.seen.insert((1, 1), seen("agent", 2.0, 6.0, 2048));
        u.seen.insert((2, 1), seen("agent", 1.0, 1.0, 4096));
        u.seen.insert((3, 1), seen("emulator", 3.0, 0.0, 10240));
        assert_eq!(
            u.report(4),
            vec![
                "cpu agent: 3.0s (+7.0s of reaped children), peak RSS 4.0 MiB, 2 process(es)",
                "cpu emulator: 3.0s (+0.0s of reaped children), peak RSS 10.0 MiB, 1 process(es)",
                "cpu total of the run's processes: 13.0s, 3.25s per build",
            ]
        );
    }

    #[test]
    fn a_sample_finds_this_runs_processes_by_their_marker() {
        let marker = format!("usage-test-{}", uuid::Uuid::new_v4());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env(super::super::reaper::RUN_MARKER, &marker)
            .spawn()
            .expect("sleep starts");
        // The child carries the marker only once it has exec'd `sleep` (until then /proc shows
        // the test's environment): sample until it is seen, within a bound.
        let mut u = Usage::default();
        let started = std::time::Instant::now();
        loop {
            u.sample(&marker);
            if !u.by_kind().is_empty() || started.elapsed() > std::time::Duration::from_secs(10) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        let by_kind = u.by_kind();
        assert_eq!(by_kind.get("other").map(|f| f.processes), Some(1), "{by_kind:?}");
        assert!(by_kind["other"].peak_rss_kib > 0);
    }
}
