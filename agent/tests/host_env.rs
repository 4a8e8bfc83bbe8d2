//! `spec.env` end to end on the host, against real `tart-double` processes: Secret values reach
//! the steps through the env file (never argv), are masked in every log and message, and never
//! land in the state directory; a Secret that is not allowed or missing fails the build before
//! anything is cloned.

mod host_common;

use host_common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tartan_agent::host::env::{SecretAccess, SecretData, SecretReadError, SecretSource};
use tartan_agent::host::{AttemptExecutor, cancel_pair, drive};
use tartan_agent::machine::{Attempt, Config};
use tartan_api::{AttemptState as S, EnvVar, Outcome, Reason};

const LIMIT: Duration = Duration::from_secs(90);

/// A hostile value: quotes, a command substitution, backticks, a newline, and long enough to be
/// cut by a poll.
const SECRET: &str = "tok-'q'\"dq\"$(touch pwned)`touch pwned2`\nsecond-line-of-the-token";

/// Secrets in memory; records which ones were read.
struct Secrets {
    data: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
    reads: Mutex<Vec<String>>,
}

impl SecretSource for Secrets {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<SecretData, SecretReadError>> + Send + 'a>> {
        self.reads.lock().unwrap().push(format!("{namespace}/{name}"));
        let found = self.data.get(name).cloned();
        Box::pin(async move { Ok(found) })
    }
}

fn access(allowed: &[&str]) -> (SecretAccess, Arc<Secrets>) {
    let source = Arc::new(Secrets {
        data: BTreeMap::from([(
            "registry".to_string(),
            BTreeMap::from([("token".to_string(), SECRET.as_bytes().to_vec())]),
        )]),
        reads: Mutex::new(Vec::new()),
    });
    let access = SecretAccess {
        allowed: allowed.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>(),
        source: source.clone(),
    };
    (access, source)
}

fn literal(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

fn executor(
    rig: &Rig,
    name: &str,
    spec: tartan_api::MacBuildSpec,
    secrets: SecretAccess,
) -> (Attempt, AttemptExecutor) {
    let mut cfg = rig.config();
    cfg.step_poll = Duration::from_millis(100);
    cfg.secrets = Some(secrets);
    let (_cancel, signal) = cancel_pair();
    attempt_with(rig, name, spec, signal, cfg)
}

/// Every file under `dir` whose bytes contain `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(bytes) = std::fs::read(&path)
                && bytes.windows(needle.len()).any(|w| w == needle)
            {
                found.push(path.display().to_string());
            }
        }
    }
    found
}

