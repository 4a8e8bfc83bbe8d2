//! Claim where the image already is: of two free agents, the one whose tart cache holds the build's
//! image claims it; the other waits `uncached_claim_delay` and claims only what the holder cannot
//! take (its slot is busy), so a build is never stranded. Each agent publishes what it holds on its
//! Lease (`tartan.dev/images`).

use std::time::Duration;
use tartan_api::AttemptState;
use tartan_e2e::stack::IMAGE;
use tartan_e2e::{AgentOptions, ControllerOptions, Stack, wait_for_async};

const UNCACHED_DELAY: Duration = Duration::from_secs(3);

// scenario: image-aware-claim
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_holding_the_image_claims_first_and_the_other_only_after_the_delay() {
    let mut s = Stack::new("image-aware-claim").await;
    let opts = AgentOptions {
        uncached_claim_delay: "3s",
        ..AgentOptions::default()
    };
    s.add_agent("holder", opts.clone());
    s.add_agent("other", opts);
    // The holder has pulled the image before (a clone pulls it; the clone itself goes).
    for args in [["clone", IMAGE, "warm"].as_slice(), &["delete", "warm"]] {
        let out = s.tart("holder", args);
        assert!(out.status.success(), "tart-double {args:?}: {out:?}");
    }
    s.start_controller(ControllerOptions::default());
    s.start_agent("holder").await;
    s.start_agent("other").await;

    // Both publish what they hold.
    wait_for_async("both Leases list the images held", Duration::from_secs(20), || async {
        let (h, o) = (
            images_published(&s, "holder").await,
            images_published(&s, "other").await,
        );
        match (&h, &o) {
            (Some(h), Some(o)) if h.contains(IMAGE) && o == "[]" => Ok(()),
            _ => Err(format!("holder {h:?}, other {o:?}")),
        }
    })
    .await;

    // Both are free: the holder takes the build (gated, so it keeps the holder's only slot).
    s.create_run("first", &s.build_params(true), None).await;
    s.wait_journal("holder", "first admitted", Duration::from_secs(30), |r| {
        r.to == AttemptState::Admitted && r.build.as_ref().is_some_and(|b| b.name == "first")
    })
    .await;
    let tried = |id: &str, name: &str| {
        s.journal(id)
            .iter()
            .any(|r| r.build.as_ref().is_some_and(|b| b.name == name))
    };
    assert!(
        !tried("other", "first"),
        "the agent without the image tried the build the holder took:\n{}",
        s.journal_text("other")
    );

    // The holder is busy now: the other agent claims the next build, but only after its delay.
    let created = k8s_openapi::jiff::Timestamp::now();
    s.create_run("second", &s.build_params(false), None).await;
    let admitted = s
        .wait_journal("other", "second admitted", Duration::from_secs(30), |r| {
            r.to == AttemptState::Admitted && r.build.as_ref().is_some_and(|b| b.name == "second")
        })
        .await;
    let waited = admitted.time.duration_since(created).unsigned_abs();
    assert!(
        waited >= UNCACHED_DELAY,
        "claimed {waited:?} after creation, before uncached_claim_delay"
    );
    assert!(!tried("holder", "second"), "the busy holder tried the second build");

    s.open_gate();
    s.wait_run("first", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    s.wait_run("second", "True", "TestsPassed", Duration::from_secs(60))
        .await;
    s.finish().await;
}

/// The `tartan.dev/images` annotation of agent `id`'s Lease.
async fn images_published(s: &Stack, id: &str) -> Option<String> {
    let annotations = s.lease(id).await?.metadata.annotations?;
    annotations.get("tartan.dev/images").cloned()
}
