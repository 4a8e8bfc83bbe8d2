//! Leader election between controller replicas on one `coordination.k8s.io/v1` Lease
//! (`tartan-controller` in the controller's namespace), and the write gate that fences a leader
//! that lost it.
//!
//! Why not a crate: `kube-lease-manager` (the one maintained elector built on kube 5) counts a
//! Lease's expiry on the wall clock from its `renewTime` and renews with patches that do not carry
//! the resourceVersion; it exposes "leader or not" but no instant to fence writes by. Here:
//!
//! - Every Lease write is a `replace` carrying the resourceVersion last read (a stale read gets 409)
//!   or a `create` (409 if it exists): two candidates can never both succeed on one version.
//! - The leader may write until `lease − margin` after it *sent* its last successful renewal, on
//!   both the monotonic and the wall clock ([`tartan_api::lease_clock`]). [`Gate`] checks that
//!   before every mutating API request leaves the process ([`GateLayer`], a layer on kube's HTTP
//!   stack, so no write path can bypass it), and the reconciler is stopped at the same instant.
//! - A standby takes over only once it has seen the *same* Lease record (same resourceVersion, not
//!   released) unchanged for that record's `leaseDurationSeconds` (never less than its own) on its
//!   own monotonic clock, which started after the holder sent its last renewal. Only a record this
//!   process wrote (or renews while leading) is its own, and only a release frees a record: a
//!   record edited or created by hand under a live leader is waited out like an expired one. So the old holder's gate is closed at least
//!   `margin` before the new one's opens, whatever the two wall clocks say; the margin covers
//!   requests in flight when the gate closed.
//! - A leader that loses the Lease re-enters standby (the reconciler is rebuilt from fresh watches
//!   if it leads again); exiting would only add a pod restart and crash-loop back-off to the
//!   failover path. On SIGTERM the leader releases the Lease (fenced), so a rolling update hands
//!   over at the standby's next poll instead of after a lease duration.

use crate::metrics::Metrics;
use futures::future::BoxFuture;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tartan_api::CONTROLLER_FIELD_MANAGER;
use tartan_api::lease_clock::{Stamp, stamp_within};
use tokio::sync::watch;
use tracing::{error, info, warn};

/// Leader-election settings (flags of `tartan-controller run`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElectionConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's `holderIdentity`: the pod name, else `<hostname>-<pid>`.
    pub identity: String,
    /// `leaseDurationSeconds` (15 s).
    pub lease: Duration,
    /// Renewal period of the leader (5 s).
    pub renew_every: Duration,
    /// Poll period of a standby and retry period of a failed renewal (2 s).
    pub retry_every: Duration,
    /// How long before the Lease's end the leader stops writing (5 s).
    pub margin: Duration,
    /// Limit of one Lease request (`--api-timeout`). Safety does not rest on it: the leader steps
    /// down when its write window ends, whatever its round is waiting for.
    pub api_timeout: Duration,
}

impl ElectionConfig {
    /// How long after a renewal was sent the leader may write.
    pub fn write_window(&self) -> Duration {
        self.lease.saturating_sub(self.margin)
    }

    /// `leaseDurationSeconds`: rounded up, so a standby never waits less than the leader's window.
    pub fn lease_seconds(&self) -> i32 {
        let secs = self
            .lease
            .as_secs()
            .saturating_add(u64::from(self.lease.subsec_nanos() > 0));
        i32::try_from(secs).unwrap_or(i32::MAX).max(1)
    }

    /// Refuses settings under which the fence cannot hold or the leader cannot renew in time.
    pub fn validate(&self) -> Result<(), ElectionConfigError> {
        if self.margin.is_zero() || self.margin >= self.lease {
            return Err(ElectionConfigError::Margin {
                margin: self.margin,
                lease: self.lease,
            });
        }
        if self.renew_every.is_zero() || self.renew_every >= self.write_window() {
            return Err(ElectionConfigError::RenewEvery {
                renew_every: self.renew_every,
                write_window: self.write_window(),
            });
        }
        if self.retry_every.is_zero() || self.retry_every > self.renew_every {
            return Err(ElectionConfigError::RetryEvery {
                retry_every: self.retry_every,
                renew_every: self.renew_every,
            });
        }
        if self.identity.is_empty() {
            return Err(ElectionConfigError::NoIdentity);
        }
        Ok(())
    }
}

