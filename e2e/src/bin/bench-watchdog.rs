//! Watchdog benchmark: N VMs (real `tart-double run` processes) with staggered deadlines and a
//! short grace. Prints how late each deletion was, split into wake lateness (when the watchdog
//! started acting, relative to deadline + grace) and the tart work (kill, stop, delete, confirm),
//! plus the watchdog's idle CPU and RSS while it tracks all N deadline files.
//!
//! ```sh
//! scripts/bench-watchdog [--vms 20] [--spacing 1s] [--grace 1s] [--idle 5s] [--tart-double BIN]
//! ```
//!
//! `tart-double` is the one of `$TARTAN_E2E_BIN_DIR` (the script builds it), as for the other benches
//! ([`tartan_e2e::bins::bin`]), unless `--tart-double` names another.
//!
//! The watchdog runs in this process (the harness only sleeps during the idle interval), so the
//! idle figures are getrusage(RUSAGE_SELF) over that interval; `tart-double` runs are children and
//! not counted.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tartan_api::deadline::{DEADLINES_DIR, DeadlineFile, write_deadline_file};
use tartan_watchdog::{Action, Config, RECORD_FILE, parse_duration, read_lines};

struct Args {
    vms: usize,
    spacing: SignedDuration,
    grace: SignedDuration,
    idle: SignedDuration,
    double: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        vms: 20,
        spacing: SignedDuration::from_secs(1),
        grace: SignedDuration::from_secs(1),
        idle: SignedDuration::from_secs(5),
        double: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--vms" => args.vms = value()?.parse().map_err(|e| format!("--vms: {e}"))?,
            "--spacing" => args.spacing = parse_duration(&value()?)?,
            "--grace" => args.grace = parse_duration(&value()?)?,
            "--idle" => args.idle = parse_duration(&value()?)?,
            "--tart-double" => args.double = Some(PathBuf::from(value()?)),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

fn cpu_time() -> Duration {
    // SAFETY: getrusage writes into the zeroed struct we pass; RUSAGE_SELF is always valid.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    assert_eq!(rc, 0, "getrusage failed");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Current RSS in KiB from /proc (Linux); `None` elsewhere.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

struct Runs(Vec<Child>);

impl Drop for Runs {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(64);
        }
    };
    let double = args
        .double
        .clone()
        .unwrap_or_else(|| tartan_e2e::bins::bin("tart-double"));
    let tmp = tempfile::tempdir().expect("temp dir");
    let home = tmp.path().join("tart-home");
    let state = tmp.path().join("state");
    let deadlines = state.join(DEADLINES_DIR);
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&deadlines).unwrap();

    eprintln!("starting {} VMs with tart-double ({})", args.vms, double.display());
    let names: Vec<String> = (0..args.vms).map(|i| format!("mb-bench-{i:02}")).collect();
    let mut runs = Runs(Vec::new());
    for name in &names {
        let out = Command::new(&double)
            .args(["clone", "ghcr.io/cirruslabs/macos-sequoia-base:latest", name])
            .env("TART_HOME", &home)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "clone {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let child = Command::new(&double)
            .args(["run", "--no-graphics", name])
            .env("TART_HOME", &home)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        runs.0.push(child);
        let start = Instant::now();
        while !matches!(tartan_tart::run_pid(&home, name), Ok(Some(p)) if p.as_raw() == pid) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "tart-double run {name} never took the VM lock"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    // The first deadline comes after the idle interval (plus a margin to start up).
    let first = Timestamp::now()
        .checked_add(args.idle)
        .and_then(|t| t.checked_add(SignedDuration::from_secs(2)))
        .unwrap();
    for (i, name) in names.iter().enumerate() {
        let deadline = first.checked_add(args.spacing * i as i32).unwrap();
        let file = DeadlineFile {
            vm: name.clone(),
            namespace: "bench".into(),
            name: name.clone(),
            uid: format!("uid-{i}"),
            attempt: 1,
            deadline,
            agent: "bench".into(),
            written_at: Timestamp::now(),
        };
        write_deadline_file(&deadlines, &file).unwrap();
    }

    let mut config = Config::new(&state);
    config.grace = args.grace;
    config.tart_program = double.clone();
    config.tart_home = Some(home.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let watchdog = tokio::spawn(tartan_watchdog::run(config, async move {
        let _ = stop_rx.await;
    }));

    // Idle: the watchdog tracks every file, nothing is due. Skip its first second (startup).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = Duration::try_from(args.idle)
        .unwrap()
        .saturating_sub(Duration::from_secs(1));
    let (cpu0, wall0) = (cpu_time(), Instant::now());
    tokio::time::sleep(idle).await;
    let (cpu, wall) = (cpu_time() - cpu0, wall0.elapsed());
    let rss = rss_kib();

    let record = state.join(RECORD_FILE);
    let last_due = first
        .checked_add(args.spacing * (args.vms as i32 - 1))
        .and_then(|t| t.checked_add(args.grace))
        .unwrap();
    let give_up = last_due.checked_add(SignedDuration::from_secs(60)).unwrap();
    let lines = loop {
        let lines = read_lines(&record).unwrap();
        let done = lines.iter().filter(|l| l.action == Action::Deleted).count();
        if done >= args.vms {
            break lines;
        }
        assert!(
            Timestamp::now() < give_up,
            "only {done}/{} VMs deleted; record: {lines:?}",
            args.vms
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = stop_tx.send(());
    watchdog.await.expect("watchdog task").expect("watchdog run");

    let mut wake = Vec::new();
    let mut work = Vec::new();
    let mut total = Vec::new();
    for line in lines.iter().filter(|l| l.action == Action::Deleted) {
        let time: Timestamp = line.time.parse().unwrap();
        let deadline: Timestamp = line.deadline.as_deref().unwrap().parse().unwrap();
        let due = deadline.checked_add(args.grace).unwrap();
        let secs: f64 = line
            .detail
            .rsplit("deleted in ")
            .next()
            .and_then(|s| s.strip_suffix('s'))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no duration in {:?}", line.detail));
        let total_s = time.duration_since(due).as_secs_f64();
        total.push(total_s);
        work.push(secs);
        wake.push(total_s - secs);
    }
    let failures = lines.iter().filter(|l| l.action != Action::Deleted).count();
    for v in [&mut wake, &mut work, &mut total] {
        v.sort_by(f64::total_cmp);
    }
    let mut still_running = 0;
    for child in runs.0.iter_mut() {
        if child.try_wait().ok().flatten().is_none() {
            still_running += 1;
        }
    }
    let vms_left = std::fs::read_dir(home.join("vms")).map(|d| d.count()).unwrap_or(0);

    println!(
        "watchdog benchmark: {} VMs, deadlines {} apart, grace {}",
        args.vms, args.spacing, args.grace
    );
    println!(
        "  deleted {}/{}, other lines {failures}, tart runs left {still_running}, VM dirs left {vms_left}",
        total.len(),
        args.vms
    );
    println!(
        "  lateness = deletion confirmed - (deadline + grace); wake = when the job started; work = kill+stop+delete+confirm"
    );
    println!("                   p50        max");
    for (label, v) in [
        ("wake lateness", &wake),
        ("tart work", &work),
        ("total lateness", &total),
    ] {
        println!(
            "  {label:<15} {:>7.3}s  {:>7.3}s",
            percentile(v, 0.5),
            percentile(v, 1.0)
        );
    }
    println!(
        "  idle CPU: {:.1} ms user+sys over {:.1}s = {:.3}% of one core (1 s rescans of {} files)",
        cpu.as_secs_f64() * 1000.0,
        wall.as_secs_f64(),
        cpu.as_secs_f64() / wall.as_secs_f64() * 100.0,
        args.vms
    );
    match rss {
        Some(kib) => println!(
            "  RSS: {:.1} MiB (watchdog + this harness, one process)",
            kib as f64 / 1024.0
        ),
        None => println!("  RSS: not available on this OS"),
    }
}
