//! The disk floor (`[disk] min_free_gib`): an agent whose floor is above the free space of its
//! disk claims nothing and says so (the Lease annotation `tartan.dev/disk-pressure`, `/healthz`,
//! the metrics, one `DiskPressure` Event on the build it leaves waiting); started again with the
//! floor lowered, it claims and runs the build.

use k8s_openapi::api::events::v1::Event;
use std::time::Duration;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for, wait_for_async};

const AGENT: &str = "mac-a";
const ANNOTATION: &str = "tartan.dev/disk-pressure";
/// 1 PiB: above the free space of any test machine's disk.
const FLOOR_GIB: u64 = 1 << 20;

// scenario: disk-floor
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_the_disk_floor_nothing_is_claimed_and_the_agent_says_why_until_the_floor_is_lowered() {
    let mut s = Stack::new("disk-floor").await;
    s.add_agent(
        AGENT,
        AgentOptions {
            disk_min_free_gib: FLOOR_GIB,
            ..AgentOptions::default()
        },
    );
    s.start_controller(ControllerOptions::default());
    s.start_agent(AGENT).await;
    s.create_run("waits", &s.build_params(false), None).await;

    // The agent has looked at the build and left it waiting: its Event says so.
    let events: kube::Api<Event> = kube::Api::namespaced(s.client.clone(), &s.ns);
    let disk_events = || async {
        let list = events.list(&Default::default()).await.map_err(|e| e.to_string())?;
        Ok::<Vec<Event>, String>(
            list.items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("DiskPressure"))
                .collect(),
        )
    };
    let first = wait_for_async(
        "the DiskPressure Event on the waiting build",
        Duration::from_secs(30),
        || async {
            let found = disk_events().await?;
            found
                .into_iter()
                .next()
                .ok_or_else(|| "no DiskPressure Event yet".to_string())
        },
    )
    .await;
    let regarding = first.regarding.clone().unwrap_or_default();
    assert_eq!(regarding.kind.as_deref(), Some("MacBuild"));
    let build = regarding.name.clone().expect("the Event names its MacBuild");
    let note = first.note.clone().unwrap_or_default();
    for needle in [AGENT, "state_dir", "tart_home", "1048576.0 GiB"] {
        assert!(note.contains(needle), "{needle:?} not in the Event's note {note:?}");
    }
    assert_eq!(first.type_.as_deref(), Some("Warning"));

    // Nothing claimed it: no journal record, no claim on the MacBuild.
    let tried = |s: &Stack| {
        s.journal(AGENT)
            .iter()
            .any(|r| r.build.as_ref().is_some_and(|b| b.name == build))
    };
    assert!(!tried(&s), "claimed below the floor:\n{}", s.journal_text(AGENT));
    let mb = s.macbuild(&build).await.expect("the MacBuild exists");
    assert!(mb["status"]["claim"].is_null(), "claimed below the floor: {mb:#}");

    // The agent says why: Lease annotation, /healthz, metrics.
    let annotation = wait_for_async(
        "the Lease's disk-pressure annotation",
        Duration::from_secs(10),
        || async {
            let lease = s.lease(AGENT).await.ok_or("no Lease")?;
            let value = lease.metadata.annotations.unwrap_or_default().get(ANNOTATION).cloned();
            value.ok_or_else(|| "no annotation yet".to_string())
        },
    )
    .await;
    let annotation: serde_json::Value = serde_json::from_str(&annotation).expect("the annotation is JSON");
    assert_eq!(annotation["minFreeBytes"], FLOOR_GIB << 30);
    let below: Vec<&str> = annotation["below"]
        .as_array()
        .expect("below is a list")
        .iter()
        .map(|b| b["fs"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(below, ["state_dir", "tart_home"], "{annotation}");
    assert!(annotation["below"][0]["freeBytes"].as_u64().is_some(), "{annotation}");
    let (code, body) = s.agent_http(AGENT, "/healthz");
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("disk pressure") && body.contains("no new build is claimed"),
        "{body}"
    );
    let (_, metrics) = s.agent_http(AGENT, "/metrics");
    assert!(metrics.contains("\ntartan_agent_disk_pressure 1\n"), "{metrics}");
    assert!(
        metrics.contains("tartan_agent_disk_free_bytes{fs=\"tart_home\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tartan_agent_disk_free_bytes{fs=\"state_dir\"}"),
        "{metrics}"
    );

    // Once per build, not once per look: the agent scans at every Lease renewal (1 s here); three
    // more renewals are three more looks.
    let renewed = |lease: &k8s_openapi::api::coordination::v1::Lease| {
        lease.spec.as_ref().and_then(|sp| sp.renew_time.clone()).map(|t| t.0)
    };
    let seen_at = renewed(&s.lease(AGENT).await.expect("Lease")).expect("renewed");
    wait_for_async("three more Lease renewals", Duration::from_secs(15), || async {
        let now = s.lease(AGENT).await.as_ref().and_then(renewed);
        match now {
            Some(t) if t.duration_since(seen_at).as_secs_f64() >= 3.0 => Ok(()),
            other => Err(format!("renewed at {other:?}")),
        }
    })
    .await;
    assert_eq!(
        disk_events().await.expect("listing Events").len(),
        1,
        "one Event per build"
    );
    assert!(!tried(&s), "claimed below the floor:\n{}", s.journal_text(AGENT));

    // The floor lowered (0: off) and the agent started again: it claims and runs the build, and
    // stops saying it is under pressure.
    s.stop_agent(AGENT, Duration::from_secs(30));
    let config = s.agent(AGENT).config.clone();
    let text = std::fs::read_to_string(&config).unwrap();
    let lowered = text.replace(&format!("min_free_gib = {FLOOR_GIB}\n"), "min_free_gib = 0\n");
    assert_ne!(text, lowered, "the config sets the floor");
    std::fs::write(&config, lowered).unwrap();
    s.start_agent(AGENT).await;
    s.wait_run("waits", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    wait_for_async("the annotation removed", Duration::from_secs(10), || async {
        let lease = s.lease(AGENT).await.ok_or("no Lease")?;
        match lease.metadata.annotations.unwrap_or_default().get(ANNOTATION) {
            None => Ok(()),
            Some(v) => Err(format!("still {v}")),
        }
    })
    .await;
    wait_for("/healthz ok", Duration::from_secs(10), || {
        match s.agent_http(AGENT, "/healthz") {
            (200, _) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let (_, metrics) = s.agent_http(AGENT, "/metrics");
    assert!(metrics.contains("\ntartan_agent_disk_pressure 0\n"), "{metrics}");
    s.finish().await;
}
