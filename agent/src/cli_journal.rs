//! `tartan-agent journal`: print the host journal in the source document's form.
//!
//! Read-only: it takes no lock and changes no file, so it is safe while the agent runs.

use anyhow::Context;
use std::io::{self, Write};
use std::path::PathBuf;
use std::time::Duration;
use tartan_agent::journal::{self, Tail};
use tartan_agent::record::Record;

/// How often `--follow` looks for new records when it has caught up.
const FOLLOW_INTERVAL: Duration = Duration::from_millis(200);

#[derive(clap::Args, Debug)]
pub struct JournalArgs {
    /// The agent's state directory (the journal lives in `<DIR>/journal/`).
    #[arg(long, value_name = "DIR", env = "TARTAN_STATE_DIR")]
    pub state_dir: PathBuf,
    /// Keep printing records as they are appended, until interrupted.
    #[arg(long)]
    pub follow: bool,
    /// Print each record as one line of JSON instead of the human form.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: JournalArgs) -> anyhow::Result<()> {
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let result = if args.follow {
        follow(&args, &mut out)
    } else {
        print_all(&args, &mut out)
    };
    match result {
        // The reader went away (`| head`): that is the end, not a failure.
        Err(e)
            if e.downcast_ref::<io::Error>()
                .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe) =>
        {
            Ok(())
        }
        other => other,
    }
}

fn print_all(args: &JournalArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let replay = journal::read_records(&args.state_dir)?;
    for warning in &replay.warnings {
        tracing::warn!("{warning}");
    }
    for record in &replay.records {
        print_record(record, args.json, out)?;
    }
    out.flush()?;
    Ok(())
}

fn follow(args: &JournalArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let mut tail = Tail::new(&args.state_dir);
    loop {
        let records = tail.poll()?;
        for record in &records {
            print_record(record, args.json, out)?;
        }
        out.flush()?;
        if records.is_empty() {
            std::thread::sleep(FOLLOW_INTERVAL);
        }
    }
}

fn print_record(record: &Record, json: bool, out: &mut impl Write) -> anyhow::Result<()> {
    if json {
        let line = serde_json::to_string(record).with_context(|| format!("encoding record #{} as JSON", record.seq))?;
        writeln!(out, "{line}")?;
    } else {
        writeln!(out, "{record}")?;
    }
    Ok(())
}
