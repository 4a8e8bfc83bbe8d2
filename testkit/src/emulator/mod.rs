//! A Kubernetes API emulator: plain HTTP on 127.0.0.1, faithful to kube-apiserver on what Tartan uses.

mod clock;
mod discovery;
pub mod faults;
mod http;
mod jsonpath;
mod openapi;
mod protobuf;
pub mod schema;
pub mod selector;
pub mod status;
pub mod store;
mod table;
pub mod types;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

pub use faults::{Availability, DenyRule, Faults, FaultsUpdate, HeldWrites, Predicate, PredicateOp, Target};
use store::{State, WriteOpts};

/// How to start an emulator.
#[derive(Debug, Clone)]
pub struct Options {
    /// Address to listen on; port 0 picks a free port.
    pub addr: SocketAddr,
    /// CRD manifests (YAML, possibly multi-document) to install at start.
    pub crd_files: Vec<PathBuf>,
    /// CRD manifests given as text.
    pub crd_yaml: Vec<String>,
    /// Number of change events kept for watches; older resourceVersions get 410 Gone.
    pub history_limit: usize,
    /// How often watches with `allowWatchBookmarks` get a BOOKMARK.
    pub bookmark_interval: Duration,
    /// A second port serving only `/emulator/*`, never refused (for scripts while `Refuse` is on).
    pub control_addr: Option<SocketAddr>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            crd_files: vec![],
            crd_yaml: vec![],
            history_limit: 10_000,
            bookmark_interval: Duration::from_secs(1),
            control_addr: None,
        }
    }
}

impl Options {
    pub fn crd_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.crd_files.push(path.into());
        self
    }

    pub fn crd_yaml(mut self, yaml: impl Into<String>) -> Self {
        self.crd_yaml.push(yaml.into());
        self
    }

    pub fn history_limit(mut self, n: usize) -> Self {
        self.history_limit = n;
        self
    }

    pub fn bookmark_interval(mut self, d: Duration) -> Self {
        self.bookmark_interval = d;
        self
    }

    pub fn port(mut self, port: u16) -> Self {
        self.addr.set_port(port);
        self
    }
}

pub(crate) struct Inner {
    pub state: Mutex<State>,
    pub addr: SocketAddr,
    pub bookmark_interval: Duration,
    /// The one-at-a-time server of `Faults::busy_ms`.
    pub busy: BusyGate,
    availability: watch::Sender<Availability>,
    restore_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Every answered API request with its status code (`GET /emulator/answers`), for benchmarks
    /// that count losing writes; kept apart from the store's lock so recording never waits on it.
    pub answers: Mutex<Answers>,
}

/// While `Faults::busy_ms` is set, requests pass one at a time (tokio's mutex is fair: they wait
/// their turn in arrival order). The gate remembers how many requests each one found ahead of it,
/// waiting or being served, so a test can check who a request waited behind without timing it.
#[derive(Default)]
pub struct BusyGate {
    serving: tokio::sync::Mutex<()>,
    inside: std::sync::atomic::AtomicUsize,
    seen: Mutex<std::collections::VecDeque<Queued>>,
}

/// A request that passed the [`BusyGate`], and how many requests were ahead of it when it came.
#[derive(Clone, Debug)]
pub struct Queued {
    /// `METHOD /path`.
    pub request: String,
    pub ahead: usize,
}

/// How many [`Queued`] the gate keeps.
const QUEUED_KEPT: usize = 10_000;

/// Counts a request as inside the gate (waiting or served) until dropped, also when its client
/// gives up and hyper drops the request's future.
pub(crate) struct InsideGate<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for InsideGate<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl BusyGate {
    /// Waits for the request's turn, serves it for `busy`, and records who was ahead of it.
    pub(crate) async fn pass(&self, request: String, busy: Duration) {
        let ahead = self.inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _inside = InsideGate(&self.inside);
        {
            let mut seen = self.seen.lock().expect("busy gate lock");
            if seen.len() >= QUEUED_KEPT {
                seen.pop_front();
            }
            seen.push_back(Queued { request, ahead });
        }
        let _serving = self.serving.lock().await;
        tokio::time::sleep(busy).await;
    }
}

