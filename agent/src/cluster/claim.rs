//! Claiming a MacBuild, and its finalizer.
//!
//! # Order of the writes, and why a crash anywhere is safe
//!
//! 1. **Claim** (status subresource, fenced): the first claim tests `metadata.resourceVersion`
//!    (any write since our read fails it: 422), a later claim by the same agent (attempt n+1)
//!    tests `status.claim.holder` and `status.claim.attempt` of attempt n. The claim sets
//!    `status.claim {holder, attempt "<name>#<n>", epoch}`, phase `Pending` and a message.
//! 2. **Finalizer and agent label** (main resource; the status subresource cannot write metadata):
//!    a JSON patch testing the resourceVersion read in step 1 *and* our claim, adding
//!    `tartan.dev/vm-cleanup` and `tartan.dev/agent=<agent id>`.
//! 3. Only after [`ClaimOutcome::Won`] does the caller journal `Admitted`, write the deadline file
//!    and clone.
//!
//! A crash between 1 and 2 leaves a MacBuild that names us but has no finalizer — and no VM, since
//! nothing is cloned before step 2 succeeded; deleting it then leaks nothing. [`claim`] is
//! idempotent: called again for the same attempt it sees its own claim and only adds what is
//! missing. The other order (finalizer first) would leave, after a crash or a lost race, a
//! finalizer on a build we do not hold, blocking its deletion with nobody to remove it.
//!
//! The finalizer is removed by [`release`] only when the caller says the VM is confirmed gone,
//! with a `test` on the finalizer's index so a concurrent change to the list cannot make us remove
//! someone else's entry.

use super::{CallError, op_add, op_remove, op_replace, op_test, patch_params, timed};
use crate::record::BuildRef;
use json_patch::Patch as JsonPatch;
use kube::api::{Api, Patch};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;
use tartan_api::{AGENT_LABEL, Claim, FINALIZER, MacBuild, Phase, attempt_id, parse_attempt_id};

/// Why this agent does not claim a MacBuild (see [`claimable`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotClaimable {
    /// Its namespace is not one the agent serves.
    NamespaceNotServed,
    /// `spec.hostSelector` asks for a label this host lacks (or has with another value).
    HostSelector { key: String },
    /// Someone holds it already.
    Claimed { holder: String },
    /// It is being deleted.
    Deleting,
    /// Cancellation was requested.
    Cancelled,
    /// It already finished.
    Finished(Phase),
    /// Its status lists `attempts` attempts (its claim was reset to hand it on) and `maxAttempts`
    /// allows no further one.
    AttemptsUsed { attempts: u32, max: u32 },
}

/// Whether an agent with `host_labels`, serving `namespaces` (empty = all), may make the first
/// claim on `mb`.
pub fn claimable(
    mb: &MacBuild,
    host_labels: &BTreeMap<String, String>,
    namespaces: &[String],
) -> Result<(), NotClaimable> {
    let ns = mb.metadata.namespace.as_deref().unwrap_or_default();
    if !namespaces.is_empty() && !namespaces.iter().any(|n| n == ns) {
        return Err(NotClaimable::NamespaceNotServed);
    }
    if let Some((key, _)) = mb
        .spec
        .host_selector
        .iter()
        .find(|(k, v)| host_labels.get(*k) != Some(*v))
    {
        return Err(NotClaimable::HostSelector { key: key.clone() });
    }
    open_for_first_claim(mb)
}

/// Not deleting, not cancelled, not claimed, not finished.
fn open_for_first_claim(mb: &MacBuild) -> Result<(), NotClaimable> {
    if mb.metadata.deletion_timestamp.is_some() {
        return Err(NotClaimable::Deleting);
    }
    if mb.spec.cancel_requested {
        return Err(NotClaimable::Cancelled);
    }
    let status = mb.status.as_ref();
    if let Some(claim) = status.and_then(|s| s.claim.as_ref())
        && !claim.holder.is_empty()
    {
        return Err(NotClaimable::Claimed {
            holder: claim.holder.clone(),
        });
    }
    if let Some(phase) = status.and_then(|s| s.phase)
        && phase.is_terminal()
    {
        return Err(NotClaimable::Finished(phase));
    }
    let next = first_attempt_number(mb);
    if next > mb.spec.max_attempts {
        return Err(NotClaimable::AttemptsUsed {
            attempts: next - 1,
            max: mb.spec.max_attempts,
        });
    }
    Ok(())
}

/// The attempt number a first claim on `mb` makes: 1, or one past the highest attempt its status
/// lists when an earlier holder's claim was reset to hand the build on. The earlier attempt may
/// still run on its (unreachable) host, so its number and VM name are never reused, and it counts
/// against `maxAttempts`.
pub fn first_attempt_number(mb: &MacBuild) -> u32 {
    let listed = mb.status.as_ref().map(|s| s.attempts.as_slice()).unwrap_or_default();
    listed.iter().map(|a| a.number).max().map_or(1, |n| n.saturating_add(1))
}

