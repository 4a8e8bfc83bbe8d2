//! deploy/monitoring against what the processes serve: every metric the alerting rules and the
//! dashboard name is in the `/metrics` of a running controller and agent (the watchdog serves
//! none; the agent counts its record), the PrometheusRule holds the same rules as rules.yaml, and
//! every alert's runbook_url names a section of docs/runbook.md. The rules' behaviour is tested
//! by promtool (scripts/test-monitoring).

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;
use tartan_e2e::promql::{exposed_names, metric_names};
use tartan_e2e::{AgentOptions, ControllerOptions, LeaderOptions, Stack, wait_for};

fn repo_file(path: &str) -> String {
    let full = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("reading {}: {e}", full.display()))
}

fn yaml(path: &str) -> Value {
    serde_saphyr::from_str(&repo_file(path)).unwrap_or_else(|e| panic!("parsing {path}: {e}"))
}

fn rules() -> Vec<Value> {
    yaml("deploy/monitoring/rules.yaml")["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").clone())
        .collect()
}

/// Every PromQL expression in deploy/monitoring, with where it is: the rules' `expr`, the
/// dashboard's `expr` anywhere in its panels, and its template variables' `label_values(...)`.
fn expressions() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = rules()
        .iter()
        .map(|r| {
            (
                format!("rules.yaml {}", r["alert"]),
                r["expr"].as_str().expect("expr").to_string(),
            )
        })
        .collect();
    let dashboard: Value = serde_json::from_str(&repo_file("deploy/monitoring/dashboard.json")).unwrap();
    fn walk(v: &Value, at: &str, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    if k == "expr" {
                        out.push((
                            format!("dashboard.json {at}"),
                            v.as_str().expect("expr string").to_string(),
                        ));
                    } else {
                        let title = m.get("title").and_then(Value::as_str).unwrap_or(at);
                        walk(v, title, out);
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, at, out)),
            _ => {}
        }
    }
    walk(&dashboard, "", &mut out);
    for var in dashboard["templating"]["list"].as_array().expect("templating") {
        if let Some(def) = var["definition"].as_str() {
            let metric = def
                .strip_prefix("label_values(")
                .and_then(|rest| rest.split(',').next())
                .unwrap_or_else(|| {
                    panic!(
                        "template variable {}: not label_values(METRIC, LABEL): {def}",
                        var["name"]
                    )
                });
            out.push((format!("dashboard.json variable {}", var["name"]), metric.to_string()));
        }
    }
    out
}

/// What the expressions name that `served` does not serve (or that is not a Tartan metric).
fn dangling(expressions: &[(String, String)], served: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    for (at, expr) in expressions {
        let names = metric_names(expr).unwrap_or_else(|e| panic!("{at}: {e}"));
        assert!(!names.is_empty(), "{at}: no metric name found in {expr:?}");
        for name in names {
            if !name.starts_with("tartan_") || !served.contains(&name) {
                out.push(format!("{at}: {name}"));
            }
        }
    }
    out
}

#[test]
fn metric_names_are_read_out_of_promql() {
    let set = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<BTreeSet<String>>();
    let cases: &[(&str, &[&str])] = &[
        ("up", &["up"]),
        ("tartan_agent_journal_failing == 1", &["tartan_agent_journal_failing"]),
        (
            r#"sum without (state) (tartan_agent_attempts{state="Quarantined", instance=~"$instance"}) + tartan_agent_unknown_vms"#,
            &["tartan_agent_attempts", "tartan_agent_unknown_vms"],
        ),
        (
            r#"increase(x_total{action=~"a|b}{[(", other="\"quoted\" y"}[30m]) > 0"#,
            &["x_total"],
        ),
        (
            "sum by (reason, status) (rate(a_total[$__rate_interval])) by (le)",
            &["a_total"],
        ),
        (
            "histogram_quantile(0.9, sum by (le) (rate(h_bucket[5m])))",
            &["h_bucket"],
        ),
        (
            "a / on (instance) group_left (agent) b unless c or d and bool e",
            &["a", "b", "c", "d", "e"],
        ),
        ("a offset 5m + b @ start() + 1e3 + 0x1f + Inf + NaN", &["a", "b"]),
        ("max_over_time(a[10m:1m]) + max (b) + absent(c)", &["a", "b", "c"]),
        ("ns:rule:rate5m # a comment naming not_a_metric\n", &["ns:rule:rate5m"]),
        ("vector(1)", &[]),
    ];
    for (expr, want) in cases {
        assert_eq!(metric_names(expr).unwrap(), set(want), "{expr}");
    }
    for bad in [r#"a{b="c}"#, "a{b=\"c\"", "rate(a[5m)"] {
        assert!(metric_names(bad).is_err(), "{bad} parsed");
    }
}

