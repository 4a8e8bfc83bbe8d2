//! `tartan-controller run`: connect, check the CRDs, serve `/metrics` `/healthz` `/readyz`, and
//! run one kube `Controller` on CustomRuns per watched namespace (owning MacBuilds, watching
//! agent Leases). Each of the three watches keeps a trimmed cache that reconciles read instead
//! of the API.

use crate::customrun::CustomRun;
use crate::decide::Timing;
use crate::duration::parse_flag;
use crate::leader::{ElectionConfig, Elector, Gate, GateLayer, Role};
use crate::metrics::Metrics;
use crate::reconcile::{
    Caches, Ctx, EVENT_QUEUE, EventQueue, LABELS_IN_FLIGHT, NewRecorder, error_policy, publish_events, reconcile,
};
use crate::view::{lease_agent, trim_customrun, trim_lease, trim_macbuild};
use crate::wire::{Unmanaged, unwrap_event};
use anyhow::{Context as _, bail};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use futures::{FutureExt as _, StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::ListParams;
use kube::client::ClientBuilder;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Config};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tartan_api::{MacBuild, UNFINISHED_SELECTOR};
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
    /// How long after a run finished it is labelled `tartan.dev/finished`, which takes it and its
    /// MacBuild out of the controller's watches (and its lists after a restart).
    #[arg(long, default_value = "30s", value_parser = parse_flag)]
    pub finished_label_after: Duration,
    /// Timeout of each Kubernetes API call.
    #[arg(long, default_value = "10s", value_parser = parse_flag)]
    pub api_timeout: Duration,
    /// Address of the /metrics, /healthz and /readyz server.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_address: SocketAddr,
    /// Connections that server holds at once (at least 1). One more closes the connection idle the
    /// longest, or is itself closed when every one is inside a request.
    #[arg(long, default_value_t = tartan_serve::DEFAULT_MAX_CONNECTIONS, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..), usize::from))]
    pub http_max_connections: usize,
    /// A connection of that server on which no request finished for this long is closed (idle
    /// keep-alives, clients that send their headers slowly, requests that hang).
    #[arg(long, default_value = "20s", value_parser = parse_flag)]
    pub http_idle_timeout: Duration,
    /// Name reported as the Events' reporting instance (the pod name in a Deployment).
    #[arg(long, env = "POD_NAME", default_value = "tartan-controller")]
    pub instance: String,
    /// Run as one of several replicas: only the holder of the leader Lease reconciles and writes;
    /// the others stand by (docs/high-availability.md).
    #[arg(long)]
    pub leader_elect: bool,
    /// Namespace of the leader Lease (the controller's own; in a pod, POD_NAMESPACE from the downward API).
    #[arg(long, env = "POD_NAMESPACE")]
    pub leader_lease_namespace: Option<String>,
    /// Name of the leader Lease.
    #[arg(long, default_value = "tartan-controller")]
    pub leader_lease_name: String,
    /// This replica's identity in the leader Lease; default: $POD_NAME, else <hostname>-<pid>.
    #[arg(long)]
    pub leader_identity: Option<String>,
    /// Leader Lease duration: a standby takes over this long after the last renewal it saw.
    #[arg(long, default_value = "15s", value_parser = parse_flag)]
    pub leader_lease: Duration,
    /// How often the leader renews the Lease.
    #[arg(long, default_value = "5s", value_parser = parse_flag)]
    pub leader_renew_every: Duration,
    /// How often a standby looks at the Lease, and a failed renewal is retried.
    #[arg(long, default_value = "2s", value_parser = parse_flag)]
    pub leader_retry_every: Duration,
    /// The leader stops writing this long before its Lease could expire without a renewal.
    #[arg(long, default_value = "5s", value_parser = parse_flag)]
    pub leader_margin: Duration,
    /// Most CustomRuns reconciled at once per watched namespace (0: no limit). Bounds the
    /// requests in flight and the memory after a restart with many CustomRuns.
    #[arg(long, default_value_t = 16)]
    pub concurrency: u16,
}

