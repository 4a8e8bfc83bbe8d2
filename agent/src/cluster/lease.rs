//! The agent's own Lease: `coordination.k8s.io/v1` `tartan-agent-<agent id>` in the configured
//! namespace, `spec.holderIdentity = <agent id>` and label `tartan.dev/agent=<agent id>` (the
//! controller's convention, `controller/src/view.rs`).
//!
//! The Lease tells the controller that this agent is alive; it is not leader election. It is
//! created if absent and renewed every `renew_every` (5 s) with `leaseDurationSeconds` =
//! `duration` (20 s), each renewal a merge patch carrying the `metadata.resourceVersion` last seen,
//! so a write based on a stale read gets 409. After a 409 the Lease is read again: still ours (or
//! held by nobody) → renewed with the fresh resourceVersion; held by someone else → not ours, the
//! agent reports it and stops claiming, and keeps checking without writing.
//!
//! [`LeaseState::can_claim`] is the agent's own fence: it turns false once no renewal has
//! succeeded for `duration` (counted from the moment the last successful request was sent, so never
//! later than the API's view of expiry), and true again after the next successful renewal. It
//! counts on both clocks: the monotonic one (immune to wall-clock steps) and the wall clock, because
//! a Mac's monotonic clock stands still while it sleeps, while the Lease's `renewTime` and the
//! controller that reads it live on wall clocks: after a sleep longer than `duration` the Lease is
//! expired for the cluster, and the monotonic clock alone would still call it fresh. **It only gates claiming new MacBuilds: builds already running are never
//! stopped because renewals fail** — an expired Lease proves nothing about the VM, and the
//! controller handles an unreachable host on its side (HostUnreachable, timeout + grace).

use super::{CallError, patch_params, timed};
use crate::cluster::placement::WARM_ANNOTATION;
use crate::config::Config;
use crate::host::disk::DISK_PRESSURE_ANNOTATION;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, Patch, PostParams};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;
use tartan_api::AGENT_LABEL;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Prefix of every agent Lease's name (the controller's `LEASE_PREFIX`).
pub const LEASE_PREFIX: &str = "tartan-agent-";

/// The Lease name of `agent_id`.
pub fn lease_name(agent_id: &str) -> String {
    format!("{LEASE_PREFIX}{agent_id}")
}

/// What the Lease keeper needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    pub agent_id: String,
    pub namespace: String,
    /// Renewal period (5 s).
    pub renew_every: Duration,
    /// `leaseDurationSeconds`, and the self-fence on the monotonic clock (20 s).
    pub duration: Duration,
    /// Limit of one API request; shorter than `renew_every`.
    pub api_timeout: Duration,
}

impl LeaseConfig {
    pub fn from_config(config: &Config) -> LeaseConfig {
        LeaseConfig {
            agent_id: config.agent_id.clone(),
            namespace: config.lease_namespace.clone(),
            renew_every: config.timing.lease_renew,
            duration: config.timing.lease_duration,
            api_timeout: config.timing.api_timeout,
        }
    }

    pub fn name(&self) -> String {
        lease_name(&self.agent_id)
    }

    fn duration_seconds(&self) -> i32 {
        i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX).max(1)
    }
}

/// What the keeper knows about the Lease, published on a watch channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseState {
    /// When the last successful create/renew request was sent (monotonic clock).
    pub last_renewed: Option<Instant>,
    /// The same moment on the wall clock (the clock of the Lease's `renewTime`).
    pub last_renewed_wall: Option<Timestamp>,
    /// The Lease duration the fence uses.
    pub duration: Duration,
    /// A Lease under our name held by someone else: not ours, so no claiming until it is ours again.
    pub held_by_other: Option<String>,
    /// Successful creates and renewals so far.
    pub renewals: u64,
    /// 409s seen (each followed by a fresh read).
    pub conflicts: u64,
    /// The last failure, cleared by the next success.
    pub last_error: Option<String>,
}

impl LeaseState {
    fn new(duration: Duration) -> LeaseState {
        LeaseState {
            last_renewed: None,
            last_renewed_wall: None,
            duration,
            held_by_other: None,
            renewals: 0,
            conflicts: 0,
            last_error: None,
        }
    }

    /// When the agent stops claiming unless a renewal succeeds first.
    pub fn expires_at(&self) -> Option<Instant> {
        self.last_renewed.and_then(|t| t.checked_add(self.duration))
    }

    /// Whether the agent may claim new MacBuilds at `now` (and now on the wall clock): see
    /// [`LeaseState::fresh_at`]. Running builds are not affected either way.
    pub fn can_claim(&self, now: Instant) -> bool {
        self.fresh_at(now, Timestamp::now())
    }