/// One answered API request.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Answer {
    /// Milliseconds since the Unix epoch when the answer was ready (watches: when they began).
    pub at_ms: u64,
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// The bearer token (the emulator's notion of a user), if any.
    pub user: Option<String>,
    pub code: u16,
}

/// The most recent [`ANSWERS_KEPT`] answers; `dropped` counts older ones let go.
#[derive(Default, serde::Serialize)]
pub struct Answers {
    pub dropped: u64,
    pub answers: std::collections::VecDeque<Answer>,
}

/// How many answers [`Answers`] keeps (about 100 bytes each).
pub const ANSWERS_KEPT: usize = 500_000;

impl Answers {
    pub fn push(&mut self, answer: Answer) {
        if self.answers.len() >= ANSWERS_KEPT {
            self.answers.pop_front();
            self.dropped += 1;
        }
        self.answers.push_back(answer);
    }
}

impl Inner {
    pub fn set_faults(self: &Arc<Self>, f: Faults) {
        let availability = f.availability;
        self.state.lock().expect("state lock").faults = f;
        self.availability.send_replace(availability);
    }

    pub fn update_faults(self: &Arc<Self>, u: FaultsUpdate) {
        let mut st = self.state.lock().expect("state lock");
        if let Some(d) = u.deny {
            st.faults.deny = d;
        }
        if let Some(l) = u.latency_ms {
            st.faults.latency_ms = l;
        }
        if let Some(b) = u.busy_ms {
            st.faults.busy_ms = b;
        }
        if let Some(w) = u.watches_stalled {
            st.faults.watches_stalled = w;
        }
        if let Some(p) = u.partitioned {
            st.faults.partitioned = p;
        }
        if let Some(h) = u.held_writes {
            st.faults.held_writes = h;
        }
        if let Some(a) = u.availability {
            st.faults.availability = a;
            drop(st);
            self.availability.send_replace(a);
            if let Some(old) = self.restore_task.lock().expect("restore lock").take() {
                old.abort();
            }
            if let Some(ms) = u.for_ms.filter(|_| a != Availability::Up) {
                let me = self.clone();
                let task = tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    me.state.lock().expect("state lock").faults.availability = Availability::Up;
                    me.availability.send_replace(Availability::Up);
                });
                *self.restore_task.lock().expect("restore lock") = Some(task);
            }
        }
    }
}

/// Splits a multi-document YAML stream into JSON values (skipping empty documents).
pub fn parse_yaml_documents(text: &str) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let flush = |cur: &mut String, out: &mut Vec<Value>| -> anyhow::Result<()> {
        if cur
            .lines()
            .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        {
            let v: Value = serde_saphyr::from_str(cur).context("parsing YAML document")?;
            if !v.is_null() {
                out.push(v);
            }
        }
        cur.clear();
        Ok(())
    };
    for line in text.lines() {
        if line.trim_end() == "---" || line.starts_with("--- ") {
            flush(&mut cur, &mut out)?;
        } else {
            cur.push_str(line);
            cur.push('\n');
        }
    }
    flush(&mut cur, &mut out)?;
    Ok(out)
}

/// A running emulator; it stops (closing its port and every connection) when dropped.
pub struct EmulatorHandle {
    inner: Arc<Inner>,
    url: String,
    control_url: Option<String>,
    shutdown: watch::Sender<bool>,
}

impl EmulatorHandle {
    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `http://127.0.0.1:<port>` of the control-only listener, if one was requested.
    pub fn control_url(&self) -> Option<&str> {
        self.control_url.as_deref()
    }

    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// A `kube::Config` for this emulator (default namespace `default`), to adjust before
    /// building a client. Note kube's default retry policy retries 503/429/504 up to 15 times
    /// with exponential backoff; set `default_retry = false` to see a 503 at once.
    pub fn config(&self) -> kube::Config {
        let mut config = kube::Config::new(self.url.parse().expect("emulator URL is a valid URI"));
        config.default_namespace = "default".into();
        config.read_timeout = None;
        config
    }

    /// A `kube::Client` for this emulator with kube's defaults, default namespace `default`.
    pub fn client(&self) -> kube::Client {
        kube::Client::try_from(self.config()).expect("kube client for the emulator")
    }

