//! `kube-emulator`: runs the Kubernetes API emulator as a process, for shell end-to-end scripts.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "A Kubernetes API emulator (plain HTTP) faithful to kube-apiserver on what Tartan uses")]
struct Args {
    /// Port to listen on (0 picks a free one; see --kubeconfig-out for the result).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// CRD manifest to install at start (repeatable; multi-document YAML allowed).
    #[arg(long = "crd")]
    crds: Vec<PathBuf>,
    /// Write a kubeconfig for this server here (kubectl and kube-rs accept it).
    #[arg(long)]
    kubeconfig_out: Option<PathBuf>,
    /// Also serve the fault-control endpoints (/emulator/*) on this port; they stay up while
    /// the API port refuses connections.
    #[arg(long)]
    control_port: Option<u16>,
    /// Watch events kept; watches from older resourceVersions get 410 Gone.
    #[arg(long, default_value_t = 10_000)]
    history: usize,
    /// Interval between watch bookmarks, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    bookmark_interval_ms: u64,
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    if let Err(e) = run(Args::parse()).await {
        eprintln!("kube-emulator: {e:#}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let options = tartan_testkit::Options {
        addr: SocketAddr::new(args.host, args.port),
        crd_files: args.crds,
        history_limit: args.history,
        bookmark_interval: Duration::from_millis(args.bookmark_interval_ms),
        control_addr: args.control_port.map(|p| SocketAddr::new(args.host, p)),
        ..Default::default()
    };
    let emu = tartan_testkit::start(options).await?;
    if let Some(path) = &args.kubeconfig_out {
        emu.write_kubeconfig(path)?;
    }
    println!("kube-emulator listening on {}", emu.url());
    if let Some(c) = emu.control_url() {
        println!("kube-emulator control on {c}");
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}