/// The claim `holder` makes for attempt `attempt` of `mb`: epoch 1 for attempt 1, else one more
/// than the current claim's epoch.
pub fn claim_for(mb: &MacBuild, holder: &str, attempt: u32) -> Claim {
    let current = mb.status.as_ref().and_then(|s| s.claim.as_ref());
    let id = attempt_id(&name(mb), attempt);
    // Already made (claiming again after a crash): the claim is the one the MacBuild shows.
    if let Some(c) = current.filter(|c| c.holder == holder && c.attempt == id) {
        return c.clone();
    }
    Claim {
        holder: holder.to_string(),
        attempt: id,
        epoch: if attempt <= 1 {
            1
        } else {
            // An epoch the cluster shows at its limit (the apiserver holds int64) stays there: the
            // claim's test fences on holder and attempt anyway.
            current.map_or(attempt.into(), |c| c.epoch.saturating_add(1).min(i64::MAX as u64))
        },
    }
}

fn name(mb: &MacBuild) -> String {
    mb.metadata.name.clone().unwrap_or_default()
}

fn claim_message(claim: &Claim) -> String {
    format!(
        "claimed by {} for attempt {}; admitting it",
        claim.holder, claim.attempt
    )
}

/// The first claim: `test` the resourceVersion read, then `add` the claim (the whole `/status`
/// if there is none yet; `add`, not `replace`, since `replace` needs the path to exist).
pub fn first_claim_patch(mb: &MacBuild, claim: &Claim) -> JsonPatch {
    let rv = mb.metadata.resource_version.clone().unwrap_or_default();
    let mut ops = vec![op_test(&["metadata", "resourceVersion"], json!(rv))];
    if mb.status.is_none() {
        ops.push(op_add(
            &["status"],
            json!({"claim": claim, "phase": Phase::Pending, "message": claim_message(claim)}),
        ));
    } else {
        ops.push(op_add(&["status", "claim"], json!(claim)));
        ops.push(op_add(&["status", "phase"], json!(Phase::Pending)));
        ops.push(op_add(&["status", "message"], json!(claim_message(claim))));
    }
    JsonPatch(ops)
}

/// A later claim by the same agent: `test` that `previous` (holder and attempt) is still the
/// claim, then move the claim on.
pub fn next_claim_patch(uid: &str, previous: &Claim, next: &Claim) -> JsonPatch {
    JsonPatch(vec![
        op_test(&["metadata", "uid"], json!(uid)),
        op_test(&["status", "claim", "holder"], json!(previous.holder)),
        op_test(&["status", "claim", "attempt"], json!(previous.attempt)),
        op_replace(&["status", "claim"], json!(next)),
        op_add(&["status", "phase"], json!(Phase::Pending)),
        op_add(&["status", "message"], json!(claim_message(next))),
    ])
}

/// Adds the finalizer and the agent label, testing the resourceVersion and our claim; `None` if
/// both are there already.
pub fn finalizer_patch(mb: &MacBuild, claim: &Claim) -> Option<JsonPatch> {
    let meta = &mb.metadata;
    let finalizers = meta.finalizers.as_deref().unwrap_or_default();
    let has_finalizer = finalizers.iter().any(|f| f == FINALIZER);
    let labels = meta.labels.as_ref();
    let has_label = labels.and_then(|l| l.get(AGENT_LABEL)) == Some(&claim.holder);
    if has_finalizer && has_label {
        return None;
    }
    let rv = meta.resource_version.clone().unwrap_or_default();
    let mut ops = vec![
        op_test(&["metadata", "resourceVersion"], json!(rv)),
        op_test(&["status", "claim", "holder"], json!(claim.holder)),
        op_test(&["status", "claim", "attempt"], json!(claim.attempt)),
    ];
    if !has_finalizer {
        ops.push(match meta.finalizers {
            None => op_add(&["metadata", "finalizers"], json!([FINALIZER])),
            Some(_) => op_add(&["metadata", "finalizers", "-"], json!(FINALIZER)),
        });
    }
    if !has_label {
        ops.push(match labels {
            None => op_add(&["metadata", "labels"], json!({AGENT_LABEL: claim.holder})),
            Some(_) => op_add(&["metadata", "labels", AGENT_LABEL], json!(claim.holder)),
        });
    }
    Some(JsonPatch(ops))
}

/// Removes `holder`'s finalizer, testing the resourceVersion read (so that a claim made since,
/// which relies on the same finalizer, fails the patch) and that the finalizer is still at the
/// index we saw. `None` if the finalizer is gone, or if the MacBuild is claimed by another holder:
/// the build was handed on, and the finalizer now keeps that holder's VM.
pub fn finalizer_removal_patch(mb: &MacBuild, holder: &str) -> Option<JsonPatch> {
    let index = mb.metadata.finalizers.as_ref()?.iter().position(|f| f == FINALIZER)?;
    if claimed_by_another(mb, holder).is_some() {
        return None;
    }
    let index = index.to_string();
    let rv = mb.metadata.resource_version.clone().unwrap_or_default();
    Some(JsonPatch(vec![
        op_test(&["metadata", "resourceVersion"], json!(rv)),
        op_test(&["metadata", "finalizers", &index], json!(FINALIZER)),
        op_remove(&["metadata", "finalizers", &index]),
    ]))
}

