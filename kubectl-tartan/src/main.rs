//! `kubectl-tartan`: run as `kubectl tartan …` (kubectl finds it on `PATH`).

use clap::{Parser, Subcommand};
use kubectl_tartan::{Connection, LogsOptions};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "kubectl tartan", about = "Tartan macOS builds: step logs, state, attempts")]
struct Cli {
    /// Namespace (default: the context's).
    #[arg(short = 'n', long, global = true)]
    namespace: Option<String>,
    /// Kubeconfig file (default: $KUBECONFIG, else ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context (default: the current one).
    #[arg(long, global = true)]
    context: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the step logs of a CustomRun or MacBuild (its current attempt), read from the
    /// artifact store it ships them to, with your own credentials (AWS_* variables,
    /// ~/.aws/credentials; AWS_ENDPOINT_URL for S3-compatible stores).
    Logs {
        /// CustomRun or MacBuild name.
        run: String,
        /// Follow: print new output as it is shipped, until the build is terminal.
        #[arg(short = 'f', long)]
        follow: bool,
        /// Only this step (also `_checkout`, `_tart-run`); default: the checkout and every step.
        #[arg(long)]
        step: Option<String>,
        /// Seconds between polls while following.
        #[arg(long, default_value_t = 1.0)]
        poll_seconds: f64,
        /// Print the logs' bytes as they are. By default terminal escape sequences (colours,
        /// titles, clipboard writes, …) and control characters other than newline and tab are
        /// removed, as in the CustomRun's message.
        #[arg(long)]
        raw: bool,
        /// Attempt N's logs (1 is the first; see `describe`) instead of the current attempt's.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        attempt: Option<u32>,
    },
    /// One line per MacBuild: phase, attempt, agent, age, logs location.
    Get {
        /// One CustomRun or MacBuild (default: all in the namespace).
        run: Option<String>,
    },
    /// A MacBuild's state, attempts, conditions and results, and its timeline (from its Events,
    /// else its status) with the time between steps.
    Describe {
        /// CustomRun or MacBuild name.
        run: String,
        /// Only attempt N in the attempts and the timeline.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        attempt: Option<u32>,
    },
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let connection = Connection {
        namespace: cli.namespace,
        kubeconfig: cli.kubeconfig,
        context: cli.context,
    };
    let result = async {
        let (client, ns) = kubectl_tartan::connect(&connection).await?;
        let out = std::io::stdout().lock();
        match cli.command {
            Command::Logs {
                run,
                follow,
                step,
                poll_seconds,
                raw,
                attempt,
            } => {
                if !(poll_seconds.is_finite() && (0.1..=60.0).contains(&poll_seconds)) {
                    anyhow::bail!("--poll-seconds must be 0.1 to 60, not {poll_seconds}");
                }
                let opts = LogsOptions {
                    run,
                    follow,
                    step,
                    poll: Duration::from_secs_f64(poll_seconds),
                    raw,
                    attempt,
                };
                kubectl_tartan::logs(&client, &ns, &opts, out).await
            }
            Command::Get { run } => kubectl_tartan::get(&client, &ns, run.as_deref(), out).await,
            Command::Describe { run, attempt } => kubectl_tartan::describe(&client, &ns, &run, attempt, out).await,
        }
    }
    .await;
    if let Err(e) = result {
        // Errors quote what agents and builds wrote (status.logs, names): printed cleaned, as
        // everything else this command shows.
        eprintln!("error: {}", tartan_api::text::clean_str(&format!("{e:#}"), 16 << 10));
        std::process::exit(1);
    }
}