impl RunArgs {
    /// The leader-election settings, when `--leader-elect` is on.
    pub fn election(&self) -> anyhow::Result<Option<ElectionConfig>> {
        if !self.leader_elect {
            return Ok(None);
        }
        let Some(namespace) = self.leader_lease_namespace.clone().filter(|n| !n.is_empty()) else {
            bail!(
                "--leader-elect needs the namespace of the leader Lease: pass --leader-lease-namespace or set \
                 POD_NAMESPACE (deploy/controller.yaml sets it from the downward API)"
            );
        };
        let identity = match &self.leader_identity {
            Some(id) => id.clone(),
            None => {
                let pod = std::env::var("POD_NAME").ok();
                let host = std::env::var("HOSTNAME")
                    .ok()
                    .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
                    .map(|h| h.trim().to_string())
                    .filter(|h| !h.is_empty())
                    .unwrap_or_else(|| "tartan-controller".into());
                crate::leader::identity(pod.as_deref(), &host, std::process::id())
            }
        };
        let cfg = ElectionConfig {
            namespace,
            name: self.leader_lease_name.clone(),
            identity,
            lease: self.leader_lease,
            renew_every: self.leader_renew_every,
            retry_every: self.leader_retry_every,
            margin: self.leader_margin,
            // Not cut at the retry period: on a loaded API server a renewal answered in 3 s still
            // keeps the leader, and a round that outlasts the write window steps it down anyway.
            api_timeout: self.api_timeout,
        };
        cfg.validate().map_err(|e| anyhow::anyhow!("leader election: {e}"))?;
        Ok(Some(cfg))
    }

    pub fn timing(&self) -> Timing {
        Timing {
            default_timeout: self.default_timeout,
            grace: self.grace,
            lease_duration: self.lease_duration,
            finished_label_after: self.finished_label_after,
        }
    }
}

