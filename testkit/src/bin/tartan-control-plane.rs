//! `tartan-control-plane start DIR | stop DIR`: a real control plane from `$KUBEBUILDER_ASSETS`
//! (see `tartan_testkit::real`) for scripts that run many test processes against one, such as
//! `scripts/e2e --cluster real` and `scripts/test-image`.
//!
//! `start` prints `API_URL=…` and `CONTROLLER_MANAGER=yes|no` and leaves in DIR the admin kubeconfig
//! (`admin.kubeconfig`), the `env` file with those two lines, logs and pid files; `stop` stops
//! the recorded processes only. `start` without `KUBEBUILDER_ASSETS` fails, naming it.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tartan_testkit::real::{Assets, ControlPlane};

#[derive(Parser)]
#[command(about = "Start or stop a real control plane from KUBEBUILDER_ASSETS")]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Starts etcd, kube-apiserver and (when present) kube-controller-manager in DIR.
    Start { dir: PathBuf },
    /// Stops what `start DIR` recorded.
    Stop { dir: PathBuf },
}

fn main() -> ExitCode {
    let result = match Args::parse().command {
        Cmd::Start { dir } => start(dir),
        Cmd::Stop { dir } => ControlPlane::stop_dir(&dir),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tartan-control-plane: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn start(dir: PathBuf) -> anyhow::Result<()> {
    let Some(assets) = Assets::from_env()? else {
        anyhow::bail!("{}", tartan_testkit::real::NO_CONTROL_PLANE);
    };
    let plane = ControlPlane::start(&assets, &dir)?;
    print!("{}", std::fs::read_to_string(dir.join("env"))?);
    plane.detach();
    Ok(())
}