/// Leader election settings under which the fence cannot hold or the leader cannot renew in time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElectionConfigError {
    #[error("--leader-margin ({margin:?}) must be more than zero and less than --leader-lease ({lease:?})")]
    Margin { margin: Duration, lease: Duration },
    #[error(
        "--leader-renew-every ({renew_every:?}) must be more than zero and less than --leader-lease minus \
         --leader-margin ({write_window:?}), or the leader stops writing between two renewals"
    )]
    RenewEvery {
        renew_every: Duration,
        write_window: Duration,
    },
    #[error(
        "--leader-retry-every ({retry_every:?}) must be more than zero and at most --leader-renew-every ({renew_every:?})"
    )]
    RetryEvery {
        retry_every: Duration,
        renew_every: Duration,
    },
    #[error("the leader identity is empty (set POD_NAME or --instance)")]
    NoIdentity,
}

/// The identity of this replica: `pod_name` when set, else `<hostname>-<pid>`.
pub fn identity(pod_name: Option<&str>, hostname: &str, pid: u32) -> String {
    match pod_name.filter(|p| !p.is_empty()) {
        Some(pod) => pod.to_string(),
        None => format!("{hostname}-{pid}"),
    }
}

// ---- pure logic ----

/// Whether a leader whose last successful renewal was sent at `renewed` may still write at `now`.
pub fn may_write(renewed: Stamp, window: Duration, now: Stamp) -> bool {
    stamp_within(renewed, window, now)
}

/// A standby's view of the Lease: the record it saw and since when (its own monotonic clock).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    pub resource_version: String,
    pub holder: Option<String>,
    /// Released by its holder: no holder and no `renewTime` ([`released`]). A holder cleared by
    /// hand leaves its `renewTime`, and its leader may still write until its next round.
    pub released: bool,
    /// The record's `leaseDurationSeconds`, never less than ours (ours when it states none).
    pub lease: Duration,
    /// When this exact record was first seen.
    pub since: Instant,
}

/// The observation after reading `lease` at `now`: unchanged record → same `since`; any change
/// (renewal, new holder, release) restarts the count.
///
/// The record's duration counts only when longer than `ours`: a leader states its own, and a
/// record edited to a shorter one (by hand, after the leader's last renewal) must not let a
/// standby in while that leader may still write for its whole window.
pub fn observe(previous: Option<&Observation>, lease: &Lease, ours: Duration, now: Instant) -> Observation {
    let spec = lease.spec.as_ref();
    let holder = spec.and_then(|s| s.holder_identity.clone()).filter(|h| !h.is_empty());
    let lease_duration = spec
        .and_then(|s| s.lease_duration_seconds)
        .and_then(|s| u64::try_from(s).ok())
        .map_or(ours, |s| Duration::from_secs(s).max(ours));
    let resource_version = lease.metadata.resource_version.clone().unwrap_or_default();
    let since = match previous {
        Some(p) if p.resource_version == resource_version && !resource_version.is_empty() => p.since,
        _ => now,
    };
    let released = holder.is_none() && spec.and_then(|s| s.renew_time.as_ref()).is_none();
    Observation {
        resource_version,
        holder,
        released,
        lease: lease_duration,
        since,
    }
}

/// What a replica that does not lead may do about the Lease it observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Takeover {
    /// Take it now, fenced by the observed resourceVersion.
    Now(TakeoverReason),
    /// Someone else holds it (or held it: a holder cleared by hand); look again; it cannot be
    /// taken before `not_before`.
    Wait {
        holder: Option<String>,
        not_before: Instant,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TakeoverReason {
    /// Nobody holds it (released, or never held), or we lead and it lost its holder under us.
    Free,
    /// It names us and is our own live claim (we lead, or we wrote exactly this record): ours to renew.
    Ours,
    /// Its holder let it go unrenewed for a whole lease duration.
    Expired,
}

/// Whether `me` may take the observed Lease at `now` (monotonic clock only: a wall-clock step
/// cannot shorten the wait, and a sleep that the monotonic clock did not count only lengthens it).
///
/// `own_claim`: this process knows a record naming `me` to be its own (it leads, or this is the
/// very record it last wrote). A record naming `me` that it did not write (edited by hand to force
/// a failover, or left by this pod's previous container) is waited out like anyone else's: the
/// replica that led before the edit keeps its gate open until its next round reads the change.
pub fn takeover(obs: &Observation, me: &str, own_claim: bool, now: Instant) -> Takeover {
    match obs.holder.as_deref() {
        None if obs.released || own_claim => Takeover::Now(TakeoverReason::Free),
        Some(h) if h == me && own_claim => Takeover::Now(TakeoverReason::Ours),
        holder => {
            let holder = holder.map(str::to_string);
            match obs.since.checked_add(obs.lease) {
                Some(t) if now < t => Takeover::Wait { holder, not_before: t },
                // An overflowing lease duration never expires.
                None => Takeover::Wait {
                    holder,
                    not_before: now + Duration::from_secs(3600),
                },
                Some(_) => Takeover::Now(TakeoverReason::Expired),
            }
        }
    }
}

/// The Lease to create when none exists.
pub fn new_lease(cfg: &ElectionConfig, now: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(cfg.name.clone()),
            namespace: Some(cfg.namespace.clone()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(cfg.identity.clone()),
            lease_duration_seconds: Some(cfg.lease_seconds()),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(0),
            ..Default::default()
        }),
    }
}

