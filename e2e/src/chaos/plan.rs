//! The seeded schedule of a chaos run (pure): which builds start when, and which faults strike
//! when and for how long. The same seed and sizes give the same plan.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fmt;
use std::time::Duration;

/// Sizes of a run.
#[derive(Clone, Debug)]
pub struct Sizes {
    pub seed: u64,
    pub builds: usize,
    pub hosts: usize,
    /// Builds start and faults strike within this window.
    pub window: Duration,
    /// How many faults (default: as many as builds).
    pub faults: usize,
    /// Add the fleet-level faults ([`fleet_faults`]) on top of the drawn ones.
    pub fleet: bool,
    /// At most one drawn cluster-wide fault ([`Fault::cluster_wide`]) per this much of the window
    /// ([`cap_cluster_faults`]); `None`: drawn like every other kind.
    pub cluster_every: Option<Duration>,
}

/// One build to run.
#[derive(Clone, Debug, PartialEq)]
pub struct BuildPlan {
    pub name: String,
    pub at: Duration,
    /// How long its step sleeps (so builds are in flight when faults strike).
    pub step_secs: f64,
    /// A short `spec.timeout` for some builds; `None` = the controller's default.
    pub timeout: Option<String>,
}

/// How an agent is killed (mirrors [`crate::KillMode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kill {
    Group,
    Alone,
    /// launchd's stop (SIGTERM, then the group): the agent detaches its builds.
    Term,
    /// The group and every tart process of the host: the VMs die with the agent.
    WithVms,
}

/// One fault. Those with a duration are lifted after it.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// `kill -9` of an agent, restarted after `down`.
    KillAgent { host: usize, kill: Kill, down: Duration },
    /// SIGSTOP, SIGCONT after `for_`.
    FreezeAgent { host: usize, for_: Duration },
    /// `kill -9` of the controller, restarted after `down`.
    KillController { down: Duration },
    /// Every API request answers 503 for `for_`.
    ApiUnavailable { for_: Duration },
    /// The API closes its socket and drops every connection for `for_`.
    ApiRefuses { for_: Duration },
    /// Every API request is delayed by `latency` for `for_`.
    ApiLatency { latency: Duration, for_: Duration },
    /// Terminal `macbuilds/status` writes are refused for `for_`.
    RefuseTerminalStatus { for_: Duration },
    /// Watches deliver nothing for `for_` (stale caches), then resume.
    WatchStall { for_: Duration },
    /// The watch history is dropped and connections cut: every watch restarts with 410 Gone.
    WatchRestart,
    /// `tart delete` fails on a host for `for_`.
    TartDeleteFails { host: usize, for_: Duration },
    /// `tart clone` and `tart delete` are slow on a host for `for_`.
    TartSlow {
        host: usize,
        clone: f64,
        delete: f64,
        for_: Duration,
    },
    /// `tart exec` hangs on a host for `for_`.
    TartExecHangs { host: usize, for_: Duration },
    /// VMs started on a host during `for_` die `after` seconds into `tart run`.
    TartRunDies { host: usize, after: f64, for_: Duration },
    /// `tart clone` on a host leaves its temp dir unlocked for `gap` seconds during `for_`: any
    /// other tart command then deletes it and the clone fails (tart's own window).
    TartCloneTmpRace { host: usize, gap: f64, for_: Duration },
    /// Tekton cancels a build's CustomRun.
    Cancel { build: usize },
    /// The CustomRun (owner of the MacBuild) is deleted.
    DeleteOwner { build: usize },
    /// A rack: these hosts' agents are cut off from the API (requests and watches get no
    /// answer) for `for_`, the controller and the other hosts not.
    RackPartition { hosts: Vec<usize>, for_: Duration },
    /// Every API request occupies the server alone for `busy` (the emulator's `busyMs`: a
    /// saturated apiserver) for `for_`.
    ApiBusy { busy: Duration, for_: Duration },
    /// A rolling agent upgrade: every host in turn, `gap` apart, gets launchd's stop (SIGTERM,
    /// waiting for the agent to exit) and is started again, while builds run.
    RollingUpgrade { gap: Duration },
    /// `kill -9` of the controller replica holding the leader Lease (a node lost with its pod);
    /// the standby takes over, the killed one comes back as a standby after `down`.
    ControllerFailover { down: Duration },
}

