//! The MacBuilds an agent reads, kept by watches: every build whose run is not finished (what
//! may be claimed, or withdrawn from its holder), and the finished ones this agent holds.
//!
//! The controller labels a run's MacBuild [`FINISHED_LABEL`] some time after the run finished
//! (`Ctx::mark_finished` in the controller). Watching all MacBuilds, every agent would keep every
//! build of the day in memory, scan all of them on each change and list all of them at each
//! start; watching only unfinished ones keeps that to the builds still queued or running. A run
//! can finish with its VM's deletion unconfirmed (its holder cut off): the MacBuild keeps the
//! cancel or deletion request for that holder, so the holder also watches its own finished ones,
//! and reads directly those it still works on that were handed on meanwhile ([`StrayReads`]).

use super::timed;
use crate::record::BuildRef;
use futures::StreamExt;
use kube::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tartan_api::{AGENT_LABEL, FINISHED_LABEL, MacBuild, UNFINISHED_SELECTOR};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The label selectors of the watches: unfinished builds, and finished ones `agent_id` holds.
pub fn selectors(agent_id: &str) -> [String; 2] {
    [
        UNFINISHED_SELECTOR.to_string(),
        format!("{FINISHED_LABEL},{AGENT_LABEL}={agent_id}"),
    ]
}

/// The watched MacBuilds. The watches stop when this is dropped.
pub struct MacBuildView {
    stores: Vec<reflector::Store<MacBuild>>,
    tasks: Vec<JoinHandle<()>>,
}

impl MacBuildView {
    /// Starts the watches of [`selectors`] in each of `namespaces` (all namespaces when empty:
    /// a namespaced Role is enough otherwise), each notifying `changed` on every change that
    /// [`concerns`] `agent_id`.
    pub fn watch(client: &kube::Client, namespaces: &[String], agent_id: &str, changed: &Arc<Notify>) -> Self {
        let apis: Vec<Api<MacBuild>> = if namespaces.is_empty() {
            vec![Api::all(client.clone())]
        } else {
            namespaces
                .iter()
                .map(|ns| Api::namespaced(client.clone(), ns))
                .collect()
        };
        let (stores, tasks) = apis
            .iter()
            .flat_map(|api| selectors(agent_id).map(|selector| (api.clone(), selector)))
            .map(|(api, selector)| watch_one(api, &selector, agent_id, Arc::clone(changed)))
            .unzip();
        MacBuildView { stores, tasks }
    }

    /// The MacBuilds as the watches last delivered them, each once (a build moving between two
    /// watches may be in both for a moment).
    pub fn builds(&self) -> Vec<Arc<MacBuild>> {
        let mut seen = BTreeSet::new();
        self.stores
            .iter()
            .flat_map(|store| store.state())
            .filter(|mb| seen.insert(mb.metadata.uid.clone()))
            .collect()
    }
}

/// Reads of the builds this agent has a task for that neither watch has: handed on to another
/// agent while this one was cut off (their agent label is the new holder's) and finished since.
/// Each is read directly, at most once per `every`, so that a cancel or deletion still reaches the
/// task running here (its next status write, fenced out, would tell it only later).
pub struct StrayReads {
    every: Duration,
    last: BTreeMap<String, Instant>,
}

impl StrayReads {
    pub fn new(every: Duration) -> Self {
        StrayReads {
            every,
            last: BTreeMap::new(),
        }
    }

    /// The MacBuilds of `tasks` missing from `view` that are due a read, as read now (each
    /// request at most `timeout`); one that is gone, or is another object under its name, is
    /// left out.
    pub async fn read(
        &mut self,
        client: &kube::Client,
        timeout: Duration,
        tasks: &[BuildRef],
        view: &[Arc<MacBuild>],
    ) -> Vec<Arc<MacBuild>> {
        // Every scan asks; with no task here (the usual idle case) there is nothing to compare.
        if tasks.is_empty() {
            self.last.clear();
            return Vec::new();
        }
        let in_view: BTreeSet<&str> = view.iter().filter_map(|mb| mb.metadata.uid.as_deref()).collect();
        let strays: Vec<&BuildRef> = tasks.iter().filter(|b| !in_view.contains(b.uid.as_str())).collect();
        self.last.retain(|uid, _| strays.iter().any(|b| &b.uid == uid));
        let now = Instant::now();
        let mut read = Vec::new();
        for build in strays {
            if self.last.get(&build.uid).is_some_and(|at| now < *at + self.every) {
                continue;
            }
            self.last.insert(build.uid.clone(), now);
            let api: Api<MacBuild> = Api::namespaced(client.clone(), &build.namespace);
            match timed(timeout, api.get_opt(&build.name)).await {
                Ok(Some(mb)) if mb.metadata.uid.as_deref() == Some(build.uid.as_str()) => read.push(Arc::new(mb)),
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%build, %error, retry_in = ?self.every, "reading a MacBuild missing from the watches failed")
                }
            }
        }
        read
    }
}

