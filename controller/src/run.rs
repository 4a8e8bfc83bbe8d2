//! `tartan-controller run`: connect, check the CRDs, serve `/metrics` `/healthz` `/readyz`, and
//! run one kube `Controller` on CustomRuns per watched namespace (owning MacBuilds, watching
//! agent Leases). Each of the three watches keeps a trimmed cache that reconciles read instead
//! of the API.

use crate::customrun::CustomRun;
use crate::decide::Timing;
use crate::duration::parse_flag;
use crate::metrics::Metrics;
use crate::reconcile::{Caches, Ctx, error_policy, reconcile};
use crate::view::{lease_agent, trim_customrun, trim_lease, trim_macbuild};
use anyhow::{Context as _, bail};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use futures::{FutureExt as _, StreamExt as _};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Config};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tartan_api::MacBuild;
use tracing::{info, warn};

/// Arguments of `tartan-controller run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Kubeconfig file; default: $KUBECONFIG, ~/.kube/config, then the in-cluster service account.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Namespace to watch (repeatable); default: all namespaces.
    #[arg(long = "namespace", short = 'n')]
    pub namespaces: Vec<String>,
    /// Timeout applied to CustomRuns without `spec.timeout` (Go duration; Tekton's default-timeout-minutes).
    #[arg(long, default_value = "60m", value_parser = parse_flag)]
    pub default_timeout: Duration,
    /// How long past the CustomRun deadline, or a cancel request, to wait for the agent to confirm the VM deleted.
    #[arg(long, default_value = "45s", value_parser = parse_flag)]
    pub grace: Duration,
    /// Lease duration assumed when an agent Lease does not state one.
    #[arg(long, default_value = "20s", value_parser = parse_flag)]
    pub lease_duration: Duration,
    /// Namespace holding all agent Leases; default: each MacBuild's own namespace.
    #[arg(long)]
    pub agent_lease_namespace: Option<String>,
    /// Timeout of each Kubernetes API call.
    #[arg(long, default_value = "10s", value_parser = parse_flag)]
    pub api_timeout: Duration,
    /// Address of the /metrics, /healthz and /readyz server.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_address: SocketAddr,
    /// Name reported as the Events' reporting instance (the pod name in a Deployment).
    #[arg(long, env = "POD_NAME", default_value = "tartan-controller")]
    pub instance: String,
    /// Most CustomRuns reconciled at once per watched namespace (0: no limit). Bounds the
    /// requests in flight and the memory after a restart with many CustomRuns.
    #[arg(long, default_value_t = 16)]
    pub concurrency: u16,
}

impl RunArgs {
    pub fn timing(&self) -> Timing {
        Timing {
            default_timeout: self.default_timeout,
            grace: self.grace,
            lease_duration: self.lease_duration,
        }
    }
}

async fn client(args: &RunArgs) -> anyhow::Result<Client> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => Config::infer().await.context(
            "no Kubernetes configuration found (tried $KUBECONFIG, ~/.kube/config and in-cluster); pass --kubeconfig",
        )?,
    };
    Client::try_from(config).context("building the Kubernetes client")
}

/// Fails fast, with the fix in the message, when a CRD we need is not served.
async fn check_crds(client: &Client, namespaces: &[Option<String>], limit: Duration) -> anyhow::Result<()> {
    let ns = namespaces.first().cloned().flatten();
    let lp = ListParams::default().limit(1);
    let mbs: Api<MacBuild> = match &ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let crs: Api<CustomRun> = match &ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let probe = tokio::time::timeout(limit, mbs.list(&lp))
        .await
        .context("listing MacBuilds timed out; is the API server reachable?")?;
    if let Err(e) = probe {
        bail!(
            "the MacBuild CRD (macbuilds.tartan.dev) is not queryable: {e}. Is it installed? Install it with \
             `tartan-controller crd | kubectl apply -f -`, and check the controller's RBAC (deploy/rbac.yaml)"
        );
    }
    let probe = tokio::time::timeout(limit, crs.list(&lp))
        .await
        .context("listing CustomRuns timed out; is the API server reachable?")?;
    if let Err(e) = probe {
        bail!(
            "Tekton's CustomRun CRD (customruns.tekton.dev, v1beta1) is not queryable: {e}. Install Tekton Pipelines \
             (v0.44 or later) and check the controller's RBAC (deploy/rbac.yaml)"
        );
    }
    Ok(())
}

#[derive(Clone)]
struct Http {
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
}

async fn metrics_handler(State(h): State<Http>) -> ([(&'static str, &'static str); 1], String) {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        h.metrics.render(),
    )
}

async fn ready_handler(State(h): State<Http>) -> (StatusCode, &'static str) {
    if h.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
    }
}

