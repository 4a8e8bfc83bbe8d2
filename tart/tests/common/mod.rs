//! What the driver's test files share.

use std::io::Write;
use std::path::Path;

/// Writes executable script `path` without this process ever holding it open for writing (a
/// child `sh` writes it): a test thread that forks meanwhile would carry a writable descriptor of
/// it into its child until that child execs, and running the script then fails with `ETXTBSY`.
pub fn write_program(path: &Path, text: &str) {
    let mut child = std::process::Command::new("sh")
        .args(["-c", r#"cat > "$1" && chmod 755 "$1""#, "sh"])
        .arg(path)
        .stdin(std::process::Stdio::piped())
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
