//! `scripts/sweep`: for every crash point in the agent's sources (or those named) and each kill
//! style, a build whose agent dies there and is restarted; prints the table. Exits 0 when every
//! row passed, 1 when one failed (its files are kept), 2 on a usage error.

use clap::{Parser, ValueEnum};
use tartan_e2e::sweep::{self, Row, RowResult, Style};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Styles {
    Group,
    Alone,
    Both,
}

#[derive(Parser, Debug)]
#[command(about = "Crash the agent at every crash point, restart it, and check each build ends as it deserved")]
struct Args {
    /// Points to run (`name` or `name#n` for its n-th hit), comma-separated; default: every point
    /// in agent/src.
    #[arg(long, value_delimiter = ',')]
    points: Vec<String>,
    /// How the agent's death is completed: its process group killed (launchd), the agent alone, or both.
    #[arg(long, value_enum, default_value = "both")]
    style: Styles,
    /// The agent's slots: 1 (one build) or 2 (two builds, both in flight at the crash).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    slots: u8,
    /// Run with a warm pool of one VM: the builds come once it is ready (the first adopts it),
    /// so the points of the pool's refill, hand-over and deletion are crossed too.
    #[arg(long)]
    pool: bool,
    /// Crash each point at every one of its hits in a build, up to this many (a first build,
    /// traced, counts them); 1: each point at its first hit only.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    max_hits: u64,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let points = match sweep::scan(&sweep::agent_sources()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("sweep: the crash points in agent/src are not usable:\n{e}");
            std::process::exit(2);
        }
    };
    let styles: Vec<Style> = match args.style {
        Styles::Group => vec![Style::Group],
        Styles::Alone => vec![Style::Alone],
        Styles::Both => Style::BOTH.to_vec(),
    };
    let binary = tartan_e2e::bins::crash_agent();
    let mut rows = if args.max_hits > 1 {
        let counts = sweep::count_hits(binary.clone(), args.slots, args.pool).await;
        eprintln!("[sweep] one build passes the points: {counts:?}");
        sweep::plan_hits(&points, &counts, args.max_hits, &styles, args.slots, args.pool)
    } else {
        sweep::plan(&points, &styles, args.slots, args.pool)
    };
    if !args.points.is_empty() {
        let unknown: Vec<&String> = args
            .points
            .iter()
            .filter(|p| !points.iter().any(|q| p.split('#').next() == Some(q.name.as_str())))
            .collect();
        if !unknown.is_empty() {
            eprintln!("sweep: no such crash point in agent/src: {unknown:?}");
            std::process::exit(2);
        }
        rows = args
            .points
            .iter()
            .flat_map(|p| {
                styles.iter().map(|&style| Row {
                    point: p.clone(),
                    style,
                    slots: args.slots,
                    pool: args.pool,
                })
            })
            .collect();
    }
    eprintln!("[sweep] {} row(s) with {}", rows.len(), binary.display());
    let mut results: Vec<RowResult> = Vec::new();
    for (i, row) in rows.into_iter().enumerate() {
        let r = sweep::run_row(row, binary.clone(), i).await;
        eprint!(
            "[sweep] {}",
            sweep::table(std::slice::from_ref(&r))
                .lines()
                .nth(1)
                .unwrap_or_default()
        );
        eprintln!();
        if let Some(dir) = &r.kept {
            eprintln!("[sweep]   files kept in {}", dir.display());
        }
        results.push(r);
    }
    print!("{}", sweep::table(&results));
    let failed = results.iter().filter(|r| !r.passed()).count();
    let unreached = results.iter().filter(|r| !r.fired).count();
    let secs: f64 = results.iter().map(|r| r.secs).sum();
    println!(
        "{} row(s): {} passed, {failed} failed, {unreached} not reached; {secs:.0} s",
        results.len(),
        results.len() - failed
    );
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