async fn kube_config(args: &RunArgs) -> anyhow::Result<Config> {
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
    Ok(config)
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
    /// The elector's role; `None` without `--leader-elect`; set once the start-up checks passed
    /// (the elector starts then), before `ready`.
    role: Option<Arc<OnceLock<tokio::sync::watch::Receiver<Role>>>>,
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

/// A standby is Ready (200) and says so: the controller has no Service, so readiness only paces a
/// RollingUpdate, which must not wait for a replica that is meant to stand by.
async fn ready_handler(State(h): State<Http>) -> (StatusCode, String) {
    if !h.ready.load(Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "starting\n".into());
    }
    let role = match &h.role {
        None => None,
        Some(slot) => match slot.get() {
            Some(r) => Some(r.borrow().clone()),
            None => return (StatusCode::SERVICE_UNAVAILABLE, "starting\n".into()),
        },
    };
    let body = match role {
        None => "ok\n".to_string(),
        Some(Role::Leader { .. }) => "ok: leading\n".to_string(),
        Some(Role::Standby { holder: Some(h) }) => format!("ok: standing by; {h} leads\n"),
        Some(Role::Standby { holder: None }) => "ok: standing by; no leader seen yet\n".to_string(),
    };
    (StatusCode::OK, body)
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
    let mut config = kube_config(&args).await?;
    let election = args.election()?;
    // Which replica sent a request, for the API server's audit log (and the e2e emulator's).
    let who = election
        .as_ref()
        .map_or(args.instance.as_str(), |e| e.identity.as_str());
    let agent = format!("tartan-controller/{} ({who})", env!("CARGO_PKG_VERSION"));
    match http::HeaderValue::from_str(&agent) {
        Ok(v) => config.headers.push((http::header::USER_AGENT, v)),
        Err(e) => warn!("not setting User-Agent {agent:?}: {e}; requests carry kube's default"),
    }
    // Two clients: the elector's own (its Lease writes are fenced by resourceVersion), and the
    // one everything else writes with, whose every write passes the leader gate.
    let client = Client::try_from(config.clone()).context("building the Kubernetes client")?;
    let namespaces: Vec<Option<String>> = if args.namespaces.is_empty() {
        vec![None]
    } else {
        args.namespaces.iter().cloned().map(Some).collect()
    };
    let metrics = Arc::new(Metrics::default());
    let ready = Arc::new(AtomicBool::new(false));
    let gate = Arc::new(match &election {
        Some(cfg) => Gate::new(cfg.write_window(), metrics.clone()),
        None => Gate::always_open(metrics.clone()),
    });
    let gated = ClientBuilder::try_from(config)
        .context("building the Kubernetes client")?
        .with_layer(&GateLayer(gate.clone()))
        .build();
    let role_slot = election.as_ref().map(|_| Arc::new(OnceLock::new()));

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
            role: role_slot.clone(),
        });
    let bound = listener.local_addr().map_or(args.metrics_address, |a| a);
    // The bound address (port 0 picks one), in the message so that tests can find it.
    info!("serving /metrics, /healthz, /readyz on {bound}");
    let limits = tartan_serve::Limits {
        max_connections: args.http_max_connections,
        idle_timeout: args.http_idle_timeout,
    };
    let server = tokio::spawn(tartan_serve::serve(
        "the controller's metrics/health server",
        listener,
        app,
        limits,
        Arc::default(),
    ));

    check_crds(&client, &namespaces, args.api_timeout).await?;
    // Only a replica that passed its checks takes part: one that takes the Lease and then fails
    // them would hold it while reconciling nothing, and exit without releasing it.
    let elector = election.map(|cfg| Elector::spawn(client.clone(), cfg, gate.clone(), metrics.clone()));
    if let (Some(slot), Some(e)) = (&role_slot, &elector) {
        let _ = slot.set(e.role());
    }

    let reporter = Reporter {
        controller: "tartan-controller".into(),
        instance: Some(args.instance.clone()),
    };
    // A fresh Recorder per Event: kube's keeps every Event it sent for 6 minutes (for series)
    // and scans them all at each publish; a controller's transitions do not repeat, and at
    // 10,000 CustomRuns that cache cost most of the CPU and tens of MiB.
    let events_client = gated.clone();
    let recorder: NewRecorder = Arc::new(move || Recorder::new(events_client.clone(), reporter.clone()));

    let Some(elector) = elector else {
        ready.store(true, Ordering::Relaxed);
        futures::future::join_all(controllers(&args, &gated, &namespaces, &recorder, &metrics)).await;
        info!("controller stopped");
        server.abort();
        return Ok(());
    };
    ready.store(true, Ordering::Relaxed);
    let mut role = elector.role();
    let mut stop = stop_signal();
    loop {
        // Standing by: nothing reconciles, nothing writes.
        tokio::select! {
            leading = role.wait_for(|r| matches!(r, Role::Leader { .. })) => {
                leading.context("the leader elector stopped")?;
            }
            _ = stop.wait_for(|s| *s) => break,
        }
        info!("leading: starting the reconcilers");
        let mut loops = std::pin::pin!(futures::future::join_all(controllers(
            &args,
            &gated,
            &namespaces,
            &recorder,
            &metrics
        )));
        tokio::select! {
            // They end only on SIGTERM/SIGINT (`shutdown_on_signal`).
            _ = &mut loops => break,
            // A signal that came before the loops first listened for one: they would never end,
            // and the Lease would not be released. Give them the usual drain, bounded.
            _ = async { stop.wait_for(|s| *s).await.is_ok() } => {
                if tokio::time::timeout(SHUTDOWN_DRAIN, &mut loops).await.is_err() {
                    warn!("the reconcilers did not stop within {SHUTDOWN_DRAIN:?} of the signal; dropping them");
                }
                break;
            }
            lost = async { role.wait_for(|r| !matches!(r, Role::Leader { .. })).await.map(|_| ()) } => {
                lost.context("the leader elector stopped")?;
                metrics.watch_agent_leases(Vec::new(), args.lease_duration);
                // Dropping the loops cancels every reconcile in flight; the gate already refuses
                // their writes.
                warn!("leadership lost: reconcilers stopped; standing by");
            }
        }
    }
    elector.shutdown().await;
    info!("controller stopped");
    server.abort();
    Ok(())
}

/// How long a leader's reconcilers may take to finish what they are doing after SIGTERM.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(5);

/// Becomes true on SIGTERM or SIGINT.
fn stop_signal() -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    warn!("cannot listen for SIGTERM ({e}); stopping on SIGINT only");
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
        let _ = tx.send(true);
    });
    rx
}