impl Fault {
    /// Whether the fault strikes the whole cluster (the controller, the API server, the watches)
    /// rather than one host or one build: its rate must not grow with the fleet.
    pub fn cluster_wide(&self) -> bool {
        matches!(
            self,
            Fault::KillController { .. }
                | Fault::ApiUnavailable { .. }
                | Fault::ApiRefuses { .. }
                | Fault::ApiLatency { .. }
                | Fault::RefuseTerminalStatus { .. }
                | Fault::WatchStall { .. }
                | Fault::WatchRestart
        )
    }

    /// The fault's kind, for the run's tally (agent kills by how the agent dies).
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillAgent { kill: Kill::Term, .. } => "agent SIGTERM (launchd stop)",
            Fault::KillAgent { kill: Kill::Group, .. } => "agent kill -9 (group)",
            Fault::KillAgent { kill: Kill::Alone, .. } => "agent kill -9 (alone)",
            Fault::KillAgent {
                kill: Kill::WithVms, ..
            } => "agent kill -9 (with its VMs)",
            Fault::FreezeAgent { .. } => "agent SIGSTOP",
            Fault::KillController { .. } => "controller kill -9",
            Fault::ControllerFailover { .. } => "controller leader kill -9 (failover)",
            Fault::ApiUnavailable { .. } => "API 503",
            Fault::ApiRefuses { .. } => "API refuses connections",
            Fault::ApiLatency { .. } => "API latency",
            Fault::RefuseTerminalStatus { .. } => "terminal status refused",
            Fault::WatchStall { .. } => "watches stall",
            Fault::WatchRestart => "watches restart (410)",
            Fault::TartDeleteFails { .. } => "tart delete fails",
            Fault::TartSlow { .. } => "tart slow",
            Fault::TartExecHangs { .. } => "tart exec hangs",
            Fault::TartRunDies { .. } => "tart run dies",
            Fault::TartCloneTmpRace { .. } => "tart clone temp-dir race",
            Fault::Cancel { .. } => "CustomRun cancelled",
            Fault::DeleteOwner { .. } => "CustomRun deleted",
            Fault::RackPartition { .. } => "rack cut off from the API",
            Fault::ApiBusy { .. } => "API saturated",
            Fault::RollingUpgrade { .. } => "rolling agent upgrade",
        }
    }

    /// How long the fault lasts before it is lifted (zero for one-shot faults).
    /// Whether the agents' status writes cannot reach the cluster while this fault is in force.
    pub fn blocks_delivery(&self) -> bool {
        matches!(
            self,
            Fault::KillAgent { .. }
                | Fault::FreezeAgent { .. }
                | Fault::ApiUnavailable { .. }
                | Fault::ApiRefuses { .. }
                | Fault::ApiLatency { .. }
                | Fault::RefuseTerminalStatus { .. }
                | Fault::RackPartition { .. }
                | Fault::ApiBusy { .. }
                | Fault::RollingUpgrade { .. }
        )
    }

    pub fn duration(&self) -> Duration {
        match self {
            Fault::KillAgent { down, .. } | Fault::KillController { down } | Fault::ControllerFailover { down } => {
                *down
            }
            Fault::FreezeAgent { for_, .. }
            | Fault::ApiUnavailable { for_ }
            | Fault::ApiRefuses { for_ }
            | Fault::ApiLatency { for_, .. }
            | Fault::RefuseTerminalStatus { for_ }
            | Fault::WatchStall { for_ }
            | Fault::TartDeleteFails { for_, .. }
            | Fault::TartSlow { for_, .. }
            | Fault::TartExecHangs { for_, .. }
            | Fault::TartRunDies { for_, .. }
            | Fault::TartCloneTmpRace { for_, .. } => *for_,
            Fault::RackPartition { for_, .. } | Fault::ApiBusy { for_, .. } => *for_,
            Fault::WatchRestart | Fault::Cancel { .. } | Fault::DeleteOwner { .. } | Fault::RollingUpgrade { .. } => {
                Duration::ZERO
            }
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = |i: &usize| host_name(*i);
        match self {
            Fault::KillAgent {
                host,
                kill: Kill::Term,
                down,
            } => write!(
                f,
                "SIGTERM agent {} (launchd stop), restart after {}",
                h(host),
                secs(*down)
            ),
            Fault::KillAgent { host, kill, down } => {
                write!(f, "kill -9 agent {} ({kill:?}), restart after {}", h(host), secs(*down))
            }
            Fault::FreezeAgent { host, for_ } => write!(f, "SIGSTOP agent {} for {}", h(host), secs(*for_)),
            Fault::KillController { down } => write!(f, "kill -9 controller, restart after {}", secs(*down)),
            Fault::ControllerFailover { down } => {
                write!(
                    f,
                    "kill -9 the leading controller replica, restart after {}",
                    secs(*down)
                )
            }
            Fault::ApiUnavailable { for_ } => write!(f, "API answers 503 for {}", secs(*for_)),
            Fault::ApiRefuses { for_ } => write!(f, "API refuses connections for {}", secs(*for_)),
            Fault::ApiLatency { latency, for_ } => {
                write!(f, "API latency {}ms for {}", latency.as_millis(), secs(*for_))
            }
            Fault::RefuseTerminalStatus { for_ } => {
                write!(f, "terminal MacBuild status writes refused for {}", secs(*for_))
            }
            Fault::WatchStall { for_ } => write!(f, "watches stall for {}", secs(*for_)),
            Fault::WatchRestart => write!(f, "watch history compacted, connections cut (410 Gone)"),
            Fault::TartDeleteFails { host, for_ } => {
                write!(f, "tart delete fails on {} for {}", h(host), secs(*for_))
            }
            Fault::TartSlow {
                host,
                clone,
                delete,
                for_,
            } => write!(
                f,
                "tart clone +{clone:.1}s, delete +{delete:.1}s on {} for {}",
                h(host),
                secs(*for_)
            ),
            Fault::TartExecHangs { host, for_ } => write!(f, "tart exec hangs on {} for {}", h(host), secs(*for_)),
            Fault::TartRunDies { host, after, for_ } => {
                write!(f, "tart run dies {after:.1}s in on {} for {}", h(host), secs(*for_))
            }
            Fault::TartCloneTmpRace { host, gap, for_ } => write!(
                f,
                "tart clone leaves its temp dir unlocked {gap:.1}s on {} for {}",
                h(host),
                secs(*for_)
            ),
            Fault::Cancel { build } => write!(f, "cancel CustomRun {}", build_name(*build)),
            Fault::DeleteOwner { build } => write!(f, "delete CustomRun {} (the MacBuild's owner)", build_name(*build)),
            Fault::RackPartition { hosts, for_ } => {
                let names: Vec<String> = hosts.iter().map(h).collect();
                write!(
                    f,
                    "rack of {} hosts ({}) cut off from the API for {}",
                    hosts.len(),
                    names.join(" "),
                    secs(*for_)
                )
            }
            Fault::ApiBusy { busy, for_ } => {
                write!(
                    f,
                    "API busy {}ms a request (one at a time) for {}",
                    busy.as_millis(),
                    secs(*for_)
                )
            }
            Fault::RollingUpgrade { gap } => {
                write!(f, "rolling agent upgrade: every host in turn, {} apart", secs(*gap))
            }
        }
    }
}

