//! Fault controls: deny rules standing in for a ValidatingAdmissionPolicy, unavailability, refused
//! connections and latency, through the handle and over HTTP.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tartan_testkit::{Availability, DenyRule, PredicateOp, Target};

fn terminal_status_rule() -> DenyRule {
    DenyRule::new("mac-ci-deny-terminal-status")
        .operations(&["UPDATE"])
        .resource("tartan.dev", "macbuilds")
        .subresource("status")
        .when(
            Target::OldObject,
            "status.phase",
            PredicateOp::In,
            &[json!("Succeeded"), json!("Failed")],
        )
        .message("status of a finished MacBuild is immutable")
}

#[tokio::test]
async fn deny_rule_refuses_matching_writes_like_a_validating_admission_policy() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    api.create(&PostParams::default(), &macbuild("d", json!({"image": "x"})))
        .await
        .unwrap();
    emu.add_deny_rule(terminal_status_rule());
    // Not terminal yet: allowed.
    api.patch_status(
        "d",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .unwrap();
    // Terminal now: a rewrite is denied with the VAP's shape.
    let s = status_of(
        api.patch_status(
            "d",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running"}})),
        )
        .await,
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    let why = "ValidatingAdmissionPolicy 'mac-ci-deny-terminal-status' with binding 'mac-ci-deny-terminal-status' denied request: status of a finished MacBuild is immutable";
    assert_eq!(s.message, format!("macbuilds.tartan.dev \"d\" is forbidden: {why}"));
    let details = s.details.unwrap();
    assert_eq!(details.causes[0].message, why);
    assert_eq!(api.get("d").await.unwrap().data["status"]["phase"], json!("Succeeded"));
    // The main resource is not covered by the rule.
    api.patch(
        "d",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
    )
    .await
    .unwrap();

    // A Forbidden (403) rule on creates in one namespace, set over HTTP.
    let http = reqwest_like_post(
        &emu,
        json!({"deny": [{"policy": "no-builds-in-default", "operations": ["CREATE"], "resource": "macbuilds",
                          "namespace": "default", "reason": "Forbidden", "message": "use the ci namespace"}]}),
    )
    .await;
    assert_eq!(http["deny"][0]["policy"], json!("no-builds-in-default"));
    let f = status_of(
        api.create(&PostParams::default(), &macbuild("e", json!({"image": "x"})))
            .await,
    );
    assert_eq!((f.code, f.reason.as_str()), (403, "Forbidden"));
    assert!(
        f.message.ends_with("denied request: use the ci namespace"),
        "{}",
        f.message
    );
    emu.clear_deny_rules();
    api.create(&PostParams::default(), &macbuild("e", json!({"image": "x"})))
        .await
        .unwrap();
}

/// POST /emulator/faults with a plain HTTP/1.1 request (no client library).
async fn reqwest_like_post(emu: &tartan_testkit::EmulatorHandle, body: Value) -> Value {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(emu.addr()).await.unwrap();
    let b = body.to_string();
    let req = format!(
        "POST /emulator/faults HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
        b.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let body = out.split("\r\n\r\n").nth(1).unwrap();
    serde_json::from_str(body).unwrap()
}

#[tokio::test]
async fn unavailable_refused_and_slow() {
    let emu = emulator().await;
    let mut config = emu.config();
    config.default_retry = false;
    let api = macbuilds(&kube::Client::try_from(config).unwrap(), "default");
    emu.set_availability(Availability::Unavailable);
    let s = status_of(api.get("x").await);
    assert_eq!((s.code, s.reason.as_str()), (503, "ServiceUnavailable"));
    // kube's default client retries a 503 with backoff, so it rides out a short outage.
    let retrying = macbuilds(&emu.client(), "default");
    let outage = tokio::spawn(async move { retrying.get("x").await });
    eventually(10, "a retried request", || async {
        (emu.requests().len() >= 3).then_some(())
    })
    .await;
    emu.set_availability(Availability::Up);
    let retried = outage.await.unwrap();
    assert_eq!(
        status_of(retried).code,
        404,
        "the retried request got through once the server was back"
    );
    assert_eq!(status_of(api.get("x").await).code, 404);

    emu.set_availability(Availability::Refuse);
    eventually(10, "connections refused", || async {
        tokio::net::TcpStream::connect(emu.addr()).await.is_err().then_some(())
    })
    .await;
    assert!(matches!(api.get("x").await, Err(e) if !matches!(e, kube::Error::Api(_))));
    emu.set_availability(Availability::Up);
    eventually(10, "serving again", || {
        let api = api.clone();
        async move { matches!(api.get("x").await, Err(kube::Error::Api(s)) if s.code == 404).then_some(()) }
    })
    .await;

    emu.set_latency(Duration::from_millis(300));
    let t = Instant::now();
    let _ = api.get("x").await;
    assert!(t.elapsed() >= Duration::from_millis(300));
    emu.set_latency(Duration::ZERO);
}

#[tokio::test]
async fn control_port_restores_a_refusing_server() {
    let emu = emulator_with(tartan_testkit::Options {
        control_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    })
    .await;
    let control: std::net::SocketAddr = emu
        .control_url()
        .unwrap()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let post = |body: Value| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(control).await.unwrap();
        let b = body.to_string();
        let req = format!(
            "POST /emulator/faults HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
            b.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    assert!(
        post(json!({"availability": "refuse"}))
            .await
            .starts_with("HTTP/1.1 200")
    );
    eventually(10, "API port refused", || async {
        tokio::net::TcpStream::connect(emu.addr()).await.is_err().then_some(())
    })
    .await;
    assert!(post(json!({"availability": "up"})).await.starts_with("HTTP/1.1 200"));
    let api = macbuilds(&emu.client(), "default");
    eventually(10, "API back", || {
        let api = api.clone();
        async move {
            api.create(&PostParams::default(), &macbuild("back", json!({"image": "x"})))
                .await
                .ok()
        }
    })
    .await;
    // A timed outage restores itself. Long enough that the GET below lands inside it on a loaded
    // machine (at 200 ms a CI run saw the GET answered after the outage had ended).
    assert!(
        post(json!({"availability": "unavailable", "forMs": 5000}))
            .await
            .starts_with("HTTP/1.1 200")
    );
    let mut config = emu.config();
    config.default_retry = false;
    let no_retry = macbuilds(&kube::Client::try_from(config).unwrap(), "default");
    assert_eq!(status_of(no_retry.get("back").await).code, 503);
    eventually(30, "timed outage over", || {
        let api = api.clone();
        async move { api.get("back").await.ok() }
    })
    .await;
}

#[tokio::test]
async fn stalled_watches_deliver_nothing_then_end_and_resume() {
    use futures::StreamExt;
    use kube::api::{WatchEvent, WatchParams};
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    let created = api
        .create(&PostParams::default(), &macbuild("w", json!({"image": "x"})))
        .await
        .unwrap();
    let rv = created.metadata.resource_version.clone().unwrap();
    let mut w = api.watch(&WatchParams::default(), &rv).await.unwrap().boxed();
    reqwest_like_post(&emu, json!({"watchesStalled": true})).await;
    api.patch(
        "w",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"k": "v"}}})),
    )
    .await
    .unwrap();
    let quiet = tokio::time::timeout(Duration::from_millis(700), w.next()).await;
    assert!(quiet.is_err(), "a stalled watch delivers nothing: {quiet:?}");
    assert!(emu.faults().watches_stalled);
    // Other requests are served meanwhile.
    assert!(api.get("w").await.is_ok());

    reqwest_like_post(&emu, json!({"watchesStalled": false})).await;
    let ended = tokio::time::timeout(Duration::from_secs(5), w.next()).await;
    assert!(
        matches!(ended, Ok(None)),
        "the stalled watch ends once lifted: {ended:?}"
    );
    let mut resumed = api.watch(&WatchParams::default(), &rv).await.unwrap().boxed();
    let event = tokio::time::timeout(Duration::from_secs(5), resumed.next())
        .await
        .expect("an event within 5s")
        .expect("stream open")
        .expect("event decodes");
    assert!(
        matches!(&event, WatchEvent::Modified(o) if kube::ResourceExt::labels(o).get("k").is_some_and(|v| v == "v")),
        "the held event comes on the next watch: {event:?}"
    );
}