/// One kube `Controller` per watched namespace, each ending on SIGTERM/SIGINT.
fn controllers(
    args: &RunArgs,
    client: &Client,
    namespaces: &[Option<String>],
    recorder: &NewRecorder,
    metrics: &Arc<Metrics>,
) -> Vec<futures::future::BoxFuture<'static, ()>> {
    let client = client.clone();
    let mut loops = Vec::new();
    let mut lease_caches = Vec::new();
    for ns in namespaces {
        let (runs, builds, leases): (Api<Unmanaged<CustomRun>>, Api<Unmanaged<MacBuild>>, Api<Lease>) =
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
        let (build_store, build_writer) = reflector::store();
        let (lease_store, lease_writer) = reflector::store();
        lease_caches.push(lease_store.clone());
        let cache = Caches::new(run_store.clone(), build_store, lease_store);
        let (own_runs, own_builds) = (cache.own_runs.clone(), cache.own_builds.clone());
        // Finished runs and their MacBuilds carry a label (`Ctx::mark_finished`) that keeps
        // them out of these watches: what is listed after a restart is only what has work.
        // Listed at resourceVersion 0 with no page size (kube sends no resourceVersion with a
        // limit): the API server answers from its watch cache, filtering there, instead of
        // reading every stored run from etcd. On the real apiserver with 2,000 finished runs
        // this took a single build after a restart from 1.0 s to 0.07 s.
        let unfinished = watcher::Config {
            page_size: None,
            ..watcher::Config::default().any_semantic().labels(UNFINISHED_SELECTOR)
        };
        // What leaves a watch (the finished label, a deletion) leaves our own writes too.
        // Read without managedFields (`wire`): the real apiserver's lists carry them for every object.
        let run_watch = watcher(runs, unfinished.clone())
            .map_ok(unwrap_event)
            .default_backoff()
            .modify(trim_customrun)
            .reflect(run_writer)
            .inspect_ok(move |e| own_runs.forget_departed(e))
            .applied_objects();
        // The CustomRuns are listed once the MacBuilds and Leases are: each unpaged list is held
        // whole (body and untrimmed objects) until the cache has it, and at 10,000 runs after a
        // restart the two big lists at once set the controller's peak memory. Reconciles wait for
        // those caches anyway; bounded like that wait, so that watches that cannot list (RBAC)
        // still end in each run's reconcile error naming them.
        let (lists_first, list_wait) = (cache.ready.clone(), args.api_timeout);
        let run_events = futures::stream::once(async move {
            let _ = tokio::time::timeout(list_wait, lists_first).await;
            run_watch
        })
        .flatten();
        let build_events = watcher(builds, unfinished)
            .map_ok(unwrap_event)
            .default_backoff()
            .modify(trim_macbuild)
            .reflect(build_writer)
            .inspect_ok(move |e| own_builds.forget_departed(e))
            .touched_objects();
        let lease_events = watcher(leases, watcher::Config::default().any_semantic())
            .default_backoff()
            .modify(trim_lease)
            .reflect(lease_writer)
            .touched_objects();
        let (events, queued) = EventQueue::new(EVENT_QUEUE, metrics.events_dropped.clone());
        let ctx = Arc::new(Ctx {
            client: client.clone(),
            timing: args.timing(),
            lease_namespace: args.agent_lease_namespace.clone(),
            api_timeout: args.api_timeout,
            events,
            labelling: tokio::sync::Semaphore::new(LABELS_IN_FLIGHT),
            metrics: metrics.clone(),
            cache,
        });
        let scope = ns.clone().unwrap_or_else(|| "all namespaces".into());
        info!(namespace = %scope, concurrency = args.concurrency, "watching CustomRuns");
        let held = run_store.clone();
        // Ends once the controller (holding the queue's sender in its context) has ended.
        let events = publish_events(queued, recorder.clone(), args.api_timeout);
        let reconciling = Controller::for_stream(run_events, run_store)
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
            });
        loops.push(futures::future::join(reconciling, events).map(|_| ()).boxed());
    }
    metrics.watch_agent_leases(lease_caches, args.lease_duration);
    loops
}