#[test]
fn exposed_names_follow_the_type_of_each_family() {
    let text = "\
# HELP a_seconds A histogram.
# TYPE a_seconds histogram
# TYPE b counter
# TYPE c gauge
# TYPE d summary
# TYPE e_total counter
c 1
f{x=\"y\"} 2
# EOF
";
    let want: BTreeSet<String> = [
        "a_seconds_bucket",
        "a_seconds_sum",
        "a_seconds_count",
        "b_total",
        "c",
        "d",
        "d_sum",
        "d_count",
        "e_total",
        "f",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(exposed_names(text), want);
}

#[test]
fn prometheus_rule_holds_the_same_groups_as_rules_yaml() {
    let plain = yaml("deploy/monitoring/rules.yaml");
    let object = yaml("deploy/monitoring/prometheusrule.yaml");
    assert_eq!(object["kind"], "PrometheusRule");
    assert_eq!(object["apiVersion"], "monitoring.coreos.com/v1");
    assert!(plain["groups"].as_array().is_some_and(|g| !g.is_empty()));
    assert_eq!(
        object["spec"]["groups"], plain["groups"],
        "deploy/monitoring/prometheusrule.yaml's spec.groups differ from rules.yaml's groups: copy them over"
    );
}

#[test]
fn every_alert_has_a_runbook_section() {
    let runbook = repo_file("docs/runbook.md");
    let anchors: BTreeSet<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(|h| h.trim().to_ascii_lowercase())
        .collect();
    for rule in rules() {
        let alert = rule["alert"].as_str().expect("alert name");
        let url = rule["annotations"]["runbook_url"].as_str().expect("runbook_url");
        let want = format!("https://tartan.invalid/docs/runbook.md#{}", alert.to_ascii_lowercase());
        assert_eq!(url, want, "{alert}");
        assert!(
            anchors.contains(&alert.to_ascii_lowercase()),
            "docs/runbook.md has no \"## {alert}\" section"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_name_is_served() {
    // A replica under leader election (the leader gauge) and one build gone through (a family
    // is served once it has a sample: the finished-run counters have them after the first end).
    let mut s = Stack::new("harness-monitoring").await;
    s.add_agent("agent-a", AgentOptions::default());
    s.start_replica("ctl-a", ControllerOptions::default(), &LeaderOptions::default());
    wait_for("ctl-a to lead", Duration::from_secs(30), || {
        if !s.replica_log("ctl-a").contains("serving /metrics") {
            return Err("not serving yet".to_string());
        }
        let got = s.replica_http("ctl-a", "/readyz");
        (got == (200, "ok: leading\n".to_string()))
            .then_some(())
            .ok_or(format!("{got:?}"))
    })
    .await;
    s.start_agent("agent-a").await;
    s.create_run("build-1", &s.build_params(false), None).await;
    s.wait_run("build-1", "True", "TestsPassed", Duration::from_secs(90))
        .await;
    let mut served = BTreeSet::new();
    for (who, (status, text)) in [
        ("controller", s.replica_http("ctl-a", "/metrics")),
        ("agent", s.agent_http("agent-a", "/metrics")),
    ] {
        assert_eq!(status, 200, "{who}: {text}");
        served.extend(exposed_names(&text));
    }
    let expressions = expressions();
    assert_eq!(
        dangling(&expressions, &served),
        Vec::<String>::new(),
        "served: {served:?}"
    );
    // The check itself: a panel naming a metric nobody serves (a typo, a histogram suffix on a
    // gauge, a counter without _total) is caught.
    for bogus in [
        "tartan_agent_slots_bussy",
        "rate(tartan_agent_slots_bucket[5m])",
        "tartan_controller_reconciles",
        "up",
    ] {
        let mut with_bogus = expressions.clone();
        with_bogus.push(("a bogus panel".into(), bogus.into()));
        assert_eq!(dangling(&with_bogus, &served).len(), 1, "{bogus} not caught");
    }
    s.finish().await;
}