/// A client of the emulator presenting bearer token `user`.
fn client_as(emu: &tartan_testkit::EmulatorHandle, user: &str) -> kube::Client {
    let mut config = emu.config();
    config.auth_info.token = Some(user.to_string().into());
    kube::Client::try_from(config).unwrap()
}

#[tokio::test]
async fn a_partitioned_user_gets_no_answer_while_others_are_served() {
    use futures::StreamExt;
    use kube::api::WatchParams;
    let emu = emulator().await;
    let agent = macbuilds(&client_as(&emu, "tartan-agent"), "default");
    let controller = macbuilds(&client_as(&emu, "tartan-controller"), "default");
    let created = controller
        .create(&PostParams::default(), &macbuild("p", json!({"image": "x"})))
        .await
        .unwrap();
    let rv = created.metadata.resource_version.clone().unwrap();
    let mut watch = agent.watch(&WatchParams::default(), &rv).await.unwrap().boxed();

    reqwest_like_post(&emu, json!({"partitioned": ["tartan-agent"]})).await;
    assert_eq!(emu.faults().partitioned, vec!["tartan-agent".to_string()]);
    // No answer at all, not an API status: the connection is dropped.
    let refused = agent.get("p").await;
    assert!(
        matches!(&refused, Err(e) if !matches!(e, kube::Error::Api(_))),
        "a partitioned request gets no answer: {refused:?}"
    );
    // The open watch is cut (kube reads a connection broken mid-body as the watch's end), and
    // watching again gets no answer either.
    let cut = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .expect("the watch is cut within 5s");
    assert!(matches!(cut, None | Some(Err(_))), "the watch breaks: {cut:?}");
    let again = agent.watch(&WatchParams::default(), &rv).await.map(|_| ());
    assert!(again.is_err(), "a new watch gets no answer: {again:?}");
    // The other user, and a client without a token, are served.
    controller
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"k": "v"}}})),
        )
        .await
        .unwrap();
    assert!(macbuilds(&emu.client(), "default").get("p").await.is_ok());

    emu.set_partitioned(&[]);
    let healed = agent.get("p").await.unwrap();
    assert_eq!(healed.metadata.labels.unwrap()["k"], "v");
}