    /// Whether the Lease is ours and a renewal succeeded less than `duration` ago on the monotonic
    /// clock (`now`) and on the wall clock (`wall`): after the Mac slept, the monotonic clock has
    /// not counted the sleep, the wall clock has.
    pub fn fresh_at(&self, now: Instant, wall: Timestamp) -> bool {
        self.held_by_other.is_none()
            && self.last_renewed.is_some_and(|at| {
                tartan_api::lease_clock::within(
                    at.into_std(),
                    self.last_renewed_wall,
                    self.duration,
                    now.into_std(),
                    wall,
                )
            })
    }
}

/// Who holds a Lease, as seen from this agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    Us,
    /// No `holderIdentity` (released or never set): free to take.
    Nobody,
    Other(String),
}

/// Who holds `lease`.
pub fn holder_of(lease: &Lease, agent_id: &str) -> Holder {
    match lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) {
        None | Some("") => Holder::Nobody,
        Some(h) if h == agent_id => Holder::Us,
        Some(h) => Holder::Other(h.to_string()),
    }
}

/// What the agent publishes on its Lease besides the renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Published<'a> {
    /// Its images once listed, and what [`placement`](super::placement) reads from other agents'
    /// Leases; each key replaces the Lease's value (others are left as they are).
    pub annotations: &'a BTreeMap<String, String>,
    /// The value of [`DISK_PRESSURE_ANNOTATION`] while the disk is below the floor; `None`
    /// removes the annotation.
    pub disk_pressure: Option<&'a str>,
}

/// The Lease to create when none exists, with the annotations of `published`.
pub fn new_lease(cfg: &LeaseConfig, now: Timestamp, published: Published<'_>) -> Lease {
    let mut annotations = published.annotations.clone();
    if let Some(pressure) = published.disk_pressure {
        annotations.insert(DISK_PRESSURE_ANNOTATION.to_string(), pressure.to_string());
    }
    Lease {
        metadata: ObjectMeta {
            name: Some(cfg.name()),
            namespace: Some(cfg.namespace.clone()),
            labels: Some(BTreeMap::from([(AGENT_LABEL.to_string(), cfg.agent_id.clone())])),
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(cfg.agent_id.clone()),
            lease_duration_seconds: Some(cfg.duration_seconds()),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(0),
            ..Default::default()
        }),
    }
}

/// The renewal: a merge patch fenced by `resource_version` (stale → 409). `taking_over` (the Lease
/// had no holder) also sets `acquireTime` and counts a transition. Each of `published`'s
/// annotations replaces the Lease's value of that key (others are left as they are), so they are as
/// fresh as the renewal; [`DISK_PRESSURE_ANNOTATION`] is set while the disk is below the floor and
/// removed (`null`) otherwise, and [`WARM_ANNOTATION`] removed when not published.
pub fn renew_patch(
    cfg: &LeaseConfig,
    resource_version: &str,
    now: Timestamp,
    taking_over: Option<&Lease>,
    published: Published<'_>,
) -> serde_json::Value {
    let mut spec = json!({
        "holderIdentity": cfg.agent_id,
        "leaseDurationSeconds": cfg.duration_seconds(),
        "renewTime": MicroTime(now),
    });
    if let Some(old) = taking_over {
        let transitions = old.spec.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0);
        spec["acquireTime"] = json!(MicroTime(now));
        spec["leaseTransitions"] = json!(transitions.saturating_add(1));
    }
    let mut patch = json!({
        "metadata": {
            "resourceVersion": resource_version,
            "labels": {AGENT_LABEL: cfg.agent_id},
        },
        "spec": spec,
    });
    patch["metadata"]["annotations"] = json!(published.annotations);
    patch["metadata"]["annotations"][DISK_PRESSURE_ANNOTATION] = json!(published.disk_pressure);
    // The warm images are published only while a warm VM is ready: removed (`null`) otherwise,
    // or peers would go on leaving this host builds it no longer has a warm VM for.
    if !published.annotations.contains_key(WARM_ANNOTATION) {
        patch["metadata"]["annotations"][WARM_ANNOTATION] = serde_json::Value::Null;
    }
    patch
}

/// Why one renewal round did not renew.
#[derive(Debug)]
enum RoundError {
    HeldBy(String),
    Failed(String),
}

/// Keeps the Lease; dropping the handle does not stop it, [`LeaseKeeper::stop`] does.
pub struct LeaseKeeper {
    state: watch::Receiver<LeaseState>,
    task: JoinHandle<()>,
}

