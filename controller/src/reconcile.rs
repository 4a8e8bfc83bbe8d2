//! The I/O around [`decide`]: read the CustomRun, its MacBuild and the holder's Lease fresh from
//! the API, decide, act on the MacBuild, then write the CustomRun's `/status` (only if it
//! changed), publish Events and count metrics.

use crate::customrun::{CustomRun, CustomRunStatus};
use crate::decide::{self, BuildAction, Plan, Timing};
use crate::metrics::{ErrorLabels, Metrics, OutcomeLabels, RetirementLabels};
use crate::view::{build_view, lease_name, lease_view, new_macbuild};
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation, TestOperation};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Client, Resource as _};
use serde_json::{Value, json};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tartan_api::{CONTROLLER_FIELD_MANAGER, MacBuild};
use tracing::{info, warn};

/// Shared state of all reconciles.
pub struct Ctx {
    pub client: Client,
    pub timing: Timing,
    /// Where agent Leases live; `None` = the MacBuild's namespace.
    pub lease_namespace: Option<String>,
    /// Timeout of each API call.
    pub api_timeout: Duration,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
}

/// Why a reconcile failed. Each says what failed, on what, and that it will be retried.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} {target} failed: {source}; retrying")]
    Kube {
        what: &'static str,
        target: String,
        #[source]
        source: kube::Error,
    },
    #[error("{what} {target} got no answer within {secs}s; retrying")]
    Timeout {
        what: &'static str,
        target: String,
        secs: u64,
    },
    #[error("CustomRun {0}: its status or MacBuild kept changing under us for 5 attempts; retrying")]
    Conflicts(String),
}

impl Error {
    /// The `error` label of the failure counter.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube { .. } => "api",
            Error::Timeout { .. } => "timeout",
            Error::Conflicts(_) => "conflicts",
        }
    }
}

async fn call<T>(
    what: &'static str,
    target: &str,
    limit: Duration,
    fut: impl Future<Output = Result<T, kube::Error>>,
) -> Result<Result<T, kube::Error>, Error> {
    tokio::time::timeout(limit, fut).await.map_err(|_| Error::Timeout {
        what,
        target: target.to_string(),
        secs: limit.as_secs(),
    })
}

fn kube_err(what: &'static str, target: &str, source: kube::Error) -> Error {
    Error::Kube {
        what,
        target: target.to_string(),
        source,
    }
}

fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// The JSON patch for `/status`: fenced so that a concurrent terminal write (another controller
/// instance) is never overwritten. With a current `Succeeded` condition we test its status,
/// reason and transition time (Tekton's spec patches do not touch them, so they never conflict);
/// with no status yet we test the resourceVersion.
pub fn status_patch(
    current: Option<&CustomRunStatus>,
    resource_version: &str,
    desired: &CustomRunStatus,
) -> json_patch::Patch {
    let mut ops = Vec::new();
    let test = |path: &str, value: Value| {
        PatchOperation::Test(TestOperation {
            path: PointerBuf::parse(path).expect("static pointer"),
            value,
        })
    };
    match current.and_then(|s| s.conditions.first().map(|c| (0usize, c))) {
        Some((i, c)) => {
            ops.push(test(&format!("/status/conditions/{i}/type"), json!(c.type_)));
            ops.push(test(&format!("/status/conditions/{i}/status"), json!(c.status)));
            if let Some(r) = &c.reason {
                ops.push(test(&format!("/status/conditions/{i}/reason"), json!(r)));
            }
            if let Some(t) = &c.last_transition_time {
                ops.push(test(&format!("/status/conditions/{i}/lastTransitionTime"), json!(t)));
            }
        }
        None => ops.push(test("/metadata/resourceVersion", json!(resource_version))),
    }
    ops.push(PatchOperation::Add(AddOperation {
        path: PointerBuf::parse("/status").expect("static pointer"),
        value: serde_json::to_value(desired).expect("status serializes"),
    }));
    json_patch::Patch(ops)
}