    /// Writes a kubeconfig (cluster, user with a dummy token, context `kube-emulator`).
    pub fn write_kubeconfig(&self, path: impl AsRef<Path>) -> anyhow::Result<()> {
        write_kubeconfig(&self.url, path.as_ref())
    }

    pub fn faults(&self) -> Faults {
        self.inner.state.lock().expect("state lock").faults.clone()
    }

    pub fn set_faults(&self, f: Faults) {
        self.inner.set_faults(f);
    }

    pub fn add_deny_rule(&self, rule: DenyRule) {
        self.inner.state.lock().expect("state lock").faults.deny.push(rule);
    }

    pub fn clear_deny_rules(&self) {
        self.inner.state.lock().expect("state lock").faults.deny.clear();
    }

    pub fn set_availability(&self, a: Availability) {
        self.inner.update_faults(FaultsUpdate {
            availability: Some(a),
            ..Default::default()
        });
    }

    /// Cuts the clients presenting bearer token `users` off the API (see
    /// [`Faults::partitioned`]); an empty list heals the partition.
    pub fn set_partitioned(&self, users: &[&str]) {
        self.inner.update_faults(FaultsUpdate {
            partitioned: Some(users.iter().map(|u| u.to_string()).collect()),
            ..Default::default()
        });
    }

    /// Holds matching writes before applying them, even for a client that gave up (see
    /// [`HeldWrites`]); added to the rules already set.
    pub fn hold_writes(&self, rule: HeldWrites) {
        self.inner
            .state
            .lock()
            .expect("state lock")
            .faults
            .held_writes
            .push(rule);
    }

    pub fn set_latency(&self, d: Duration) {
        self.inner.state.lock().expect("state lock").faults.latency_ms = d.as_millis() as u64;
    }

    /// Makes every API request occupy the server for `d`, one at a time (see [`Faults::busy_ms`]);
    /// zero serves requests concurrently again.
    pub fn set_busy(&self, d: Duration) {
        self.inner.state.lock().expect("state lock").faults.busy_ms = d.as_millis() as u64;
    }

    /// Forgets the watch history, like an etcd compaction: watches from older versions get 410.
    pub fn compact(&self) {
        self.inner.state.lock().expect("state lock").compact();
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.inner.state.lock().expect("state lock").rv()
    }

    /// API requests seen so far (the most recent 10,000 to 20,000), as `METHOD /path?query ua=USER-AGENT`.
    pub fn requests(&self) -> Vec<String> {
        self.inner.state.lock().expect("state lock").requests.clone()
    }

    /// Requests that met a busy server ([`Self::set_busy`]) with how many were ahead of each, the
    /// most recent 10,000.
    pub fn busy_queue(&self) -> Vec<Queued> {
        self.inner
            .busy
            .seen
            .lock()
            .expect("busy gate lock")
            .iter()
            .cloned()
            .collect()
    }

    /// Answered API requests so far with their status codes (the most recent [`ANSWERS_KEPT`]).
    pub fn answers(&self) -> Vec<Answer> {
        let answers = self.inner.answers.lock().expect("answers lock");
        answers.answers.iter().cloned().collect()
    }

    /// Objects the garbage collector has examined since start: it grows with what was deleted or
    /// owned, not with what is stored (a status write on an object without owners adds nothing).
    pub fn gc_visited(&self) -> u64 {
        self.inner.state.lock().expect("state lock").gc_visited()
    }

    /// Installs a CRD (as if POSTed), e.g. from `deploy/crd.yaml` content.
    pub fn install_crd(&self, crd: Value) -> anyhow::Result<()> {
        install_crd(&self.inner, crd)
    }
}