impl LeaseKeeper {
    /// Starts creating/renewing the Lease on the current tokio runtime.
    pub fn spawn(client: kube::Client, cfg: LeaseConfig) -> LeaseKeeper {
        let (_, annotations) = watch::channel(BTreeMap::new());
        let (_, disk_pressure) = watch::channel(None);
        LeaseKeeper::spawn_publishing(client, cfg, annotations, disk_pressure)
    }

    /// [`LeaseKeeper::spawn`], publishing with every renewal the latest value of `annotations`
    /// and of `disk_pressure` (`None` while the disk is above the floor).
    pub fn spawn_publishing(
        client: kube::Client,
        cfg: LeaseConfig,
        annotations: watch::Receiver<BTreeMap<String, String>>,
        disk_pressure: watch::Receiver<Option<String>>,
    ) -> LeaseKeeper {
        let (tx, state) = watch::channel(LeaseState::new(cfg.duration));
        let task = tokio::spawn(run(client, cfg, tx, annotations, disk_pressure));
        LeaseKeeper { state, task }
    }

    /// The state channel (it changes on every renewal, failure and conflict).
    pub fn state(&self) -> watch::Receiver<LeaseState> {
        self.state.clone()
    }

    /// [`LeaseState::can_claim`] now.
    pub fn can_claim(&self) -> bool {
        self.state.borrow().can_claim(Instant::now())
    }

    /// Stops renewing (the Lease then expires on its own, telling the controller).
    pub fn stop(self) {
        self.task.abort();
    }
}

async fn run(
    client: kube::Client,
    cfg: LeaseConfig,
    tx: watch::Sender<LeaseState>,
    annotations: watch::Receiver<BTreeMap<String, String>>,
    disk_pressure: watch::Receiver<Option<String>>,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let where_ = format!("Lease {}/{}", cfg.namespace, cfg.name());
    let mut known: Option<Lease> = None;
    loop {
        let started = Instant::now();
        let started_wall = Timestamp::now();
        // The whole round (at most a few requests) fits in one period.
        let annotations = annotations.borrow().clone();
        let disk_pressure = disk_pressure.borrow().clone();
        let published = Published {
            annotations: &annotations,
            disk_pressure: disk_pressure.as_deref(),
        };
        let round = tokio::time::timeout(cfg.renew_every, round(&api, &cfg, &mut known, &tx, published)).await;
        match round {
            Ok(Ok(())) => {
                let was_failing = tx.borrow().last_error.is_some() || tx.borrow().held_by_other.is_some();
                if was_failing {
                    tracing::info!("{where_} renewed again; claiming new builds resumes");
                }
                tx.send_modify(|s| {
                    s.last_renewed = Some(started);
                    s.last_renewed_wall = Some(started_wall);
                    s.renewals += 1;
                    s.held_by_other = None;
                    s.last_error = None;
                });
            }
            Ok(Err(RoundError::HeldBy(other))) => {
                if tx.borrow().held_by_other.as_deref() != Some(other.as_str()) {
                    tracing::error!(
                        "{where_} is held by {other:?}, not by this agent ({:?}): claiming no new builds \
                         (running builds go on); checking again every {:?}",
                        cfg.agent_id,
                        cfg.renew_every
                    );
                }
                known = None;
                tx.send_modify(|s| {
                    s.held_by_other = Some(other.clone());
                    s.last_error = Some(format!("{where_} is held by {other:?}"));
                });
            }
            failed @ (Ok(Err(RoundError::Failed(_))) | Err(_)) => {
                let detail = match failed {
                    Ok(Err(RoundError::Failed(detail))) => detail,
                    _ => format!("no renewal within {:?}", cfg.renew_every),
                };
                let state = tx.borrow().clone();
                let next = match state.expires_at() {
                    Some(expiry) if expiry > Instant::now() => format!(
                        "new builds stop being claimed in {:.1}s unless a renewal succeeds",
                        (expiry - Instant::now()).as_secs_f64()
                    ),
                    _ => "claiming no new builds until a renewal succeeds (running builds go on)".to_string(),
                };
                tracing::warn!(
                    "renewing {where_} failed: {detail}; retrying in {:?}; {next}",
                    cfg.renew_every
                );
                known = None;
                tx.send_modify(|s| s.last_error = Some(detail));
            }
        }
        tokio::time::sleep_until(started + cfg.renew_every).await;
    }
}