/// The holder of `mb`'s claim, if it is someone other than `holder`.
fn claimed_by_another<'a>(mb: &'a MacBuild, holder: &str) -> Option<&'a str> {
    let claim = mb.status.as_ref()?.claim.as_ref()?;
    (!claim.holder.is_empty() && claim.holder != holder).then_some(claim.holder.as_str())
}

/// What a claim came to.
#[derive(Clone, Debug, PartialEq)]
pub enum ClaimOutcome {
    /// We hold the claim and the finalizer is on; the MacBuild as the API returned it.
    Won { claim: Claim, macbuild: Box<MacBuild> },
    /// Someone else got there first (or the build changed or went away): journal `ClaimLost` and
    /// clone nothing.
    Lost { reason: String },
}

/// A claim or release that could not be completed; nothing is known to be lost. Try again later;
/// never clone after an error.
#[derive(Debug, thiserror::Error)]
#[error("{action} MacBuild {build} failed: {detail}; nothing is cloned, it will be tried again")]
pub struct ClaimError {
    pub action: &'static str,
    pub build: String,
    pub detail: String,
}

fn build_of(mb: &MacBuild) -> String {
    format!("{}/{}", mb.metadata.namespace.as_deref().unwrap_or_default(), name(mb))
}

fn is_ours(mb: &MacBuild, claim: &Claim) -> bool {
    mb.status
        .as_ref()
        .and_then(|s| s.claim.as_ref())
        .is_some_and(|c| c.holder == claim.holder && c.attempt == claim.attempt)
}

fn describe_claim(mb: &MacBuild) -> String {
    match mb.status.as_ref().and_then(|s| s.claim.as_ref()) {
        Some(c) => format!("claimed by {} for {} (epoch {})", c.holder, c.attempt, c.epoch),
        None => "not claimed".into(),
    }
}

/// How many times a first claim is written when writes by others keep failing its test.
const FIRST_CLAIM_TRIES: u32 = 3;

/// What a 409/422 on a claim means, from the MacBuild as read before the write and as read after.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AfterConflict {
    /// Our claim is there (an earlier answer was lost in transit).
    Won,
    /// Nothing changed, so no test failed: the write itself was refused (an admission policy).
    Refused,
    /// Someone else claimed it, or it changed so that this claim no longer applies.
    Lost(String),
    /// Only something else changed (a label, a message): still open for this very first claim,
    /// so claim it again on the fresh read (for the finalizer: add it again on the fresh read).
    ClaimAgain,
}

/// The decision after a 409/422 on the claim of `attempt` (`first`: a first claim, fenced on the
/// resourceVersion) that `read` was the basis of, `fresh` the build as it is now.
pub fn after_claim_conflict(
    read: &MacBuild,
    fresh: &MacBuild,
    wanted: &Claim,
    attempt: u32,
    first: bool,
) -> AfterConflict {
    if fresh.metadata.uid != read.metadata.uid {
        return AfterConflict::Lost("the MacBuild was deleted and created again".into());
    }
    if is_ours(fresh, wanted) {
        return AfterConflict::Won;
    }
    if fresh.metadata.resource_version == read.metadata.resource_version {
        return AfterConflict::Refused;
    }
    // The attempt number is journaled already: a build handed on meanwhile needs another one.
    if first && open_for_first_claim(fresh).is_ok() && first_attempt_number(fresh) == attempt {
        return AfterConflict::ClaimAgain;
    }
    AfterConflict::Lost(format!("it is now {}", describe_claim(fresh)))
}

/// The decision after a 409/422 on adding the finalizer to `current` (which showed our claim
/// `wanted`), `fresh` the build as it is now: `ClaimAgain` means add it again on `fresh`. A
/// MacBuild deleted and created again under the same name is lost even if it shows a claim just
/// like ours (this agent may have claimed the new one meanwhile, whose attempt id is the same):
/// winning it would run a second VM for that build under the old one's uid.
pub fn after_finalizer_conflict(current: &MacBuild, fresh: &MacBuild, wanted: &Claim) -> AfterConflict {
    if fresh.metadata.uid != current.metadata.uid {
        return AfterConflict::Lost("the MacBuild was deleted and created again before the finalizer was added".into());
    }
    if !is_ours(fresh, wanted) {
        return AfterConflict::Lost(format!(
            "the claim changed before the finalizer was added: {}",
            describe_claim(fresh)
        ));
    }
    if fresh.metadata.resource_version == current.metadata.resource_version {
        return AfterConflict::Refused;
    }
    AfterConflict::ClaimAgain
}

