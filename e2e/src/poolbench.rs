//! `scripts/bench-pool`: what the warm pool buys and what it costs (issue 27, docs/warm-pool.md).
//! One real agent with 2 slots on the API emulator, tart-double as tart with the source's figures
//! (boot 20 s, clone 2 s by default), builds of one image arriving at random (exponential gaps,
//! seeded) at a given rate, each one step of a fixed length. For every cell of rates × pool sizes:
//! - the start: CustomRun created → its first step started (the attempt's `Running` record),
//!   cold and warm apart, p50/p99/max;
//! - the cost: the share of the host's slot-time held by warm VMs without a build (booting or
//!   waiting: `tartan_agent_warm_idle_slot_seconds_total` over 2 × the run's wall time), and builds
//!   finished per hour of the run.
//!
//! Cells run side by side (each its own stack): the figures are sleeps of tart-double and the
//! steps, not CPU.

use crate::fleet::percentile;
use crate::stack::{AgentOptions, ControllerOptions, IMAGE, Stack};
use k8s_openapi::jiff::Timestamp;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::time::{Duration, Instant};
use tartan_api::{AttemptState, Reason};

const AGENT: &str = "mac-00";

/// What one run measures.
#[derive(Clone, Debug)]
pub struct PoolBenchOptions {
    /// Arrival rates, builds per hour.
    pub rates: Vec<f64>,
    /// Pool sizes (warm VMs of the one image; 0 = no pool).
    pub pools: Vec<u8>,
    /// Builds per cell.
    pub builds: usize,
    /// The one step's length.
    pub step: Duration,
    /// tart-double: `run` until the guest answers.
    pub boot: Duration,
    /// tart-double: how long a `clone` takes.
    pub clone: Duration,
    pub seed: u64,
}

/// One cell's figures.
#[derive(Clone, Debug)]
pub struct Cell {
    pub rate: f64,
    pub pool: u8,
    /// Seconds from creation to the first step, by start.
    pub warm: Vec<f64>,
    pub cold: Vec<f64>,
    /// Warm idle slot-seconds over 2 × wall time.
    pub idle_share: f64,
    pub builds_per_hour: f64,
    pub wall: Duration,
}

/// Runs every cell (all pool sizes of a rate side by side) and returns their figures.
pub async fn run(opts: &PoolBenchOptions) -> Vec<Cell> {
    let mut cells = Vec::new();
    for &rate in &opts.rates {
        let runs = opts.pools.iter().map(|&pool| run_cell(opts, rate, pool));
        cells.extend(futures::future::join_all(runs).await);
    }
    cells
}

fn pool_section(pool: u8) -> &'static str {
    if pool == 0 {
        return "";
    }
    let text = format!("images = [{{ image = \"{IMAGE}\", size = {pool} }}]\nprepull = true\nmax_idle = \"1h\"");
    // One per cell, for the stack's life (the bench is a short-lived process).
    Box::leak(text.into_boxed_str())
}

