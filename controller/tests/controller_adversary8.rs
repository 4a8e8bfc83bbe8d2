//! Adversary 8: hostile CustomRun input against the pure decision (`decide`) and, where the API
//! matters, the controller against the emulator. Each test names the promise it checks; tests
//! marked HELD passed when written and stay as guards.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use tartan_api::text::clean_str;
use tartan_controller::customrun::{CustomRef, CustomRun, CustomRunSpec, Param};
use tartan_controller::decide::{BuildAction, Plan, Timing, decide};

const NS: &str = "ci";
const NAME: &str = "build-42-mac-build";

/// A bound any status message should respect (the controller's own bound for copied text).
const BOUND: usize = tartan_controller::view::MESSAGE_MAX;

fn t0() -> Timestamp {
    "2026-10-05T02:52:00Z".parse().unwrap()
}

fn param(name: &str, value: Value) -> Param {
    Param {
        name: name.into(),
        value,
    }
}

fn run_with(params: Vec<Param>, timeout: Option<&str>) -> CustomRun {
    let spec = CustomRunSpec {
        custom_ref: Some(CustomRef {
            api_version: Some("tartan.dev/v1alpha1".into()),
            kind: Some("MacBuild".into()),
            ..Default::default()
        }),
        params,
        timeout: timeout.map(String::from),
        service_account_name: "default".into(),
        ..Default::default()
    };
    let mut r = CustomRun::new(NAME, spec);
    r.metadata.namespace = Some(NS.into());
    r.metadata.uid = Some("run-uid-1".into());
    r.metadata.generation = Some(1);
    r.metadata.creation_timestamp = Some(Time(t0()));
    r
}

/// `image` + `steps` + the hostile params.
fn base(extra: Vec<Param>) -> Vec<Param> {
    let mut ps = vec![param("image", json!("img")), param("steps", json!(["make"]))];
    ps.extend(extra);
    ps
}

fn decide_now(r: &CustomRun) -> Plan {
    decide(r, None, None, &Timing::default(), t0())
}

fn succeeded(p: &Plan) -> (String, String, String) {
    let c = &p.status.conditions[0];
    (
        c.status.clone(),
        c.reason.clone().unwrap_or_default(),
        c.message.clone().unwrap_or_default(),
    )
}

/// The status message is clean (what `tartan_api::text::clean` would keep) and bounded, and so
/// is every Event's.
fn assert_clean_and_bounded(p: &Plan, what: &str) {
    let (_, _, msg) = succeeded(p);
    let shown = |m: &str| format!("{:?}", m.chars().take(300).collect::<String>());
    assert!(
        clean_str(&msg, usize::MAX) == msg,
        "{what}: status message carries escapes/control/bidi characters: {}",
        shown(&msg)
    );
    assert!(
        msg.len() <= BOUND,
        "{what}: status message is {} bytes (bound {BOUND})",
        msg.len()
    );
    for e in &p.events {
        assert!(
            clean_str(&e.message, usize::MAX) == e.message,
            "{what}: event message not clean: {}",
            shown(&e.message)
        );
        assert!(
            e.message.len() <= BOUND,
            "{what}: event message is {} bytes",
            e.message.len()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// FINDING 1 (promise: nothing a pipeline author writes puts terminal escapes into status
// messages). Input: param `cpu` given as an ARRAY holding a string with the 8-bit C1 CSI
// (U+009B) and a bidi override (U+202E). `param_string` reports `got {}` with serde_json's
// Display, which escapes only U+0000..U+001F, `"` and `\`: U+009B, U+202E (and DEL) reach
// `Succeeded.message` and the Warning Event raw.
// ---------------------------------------------------------------------------------------------
#[test]
fn adv8_non_string_param_value_echoes_c1_csi_and_bidi_into_the_status_message() {
    let r = run_with(
        base(vec![param(
            "cpu",
            json!(["\u{9b}2J\u{9b}31mPASSED\u{202e}dekcah\u{7f}"]),
        )]),
        None,
    );
    let p = decide_now(&r);
    let (status, reason, _) = succeeded(&p);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "InvalidParams"));
    assert_clean_and_bounded(&p, "cpu=[C1 CSI]");
}

// ---------------------------------------------------------------------------------------------
// FINDING 2 (same promise, worse: a real 7-bit ESC). Input: param `env` as an object whose KEY
// carries ESC sequences and whose value is not a string. `param_env` builds its hint
// `(quote it: {name}: "...")` with Display of the key, not Debug, so the key's ESC/BEL reach
// the message verbatim (an OSC title-set / screen clear in `kubectl describe customrun`).
// ---------------------------------------------------------------------------------------------
#[test]
fn adv8_env_key_with_escape_sequence_reaches_the_status_message_raw() {
    let key = "\u{1b}]0;owned\u{7}\u{1b}[2J\u{1b}[1;32mSucceeded";
    let r = run_with(base(vec![param("env", json!({ key: 1 }))]), None);
    let p = decide_now(&r);
    let (status, reason, msg) = succeeded(&p);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "InvalidParams"),
        "{msg:?}"
    );
    assert_clean_and_bounded(&p, "env={ESC-key: 1}");
}