impl Drop for MacBuildView {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Whether a change to `mb` asks for a scan by agent `agent_id`: a build nobody holds (to claim,
/// or no longer claimable) or one it holds (to withdraw, or to answer for). Another agent's
/// build is that agent's business: at 100 hosts its status writes woke every agent for a scan of
/// its whole view, several times a second. A task still running here for a build handed on to
/// another agent learns of a cancel from the periodic rescan, or from its next status write.
pub fn concerns(mb: &MacBuild, agent_id: &str) -> bool {
    mb.status
        .as_ref()
        .and_then(|s| s.claim.as_ref())
        .is_none_or(|c| c.holder.is_empty() || c.holder == agent_id)
}

/// A reflector over `api`'s MacBuilds matching `selector`, without their managedFields (never
/// read, and much of each object), and the task that keeps it and notifies `changed` of the
/// changes that [`concerns`] `agent_id`.
fn watch_one(
    api: Api<MacBuild>,
    selector: &str,
    agent_id: &str,
    changed: Arc<Notify>,
) -> (reflector::Store<MacBuild>, JoinHandle<()>) {
    let (reader, writer) = reflector::store();
    // Listed at resourceVersion 0 without pages (kube sends no resourceVersion with a limit): a
    // real API server answers from its watch cache instead of reading every stored MacBuild,
    // finished ones included, from etcd at each agent start. A list a moment old is safe: claims
    // are fenced writes, and this agent's own builds are in its journal.
    let config = watcher::Config {
        page_size: None,
        ..watcher::Config::default().any_semantic().labels(selector)
    };
    let stream = watcher(api, config)
        .default_backoff()
        .modify(|mb| mb.metadata.managed_fields = None)
        .reflect(writer)
        .touched_objects();
    let selector = selector.to_string();
    let agent_id = agent_id.to_string();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(mb) if concerns(&mb, &agent_id) => changed.notify_one(),
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, %selector, "MacBuild watch failed; it restarts with backoff")
                }
            }
        }
    });
    (reader, task)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watches_split_on_the_finished_label_and_keep_only_own_finished_builds() {
        let [unfinished, own_finished] = selectors("mac-mini-07");
        assert_eq!(unfinished, "!tartan.dev/finished");
        assert_eq!(own_finished, "tartan.dev/finished,tartan.dev/agent=mac-mini-07");
    }

    #[test]
    fn a_change_concerns_an_agent_when_nobody_or_it_holds_the_build() {
        let with_holder = |holder: Option<&str>| {
            let mut mb = MacBuild::new("b", tartan_api::MacBuildSpec::new("img", vec![]));
            if let Some(h) = holder {
                mb.status = Some(tartan_api::MacBuildStatus {
                    claim: Some(tartan_api::Claim {
                        holder: h.into(),
                        attempt: "b#1".into(),
                        epoch: 1,
                    }),
                    ..Default::default()
                });
            }
            mb
        };
        assert!(concerns(&with_holder(None), "mac-mini-07"), "no status yet: claimable");
        assert!(
            concerns(&with_holder(Some("")), "mac-mini-07"),
            "claim reset to hand it on"
        );
        assert!(concerns(&with_holder(Some("mac-mini-07")), "mac-mini-07"), "its own");
        assert!(!concerns(&with_holder(Some("mac-mini-08")), "mac-mini-07"), "another's");
        let mut unclaimed_status = with_holder(None);
        unclaimed_status.status = Some(Default::default());
        assert!(concerns(&unclaimed_status, "mac-mini-07"), "a status without a claim");
    }
}
