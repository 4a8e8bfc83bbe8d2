//! `kubectl tartan`: a kubectl plugin for Tartan builds.
//!
//! * `kubectl tartan logs RUN [-f] [--step S] [--attempt N]`: the step logs of a CustomRun's (or
//!   MacBuild's) current attempt, or attempt N's, read from where the agent ships them
//!   (`status.logs`); with `-f` it follows the build until it is terminal, trying failed reads
//!   again with backoff.
//! * `kubectl tartan get [RUN]`: one line per MacBuild.
//! * `kubectl tartan describe RUN [--attempt N]`: a MacBuild's state, attempts, conditions,
//!   results and timeline.
//!
//! It follows kubectl's conventions: `--namespace/-n`, `--kubeconfig`, `--context`, else
//! `$KUBECONFIG`/`~/.kube/config` and its current context and namespace.

pub mod reads;
pub mod store;

use anyhow::Context as _;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;
use tartan_api::logs::safe_name;
use tartan_api::{CUSTOM_RUN_LABEL, MacBuild, Phase};

/// kubectl's connection flags.
#[derive(Clone, Debug, Default)]
pub struct Connection {
    pub namespace: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub context: Option<String>,
}

/// A client and the namespace to work in, as kubectl would pick them.
pub async fn connect(c: &Connection) -> anyhow::Result<(kube::Client, String)> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let options = KubeConfigOptions {
        context: c.context.clone(),
        ..Default::default()
    };
    let config = match &c.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &options)
                .await
                .with_context(|| format!("using kubeconfig {}", path.display()))?
        }
        None if c.context.is_some() => kube::Config::from_kubeconfig(&options)
            .await
            .context("loading the kubeconfig")?,
        None => kube::Config::infer()
            .await
            .context("finding a kubeconfig or in-cluster config")?,
    };
    let namespace = c.namespace.clone().unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config).context("making the Kubernetes client")?;
    Ok((client, namespace))
}

fn customruns(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let resource = ApiResource {
        group: "tekton.dev".into(),
        version: "v1beta1".into(),
        api_version: "tekton.dev/v1beta1".into(),
        kind: "CustomRun".into(),
        plural: "customruns".into(),
    };
    Api::namespaced_with(client.clone(), ns, &resource)
}

/// What a name finds: its MacBuild, a CustomRun whose MacBuild the controller has not created
/// yet, or nothing.
enum Lookup {
    Found(Box<MacBuild>),
    RunWithoutBuild,
    Nothing,
}

/// How long `logs -f` waits for the controller to create a new CustomRun's MacBuild.
const MACBUILD_WAIT: Duration = Duration::from_secs(60);

/// The MacBuild of `run`: the MacBuild of that name (the controller names it after its
/// CustomRun), else one labelled with the CustomRun's name.
async fn lookup_build(client: &kube::Client, ns: &str, run: &str) -> anyhow::Result<Lookup> {
    let api: Api<MacBuild> = Api::namespaced(client.clone(), ns);
    if let Some(mb) = api
        .get_opt(run)
        .await
        .with_context(|| format!("reading MacBuild {ns}/{run}"))?
    {
        return Ok(Lookup::Found(Box::new(mb)));
    }
    let labelled = api
        .list(&ListParams::default().labels(&format!("{CUSTOM_RUN_LABEL}={run}")))
        .await
        .with_context(|| format!("listing the MacBuilds of CustomRun {ns}/{run}"))?;
    if let Some(mb) = labelled.items.into_iter().next() {
        return Ok(Lookup::Found(Box::new(mb)));
    }
    Ok(match customruns(client, ns).get_opt(run).await {
        Ok(Some(_)) => Lookup::RunWithoutBuild,
        _ => Lookup::Nothing,
    })
}

/// The MacBuild of `run` ([`lookup_build`]), or a clear error. With `wait`, a CustomRun whose
/// MacBuild does not exist yet is looked at again every `poll` for up to that long (a run
/// followed right after it was created).
pub async fn find_build(
    client: &kube::Client,
    ns: &str,
    run: &str,
    wait: Option<(Duration, Duration)>,
) -> anyhow::Result<MacBuild> {
    let started = std::time::Instant::now();
    loop {
        match lookup_build(client, ns, run).await? {
            Lookup::Found(mb) => return Ok(*mb),
            Lookup::Nothing => {
                anyhow::bail!("no such run: neither a CustomRun nor a MacBuild named {run:?} in namespace {ns}")
            }
            Lookup::RunWithoutBuild => match wait {
                Some((limit, poll)) if started.elapsed() < limit => tokio::time::sleep(poll).await,
                Some((limit, _)) => anyhow::bail!(
                    "CustomRun {ns}/{run} still has no MacBuild after {limit:?}: is the tartan controller running? (kubectl -n tartan-system logs deploy/tartan-controller)"
                ),
                None => anyhow::bail!(
                    "CustomRun {ns}/{run} has no MacBuild yet (the tartan controller creates it); try again shortly, or use -f to wait"
                ),
            },
        }
    }
}