/// Claims attempt `attempt` of `mb` (as last read) for `holder`, then adds the finalizer and agent
/// label. Attempt 1 needs an unclaimed build; attempt n > 1 needs our own claim of attempt n−1.
/// Idempotent: if `mb` already shows this claim, it is confirmed on a fresh read (`mb` may be old,
/// the build handed on since) and only the missing metadata is added.
///
/// 409/422 are resolved by reading the MacBuild again ([`after_claim_conflict`]): our claim there
/// → won (an earlier answer was lost in transit); someone else's claim, a hand-over or deletion →
/// lost; still unclaimed after another write → the first claim is made again on the fresh read (at
/// most [`FIRST_CLAIM_TRIES`] writes in all); the same resourceVersion and no claim → the write
/// was refused (e.g. by an admission policy) → [`ClaimError`].
pub async fn claim(
    client: &kube::Client,
    api_timeout: Duration,
    mb: &MacBuild,
    holder: &str,
    attempt: u32,
) -> Result<ClaimOutcome, ClaimError> {
    let ns = mb.metadata.namespace.clone().unwrap_or_default();
    let call = ClaimCall {
        api: Api::namespaced(client.clone(), &ns),
        api_timeout,
        build: build_of(mb),
        name: name(mb),
    };
    let (current, wanted) = match write_claim(&call, mb, holder, attempt).await? {
        ClaimWrite::Ours { current, wanted } => (current, wanted),
        ClaimWrite::Lost(reason) => return Ok(ClaimOutcome::Lost { reason }),
    };
    add_finalizer(&call, *current, wanted).await
}

/// What the calls of one [`claim`] share: the API, its timeout, and the build's names.
struct ClaimCall {
    api: Api<MacBuild>,
    api_timeout: Duration,
    build: String,
    name: String,
}

impl ClaimCall {
    fn err(&self, action: &'static str, detail: String) -> ClaimError {
        ClaimError {
            action,
            build: self.build.clone(),
            detail,
        }
    }

    /// After a 409/422 on `write`: the MacBuild as it is now (`None`: deleted).
    async fn reread(&self, action: &'static str, write: &str, e: &CallError) -> Result<Option<MacBuild>, ClaimError> {
        timed(self.api_timeout, self.api.get_opt(&self.name))
            .await
            .map_err(|read| self.err(action, format!("{write} got {e}, and reading it again failed: {read}")))
    }
}

/// How step 1 of [`claim`] ended: our claim is on `current`, or the build is lost.
enum ClaimWrite {
    Ours { current: Box<MacBuild>, wanted: Claim },
    Lost(String),
}

/// Step 1 of [`claim`]: write the claim (or confirm the one `mb` shows), resolving conflicts.
async fn write_claim(call: &ClaimCall, mb: &MacBuild, holder: &str, attempt: u32) -> Result<ClaimWrite, ClaimError> {
    let (api, api_timeout, build) = (&call.api, call.api_timeout, &call.build);
    let name = call.name.clone();
    let err = |action: &'static str, detail: String| call.err(action, detail);
    let lost = |reason: String| Ok(ClaimWrite::Lost(reason));
    let reread = async |action: &'static str, write: &str, e: &CallError| call.reread(action, write, e).await;
    let wanted = claim_for(mb, holder, attempt);

    // Step 1: the claim, unless `mb` shows it already. A first claim whose test failed only
    // because something else wrote the build (a label, a status message) is made again on the
    // fresh read, a few times: the journal allows one claim per attempt, so giving up here would
    // leave the build to nobody if every agent had read it before that write.
    let mut read = mb.clone();
    let mut wanted = wanted;
    let mut tries = 0;
    // Whether `read` came from the API within this call: the caller's may be old (recovery's read,
    // then a wait for a slot or a pause), and showing our claim and finalizer it would win with no
    // write at all, though an operator may have handed the build on to another agent since.
    let mut fresh_read = false;
    let current = loop {
        if is_ours(&read, &wanted) && !fresh_read {
            let confirmed = timed(api_timeout, api.get_opt(&name)).await.map_err(|e| {
                err(
                    "claiming",
                    format!("confirming our claim by reading it again failed: {e}"),
                )
            })?;
            match confirmed {
                Some(fresh) if fresh.metadata.uid == mb.metadata.uid => {
                    if !is_ours(&fresh, &wanted) {
                        tracing::info!(build = %build, "our claim shown by an earlier read is gone: {}", describe_claim(&fresh));
                    }
                    read = fresh;
                    fresh_read = true;
                    continue;
                }
                Some(_) => return lost("the MacBuild was deleted and created again".into()),
                None => return lost("the MacBuild was deleted".into()),
            }
        }
        // An end shown is final, whoever wrote it (a retry's own end moves the claim on:
        // `delivery::claim_to_test`); a first claim is refused it by `open_for_first_claim` too.
        if let Some(phase) = read.status.as_ref().and_then(|s| s.phase).filter(|p| p.is_terminal()) {
            return lost(format!("the build has ended ({phase}); nothing is left to claim"));
        }
        if is_ours(&read, &wanted) {
            break read;
        }
        tries += 1;
        let unclaimed = read
            .status
            .as_ref()
            .and_then(|s| s.claim.as_ref())
            .is_none_or(|c| c.holder.is_empty());
        // A first claim (attempt 1, or the first after a hand-over) needs an unclaimed build; a
        // retry follows our own claim of the attempt before.
        let first = attempt <= 1 || unclaimed;
        let patch = if first {
            // The caller matched labels and namespaces; here only the build's own state matters.
            if let Err(why) = open_for_first_claim(&read) {
                return lost(format!("not claimable: {why:?}"));
            }
            first_claim_patch(&read, &wanted)
        } else {
            let previous = Claim {
                holder: holder.to_string(),
                attempt: attempt_id(&name, attempt - 1),
                epoch: 0,
            };
            if !is_ours(&read, &previous) {
                return lost(format!(
                    "attempt {} is not ours to follow: {}",
                    previous.attempt,
                    describe_claim(&read)
                ));
            }
            next_claim_patch(read.metadata.uid.as_deref().unwrap_or_default(), &previous, &wanted)
        };
        crate::crash_point!("claim.status.before");
        let claimed = timed(
            api_timeout,
            api.patch_status(&name, &patch_params(), &Patch::Json::<()>(patch)),
        )
        .await;
        crate::crash_point!("claim.status.after");
        match claimed {
            Ok(updated) => break updated,
            Err(e) if e.is_not_found() => return lost("the MacBuild was deleted".into()),
            Err(e) if e.is_precondition() => {
                let Some(fresh) = reread("claiming", "the claim", &e).await? else {
                    return lost("the MacBuild was deleted".into());
                };
                match after_claim_conflict(&read, &fresh, &wanted, attempt, first) {
                    AfterConflict::Won => break fresh,
                    AfterConflict::Refused => {
                        return Err(err("claiming", format!("the claim was refused: {e}")));
                    }
                    AfterConflict::Lost(why) => return lost(format!("the claim's test failed ({e}); {why}")),
                    AfterConflict::ClaimAgain if tries < FIRST_CLAIM_TRIES => {
                        tracing::debug!(build = %build, "the claim's test failed ({e}) but the build is still unclaimed; claiming it again on the fresh read");
                        wanted = claim_for(&fresh, holder, attempt);
                        read = fresh;
                        fresh_read = true;
                    }
                    AfterConflict::ClaimAgain => {
                        return Err(err(
                            "claiming",
                            format!("the build kept changing under the claim ({FIRST_CLAIM_TRIES} tries, last {e})"),
                        ));
                    }
                }
            }
            Err(e) => return Err(err("claiming", e.to_string())),
        }
    };
    Ok(ClaimWrite::Ours {
        current: Box::new(current),
        wanted,
    })
}

