//! A real Kubernetes control plane for tests, from what the user provides, by the convention
//! controller authors already use (controller-runtime's envtest):
//!
//! - `KUBEBUILDER_ASSETS=DIR` holding `kube-apiserver`, `etcd` and `kubectl` (and
//!   `kube-controller-manager` when present: garbage collection, namespace deletion and
//!   ServiceAccount token Secrets need it). [`ControlPlane::start`] starts them in a directory of
//!   its own: a CA and certificates (openssl), free loopback ports, RBAC on, an admin kubeconfig.
//!   They are stopped by their recorded pids only ([`ControlPlane::stop_dir`]), never by name.
//! - `USE_EXISTING_CLUSTER=true` with `KUBECONFIG` naming a cluster where you are admin.
//!
//! Without either, a test calls [`RealCluster::start`], gets `None`, and has printed
//! [`NO_CONTROL_PLANE`] on a line of its own (also recorded for `scripts/test`'s count of skips,
//! see [`skip`]). With assets given, a start that fails is an error, never a skip.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine as _;
use serde_json::{Value, json};

/// The folder holding the control plane's binaries.
pub const ASSETS_ENV: &str = "KUBEBUILDER_ASSETS";
/// `true` together with `KUBECONFIG`: use that cluster instead of starting one.
pub const EXISTING_CLUSTER_ENV: &str = "USE_EXISTING_CLUSTER";
/// `scripts/test` sets this to a file; each skip appends its line there, to be counted.
pub const SKIP_LOG_ENV: &str = "TARTAN_SKIP_LOG";

/// What a real-cluster test prints when there is none.
pub const NO_CONTROL_PLANE: &str =
    "skipped: no real control plane (set KUBEBUILDER_ASSETS=DIR with kube-apiserver, etcd, kubectl)";
/// What a test that needs the controller-manager prints when the assets lack it.
pub const NO_CONTROLLER_MANAGER: &str = "skipped: needs kube-controller-manager in KUBEBUILDER_ASSETS";

/// How long the control plane may take to answer `/readyz` (and the controller-manager to run).
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a stopped process has after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Prints `line` (e.g. [`NO_CONTROL_PLANE`]) naming `test`, straight to the process's stderr so
/// the test harness's capture does not hide it, and appends it to `$TARTAN_SKIP_LOG` if set.
pub fn skip(line: &str, test: &str) {
    let text = format!("{line} [{test}]\n");
    let _ = std::io::stderr().write_all(text.as_bytes());
    if let Some(path) = std::env::var_os(SKIP_LOG_ENV).filter(|p| !p.is_empty()) {
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()));
        if let Err(e) = appended {
            let _ = writeln!(std::io::stderr(), "cannot record the skip in {path:?}: {e}");
        }
    }
}

/// The binaries of `$KUBEBUILDER_ASSETS`.
#[derive(Clone, Debug)]
pub struct Assets {
    pub kube_apiserver: PathBuf,
    pub etcd: PathBuf,
    pub kubectl: PathBuf,
    pub kube_controller_manager: Option<PathBuf>,
}

impl Assets {
    /// `None` when `KUBEBUILDER_ASSETS` is unset or empty; an error when it names a folder that
    /// lacks a required binary (a given control plane that cannot start is a failure, not a skip).
    pub fn from_env() -> anyhow::Result<Option<Assets>> {
        match std::env::var_os(ASSETS_ENV).filter(|d| !d.is_empty()) {
            None => Ok(None),
            Some(dir) => Assets::in_dir(Path::new(&dir)).map(Some),
        }
    }