/// A fault at a time from the start of the run.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    pub at: Duration,
    pub fault: Fault,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub builds: Vec<BuildPlan>,
    pub faults: Vec<Planned>,
}

pub fn host_name(i: usize) -> String {
    format!("host-{}", i + 1)
}

pub fn build_name(i: usize) -> String {
    format!("chaos-{:03}", i + 1)
}

/// How many kinds [`draw_fault`] draws from.
pub const FAULT_KINDS: usize = 19;

fn ms(rng: &mut StdRng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(rng.random_range(lo..=hi))
}

/// Fault kind `kind` (0..FAULT_KINDS) with its random parameters.
fn draw_fault(rng: &mut StdRng, kind: usize, hosts: usize, builds: usize) -> Fault {
    let host = rng.random_range(0..hosts);
    match kind {
        0 => Fault::KillAgent {
            host,
            kill: Kill::Group,
            down: ms(rng, 500, 8000),
        },
        1 => Fault::KillAgent {
            host,
            kill: Kill::Alone,
            down: ms(rng, 500, 8000),
        },
        17 => Fault::KillAgent {
            host,
            kill: Kill::Term,
            down: ms(rng, 500, 8000),
        },
        18 => Fault::KillAgent {
            host,
            kill: Kill::WithVms,
            down: ms(rng, 500, 8000),
        },
        2 => Fault::FreezeAgent {
            host,
            for_: ms(rng, 2000, 12_000),
        },
        3 => Fault::KillController {
            down: ms(rng, 500, 6000),
        },
        4 => Fault::ApiUnavailable {
            for_: ms(rng, 1000, 5000),
        },
        5 => Fault::ApiRefuses {
            for_: ms(rng, 1000, 4000),
        },
        6 => Fault::ApiLatency {
            latency: ms(rng, 100, 1200),
            for_: ms(rng, 2000, 10_000),
        },
        7 => Fault::RefuseTerminalStatus {
            for_: ms(rng, 2000, 15_000),
        },
        8 => Fault::WatchStall {
            for_: ms(rng, 2000, 10_000),
        },
        9 => Fault::WatchRestart,
        10 => Fault::TartDeleteFails {
            host,
            for_: ms(rng, 2000, 15_000),
        },
        11 => Fault::TartSlow {
            host,
            clone: rng.random_range(0.5..4.0),
            delete: rng.random_range(0.5..4.0),
            for_: ms(rng, 3000, 15_000),
        },
        12 => Fault::TartExecHangs {
            host,
            for_: ms(rng, 2000, 10_000),
        },
        13 => Fault::TartRunDies {
            host,
            after: rng.random_range(0.5..3.0),
            for_: ms(rng, 2000, 8000),
        },
        14 => Fault::TartCloneTmpRace {
            host,
            gap: rng.random_range(0.3..1.5),
            for_: ms(rng, 3000, 12_000),
        },
        15 => Fault::Cancel {
            build: rng.random_range(0..builds),
        },
        _ => Fault::DeleteOwner {
            build: rng.random_range(0..builds),
        },
    }
}