/// Step 2 of [`claim`]: the finalizer and agent label on `current`, fenced on the
/// resourceVersion and our claim `wanted`.
async fn add_finalizer(call: &ClaimCall, mut current: MacBuild, wanted: Claim) -> Result<ClaimOutcome, ClaimError> {
    let (api, api_timeout) = (&call.api, call.api_timeout);
    let name = call.name.clone();
    let err = |action: &'static str, detail: String| call.err(action, detail);
    let lost = |reason: String| Ok(ClaimOutcome::Lost { reason });
    let reread = async |action: &'static str, write: &str, e: &CallError| call.reread(action, write, e).await;

    // Step 2: finalizer and label, fenced on the resourceVersion and our claim.
    for _ in 0..3 {
        if current.metadata.deletion_timestamp.is_some() {
            return lost("the MacBuild is being deleted; no finalizer can be added".into());
        }
        let Some(patch) = finalizer_patch(&current, &wanted) else {
            return Ok(ClaimOutcome::Won {
                claim: wanted,
                macbuild: Box::new(current),
            });
        };
        crate::crash_point!("claim.finalizer_add.before");
        let added = timed(
            api_timeout,
            api.patch(&name, &patch_params(), &Patch::Json::<()>(patch)),
        )
        .await;
        crate::crash_point!("claim.finalizer_add.after");
        match added {
            Ok(updated) => {
                return Ok(ClaimOutcome::Won {
                    claim: wanted,
                    macbuild: Box::new(updated),
                });
            }
            Err(e) if e.is_not_found() => return lost("the MacBuild was deleted".into()),
            Err(e) if e.is_precondition() => {
                let Some(fresh) = reread("adding the finalizer to", "the patch", &e).await? else {
                    return lost("the MacBuild was deleted".into());
                };
                match after_finalizer_conflict(&current, &fresh, &wanted) {
                    AfterConflict::Lost(why) => return lost(why),
                    AfterConflict::Refused => {
                        return Err(err("adding the finalizer to", format!("the patch was refused: {e}")));
                    }
                    AfterConflict::Won | AfterConflict::ClaimAgain => current = fresh,
                }
            }
            Err(e) => return Err(err("adding the finalizer to", e.to_string())),
        }
    }
    Err(err(
        "adding the finalizer to",
        "the MacBuild kept changing (3 tries)".into(),
    ))
}

