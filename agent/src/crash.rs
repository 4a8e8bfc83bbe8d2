//! Crash points: named places where the agent changes the world (a journal sync, a status write,
//! a tart call …) at which a build made with the `crash-points` cargo feature kills itself when
//! `TARTAN_CRASH_AT=<point>[#n]` names that point (on its n-th hit, the first by default).
//! `scripts/sweep` runs a build crashing at each point and checks that the restarted agent
//! recovers it. Without the feature, [`crash_point!`](crate::crash_point) expands to `()`: a
//! production binary carries neither the names nor the code reading the variable.

/// The variable naming the point to crash at: `<point>` or `<point>#<n>` (n ≥ 1).
pub const ENV: &str = "TARTAN_CRASH_AT";

/// The line a firing point writes to stderr before the SIGKILL (the sweep looks for it).
pub const FIRED: &str = "tartan crash point fired:";

/// When set (to anything), every hit of every point writes [`PASSED`] and its name to stderr:
/// the sweep counts how often a build passes each point.
pub const TRACE_ENV: &str = "TARTAN_CRASH_TRACE";

/// The line a point writes when traced.
pub const PASSED: &str = "tartan crash point passed:";

/// Marks a crash point named `"area.action.before"` or `"area.action.after"` (a string literal:
/// the sweep finds the points by scanning the sources for this macro).
#[cfg(feature = "crash-points")]
#[macro_export]
macro_rules! crash_point {
    ($name:literal) => {
        $crate::crash::hit($name)
    };
}

/// Marks a crash point; without the `crash-points` feature it is nothing at all.
#[cfg(not(feature = "crash-points"))]
#[macro_export]
macro_rules! crash_point {
    ($name:literal) => {
        ()
    };
}

/// What `TARTAN_CRASH_AT` asks for: the point and which hit of it (1-based).
#[cfg(any(test, feature = "crash-points"))]
#[derive(Debug, PartialEq, Eq)]
pub struct Target {
    pub point: String,
    pub hit: u64,
}

/// Parses `<point>[#n]`; `None` for an empty value or a count that is not a positive integer.
#[cfg(any(test, feature = "crash-points"))]
pub fn parse(value: &str) -> Option<Target> {
    let (point, hit) = match value.split_once('#') {
        Some((point, n)) => (point, n.parse::<u64>().ok().filter(|n| *n >= 1)?),
        None => (value, 1),
    };
    let point = point.trim();
    (!point.is_empty()).then(|| Target {
        point: point.to_string(),
        hit,
    })
}

#[cfg(feature = "crash-points")]
mod fire {
    use super::{ENV, FIRED, PASSED, TRACE_ENV, Target, parse};
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    static TARGET: OnceLock<Option<Target>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    static TRACE: OnceLock<bool> = OnceLock::new();

    /// Writes `line` to fd 2 at once. A raw write: std's stderr is unbuffered too, but takes a
    /// lock another thread may hold when the process is about to die.
    fn say(line: &str) {
        // SAFETY: writing a live buffer to fd 2.
        unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    }

    /// Counts a hit of `point` and, on the hit `TARTAN_CRASH_AT` names, says so on stderr and
    /// SIGKILLs this process: no unwinding, no destructor, no buffered write reaches the disk.
    pub fn hit(point: &'static str) {
        let target = TARGET.get_or_init(|| {
            let value = std::env::var(ENV).ok()?;
            let parsed = parse(&value);
            if parsed.is_none() {
                eprintln!("{ENV}={value:?} is not <point>[#n]; no crash point will fire");
            }
            parsed
        });
        if *TRACE.get_or_init(|| std::env::var_os(TRACE_ENV).is_some()) {
            say(&format!("{PASSED} {point}\n"));
        }
        let Some(target) = target else { return };
        if target.point != point || HITS.fetch_add(1, Ordering::SeqCst) + 1 != target.hit {
            return;
        }
        say(&format!("{FIRED} {point}#{}\n", target.hit));
        let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
        // SIGKILL is not delivered asynchronously to ourselves in practice, but never go on.
        loop {
            std::thread::park();
        }
    }
}

#[cfg(feature = "crash-points")]
pub use fire::hit;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_names_a_point_and_a_hit() {
        assert_eq!(
            parse("journal.append.after"),
            Some(Target {
                point: "journal.append.after".into(),
                hit: 1
            })
        );
        assert_eq!(
            parse("tart.clone.before#3"),
            Some(Target {
                point: "tart.clone.before".into(),
                hit: 3
            })
        );
        assert_eq!(parse(""), None);
        assert_eq!(parse("#2"), None);
        assert_eq!(parse("a.b.before#0"), None);
        assert_eq!(parse("a.b.before#x"), None);
    }

    /// The child half of the tests below: hits `test.point.before` three times, printing after each.
    #[test]
    fn crash_child() {
        if std::env::var_os("TARTAN_CRASH_CHILD").is_none() {
            return;
        }
        for i in 1..=3 {
            crate::crash_point!("test.point.before");
            println!("survived hit {i}");
        }
    }

    /// Runs [`crash_child`] in a new process of this test binary with `TARTAN_CRASH_AT=value`.
    fn child(value: &str) -> std::process::Output {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "crash::tests::crash_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TARTAN_CRASH_CHILD", "1")
            .env(ENV, value)
            .output()
            .unwrap()
    }

    #[cfg(feature = "crash-points")]
    #[test]
    fn a_point_kills_the_process_on_the_named_hit() {
        use std::os::unix::process::ExitStatusExt;
        let out = child("test.point.before#2");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{out:?}");
        assert!(
            stdout.contains("survived hit 1") && !stdout.contains("survived hit 2"),
            "{stdout}"
        );
        assert!(stderr.contains(&format!("{FIRED} test.point.before#2")), "{stderr}");
    }

    #[cfg(feature = "crash-points")]
    #[test]
    fn a_traced_run_names_every_hit() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "crash::tests::crash_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TARTAN_CRASH_CHILD", "1")
            .env(TRACE_ENV, "1")
            .env_remove(ENV)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            stderr.matches(&format!("{PASSED} test.point.before\n")).count(),
            3,
            "{stderr}"
        );
    }

    #[cfg(feature = "crash-points")]
    #[test]
    fn another_point_or_a_later_hit_does_not_fire() {
        for value in ["other.point.before", "test.point.before#4"] {
            let out = child(value);
            assert!(out.status.success(), "{value}: {out:?}");
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("survived hit 3"),
                "{value}"
            );
        }
    }

    /// Without the feature the macro is `()`: the named point does not fire, and no code reading
    /// the variable exists (`hit` is not compiled; see also scripts/sweep's check of the binary).
    #[cfg(not(feature = "crash-points"))]
    #[test]
    fn without_the_feature_a_point_is_nothing() {
        let out = child("test.point.before");
        assert!(out.status.success(), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("survived hit 3"));
    }
}
