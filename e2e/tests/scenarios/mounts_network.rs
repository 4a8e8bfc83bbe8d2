//! Issue 15, caches and network isolation: the agent's `[[mounts]]` reach `tart run --dir` for a
//! build that asks for them (param `mounts`), a name the agent does not declare fails the build
//! `MountNotDeclared` before anything is cloned, and `network = "softnet"` with `softnet_allow`
//! starts every VM with `--net-softnet --net-softnet-allow=…` (as tart-double records them).

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tart_double::run_flags::runs_file;
use tartan_e2e::invariants::result;
use tartan_e2e::stack::{IMAGE, condition_text};
use tartan_e2e::{AgentOptions, ControllerOptions, Stack};

/// Adds `top` (top-level keys) and `tables` to agent `id`'s generated config.
fn extend_config(s: &Stack, id: &str, top: &str, tables: &str) {
    let path = s.dir.join(id).join("agent.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, format!("{top}\n{text}\n{tables}")).unwrap();
}

fn tart_home(s: &Stack, id: &str) -> PathBuf {
    s.dir.join(id).join("tart")
}

/// Every `tart run` tart-double recorded under `home`.
fn runs(home: &Path) -> Vec<Value> {
    std::fs::read_to_string(runs_file(home))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn params(mounts: &str) -> Vec<(&'static str, Value)> {
    vec![
        ("image", json!(IMAGE)),
        ("steps", json!(["echo built"])),
        ("mounts", json!(mounts)),
    ]
}

// scenario: mounts
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_mounts_reach_tart_run_and_an_undeclared_one_fails_before_the_clone() {
    let mut s = Stack::new("mounts").await;
    s.add_agent("agent-a", AgentOptions::default());
    let (spm, seed) = (s.dir.join("cache/spm"), s.dir.join("cache/seed"));
    std::fs::create_dir_all(&spm).unwrap();
    std::fs::create_dir_all(&seed).unwrap();
    extend_config(
        &s,
        "agent-a",
        "",
        &format!(
            "[[mounts]]\nname = \"spm\"\nhost_path = {spm:?}\n\n[[mounts]]\nname = \"seed\"\nhost_path = {seed:?}\nread_only = true\n"
        ),
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;

    s.create_run("with-caches", &params("spm, seed"), None).await;
    let run = s
        .wait_run("with-caches", "True", "TestsPassed", Duration::from_secs(90))
        .await;
    assert_eq!(result(&run, "attempt"), Some("with-caches#1"));
    let recorded = runs(&tart_home(&s, "agent-a"));
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    eprintln!("[e2e] tart-double recorded: {}", recorded[0]);
    let spm_real = spm.canonicalize().unwrap().display().to_string();
    let seed_real = seed.canonicalize().unwrap().display().to_string();
    assert_eq!(recorded[0]["dir"][0]["name"], "spm");
    assert_eq!(recorded[0]["dir"][0]["path"], spm_real.as_str());
    assert_eq!(recorded[0]["dir"][0]["read_only"], false);
    assert_eq!(recorded[0]["dir"][1]["name"], "seed");
    assert_eq!(recorded[0]["dir"][1]["path"], seed_real.as_str());
    assert_eq!(recorded[0]["dir"][1]["read_only"], true);
    assert_eq!(recorded[0]["net_softnet"], false, "shared network by default");

    s.create_run("undeclared", &params("spm,pods"), None).await;
    let run = s
        .wait_run("undeclared", "False", "MountNotDeclared", Duration::from_secs(60))
        .await;
    let text = condition_text(&run);
    eprintln!("[e2e] CustomRun: {text}");
    assert!(
        text.contains(
            "mount \"pods\" is not declared by this agent's config ([[mounts]]: it declares spm, seed); nothing was cloned"
        ),
        "{text}"
    );
    assert_eq!(
        runs(&tart_home(&s, "agent-a")).len(),
        1,
        "no tart run for the refused build"
    );
    assert!(
        s.vms("agent-a").iter().all(|v| !v.starts_with("mb-")),
        "{:?}",
        s.vms("agent-a")
    );
    s.finish().await;
}

// scenario: softnet
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn softnet_with_an_allow_list_reaches_tart_run() {
    let mut s = Stack::new("softnet").await;
    s.add_agent("agent-a", AgentOptions::default());
    extend_config(
        &s,
        "agent-a",
        "network = \"softnet\"\nsoftnet_allow = [\"10.0.0.0/8\", \"192.168.1.0/24\"]",
        "",
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent("agent-a").await;
    s.create_run(
        "isolated",
        &[("image", json!(IMAGE)), ("steps", json!(["echo built"]))],
        None,
    )
    .await;
    s.wait_run("isolated", "True", "TestsPassed", Duration::from_secs(90))
        .await;
    let recorded = runs(&tart_home(&s, "agent-a"));
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    eprintln!("[e2e] tart-double recorded: {}", recorded[0]);
    assert_eq!(recorded[0]["net_softnet"], true);
    assert_eq!(recorded[0]["net_softnet_allow"], "10.0.0.0/8,192.168.1.0/24");
    assert_eq!(recorded[0]["dir"], json!([]));
    s.finish().await;
}