async fn run_cell(opts: &PoolBenchOptions, rate: f64, pool: u8) -> Cell {
    let name = format!("bench-pool-r{}-p{pool}", rate.round());
    let mut s = Stack::new(&name).await;
    s.add_agent(
        AGENT,
        AgentOptions {
            slots: 2,
            boot_delay_secs: opts.boot.as_secs_f64(),
            pool: pool_section(pool),
            ..AgentOptions::default()
        },
    );
    s.tart_faults(AGENT, json!({"global": {"clone_delay_secs": opts.clone.as_secs_f64()}}));
    s.start_controller(ControllerOptions::default());
    s.start_agent(AGENT).await;
    // Steady state first: the pool full before the first build comes.
    let limit = opts.boot + opts.clone + Duration::from_secs(60);
    crate::wait::wait_for("the pool full", limit, || {
        let ready = ready_warm(&s);
        (ready >= usize::from(pool))
            .then_some(())
            .ok_or(format!("{ready} warm VM(s) ready"))
    })
    .await;
    let idle_before = idle_slot_seconds(&s);
    let started = Instant::now();
    // The same arrivals for every pool size of a rate: the cells differ only by the pool.
    let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed ^ rate.to_bits());
    let mut created = Vec::new();
    for i in 0..opts.builds {
        let name = format!("b{i}");
        let params = vec![
            ("image", json!(IMAGE)),
            ("steps", json!([format!("sleep {}", opts.step.as_secs_f64())])),
        ];
        created.push((name.clone(), Timestamp::now()));
        s.create_run(&name, &params, None).await;
        if i + 1 < opts.builds {
            // Exponential gaps: a Poisson arrival process at `rate` per hour.
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            tokio::time::sleep(Duration::from_secs_f64(-u.ln() * 3600.0 / rate)).await;
        }
    }
    for (name, _) in &created {
        s.wait_run_ended(name, Duration::from_secs(3600)).await;
    }
    let wall = started.elapsed();
    let idle = idle_slot_seconds(&s) - idle_before;
    let (mut warm, mut cold) = (Vec::new(), Vec::new());
    let journal = s.journal(AGENT);
    for (name, at) in &created {
        let running = journal.iter().find(|r| {
            r.build.as_ref().is_some_and(|b| &b.name == name)
                && r.to == AttemptState::Running
                && matches!(r.reason, Some(Reason::GuestReady | Reason::Adopted))
        });
        if let Some(r) = running {
            let secs = r.time.duration_since(*at).as_secs_f64();
            match r.reason {
                Some(Reason::Adopted) => warm.push(secs),
                _ => cold.push(secs),
            }
        }
    }
    warm.sort_by(f64::total_cmp);
    cold.sort_by(f64::total_cmp);
    s.finish().await;
    Cell {
        rate,
        pool,
        warm,
        cold,
        idle_share: idle / (2.0 * wall.as_secs_f64()),
        builds_per_hour: created.len() as f64 * 3600.0 / wall.as_secs_f64(),
        wall,
    }
}

/// Warm VMs ready, from the agent's `/metrics`.
fn ready_warm(s: &Stack) -> usize {
    metric(s, "tartan_agent_warm_vms_ready") as usize
}

fn idle_slot_seconds(s: &Stack) -> f64 {
    metric(s, "tartan_agent_warm_idle_slot_seconds_total")
}

fn metric(s: &Stack, name: &str) -> f64 {
    let (_, text) = s.agent_http(AGENT, "/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The table: one row per cell.
pub fn print(opts: &PoolBenchOptions, cells: &[Cell]) {
    println!(
        "bench-pool: 2-slot host, tart-double boot {:?} clone {:?}, {} build(s) per cell, one {:?} step, seed {}",
        opts.boot, opts.clone, opts.builds, opts.step, opts.seed
    );
    println!(
        "{:>8} {:>5} {:>6} {:>28} {:>28} {:>10} {:>10} {:>8}",
        "rate/h",
        "pool",
        "warm",
        "warm start p50/p99/max s",
        "cold start p50/p99/max s",
        "idle slot",
        "builds/h",
        "wall s"
    );
    for c in cells {
        let figures = |v: &[f64]| match (percentile(v, 50.0), percentile(v, 99.0), v.last()) {
            (Some(a), Some(b), Some(m)) => format!("{a:.2}/{b:.2}/{m:.2}"),
            _ => "-".to_string(),
        };
        println!(
            "{:>8.0} {:>5} {:>3}/{:<2} {:>28} {:>28} {:>9.1}% {:>10.1} {:>8.0}",
            c.rate,
            c.pool,
            c.warm.len(),
            c.warm.len() + c.cold.len(),
            figures(&c.warm),
            figures(&c.cold),
            c.idle_share * 100.0,
            c.builds_per_hour,
            c.wall.as_secs_f64()
        );
    }
}
