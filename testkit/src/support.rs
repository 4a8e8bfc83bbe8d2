//! Helpers shared by the workspace's tests: other crates' binaries built on demand, bounded
//! polling, and a local S3 server (moto).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The path of binary `bin` of workspace package `package`, built with the same profile as the
/// running test or example (a no-op when `cargo test --workspace` already built it). Other crates'
/// binaries have no `CARGO_BIN_EXE_*`, so the test asks cargo itself; cargo releases its build
/// lock while tests run, so this nested build does not deadlock. Built once per process.
pub fn workspace_bin(package: &str, bin: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(path) = built.get(bin) {
        return path.clone();
    }
    // Test executables live in <target>/<profile>/deps/, examples in <target>/<profile>/examples/.
    let exe = std::env::current_exe().expect("the test knows its own path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test exe is in <target>/<profile>/deps");
    let target_dir = profile_dir.parent().expect("profile dir is inside the target dir");
    let profile = profile_dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--quiet", "-p", package, "--bin", bin, "--target-dir"])
        .arg(target_dir);
    if profile == "release" {
        cmd.arg("--release");
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run cargo to build {bin}: {e}"));
    assert!(
        out.status.success(),
        "cargo build -p {package} --bin {bin} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = profile_dir.join(bin);
    assert!(path.is_file(), "{} missing after building it", path.display());
    built.insert(bin.to_string(), path.clone());
    path
}

/// `tart-double`, built as by [`workspace_bin`].
pub fn tart_double() -> PathBuf {
    workspace_bin("tart-double", "tart-double")
}

/// Polls `check` every 20 ms until it returns `Some`, for at most `limit`.
pub async fn wait_for<T>(what: &str, limit: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(start.elapsed() < limit, "gave up after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `python3 -m moto.server` on a free local port; killed and reaped on drop.
pub struct Moto {
    child: Child,
    port: u16,
}

impl Moto {
    /// `None` when moto is not installed (the caller says SKIPPED).
    pub fn start() -> Option<Moto> {
        let probe = Command::new("python3")
            .args(["-c", "import moto.server"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !matches!(probe, Ok(s) if s.success()) {
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new("python3")
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start moto server");
        let moto = Moto { child, port };
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "moto did not listen on {port} within 60s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(moto)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `PUT /<bucket>` (moto does not check signatures); returns the status line.
    pub fn create_bucket(&self, bucket: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            s,
            "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )
        .unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        reply.lines().next().unwrap_or_default().to_string()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Descriptors this process holds for server-side sockets on `port` (the listener and every
/// accepted connection), from /proc: a socket descriptor names its inode, and /proc/net/tcp maps
/// inodes to local ports. Counting only these keeps the figure exact while the other tests of
/// a binary open their own sockets alongside. `None` where there is no /proc.
pub fn server_socket_fds(port: u16) -> Option<usize> {
    let inodes_on_port: std::collections::HashSet<String> = ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| text.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields.get(1)?.rsplit(':').next()?;
            let inode = fields.get(9)?;
            (u16::from_str_radix(local_port, 16).ok()? == port && *inode != "0").then(|| inode.to_string())
        })
        .collect();
    let fds = std::fs::read_dir("/proc/self/fd").ok()?;
    Some(
        fds.filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
            .filter_map(|target| {
                let target = target.to_string_lossy().into_owned();
                let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned();
                inodes_on_port.contains(&inode).then_some(())
            })
            .count(),
    )
}

/// Writes executable script `path` without this process ever holding it open for writing (a
/// child `sh` writes it): a test thread that forks meanwhile would carry a writable descriptor of
/// it into its child until that child execs, and running the script then fails with `ETXTBSY`.
pub fn write_program(path: &Path, text: &str) {
    let mut child = Command::new("sh")
        .args(["-c", r#"cat > "$1" && chmod 755 "$1""#, "sh"])
        .arg(path)
        .stdin(Stdio::piped())
        .spawn()
        .expect("sh runs");
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(text.as_bytes())
        .expect("sh reads its stdin");
    assert!(child.wait().expect("sh ends").success(), "writing {}", path.display());
}
