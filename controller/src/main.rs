//! `tartan-controller`: the cluster side of Tartan (Tekton CustomRun <-> MacBuild).

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use kube::CustomResourceExt as _;
use std::io::Write as _;
use tartan_api::MacBuild;

/// The release and the git commit this binary was built from (`build-support/git-version.rs`).
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("TARTAN_GIT_COMMIT"), ")");

/// The cluster side of Tartan: turns Tekton CustomRuns into MacBuilds and reports back.
#[derive(Debug, Parser)]
#[command(name = "tartan-controller", version = VERSION, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the MacBuild CustomResourceDefinition as YAML, for `kubectl apply -f -`.
    Crd,
    /// Run the controller: CustomRun -> MacBuild, MacBuild status -> CustomRun status.
    Run(Box<tartan_controller::run::RunArgs>),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_writer(std::io::stderr)
                .init();
            tartan_serve::raise_and_log_open_files_limit();
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            runtime.block_on(tartan_controller::run::run(*args))?;
        }
        Command::Crd => {
            let yaml = serde_saphyr::to_string(&MacBuild::crd())
                .context("rendering the MacBuild CRD as YAML failed; nothing was printed")?;
            std::io::stdout()
                .lock()
                .write_all(yaml.as_bytes())
                .context("writing the MacBuild CRD to stdout failed")?;
        }
    }
    Ok(())
}