fn key(run: &CustomRun) -> String {
    format!(
        "{}/{}",
        run.metadata.namespace.as_deref().unwrap_or_default(),
        run.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Reconciles one CustomRun. Runs of other custom tasks are ignored.
pub async fn reconcile(obj: Arc<CustomRun>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    if !obj.spec.is_macbuild() {
        return Ok(Action::await_change());
    }
    ctx.metrics.reconciles.inc();
    let ns = obj.metadata.namespace.clone().unwrap_or_default();
    let name = obj.metadata.name.clone().unwrap_or_default();
    let target = format!("{ns}/{name}");
    let runs: Api<CustomRun> = Api::namespaced(ctx.client.clone(), &ns);
    let builds: Api<MacBuild> = Api::namespaced(ctx.client.clone(), &ns);
    let t = ctx.api_timeout;

    for _ in 0..5 {
        // Fresh reads (not the watch cache): a MacBuild created a moment ago must be seen.
        let run = match call("reading CustomRun", &target, t, runs.get_opt(&name)).await? {
            Ok(Some(run)) => run,
            Ok(None) => return Ok(Action::await_change()),
            Err(e) => return Err(kube_err("reading CustomRun", &target, e)),
        };
        if run.metadata.deletion_timestamp.is_some() {
            // Garbage collection takes the MacBuild with it; the agent's finalizer keeps it until its VM is gone.
            return Ok(Action::await_change());
        }
        let mb = call("reading MacBuild", &target, t, builds.get_opt(&name))
            .await?
            .map_err(|e| kube_err("reading MacBuild", &target, e))?;
        let view = mb.as_ref().map(build_view);
        let lease = match view.as_ref().and_then(|v| v.holder.clone()) {
            None => None,
            Some(holder) => {
                let lease_ns = ctx.lease_namespace.clone().unwrap_or_else(|| ns.clone());
                let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &lease_ns);
                let lname = lease_name(&holder);
                let lt = format!("{lease_ns}/{lname}");
                call("reading agent Lease", &lt, t, leases.get_opt(&lname))
                    .await?
                    .map_err(|e| kube_err("reading agent Lease", &lt, e))?
                    .map(|l| lease_view(&l))
            }
        };
        let now = Timestamp::now();
        let mut plan = decide::decide(&run, view.as_ref(), lease.as_ref(), &ctx.timing, now);

        // 1. The MacBuild first, so that a status write that fails is simply decided again.
        match &plan.action {
            BuildAction::None => {}
            BuildAction::Create(spec) => match new_macbuild(&run, spec.clone()) {
                Err(msg) => plan = decide::refuse_spec(&run, msg, now),
                Ok(object) => {
                    let pp = PostParams {
                        field_manager: Some(CONTROLLER_FIELD_MANAGER.into()),
                        ..Default::default()
                    };
                    match call("creating MacBuild", &target, t, builds.create(&pp, &object)).await? {
                        Ok(_) => {
                            info!(customrun = %target, "created MacBuild");
                            publish(
                                &ctx,
                                &run,
                                false,
                                "MacBuildCreated",
                                format!("created MacBuild {target}"),
                            )
                            .await;
                        }
                        // Another replica or an earlier reconcile created it: decide again, adopting
                        // it if it is ours.
                        Err(e) if api_code(&e) == Some(409) => continue,
                        Err(kube::Error::Api(s)) if s.code == 422 || s.code == 400 => {
                            plan =
                                decide::refuse_spec(&run, format!("the API refused the MacBuild: {}", s.message), now);
                        }
                        Err(e) => return Err(kube_err("creating MacBuild", &target, e)),
                    }
                }
            },
            BuildAction::RequestCancel => {
                let patch = Patch::Merge(json!({"spec": {"cancelRequested": true}}));
                let pp = PatchParams {
                    field_manager: Some(CONTROLLER_FIELD_MANAGER.into()),
                    ..Default::default()
                };
                match call(
                    "requesting cancel on MacBuild",
                    &target,
                    t,
                    builds.patch(&name, &pp, &patch),
                )
                .await?
                {
                    Ok(_) => {
                        if let Some(mb) = &mb {
                            publish_on(
                                &ctx,
                                mb,
                                false,
                                "CancelRequested",
                                "cancel requested by tartan-controller".into(),
                            )
                            .await;
                        }
                    }
                    Err(e) if api_code(&e) == Some(404) => continue,
                    Err(e) => return Err(kube_err("requesting cancel on MacBuild", &target, e)),
                }
            }
            BuildAction::Delete { precondition_rv } => {
                let dp = DeleteParams {
                    preconditions: precondition_rv.as_ref().map(|rv| Preconditions {
                        resource_version: Some(rv.clone()),
                        uid: None,
                    }),
                    ..Default::default()
                };
                match call("deleting MacBuild", &target, t, builds.delete(&name, &dp)).await? {
                    Ok(_) => {
                        if let Some(mb) = &mb {
                            let note = "deletion requested by tartan-controller; an agent's finalizer keeps it until its VM is gone";
                            publish_on(&ctx, mb, false, "DeletionRequested", note.into()).await;
                        }
                    }
                    Err(e) if api_code(&e) == Some(404) => {}
                    // An agent claimed it between our read and the delete: decide again.
                    Err(e) if api_code(&e) == Some(409) => continue,
                    Err(e) => return Err(kube_err("deleting MacBuild", &target, e)),
                }
            }
        }

        // 2. The status, only if it changed.
        if run.status.as_ref() != Some(&plan.status) {
            let patch = status_patch(
                run.status.as_ref(),
                run.metadata.resource_version.as_deref().unwrap_or(""),
                &plan.status,
            );
            let pp = PatchParams {
                field_manager: Some(CONTROLLER_FIELD_MANAGER.into()),
                ..Default::default()
            };
            match call(
                "writing CustomRun status",
                &target,
                t,
                runs.patch_status(&name, &pp, &Patch::Json::<()>(patch)),
            )
            .await?
            {
                Ok(_) => {}
                // Someone else wrote first (a failed `test` is 422, a stale version 409): decide again.
                Err(e) if matches!(api_code(&e), Some(409 | 422)) => continue,
                Err(e) if api_code(&e) == Some(404) => return Ok(Action::await_change()),
                Err(e) => return Err(kube_err("writing CustomRun status", &target, e)),
            }
            for note in &plan.events {
                publish(&ctx, &run, note.warning, &note.reason, note.message.clone()).await;
            }
            count_finish(&ctx, &plan);
        }
        return Ok(plan.requeue_after.map_or_else(Action::await_change, Action::requeue));
    }
    Err(Error::Conflicts(target))
}

fn count_finish(ctx: &Ctx, plan: &Plan) {
    if let Some(f) = &plan.finished {
        ctx.metrics
            .customruns
            .get_or_create(&OutcomeLabels {
                status: f.status.clone(),
                reason: f.reason.clone(),
            })
            .inc();
        if f.reason == crate::customrun::reason::TIMED_OUT {
            let vm_retirement = f.vm_retirement.as_str().to_string();
            ctx.metrics
                .timeouts
                .get_or_create(&RetirementLabels { vm_retirement })
                .inc();
        }
    }
}

async fn publish(ctx: &Ctx, run: &CustomRun, warning: bool, reason: &str, note: String) {
    publish_ref(ctx, run.object_ref(&()), key(run), warning, reason, note).await;
}

async fn publish_on(ctx: &Ctx, mb: &MacBuild, warning: bool, reason: &str, note: String) {
    let target = format!(
        "{}/{}",
        mb.metadata.namespace.as_deref().unwrap_or_default(),
        mb.metadata.name.as_deref().unwrap_or_default()
    );
    publish_ref(ctx, mb.object_ref(&()), target, warning, reason, note).await;
}

/// Events are best effort: a failure is logged and never fails the reconcile.
async fn publish_ref(
    ctx: &Ctx,
    reference: k8s_openapi::api::core::v1::ObjectReference,
    target: String,
    warning: bool,
    reason: &str,
    note: String,
) {
    let mut note = note;
    if note.len() > 1000 {
        let mut cut = 1000;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    let ev = Event {
        type_: if warning { EventType::Warning } else { EventType::Normal },
        reason: reason.to_string(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    match tokio::time::timeout(ctx.api_timeout, ctx.recorder.publish(&ev, &reference)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(object = %target, reason, "publishing Event failed: {e}; continuing without it"),
        Err(_) => warn!(object = %target, reason, "publishing Event timed out; continuing without it"),
    }
}

/// On error: log, count, and retry in 5 s (the call that failed has its own timeout).
pub fn error_policy(obj: Arc<CustomRun>, error: &Error, ctx: Arc<Ctx>) -> Action {
    warn!(customrun = %key(&obj), "reconcile failed: {error}");
    ctx.metrics
        .errors
        .get_or_create(&ErrorLabels {
            error: error.metric_label().into(),
        })
        .inc();
    Action::requeue(Duration::from_secs(5))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::customrun::Condition;

    #[test]
    fn first_status_write_is_fenced_on_the_resource_version() {
        let desired = CustomRunStatus {
            observed_generation: Some(1),
            ..Default::default()
        };
        let p = serde_json::to_value(status_patch(None, "42", &desired)).unwrap();
        assert_eq!(
            p,
            json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "42"},
                {"op": "add", "path": "/status", "value": {"observedGeneration": 1}},
            ])
        );
    }

    #[test]
    fn later_status_writes_are_fenced_on_the_succeeded_condition() {
        let current = CustomRunStatus {
            conditions: vec![Condition {
                type_: "Succeeded".into(),
                status: "Unknown".into(),
                reason: Some("Running".into()),
                message: Some("m".into()),
                severity: None,
                last_transition_time: Some("2026-10-05T02:52:10Z".into()),
            }],
            ..Default::default()
        };
        let p = serde_json::to_value(status_patch(Some(&current), "42", &current)).unwrap();
        let ops: Vec<(String, String)> = p
            .as_array()
            .unwrap()
            .iter()
            .map(|o| {
                (
                    o["op"].as_str().unwrap().to_string(),
                    o["path"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let want = [
            ("test", "/status/conditions/0/type"),
            ("test", "/status/conditions/0/status"),
            ("test", "/status/conditions/0/reason"),
            ("test", "/status/conditions/0/lastTransitionTime"),
            ("add", "/status"),
        ];
        assert_eq!(ops, want.map(|(a, b)| (a.to_string(), b.to_string())));
        assert_eq!(p[2]["value"], "Running");
    }
}