impl Drop for EmulatorHandle {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

fn install_crd(inner: &Inner, crd: Value) -> anyhow::Result<()> {
    let mut st = inner.state.lock().expect("state lock");
    let rt = st
        .find("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        .expect("CRDs are built in");
    st.create(&rt, "", crd, &WriteOpts::default())
        .map_err(|e| anyhow::anyhow!("installing CRD: {e}"))?;
    Ok(())
}

pub fn write_kubeconfig(url: &str, path: &Path) -> anyhow::Result<()> {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: kube-emulator\n  cluster:\n    server: {url}\n\
         contexts:\n- name: kube-emulator\n  context:\n    cluster: kube-emulator\n    user: kube-emulator\n    namespace: default\n\
         current-context: kube-emulator\nusers:\n- name: kube-emulator\n  user:\n    token: kube-emulator-token\n"
    );
    std::fs::write(path, text).with_context(|| format!("writing kubeconfig {}", path.display()))
}

async fn serve(
    inner: Arc<Inner>,
    listener: TcpListener,
    control_only: bool,
    mut shutdown: watch::Receiver<bool>,
    mut availability: watch::Receiver<Availability>,
) {
    let addr = listener.local_addr().expect("bound listener has an address");
    let mut listener = Some(listener);
    let mut conns = JoinSet::new();
    loop {
        let refusing = !control_only && *availability.borrow() == Availability::Refuse;
        if refusing && listener.is_some() {
            listener = None;
            conns.abort_all();
        } else if !refusing && listener.is_none() {
            match TcpListener::bind(addr).await {
                Ok(l) => listener = Some(l),
                Err(e) => {
                    tracing::warn!("re-binding {addr}: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
        }
        tokio::select! {
            _ = shutdown.changed() => break,
            _ = availability.changed() => continue,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            accepted = async { listener.as_ref().expect("listening").accept().await }, if listener.is_some() => {
                let Ok((stream, _)) = accepted else { continue };
                let inner = inner.clone();
                conns.spawn(async move {
                    let svc = hyper::service::service_fn(move |req| http::handle(inner.clone(), req, control_only));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        }
    }
    conns.abort_all();
}

/// Starts an emulator on the current tokio runtime.
pub async fn start(options: Options) -> anyhow::Result<EmulatorHandle> {
    let listener = TcpListener::bind(options.addr)
        .await
        .with_context(|| format!("binding {}", options.addr))?;
    let addr = listener.local_addr()?;
    let (availability, avail_rx) = watch::channel(Availability::Up);
    let inner = Arc::new(Inner {
        state: Mutex::new(State::new(options.history_limit)),
        addr,
        bookmark_interval: options.bookmark_interval,
        busy: BusyGate::default(),
        availability,
        restore_task: Mutex::new(None),
        answers: Mutex::new(Answers::default()),
    });
    let mut crds = Vec::new();
    for f in &options.crd_files {
        let text = std::fs::read_to_string(f).with_context(|| format!("reading CRD file {}", f.display()))?;
        crds.extend(parse_yaml_documents(&text).with_context(|| format!("parsing {}", f.display()))?);
    }
    for text in &options.crd_yaml {
        crds.extend(parse_yaml_documents(text)?);
    }
    for crd in crds {
        if crd.get("kind").and_then(Value::as_str) == Some("CustomResourceDefinition") {
            install_crd(&inner, crd)?;
        }
    }
    let (shutdown, shutdown_rx) = watch::channel(false);
    tokio::spawn(serve(
        inner.clone(),
        listener,
        false,
        shutdown_rx.clone(),
        avail_rx.clone(),
    ));
    let mut control_url = None;
    if let Some(caddr) = options.control_addr {
        let cl = TcpListener::bind(caddr)
            .await
            .with_context(|| format!("binding control port {caddr}"))?;
        control_url = Some(format!("http://{}", cl.local_addr()?));
        tokio::spawn(serve(inner.clone(), cl, true, shutdown_rx.clone(), avail_rx));
    }
    let gc_inner = inner.clone();
    let mut gc_shutdown = shutdown_rx;
    tokio::spawn(async move {
        let wake = gc_inner.state.lock().expect("state lock").gc_wake.clone();
        loop {
            tokio::select! {
                _ = gc_shutdown.changed() => return,
                _ = wake.notified() => {}
            }
            // The lock is released between passes so requests interleave with a long collection.
            while gc_inner.state.lock().expect("state lock").gc_pass() {
                tokio::task::yield_now().await;
            }
        }
    });
    Ok(EmulatorHandle {
        inner,
        url: format!("http://{addr}"),
        control_url,
        shutdown,
    })
}
