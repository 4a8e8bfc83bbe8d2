//! `kubectl tartan`: a kubectl plugin for Tartan builds.
//!
//! * `kubectl tartan logs RUN [-f] [--step S]`: the step logs of a CustomRun's (or MacBuild's)
//!   current attempt, read from where the agent ships them (`status.logs`); with `-f` it follows
//!   the build until it is terminal.
//! * `kubectl tartan get [RUN]`: one line per MacBuild.
//! * `kubectl tartan describe RUN`: a MacBuild's state, attempts, conditions and results.
//!
//! It follows kubectl's conventions: `--namespace/-n`, `--kubeconfig`, `--context`, else
//! `$KUBECONFIG`/`~/.kube/config` and its current context and namespace.

pub mod reads;
pub mod store;

use anyhow::Context as _;
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
}

/// Writes what it is given to `out`, with `==> step <==` headers when `headers` is set and the
/// step changes (as `tail` does for several files).
struct Printer<W: Write> {
    out: W,
    headers: bool,
    last: Option<String>,
}

impl<W: Write> Printer<W> {
    fn print(&mut self, step: &str, bytes: &[u8]) -> std::io::Result<()> {
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
        last: None,
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
        mb = reread(&api, &name).await?;
        location = logs_location(&mb);
    }
    let mut location = location.expect("loop ends with one");
    let mut offsets: std::collections::BTreeMap<String, u64> = Default::default();
    loop {
        // Terminal is read before the store: the agent finishes the logs before the build
        // turns terminal, so this pass sees all of them.
        let terminal = is_terminal(&mb);
        let store = store::Store::open(&location)?;
        let listing = store.list().await?;
        let steps = match &opts.step {
            Some(s) => vec![s.clone()],
            None => default_steps(&mb),
        };
        let mut unfinished = Vec::new();
        for step in &steps {
            let offset = offsets.entry(step.clone()).or_insert(0);
            let plan = reads::plan(&listing, step, *offset);
            for read in &plan.reads {
                let bytes = store.get(&read.name, read.from, read.to).await?;
                *offset += bytes.len() as u64;
                if let Err(e) = printer.print(step, &bytes) {
                    // A closed pipe (`| head`) ends the command quietly.
                    if e.kind() == std::io::ErrorKind::BrokenPipe {
                        return Ok(());
                    }
                    return Err(e).context("writing the logs");
                }
            }
            if plan.shipped && !plan.complete {
                unfinished.push(step.clone());
            }
        }
        if terminal || !opts.follow {
            if let Some(s) = &opts.step
                && !listing
                    .iter()
                    .any(|(n, _)| reads::plan(&[(n.clone(), 0)], s, 0).shipped)
            {
                anyhow::bail!("no log named {s:?} was shipped to {location}");
            }
            if terminal && !unfinished.is_empty() {
                eprintln!(
                    "note: the agent did not finish the logs of {} (the store failed or the agent stopped); they may be incomplete",
                    unfinished.join(", ")
                );
            }
            return Ok(());
        }
        tokio::time::sleep(opts.poll).await;
        mb = reread(&api, &name).await?;
        if let Some(now) = logs_location(&mb)
            && now != location
        {
            eprintln!("note: a new attempt started; its logs are at {now}");
            location = now;
            offsets.clear();
            printer.last = None;
        }
    }
}

async fn reread(api: &Api<MacBuild>, name: &str) -> anyhow::Result<MacBuild> {
    api.get_opt(name)
        .await
        .with_context(|| format!("reading MacBuild {name}"))?
        .ok_or_else(|| anyhow::anyhow!("MacBuild {name} was deleted while its logs were read"))
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
pub async fn get(client: &kube::Client, ns: &str, run: Option<&str>, mut out: impl Write) -> anyhow::Result<()> {
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
    let rows: Vec<[String; 6]> = builds
        .iter()
        .map(|mb| {
            let st = mb.status.clone().unwrap_or_default();
            [
                mb.metadata.name.clone().unwrap_or_default(),
                st.phase.map_or("-", |p| p.as_str()).to_string(),
                st.claim.as_ref().map_or("-".into(), |c| c.attempt.clone()),
                st.claim.as_ref().map_or("-".into(), |c| c.holder.clone()),
                age(mb),
                st.logs.unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let head = ["NAME", "PHASE", "ATTEMPT", "AGENT", "AGE", "LOGS"];
    let widths: Vec<usize> = (0..6)
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
pub async fn describe(client: &kube::Client, ns: &str, run: &str, mut out: impl Write) -> anyhow::Result<()> {
    let mb = find_build(client, ns, run, None).await?;
    let st = mb.status.clone().unwrap_or_default();
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
        for a in &st.attempts {
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
    Ok(())
}
