//! A real Kubernetes control plane for tests: the shared `cluster` script (etcd + kube-apiserver
//! v1.24 + kube-controller-manager, RBAC enforced; see `../shared/kube/README.md`), started in a
//! temporary directory and stopped when the [`RealCluster`] is dropped — also when the test
//! panics.
//!
//! The script is `$TARTAN_KUBE_CLUSTER`, else `<workspace>/../shared/kube/cluster`. Tests call
//! [`RealCluster::start`] and skip (printing why) when it returns `None`: no script, or no etcd.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// Environment variable naming the `cluster` script.
pub const CLUSTER_SCRIPT_ENV: &str = "TARTAN_KUBE_CLUSTER";

/// A running real control plane; stopped (only its own processes) on drop.
pub struct RealCluster {
    script: PathBuf,
    dir: tempfile::TempDir,
    api_url: String,
}

impl RealCluster {
    /// The `cluster` script, if it exists.
    pub fn script() -> Option<PathBuf> {
        let path = std::env::var_os(CLUSTER_SCRIPT_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/kube/cluster"));
        path.is_file().then_some(path)
    }

    /// Why a real cluster cannot start here (no script, no etcd, no kubectl), or `None` if it can.
    pub fn missing() -> Option<String> {
        let Some(script) = Self::script() else {
            return Some(format!(
                "no cluster script (set {CLUSTER_SCRIPT_ENV} or provide ../shared/kube/cluster beside the workspace)"
            ));
        };
        let on_path = |prog: &str| {
            std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()))
        };
        let etcd = std::env::var_os("ETCD_BIN").is_some_and(|p| Path::new(&p).is_file()) || on_path("etcd");
        if !etcd {
            return Some(format!(
                "no etcd on PATH (apt-get install -y etcd-server, or set ETCD_BIN); {} needs it",
                script.display()
            ));
        }
        for prog in ["kubectl", "openssl", "curl"] {
            if !on_path(prog) {
                return Some(format!("no {prog} on PATH; {} needs it", script.display()));
            }
        }
        None
    }

    /// Starts a cluster, or returns `None` after printing why it cannot run here. A start that
    /// fails although everything is installed is an error (the caller panics: a broken CI must
    /// not look like a skip).
    pub fn start() -> anyhow::Result<Option<RealCluster>> {
        if let Some(why) = Self::missing() {
            eprintln!("skipping the real-apiserver test: {why}");
            return Ok(None);
        }
        let script = Self::script().expect("checked by missing()");
        let dir = tempfile::Builder::new()
            .prefix("tartan-real-cluster-")
            .tempdir()
            .context("creating the cluster's temporary directory")?;
        let mut cluster = RealCluster {
            script,
            dir,
            api_url: String::new(),
        };
        // From here on, Drop stops whatever did start.
        let out = cluster.run(&["start".as_ref(), cluster.dir.path().as_os_str()])?;
        cluster.api_url = out
            .lines()
            .find_map(|l| l.strip_prefix("API_URL="))
            .map(str::to_string)
            .with_context(|| format!("`cluster start` printed no API_URL: {out}"))?;
        Ok(Some(cluster))
    }

    fn run(&self, args: &[&std::ffi::OsStr]) -> anyhow::Result<String> {
        let out = Command::new(&self.script)
            .args(args)
            .output()
            .with_context(|| format!("running {}", self.script.display()))?;
        if !out.status.success() {
            bail!(
                "{} {:?} failed ({}): {}{}; logs are in {}/logs",
                self.script.display(),
                args,
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                self.dir.path().display()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `https://127.0.0.1:<port>`.
    pub fn api_url(&self) -> &str {
        &self.api_url
    }

    /// The state directory (logs under `logs/`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The admin (`system:masters`) kubeconfig.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.path().join("admin.kubeconfig")
    }

    /// Writes a kubeconfig acting as ServiceAccount `namespace/sa` (which must exist) and returns its path.
    pub fn sa_kubeconfig(&self, namespace: &str, sa: &str) -> anyhow::Result<PathBuf> {
        let out = self.dir.path().join(format!("sa-{namespace}-{sa}.kubeconfig"));
        self.run(&[
            "kubeconfig".as_ref(),
            self.dir.path().as_os_str(),
            namespace.as_ref(),
            sa.as_ref(),
            out.as_os_str(),
        ])?;
        Ok(out)
    }

    /// A client with the admin credentials.
    pub async fn admin_client(&self) -> anyhow::Result<kube::Client> {
        client_from_kubeconfig(&self.admin_kubeconfig()).await
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
        use std::io::Write as _;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.admin_kubeconfig())
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("running kubectl")?;
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
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        if let Err(e) = self.run(&["stop".as_ref(), self.dir.path().as_os_str()]) {
            eprintln!("stopping the real cluster: {e:#}");
        }
    }
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