#[tokio::test]
async fn a_busy_server_serves_one_request_at_a_time() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    api.create(&PostParams::default(), &macbuild("b", json!({"image": "x"})))
        .await
        .unwrap();
    emu.set_busy(Duration::from_millis(50));
    let started = Instant::now();
    let reads = (0..6).map(|_| api.get("b"));
    for r in futures::future::join_all(reads).await {
        r.unwrap();
    }
    // Served concurrently, six reads take one busy period; one at a time, six.
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "6 concurrent reads took {:?}",
        started.elapsed()
    );
    emu.set_busy(Duration::ZERO);
}

#[tokio::test]
async fn answers_record_each_request_with_its_status_code() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    api.create(&PostParams::default(), &macbuild("a", json!({"image": "x"})))
        .await
        .unwrap();
    // A JSON patch whose test fails: the 422 a losing claim gets.
    let failing = json_patch::Patch(vec![json_patch::PatchOperation::Test(json_patch::TestOperation {
        path: json_patch::jsonptr::PointerBuf::parse("/metadata/resourceVersion").unwrap(),
        value: json!("1"),
    })]);
    let refused = api
        .patch_status("a", &PatchParams::default(), &Patch::Json::<()>(failing))
        .await;
    assert_eq!(status_of(refused).code, 422);
    let answers = emu.answers();
    let codes: Vec<(&str, u16)> = answers
        .iter()
        .filter(|a| a.uri.contains("/macbuilds"))
        .map(|a| (a.method.as_str(), a.code))
        .collect();
    assert_eq!(codes, [("POST", 201), ("PATCH", 422)], "{answers:?}");
    let patch = answers.iter().find(|a| a.method == "PATCH").unwrap();
    assert!(patch.uri.ends_with("/macbuilds/a/status"), "{patch:?}");
    assert!(patch.at_ms > 1_700_000_000_000, "{patch:?}");
}

/// A held write is applied after its client gave up, and after a newer write that overtook it;
/// other objects' writes and all reads go through at once.
#[tokio::test]
async fn a_held_write_is_applied_after_its_client_gave_up_and_after_a_newer_write() {
    let emu = emulator().await;
    let api = macbuilds(&emu.client(), "default");
    for name in ["h", "other"] {
        api.create(&PostParams::default(), &macbuild(name, json!({"image": "x"})))
            .await
            .unwrap();
    }
    // The test CRD prunes `journalSeq`: the claim's attempt stands for the write's sequence.
    let status = |seq: u64| Patch::Merge(json!({"status": {"claim": {"holder": "a", "attempt": seq.to_string()}}}));
    let seq_of = |api: &kube::Api<kube::core::DynamicObject>, name: &'static str| {
        let api = api.clone();
        async move {
            let mb = api.get(name).await.unwrap();
            mb.data["status"]["claim"]["attempt"]
                .as_str()
                .and_then(|s| s.parse::<u64>().ok())
        }
    };
    emu.hold_writes(tartan_testkit::HeldWrites::status_of(
        "macbuilds",
        "default",
        "h",
        Duration::from_millis(800),
        1,
    ));
    // The client gives up long before the hold ends.
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        api.patch_status("h", &PatchParams::default(), &status(30)),
    )
    .await;
    assert!(gave_up.is_err(), "the held write answered within 100 ms: {gave_up:?}");
    assert_eq!(seq_of(&api, "h").await, None, "applied before its hold ended");
    // The rule held one write: the next one, and another object's, land at once.
    let t = Instant::now();
    api.patch_status("h", &PatchParams::default(), &status(31))
        .await
        .unwrap();
    api.patch_status("other", &PatchParams::default(), &status(7))
        .await
        .unwrap();
    assert!(t.elapsed() < Duration::from_millis(500), "{:?}", t.elapsed());
    assert_eq!(seq_of(&api, "h").await, Some(31));
    assert_eq!(emu.faults().held_writes[0].count, 0);
    // Then the held write lands over the newer one, its answer recorded though nobody read it.
    eventually(10, "the held write applied", || async {
        (seq_of(&api, "h").await == Some(30)).then_some(())
    })
    .await;
    let patches: Vec<u16> = emu
        .answers()
        .iter()
        .filter(|a| a.method == "PATCH" && a.uri.contains("/macbuilds/h/status"))
        .map(|a| a.code)
        .collect();
    assert_eq!(patches, [200, 200]);

    // Over HTTP, the rule is set the same way.
    let set = reqwest_like_post(
        &emu,
        json!({"heldWrites": [{"resource": "macbuilds", "name": "other", "holdMs": 50, "count": 2}]}),
    )
    .await;
    assert_eq!(set["heldWrites"][0]["count"], json!(2));
}