fn phase(mb: &MacBuild) -> Option<Phase> {
    mb.status.as_ref().and_then(|s| s.phase)
}

fn is_terminal(mb: &MacBuild) -> bool {
    phase(mb).is_some_and(Phase::is_terminal)
}

fn logs_location(mb: &MacBuild) -> Option<String> {
    mb.status.as_ref().and_then(|s| s.logs.clone())
}

/// The step logs shown by default: the source checkout's (if the build checks out a source),
/// then each step's, in the order they run; named as the agent names their files.
pub fn default_steps(mb: &MacBuild) -> Vec<String> {
    let mut steps = Vec::new();
    if mb.spec.source.is_some() {
        steps.push("_checkout".to_string());
    }
    steps.extend(mb.spec.steps.iter().map(|s| safe_name(&s.name)));
    steps
}

/// What `logs` prints and how.
#[derive(Clone, Debug)]
pub struct LogsOptions {
    pub run: String,
    pub follow: bool,
    /// One step only (any shipped log, e.g. `_tart-run`); else [`default_steps`] with headers.
    pub step: Option<String>,
    /// Pause between polls while following.
    pub poll: Duration,
    /// Print the bytes as shipped. By default they are cleaned as the CustomRun's message is
    /// ([`tartan_api::text::Cleaner`]): a build's output must not reach the reader's terminal
    /// with escape sequences (clipboard writes, window titles, clear-screen, device queries).
    pub raw: bool,
    /// Attempt N's logs (1-based, `status.attempts`) instead of the current attempt's; following
    /// stays on that attempt.
    pub attempt: Option<u32>,
}