// ---------------------------------------------------------------------------------------------
// FINDING 3 (promise: no unbounded text into status messages). Input: param `cpu` of 1 MiB of
// digits. `param_int` echoes the whole value (`got {text:?}`) into `Succeeded.message` and the
// Event: the status write then carries the value a second time (a spec near etcd's object
// limit can no longer have its failure recorded, and the run never ends).
// ---------------------------------------------------------------------------------------------
#[test]
fn adv8_huge_param_value_is_echoed_unbounded_into_the_status_message() {
    let huge = "9".repeat(1 << 20);
    let r = run_with(base(vec![param("cpu", json!(huge))]), None);
    let p = decide_now(&r);
    let (status, reason, _) = succeeded(&p);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "InvalidParams"));
    assert_clean_and_bounded(&p, "cpu=1MiB");
}

// Same promise via a step name: `check_step_timeouts` prints the step's name with
// `Value::to_string` (whole, JSON Display: bidi overrides raw) when its timeoutSeconds is bad.
// (A C1 character is refused by the YAML parser first, with a bounded snippet.)
#[test]
fn adv8_step_name_in_timeout_error_is_unbounded_and_unclean() {
    let name = format!("\u{202e}kcatta{}", "n".repeat(100_000));
    let steps = json!([{ "name": name, "run": ["x"], "timeoutSeconds": 0 }]).to_string();
    let r = run_with(vec![param("image", json!("img")), param("steps", json!(steps))], None);
    let p = decide_now(&r);
    let (status, reason, _) = succeeded(&p);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "InvalidParams"));
    assert_clean_and_bounded(&p, "steps[0].name=U+202E+100k");
}

// Same promise via the unknown-param path: the name is Debug-escaped (clean) but unbounded.
#[test]
fn adv8_unknown_param_name_is_unbounded_in_the_status_message() {
    let r = run_with(base(vec![param(&"x".repeat(200_000), json!("v"))]), None);
    let p = decide_now(&r);
    assert_eq!(succeeded(&p).1, "InvalidParams");
    assert_clean_and_bounded(&p, "unknown 200k-byte param name");
}

// ---------------------------------------------------------------------------------------------
// FINDING 4 (promise: bad input ends with a clear error / a legal run is not refused for a
// field its author never wrote). Input: `spec.timeout: 200h` (legal Tekton) and no
// `timeout-seconds` param. `macbuild_spec` sets `timeoutSeconds` to the CustomRun cap,
// 720000, beyond the MacBuild CRD's `maximum: 604800`: the controller plans to create a
// MacBuild the API must refuse (422 → "InvalidMacBuildSpec: the API refused the MacBuild…"),
// instead of capping at the CRD's maximum (the CustomRun deadline still bounds the run).
// ---------------------------------------------------------------------------------------------
#[test]
fn adv8_long_customrun_timeout_plans_a_macbuild_the_crd_refuses() {
    let r = run_with(base(vec![]), Some("200h"));
    let p = decide_now(&r);
    match &p.action {
        BuildAction::Create(spec) => {
            let secs = spec["timeoutSeconds"].as_u64().unwrap();
            assert!(
                secs <= 604_800,
                "timeoutSeconds {secs} exceeds the CRD maximum 604800: the API will refuse the MacBuild"
            );
        }
        other => {
            // A clear refusal naming spec.timeout would also be acceptable.
            let (_, _, msg) = succeeded(&p);
            assert!(msg.contains("timeout"), "{other:?}: {msg}");
        }
    }
}

