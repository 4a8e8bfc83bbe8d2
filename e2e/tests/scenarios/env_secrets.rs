//! Issue 15, environment and secrets: a build's `env` and `secret-env` params reach its steps;
//! a Secret's value is usable in a step (its hash is checked), masked (`***`) wherever the
//! step prints it (host step logs, the failure tail in the CustomRun message and the MacBuild
//! status), and no byte of it is in the agent's state dir (journal included) or the cluster's
//! objects. A Secret the agent is not allowed to read, or a key the Secret lacks, fails the build
//! naming it, before any VM is cloned. On a real cluster the agent reads the Secret through a Role
//! with `resourceNames`, created as an operator would.

use serde_json::json;
use std::path::Path;
use std::time::Duration;
use tartan_api::AttemptState;
use tartan_e2e::stack::condition_text;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

/// Quotes, a command substitution, backticks, a newline.
const TOKEN: &str = "e2e-tok'\"$(touch pwned)`id`\nline-two-of-the-token";

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
        .expect("sha256sum runs");
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_string()
}

// scenario: env-secrets
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_reach_the_steps_masked_and_a_secret_not_allowed_or_missing_fails_before_the_clone() {
    let mut s = Stack::new("env-secrets").await;
    s.create_secret("signing", &[("token", TOKEN.as_bytes())], true).await;
    // Exists, but the operator did not allow it.
    s.create_secret("other", &[("token", b"other-secret-value")], false)
        .await;
    s.add_agent(
        "agent-a",
        AgentOptions {
            secrets: &["signing"],
            ..AgentOptions::default()
        },
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;

    let steps = json!([
        "printf 'sha=%s mode=%s\\n' \"$(printf %s \"$TOKEN\" | sha256sum | cut -d' ' -f1)\" \"$MODE\"",
        "echo \"token: $TOKEN\"; exit 3",
    ]);
    let params = vec![
        ("image", json!(tartan_e2e::stack::IMAGE)),
        ("steps", steps.clone()),
        ("env", json!("{MODE: Release}")),
        ("secret-env", json!("TOKEN=signing/token")),
    ];
    s.create_run("uses", &params, None).await;
    let run = s.wait_run("uses", "False", "StepFailed", Duration::from_secs(90)).await;
    let message = condition_text(&run);
    eprintln!("[e2e] uses: {message}");
    assert!(
        message.ends_with("token: ***"),
        "the failure tail shows the value masked: {message}"
    );

    let vm = s
        .journal("agent-a")
        .iter()
        .find_map(|r| {
            r.vm.clone()
                .filter(|_| r.build.as_ref().is_some_and(|b| b.name == "uses"))
        })
        .expect("a journal record of the build");
    let logs = s.agent("agent-a").state_dir.join("logs").join(&vm);
    let first = std::fs::read_to_string(logs.join("step-1.log")).unwrap();
    assert_eq!(
        first,
        format!("sha={} mode=Release\n", sha256(TOKEN.as_bytes())),
        "the step used the value"
    );
    let second = std::fs::read_to_string(logs.join("step-2.log")).unwrap();
    assert_eq!(second, "token: ***\n");
    eprintln!("[e2e] step-2.log: {second:?}");

    // Refusals, each before a clone.
    for (name, secret_env, reason, says) in [
        (
            "not-allowed",
            "TOKEN=other/token",
            "SecretNotAllowed",
            format!("Secret {}/other is not allowed on this agent", s.ns),
        ),
        (
            "no-key",
            "TOKEN=signing/nokey",
            "SecretMissing",
            format!("Secret {}/signing has no key \"nokey\"", s.ns),
        ),
    ] {
        let params = vec![
            ("image", json!(tartan_e2e::stack::IMAGE)),
            ("steps", steps.clone()),
            ("secret-env", json!(secret_env)),
        ];
        s.create_run(name, &params, None).await;
        let run = s.wait_run(name, "False", reason, Duration::from_secs(60)).await;
        let text = condition_text(&run);
        eprintln!("[e2e] {name}: {text}");
        assert!(text.contains(&says) && text.contains("nothing was cloned"), "{text}");
        assert!(
            !s.journal("agent-a")
                .iter()
                .any(|r| r.build.as_ref().is_some_and(|b| b.name == name) && r.to == AttemptState::Booting),
            "{name}: refused before any clone"
        );
    }

    // No byte of a value (or of one of its lines) anywhere: state dir with the journal, the
    // cluster's objects.
    let state = s.agent("agent-a").state_dir.clone();
    let mut objects = String::new();
    for name in ["uses", "not-allowed", "no-key"] {
        objects.push_str(&s.customrun(name).await.unwrap().to_string());
        objects.push_str(&s.macbuild(name).await.unwrap().to_string());
    }
    for needle in [TOKEN, "line-two-of-the-token", "other-secret-value"] {
        assert_eq!(
            files_containing(&state, needle.as_bytes()),
            Vec::<String>::new(),
            "{needle:?}"
        );
        assert!(!objects.contains(needle), "{needle:?} in the cluster's objects");
        assert!(
            !s.agent_log("agent-a").contains(needle),
            "{needle:?} in the agent's log"
        );
    }
    s.finish().await;
}