/// The plan for `sizes`: builds start over the first 70 % of the window, each step sleeping 1-10 s
/// (so faults find builds in flight), one in five with a short timeout; faults strike at random
/// times in the window, drawn from every kind.
pub fn plan(sizes: &Sizes) -> Plan {
    let mut rng = StdRng::seed_from_u64(sizes.seed);
    let window = sizes.window.as_millis().max(1000) as u64;
    let hosts = sizes.hosts.max(1);
    let builds_n = sizes.builds.max(1);
    let mut builds: Vec<BuildPlan> = (0..builds_n)
        .map(|i| BuildPlan {
            name: build_name(i),
            at: Duration::from_millis(rng.random_range(0..=window * 7 / 10)),
            step_secs: rng.random_range(1.0..10.0),
            timeout: rng.random_bool(0.2).then(|| format!("{}s", rng.random_range(12..30))),
        })
        .collect();
    builds.sort_by_key(|b| b.at);
    // Names follow start order, so `chaos-001` is the first build created.
    for (i, b) in builds.iter_mut().enumerate() {
        b.name = build_name(i);
    }
    let mut faults: Vec<Planned> = (0..sizes.faults)
        .map(|_| {
            let kind = rng.random_range(0..FAULT_KINDS);
            Planned {
                at: Duration::from_millis(rng.random_range(window / 20..window)),
                fault: draw_fault(&mut rng, kind, hosts, builds_n),
            }
        })
        .collect();
    if let Some(every) = sizes.cluster_every {
        cap_cluster_faults(&mut faults, sizes, every);
    }
    if sizes.fleet {
        faults.extend(fleet_faults(sizes));
    }
    faults.sort_by_key(|f| f.at);
    Plan { builds, faults }
}

/// The kinds of [`draw_fault`] that are cluster-wide ([`Fault::cluster_wide`]).
const CLUSTER_KINDS: std::ops::RangeInclusive<usize> = 3..=9;

/// Keeps the drawn cluster-wide faults to as many as the window holds `every`s (the first drawn
/// stay, so those kept are spread over the window at random); each one over is replaced, at its
/// time, by a fault of one host or build drawn from a stream of its own. Drawn uniformly, 3,000
/// faults an hour struck a controller kill every 31 s and an API outage or refusal every 16 s
/// (`scripts/chaos-fleet --bench --seed 52361`): with 10,000 runs in the namespace, the
/// controller's catch-up never ended before the next kill.
fn cap_cluster_faults(faults: &mut [Planned], sizes: &Sizes, every: Duration) {
    let mut rng = StdRng::seed_from_u64(sizes.seed ^ 0xC1A5_7E00_0000_0029);
    let allowed = (sizes.window.as_millis() / every.as_millis().max(1)) as usize;
    let mut kept = 0;
    for f in faults.iter_mut().filter(|f| f.fault.cluster_wide()) {
        if kept < allowed {
            kept += 1;
            continue;
        }
        let kind = loop {
            let k = rng.random_range(0..FAULT_KINDS);
            if !CLUSTER_KINDS.contains(&k) {
                break k;
            }
        };
        f.fault = draw_fault(&mut rng, kind, sizes.hosts.max(1), sizes.builds.max(1));
    }
}