/// The CustomRuns to look at when an agent's Lease changes: those whose last recorded holder is
/// that agent and that are not done (so a returning agent clears `HostUnreachable` at once).
fn runs_held_by(store: &Store<CustomRun>, lease: &Lease) -> Vec<ObjectRef<CustomRun>> {
    let Some(agent) = lease_agent(lease) else { return vec![] };
    store
        .state()
        .iter()
        .filter(|run| {
            let status = run.status.as_ref();
            !status.is_some_and(|s| s.is_done())
                && status
                    .and_then(|s| s.extra_fields.as_ref())
                    .and_then(|e| e.get("holder"))
                    .and_then(|h| h.as_str())
                    == Some(agent.as_str())
        })
        .map(|run| ObjectRef::from_obj(run.as_ref()))
        .collect()
}

/// Runs the controller until SIGTERM/SIGINT.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = client(&args).await?;
    let namespaces: Vec<Option<String>> = if args.namespaces.is_empty() {
        vec![None]
    } else {
        args.namespaces.iter().cloned().map(Some).collect()
    };
    let metrics = Arc::new(Metrics::default());
    let ready = Arc::new(AtomicBool::new(false));

    let listener = tokio::net::TcpListener::bind(args.metrics_address)
        .await
        .with_context(|| format!("binding the metrics/health server to {}", args.metrics_address))?;
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(Http {
            metrics: metrics.clone(),
            ready: ready.clone(),
        });
    info!(address = %args.metrics_address, "serving /metrics, /healthz, /readyz");
    let server = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            warn!("metrics/health server stopped: {e}");
        }
    });

    check_crds(&client, &namespaces, args.api_timeout).await?;

    let reporter = Reporter {
        controller: "tartan-controller".into(),
        instance: Some(args.instance.clone()),
    };
    let recorder = Recorder::new(client.clone(), reporter);

    let mut loops = Vec::new();
    for ns in &namespaces {
        let (runs, builds, leases): (Api<CustomRun>, Api<MacBuild>, Api<Lease>) =
            match (ns, &args.agent_lease_namespace) {
                (Some(ns), Some(lns)) => (
                    Api::namespaced(client.clone(), ns),
                    Api::namespaced(client.clone(), ns),
                    Api::namespaced(client.clone(), lns),
                ),
                (Some(ns), None) => (
                    Api::namespaced(client.clone(), ns),
                    Api::namespaced(client.clone(), ns),
                    Api::namespaced(client.clone(), ns),
                ),
                (None, Some(lns)) => (
                    Api::all(client.clone()),
                    Api::all(client.clone()),
                    Api::namespaced(client.clone(), lns),
                ),
                (None, None) => (
                    Api::all(client.clone()),
                    Api::all(client.clone()),
                    Api::all(client.clone()),
                ),
            };
        // One watch per kind, each feeding a trimmed cache and the controller's triggers.
        let (run_store, run_writer) = reflector::store();
        let run_events = watcher(runs, watcher::Config::default().any_semantic())
            .default_backoff()
            .modify(trim_customrun)
            .reflect(run_writer)
            .applied_objects();
        let (build_store, build_writer) = reflector::store();
        let build_events = watcher(builds, watcher::Config::default().any_semantic())
            .default_backoff()
            .modify(trim_macbuild)
            .reflect(build_writer)
            .touched_objects();
        let (lease_store, lease_writer) = reflector::store();
        let lease_events = watcher(leases, watcher::Config::default().any_semantic())
            .default_backoff()
            .modify(trim_lease)
            .reflect(lease_writer)
            .touched_objects();
        let ctx = Arc::new(Ctx {
            client: client.clone(),
            timing: args.timing(),
            lease_namespace: args.agent_lease_namespace.clone(),
            api_timeout: args.api_timeout,
            recorder: recorder.clone(),
            metrics: metrics.clone(),
            cache: Caches::new(run_store.clone(), build_store, lease_store),
        });
        let scope = ns.clone().unwrap_or_else(|| "all namespaces".into());
        info!(namespace = %scope, concurrency = args.concurrency, "watching CustomRuns");
        let held = run_store.clone();
        loops.push(
            Controller::for_stream(run_events, run_store)
                .with_config(controller::Config::default().concurrency(args.concurrency))
                .owns_stream(build_events)
                .watches_stream(lease_events, move |lease| runs_held_by(&held, &lease))
                .shutdown_on_signal()
                .run(reconcile, error_policy, ctx)
                .for_each(|res| async move {
                    match res {
                        Ok((obj, _)) => tracing::debug!(customrun = %obj, "reconciled"),
                        Err(e) => tracing::debug!("controller event: {e}"),
                    }
                })
                .boxed(),
        );
    }
    ready.store(true, Ordering::Relaxed);
    futures::future::join_all(loops).await;
    info!("controller stopped");
    server.abort();
    Ok(())
}