/// `current` renewed by us at `now` (keeping its resourceVersion, the fence of the replace); when
/// it was not ours, also `acquireTime` and one more transition.
pub fn claimed(current: &Lease, cfg: &ElectionConfig, now: Timestamp) -> Lease {
    let mut lease = current.clone();
    let spec = lease.spec.get_or_insert_with(Default::default);
    let ours = spec.holder_identity.as_deref() == Some(cfg.identity.as_str());
    if !ours {
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
    }
    spec.holder_identity = Some(cfg.identity.clone());
    spec.lease_duration_seconds = Some(cfg.lease_seconds());
    spec.renew_time = Some(MicroTime(now));
    lease
}

/// `current` released: no holder, so a standby takes it at once.
pub fn released(current: &Lease) -> Lease {
    let mut lease = current.clone();
    let spec = lease.spec.get_or_insert_with(Default::default);
    spec.holder_identity = None;
    spec.renew_time = None;
    spec.acquire_time = None;
    lease
}

// ---- the gate ----

/// Whether this replica leads, and until when it may write. Shared by the elector (which opens and
/// closes it), the HTTP layer (which checks it before every write) and `/readyz`, `/metrics`.
pub struct Gate {
    renewed: Mutex<Option<Stamp>>,
    window: Duration,
    metrics: Arc<Metrics>,
}

impl Gate {
    pub fn new(window: Duration, metrics: Arc<Metrics>) -> Gate {
        Gate {
            renewed: Mutex::new(None),
            window,
            metrics,
        }
    }

    /// A gate that is always open: leader election is off (one replica).
    pub fn always_open(metrics: Arc<Metrics>) -> Gate {
        Gate::new(Duration::MAX, metrics).opened(Stamp::now())
    }

    fn opened(self, at: Stamp) -> Gate {
        *self.lock() = Some(at);
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Stamp>> {
        // A poisoned lock only means a panic elsewhere while holding a Copy value: still valid.
        self.renewed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A renewal (or takeover) sent at `sent` succeeded.
    pub fn renewed(&self, sent: Stamp) {
        let mut r = self.lock();
        // Never move the fence back: a slow older request must not shorten a newer renewal's window.
        if r.is_none_or(|old| old.mono <= sent.mono) {
            *r = Some(sent);
        }
    }

    /// Leadership ended (lost, released, or its window passed).
    pub fn close(&self) {
        *self.lock() = None;
    }

    /// The last successful renewal, if leading.
    pub fn renewed_at(&self) -> Option<Stamp> {
        *self.lock()
    }

    /// Whether writes are allowed at `now`.
    pub fn may_write_at(&self, now: Stamp) -> bool {
        self.renewed_at().is_some_and(|r| may_write(r, self.window, now))
    }

    /// When writes stop unless a renewal succeeds first (monotonic clock).
    pub fn deadline(&self) -> Option<Instant> {
        self.renewed_at().and_then(|r| r.mono.checked_add(self.window))
    }

    /// Checked before every mutating request: refuses, logs and counts it when not allowed.
    pub fn check(&self, method: &http::Method, path: &str) -> Result<(), WriteRefused> {
        if self.may_write_at(Stamp::now()) {
            return Ok(());
        }
        self.metrics.refused_writes.inc();
        let refused = WriteRefused {
            method: method.to_string(),
            path: path.to_string(),
        };
        warn!("{refused}");
        Err(refused)
    }
}

/// A write this replica did not send because it does not (or no longer) hold the leader Lease.
#[derive(Debug, thiserror::Error)]
#[error(
    "refused write {method} {path}: this controller is not the leader (its leader Lease is lost or not \
     yet held); the write was not sent, the leader does it"
)]
pub struct WriteRefused {
    pub method: String,
    pub path: String,
}

