//! The chaos run's controller: one process, or (fleet runs) replicas under leader election with
//! the source's timings, as a two-replica Deployment runs them. One owner for which of them is
//! down and why, so a failover, a whole-controller kill and healing never start one twice.

use crate::stack::{ControllerOptions, LeaderOptions, Stack};
use std::collections::BTreeSet;
use std::process::ExitStatus;

#[derive(Default)]
pub struct Controllers {
    opts: ControllerOptions,
    /// Replica identities; empty for a single controller without leader election.
    replicas: Vec<String>,
    /// Every process down (`Fault::KillController`), restarted when it is lifted.
    all_down: bool,
    /// Replicas killed as the leader (`Fault::ControllerFailover`), restarted when it is lifted.
    failed_over: BTreeSet<String>,
}

impl Controllers {
    /// `replicas` = 1: one controller as before; more: that many replicas, `ctl-1`, `ctl-2`, ...
    pub fn new(opts: ControllerOptions, replicas: usize) -> Controllers {
        let replicas = if replicas > 1 {
            (1..=replicas).map(|i| format!("ctl-{i}")).collect()
        } else {
            vec![]
        };
        Controllers {
            opts,
            replicas,
            all_down: false,
            failed_over: BTreeSet::new(),
        }
    }

    /// Starts what is not running and not meant to be down.
    pub fn start(&mut self, stack: &mut Stack) {
        if self.replicas.is_empty() && !stack.controller_started() {
            stack.start_controller(self.opts.clone());
        }
        for id in &self.replicas {
            if !stack.replica_started(id) && !self.failed_over.contains(id) {
                stack.start_replica(id, self.opts.clone(), &LeaderOptions::source_defaults());
            }
        }
    }

    pub fn all_down(&self) -> bool {
        self.all_down
    }

    /// Whether any process is down on purpose (all of them, or a failed-over leader).
    fn any_down(&self) -> bool {
        self.all_down || !self.failed_over.is_empty()
    }

    /// `kill -9` of every controller process (no controller until [`Controllers::restart_all`]).
    pub fn kill_all(&mut self, stack: &mut Stack) {
        if self.replicas.is_empty() {
            stack.kill_controller();
        }
        for id in &self.replicas {
            if stack.replica_started(id) {
                stack.kill_replica(id);
            }
        }
        self.all_down = true;
    }

    /// Starts every process [`Controllers::kill_all`] killed; a failed-over replica stays down
    /// until its own fault is lifted (a lift restarts only what its strike killed).
    pub fn restart_all(&mut self, stack: &mut Stack) {
        self.all_down = false;
        self.start(stack);
    }

    /// Starts every process that is down on purpose (healing); whether any was.
    pub fn heal(&mut self, stack: &mut Stack) -> bool {
        let was_down = self.any_down();
        self.all_down = false;
        self.failed_over.clear();
        self.start(stack);
        was_down
    }

    /// `kill -9` of the replica holding the leader Lease: the standby must take over. Returns
    /// its identity, or why nothing was killed (the Lease unreadable during an API outage, too).
    pub async fn kill_leader(&mut self, stack: &mut Stack) -> Result<String, String> {
        if self.replicas.len() < 2 {
            return Err("one controller, no standby to fail over to".into());
        }
        if self.all_down || !self.failed_over.is_empty() {
            return Err("a controller replica is already down".into());
        }
        let lease = stack.leader_lease().await.map_err(|e| format!("{e}; nobody killed"))?;
        let holder = lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| self.replicas.contains(h) && stack.replica_started(h))
            .ok_or("no running replica holds the leader Lease")?;
        stack.kill_replica(&holder);
        self.failed_over.insert(holder.clone());
        Ok(holder)
    }

    /// Starts the replicas [`Controllers::kill_leader`] killed (as standbys now); their names.
    pub fn restart_failed_over(&mut self, stack: &mut Stack) -> Vec<String> {
        let ids: Vec<String> = std::mem::take(&mut self.failed_over).into_iter().collect();
        if !self.all_down {
            self.start(stack);
        }
        ids
    }

    /// Processes that exited although the run did not kill them, restarted as their Deployment
    /// would: their names and how they ended.
    pub fn restart_exited(&mut self, stack: &mut Stack) -> Vec<(String, ExitStatus)> {
        if self.all_down {
            return vec![];
        }
        let mut exited = vec![];
        if self.replicas.is_empty() {
            if stack.controller_started()
                && let Some(status) = stack.controller_exit_status()
            {
                stack.forget_exited_controller();
                stack.restart_controller();
                exited.push(("controller".to_string(), status));
            }
            return exited;
        }
        for id in &self.replicas {
            if let Some(status) = stack.replica_exit_status(id) {
                stack.forget_exited_replica(id);
                exited.push((format!("controller replica {id}"), status));
            }
        }
        if !exited.is_empty() {
            self.start(stack);
        }
        exited
    }
}