/// One renewal: read if needed, create if absent, renew with the resourceVersion fence; after a
/// 409, read again and retry once if the Lease is still ours.
async fn round(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    known: &mut Option<Lease>,
    tx: &watch::Sender<LeaseState>,
    published: Published<'_>,
) -> Result<(), RoundError> {
    let name = cfg.name();
    let failed = |what: &str, e: CallError| RoundError::Failed(format!("{what}: {e}"));
    for _ in 0..3 {
        let lease = match known.take() {
            Some(lease) => lease,
            None => match timed(cfg.api_timeout, api.get_opt(&name)).await {
                Ok(Some(lease)) => lease,
                Ok(None) => {
                    match timed(
                        cfg.api_timeout,
                        api.create(&PostParams::default(), &new_lease(cfg, Timestamp::now(), published)),
                    )
                    .await
                    {
                        Ok(created) => {
                            *known = Some(created);
                            return Ok(());
                        }
                        // Created meanwhile (by whom, the next read says).
                        Err(e) if e.code() == Some(409) => continue,
                        Err(e) => return Err(failed("creating it", e)),
                    }
                }
                Err(e) => return Err(failed("reading it", e)),
            },
        };
        let taking_over = match holder_of(&lease, &cfg.agent_id) {
            Holder::Us => None,
            Holder::Nobody => Some(&lease),
            Holder::Other(other) => return Err(RoundError::HeldBy(other)),
        };
        let Some(rv) = lease.metadata.resource_version.as_deref() else {
            return Err(RoundError::Failed(
                "the API returned the Lease without a resourceVersion".into(),
            ));
        };
        let patch = renew_patch(cfg, rv, Timestamp::now(), taking_over, published);
        match timed(
            cfg.api_timeout,
            api.patch(&name, &patch_params(), &Patch::Merge(&patch)),
        )
        .await
        {
            Ok(renewed) => {
                *known = Some(renewed);
                return Ok(());
            }
            Err(e) if e.code() == Some(409) => {
                // Someone else wrote it since we read it: read again and look who holds it.
                tx.send_modify(|s| s.conflicts += 1);
                tracing::debug!("Lease {name}: resourceVersion {rv} is stale (409); reading it again");
            }
            // Deleted meanwhile: the next pass creates it again.
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(failed("renewing it", e)),
        }
    }
    Err(RoundError::Failed(
        "the Lease kept changing under the renewal (3 tries in one period)".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::placement::IMAGES_ANNOTATION;

    fn images(value: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(IMAGES_ANNOTATION.to_string(), value.to_string())])
    }

    fn publish(annotations: &BTreeMap<String, String>) -> Published<'_> {
        Published {
            annotations,
            disk_pressure: None,
        }
    }

    fn cfg() -> LeaseConfig {
        LeaseConfig {
            agent_id: "mac-mini-07".into(),
            namespace: "default".into(),
            renew_every: Duration::from_secs(5),
            duration: Duration::from_secs(20),
            api_timeout: Duration::from_secs(4),
        }
    }

    #[test]
    fn name_and_new_lease_follow_the_controllers_convention() {
        assert_eq!(lease_name("mac-mini-07"), "tartan-agent-mac-mini-07");
        let now: Timestamp = "2026-10-05T02:54:20.123456Z".parse().unwrap();
        let none = BTreeMap::new();
        let lease = new_lease(&cfg(), now, publish(&none));
        assert_eq!(lease.metadata.name.as_deref(), Some("tartan-agent-mac-mini-07"));
        assert_eq!(lease.metadata.annotations, None);
        let listed = new_lease(&cfg(), now, publish(&images(r#"["ghcr.io/x/y:16"]"#)));
        assert_eq!(listed.metadata.annotations.unwrap(), images(r#"["ghcr.io/x/y:16"]"#));
        let pressed = new_lease(
            &cfg(),
            now,
            Published {
                annotations: &none,
                disk_pressure: Some(r#"{"minFreeBytes":1}"#),
            },
        );
        assert_eq!(
            pressed.metadata.annotations.unwrap(),
            BTreeMap::from([(
                DISK_PRESSURE_ANNOTATION.to_string(),
                r#"{"minFreeBytes":1}"#.to_string()
            )])
        );
        assert_eq!(lease.metadata.labels.as_ref().unwrap()[AGENT_LABEL], "mac-mini-07");
        let spec = lease.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("mac-mini-07"));
        assert_eq!(spec.lease_duration_seconds, Some(20));
        assert_eq!(spec.renew_time, Some(MicroTime(now)));
        assert_eq!(spec.acquire_time, Some(MicroTime(now)));
    }

    #[test]
    fn renew_patch_carries_the_resource_version_and_micro_time() {
        let now: Timestamp = "2026-10-05T02:54:20.123456Z".parse().unwrap();
        let none = BTreeMap::new();
        let p = renew_patch(&cfg(), "4711", now, None, publish(&none));
        assert_eq!(
            p["metadata"]["annotations"],
            json!({DISK_PRESSURE_ANNOTATION: null, WARM_ANNOTATION: null}),
            "images not listed yet: left as they are; no disk pressure, no warm VM: those are removed"
        );
        let listed = images("[]");
        let with = renew_patch(
            &cfg(),
            "4711",
            now,
            None,
            Published {
                annotations: &listed,
                disk_pressure: Some("{}"),
            },
        );
        assert_eq!(
            with["metadata"]["annotations"],
            json!({IMAGES_ANNOTATION: "[]", DISK_PRESSURE_ANNOTATION: "{}", WARM_ANNOTATION: null})
        );
        assert_eq!(p["metadata"]["resourceVersion"], "4711");
        assert_eq!(p["metadata"]["labels"][AGENT_LABEL], "mac-mini-07");
        assert_eq!(p["spec"]["holderIdentity"], "mac-mini-07");
        assert_eq!(p["spec"]["leaseDurationSeconds"], 20);
        assert_eq!(p["spec"]["renewTime"], "2026-10-05T02:54:20.123456Z");
        assert!(p["spec"].get("acquireTime").is_none());

        let mut released = new_lease(&cfg(), now, publish(&none));
        let spec = released.spec.as_mut().unwrap();
        spec.holder_identity = None;
        spec.lease_transitions = Some(3);
        let p = renew_patch(&cfg(), "4712", now, Some(&released), publish(&none));
        assert_eq!(p["spec"]["acquireTime"], "2026-10-05T02:54:20.123456Z");
        assert_eq!(p["spec"]["leaseTransitions"], 4);
    }

    #[test]
    fn holder_is_us_nobody_or_someone_else() {
        let mut lease = new_lease(&cfg(), Timestamp::UNIX_EPOCH, publish(&BTreeMap::new()));
        assert_eq!(holder_of(&lease, "mac-mini-07"), Holder::Us);
        assert_eq!(holder_of(&lease, "other"), Holder::Other("mac-mini-07".into()));
        lease.spec.as_mut().unwrap().holder_identity = Some(String::new());
        assert_eq!(holder_of(&lease, "mac-mini-07"), Holder::Nobody);
        lease.spec = None;
        assert_eq!(holder_of(&lease, "mac-mini-07"), Holder::Nobody);
    }

    #[test]
    fn can_claim_follows_the_monotonic_clock() {
        let t0 = Instant::now();
        let mut s = LeaseState::new(Duration::from_secs(20));
        assert!(!s.can_claim(t0), "never renewed");
        s.last_renewed = Some(t0);
        assert!(s.can_claim(t0));
        assert!(s.can_claim(t0 + Duration::from_millis(19_999)));
        assert!(!s.can_claim(t0 + Duration::from_secs(20)));
        assert_eq!(s.expires_at(), Some(t0 + Duration::from_secs(20)));
        // A renewal brings it back.
        s.last_renewed = Some(t0 + Duration::from_secs(25));
        assert!(s.can_claim(t0 + Duration::from_secs(30)));
        // Another holder stops claiming at once, however fresh the last renewal.
        s.held_by_other = Some("intruder".into());
        assert!(!s.can_claim(t0 + Duration::from_secs(25)));
    }

    #[test]
    fn a_sleep_the_monotonic_clock_did_not_count_still_expires_the_fence() {
        let (t0, w0) = (Instant::now(), Timestamp::now());
        let secs = |n: i64| k8s_openapi::jiff::SignedDuration::from_secs(n);
        let mut s = LeaseState::new(Duration::from_secs(20));
        s.last_renewed = Some(t0);
        s.last_renewed_wall = Some(w0);
        assert!(s.fresh_at(t0 + Duration::from_secs(19), w0 + secs(19)));
        // The Mac slept an hour: 1 s passed on the monotonic clock, an hour on the wall clock
        // (and for the controller, which sees the Lease expired).
        assert!(!s.fresh_at(t0 + Duration::from_secs(1), w0 + secs(3600)));
        // A wall clock stepped back does not extend the fence either.
        assert!(!s.fresh_at(t0 + Duration::from_secs(20), w0 - secs(60)));
        // The next renewal brings it back.
        s.last_renewed = Some(t0 + Duration::from_secs(2));
        s.last_renewed_wall = Some(w0 + secs(3601));
        assert!(s.fresh_at(t0 + Duration::from_secs(3), w0 + secs(3602)));
    }
}