/// Removes `holder`'s finalizer from `build` — call it only once the VM is confirmed gone. Done
/// when the MacBuild, or the finalizer, is already gone (or the name now belongs to a new
/// MacBuild), and when another holder claims the build now: the finalizer is then theirs.
pub async fn release(
    client: &kube::Client,
    api_timeout: Duration,
    build: &BuildRef,
    holder: &str,
) -> Result<(), ClaimError> {
    let api: Api<MacBuild> = Api::namespaced(client.clone(), &build.namespace);
    let err = |detail: String| ClaimError {
        action: "removing the finalizer from",
        build: build.to_string(),
        detail,
    };
    for _ in 0..3 {
        let mb = match timed(api_timeout, api.get_opt(&build.name)).await {
            Ok(Some(mb)) => mb,
            Ok(None) => return Ok(()),
            Err(e) => return Err(err(format!("reading it: {e}"))),
        };
        if mb.metadata.uid.as_deref() != Some(build.uid.as_str()) {
            return Ok(());
        }
        if let Some(other) = claimed_by_another(&mb, holder) {
            tracing::info!("finalizer of {build} left on: {other} claims it now, and it keeps that holder's VM");
            return Ok(());
        }
        let Some(patch) = finalizer_removal_patch(&mb, holder) else {
            return Ok(());
        };
        crate::crash_point!("claim.finalizer_remove.before");
        let removed = timed(
            api_timeout,
            api.patch(&build.name, &patch_params(), &Patch::Json::<()>(patch)),
        )
        .await;
        crate::crash_point!("claim.finalizer_remove.after");
        match removed {
            Ok(_) => return Ok(()),
            Err(e) if e.is_not_found() => return Ok(()),
            // The MacBuild changed since our read (perhaps claimed anew); read again.
            Err(e) if e.is_precondition() => tracing::debug!("finalizer of {build}: {e}; reading it again"),
            Err(e) => return Err(err(e.to_string())),
        }
    }
    Err(err("the finalizer list kept changing (3 tries)".into()))
}