fn sha256(bytes: &[u8]) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_reaches_the_step_masked_in_every_log_and_message_and_never_on_disk() {
    let rig = Rig::new();
    let (secrets, source) = access(&["ci/registry"]);
    let mut spec = spec(vec![
        // Uses the value: its hash goes to the log (the hash is no secret), and the env file's mode.
        step(
            "use",
            r#"printf 'sha=%s\n' "$(printf %s "$TOKEN" | sha256sum | cut -d' ' -f1)"; echo "mode=$(ls -l "$ENVFILE" | cut -c1-10)"; echo "mode=$MODE"; if [ -e pwned ] || [ -e pwned2 ]; then echo pwned=yes; else echo pwned=no; fi"#,
        ),
        // Prints it whole, then in two pieces with a pause (a poll in between sees half of it),
        // then fails: the failure tail is the value's last lines.
        step(
            "leak",
            r#"echo "token is $TOKEN"; printf 'again: %s' "${TOKEN%%second*}"; sleep 1; printf '%s\n' "second${TOKEN#*second}"; echo "end: $TOKEN"; exit 7"#,
        ),
    ]);
    let b = build("secret");
    let vm = tartan_api::vm_name(&b.namespace, &b.name, &b.uid, 1);
    spec.env = vec![
        EnvVar::from_secret("TOKEN", "registry", "token"),
        literal("MODE", "Release"),
        // Where the step's env file is (relative to its working folder), to check its mode.
        literal("ENVFILE", &format!(".tartan/{vm}/env")),
    ];
    let (mut a, mut exec) = executor(&rig, "secret", spec, secrets);
    assert_eq!(a.vm, vm);
    let env_file = rig.vm_dir(&vm).join(".tartan").join(&vm).join("env");
    let seen_removed = Arc::new(Mutex::new(None));
    let seen = seen_removed.clone();
    let file = env_file.clone();
    let journal = MemJournal::with_hook(move |r| {
        if r.to == S::Retiring {
            *seen.lock().unwrap() = Some(!file.exists());
        }
    });
    let mut hooks = journal.clone();
    let end = tokio::time::timeout(
        LIMIT,
        drive(&mut exec, &mut a, admit(600), &Config::default(), &mut hooks),
    )
    .await
    .expect("attempt finished in time")
    .unwrap();
    assert_eq!(end, S::Retired);
    assert_eq!(*source.reads.lock().unwrap(), vec!["ci/registry"]);
    assert_eq!(
        *seen_removed.lock().unwrap(),
        Some(true),
        "the env file is gone after the last step"
    );

    // The step could use the value, and the env file was private.
    let logs = rig.state.path().join("logs").join(&vm);
    let use_log = std::fs::read_to_string(logs.join("use.log")).unwrap();
    assert!(
        use_log.contains(&format!("sha={}\n", sha256(SECRET.as_bytes()))),
        "{use_log}"
    );
    assert!(use_log.contains("mode=-rw-------\n"), "{use_log}");
    assert!(use_log.contains("mode=Release\n"), "{use_log}");
    assert!(use_log.contains("pwned=no\n"), "the value ran as a command: {use_log}");

    // Every appearance is masked in the host log, including the one cut by a poll.
    let leak_log = std::fs::read_to_string(logs.join("leak.log")).unwrap();
    assert_eq!(
        leak_log, "token is ***\nagain: ***\nend: ***\n",
        "the whole value and each of its lines are masked"
    );

    // The failure tail, the journal and the status say *** and never the value.
    let records = journal.records.lock().unwrap().clone();
    let retiring = records.iter().find(|r| r.to == S::Retiring).unwrap();
    assert_eq!(retiring.reason, Some(Reason::StepFailed));
    assert!(retiring.detail.ends_with("end: ***"), "{}", retiring.detail);
    let needles: Vec<&str> = vec![SECRET, "second-line-of-the-token"];
    for r in &records {
        let text = format!("{r} {r:?}");
        for n in &needles {
            assert!(!text.contains(n), "the journal holds the secret: {text}");
        }
    }
    // No file under the state directory holds the value or a line of it.
    for n in &needles {
        assert_eq!(files_containing(rig.state.path(), n.as_bytes()), Vec::<String>::new());
    }
    assert!(rig.vms().is_empty(), "VMs left: {:?}", rig.vms());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_not_allowed_or_missing_fails_the_build_before_anything_is_cloned() {
    for (env, reason, says) in [
        (
            EnvVar::from_secret("TOKEN", "other", "token"),
            Reason::SecretNotAllowed,
            "env TOKEN: Secret ci/other is not allowed on this agent",
        ),
        (
            EnvVar::from_secret("TOKEN", "gone", "token"),
            Reason::SecretMissing,
            "env TOKEN: Secret ci/gone does not exist",
        ),
        (
            EnvVar::from_secret("TOKEN", "registry", "nokey"),
            Reason::SecretMissing,
            "env TOKEN: Secret ci/registry has no key \"nokey\"",
        ),
    ] {
        let rig = Rig::new();
        let (secrets, source) = access(&["ci/registry", "ci/gone"]);
        let mut spec = spec(vec![step("build", "echo never")]);
        spec.env = vec![env];
        let (mut a, mut exec) = executor(&rig, "refused", spec, secrets);
        let vm = a.vm.clone();
        let journal = MemJournal::new();
        let mut hooks = journal.clone();
        let end = tokio::time::timeout(
            LIMIT,
            drive(&mut exec, &mut a, admit(600), &Config::default(), &mut hooks),
        )
        .await
        .expect("attempt finished in time")
        .unwrap();
        assert_eq!(end, S::Retired);
        assert_eq!(a.outcome, Some(Outcome::Failed));
        assert_eq!(journal.states(), vec![S::Admitted, S::Retiring, S::Retired]);
        let refused = journal.records.lock().unwrap()[1].clone();
        assert_eq!(refused.reason, Some(reason), "{refused}");
        assert!(refused.detail.contains(says), "{refused}");
        assert!(refused.detail.ends_with("nothing was cloned"), "{refused}");
        assert!(rig.vms().is_empty(), "nothing was cloned");
        assert!(
            !rig.deadline_file(&vm).exists(),
            "no deadline file for a build that never cloned"
        );
        if reason == Reason::SecretNotAllowed {
            assert!(
                source.reads.lock().unwrap().is_empty(),
                "a Secret not allowed is never read"
            );
        }
    }
}
