//! The I/O around [`decide`]: read the CustomRun, its MacBuild and the holder's Lease from the
//! watches' caches (fresh from the API when acting on the cache could be wrong, or after a
//! conflict), decide, act on the MacBuild, then write the CustomRun's `/status` (only if it
//! changed), publish Events and count metrics. A finished run with nothing owed costs nothing.

use crate::customrun::{CustomRun, CustomRunStatus};
use crate::decide::{self, BuildAction, Plan, Timing};
use crate::metrics::{ERROR_LABELS, ErrorLabels, Metrics};
use crate::view::{
    build_view, finished_label_patch, lease_name, lease_view, marked_finished, new_macbuild, trim_customrun,
    trim_macbuild,
};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt as _, StreamExt as _};
use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation, TestOperation};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use prometheus_client::metrics::counter::Counter;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tartan_api::{CONTROLLER_FIELD_MANAGER, FINISHED_LABEL, MacBuild};
use tokio::sync::mpsc;
use tracing::{info, warn};

/// Shared state of the reconciles of one watched namespace.
pub struct Ctx {
    pub client: Client,
    pub timing: Timing,
    /// Where agent Leases live; `None` = the MacBuild's namespace.
    pub lease_namespace: Option<String>,
    /// Timeout of each API call.
    pub api_timeout: Duration,
    /// Where Events wait for [`publish_events`].
    pub events: EventQueue,
    /// Slots for finished-label writes ([`LABELS_IN_FLIGHT`]).
    pub labelling: tokio::sync::Semaphore,
    pub metrics: Arc<Metrics>,
    pub cache: Caches,
}

/// The watches' caches, read instead of the API, and our own writes they may not show yet.
pub struct Caches {
    pub runs: Store<CustomRun>,
    pub builds: Store<MacBuild>,
    pub leases: Store<Lease>,
    /// Shared with the watches, which drop what left them ([`OwnWrites::forget_departed`]).
    pub own_runs: Arc<OwnWrites<CustomRun>>,
    pub own_builds: Arc<OwnWrites<MacBuild>>,
    /// The MacBuild and Lease caches have listed once.
    pub ready: CachesReady,
}

impl Caches {
    pub fn new(runs: Store<CustomRun>, builds: Store<MacBuild>, leases: Store<Lease>) -> Caches {
        Caches {
            ready: caches_ready(builds.clone(), leases.clone()),
            own_runs: Arc::new(OwnWrites::new(runs.clone(), trim_customrun)),
            own_builds: Arc::new(OwnWrites::new(builds.clone(), trim_macbuild)),
            runs,
            builds,
            leases,
        }
    }
}

/// Entries kept in an [`OwnWrites`] before it starts over (it only saves a conflict and a
/// fresh read; every write stays fenced without it).
const OWN_WRITES_MAX: usize = 4096;

/// The objects our own writes returned, each with the resourceVersion the cache showed when
/// we wrote (`None`: absent). While the cache still shows that version it has not seen our
/// write, and the written object is the fresher; once it moves on, the cache is.
pub struct OwnWrites<K: Resource<DynamicType = ()> + 'static> {
    written: Mutex<HashMap<ObjectRef<K>, Written<K>>>,
    /// The watch cache our writes are compared with.
    cache: Store<K>,
    /// The watch cache's trim, applied to what we keep: it stands in for the cached object, and
    /// untrimmed (managedFields, a created MacBuild's whole spec) up to [`OWN_WRITES_MAX`]
    /// entries cost tens of MiB at 10,000 runs.
    trim: fn(&mut K),
}

/// The resourceVersion the cache showed when we wrote, and what the API answered.
type Written<K> = (Option<String>, Arc<K>);