// Same, through the param: `timeout-seconds` accepts up to u32::MAX although the CRD stops at
// 604800, so `timeout-seconds: "700000"` (no CustomRun cap with timeout 0) passes the param
// check and is refused by the API with its own wording, not "param timeout-seconds".
#[test]
fn adv8_timeout_seconds_param_above_crd_maximum_is_not_refused_as_a_param() {
    let r = run_with(base(vec![param("timeout-seconds", json!("700000"))]), Some("0s"));
    let p = decide_now(&r);
    match &p.action {
        BuildAction::Create(spec) => panic!(
            "timeoutSeconds {} accepted; the CRD maximum is 604800, the API will refuse it",
            spec["timeoutSeconds"]
        ),
        _ => {
            let (_, reason, msg) = succeeded(&p);
            assert_eq!(reason, "InvalidParams", "{msg}");
            assert!(msg.contains("timeout-seconds"), "{msg}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// HELD checks.
// ---------------------------------------------------------------------------------------------

/// HELD: a YAML alias bomb in `steps` ends quickly with InvalidParams (serde-saphyr's budget).
#[test]
fn adv8_held_yaml_alias_bomb_in_steps_is_refused_quickly() {
    let mut steps = String::from("- name: z\n  run: [x]\n  bomb:\n    a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..12 {
        let prev = i - 1;
        let refs = vec![format!("*a{prev}"); 10].join(", ");
        steps.push_str(&format!("    a{i}: &a{i} [{refs}]\n"));
    }
    let r = run_with(vec![param("image", json!("img")), param("steps", json!(steps))], None);
    let start = Instant::now();
    let p = decide_now(&r);
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    let (status, _, msg) = succeeded(&p);
    assert_eq!(status, "False", "{}", msg.chars().take(300).collect::<String>());
}

/// HELD: duplicate keys in the `env` YAML string must not silently drop a value.
#[test]
fn adv8_held_duplicate_keys_in_env_yaml_are_refused_not_merged() {
    let r = run_with(base(vec![param("env", json!("A: one\nA: two"))]), None);
    let p = decide_now(&r);
    assert!(
        !matches!(p.action, BuildAction::Create(_)),
        "env with A twice accepted silently: {:?}",
        p.action
    );
    assert_eq!(succeeded(&p).0, "False");
}

/// HELD: duplicate keys in a step of the `steps` YAML string.
#[test]
fn adv8_held_duplicate_keys_in_a_step_are_refused_not_merged() {
    let steps = "[{name: build, run: [make], run: [rm, -rf, /]}]";
    let r = run_with(vec![param("image", json!("img")), param("steps", json!(steps))], None);
    let p = decide_now(&r);
    assert!(
        !matches!(p.action, BuildAction::Create(_)),
        "a step with `run` twice accepted silently: {:?}",
        p.action
    );
}

/// HELD: negative/overflowing/odd CustomRun timeouts end the run cleanly, never panic.
#[test]
fn adv8_held_hostile_customrun_timeouts_end_cleanly() {
    for t in [
        "-1s",
        "-0s",
        "99999999999999999999999999999999999999h",
        "1e9s",
        "\u{1b}[2J1h",
        "1h\u{9b}31m",
        "0.0000000001ns",
        "",
        // (Longer legal timeouts, from 168h up to Go's 2562047h, are finding 4.)
    ] {
        let r = run_with(base(vec![]), Some(t));
        let start = Instant::now();
        let p = decide_now(&r);
        assert!(start.elapsed() < Duration::from_secs(2));
        let (status, reason, _) = succeeded(&p);
        if status == "False" {
            assert_eq!(reason, "InvalidTimeout", "{t:?}");
        }
        assert_clean_and_bounded(&p, &format!("timeout {t:?}"));
        if let BuildAction::Create(spec) = &p.action {
            // Absent = the CRD default (3600); present must fit the CRD.
            if let Some(secs) = spec.get("timeoutSeconds").and_then(Value::as_u64) {
                assert!((1..=604_800).contains(&secs), "timeout {t:?}: timeoutSeconds {secs}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// FINDING 4, end to end against the emulator: a CustomRun with the legal Tekton timeout `200h`
// and the usual params must get its MacBuild. Observed: the create is refused by the CRD's
// `maximum: 604800` on the timeoutSeconds the controller itself derived, and the run ends
// `False/InvalidMacBuildSpec` with the API's wording.
// ---------------------------------------------------------------------------------------------
mod emulator {
    use super::*;
    use kube::CustomResourceExt as _;
    use kube::api::{Api, PostParams};
    use tartan_api::MacBuild;
    use tartan_controller::run::RunArgs;
    use tartan_testkit::Options;

    #[tokio::test]
    async fn adv8_emulator_customrun_timeout_200h_gets_a_macbuild() {
        let emu = tartan_testkit::start(Options::default().crd_file(tartan_testkit::customrun_crd()))
            .await
            .expect("emulator starts");
        emu.install_crd(serde_json::to_value(MacBuild::crd()).unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        emu.write_kubeconfig(&kubeconfig).unwrap();
        let client = emu.client();
        let args = RunArgs {
            kubeconfig: Some(kubeconfig),
            namespaces: vec!["default".into()],
            default_timeout: Duration::from_secs(3600),
            grace: Duration::from_secs(2),
            lease_duration: Duration::from_secs(20),
            finished_label_after: Duration::ZERO,
            agent_lease_namespace: None,
            api_timeout: Duration::from_secs(5),
            metrics_address: "127.0.0.1:0".parse().unwrap(),
            http_max_connections: tartan_serve::DEFAULT_MAX_CONNECTIONS,
            http_idle_timeout: tartan_serve::DEFAULT_IDLE_TIMEOUT,
            instance: "adv8".into(),
            leader_elect: false,
            leader_lease_namespace: None,
            leader_lease_name: "tartan-controller".into(),
            leader_identity: None,
            leader_lease: Duration::from_secs(15),
            leader_renew_every: Duration::from_secs(5),
            leader_retry_every: Duration::from_secs(2),
            leader_margin: Duration::from_secs(5),
            concurrency: 4,
        };
        let ctl = tokio::spawn(tartan_controller::run::run(args));
        let runs: Api<CustomRun> = Api::namespaced(client.clone(), "default");
        let builds: Api<MacBuild> = Api::namespaced(client.clone(), "default");
        let run: CustomRun = serde_json::from_value(json!({
            "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
            "metadata": {"name": "long"},
            "spec": {
                "customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"},
                "params": [{"name": "image", "value": "img"}, {"name": "steps", "value": ["make"]}],
                "serviceAccountName": "default",
                "timeout": "200h",
            },
        }))
        .unwrap();
        runs.create(&PostParams::default(), &run).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(15);
        let outcome = loop {
            if builds.get_opt("long").await.unwrap().is_some() {
                break Ok(());
            }
            let status = runs.get("long").await.unwrap().status;
            if let Some(c) = status
                .as_ref()
                .and_then(|s| s.conditions.first())
                .filter(|c| c.status == "False")
            {
                break Err(format!("{:?}: {:?}", c.reason, c.message));
            }
            assert!(Instant::now() < deadline, "neither a MacBuild nor a verdict in 15s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        ctl.abort();
        assert_eq!(outcome, Ok(()), "a legal 200h CustomRun was failed");
    }
}