/// The attempt number of `claim`, if its attempt id is well formed.
pub fn attempt_number(claim: &Claim) -> Option<u32> {
    parse_attempt_id(&claim.attempt).map(|(_, n)| n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tartan_api::{MacBuildSpec, MacBuildStatus, Step};

    fn mb(status: Option<MacBuildStatus>) -> MacBuild {
        let mut mb = MacBuild::new(
            "b",
            MacBuildSpec {
                timeout_seconds: 100,
                host_selector: BTreeMap::from([("xcode".to_string(), "16".to_string())]),
                ..MacBuildSpec::new(
                    "img",
                    vec![Step {
                        name: "build".into(),
                        run: vec!["true".into()],
                        timeout_seconds: None,
                    }],
                )
            },
        );
        mb.metadata.namespace = Some("ci".into());
        mb.metadata.uid = Some("uid-1".into());
        mb.metadata.resource_version = Some("41".into());
        mb.status = status;
        mb
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn claim(holder: &str, attempt: &str, epoch: u64) -> Claim {
        Claim {
            holder: holder.into(),
            attempt: attempt.into(),
            epoch,
        }
    }

    #[test]
    fn claimable_checks_selector_claim_deletion_cancel_and_namespace() {
        let host = labels(&[("xcode", "16"), ("arch", "arm64")]);
        assert_eq!(claimable(&mb(None), &host, &[]), Ok(()));
        assert_eq!(claimable(&mb(None), &host, &["ci".into()]), Ok(()));
        assert_eq!(
            claimable(&mb(None), &host, &["other".into()]),
            Err(NotClaimable::NamespaceNotServed)
        );
        assert_eq!(
            claimable(&mb(None), &labels(&[("xcode", "15")]), &[]),
            Err(NotClaimable::HostSelector { key: "xcode".into() })
        );
        assert_eq!(
            claimable(&mb(None), &labels(&[]), &[]),
            Err(NotClaimable::HostSelector { key: "xcode".into() })
        );
        let claimed = mb(Some(MacBuildStatus {
            claim: Some(claim("a", "b#1", 1)),
            ..Default::default()
        }));
        assert_eq!(
            claimable(&claimed, &host, &[]),
            Err(NotClaimable::Claimed { holder: "a".into() })
        );
        let mut deleting = mb(None);
        deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        assert_eq!(claimable(&deleting, &host, &[]), Err(NotClaimable::Deleting));
        let mut cancelled = mb(None);
        cancelled.spec.cancel_requested = true;
        assert_eq!(claimable(&cancelled, &host, &[]), Err(NotClaimable::Cancelled));
        let done = mb(Some(MacBuildStatus {
            phase: Some(Phase::Failed),
            ..Default::default()
        }));
        assert_eq!(claimable(&done, &host, &[]), Err(NotClaimable::Finished(Phase::Failed)));
    }

    #[test]
    fn a_claim_reset_to_hand_the_build_on_continues_the_attempt_numbers() {
        let host = labels(&[("xcode", "16")]);
        let listed = |numbers: &[u32]| {
            mb(Some(MacBuildStatus {
                attempts: numbers
                    .iter()
                    .map(|&n| tartan_api::AttemptRecord {
                        number: n,
                        id: format!("b#{n}"),
                        vm: format!("mb-ci-b-a{n}"),
                        host: "mac-mini-01".into(),
                        outcome: None,
                        reason: None,
                        started_at: None,
                        finished_at: None,
                        message: None,
                    })
                    .collect(),
                ..Default::default()
            }))
        };
        assert_eq!(first_attempt_number(&mb(None)), 1);
        assert_eq!(first_attempt_number(&listed(&[])), 1);
        // The unreachable holder's attempt 1 may still run: its number and VM are not reused.
        let handed_on = listed(&[1]);
        assert_eq!(first_attempt_number(&handed_on), 2);
        assert_eq!(claimable(&handed_on, &host, &[]), Ok(()));
        assert_eq!(claim_for(&handed_on, "mac-mini-07", 2), claim("mac-mini-07", "b#2", 2));
        // And it counts against maxAttempts (2 by default).
        assert_eq!(
            claimable(&listed(&[1, 2]), &host, &[]),
            Err(NotClaimable::AttemptsUsed { attempts: 2, max: 2 })
        );
    }

    #[test]
    fn first_claim_tests_the_resource_version_and_adds_status() {
        let c = claim_for(&mb(None), "mac-mini-07", 1);
        assert_eq!(c, claim("mac-mini-07", "b#1", 1));
        let p = serde_json::to_value(first_claim_patch(&mb(None), &c)).unwrap();
        assert_eq!(
            p,
            json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "41"},
                {"op": "add", "path": "/status", "value": {
                    "claim": {"holder": "mac-mini-07", "attempt": "b#1", "epoch": 1},
                    "phase": "Pending",
                    "message": "claimed by mac-mini-07 for attempt b#1; admitting it"}},
            ])
        );
        // With a status already there, only the claim's fields are added.
        let p = serde_json::to_value(first_claim_patch(&mb(Some(MacBuildStatus::default())), &c)).unwrap();
        let paths: Vec<&str> = p
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["path"].as_str().unwrap())
            .collect();
        assert_eq!(
            paths,
            [
                "/metadata/resourceVersion",
                "/status/claim",
                "/status/phase",
                "/status/message"
            ]
        );
        assert!(p.as_array().unwrap()[1..].iter().all(|o| o["op"] == "add"));
    }

    #[test]
    fn next_claim_tests_holder_and_previous_attempt() {
        let current = mb(Some(MacBuildStatus {
            claim: Some(claim("mac-mini-07", "b#1", 1)),
            ..Default::default()
        }));
        let next = claim_for(&current, "mac-mini-07", 2);
        assert_eq!(next, claim("mac-mini-07", "b#2", 2));
        let p = serde_json::to_value(next_claim_patch("uid-1", &claim("mac-mini-07", "b#1", 1), &next)).unwrap();
        assert_eq!(p[0], json!({"op": "test", "path": "/metadata/uid", "value": "uid-1"}));
        assert_eq!(
            p[1],
            json!({"op": "test", "path": "/status/claim/holder", "value": "mac-mini-07"})
        );
        assert_eq!(
            p[2],
            json!({"op": "test", "path": "/status/claim/attempt", "value": "b#1"})
        );
        assert_eq!(
            p[3],
            json!({"op": "replace", "path": "/status/claim", "value": {"holder": "mac-mini-07", "attempt": "b#2", "epoch": 2}})
        );
        assert_eq!(attempt_number(&next), Some(2));
        // Claiming attempt 2 again once it is made does not move the epoch on.
        let made = mb(Some(MacBuildStatus {
            claim: Some(next.clone()),
            ..Default::default()
        }));
        assert_eq!(claim_for(&made, "mac-mini-07", 2), next);
        assert_eq!(claim_for(&made, "other", 2), claim("other", "b#2", 3));
    }

    #[test]
    fn a_conflict_is_won_lost_refused_or_claimed_again_by_what_changed() {
        let read = mb(None);
        let wanted = claim("mac-a", "b#1", 1);
        let changed = |f: &dyn Fn(&mut MacBuild)| {
            let mut m = read.clone();
            m.metadata.resource_version = Some("42".into());
            f(&mut m);
            m
        };
        // Only a label changed: still unclaimed, so claim it again (the old code gave up, and with
        // its attempt journaled this agent never claimed the build again).
        let labelled = changed(&|m| m.metadata.labels = Some(labels(&[("x", "y")])));
        assert_eq!(
            after_claim_conflict(&read, &labelled, &wanted, 1, true),
            AfterConflict::ClaimAgain
        );
        // Claimed by another agent: lost, no second write.
        let taken = changed(&|m| {
            m.status = Some(MacBuildStatus {
                claim: Some(claim("mac-b", "b#1", 1)),
                ..Default::default()
            })
        });
        assert!(matches!(
            after_claim_conflict(&read, &taken, &wanted, 1, true),
            AfterConflict::Lost(why) if why.contains("mac-b")
        ));
        // Ours: an answer lost in transit.
        let ours = changed(&|m| {
            m.status = Some(MacBuildStatus {
                claim: Some(wanted.clone()),
                ..Default::default()
            })
        });
        assert_eq!(after_claim_conflict(&read, &ours, &wanted, 1, true), AfterConflict::Won);
        // Nothing changed: the write was refused.
        assert_eq!(
            after_claim_conflict(&read, &read, &wanted, 1, true),
            AfterConflict::Refused
        );
        // Cancelled, handed on (attempt 2 next), or a new build of that name: lost.
        let cancelled = changed(&|m| m.spec.cancel_requested = true);
        assert!(matches!(
            after_claim_conflict(&read, &cancelled, &wanted, 1, true),
            AfterConflict::Lost(_)
        ));
        let handed_on = changed(&|m| {
            m.status = Some(MacBuildStatus {
                attempts: vec![tartan_api::AttemptRecord {
                    number: 1,
                    id: "b#1".into(),
                    vm: "mb-ci-b-a1".into(),
                    host: "mac-c".into(),
                    outcome: None,
                    reason: None,
                    started_at: None,
                    finished_at: None,
                    message: None,
                }],
                ..Default::default()
            })
        });
        assert!(matches!(
            after_claim_conflict(&read, &handed_on, &wanted, 1, true),
            AfterConflict::Lost(_)
        ));
        let recreated = changed(&|m| m.metadata.uid = Some("uid-2".into()));
        assert!(matches!(
            after_claim_conflict(&read, &recreated, &wanted, 1, true),
            AfterConflict::Lost(why) if why.contains("created again")
        ));
        // A later claim by the holder is fenced on its own claim, not the version: not repeated.
        assert!(matches!(
            after_claim_conflict(&read, &labelled, &claim("mac-a", "b#2", 2), 2, false),
            AfterConflict::Lost(_)
        ));
    }

    #[test]
    fn a_finalizer_conflict_on_a_build_created_again_under_its_name_is_lost() {
        let wanted = claim("mac-a", "b#1", 1);
        let ours = mb(Some(MacBuildStatus {
            claim: Some(wanted.clone()),
            ..Default::default()
        }));
        let changed = |f: &dyn Fn(&mut MacBuild)| {
            let mut m = ours.clone();
            m.metadata.resource_version = Some("42".into());
            f(&mut m);
            m
        };
        // Deleted (no finalizer yet) and created again, and this agent claimed the new one for
        // the same attempt id: the old claim must not win it.
        let recreated = changed(&|m| m.metadata.uid = Some("uid-2".into()));
        assert!(matches!(
            after_finalizer_conflict(&ours, &recreated, &wanted),
            AfterConflict::Lost(why) if why.contains("created again")
        ));
        let taken = changed(&|m| m.status.as_mut().unwrap().claim = Some(claim("mac-b", "b#1", 1)));
        assert!(matches!(
            after_finalizer_conflict(&ours, &taken, &wanted),
            AfterConflict::Lost(why) if why.contains("mac-b")
        ));
        assert_eq!(after_finalizer_conflict(&ours, &ours, &wanted), AfterConflict::Refused);
        let labelled = changed(&|m| m.metadata.labels = Some(labels(&[("x", "y")])));
        assert_eq!(
            after_finalizer_conflict(&ours, &labelled, &wanted),
            AfterConflict::ClaimAgain
        );
    }

    #[test]
    fn finalizer_patch_escapes_the_label_key_and_appends_to_existing_lists() {
        let c = claim("mac-mini-07", "b#1", 1);
        let mut m = mb(Some(MacBuildStatus {
            claim: Some(c.clone()),
            ..Default::default()
        }));
        let p = serde_json::to_value(finalizer_patch(&m, &c).unwrap()).unwrap();
        assert_eq!(
            p,
            json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "41"},
                {"op": "test", "path": "/status/claim/holder", "value": "mac-mini-07"},
                {"op": "test", "path": "/status/claim/attempt", "value": "b#1"},
                {"op": "add", "path": "/metadata/finalizers", "value": ["tartan.dev/vm-cleanup"]},
                {"op": "add", "path": "/metadata/labels", "value": {"tartan.dev/agent": "mac-mini-07"}},
            ])
        );
        m.metadata.finalizers = Some(vec!["other/f".into()]);
        m.metadata.labels = Some(labels(&[("app", "x")]));
        let p = serde_json::to_value(finalizer_patch(&m, &c).unwrap()).unwrap();
        assert_eq!(
            p[3],
            json!({"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER})
        );
        assert_eq!(
            p[4],
            json!({"op": "add", "path": "/metadata/labels/tartan.dev~1agent", "value": "mac-mini-07"})
        );
        m.metadata.finalizers = Some(vec!["other/f".into(), FINALIZER.into()]);
        m.metadata.labels = Some(labels(&[(AGENT_LABEL, "mac-mini-07")]));
        assert_eq!(finalizer_patch(&m, &c), None);
    }

    #[test]
    fn finalizer_removal_tests_the_version_read_and_its_index() {
        let mut m = mb(None);
        assert_eq!(finalizer_removal_patch(&m, "mac-mini-07"), None);
        m.metadata.finalizers = Some(vec!["other/f".into(), FINALIZER.into()]);
        let p = serde_json::to_value(finalizer_removal_patch(&m, "mac-mini-07").unwrap()).unwrap();
        assert_eq!(
            p,
            json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "41"},
                {"op": "test", "path": "/metadata/finalizers/1", "value": FINALIZER},
                {"op": "remove", "path": "/metadata/finalizers/1"},
            ])
        );
        // Our claim, or none (reset, not claimed again): ours to remove.
        m.status = Some(MacBuildStatus {
            claim: Some(claim("mac-mini-07", "b#1", 1)),
            ..Default::default()
        });
        assert!(finalizer_removal_patch(&m, "mac-mini-07").is_some());
    }

    #[test]
    fn a_finalizer_of_a_build_handed_on_is_left_to_the_new_holder() {
        let mut m = mb(Some(MacBuildStatus {
            claim: Some(claim("mac-mini-08", "b#1", 1)),
            ..Default::default()
        }));
        m.metadata.finalizers = Some(vec![FINALIZER.into()]);
        assert_eq!(finalizer_removal_patch(&m, "mac-mini-07"), None);
        assert!(finalizer_removal_patch(&m, "mac-mini-08").is_some());
    }
}