/// The fleet-level faults of a window, from a random stream of their own (the drawn faults of a
/// seed stay the same with or without them): a rack of a random 20 % of the hosts (at least one)
/// cut off from the API in each third of the window for 10-30 s; the API saturated (5-20 ms a
/// request, one at a time) from a random time in the first half for a quarter of the window (at
/// most 3 minutes); a rolling agent upgrade starting in the first half, spread over a third of
/// the window; the leading controller replica killed within 3 s of each rack's return.
pub fn fleet_faults(sizes: &Sizes) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(sizes.seed ^ 0xF1EE_7000_0000_0029);
    let window = sizes.window.as_millis().max(1000) as u64;
    let hosts = sizes.hosts.max(1);
    let rack = (hosts / 5).max(1);
    let mut out = vec![];
    for third in 0..3 {
        let mut all: Vec<usize> = (0..hosts).collect();
        let mut picked = vec![];
        for _ in 0..rack {
            picked.push(all.swap_remove(rng.random_range(0..all.len())));
        }
        picked.sort();
        out.push(Planned {
            at: Duration::from_millis(rng.random_range(window * third / 3..window * (third + 1) / 3)),
            fault: Fault::RackPartition {
                hosts: picked,
                for_: ms(&mut rng, 10_000, 30_000),
            },
        });
    }
    out.push(Planned {
        at: Duration::from_millis(rng.random_range(window / 20..window / 2)),
        fault: Fault::ApiBusy {
            busy: ms(&mut rng, 5, 20),
            for_: Duration::from_millis((window / 4).min(180_000)),
        },
    });
    out.push(Planned {
        at: Duration::from_millis(rng.random_range(window / 20..window / 2)),
        fault: Fault::RollingUpgrade {
            gap: Duration::from_millis(window / 3 / hosts as u64),
        },
    });
    // The controller's leader killed while it catches up: within 3 s of each rack's return,
    // when that rack's agents deliver what they held back.
    let rack_ends: Vec<Duration> = out
        .iter()
        .filter(|p| matches!(p.fault, Fault::RackPartition { .. }))
        .map(|p| p.at + p.fault.duration())
        .collect();
    for end in rack_ends {
        out.push(Planned {
            at: end + ms(&mut rng, 0, 3_000),
            fault: Fault::ControllerFailover {
                down: ms(&mut rng, 20_000, 60_000),
            },
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::discriminant;

    fn sizes(seed: u64) -> Sizes {
        Sizes {
            seed,
            builds: 8,
            hosts: 2,
            window: Duration::from_secs(60),
            faults: 12,
            fleet: false,
            cluster_every: None,
        }
    }

    #[test]
    fn the_cluster_kinds_are_exactly_the_cluster_wide_faults() {
        let mut rng = StdRng::seed_from_u64(1);
        for kind in 0..FAULT_KINDS {
            let f = draw_fault(&mut rng, kind, 4, 4);
            assert_eq!(CLUSTER_KINDS.contains(&kind), f.cluster_wide(), "{kind}: {f}");
        }
    }

    #[test]
    fn cluster_wide_faults_are_capped_to_one_per_interval_and_the_rest_replaced() {
        let many = Sizes {
            faults: 600,
            hosts: 10,
            ..sizes(9)
        };
        let plain = plan(&many);
        let capped = plan(&Sizes {
            cluster_every: Some(Duration::from_secs(10)),
            ..many.clone()
        });
        let cluster = |p: &Plan| p.faults.iter().filter(|f| f.fault.cluster_wide()).count();
        assert!(cluster(&plain) > 100, "uniform draws: {}", cluster(&plain));
        assert_eq!(cluster(&capped), 6, "60 s window, one per 10 s");
        assert_eq!(capped.faults.len(), plain.faults.len(), "replaced, not dropped");
        assert_eq!(capped.builds, plain.builds);
        let times = |p: &Plan| p.faults.iter().map(|f| f.at).collect::<Vec<_>>();
        assert_eq!(times(&capped), times(&plain), "the same times");
        let hosts_and_builds = |p: &Plan| p.faults.iter().filter(|f| !f.fault.cluster_wide()).count();
        assert_eq!(hosts_and_builds(&capped), 600 - 6);
    }

    #[test]
    fn fleet_faults_add_to_the_drawn_ones_without_changing_them() {
        let plain = plan(&sizes(5));
        let fleet = plan(&Sizes {
            fleet: true,
            hosts: 20,
            ..sizes(5)
        });
        let plain20 = plan(&Sizes { hosts: 20, ..sizes(5) });
        assert_eq!(plain.builds, fleet.builds);
        let fleet_only: Vec<&Planned> = fleet.faults.iter().filter(|f| !plain20.faults.contains(f)).collect();
        assert_eq!(fleet.faults.len(), plain20.faults.len() + 8);
        assert_eq!(fleet_only.len(), 8, "{fleet_only:?}");
        let racks: Vec<&Vec<usize>> = fleet_only
            .iter()
            .filter_map(|f| match &f.fault {
                Fault::RackPartition { hosts, .. } => Some(hosts),
                _ => None,
            })
            .collect();
        assert_eq!(racks.len(), 3);
        for rack in racks {
            assert_eq!(rack.len(), 4, "20 % of 20 hosts");
            assert!(rack.windows(2).all(|w| w[0] < w[1] && w[1] < 20), "{rack:?}");
        }
        assert!(fleet_only.iter().any(|f| matches!(f.fault, Fault::ApiBusy { .. })));
        let rack_ends: Vec<Duration> = fleet_only
            .iter()
            .filter(|f| matches!(f.fault, Fault::RackPartition { .. }))
            .map(|f| f.at + f.fault.duration())
            .collect();
        let failovers: Vec<Duration> = fleet_only
            .iter()
            .filter(|f| matches!(f.fault, Fault::ControllerFailover { .. }))
            .map(|f| f.at)
            .collect();
        assert_eq!(failovers.len(), 3, "one per rack");
        assert!(
            failovers.iter().all(|at| rack_ends
                .iter()
                .any(|end| *at >= *end && *at <= *end + Duration::from_secs(3))),
            "each within 3 s of a rack's return: {failovers:?} {rack_ends:?}"
        );
        assert!(
            fleet_only
                .iter()
                .any(|f| matches!(f.fault, Fault::RollingUpgrade { .. }))
        );
        assert!(
            fleet
                .faults
                .iter()
                .filter(|f| !matches!(f.fault, Fault::ControllerFailover { .. }))
                .all(|f| f.at < Duration::from_secs(60))
        );
        // One host: a rack of one.
        let one = fleet_faults(&Sizes {
            fleet: true,
            hosts: 1,
            ..sizes(5)
        });
        assert!(one.iter().all(|f| match &f.fault {
            Fault::RackPartition { hosts, .. } => hosts == &vec![0],
            _ => true,
        }));
    }

    #[test]
    fn the_same_seed_gives_the_same_plan_and_another_seed_another() {
        assert_eq!(plan(&sizes(7)), plan(&sizes(7)));
        assert_ne!(plan(&sizes(7)), plan(&sizes(8)));
    }

    #[test]
    fn plans_stay_in_the_window_and_name_real_hosts_and_builds() {
        let s = sizes(3);
        let p = plan(&s);
        assert_eq!(p.builds.len(), 8);
        assert_eq!(p.faults.len(), 12);
        assert!(p.builds.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(p.faults.iter().all(|f| f.at < s.window));
        for f in &p.faults {
            match &f.fault {
                Fault::Cancel { build } | Fault::DeleteOwner { build } => assert!(*build < 8),
                Fault::KillAgent { host, .. } | Fault::FreezeAgent { host, .. } => assert!(*host < 2),
                _ => {}
            }
        }
    }

    #[test]
    fn every_fault_kind_is_drawn() {
        let mut seen = vec![];
        for seed in 0..20 {
            for f in plan(&Sizes {
                faults: 40,
                ..sizes(seed)
            })
            .faults
            {
                let d = discriminant(&f.fault);
                let kill = match f.fault {
                    Fault::KillAgent { kill, .. } => Some(kill),
                    _ => None,
                };
                if !seen.contains(&(d, kill)) {
                    seen.push((d, kill));
                }
            }
        }
        // 16 variants, KillAgent counted once per kill mode (4).
        assert_eq!(seen.len(), FAULT_KINDS, "{seen:?}");
    }
}