/// Where attempt `number`'s logs are: the current attempt's `status.logs` is
/// `<destination>/<vm>/logs/` (`tartan_api::logs`), and every attempt of a build ships under the
/// same destination, in the folder of its own VM.
pub fn attempt_logs_location(status: &tartan_api::MacBuildStatus, number: u32) -> anyhow::Result<String> {
    let numbers = || {
        status
            .attempts
            .iter()
            .map(|a| a.number.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(attempt) = status.attempts.iter().find(|a| a.number == number) else {
        anyhow::bail!(
            "no attempt {number}: the build has {}",
            if status.attempts.is_empty() {
                "no attempts yet".to_string()
            } else {
                format!("attempts {}", numbers())
            }
        );
    };
    let Some(current) = status.logs.as_deref() else {
        anyhow::bail!("no logs location: the build's agent names no artifact destination (status.logs is empty)");
    };
    let current_vm = status
        .current_attempt()
        .map(|a| a.vm.as_str())
        .or(status.vm.as_deref())
        .unwrap_or_default();
    let suffix = tartan_api::logs::logs_prefix(current_vm);
    match current.strip_suffix(&suffix) {
        Some(destination) if !current_vm.is_empty() => {
            Ok(format!("{destination}{}", tartan_api::logs::logs_prefix(&attempt.vm)))
        }
        _ => anyhow::bail!(
            "status.logs {current:?} does not end in {suffix:?} (the current attempt's VM folder), so attempt {number}'s folder cannot be told from it"
        ),
    }
}

/// While following: how long to wait after the `n`th failure in a row (1-based) to read the
/// MacBuild or the store, or `None` once it is time to give up.
pub fn follow_retry_wait(n: u32) -> Option<Duration> {
    (n <= FOLLOW_MAX_FAILURES).then(|| {
        FOLLOW_RETRY_FIRST
            .saturating_mul(1u32 << (n - 1).min(16))
            .min(FOLLOW_RETRY_MAX)
    })
}

/// The first wait after a failed read while following; it doubles with each failure in a row.
pub const FOLLOW_RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two tries.
pub const FOLLOW_RETRY_MAX: Duration = Duration::from_secs(30);
/// Failures in a row after which `logs -f` gives up (about 3.5 minutes of waiting in all).
pub const FOLLOW_MAX_FAILURES: u32 = 10;

/// Most bytes fetched, and held, at once: a log of any size goes through this much memory.
pub const READ_CHUNK: u64 = 1 << 20;

/// Writes what it is given to `out`, with `==> step <==` headers when `headers` is set and the
/// step changes (as `tail` does for several files); unless `raw`, each step's bytes go through a
/// cleaner of their own (a sequence may span reads, never steps).
struct Printer<W: Write> {
    out: W,
    headers: bool,
    raw: bool,
    last: Option<String>,
    cleaners: std::collections::BTreeMap<String, tartan_api::text::Cleaner>,
}

impl<W: Write> Printer<W> {
    fn print(&mut self, step: &str, bytes: &[u8]) -> std::io::Result<()> {
        let cleaned;
        let bytes = if self.raw {
            bytes
        } else {
            cleaned = self.cleaners.entry(step.to_string()).or_default().push(bytes);
            cleaned.as_bytes()
        };
        if bytes.is_empty() {
            return Ok(());
        }
        if self.headers && self.last.as_deref() != Some(step) {
            if self.last.is_some() {
                self.out.write_all(b"\n")?;
            }
            writeln!(self.out, "==> {step} <==")?;
            self.last = Some(step.to_string());
        }
        self.out.write_all(bytes)?;
        self.out.flush()
    }

    /// A new attempt's logs start: new streams.
    fn restart(&mut self) {
        self.last = None;
        self.cleaners.clear();
    }
}

/// `kubectl tartan logs`: prints the step logs; following, polls the MacBuild and the store
/// until the MacBuild is terminal (then prints what the agent finished and stops).
pub async fn logs(client: &kube::Client, ns: &str, opts: &LogsOptions, out: impl Write) -> anyhow::Result<()> {
    let wait = opts.follow.then_some((MACBUILD_WAIT, opts.poll));
    let mut mb = find_build(client, ns, &opts.run, wait).await?;
    let name = mb.metadata.name.clone().unwrap_or_default();
    let api: Api<MacBuild> = Api::namespaced(client.clone(), ns);
    let mut printer = Printer {
        out,
        headers: opts.step.is_none(),
        raw: opts.raw,
        last: None,
        cleaners: Default::default(),
    };
    let mut location = logs_location(&mb);
    while location.is_none() {
        if is_terminal(&mb) {
            anyhow::bail!(
                "MacBuild {ns}/{name} ended ({}) with no logs location: neither it nor its agent names an artifact destination, so its step logs stayed on the Mac (<state_dir>/logs/<vm>/)",
                phase(&mb).map_or("?", |p| p.as_str())
            );
        }
        if !opts.follow {
            anyhow::bail!(
                "no logs location yet: MacBuild {ns}/{name} is {}; its agent sets status.logs when the attempt starts (use -f to wait)",
                phase(&mb).map_or("not claimed yet", |p| p.as_str())
            );
        }
        tokio::time::sleep(opts.poll).await;
        mb = reread_retrying(&api, &name, &mut 0).await?;
        location = logs_location(&mb);
    }
    let mut location = location.expect("loop ends with one");
    if let Some(n) = opts.attempt {
        location = attempt_logs_location(mb.status.as_ref().expect("it has status.logs"), n)?;
    }
    let mut offsets: std::collections::BTreeMap<String, u64> = Default::default();
    let mut failures = 0u32;
    loop {
        // Terminal is read before the store: the agent finishes the logs before the build
        // turns terminal, so this pass sees all of them.
        let terminal = is_terminal(&mb);
        let store = store::Store::open(&location)?;
        let steps = match &opts.step {
            Some(s) => vec![s.clone()],
            None => default_steps(&mb),
        };
        // What was printed moved the offsets: a pass retried after a failure resumes where the
        // last one stopped, so no line is printed twice.
        let listing = match print_pass(&store, &steps, &mut offsets, &mut printer).await {
            Ok(PassEnd::Printed(listing)) => listing,
            Ok(PassEnd::ReaderGone) => return Ok(()),
            Err(PassError::Write(e)) => return Err(e).context("writing the logs"),
            Err(PassError::Store(e)) => {
                if !opts.follow {
                    return Err(e);
                }
                failures += 1;
                retry_or_give_up(failures, &e).await?;
                mb = reread_retrying(&api, &name, &mut failures).await?;
                continue;
            }
        };
        if terminal || !opts.follow {
            if let Some(s) = &opts.step
                && !listing
                    .names
                    .iter()
                    .any(|(n, _)| reads::plan(&[(n.clone(), 0)], s, 0).shipped)
            {
                anyhow::bail!("no log named {s:?} was shipped to {location}");
            }
            if terminal && !listing.unfinished.is_empty() {
                eprintln!(
                    "note: the agent did not finish the logs of {} (the store failed or the agent stopped); they may be incomplete",
                    listing.unfinished.join(", ")
                );
            }
            return Ok(());
        }
        failures = 0;
        tokio::time::sleep(opts.poll).await;
        mb = reread_retrying(&api, &name, &mut failures).await?;
        if opts.attempt.is_none()
            && let Some(now) = logs_location(&mb)
            && now != location
        {
            eprintln!(
                "note: a new attempt started; its logs are at {}",
                tartan_api::text::clean_str(&now, 4096)
            );
            location = now;
            offsets.clear();
            printer.restart();
        }
    }
}

/// What one pass over the store printed: the store's listing, and the steps whose log was
/// shipped but not finished.
struct Listing {
    names: Vec<(String, u64)>,
    unfinished: Vec<String>,
}

enum PassEnd {
    Printed(Listing),
    /// The reader went away (`| head`): the command ends quietly.
    ReaderGone,
}

enum PassError {
    /// Listing or reading the store failed: worth another try while following.
    Store(anyhow::Error),
    /// Writing to stdout failed.
    Write(std::io::Error),
}

/// Prints what is new in each step's log since `offsets`, moving them by what was printed.
async fn print_pass<W: Write>(
    store: &store::Store,
    steps: &[String],
    offsets: &mut std::collections::BTreeMap<String, u64>,
    printer: &mut Printer<W>,
) -> Result<PassEnd, PassError> {
    let listing = store.list().await.map_err(PassError::Store)?;
    let mut unfinished = Vec::new();
    for step in steps {
        let offset = offsets.entry(step.clone()).or_insert(0);
        let plan = reads::plan(&listing, step, *offset);
        for read in &plan.reads {
            // In pieces of at most READ_CHUNK: memory stays bounded whatever the log's size.
            let mut from = read.from;
            while from < read.to {
                let to = read.to.min(from + READ_CHUNK);
                let bytes = store.get(&read.name, from, to).await.map_err(PassError::Store)?;
                if bytes.is_empty() {
                    // Shorter than listed (replaced meanwhile): read again at the next pass.
                    break;
                }
                from += bytes.len() as u64;
                *offset += bytes.len() as u64;
                if let Err(e) = printer.print(step, &bytes) {
                    // A closed pipe (`| head`) ends the command quietly.
                    if e.kind() == std::io::ErrorKind::BrokenPipe {
                        return Ok(PassEnd::ReaderGone);
                    }
                    return Err(PassError::Write(e));
                }
            }
        }
        if plan.shipped && !plan.complete {
            unfinished.push(step.clone());
        }
    }
    Ok(PassEnd::Printed(Listing {
        names: listing,
        unfinished,
    }))
}

/// Says on stderr that a read failed and waits before the next try, or gives up with the error.
async fn retry_or_give_up(failures: u32, error: &anyhow::Error) -> anyhow::Result<()> {
    match follow_retry_wait(failures) {
        Some(wait) => {
            eprintln!(
                "note: {}; trying again in {wait:?} (failure {failures} in a row, giving up after {FOLLOW_MAX_FAILURES})",
                tartan_api::text::clean_str(&format!("{error:#}"), 4096)
            );
            tokio::time::sleep(wait).await;
            Ok(())
        }
        None => Err(anyhow::anyhow!("{error:#}"))
            .context(format!("giving up after {FOLLOW_MAX_FAILURES} failures in a row")),
    }
}

/// [`reread`], tried again with backoff while the API fails (a deleted MacBuild is final).
async fn reread_retrying(api: &Api<MacBuild>, name: &str, failures: &mut u32) -> anyhow::Result<MacBuild> {
    loop {
        match api.get_opt(name).await {
            Ok(Some(mb)) => return Ok(mb),
            Ok(None) => anyhow::bail!("MacBuild {name} was deleted while its logs were read"),
            Err(e) => {
                *failures += 1;
                retry_or_give_up(
                    *failures,
                    &anyhow::Error::new(e).context(format!("reading MacBuild {name}")),
                )
                .await?;
            }
        }
    }
}

fn age(mb: &MacBuild) -> String {
    let Some(created) = mb.metadata.creation_timestamp.as_ref() else {
        return "-".into();
    };
    let secs = k8s_openapi::jiff::Timestamp::now()
        .duration_since(created.0)
        .as_secs()
        .max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// `kubectl tartan get [RUN]`: a table of MacBuilds (one, or all in the namespace).
pub async fn get(client: &kube::Client, ns: &str, run: Option<&str>, out: impl Write) -> anyhow::Result<()> {
    let mut text = Vec::new();
    get_raw(client, ns, run, &mut text).await?;
    write_cleaned(&text, out)
}

async fn get_raw(client: &kube::Client, ns: &str, run: Option<&str>, mut out: impl Write) -> anyhow::Result<()> {
    let builds = match run {
        Some(r) => vec![find_build(client, ns, r, None).await?],
        None => {
            let api: Api<MacBuild> = Api::namespaced(client.clone(), ns);
            api.list(&ListParams::default())
                .await
                .with_context(|| format!("listing MacBuilds in {ns}"))?
                .items
        }
    };
    if builds.is_empty() {
        anyhow::bail!("no MacBuilds in namespace {ns}");
    }
    let rows: Vec<[String; 7]> = builds
        .iter()
        .map(|mb| {
            let st = mb.status.clone().unwrap_or_default();
            // Whether the current attempt started in a warm VM of its agent's pool.
            let start = match st.vm.as_deref() {
                Some(vm) if tartan_api::is_warm_vm(vm) => "warm",
                Some(_) => "cold",
                None => "-",
            };
            [
                mb.metadata.name.clone().unwrap_or_default(),
                st.phase.map_or("-", |p| p.as_str()).to_string(),
                st.claim.as_ref().map_or("-".into(), |c| c.attempt.clone()),
                st.claim.as_ref().map_or("-".into(), |c| c.holder.clone()),
                start.to_string(),
                age(mb),
                st.logs.unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let head = ["NAME", "PHASE", "ATTEMPT", "AGENT", "START", "AGE", "LOGS"];
    let widths: Vec<usize> = (0..7)
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain([head[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[&str]| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("   ")
            .trim_end()
            .to_string()
    };
    writeln!(out, "{}", line(&head))?;
    for r in &rows {
        writeln!(out, "{}", line(&r.iter().map(String::as_str).collect::<Vec<_>>()))?;
    }
    Ok(())
}

/// `kubectl tartan describe RUN`: the MacBuild's spec in short, its state, attempts, conditions,
/// results and logs location.
pub async fn describe(
    client: &kube::Client,
    ns: &str,
    run: &str,
    attempt: Option<u32>,
    out: impl Write,
) -> anyhow::Result<()> {
    // Every field shown comes from the pipeline's author or a guest (an image param, an artifact
    // path, a message): cleaned as the logs are, so no escape reaches the reader's terminal.
    let mut text = Vec::new();
    describe_raw(client, ns, run, attempt, &mut text).await?;
    write_cleaned(&text, out)
}

/// `text` through the same cleaning as the CustomRun message (escapes, controls but `\n`/`\t`,
/// bidirectional overrides removed).
fn write_cleaned(text: &[u8], mut out: impl Write) -> anyhow::Result<()> {
    out.write_all(tartan_api::text::Cleaner::new().push(text).as_bytes())?;
    out.flush()?;
    Ok(())
}

async fn describe_raw(
    client: &kube::Client,
    ns: &str,
    run: &str,
    attempt: Option<u32>,
    mut out: impl Write,
) -> anyhow::Result<()> {
    let mb = find_build(client, ns, run, None).await?;
    let st = mb.status.clone().unwrap_or_default();
    if let Some(n) = attempt
        && !st.attempts.iter().any(|a| a.number == n)
    {
        anyhow::bail!(
            "MacBuild {ns}/{} has no attempt {n} (it has {})",
            mb.metadata.name.as_deref().unwrap_or(run),
            st.attempts.len()
        );
    }
    // The Events are best effort (they expire after an hour; reading them may be forbidden):
    // without them the timeline comes from the status alone.
    let events = match build_events(client, ns, &mb).await {
        Ok(events) => events,
        Err(e) => {
            eprintln!("note: {e:#}; the timeline shows the status only");
            Vec::new()
        }
    };
    let w = &mut out;
    writeln!(w, "Name:        {}", mb.metadata.name.as_deref().unwrap_or("-"))?;
    writeln!(w, "Namespace:   {ns}")?;
    if let Some(owner) = mb
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
    {
        writeln!(w, "Owner:       {}/{}", owner.kind, owner.name)?;
    }
    writeln!(w, "Image:       {}", mb.spec.image)?;
    writeln!(
        w,
        "Steps:       {}",
        mb.spec
            .steps
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    writeln!(w, "Phase:       {}", st.phase.map_or("-", |p| p.as_str()))?;
    if let Some(o) = st.outcome {
        writeln!(w, "Outcome:     {}", o.as_str())?;
    }
    if let Some(c) = &st.claim {
        writeln!(w, "Agent:       {} (attempt {})", c.holder, c.attempt)?;
    }
    if let Some(vm) = &st.vm {
        writeln!(w, "VM:          {vm}")?;
    }
    if let Some(d) = &st.deadline {
        writeln!(w, "Deadline:    {}", d.0)?;
    }
    writeln!(w, "Logs:        {}", st.logs.as_deref().unwrap_or("- (not shipped)"))?;
    if let Some(r) = &st.results {
        let n = |v: Option<u32>| v.map_or("-".to_string(), |n| n.to_string());
        writeln!(w, "Tests:       {}/{} passed", n(r.tests_passed), n(r.tests_total))?;
        if let Some(a) = &r.artifact_url {
            writeln!(w, "Artifacts:   {a}")?;
        }
    }
    if let Some(m) = &st.message {
        writeln!(w, "Message:     {}", m.replace('\n', "\n             "))?;
    }
    if !st.attempts.is_empty() {
        writeln!(w, "Attempts:")?;
        for a in st.attempts.iter().filter(|a| attempt.is_none_or(|n| a.number == n)) {
            writeln!(
                w,
                "  #{} {} on {}: {} {}{}",
                a.number,
                a.vm,
                a.host,
                a.outcome.map_or("running", |o| o.as_str()),
                a.reason.map_or("", |r| r.as_str()),
                a.message
                    .as_deref()
                    .map(|m| format!(" ({})", m.lines().next().unwrap_or("")))
                    .unwrap_or_default()
            )?;
        }
    }
    if !st.conditions.is_empty() {
        writeln!(w, "Conditions:")?;
        for c in &st.conditions {
            writeln!(
                w,
                "  {} {} {}: {}",
                c.type_.as_str(),
                c.status.as_str(),
                c.reason.as_str(),
                c.message.lines().next().unwrap_or("")
            )?;
        }
    }
    let entries = timeline(&mb, &events, attempt);
    if !entries.is_empty() {
        writeln!(w, "Timeline:")?;
        for line in render_timeline(&entries) {
            writeln!(w, "  {line}")?;
        }
    }
    Ok(())
}

/// One Event on a MacBuild: when, its reason, its note (the agent's journal line for a
/// transition, `#<seq> a<attempt> <from> -> <to> (<reason>) <detail>`).
#[derive(Clone, Debug, PartialEq)]
pub struct BuildEvent {
    pub time: Timestamp,
    pub reason: String,
    pub note: String,
}

async fn build_events(client: &kube::Client, ns: &str, mb: &MacBuild) -> anyhow::Result<Vec<BuildEvent>> {
    let name = mb.metadata.name.clone().unwrap_or_default();
    let uid = mb.metadata.uid.clone();
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), ns);
    let list = api
        .list(&ListParams::default())
        .await
        .with_context(|| format!("listing the Events in {ns}"))?;
    Ok(list
        .items
        .into_iter()
        // By name and, where both are known, uid: an earlier MacBuild of the same name (a
        // re-run) left Events that are not this one's.
        .filter(|e| {
            e.regarding.as_ref().is_some_and(|r| {
                r.kind.as_deref() == Some("MacBuild")
                    && r.name.as_deref() == Some(name.as_str())
                    && (r.uid.is_none() || uid.is_none() || r.uid == uid)
            })
        })
        .filter_map(|e| {
            let time = e
                .event_time
                .as_ref()
                .map(|t| t.0)
                .or(e.deprecated_first_timestamp.as_ref().map(|t| t.0))
                .or(e.metadata.creation_timestamp.as_ref().map(|t| t.0))?;
            Some(BuildEvent {
                time,
                reason: e.reason.unwrap_or_default(),
                note: e.note.unwrap_or_default(),
            })
        })
        .collect())
}

/// The attempt an agent's Event is about, from its note's `a<N>` (none for other Events).
fn event_attempt(note: &str) -> Option<u32> {
    let mut words = note.split_whitespace();
    words.next().filter(|w| w.starts_with('#'))?;
    words.next()?.strip_prefix('a')?.parse().ok()
}

/// The build's history, oldest first: its creation, then the agent's Events (each transition:
/// claimed, admitted, booted, running the steps, retiring, retired) when there are any, else what
/// the status keeps (claimed, each attempt's admission and VM deletion, VM ready, the result).
/// With `attempt`, only what is about that attempt. Each entry: when, which attempt, what.
pub fn timeline(mb: &MacBuild, events: &[BuildEvent], attempt: Option<u32>) -> Vec<(Timestamp, Option<u32>, String)> {
    let mut out: Vec<(Timestamp, Option<u32>, String)> = Vec::new();
    if let Some(created) = &mb.metadata.creation_timestamp {
        out.push((created.0, None, "created".to_string()));
    }
    if events.is_empty() {
        let st = mb.status.clone().unwrap_or_default();
        let current = st.current_attempt().map(|a| a.number);
        let turned = |type_: tartan_api::ConditionType| {
            st.condition(type_)
                .filter(|c| c.status != tartan_api::ConditionStatus::Unknown)
                .map(|c| (c.last_transition_time.0, c))
        };
        if let Some((t, c)) = turned(tartan_api::ConditionType::Claimed) {
            let first = st.attempts.first().map(|a| a.number);
            out.push((t, first, format!("claimed: {}", c.message)));
        }
        for a in &st.attempts {
            if let Some(t) = &a.started_at {
                out.push((
                    t.0,
                    Some(a.number),
                    format!("attempt {} admitted on {} (VM {})", a.number, a.host, a.vm),
                ));
            }
            if let Some(t) = &a.finished_at {
                out.push((
                    t.0,
                    Some(a.number),
                    format!(
                        "attempt {} retired, VM deleted: {} {}",
                        a.number,
                        a.outcome.map_or("-", |o| o.as_str()),
                        a.reason.map_or("", |r| r.as_str())
                    )
                    .trim_end()
                    .to_string(),
                ));
            }
        }
        if let Some((t, c)) = turned(tartan_api::ConditionType::VMReady)
            && c.status == tartan_api::ConditionStatus::True
        {
            out.push((t, current, format!("VM ready, steps running: {}", c.message)));
        }
        if let Some((t, c)) = turned(tartan_api::ConditionType::Succeeded) {
            out.push((
                t,
                current,
                format!("result: Succeeded={} {}", c.status.as_str(), c.reason.as_str()),
            ));
        }
    } else {
        for e in events {
            out.push((e.time, event_attempt(&e.note), format!("{}: {}", e.reason, e.note)));
        }
    }
    // Stable: entries of one instant keep their order (creation first, then the journal's).
    out.sort_by_key(|(t, _, _)| *t);
    if let Some(n) = attempt {
        out.retain(|(_, a, _)| *a == Some(n));
    }
    out
}

/// `<time>  <since the previous entry>  <what>`, the first without a duration, and a last line
/// with the whole span.
pub fn render_timeline(entries: &[(Timestamp, Option<u32>, String)]) -> Vec<String> {
    let mut lines = Vec::new();
    let mut previous: Option<Timestamp> = None;
    for (t, _, what) in entries {
        let since = previous.map_or_else(String::new, |p| format!("+{}", short_duration(t.duration_since(p))));
        lines.push(format!("{t}  {since:<8} {}", what.lines().next().unwrap_or("")));
        previous = Some(*t);
    }
    if let (Some((first, _, _)), Some((last, _, _))) = (entries.first(), entries.last())
        && entries.len() > 1
    {
        lines.push(format!("({} in all)", short_duration(last.duration_since(*first))));
    }
    lines
}

/// `850ms`, `42s`, `3m07s`, `2h05m`.
fn short_duration(d: SignedDuration) -> String {
    let ms = d.as_millis().max(0);
    let s = ms / 1000;
    match s {
        _ if ms < 1000 => format!("{ms}ms"),
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn build(status: serde_json::Value) -> MacBuild {
        serde_json::from_value(json!({
            "apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild",
            "metadata": {"name": "b1", "namespace": "ci", "creationTimestamp": "2026-10-05T02:00:00Z"},
            "spec": {"image": "ghcr.io/x/y:1", "steps": [{"name": "build", "run": ["make"]}]},
            "status": status,
        }))
        .unwrap()
    }

    fn attempts() -> serde_json::Value {
        json!([
            {"number": 1, "id": "b1#1", "vm": "mb-ci-b1-0001", "host": "mac-1", "outcome": "Interrupted",
             "reason": "AgentRestarted", "startedAt": "2026-10-05T02:00:05Z", "finishedAt": "2026-10-05T02:03:00Z"},
            {"number": 2, "id": "b1#2", "vm": "mb-ci-b1-0002", "host": "mac-2", "startedAt": "2026-10-05T02:03:30Z"},
        ])
    }

    #[test]
    fn an_attempts_logs_are_in_its_own_vm_folder_under_the_same_destination() {
        let status = |logs: Option<&str>| {
            serde_json::from_value::<tartan_api::MacBuildStatus>(json!({
                "attempts": attempts(), "vm": "mb-ci-b1-0002", "logs": logs,
            }))
            .unwrap()
        };
        let s3 = status(Some("s3://ci-logs/builds/mb-ci-b1-0002/logs/"));
        assert_eq!(
            attempt_logs_location(&s3, 1).unwrap(),
            "s3://ci-logs/builds/mb-ci-b1-0001/logs/"
        );
        assert_eq!(
            attempt_logs_location(&s3, 2).unwrap(),
            "s3://ci-logs/builds/mb-ci-b1-0002/logs/"
        );
        let err = attempt_logs_location(&s3, 3).unwrap_err().to_string();
        assert!(err.contains("no attempt 3") && err.contains("attempts 1, 2"), "{err}");
        let err = attempt_logs_location(&status(None), 1).unwrap_err().to_string();
        assert!(err.contains("no logs location"), "{err}");
        let odd = status(Some("file:///srv/logs/elsewhere/"));
        let err = attempt_logs_location(&odd, 1).unwrap_err().to_string();
        assert!(err.contains("does not end in \"mb-ci-b1-0002/logs/\""), "{err}");
        let none: tartan_api::MacBuildStatus = serde_json::from_value(json!({})).unwrap();
        assert!(
            attempt_logs_location(&none, 1)
                .unwrap_err()
                .to_string()
                .contains("no attempts yet")
        );
    }

    #[test]
    fn follow_retries_double_up_to_a_cap_then_give_up() {
        let waits: Vec<Option<u64>> = (1..=12).map(|n| follow_retry_wait(n).map(|d| d.as_secs())).collect();
        assert_eq!(
            waits,
            [
                Some(1),
                Some(2),
                Some(4),
                Some(8),
                Some(16),
                Some(30),
                Some(30),
                Some(30),
                Some(30),
                Some(30),
                None,
                None
            ]
        );
    }

    #[test]
    fn the_timeline_comes_from_the_events_else_the_status_and_filters_by_attempt() {
        let t = |s: &str| -> Timestamp { s.parse().unwrap() };
        let mb = build(json!({
            "attempts": attempts(),
            "conditions": [
                {"type": "Claimed", "status": "True", "reason": "SlotFree", "message": "held by mac-2",
                 "lastTransitionTime": "2026-10-05T02:00:02Z"},
                {"type": "VMReady", "status": "True", "reason": "GuestReady", "message": "tart exec ready after 13.91s",
                 "lastTransitionTime": "2026-10-05T02:04:10Z"},
                {"type": "Succeeded", "status": "Unknown", "reason": "Running", "message": "",
                 "lastTransitionTime": "2026-10-05T02:04:10Z"},
            ],
        }));
        let from_status: Vec<String> = timeline(&mb, &[], None).into_iter().map(|(_, _, w)| w).collect();
        assert_eq!(
            from_status,
            [
                "created",
                "claimed: held by mac-2",
                "attempt 1 admitted on mac-1 (VM mb-ci-b1-0001)",
                "attempt 1 retired, VM deleted: Interrupted AgentRestarted",
                "attempt 2 admitted on mac-2 (VM mb-ci-b1-0002)",
                "VM ready, steps running: tart exec ready after 13.91s",
            ]
        );
        let second: Vec<String> = timeline(&mb, &[], Some(2)).into_iter().map(|(_, _, w)| w).collect();
        assert_eq!(
            second,
            [
                "attempt 2 admitted on mac-2 (VM mb-ci-b1-0002)",
                "VM ready, steps running: tart exec ready after 13.91s"
            ]
        );

        let event = |at: &str, reason: &str, note: &str| BuildEvent {
            time: t(at),
            reason: reason.into(),
            note: note.into(),
        };
        let events = [
            event(
                "2026-10-05T02:00:20Z",
                "GuestReady",
                "#3 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s",
            ),
            event("2026-10-05T02:00:02Z", "Requested", "#1 a1 [*] -> Requested"),
            event(
                "2026-10-05T02:00:05Z",
                "SlotFree",
                "#2 a1 Requested -> Admitted (SlotFree)",
            ),
            event(
                "2026-10-05T02:03:31Z",
                "SlotFree",
                "#9 a2 Requested -> Admitted (SlotFree)",
            ),
            event(
                "2026-10-05T02:01:00Z",
                "CancelRequested",
                "cancel requested by tartan-controller",
            ),
        ];
        let entries = timeline(&mb, &events, None);
        assert_eq!(
            render_timeline(&entries),
            [
                "2026-10-05T02:00:00Z           created",
                "2026-10-05T02:00:02Z  +2s      Requested: #1 a1 [*] -> Requested",
                "2026-10-05T02:00:05Z  +3s      SlotFree: #2 a1 Requested -> Admitted (SlotFree)",
                "2026-10-05T02:00:20Z  +15s     GuestReady: #3 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s",
                "2026-10-05T02:01:00Z  +40s     CancelRequested: cancel requested by tartan-controller",
                "2026-10-05T02:03:31Z  +2m31s   SlotFree: #9 a2 Requested -> Admitted (SlotFree)",
                "(3m31s in all)",
            ]
        );
        let first: Vec<Option<u32>> = timeline(&mb, &events, Some(1)).into_iter().map(|(_, a, _)| a).collect();
        assert_eq!(first, [Some(1); 3]);
        assert_eq!(short_duration(SignedDuration::from_millis(850)), "850ms");
        assert_eq!(short_duration(SignedDuration::from_secs(7500)), "2h05m");
    }
}