    pub fn in_dir(dir: &Path) -> anyhow::Result<Assets> {
        let required = |name: &str| {
            let path = dir.join(name);
            if is_executable(&path) {
                Ok(absolute(&path))
            } else {
                bail!("{ASSETS_ENV}={} has no executable {name}", dir.display())
            }
        };
        let optional = dir.join("kube-controller-manager");
        Ok(Assets {
            kube_apiserver: required("kube-apiserver")?,
            etcd: required("etcd")?,
            kubectl: required("kubectl")?,
            kube_controller_manager: is_executable(&optional).then(|| absolute(&optional)),
        })
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// A control plane started from [`Assets`] in `dir`: `certs/`, `etcd/`, `logs/`, `run/<name>.pid`,
/// `admin.kubeconfig` and `env` (`API_URL=…`, `CONTROLLER_MANAGER=yes|no`).
pub struct ControlPlane {
    dir: PathBuf,
    api_url: String,
    kubectl: PathBuf,
    controller_manager: bool,
    /// The processes this value stops on drop (empty once [`ControlPlane::detach`]ed).
    children: Vec<(&'static str, Child)>,
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and (when given) kube-controller-manager in `dir` and waits for
    /// `/readyz`. On failure, whatever started is stopped and the error names the log to read.
    pub fn start(assets: &Assets, dir: &Path) -> anyhow::Result<ControlPlane> {
        let dir = absolute(dir);
        for sub in ["certs", "etcd", "logs", "run"] {
            std::fs::create_dir_all(dir.join(sub)).with_context(|| format!("creating {}", dir.join(sub).display()))?;
        }
        make_certificates(&dir.join("certs"))?;
        let (etcd_port, peer_port, api_port) = (free_port()?, free_port()?, free_port()?);
        let api_url = format!("https://127.0.0.1:{api_port}");
        write_admin_kubeconfig(&dir, &api_url)?;
        let mut plane = ControlPlane {
            dir: dir.clone(),
            api_url,
            kubectl: assets.kubectl.clone(),
            controller_manager: assets.kube_controller_manager.is_some(),
            children: vec![],
        };
        // From here on, Drop stops whatever did start.
        plane.spawn("etcd", &assets.etcd, &etcd_args(&dir, etcd_port, peer_port))?;
        plane.spawn(
            "kube-apiserver",
            &assets.kube_apiserver,
            &apiserver_args(&dir, etcd_port, api_port),
        )?;
        plane.wait("kube-apiserver to answer /readyz", |p| {
            p.kubectl(&["get", "--raw", "/readyz"], None).map(drop)
        })?;
        if let Some(cm) = &assets.kube_controller_manager {
            plane.spawn("kube-controller-manager", cm, &controller_manager_args(&dir))?;
            // The ServiceAccount controller making `default` in `default` shows it runs.
            plane.wait("kube-controller-manager to make ServiceAccount default/default", |p| {
                p.kubectl(
                    &["-n", "default", "get", "serviceaccount", "default", "-o", "name"],
                    None,
                )
                .map(drop)
            })?;
        }
        let env = format!(
            "API_URL={}\nCONTROLLER_MANAGER={}\n",
            plane.api_url,
            if plane.controller_manager { "yes" } else { "no" }
        );
        std::fs::write(dir.join("env"), env).context("writing the control plane's env file")?;
        Ok(plane)
    }

    fn spawn(&mut self, name: &'static str, program: &Path, args: &[String]) -> anyhow::Result<()> {
        use std::os::unix::process::CommandExt as _;
        let log = self.dir.join("logs").join(format!("{name}.log"));
        let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().context("duplicating the log's descriptor")?)
            .stderr(out)
            // A group of its own: a terminal's ^C or a test's process-group kill does not reach it,
            // so it is stopped only through its recorded pid.
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        let pid_file = self.dir.join("run").join(format!("{name}.pid"));
        std::fs::write(&pid_file, format!("{}\n", child.id()))
            .with_context(|| format!("writing {}", pid_file.display()))?;
        self.children.push((name, child));
        Ok(())
    }

    /// Polls `ready` until it succeeds, a started process exits, or [`START_TIMEOUT`] passes.
    fn wait(&mut self, what: &str, ready: impl Fn(&ControlPlane) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let last = match ready(self) {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            for (name, child) in &mut self.children {
                if let Some(status) = child.try_wait().context("checking a control plane process")? {
                    bail!(
                        "waiting for {what}: {name} exited ({status}); its log {}:\n{}",
                        self.dir.join("logs").join(format!("{name}.log")).display(),
                        log_tail(&self.dir.join("logs").join(format!("{name}.log")), 25)
                    );
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "{what} did not happen within {START_TIMEOUT:?} (last: {last:#}); logs in {}",
                    self.dir.join("logs").display()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Leaves the processes running when this value is dropped (`tartan-control-plane start`);
    /// [`ControlPlane::stop_dir`] stops them later from their pid files.
    pub fn detach(mut self) {
        for (_, child) in self.children.drain(..) {
            drop(child);
        }
    }

    /// Stops the processes whose pids `dir/run/*.pid` recorded, the last started first: SIGTERM,
    /// then SIGKILL after [`STOP_GRACE`]. A pid whose process no longer names `dir` on its command
    /// line is gone (or reused by another program) and is left alone.
    pub fn stop_dir(dir: &Path) -> anyhow::Result<()> {
        let dir = absolute(dir);
        for name in ["kube-controller-manager", "kube-apiserver", "etcd"] {
            let pid_file = dir.join("run").join(format!("{name}.pid"));
            let Ok(text) = std::fs::read_to_string(&pid_file) else {
                continue;
            };
            let pid: i32 = text
                .trim()
                .parse()
                .with_context(|| format!("{} holds no pid: {text:?}", pid_file.display()))?;
            if ours(pid, &dir) {
                stop_pid(pid, name)?;
            }
            std::fs::remove_file(&pid_file).with_context(|| format!("removing {}", pid_file.display()))?;
        }
        Ok(())
    }

    /// `https://127.0.0.1:<port>`.
    pub fn api_url(&self) -> &str {
        &self.api_url
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn has_controller_manager(&self) -> bool {
        self.controller_manager
    }

    /// Runs the assets' kubectl as admin; `stdin` is fed to it. Fails with kubectl's stderr.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        run_kubectl(&self.kubectl, &self.dir.join("admin.kubeconfig"), args, stdin)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        while let Some((name, mut child)) = self.children.pop() {
            if let Err(e) = stop_child(name, &mut child) {
                let _ = writeln!(std::io::stderr(), "stopping {name}: {e:#}");
            }
        }
    }
}

/// Whether `pid` is a live process of the control plane in `dir` (its command line names `dir`).
fn ours(pid: i32, dir: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    !is_zombie(pid) && cmdline_names_dir(&cmdline, dir.as_os_str().as_encoded_bytes())
}

/// Whether an argument of `cmdline` (NUL-separated, as in `/proc/PID/cmdline`; a `--flag=` before
/// the value allowed) is `dir` or a path below it: `/tmp/cp` must not match `/tmp/cp2`.
fn cmdline_names_dir(cmdline: &[u8], dir: &[u8]) -> bool {
    cmdline.split(|&b| b == 0).any(|arg| {
        let value = arg.iter().position(|&b| b == b'=').map_or(arg, |eq| &arg[eq + 1..]);
        value
            .strip_prefix(dir)
            .is_some_and(|rest| rest.is_empty() || rest[0] == b'/')
    })
}

fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

/// Stops a process that is not our child (started by an earlier `tartan-control-plane start`).
fn stop_pid(pid: i32, name: &str) -> anyhow::Result<()> {
    use nix::sys::signal::Signal;
    signal(pid, Signal::SIGCONT); // a paused kube-apiserver (an e2e outage) must see the SIGTERM
    signal(pid, Signal::SIGTERM);
    let gone = |pid| !Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid);
    let deadline = Instant::now() + STOP_GRACE;
    while !gone(pid) {
        if Instant::now() >= deadline {
            signal(pid, Signal::SIGKILL);
            std::thread::sleep(Duration::from_millis(100));
            if !gone(pid) {
                bail!("{name} (pid {pid}) survived SIGKILL");
            }
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

fn stop_child(name: &str, child: &mut Child) -> anyhow::Result<()> {
    use nix::sys::signal::Signal;
    let pid = i32::try_from(child.id()).context("pid out of range")?;
    if child.try_wait()?.is_some() {
        return Ok(());
    }
    signal(pid, Signal::SIGCONT);
    signal(pid, Signal::SIGTERM);
    let deadline = Instant::now() + STOP_GRACE;
    while child.try_wait()?.is_none() {
        if Instant::now() >= deadline {
            child.kill().with_context(|| format!("SIGKILL to {name} (pid {pid})"))?;
            child.wait()?;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A loopback port free now (the kernel's pick, released for the process that takes it).
fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free loopback port")?;
    Ok(listener.local_addr()?.port())
}

fn etcd_args(dir: &Path, client: u16, peer: u16) -> Vec<String> {
    let d = dir.display();
    vec![
        "--name=tartan-test".into(),
        format!("--data-dir={d}/etcd"),
        format!("--listen-client-urls=http://127.0.0.1:{client}"),
        format!("--advertise-client-urls=http://127.0.0.1:{client}"),
        format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
        format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
        format!("--initial-cluster=tartan-test=http://127.0.0.1:{peer}"),
        "--initial-cluster-state=new".into(),
        // No metrics or pprof listeners of its own on fixed ports.
        "--listen-metrics-urls=".into(),
    ]
}

fn apiserver_args(dir: &Path, etcd: u16, port: u16) -> Vec<String> {
    let c = dir.join("certs");
    let c = c.display();
    vec![
        format!("--etcd-servers=http://127.0.0.1:{etcd}"),
        "--bind-address=127.0.0.1".into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--secure-port={port}"),
        format!("--cert-dir={}/apiserver", dir.display()),
        format!("--tls-cert-file={c}/apiserver.crt"),
        format!("--tls-private-key-file={c}/apiserver.key"),
        format!("--client-ca-file={c}/ca.crt"),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
        format!("--service-account-key-file={c}/sa.key"),
        format!("--service-account-signing-key-file={c}/sa.key"),
        "--service-cluster-ip-range=10.0.0.0/24".into(),
        "--authorization-mode=RBAC".into(),
        "--allow-privileged=true".into(),
    ]
}

fn controller_manager_args(dir: &Path) -> Vec<String> {
    let d = dir.display();
    vec![
        format!("--kubeconfig={d}/admin.kubeconfig"),
        "--leader-elect=false".into(),
        "--secure-port=0".into(),
        "--controllers=*".into(),
        "--use-service-account-credentials=false".into(),
        format!("--service-account-private-key-file={d}/certs/sa.key"),
        format!("--root-ca-file={d}/certs/ca.crt"),
    ]
}

/// The CA, the apiserver's serving certificate, the admin's client certificate (group
/// `system:masters`) and the ServiceAccount signing key, in `certs`.
fn make_certificates(certs: &Path) -> anyhow::Result<()> {
    let ext = "[server]\nsubjectAltName = IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,\
               DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n\
               basicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature,keyEncipherment\n\
               extendedKeyUsage = serverAuth\n\
               [client]\nbasicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature,keyEncipherment\n\
               extendedKeyUsage = clientAuth\n";
    std::fs::write(certs.join("ext.cnf"), ext).context("writing the certificates' extensions")?;
    let steps = [
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 7 -subj /CN=tartan-test-ca \
         -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign",
        "req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver",
        "x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 7 \
         -extfile ext.cnf -extensions server",
        "req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj /O=system:masters/CN=tartan-admin",
        "x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out admin.crt -days 7 \
         -extfile ext.cnf -extensions client",
        "genrsa -out sa.key 2048",
    ];
    openssl(certs, &steps)
}

/// Runs `openssl` once per step in `dir`; a step's arguments are split on whitespace (so none may
/// hold a space). Shared with the e2e harness's admission webhook certificates.
pub fn openssl(dir: &Path, steps: &[&str]) -> anyhow::Result<()> {
    for step in steps {
        let args: Vec<&str> = step.split_whitespace().collect();
        let out = Command::new("openssl")
            .args(&args)
            .current_dir(dir)
            .output()
            .context("running openssl (test certificates need it)")?;
        if !out.status.success() {
            bail!(
                "openssl {} in {} failed: {}",
                args.join(" "),
                dir.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    Ok(())
}

/// `admin.kubeconfig`, with the CA and the client certificate inline (it is copied into images).
fn write_admin_kubeconfig(dir: &Path, api_url: &str) -> anyhow::Result<()> {
    let inline = |name: &str| -> anyhow::Result<String> {
        let path = dir.join("certs").join(name);
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
    };
    let config = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "tartan-test", "cluster": {
            "server": api_url, "certificate-authority-data": inline("ca.crt")?}}],
        "users": [{"name": "admin", "user": {
            "client-certificate-data": inline("admin.crt")?, "client-key-data": inline("admin.key")?}}],
        "contexts": [{"name": "admin", "context": {"cluster": "tartan-test", "user": "admin"}}],
        "current-context": "admin",
    });
    // JSON is YAML: kubectl and kube read it as a kubeconfig.
    let path = dir.join("admin.kubeconfig");
    std::fs::write(&path, config.to_string()).with_context(|| format!("writing {}", path.display()))
}

/// Runs `kubectl --kubeconfig KUBECONFIG ARGS`; `stdin` is fed to it. Fails with kubectl's stderr.
fn run_kubectl(kubectl: &Path, kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
    let mut child = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", kubectl.display()))?;
    let mut pipe = child.stdin.take().expect("stdin is piped");
    pipe.write_all(stdin.unwrap_or_default().as_bytes())
        .context("writing kubectl's stdin")?;
    drop(pipe);
    let out = child.wait_with_output().context("waiting for kubectl")?;
    if !out.status.success() {
        bail!(
            "kubectl {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A real cluster for a test: a [`ControlPlane`] of its own, or the existing cluster of
/// `$KUBECONFIG` (`USE_EXISTING_CLUSTER=true`).
pub struct RealCluster {
    /// The control plane started for this test; `None` on an existing cluster.
    plane: Option<ControlPlane>,
    admin_kubeconfig: PathBuf,
    kubectl: PathBuf,
    api_url: String,
    /// Kubeconfigs written for ServiceAccounts (and the control plane's files).
    dir: tempfile::TempDir,
}

impl RealCluster {
    /// A cluster for the test named `test`, or `None` after printing [`NO_CONTROL_PLANE`]. A
    /// control plane that was given but fails to start is an error (the caller panics: a broken
    /// CI must not look like a skip).
    pub fn start(test: &str) -> anyhow::Result<Option<RealCluster>> {
        let dir = tempfile::Builder::new()
            .prefix("tartan-real-cluster-")
            .tempdir()
            .context("creating the cluster's temporary directory")?;
        if let Some(assets) = Assets::from_env()? {
            let plane = ControlPlane::start(&assets, &dir.path().join("control-plane"))?;
            return Ok(Some(RealCluster {
                admin_kubeconfig: plane.dir().join("admin.kubeconfig"),
                kubectl: assets.kubectl.clone(),
                api_url: plane.api_url().to_string(),
                plane: Some(plane),
                dir,
            }));
        }
        let Some(kubeconfig) = existing_cluster_kubeconfig() else {
            skip(NO_CONTROL_PLANE, test);
            return Ok(None);
        };
        let file = kube::config::Kubeconfig::read_from(&kubeconfig)
            .with_context(|| format!("reading KUBECONFIG {}", kubeconfig.display()))?;
        let api_url = current_cluster(&file)
            .and_then(|c| c.server.clone())
            .with_context(|| format!("KUBECONFIG {} names no server", kubeconfig.display()))?;
        Ok(Some(RealCluster {
            plane: None,
            admin_kubeconfig: kubeconfig,
            kubectl: PathBuf::from("kubectl"),
            api_url,
            dir,
        }))
    }

    /// Like [`RealCluster::start`], but skips (printing [`NO_CONTROLLER_MANAGER`]) when the control
    /// plane given has no kube-controller-manager. An existing cluster is taken to have one.
    pub fn start_with_controller_manager(test: &str) -> anyhow::Result<Option<RealCluster>> {
        let cluster = RealCluster::start(test)?;
        if cluster.as_ref().is_some_and(|c| !c.has_controller_manager()) {
            skip(NO_CONTROLLER_MANAGER, test);
            return Ok(None);
        }
        Ok(cluster)
    }

    pub fn has_controller_manager(&self) -> bool {
        self.plane.as_ref().is_none_or(ControlPlane::has_controller_manager)
    }

    /// The API server's URL.
    pub fn api_url(&self) -> &str {
        &self.api_url
    }

    /// The CA file that signed the API server's certificate (a started control plane's; on an
    /// existing cluster, written from its kubeconfig's CA data).
    pub fn ca_file(&self) -> PathBuf {
        match &self.plane {
            Some(plane) => plane.dir().join("certs/ca.crt"),
            None => {
                let out = self.dir.path().join("ca.crt");
                let file = kube::config::Kubeconfig::read_from(&self.admin_kubeconfig).ok();
                let cluster = file.as_ref().and_then(current_cluster);
                if let Some(data) = cluster.and_then(|c| c.certificate_authority_data.as_deref()) {
                    let pem = base64::engine::general_purpose::STANDARD
                        .decode(data)
                        .unwrap_or_default();
                    let _ = std::fs::write(&out, pem);
                } else if let Some(path) = cluster.and_then(|c| c.certificate_authority.as_deref()) {
                    return PathBuf::from(path);
                }
                out
            }
        }
    }

    /// A folder of this test's own.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The admin (`system:masters`) kubeconfig.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.admin_kubeconfig.clone()
    }

    /// Writes a kubeconfig acting as ServiceAccount `namespace/sa` (which must exist), with a
    /// token from the TokenRequest API, and returns its path.
    pub fn sa_kubeconfig(&self, namespace: &str, sa: &str) -> anyhow::Result<PathBuf> {
        let token = service_account_token(&self.kubectl, &self.admin_kubeconfig, namespace, sa)?;
        let admin =
            kube::config::Kubeconfig::read_from(&self.admin_kubeconfig).context("reading the admin kubeconfig")?;
        let text = service_account_kubeconfig_text(&admin, namespace, sa, &token).map_err(anyhow::Error::msg)?;
        let out = self.dir.path().join(format!("sa-{namespace}-{sa}.kubeconfig"));
        std::fs::write(&out, text).with_context(|| format!("writing {}", out.display()))?;
        Ok(out)
    }

    /// A client with the admin credentials.
    pub async fn admin_client(&self) -> anyhow::Result<kube::Client> {
        client_from_kubeconfig(&self.admin_kubeconfig).await
    }

    /// A client acting as ServiceAccount `namespace/sa`.
    pub async fn sa_client(&self, namespace: &str, sa: &str) -> anyhow::Result<kube::Client> {
        client_from_kubeconfig(&self.sa_kubeconfig(namespace, sa)?).await
    }

    /// `kubectl apply -f -` of `yaml` as admin.
    pub fn apply(&self, yaml: &str) -> anyhow::Result<String> {
        self.kubectl(&["apply", "-f", "-"], Some(yaml))
    }

    /// Runs kubectl as admin; `stdin` is fed to it. Fails with kubectl's stderr.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        run_kubectl(&self.kubectl, &self.admin_kubeconfig, args, stdin)
    }
}

/// `$KUBECONFIG` when `USE_EXISTING_CLUSTER=true`.
fn existing_cluster_kubeconfig() -> Option<PathBuf> {
    let opted_in = std::env::var(EXISTING_CLUSTER_ENV).is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    let kubeconfig = std::env::var_os("KUBECONFIG").filter(|k| !k.is_empty())?;
    opted_in.then(|| PathBuf::from(kubeconfig))
}

fn current_cluster(file: &kube::config::Kubeconfig) -> Option<&kube::config::Cluster> {
    let current = file.current_context.as_deref()?;
    let context = file.contexts.iter().find(|c| c.name == current)?.context.as_ref()?;
    file.clusters
        .iter()
        .find(|c| c.name == context.cluster)?
        .cluster
        .as_ref()
}

/// A token for ServiceAccount `namespace/sa` from the TokenRequest API (valid 24 h), asked with
/// `kubectl create --raw`, which every kubectl version has.
pub fn service_account_token(kubectl: &Path, admin: &Path, namespace: &str, sa: &str) -> anyhow::Result<String> {
    let request = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                         "spec": {"expirationSeconds": 86400}});
    let path = format!("/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token");
    let out = run_kubectl(
        kubectl,
        admin,
        &["create", "--raw", &path, "-f", "-"],
        Some(&request.to_string()),
    )?;
    let answer: Value = serde_json::from_str(&out).with_context(|| format!("TokenRequest answer: {out}"))?;
    answer["status"]["token"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("TokenRequest for {namespace}/{sa} answered no token: {out}"))
}

/// A kubeconfig (YAML) for ServiceAccount `sa` of `namespace` with `token`, on the cluster of
/// `admin`'s current context.
pub fn service_account_kubeconfig_text(
    admin: &kube::config::Kubeconfig,
    namespace: &str,
    sa: &str,
    token: &str,
) -> Result<String, String> {
    let cluster = current_cluster(admin).ok_or("the admin kubeconfig's current context names no cluster")?;
    let mut entry = json!({"server": cluster.server.clone().ok_or("the cluster has no server")?});
    if let Some(ca) = &cluster.certificate_authority_data {
        entry["certificate-authority-data"] = json!(ca);
    } else if let Some(ca) = &cluster.certificate_authority {
        entry["certificate-authority"] = json!(ca);
    }
    if cluster.insecure_skip_tls_verify == Some(true) {
        entry["insecure-skip-tls-verify"] = json!(true);
    }
    // JSON is YAML: kubectl and kube read it as a kubeconfig.
    Ok(json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": entry}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": sa, "namespace": namespace}}],
        "current-context": "e2e",
    })
    .to_string())
}

/// A `kube::Client` from a kubeconfig file (its current context).
pub async fn client_from_kubeconfig(path: &Path) -> anyhow::Result<kube::Client> {
    let file =
        kube::config::Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading kubeconfig {}", path.display()))?;
    kube::Client::try_from(config).context("building a kube client")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn which(program: &str) -> PathBuf {
        let path = std::env::var_os("PATH").unwrap();
        std::env::split_paths(&path)
            .map(|d| d.join(program))
            .find(|p| is_executable(p))
            .unwrap_or_else(|| panic!("no {program} on PATH"))
    }

    #[test]
    fn a_command_line_names_the_folder_only_as_a_whole_path() {
        let dir = b"/tmp/cp";
        for (cmdline, names) in [
            (&b"etcd\0--data-dir=/tmp/cp/etcd\0"[..], true),
            (b"/tmp/cp/sleeper\0sixty\0", true),
            (b"x\0/tmp/cp\0", true),
            // Found by the adversary: another control plane's folder, or a mere substring.
            (b"etcd\0--data-dir=/tmp/cp2/etcd\0", false),
            (b"grep\0x/tmp/cp/y\0", false),
            (b"sleep\0sixty\0", false),
        ] {
            assert_eq!(
                cmdline_names_dir(cmdline, dir),
                names,
                "{}",
                String::from_utf8_lossy(cmdline)
            );
        }
    }

    #[test]
    fn assets_missing_a_binary_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = Assets::in_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no executable kube-apiserver"), "{err}");
        for name in ["kube-apiserver", "etcd"] {
            std::fs::write(dir.path().join(name), "#!/bin/sh\n").unwrap();
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(dir.path().join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let err = Assets::in_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no executable kubectl"), "{err}");
    }

    #[test]
    fn a_recorded_pid_that_is_not_ours_is_never_signalled() {
        // Our own process does not name the directory: stop_dir must leave it alone.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("run")).unwrap();
        std::fs::write(dir.path().join("run/etcd.pid"), format!("{}\n", std::process::id())).unwrap();
        ControlPlane::stop_dir(dir.path()).unwrap();
        assert!(
            !dir.path().join("run/etcd.pid").exists(),
            "the stale pid file is removed"
        );
    }

    #[test]
    fn stop_dir_stops_a_recorded_process_that_names_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("run")).unwrap();
        // A sleeper whose command line names the directory, as every control plane process's does.
        let sleeper = dir.path().join("sleeper");
        std::os::unix::fs::symlink(which("sleep"), &sleeper).unwrap();
        let mut child = Command::new(&sleeper).arg("600").spawn().unwrap();
        std::fs::write(dir.path().join("run/kube-apiserver.pid"), format!("{}\n", child.id())).unwrap();
        // Its command line is readable once the exec has gone through.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ours(child.id() as i32, &absolute(dir.path())) {
            assert!(
                Instant::now() < deadline,
                "the sleeper never showed the directory in /proc"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        ControlPlane::stop_dir(dir.path()).unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success(), "stopped by a signal: {status:?}");
    }
}