impl<K: Resource<DynamicType = ()> + Clone + 'static> OwnWrites<K> {
    pub fn new(cache: Store<K>, trim: fn(&mut K)) -> Self {
        OwnWrites {
            written: Mutex::new(HashMap::new()),
            cache,
            trim,
        }
    }

    /// The fresher of `cached` (what the cache holds for `key`) and our last write of it.
    pub fn fresher(&self, key: &ObjectRef<K>, cached: Option<Arc<K>>) -> Option<Arc<K>> {
        let mut written = self.written.lock().expect("own-writes lock");
        let cached_rv = cached.as_ref().and_then(|c| c.meta().resource_version.clone());
        match written.get(key) {
            None => cached,
            Some((seen, ours)) if *seen == cached_rv => Some(ours.clone()),
            Some(_) => {
                written.remove(key);
                cached
            }
        }
    }

    /// Records `ours`, just written while the cache showed `cached_rv`; not when the cache has
    /// moved on already (it saw our write, or the write took the object out of the watch: the
    /// finished label), since nothing would ever read or drop that entry.
    pub fn remember(&self, cached_rv: Option<String>, mut ours: K) {
        (self.trim)(&mut ours);
        let key = ObjectRef::from_obj(&ours);
        // Under the lock: a departure applied to the cache after this check is forgotten after
        // this insert (`forget_departed` runs once the cache has applied it).
        let mut written = self.written.lock().expect("own-writes lock");
        if rv_in(&self.cache, &key) != cached_rv {
            written.remove(&key);
            return;
        }
        if written.len() >= OWN_WRITES_MAX {
            written.clear();
        }
        written.insert(key, (cached_rv, Arc::new(ours)));
    }

    pub fn forget(&self, key: &ObjectRef<K>) {
        self.written.lock().expect("own-writes lock").remove(key);
    }

    /// Drops our write of an object its watch reports gone, deleted or no longer selected (the
    /// finished label): the cache never shows it again, so `fresher` would never drop it.
    /// Called on each watch event after the cache applied it.
    pub fn forget_departed(&self, event: &watcher::Event<K>) {
        match event {
            watcher::Event::Delete(gone) => self.forget(&ObjectRef::from_obj(gone)),
            // A list again (the watch fell behind) reports no deletion: what it left out is gone.
            watcher::Event::InitDone => {
                let mut written = self.written.lock().expect("own-writes lock");
                written.retain(|key, (seen, _)| seen.is_none() || self.cache.get(key).is_some());
            }
            _ => {}
        }
    }

    /// How many writes are kept.
    pub fn len(&self) -> usize {
        self.written.lock().expect("own-writes lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn rv_in<K: Resource<DynamicType = ()> + Clone>(store: &Store<K>, key: &ObjectRef<K>) -> Option<String> {
    store.get(key).and_then(|o| o.meta().resource_version.clone())
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
            Error::Kube { .. } => ERROR_LABELS[0],
            Error::Timeout { .. } => ERROR_LABELS[1],
            Error::Conflicts(_) => ERROR_LABELS[2],
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

/// Resolves (true) once the MacBuild and Lease caches hold their first full list; before that, an
/// absent object only means "not listed yet". One future shared by every reconcile, because
/// kube's `Store::wait_until_ready` keeps a single waker (a oneshot's): of several reconciles
/// waiting on it at once only the last is woken, and the others sat until their timeout (10 s,
/// the whole of a catch-up after a restart). `Shared` wakes every waiter.
pub type CachesReady = Shared<BoxFuture<'static, bool>>;

pub fn caches_ready(builds: Store<MacBuild>, leases: Store<Lease>) -> CachesReady {
    async move { builds.wait_until_ready().await.is_ok() && leases.wait_until_ready().await.is_ok() }
        .boxed()
        .shared()
}

/// What one decision reads: the CustomRun, its MacBuild, the holder's Lease.
struct Inputs {
    run: Arc<CustomRun>,
    mb: Option<Arc<MacBuild>>,
    lease: Option<Arc<Lease>>,
}

impl Ctx {
    fn lease_ref(&self, ns: &str, holder: &str) -> (String, String) {
        let lease_ns = self.lease_namespace.clone().unwrap_or_else(|| ns.to_string());
        (lease_ns, lease_name(holder))
    }

    /// From the watches' caches (and our own writes they may not show yet): no API request.
    async fn cached(&self, run: Arc<CustomRun>, ns: &str, name: &str, target: &str) -> Result<Inputs, Error> {
        self.caches_filled(target).await?;
        let key = ObjectRef::new(name).within(ns);
        let mb = self.cache.own_builds.fresher(&key, self.cache.builds.get(&key));
        let lease = match mb.as_ref().map(|m| build_view(m)).and_then(|v| v.holder) {
            None => None,
            Some(holder) => {
                let (lease_ns, lname) = self.lease_ref(ns, &holder);
                self.cache.leases.get(&ObjectRef::new(&lname).within(&lease_ns))
            }
        };
        Ok(Inputs { run, mb, lease })
    }

    /// Waits (bounded) until the MacBuild and Lease caches hold their first list.
    async fn caches_filled(&self, target: &str) -> Result<(), Error> {
        let limit = self.api_timeout;
        if !matches!(tokio::time::timeout(limit, self.cache.ready.clone()).await, Ok(true)) {
            return Err(Error::Timeout {
                what: "waiting for the MacBuild and agent Lease watches' first lists",
                target: target.to_string(),
                secs: limit.as_secs(),
            });
        }
        Ok(())
    }

    /// Labels a finished run's MacBuild, then the run, [`tartan_api::FINISHED_LABEL`]: the watches select
    /// only unfinished objects, so neither is cached or listed again, by this process or after a
    /// restart. The MacBuild first, because a labelled run is never reconciled again. A MacBuild
    /// that is gone, not this run's, or refuses the patch is left as it is (it only stays cached);
    /// so is a run that refuses it, but for an error the reconcile retries.
    async fn mark_finished(&self, run: &CustomRun, ns: &str, name: &str, target: &str) -> Result<(), Error> {
        let t = self.api_timeout;
        let pp = PatchParams {
            field_manager: Some(CONTROLLER_FIELD_MANAGER.into()),
            ..Default::default()
        };
        let run_uid = run.metadata.uid.clone().unwrap_or_default();
        self.caches_filled(target).await?;
        let mb_key = ObjectRef::new(name).within(ns);
        let cached_mb = self.cache.builds.get(&mb_key);
        let cached_rv = cached_mb.as_ref().and_then(|m| m.metadata.resource_version.clone());
        let mb = self.cache.own_builds.fresher(&mb_key, cached_mb);
        if let Some(mb) = mb.filter(|m| !marked_finished(&m.metadata))
            && build_view(&mb).controller_uid.as_deref() == Some(run_uid.as_str())
        {
            let builds: Api<MacBuild> = Api::namespaced(self.client.clone(), ns);
            let patch = finished_label_patch(
                mb.metadata.uid.as_deref().unwrap_or_default(),
                mb.metadata.labels.is_some(),
            );
            match call(
                "labelling MacBuild finished",
                target,
                t,
                builds.patch(name, &pp, &Patch::Json::<()>(patch)),
            )
            .await?
            {
                Ok(written) => self.cache.own_builds.remember(cached_rv, written),
                Err(e) if matches!(api_code(&e), Some(403 | 404 | 409 | 422)) => {
                    tracing::debug!(customrun = %target, "MacBuild not labelled finished ({e}); it stays in the cache");
                }
                Err(e) => return Err(kube_err("labelling MacBuild finished", target, e)),
            }
        }
        let runs: Api<CustomRun> = Api::namespaced(self.client.clone(), ns);
        let run_key = ObjectRef::from_obj(run);
        let cached_rv = rv_in(&self.cache.runs, &run_key);
        let patch = finished_label_patch(&run_uid, run.metadata.labels.is_some());
        match call(
            "labelling CustomRun finished",
            target,
            t,
            runs.patch(name, &pp, &Patch::Json::<()>(patch)),
        )
        .await?
        {
            Ok(written) => self.cache.own_runs.remember(cached_rv, written),
            // Gone, or created again under its name (the uid test fails): the new one is
            // reconciled on its own events.
            Err(e) if matches!(api_code(&e), Some(404 | 422)) => {
                tracing::debug!(customrun = %target, "CustomRun not labelled finished ({e})");
            }
            // Not allowed (RBAC without `patch` on customruns, or an admission policy): the run
            // stays in the watch as before the label, instead of being refused every 5 s for good.
            Err(e) if api_code(&e) == Some(403) => {
                warn!(
                    customrun = %target,
                    "CustomRun not labelled {FINISHED_LABEL}: {e}; it stays in the controller's watch and is listed \
                     at each start; grant the controller `patch` on customruns (deploy/rbac.yaml)"
                );
            }
            Err(e) => return Err(kube_err("labelling CustomRun finished", target, e)),
        }
        Ok(())
    }

    /// Fresh from the API: after a conflict, or before acting on what a stale cache could get
    /// wrong. `None` when the CustomRun is gone.
    async fn fresh(&self, ns: &str, name: &str, target: &str) -> Result<Option<Inputs>, Error> {
        let t = self.api_timeout;
        let runs: Api<CustomRun> = Api::namespaced(self.client.clone(), ns);
        let builds: Api<MacBuild> = Api::namespaced(self.client.clone(), ns);
        let run = match call("reading CustomRun", target, t, runs.get_opt(name)).await? {
            Ok(Some(run)) => run,
            Ok(None) => return Ok(None),
            Err(e) => return Err(kube_err("reading CustomRun", target, e)),
        };
        let mb = call("reading MacBuild", target, t, builds.get_opt(name))
            .await?
            .map_err(|e| kube_err("reading MacBuild", target, e))?;
        let lease = match mb.as_ref().map(build_view).and_then(|v| v.holder) {
            None => None,
            Some(holder) => {
                let (lease_ns, lname) = self.lease_ref(ns, &holder);
                let leases: Api<Lease> = Api::namespaced(self.client.clone(), &lease_ns);
                let lt = format!("{lease_ns}/{lname}");
                call("reading agent Lease", &lt, t, leases.get_opt(&lname))
                    .await?
                    .map_err(|e| kube_err("reading agent Lease", &lt, e))?
            }
        };
        Ok(Some(Inputs {
            run: Arc::new(run),
            mb: mb.map(Arc::new),
            lease: lease.map(Arc::new),
        }))
    }
}

/// Which CustomRun a reconcile is about, in the forms its calls need.
struct Target {
    ns: String,
    name: String,
    /// `ns/name`, for messages and logs.
    key: String,
}

/// What one round of a reconcile (read, decide, act) leaves to do.
enum Next {
    /// The reconcile ends with this action.
    Done(Action),
    /// Decide again: on fresh reads, or on the caches (which show our own writes).
    Again { fresh: bool },
    /// The CustomRun is gone: a new one under its name is reconciled on its own events.
    Gone,
}

/// What applying a plan's MacBuild action came to.
enum Applied {
    /// Done, or nothing to do: the status is written next.
    Done,
    /// The MacBuild cannot be created (why): the run fails with this reason instead.
    Refused(String),
    /// Decide again before writing the status.
    Again { fresh: bool },
}

/// Reconciles one CustomRun. Runs of other custom tasks are ignored.
pub async fn reconcile(obj: Arc<CustomRun>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let mut clock = PhaseClock::new(&obj);
    if !obj.spec.is_macbuild() {
        return Ok(Action::await_change());
    }
    ctx.metrics.reconciles.inc();
    let ns = obj.metadata.namespace.clone().unwrap_or_default();
    let name = obj.metadata.name.clone().unwrap_or_default();
    let at = Target {
        key: format!("{ns}/{name}"),
        ns,
        name,
    };
    let run_key = ObjectRef::from_obj(obj.as_ref());
    let mut run = ctx.cache.own_runs.fresher(&run_key, Some(obj.clone())).unwrap_or(obj);
    if decide::nothing_owed(&run) {
        return ctx.settle_finished(&run, &at).await;
    }
    // The first decision is made on the caches; a conflict, or a verdict a stale cache could
    // get wrong, sends us to fresh reads.
    let mut fresh = false;
    for _ in 0..6 {
        let inputs = if fresh {
            match ctx.fresh(&at.ns, &at.name, &at.key).await? {
                Some(i) => i,
                None => return Ok(Action::await_change()),
            }
        } else {
            ctx.cached(run.clone(), &at.ns, &at.name, &at.key).await?
        };
        clock.mark(if fresh { "fresh" } else { "cached" });
        // The next cached round (after our own create) decides on this run.
        run = inputs.run.clone();
        match ctx.round(inputs, fresh, &at, &mut clock).await? {
            Next::Done(action) => return Ok(action),
            Next::Again { fresh: again_fresh } => fresh = again_fresh,
            Next::Gone => return Ok(Action::await_change()),
        }
    }
    Err(Error::Conflicts(at.key))
}

impl Ctx {
    /// Finished, and its status says so already: nothing to read or write but, once, the label
    /// that takes it out of the watches.
    async fn settle_finished(&self, run: &CustomRun, at: &Target) -> Result<Action, Error> {
        if marked_finished(&run.metadata) {
            return Ok(Action::await_change());
        }
        if let Some(wait) = decide::finished_label_wait(run, &self.timing, Timestamp::now()) {
            return Ok(Action::requeue(wait));
        }
        // Without a free slot the run comes back later instead of holding a reconcile slot
        // that a status write could use.
        let Ok(_slot) = self.labelling.try_acquire() else {
            return Ok(Action::requeue(decide::label_slot_retry(
                run.metadata.uid.as_deref().unwrap_or_default(),
            )));
        };
        self.mark_finished(run, &at.ns, &at.name, &at.key).await?;
        Ok(Action::await_change())
    }

    /// Decides on `inputs` and acts: the MacBuild first, so that a status write that fails is
    /// simply decided again; then the status.
    async fn round(&self, inputs: Inputs, fresh: bool, at: &Target, clock: &mut PhaseClock) -> Result<Next, Error> {
        let Inputs { run, mb, lease } = inputs;
        if run.metadata.deletion_timestamp.is_some() {
            // Garbage collection takes the MacBuild with it; the agent's finalizer keeps it until its VM is gone.
            return Ok(Next::Done(Action::await_change()));
        }
        let view = mb.as_deref().map(build_view);
        let lease = lease.as_deref().map(lease_view);
        let now = Timestamp::now();
        let mut plan = decide::decide(&run, view.as_ref(), lease.as_ref(), &self.timing, now);
        if !fresh && decide::needs_fresh_inputs(&plan, view.as_ref()) {
            return Ok(Next::Again { fresh: true });
        }
        // Whatever goes wrong from here is decided again on fresh reads.
        match self.apply(&plan.action, &run, mb.as_deref(), at).await? {
            Applied::Done => {}
            Applied::Refused(why) => plan = decide::refuse_spec(&run, why, now),
            Applied::Again { fresh } => return Ok(Next::Again { fresh }),
        }
        self.write_status(&run, mb.as_deref(), &plan, at, clock).await
    }

    /// Applies a plan's MacBuild action.
    async fn apply(
        &self,
        action: &BuildAction,
        run: &Arc<CustomRun>,
        mb: Option<&MacBuild>,
        at: &Target,
    ) -> Result<Applied, Error> {
        match action {
            BuildAction::None => Ok(Applied::Done),
            BuildAction::Create(spec) => match new_macbuild(run, spec.clone()) {
                Err(why) => Ok(Applied::Refused(why.to_string())),
                Ok(object) => self.create_macbuild(run, &object, at).await,
            },
            BuildAction::RequestCancel => self.request_cancel(mb, at).await,
            BuildAction::Delete { precondition_rv } => self.delete_macbuild(precondition_rv.as_deref(), mb, at).await,
        }
    }

    async fn create_macbuild(&self, run: &CustomRun, object: &MacBuild, at: &Target) -> Result<Applied, Error> {
        let builds: Api<MacBuild> = Api::namespaced(self.client.clone(), &at.ns);
        let pp = PostParams {
            field_manager: Some(CONTROLLER_FIELD_MANAGER.into()),
            ..Default::default()
        };
        let cached_rv = rv_in(&self.cache.builds, &ObjectRef::new(&at.name).within(&at.ns));
        let target = &at.key;
        match call(
            "creating MacBuild",
            target,
            self.api_timeout,
            builds.create(&pp, object),
        )
        .await?
        {
            Ok(created) => {
                info!(customrun = %target, "created MacBuild");
                self.cache.own_builds.remember(cached_rv, created);
                publish(
                    self,
                    run,
                    false,
                    "MacBuildCreated",
                    format!("created MacBuild {target}"),
                );
                // Decide again on the created MacBuild before writing: one status write then
                // records it (its uid) instead of two.
                Ok(Applied::Again { fresh: false })
            }
            // Another replica or an earlier reconcile created it: decide again, adopting it if
            // it is ours.
            Err(e) if api_code(&e) == Some(409) => Ok(Applied::Again { fresh: true }),
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 400 => {
                Ok(Applied::Refused(format!("the API refused the MacBuild: {}", s.message)))
            }
            Err(e) => Err(kube_err("creating MacBuild", target, e)),
        }
    }

    async fn request_cancel(&self, mb: Option<&MacBuild>, at: &Target) -> Result<Applied, Error> {
        let builds: Api<MacBuild> = Api::namespaced(self.client.clone(), &at.ns);
        let patch = Patch::Merge(json!({"spec": {"cancelRequested": true}}));
        let pp = PatchParams {
            field_manager: Some(CONTROLLER_FIELD_MANAGER.into()),
            ..Default::default()
        };
        let cached_rv = rv_in(&self.cache.builds, &ObjectRef::new(&at.name).within(&at.ns));
        let what = "requesting cancel on MacBuild";
        match call(what, &at.key, self.api_timeout, builds.patch(&at.name, &pp, &patch)).await? {
            Ok(patched) => {
                self.cache.own_builds.remember(cached_rv, patched);
                if let Some(mb) = mb {
                    let note = "cancel requested by tartan-controller";
                    publish_on(self, mb, false, "CancelRequested", note.into());
                }
                Ok(Applied::Done)
            }
            Err(e) if api_code(&e) == Some(404) => Ok(Applied::Again { fresh: true }),
            Err(e) => Err(kube_err(what, &at.key, e)),
        }
    }

    async fn delete_macbuild(
        &self,
        precondition_rv: Option<&str>,
        mb: Option<&MacBuild>,
        at: &Target,
    ) -> Result<Applied, Error> {
        let builds: Api<MacBuild> = Api::namespaced(self.client.clone(), &at.ns);
        let dp = DeleteParams {
            preconditions: precondition_rv.map(|rv| Preconditions {
                resource_version: Some(rv.to_string()),
                uid: None,
            }),
            ..Default::default()
        };
        self.cache.own_builds.forget(&ObjectRef::new(&at.name).within(&at.ns));
        match call(
            "deleting MacBuild",
            &at.key,
            self.api_timeout,
            builds.delete(&at.name, &dp),
        )
        .await?
        {
            Ok(_) => {
                if let Some(mb) = mb {
                    let note =
                        "deletion requested by tartan-controller; an agent's finalizer keeps it until its VM is gone";
                    publish_on(self, mb, false, "DeletionRequested", note.into());
                }
                Ok(Applied::Done)
            }
            Err(e) if api_code(&e) == Some(404) => Ok(Applied::Done),
            // An agent claimed it between our read and the delete: decide again.
            Err(e) if api_code(&e) == Some(409) => Ok(Applied::Again { fresh: true }),
            Err(e) => Err(kube_err("deleting MacBuild", &at.key, e)),
        }
    }

    /// Writes the plan's status, only if it changed (a write that changes nothing is never
    /// sent), then its Events and metrics.
    async fn write_status(
        &self,
        run: &CustomRun,
        mb: Option<&MacBuild>,
        plan: &Plan,
        at: &Target,
        clock: &mut PhaseClock,
    ) -> Result<Next, Error> {
        let done = Next::Done(plan.requeue_after.map_or_else(Action::await_change, Action::requeue));
        if run.status.as_ref() == Some(&plan.status) {
            return Ok(done);
        }
        let runs: Api<CustomRun> = Api::namespaced(self.client.clone(), &at.ns);
        let patch = status_patch(
            run.status.as_ref(),
            run.metadata.resource_version.as_deref().unwrap_or(""),
            &plan.status,
        );
        let pp = PatchParams {
            field_manager: Some(CONTROLLER_FIELD_MANAGER.into()),
            ..Default::default()
        };
        let cached_rv = rv_in(&self.cache.runs, &ObjectRef::from_obj(run));
        let what = "writing CustomRun status";
        let t = self.api_timeout;
        match call(
            what,
            &at.key,
            t,
            runs.patch_status(&at.name, &pp, &Patch::Json::<()>(patch)),
        )
        .await?
        {
            Ok(written) => {
                clock.mark("status");
                self.cache.own_runs.remember(cached_rv, written)
            }
            // Someone else wrote first (a failed `test` is 422, a stale version 409): decide again.
            Err(e) if matches!(api_code(&e), Some(409 | 422)) => return Ok(Next::Again { fresh: true }),
            Err(e) if api_code(&e) == Some(404) => return Ok(Next::Gone),
            Err(e) => return Err(kube_err(what, &at.key, e)),
        }
        for note in &plan.events {
            publish(self, run, note.warning, &note.reason, note.message.clone());
        }
        clock.mark("events");
        count_finish(self, plan);
        if plan.finished.is_some() {
            self.metrics.observe_build_times(crate::metrics::build_times(
                run.metadata.creation_timestamp.as_ref().map(|t| t.0),
                mb.and_then(|mb| mb.status.as_ref()),
                Timestamp::now(),
            ));
        }
        Ok(done)
    }
}

/// How long each phase of one reconcile took (reading, writing the status, the Events), logged
/// at debug level under `tartan_controller::timing` for reconciles that did some work: the
/// benchmark (`BENCH_CONTROLLER_LOG`) finds where a slow catch-up waits with it.
struct PhaseClock {
    key: String,
    start: std::time::Instant,
    last: std::time::Instant,
    marks: Vec<(&'static str, u128)>,
}

impl PhaseClock {
    fn new(run: &CustomRun) -> Self {
        let now = std::time::Instant::now();
        PhaseClock {
            key: key(run),
            start: now,
            last: now,
            marks: vec![],
        }
    }
    fn mark(&mut self, what: &'static str) {
        let now = std::time::Instant::now();
        self.marks.push((what, now.duration_since(self.last).as_micros()));
        self.last = now;
    }
}

impl Drop for PhaseClock {
    fn drop(&mut self) {
        if !self.marks.is_empty() {
            tracing::debug!(target: "tartan_controller::timing", customrun = %self.key, total_us = self.start.elapsed().as_micros(), marks = ?self.marks, "reconcile phases");
        }
    }
}

fn count_finish(ctx: &Ctx, plan: &Plan) {
    if let Some(f) = &plan.finished {
        ctx.metrics.count_finish(f);
    }
}

fn publish(ctx: &Ctx, run: &CustomRun, warning: bool, reason: &str, note: String) {
    publish_ref(ctx, run.object_ref(&()), key(run), warning, reason, note);
}

fn publish_on(ctx: &Ctx, mb: &MacBuild, warning: bool, reason: &str, note: String) {
    let target = format!(
        "{}/{}",
        mb.metadata.namespace.as_deref().unwrap_or_default(),
        mb.metadata.name.as_deref().unwrap_or_default()
    );
    publish_ref(ctx, mb.object_ref(&()), target, warning, reason, note);
}

/// Events are best effort: queued for [`publish_events`] (dropped while the queue is full);
/// a failure is logged and never fails the reconcile.
fn publish_ref(ctx: &Ctx, reference: ObjectReference, target: String, warning: bool, reason: &str, note: String) {
    let mut note = note;
    if note.len() > 1000 {
        let mut cut = 1000;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    let event = Event {
        type_: if warning { EventType::Warning } else { EventType::Normal },
        reason: reason.to_string(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    let pending = PendingEvent {
        event,
        reference,
        target,
    };
    ctx.events.offer(pending);
}

/// An Event waiting to be published, and what it is about.
pub struct PendingEvent {
    event: Event,
    reference: ObjectReference,
    target: String,
}

/// Finished-label writes at once per watched namespace. Few: the label is not urgent (it only
/// takes a finished run out of the watches), and after a restart that ends thousands of runs the
/// label wave (two writes a run, 30 s after each ending) otherwise took most of the API server
/// from the status writes Tekton waits for: on kube-apiserver 1.24 a catch-up of 3,000 runs
/// (over before the wave) went at 200-265 runs/s, one of 10,000 (inside it) at 80.
pub const LABELS_IN_FLIGHT: usize = 4;

/// Most Events waiting to be published.
pub const EVENT_QUEUE: usize = 4096;

/// Events published at once. Fewer than the reconciles' writes: after a restart the status
/// writes (what Tekton waits for) get most of the API server, and the Events follow.
pub const EVENTS_IN_FLIGHT: usize = 4;

/// Where Events wait for [`publish_events`]. Events are best effort and never hold up a reconcile:
/// when the queue is full (a restart that ends thousands of runs at once, faster than the API
/// server takes their Events) the Event is dropped and counted in `events_dropped`, as client-go's
/// recorder drops what its full queue cannot take. A reconcile that waited for room instead made
/// a catch-up of 10,000 runs on kube-apiserver 1.24 run at the Events' pace.
#[derive(Clone)]
pub struct EventQueue {
    waiting: mpsc::Sender<PendingEvent>,
    dropped: Counter,
    /// Whether the last Event offered was dropped: the next drop after one that was queued
    /// starts a new burst, which is logged.
    dropping: Arc<std::sync::atomic::AtomicBool>,
}

/// What became of an Event offered to the [`EventQueue`].
#[derive(Debug, PartialEq, Eq)]
enum Offered {
    Queued,
    /// Dropped for a full queue, and whether that was logged.
    Dropped {
        logged: bool,
    },
    /// The publisher has stopped.
    Closed,
}

impl EventQueue {
    /// A queue of `capacity` Events, counting what it drops in `dropped`, and its receiving end
    /// for [`publish_events`].
    pub fn new(capacity: usize, dropped: Counter) -> (EventQueue, mpsc::Receiver<PendingEvent>) {
        let (waiting, queued) = mpsc::channel(capacity);
        let dropping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        (
            EventQueue {
                waiting,
                dropped,
                dropping,
            },
            queued,
        )
    }

    /// Queues the Event, or drops it if the queue is full or the publisher has stopped.
    fn offer(&self, pending: PendingEvent) -> Offered {
        use std::sync::atomic::Ordering::Relaxed;
        match self.waiting.try_send(pending) {
            Ok(()) => {
                self.dropping.store(false, Relaxed);
                Offered::Queued
            }
            Err(mpsc::error::TrySendError::Full(p)) => {
                // One line for the first drop of each burst and one per thousand after: a burst
                // would otherwise log as many lines as it drops, and a count kept since the start
                // alone would leave every later burst short of a thousand unlogged.
                let dropped = self.dropped.inc() + 1;
                let burst_starts = !self.dropping.swap(true, Relaxed);
                let logged = burst_starts || dropped.is_multiple_of(1000);
                if logged {
                    warn!(
                        object = %p.target,
                        reason = %p.event.reason,
                        dropped,
                        "Event dropped: {} Events are waiting to be published; the run's status is written regardless",
                        self.waiting.max_capacity()
                    );
                }
                Offered::Dropped { logged }
            }
            Err(mpsc::error::TrySendError::Closed(p)) => {
                warn!(object = %p.target, reason = %p.event.reason, "Event not published: the controller is stopping");
                Offered::Closed
            }
        }
    }
}

/// Makes the Recorder that publishes one Event.
pub type NewRecorder = Arc<dyn Fn() -> Recorder + Send + Sync>;

/// Publishes the queued Events, [`EVENTS_IN_FLIGHT`] at once, until every sender is gone. Apart
/// from the reconciles, so that a status write never waits for another run's Event.
pub async fn publish_events(rx: mpsc::Receiver<PendingEvent>, recorder: NewRecorder, limit: Duration) {
    let recorder = &recorder;
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|p| (p, rx)) })
        .for_each_concurrent(EVENTS_IN_FLIGHT, |p| async move {
            let reason = p.event.reason.as_str();
            match tokio::time::timeout(limit, recorder().publish(&p.event, &p.reference)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    warn!(object = %p.target, reason, "publishing Event failed: {e}; continuing without it")
                }
                Err(_) => warn!(object = %p.target, reason, "publishing Event timed out; continuing without it"),
            }
        })
        .await;
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

    fn pending(name: &str) -> PendingEvent {
        PendingEvent {
            event: Event {
                type_: EventType::Normal,
                reason: "Succeeded".into(),
                note: None,
                action: "Reconcile".into(),
                secondary: None,
            },
            reference: ObjectReference::default(),
            target: format!("ci/{name}"),
        }
    }

    /// A full queue drops (and counts) the Event at once instead of holding up the reconcile;
    /// what was queued is published, in order; a stopped publisher drops without counting.
    #[test]
    fn a_full_event_queue_drops_and_counts_without_waiting() {
        let dropped = Counter::default();
        let (queue, mut queued) = EventQueue::new(2, dropped.clone());
        for name in ["a", "b", "c", "d"] {
            queue.offer(pending(name));
        }
        assert_eq!(dropped.get(), 2);
        assert_eq!(queued.try_recv().unwrap().target, "ci/a");
        assert_eq!(queued.try_recv().unwrap().target, "ci/b");
        assert!(queued.try_recv().is_err());
        queue.offer(pending("e"));
        assert_eq!(queued.try_recv().unwrap().target, "ci/e");
        assert_eq!(dropped.get(), 2);
        drop(queued);
        queue.offer(pending("f"));
        assert_eq!(
            dropped.get(),
            2,
            "a closed queue is the controller stopping, not a drop"
        );
    }

    /// Each burst of drops is logged at its first drop (and every thousandth), not only the
    /// first burst since the start: a later burst short of a thousand drops left no line at all.
    #[test]
    fn every_burst_of_dropped_events_is_logged() {
        let dropped = Counter::default();
        let (queue, mut queued) = EventQueue::new(1, dropped.clone());
        assert_eq!(queue.offer(pending("a")), Offered::Queued);
        assert_eq!(queue.offer(pending("b")), Offered::Dropped { logged: true });
        assert_eq!(queue.offer(pending("c")), Offered::Dropped { logged: false });
        // The publisher catches up; a later burst drops again.
        assert_eq!(queued.try_recv().unwrap().target, "ci/a");
        assert_eq!(queue.offer(pending("d")), Offered::Queued);
        assert_eq!(
            queue.offer(pending("e")),
            Offered::Dropped { logged: true },
            "the first drop of a new burst is logged"
        );
        assert_eq!(queue.offer(pending("f")), Offered::Dropped { logged: false });
        assert_eq!(dropped.get(), 4);
        // A burst of thousands: its first drop and each thousandth counted are logged.
        assert_eq!(queued.try_recv().unwrap().target, "ci/d");
        assert_eq!(queue.offer(pending("g")), Offered::Queued);
        let logged = (0..2500)
            .filter(|_| queue.offer(pending("h")) == Offered::Dropped { logged: true })
            .count();
        assert_eq!(logged, 3, "the burst's first drop, and the 1000th and 2000th counted");
        drop(queued);
        assert_eq!(queue.offer(pending("i")), Offered::Closed);
    }

    fn run_at(rv: &str, reason: &str) -> Arc<CustomRun> {
        let mut run = CustomRun::new("r", Default::default());
        run.metadata.namespace = Some("ci".into());
        run.metadata.resource_version = Some(rv.into());
        run.status = Some(CustomRunStatus {
            conditions: vec![Condition {
                type_: "Succeeded".into(),
                status: "Unknown".into(),
                reason: Some(reason.into()),
                message: None,
                severity: None,
                last_transition_time: None,
            }],
            ..Default::default()
        });
        Arc::new(run)
    }

    /// Found by the controller benchmark: after a restart the first reconciles (as many as the
    /// concurrency) all wait for the caches, and with kube's own readiness future only the last
    /// to wait was woken; the others sat out their 10 s timeout.
    #[tokio::test]
    async fn every_reconcile_waiting_for_the_caches_wakes_when_they_fill() {
        use futures::StreamExt as _;
        use futures::stream::FuturesUnordered;
        use kube::runtime::{reflector, watcher};
        let (builds, mut build_writer) = reflector::store::<MacBuild>();
        let (leases, mut lease_writer) = reflector::store::<Lease>();
        let caches = Caches::new(reflector::store::<CustomRun>().0, builds, leases);
        // Polled the way kube's controller polls its reconciles: one task, a waker each.
        let mut waiting: FuturesUnordered<_> = (0..16).map(|_| caches.ready.clone()).collect();
        assert!(futures::poll!(waiting.next()).is_pending(), "nothing listed yet");
        build_writer.apply_watcher_event(&watcher::Event::Init);
        build_writer.apply_watcher_event(&watcher::Event::InitDone);
        assert!(
            futures::poll!(waiting.next()).is_pending(),
            "the Leases are not listed yet"
        );
        lease_writer.apply_watcher_event(&watcher::Event::Init);
        lease_writer.apply_watcher_event(&watcher::Event::InitDone);
        let woke = tokio::time::timeout(Duration::from_secs(5), waiting.collect::<Vec<bool>>())
            .await
            .expect("every waiting reconcile is woken once both caches are listed");
        assert_eq!(woke, vec![true; 16]);
    }

    /// A store (the watch cache) and its writer, holding `objects`.
    fn cache_of(objects: &[Arc<CustomRun>]) -> (Store<CustomRun>, kube::runtime::reflector::store::Writer<CustomRun>) {
        let (store, mut writer) = kube::runtime::reflector::store::<CustomRun>();
        writer.apply_watcher_event(&watcher::Event::Init);
        for o in objects {
            writer.apply_watcher_event(&watcher::Event::InitApply((**o).clone()));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        (store, writer)
    }

    #[test]
    fn our_own_write_is_read_until_the_cache_shows_it() {
        let rv = |r: Option<Arc<CustomRun>>| r.and_then(|r| r.metadata.resource_version.clone());
        let cached = run_at("10", "Pending");
        let (store, _writer) = cache_of(std::slice::from_ref(&cached));
        let own = OwnWrites::<CustomRun>::new(store, trim_customrun);
        let key = ObjectRef::new("r").within("ci");
        assert_eq!(
            rv(own.fresher(&key, Some(cached.clone()))).as_deref(),
            Some("10"),
            "nothing written yet"
        );
        // We wrote while the cache showed 10; the API answered with 11.
        own.remember(Some("10".into()), (*run_at("11", "Running")).clone());
        assert_eq!(
            rv(own.fresher(&key, Some(cached.clone()))).as_deref(),
            Some("11"),
            "the cache is behind"
        );
        // The cache moved on (to our write or past it): from now on it is the fresher.
        assert_eq!(
            rv(own.fresher(&key, Some(run_at("12", "Running")))).as_deref(),
            Some("12")
        );
        assert_eq!(
            rv(own.fresher(&key, Some(cached))).as_deref(),
            Some("10"),
            "forgotten once the cache moved"
        );
        // A created object the cache has not listed yet.
        let created = OwnWrites::<CustomRun>::new(cache_of(&[]).0, trim_customrun);
        created.remember(None, (*run_at("5", "Pending")).clone());
        assert_eq!(rv(created.fresher(&key, None)).as_deref(), Some("5"));
    }

    /// Found by the controller benchmark: the objects our writes returned were kept whole
    /// (managedFields, a created MacBuild's spec), thousands of them at 10,000 runs.
    #[test]
    fn our_own_writes_are_kept_trimmed_like_the_cache() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
        let key = ObjectRef::new("r").within("ci");
        let mut run = (*run_at("11", "Running")).clone();
        run.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some("tartan-controller".into()),
            ..Default::default()
        }]);
        let (store, _writer) = cache_of(&[run_at("10", "Pending")]);
        let own = OwnWrites::<CustomRun>::new(store.clone(), trim_customrun);
        own.remember(Some("10".into()), run.clone());
        let kept = own.fresher(&key, store.get(&key)).expect("our write");
        trim_customrun(&mut run);
        assert_eq!(
            serde_json::to_value(&*kept).unwrap(),
            serde_json::to_value(&run).unwrap(),
            "kept as the watch cache would keep it"
        );
        assert!(kept.metadata.managed_fields.is_none());

        let mut mb = MacBuild::new(
            "r",
            serde_json::from_value(json!({"image": "img", "steps": [{"name": "a", "run": ["x"]}]})).unwrap(),
        );
        mb.metadata.namespace = Some("ci".into());
        let (builds, _build_writer) = kube::runtime::reflector::store::<MacBuild>();
        let own = OwnWrites::<MacBuild>::new(builds, trim_macbuild);
        own.remember(None, mb.clone());
        let kept = own.fresher(&ObjectRef::new("r").within("ci"), None).expect("our write");
        trim_macbuild(&mut mb);
        assert_eq!(kept.spec, mb.spec);
        assert!(kept.spec.steps.is_empty(), "a created MacBuild's steps are not kept");
    }

    /// Found by the adversary review of the finished label: the label's write takes the run
    /// (and its MacBuild) out of its watch, so the cache never showed another version, no
    /// reconcile of it called `fresher` again, and our write stayed: every labelled run left its
    /// CustomRun and MacBuild, untrimmed, in the overlay until 4,096 piled up, and then the whole
    /// overlay went, live runs' entries with it.
    #[test]
    fn a_write_that_takes_the_object_out_of_its_watch_is_not_kept() {
        let key = ObjectRef::new("r").within("ci");
        // The watch's DELETED (the selector no longer matches) comes after the API's answer...
        let (store, mut writer) = cache_of(&[run_at("10", "Succeeded")]);
        let own = OwnWrites::<CustomRun>::new(store, trim_customrun);
        own.remember(Some("10".into()), (*run_at("11", "Succeeded")).clone());
        assert_eq!(own.len(), 1, "the cache has not seen the label yet");
        let left = watcher::Event::Delete((*run_at("11", "Succeeded")).clone());
        writer.apply_watcher_event(&left);
        own.forget_departed(&left);
        assert!(own.is_empty(), "kept after the run left the watch");

        // ... or before it.
        let (store, mut writer) = cache_of(&[run_at("20", "Succeeded")]);
        let own = OwnWrites::<CustomRun>::new(store, trim_customrun);
        writer.apply_watcher_event(&watcher::Event::Delete((*run_at("21", "Succeeded")).clone()));
        own.remember(Some("20".into()), (*run_at("21", "Succeeded")).clone());
        assert!(own.is_empty(), "kept though the run had left the watch already");
        assert!(own.fresher(&key, None).is_none());

        // A list again that leaves it out (it left while the watch was behind).
        let (store, mut writer) = cache_of(&[run_at("40", "Succeeded")]);
        let own = OwnWrites::<CustomRun>::new(store, trim_customrun);
        own.remember(Some("40".into()), (*run_at("41", "Succeeded")).clone());
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitDone);
        own.forget_departed(&watcher::Event::InitDone);
        assert!(own.is_empty(), "kept after a list without it");

        // Other events keep it until the cache shows it.
        let (store, mut writer) = cache_of(&[run_at("30", "Running")]);
        let own = OwnWrites::<CustomRun>::new(store, trim_customrun);
        own.remember(Some("30".into()), (*run_at("31", "Running")).clone());
        let other = watcher::Event::Apply((*run_at("30", "Running")).clone());
        writer.apply_watcher_event(&other);
        own.forget_departed(&other);
        assert_eq!(own.len(), 1);
    }

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