/// A layer on kube's HTTP stack that sends a mutating request only while the [`Gate`] is open.
#[derive(Clone)]
pub struct GateLayer(pub Arc<Gate>);

impl<S> tower_layer::Layer<S> for GateLayer {
    type Service = Gated<S>;
    fn layer(&self, inner: S) -> Gated<S> {
        Gated {
            inner,
            gate: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Gated<S> {
    inner: S,
    gate: Arc<Gate>,
}

/// Reads go through; everything else is a write.
fn is_read(method: &http::Method) -> bool {
    matches!(*method, http::Method::GET | http::Method::HEAD | http::Method::OPTIONS)
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<S, B> tower_service::Service<http::Request<B>> for Gated<S>
where
    S: tower_service::Service<http::Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<S::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if !is_read(req.method()) {
            // Checked here, when the request leaves, not when the reconcile began.
            if let Err(refused) = self.gate.check(req.method(), req.uri().path()) {
                return Box::pin(async move { Err(Box::new(refused) as BoxError) });
            }
        }
        let fut = self.inner.call(req);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}

// ---- the elector ----

/// What the elector publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Not leading; `holder` is who does, as last seen.
    Standby { holder: Option<String> },
    /// Leading; writes stop at `until` (monotonic) unless a renewal succeeds first.
    Leader { until: Instant },
}

/// The running elector.
pub struct Elector {
    role: watch::Receiver<Role>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Elector {
    /// Starts electing with `client` (an ungated client: Lease writes are the elector's own).
    pub fn spawn(client: Client, cfg: ElectionConfig, gate: Arc<Gate>, metrics: Arc<Metrics>) -> Elector {
        let (tx, role) = watch::channel(Role::Standby { holder: None });
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(elect(client, cfg, gate, metrics, tx, stopped));
        Elector { role, stop, task }
    }

    pub fn role(&self) -> watch::Receiver<Role> {
        self.role.clone()
    }

    /// Stops electing; a leader closes its gate and releases the Lease (fenced by resourceVersion)
    /// so a standby takes over without waiting out the lease.
    pub async fn shutdown(self) {
        let _ = self.stop.send(());
        if let Err(e) = self.task.await {
            error!("the leader elector ended abnormally: {e}");
        }
    }
}

/// The result of one round.
enum Round {
    /// We hold the Lease; the request that renewed or took it was sent at this moment.
    Holding(Stamp),
    /// Someone else holds it (or a conflict we lost). Our own identity when the record names us
    /// but is not ours to renew yet ([`takeover`]'s `own_claim`).
    Other(Option<String>),
    Failed(String),
}

/// A Lease request that failed, or got no answer in time.
#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

async fn timed<T>(limit: Duration, fut: impl Future<Output = Result<T, kube::Error>>) -> Result<T, CallError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(CallError::Timeout(limit)),
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// What the elector remembers between rounds.
#[derive(Default)]
struct Memory {
    /// A standby's view of the Lease.
    obs: Option<Observation>,
    /// The resourceVersion of the last Lease record this process wrote (unknown after a write
    /// whose answer did not come).
    written: Option<String>,
}

/// One round: read the Lease, and renew, take or create it when allowed. `leading`: our gate is
/// open (or was until its window just passed), so a record naming us is ours.
async fn round(api: &Api<Lease>, cfg: &ElectionConfig, mem: &mut Memory, leading: bool) -> Round {
    let pp = PostParams {
        field_manager: Some(CONTROLLER_FIELD_MANAGER.into()),
        ..Default::default()
    };
    let current = match timed(cfg.api_timeout, api.get_opt(&cfg.name)).await {
        Ok(l) => l,
        Err(e) => return Round::Failed(format!("reading it: {e}")),
    };
    let Some(current) = current else {
        let sent = Stamp::now();
        mem.written = None;
        return match tokio::time::timeout(cfg.api_timeout, api.create(&pp, &new_lease(cfg, sent.wall))).await {
            // Leading, we only put back a Lease deleted under us: nobody else can have opened a
            // gate since (a creator waits, below).
            Ok(Ok(created)) if leading => {
                mem.written = created.metadata.resource_version;
                Round::Holding(sent)
            }
            // A missing Lease may have been deleted under a leader whose gate is still open until
            // its next round: the new record is waited out like anyone else's before we lead.
            Ok(Ok(created)) => {
                mem.obs = Some(observe(None, &created, cfg.lease, Instant::now()));
                Round::Other(Some(cfg.identity.clone()))
            }
            Ok(Err(e)) if is_conflict(&e) => Round::Other(None),
            Ok(Err(e)) => Round::Failed(format!("creating it: {e}")),
            Err(_) => Round::Failed(format!("creating it: no answer within {:?}", cfg.api_timeout)),
        };
    };
    let seen = observe(mem.obs.as_ref(), &current, cfg.lease, Instant::now());
    let own_claim = leading || (mem.written.is_some() && mem.written == current.metadata.resource_version);
    let decision = takeover(&seen, &cfg.identity, own_claim, Instant::now());
    mem.obs = Some(seen);
    if let Takeover::Wait { holder, .. } = decision {
        return Round::Other(holder);
    }
    let sent = Stamp::now();
    mem.written = None;
    match tokio::time::timeout(
        cfg.api_timeout,
        api.replace(&cfg.name, &pp, &claimed(&current, cfg, sent.wall)),
    )
    .await
    {
        Ok(Ok(renewed)) => {
            mem.obs = None;
            mem.written = renewed.metadata.resource_version;
            Round::Holding(sent)
        }
        // Written by someone else since our read: the next round reads who.
        Ok(Err(e)) if is_conflict(&e) => Round::Other(None),
        Ok(Err(e)) => Round::Failed(format!("writing it: {e}")),
        Err(_) => Round::Failed(format!("writing it: no answer within {:?}", cfg.api_timeout)),
    }
}

async fn elect(
    client: Client,
    cfg: ElectionConfig,
    gate: Arc<Gate>,
    metrics: Arc<Metrics>,
    tx: watch::Sender<Role>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let where_ = format!("leader Lease {}/{}", cfg.namespace, cfg.name);
    let mut mem = Memory::default();
    let mut waiting_own = false;
    metrics.set_leader(&cfg.identity, false);
    info!(identity = %cfg.identity, "standing by for the {where_}");
    let step_down = |why: &str, holder: Option<String>| {
        gate.close();
        metrics.set_leader(&cfg.identity, false);
        error!("lost the {where_} ({why}): stopped writing; reconciling stops; standing by");
        tx.send_replace(Role::Standby { holder });
    };
    loop {
        let started = tokio::time::Instant::now();
        let this_round = round(&api, &cfg, &mut mem, gate.renewed_at().is_some());
        tokio::pin!(this_round);
        // A round can outlast the write window (its requests hang until their timeout): the leader
        // steps down at the window's end, not when the round gives up. A renewal of that round
        // that still succeeds was sent inside its own window, and leads again.
        let outcome = loop {
            let leading = matches!(*tx.borrow(), Role::Leader { .. });
            let deadline = gate.deadline().filter(|_| leading);
            tokio::select! {
                outcome = &mut this_round => break Some(outcome),
                // A stop ends the round under way: its requests may each take --api-timeout, and
                // the release below must fit in the pod's termination grace.
                _ = &mut stopped => break None,
                _ = tokio::time::sleep_until(deadline.map_or_else(tokio::time::Instant::now, tokio::time::Instant::from_std)),
                    if deadline.is_some() =>
                {
                    step_down("no renewal within the write window; the renewal under way is still unanswered", None);
                }
            }
        };
        let Some(outcome) = outcome else { break };
        let leading = matches!(*tx.borrow(), Role::Leader { .. });
        let next = match outcome {
            Round::Holding(sent) => {
                waiting_own = false;
                gate.renewed(sent);
                let until = gate.deadline().unwrap_or_else(|| sent.mono + cfg.write_window());
                if !leading {
                    info!(identity = %cfg.identity, "acquired the {where_}: leading; reconciling starts");
                    metrics.set_leader(&cfg.identity, true);
                }
                tx.send_replace(Role::Leader { until });
                cfg.renew_every
            }
            other => {
                let (holder, failure) = match other {
                    Round::Other(h) => (h, None),
                    Round::Failed(f) => (None, Some(f)),
                    Round::Holding(_) => unreachable!("handled above"),
                };
                if leading {
                    let still = gate.may_write_at(Stamp::now()) && holder.is_none();
                    if still {
                        let left = gate
                            .deadline()
                            .map(|d| d.saturating_duration_since(Instant::now()))
                            .unwrap_or_default();
                        warn!(
                            "renewing the {where_} failed: {}; retrying in {:?}; this controller stops \
                             writing in {:.1}s unless a renewal succeeds",
                            failure.as_deref().unwrap_or("it changed under the renewal"),
                            cfg.retry_every,
                            left.as_secs_f64()
                        );
                    } else {
                        let why = match (&holder, &failure) {
                            (Some(h), _) => format!("{h:?} holds it"),
                            (None, Some(f)) => format!("no renewal within the write window: {f}"),
                            (None, None) => "no renewal within the write window".into(),
                        };
                        step_down(&why, holder.clone());
                    }
                } else {
                    if let Some(f) = &failure {
                        warn!(
                            "standing by: the {where_} could not be checked or taken ({f}); trying again in {:?}",
                            cfg.retry_every
                        );
                    }
                    // A record naming us that is not ours to renew yet: nobody leads (so says
                    // `/readyz`) until we take it.
                    let own_record = holder.as_deref() == Some(cfg.identity.as_str());
                    if own_record && !waiting_own {
                        info!(
                            "standing by: the {where_} names this controller in a record it cannot vouch \
                             for (just created, edited, or a previous container's): it leads once that \
                             record has gone unrenewed for its duration, when any replica that led before \
                             has stopped writing"
                        );
                    }
                    waiting_own = own_record;
                    let holder = holder.filter(|_| !own_record);
                    // Compared into a bool first: a `watch::Ref` kept alive into the block would
                    // hold the channel's read lock across a later send on the same task.
                    let announced = *tx.borrow() == (Role::Standby { holder: holder.clone() });
                    if let Some(h) = &holder
                        && !announced
                    {
                        info!("standing by: {h} leads");
                    }
                    if holder.is_some() || failure.is_some() || own_record {
                        tx.send_replace(Role::Standby { holder });
                    }
                }
                cfg.retry_every
            }
        };
        // A leader whose renewals keep failing wakes at its deadline to step down on time.
        let wake = match gate.deadline() {
            Some(d) => (started + next).min(tokio::time::Instant::from_std(d).max(tokio::time::Instant::now())),
            None => started + next,
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wake) => {}
            _ = &mut stopped => break,
        }
        // Read into a bool, not matched in the `if`: the `watch::Ref` of an `if let` scrutinee
        // lives to the end of its block, and `send_replace` below waits for that very read lock
        // (a leader cut off past its window deadlocked here, found by e2e `failover-frozen`).
        let leading_now = matches!(*tx.borrow(), Role::Leader { .. });
        if leading_now && !gate.may_write_at(Stamp::now()) && gate.renewed_at().is_some() {
            // The window closed before the next round: step down now, the round below may renew.
            step_down("no renewal within the write window", None);
        }
    }
    // Shutting down.
    let was_leading = gate.renewed_at().is_some();
    gate.close();
    metrics.set_leader(&cfg.identity, false);
    if was_leading {
        release(&api, &cfg, &where_).await;
    }
    tx.send_replace(Role::Standby { holder: None });
}

/// Releases the Lease if it still names us (fenced: a 409 means someone else wrote it since).
async fn release(api: &Api<Lease>, cfg: &ElectionConfig, where_: &str) {
    let pp = PostParams {
        field_manager: Some(CONTROLLER_FIELD_MANAGER.into()),
        ..Default::default()
    };
    // Each request at most one retry period: a shutdown must end within the pod's grace, and an
    // unreleased Lease only makes the standby wait it out.
    let limit = cfg.api_timeout.min(cfg.retry_every);
    let result = async {
        let Some(current) = timed(limit, api.get_opt(&cfg.name)).await? else {
            return Ok(false);
        };
        let holder = current.spec.as_ref().and_then(|s| s.holder_identity.as_deref());
        if holder != Some(cfg.identity.as_str()) {
            return Ok(false);
        }
        timed(limit, api.replace(&cfg.name, &pp, &released(&current))).await?;
        Ok::<bool, CallError>(true)
    }
    .await;
    match result {
        Ok(true) => info!("released the {where_}: a standby takes over at once"),
        Ok(false) => info!("the {where_} no longer names this controller; nothing to release"),
        Err(e) => warn!("releasing the {where_} failed: {e}; a standby takes over when it expires"),
    }
}

#[cfg(test)]
#[path = "leader_tests.rs"]
mod tests;
