//! Publishing artifacts: where they go ([`Destination`], parsed from `spec.artifacts.destination`)
//! and the upload of one host file there, retried with capped backoff.
//!
//! Every attempt publishes under its own folder, `<destination>/<vm>/<guest path>`: the VM name
//! carries the build and the attempt, so a repeated attempt never overwrites another's files and
//! a reader can tell them apart (execution is at least once).
//!
//! * `file:///abs/dir/`: copied to a temp file beside the target, fsynced, renamed into place,
//!   and the directory fsynced, so a crash leaves the old file or the whole new one. The folders
//!   are walked from `/` without following any link (see [`super::nofollow`]): a link planted
//!   below the checked destination is refused, never written through.
//! * `s3://bucket/prefix/`: `object_store`'s S3 client, configured from the agent config's
//!   `[artifacts]` (`s3_region`, `s3_endpoint`, `s3_access_key_id`, `s3_secret_access_key`) and,
//!   for what it leaves unset, the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//!   `AWS_SESSION_TOKEN`, `AWS_REGION` or `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` or
//!   `AWS_ENDPOINT` for S3-compatible servers);
//!   plain `http://` endpoints are allowed (a local MinIO or moto), and large files go up in
//!   multipart chunks without being held in memory.

use crate::config::ArtifactsConfig;
use object_store::aws::AmazonS3Builder;
use object_store::buffered::BufWriter;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::path::{Path, PathBuf};

use super::nofollow::place_file;
use crate::real_path::resolve;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;
pub use tartan_api::destination::{
    Destination, DestinationError, MAX_NAME_BYTES, MAX_PATH_BYTES, check_bucket, join_key,
};
use tokio::io::AsyncWriteExt;

/// What the operator allows as artifact destinations (the agent config's `[artifacts]`), and the
/// folders no destination may ever reach, whatever the config says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DestinationPolicy {
    /// The config's own `destination`: always allowed (the operator wrote it), and used when a
    /// MacBuild names none.
    pub default: Option<String>,
    /// `allowed_file_roots`: a `file://` destination must resolve inside one of them. Empty: only
    /// the default may be `file://`.
    pub file_roots: Vec<PathBuf>,
    /// `allowed_buckets`: empty = any bucket; otherwise only these (and the default's).
    pub buckets: Vec<String>,
    /// The agent's own folders, each with the config key that names it (`state_dir`,
    /// `tart_home`): a destination may be neither inside one nor around one.
    pub protected: Vec<(&'static str, PathBuf)>,
}

impl DestinationPolicy {
    /// The policy of `settings`, protecting `state_dir` and (when known) tart's home.
    pub fn new(settings: &ArtifactsConfig, state_dir: &Path, tart_home: Option<&Path>) -> DestinationPolicy {
        let mut protected = vec![("state_dir", state_dir.to_path_buf())];
        protected.extend(tart_home.map(|h| ("tart_home", h.to_path_buf())));
        DestinationPolicy {
            default: settings.destination.clone(),
            file_roots: settings.allowed_file_roots.clone(),
            buckets: settings.allowed_buckets.clone(),
            protected,
        }
    }
}

/// Why a MacBuild's artifact destination is not used. Each message names the destination and the
/// agent config key that decides; nothing was uploaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DestinationRefused {
    #[error("the MacBuild names no artifact destination and the agent config has no [artifacts] destination")]
    NoDestination,
    #[error(transparent)]
    Malformed(#[from] DestinationError),
    #[error(
        "artifact destination {url:?} is refused: its part {segment:?} is named as a build's VM is, and each \
         build writes below its own VM's name: a destination there would write into another build's files"
    )]
    InsideAttemptFolder { url: String, segment: String },
    #[error(
        "artifact destination {url:?} is refused: this agent accepts a file:// destination only under \
         [artifacts] allowed_file_roots, which lists none, or equal to its [artifacts] destination ({})",
        .default.as_deref().unwrap_or("not set")
    )]
    FileNotAllowed { url: String, default: Option<String> },
    #[error(
        "artifact destination {url:?} is refused: it resolves to {}, which is inside none of [artifacts] \
         allowed_file_roots ({})",
        .resolved.display(), show_paths(.roots)
    )]
    OutsideRoots {
        url: String,
        resolved: PathBuf,
        roots: Vec<PathBuf>,
    },
    #[error(
        "artifact destination {url:?} is refused: it resolves to {}, {where_} the agent's {key} {}; a MacBuild \
         may never write there, whatever [artifacts] allowed_file_roots says",
        .resolved.display(), .dir.display()
    )]
    Protected {
        url: String,
        resolved: PathBuf,
        /// "inside" or "around".
        where_: &'static str,
        key: &'static str,
        dir: PathBuf,
    },
    #[error("artifact destination {url:?} is refused: {} cannot be resolved: {error}", .path.display())]
    Unresolvable { url: String, path: PathBuf, error: String },
    #[error(
        "artifact destination {url:?} is refused: bucket {bucket:?} is not one of [artifacts] allowed_buckets ({})",
        .allowed.join(", ")
    )]
    BucketNotAllowed {
        url: String,
        bucket: String,
        allowed: Vec<String>,
    },
}

fn show_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The destination a MacBuild's `spec.artifacts.destination` (`named`; empty = none) may use
/// under `policy`: the config's default when it names none, otherwise `named` if the policy
/// allows it. A `file://` destination comes back resolved (symlinks followed), so the upload
/// writes where the check looked, and never inside or around a protected folder.
pub fn allowed_destination(named: &str, policy: &DestinationPolicy) -> Result<Destination, DestinationRefused> {
    let url = match (named, &policy.default) {
        ("", Some(default)) => default.as_str(),
        ("", None) => return Err(DestinationRefused::NoDestination),
        (named, _) => named,
    };
    let is_default = policy.default.as_deref() == Some(url);
    let parsed = Destination::parse(url)?;
    if !is_default && matches!(parsed, Destination::S3 { .. }) {
        refuse_attempt_folders(url, &parsed)?;
    }
    match parsed {
        Destination::S3 { bucket, prefix } => {
            let default_bucket = match policy.default.as_deref().map(Destination::parse) {
                Some(Ok(Destination::S3 { bucket, .. })) => Some(bucket),
                _ => None,
            };
            if is_default
                || policy.buckets.is_empty()
                || policy.buckets.contains(&bucket)
                || default_bucket.as_ref() == Some(&bucket)
            {
                Ok(Destination::S3 { bucket, prefix })
            } else {
                Err(DestinationRefused::BucketNotAllowed {
                    url: url.to_string(),
                    bucket,
                    allowed: policy.buckets.clone(),
                })
            }
        }
        Destination::File { dir } => {
            let unresolvable = |path: &Path, e: std::io::Error| DestinationRefused::Unresolvable {
                url: url.to_string(),
                path: path.to_path_buf(),
                error: e.to_string(),
            };
            let resolved = resolve(&dir).map_err(|(p, e)| unresolvable(&p, e))?;
            for (key, protected) in &policy.protected {
                // A protected folder that does not exist (yet) is compared as written.
                let protected = resolve(protected).unwrap_or_else(|_| protected.clone());
                let where_ = if within(&resolved, &protected) {
                    "inside"
                } else if within(&protected, &resolved) {
                    "around"
                } else {
                    continue;
                };
                return Err(DestinationRefused::Protected {
                    url: url.to_string(),
                    resolved,
                    where_,
                    key,
                    dir: protected,
                });
            }
            if !is_default {
                // As written and as resolved (through a link).
                for dir in [&dir, &resolved] {
                    refuse_attempt_folders(url, &Destination::File { dir: dir.clone() })?;
                }
            }
            let default_dir = match policy.default.as_deref().map(Destination::parse) {
                Some(Ok(Destination::File { dir })) => resolve(&dir).ok(),
                _ => None,
            };
            if default_dir.as_ref() == Some(&resolved) {
                return Ok(Destination::File { dir: resolved });
            }
            if policy.file_roots.is_empty() {
                return Err(DestinationRefused::FileNotAllowed {
                    url: url.to_string(),
                    default: policy.default.clone(),
                });
            }
            // Component-wise: /allowed-root-evil is not inside /allowed-root.
            let inside = policy
                .file_roots
                .iter()
                .any(|root| resolve(root).is_ok_and(|root| resolved.starts_with(root)));
            if inside {
                Ok(Destination::File { dir: resolved })
            } else {
                Err(DestinationRefused::OutsideRoots {
                    url: url.to_string(),
                    resolved,
                    roots: policy.file_roots.clone(),
                })
            }
        }
    }
}

/// Refuses a destination with a folder (or S3 prefix segment) named as a build's VM is: every
/// build writes below `<destination>/<its vm>/`, so such a destination is inside another build's
/// attempt folder (its VM name is on its status), where its writes would collide with that
/// build's artifacts and step logs.
fn refuse_attempt_folders(url: &str, dest: &Destination) -> Result<(), DestinationRefused> {
    let segments: Vec<String> = match dest {
        Destination::S3 { prefix, .. } => prefix.split('/').map(str::to_string).collect(),
        Destination::File { dir } => dir
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect(),
    };
    match segments
        .into_iter()
        .find(|s| tartan_api::names::check_vm_name(&s.to_ascii_lowercase()).is_ok())
    {
        Some(segment) => Err(DestinationRefused::InsideAttemptFolder {
            url: url.to_string(),
            segment,
        }),
        None => Ok(()),
    }
}

/// Whether `path` is `dir` or inside it, component by component. On macOS the file system
/// usually ignores case, so the comparison does too there: a path that only differs in case
/// names the same folder.
fn within(path: &Path, dir: &Path) -> bool {
    if cfg!(target_os = "macos") {
        let fold = |p: &Path| PathBuf::from(p.to_string_lossy().to_lowercase());
        fold(path).starts_with(fold(dir))
    } else {
        path.starts_with(dir)
    }
}

/// The key under the destination for guest path `path` of the attempt whose VM is `vm`:
/// `<vm>/<path>` with `./` segments dropped. Absolute paths and `..` are refused (they would
/// escape the attempt's folder).
pub fn artifact_key(vm: &str, path: &str) -> Result<String, DestinationError> {
    let bad = |why| DestinationError::ArtifactPath {
        path: path.to_string(),
        why,
    };
    if path.starts_with('/') {
        return Err(bad("is absolute"));
    }
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty() && *s != ".").collect();
    if segments.is_empty() {
        return Err(bad("names no file"));
    }
    if segments.contains(&"..") {
        return Err(bad("contains '..'"));
    }
    if path.chars().any(char::is_control) {
        return Err(bad("contains control characters (NUL, newline, ...)"));
    }
    if segments.iter().any(|s| s.len() > MAX_NAME_BYTES) {
        return Err(bad("has a name longer than 255 bytes"));
    }
    // Shown to people in `kubectl tartan describe` and object listings: a right-to-left override
    // or isolate would show the name other than it is.
    if path.chars().any(is_bidi_control) {
        return Err(bad(
            "contains bidirectional, invisible or line-breaking format characters (U+061C, U+200B-U+200F, \
             U+2028-U+202E, U+2066-U+2069, U+FEFF)",
        ));
    }
    // `<vm>/logs/` holds the step logs the shipper writes and reads back (its listing counts the
    // parts shipped): an artifact there would replace a log or forge one.
    // Any case, folded as a Mac's disk folds it: `LOGS/` and `logſ/` are that folder there.
    if crate::host::mounts::case_fold(segments[0]) == tartan_api::logs::LOGS_FOLDER {
        return Err(bad("is in the logs/ folder, where the build's step logs are shipped"));
    }
    Ok(format!("{vm}/{}", segments.join("/")))
}

/// Characters that make a name show other than it is: bidi overrides, isolates and marks,
/// zero-width ones, and the Unicode line and paragraph separators (a fake second line).
fn is_bidi_control(c: char) -> bool {
    matches!(
        c,
        '\u{061C}' | '\u{200B}'..='\u{200F}' | '\u{2028}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{FEFF}'
    )
}

/// How hard to try an upload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UploadPolicy {
    /// Attempts per file (at least 1).
    pub attempts: u32,
    /// Wait before the second attempt; doubled each time up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Limit of one attempt (the store's own request retries included).
    pub attempt_timeout: Duration,
}

impl Default for UploadPolicy {
    fn default() -> Self {
        UploadPolicy {
            attempts: 5,
            backoff: Duration::from_secs(2),
            max_backoff: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(15 * 60),
        }
    }
}

/// An upload that failed for good.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("uploading {file} to {url} failed after {attempts} attempt(s): {last}")]
pub struct UploadError {
    pub file: PathBuf,
    pub url: String,
    pub attempts: u32,
    pub last: String,
}

/// Why one write of a file or object to a destination failed. Each says what failed, on what.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Writing below a `file://` folder: reading the source, or placing the file (see
    /// [`place_file`], whose messages name the folder or link in the way).
    #[error("{0}")]
    File(String),
    #[error("copy task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    #[error("configuring the S3 client for bucket {bucket}: {source}")]
    S3Client {
        bucket: String,
        #[source]
        source: object_store::Error,
    },
    #[error("no S3 client for bucket {bucket}")]
    NoS3Client { bucket: String },
    #[error("object key {key:?} is not valid: {source}")]
    Key {
        key: String,
        #[source]
        source: object_store::path::Error,
    },
    #[error("opening {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("PUT s3://{bucket}/{key}: {source}")]
    Put {
        bucket: String,
        key: String,
        #[source]
        source: object_store::Error,
    },
    /// Streaming a file into a multipart upload (its parts already sent are aborted).
    #[error("PUT s3://{bucket}/{key}: {source}")]
    PutStream {
        bucket: String,
        key: String,
        #[source]
        source: std::io::Error,
    },
}

/// Uploads host file `file` to `key` under `dest`, retrying per `policy`. Returns the URL.
pub async fn upload(
    dest: &Destination,
    key: &str,
    file: &Path,
    policy: &UploadPolicy,
    settings: &ArtifactsConfig,
) -> Result<String, UploadError> {
    let url = dest.url_of(key);
    let mut wait = policy.backoff;
    let attempts = policy.attempts.max(1);
    let mut last = String::new();
    for n in 1..=attempts {
        let once = async {
            match dest {
                Destination::File { dir } => copy_into(dir, key, file).await,
                Destination::S3 { bucket, prefix } => put_s3(bucket, &join_key(prefix, key), file, settings).await,
            }
        };
        match tokio::time::timeout(policy.attempt_timeout, once).await {
            Ok(Ok(())) => return Ok(url),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = format!("attempt did not finish within {:?}", policy.attempt_timeout),
        }
        if n < attempts {
            tracing::warn!(file = %file.display(), %url, attempt = n, error = %last, retry_in = ?wait, "artifact upload failed; retrying");
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(policy.max_backoff);
        }
    }
    Err(UploadError {
        file: file.to_path_buf(),
        url,
        attempts,
        last,
    })
}

/// Copies `file` to `dir/key` durably, without following a link below `/` (see [`place_file`]).
async fn copy_into(dir: &Path, key: &str, file: &Path) -> Result<(), StoreError> {
    let file = file.to_path_buf();
    place_durably(dir, key, move |out| {
        let mut source = std::fs::File::open(&file).map_err(|e| format!("copying {}: opening: {e}", file.display()))?;
        std::io::copy(&mut source, out)
            .map(|_| ())
            .map_err(|e| format!("copying {}: {e}", file.display()))
    })
    .await
}

/// Writes `bytes` to `dir/key` durably, as [`copy_into`] does.
async fn write_into(dir: &Path, key: &str, bytes: Vec<u8>) -> Result<(), StoreError> {
    let target = dir.join(key);
    place_durably(dir, key, move |out| {
        out.write_all(&bytes)
            .map_err(|e| format!("writing {}: {e}", target.display()))
    })
    .await
}

/// [`place_file`] on a blocking thread: a temp file created exclusively in the folder of
/// `dir/key` (opened from `/` without following links, made when missing), filled by `fill`,
/// synced, renamed into place within that folder, and the folder synced, so a crash leaves the
/// old file or the whole new one, and a link planted anywhere on the way is refused.
async fn place_durably(
    dir: &Path,
    key: &str,
    fill: impl FnOnce(&mut std::fs::File) -> Result<(), String> + Send + 'static,
) -> Result<(), StoreError> {
    let (dir, key) = (dir.to_path_buf(), key.to_string());
    tokio::task::spawn_blocking(move || place_file(&dir, &key, fill))
        .await
        .map_err(StoreError::Task)?
        .map_err(StoreError::File)
}

/// The S3 client for `bucket`, from `settings` and the environment (see the module docs).
pub fn s3_store(bucket: &str, settings: &ArtifactsConfig) -> Result<Arc<dyn ObjectStore>, StoreError> {
    // reqwest (under object_store) needs a process-wide TLS crypto provider; ring is the one
    // kube uses too. Installing fails harmlessly when one is already installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
    if let Some(id) = &settings.s3_access_key_id {
        builder = builder.with_access_key_id(id);
    }
    if let Some(secret) = &settings.s3_secret_access_key {
        builder = builder.with_secret_access_key(secret);
    }
    let endpoint = settings.s3_endpoint.clone().or_else(|| {
        std::env::var("AWS_ENDPOINT_URL")
            .or_else(|_| std::env::var("AWS_ENDPOINT"))
            .ok()
    });
    if let Some(endpoint) = endpoint.filter(|e| !e.is_empty()) {
        // A custom endpoint is an S3-compatible server: path-style requests, and http allowed
        // when the endpoint says http.
        builder = builder
            .with_endpoint(endpoint.clone())
            .with_virtual_hosted_style_request(false)
            .with_allow_http(endpoint.starts_with("http://"));
    }
    if let Some(region) = &settings.s3_region {
        builder = builder.with_region(region);
    } else if std::env::var("AWS_REGION").is_err() && std::env::var("AWS_DEFAULT_REGION").is_err() {
        builder = builder.with_region("us-east-1");
    }
    let retry = object_store::RetryConfig {
        max_retries: 3,
        retry_timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let store = builder
        .with_retry(retry)
        .build()
        .map_err(|source| StoreError::S3Client {
            bucket: bucket.to_string(),
            source,
        })?;
    Ok(Arc::new(store))
}

/// Writes `bytes` as object `key` under `dest` in one request: a durable file under a `file://`
/// folder, or one PUT through `s3` (the client of the destination's bucket, made once by the
/// caller with [`s3_store`]). No retries: the caller decides what a failure means.
pub async fn put_bytes(
    dest: &Destination,
    s3: Option<&Arc<dyn ObjectStore>>,
    key: &str,
    bytes: Vec<u8>,
) -> Result<(), StoreError> {
    match dest {
        Destination::File { dir } => write_into(dir, key, bytes).await,
        Destination::S3 { bucket, prefix } => {
            let key = join_key(prefix, key);
            let store = s3.ok_or_else(|| StoreError::NoS3Client { bucket: bucket.clone() })?;
            let location = object_path(&key)?;
            match store.put(&location, bytes.into()).await {
                Ok(_) => Ok(()),
                Err(source) => Err(StoreError::Put {
                    bucket: bucket.clone(),
                    key,
                    source,
                }),
            }
        }
    }
}

fn object_path(key: &str) -> Result<ObjectPath, StoreError> {
    ObjectPath::parse(key).map_err(|source| StoreError::Key {
        key: key.to_string(),
        source,
    })
}

async fn put_s3(bucket: &str, key: &str, file: &Path, settings: &ArtifactsConfig) -> Result<(), StoreError> {
    let store = s3_store(bucket, settings)?;
    let location = object_path(key)?;
    let mut source = tokio::fs::File::open(file).await.map_err(|source| StoreError::Open {
        path: file.to_path_buf(),
        source,
    })?;
    let put_failed = |source| StoreError::PutStream {
        bucket: bucket.to_string(),
        key: key.to_string(),
        source,
    };
    let mut writer = BufWriter::new(store, location);
    if let Err(e) = tokio::io::copy(&mut source, &mut writer).await {
        // Drop the parts already sent of a multipart upload.
        let _ = writer.abort().await;
        return Err(put_failed(e));
    }
    // Completes the upload (a single PUT, or the multipart completion); a failure here has
    // already cleaned up after itself.
    writer.shutdown().await.map_err(put_failed)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn artifact_keys_stay_inside_the_attempt_folder() {
        assert_eq!(artifact_key("mb-x", "out/App.ipa").unwrap(), "mb-x/out/App.ipa");
        assert_eq!(artifact_key("mb-x", "./out//App.ipa").unwrap(), "mb-x/out/App.ipa");
        assert!(artifact_key("mb-x", "/etc/passwd").is_err());
        assert!(artifact_key("mb-x", "out/../../x").is_err());
        assert!(artifact_key("mb-x", "./").is_err());
        assert!(artifact_key("mb-x", "..").is_err());
        assert!(artifact_key("mb-x", "out/..").is_err());
        assert!(artifact_key("mb-x", "").is_err());
        assert!(artifact_key("mb-x", "//etc/passwd").is_err());
        assert!(artifact_key("mb-x", "out/a\0b").is_err());
        assert!(artifact_key("mb-x", &format!("out/{}", "n".repeat(256))).is_err());
        assert!(artifact_key("mb-x", &format!("out/{}", "n".repeat(255))).is_ok());
        // Found by the adversary: an artifact named like a shipped log replaced it (or forged a
        // part the shipper's listing then counted), and a bidi override hid its real name.
        for path in [
            "logs/build.log",
            "./logs/build.log.part000001",
            "logs",
            "logs/x",
            "LOGS/build.log",
            "Logs/x",
        ] {
            let err = artifact_key("mb-x", path).unwrap_err().to_string();
            assert!(err.contains("logs/ folder"), "{path}: {err}");
        }
        assert!(
            artifact_key("mb-x", "out/logs/build.log").is_ok(),
            "only the top-level logs/ is the shipper's"
        );
        assert!(artifact_key("mb-x", "out/\u{202E}gpj.exe").is_err());
        assert!(artifact_key("mb-x", "out/\u{2066}a").is_err());
        let s3 = Destination::parse("s3://ci-artifacts/app/").unwrap();
        assert_eq!(s3.url_of("mb-x/out/App.ipa"), "s3://ci-artifacts/app/mb-x/out/App.ipa");
        let s3 = Destination::parse("s3://ci-artifacts").unwrap();
        assert_eq!(s3.url_of("mb-x/App.ipa"), "s3://ci-artifacts/mb-x/App.ipa");
        let f = Destination::parse("file:///srv/a/").unwrap();
        assert_eq!(f.url_of("mb-x/App.ipa"), "file:///srv/a/mb-x/App.ipa");
    }

    /// A host layout for the policy: `root` allowed, a sibling `root-evil`, the state dir and
    /// tart's home, and the symlinks a hostile destination would try.
    struct Layout {
        _tmp: tempfile::TempDir,
        base: PathBuf,
        root: PathBuf,
        state: PathBuf,
        home: PathBuf,
    }

    impl Layout {
        fn new() -> Layout {
            let tmp = tempfile::tempdir().unwrap();
            let base = std::fs::canonicalize(tmp.path()).unwrap();
            let root = base.join("allowed-root");
            let state = base.join("state");
            let home = base.join("tart");
            for d in [
                &root,
                &base.join("allowed-root-evil"),
                &state.join("journal"),
                &home.join("vms/mb-other"),
                &base.join("elsewhere"),
            ] {
                std::fs::create_dir_all(d).unwrap();
            }
            std::fs::write(root.join("a-file"), b"x").unwrap();
            let link = |target: &Path, name: &str| std::os::unix::fs::symlink(target, root.join(name)).unwrap();
            link(&state, "to-state");
            link(&home.join("vms/mb-other"), "to-vm");
            link(&base.join("elsewhere"), "to-elsewhere");
            link(&base.join("nowhere"), "dangling");
            link(&root.join("sub"), "to-sub");
            std::fs::create_dir_all(root.join("sub")).unwrap();
            std::os::unix::fs::symlink(&root, base.join("root-link")).unwrap();
            Layout {
                _tmp: tmp,
                base,
                root,
                state,
                home,
            }
        }

        fn policy(&self, roots: &[&Path]) -> DestinationPolicy {
            let settings = ArtifactsConfig {
                allowed_file_roots: roots.iter().map(|r| r.to_path_buf()).collect(),
                ..Default::default()
            };
            DestinationPolicy::new(&settings, &self.state, Some(&self.home))
        }
    }

    fn file(dir: impl Into<PathBuf>) -> String {
        format!("file://{}/", dir.into().display())
    }

    #[test]
    fn file_destinations_must_resolve_inside_an_allowed_root() {
        let l = Layout::new();
        let policy = l.policy(&[&l.root]);
        let ok = |url: String| match allowed_destination(&url, &policy) {
            Ok(Destination::File { dir }) => dir,
            other => panic!("{url}: {other:?}"),
        };
        assert_eq!(ok(file(l.root.join("builds"))), l.root.join("builds"));
        assert_eq!(ok(file(&l.root)), l.root);
        assert_eq!(ok(format!("file://{}", l.root.display())), l.root);
        assert_eq!(ok(format!("file://{}//x//", l.root.display())), l.root.join("x"));
        // Symlinks that stay inside are fine, and the upload gets the resolved folder.
        assert_eq!(ok(file(l.root.join("to-sub/x"))), l.root.join("sub/x"));
        // A root written through a symlink works as well as the real one.
        let via_link = l.policy(&[&l.base.join("root-link")]);
        assert!(allowed_destination(&file(l.root.join("x")), &via_link).is_ok());
        assert!(allowed_destination(&file(l.base.join("root-link/x")), &policy).is_ok());

        let refused = |url: String| allowed_destination(&url, &policy).unwrap_err();
        // The sibling-prefix trick: /allowed-root-evil is not inside /allowed-root.
        let e = refused(file(l.base.join("allowed-root-evil/x")));
        assert!(matches!(e, DestinationRefused::OutsideRoots { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains("allowed-root-evil/x") && text.contains("[artifacts] allowed_file_roots"),
            "{text}"
        );
        // Symlink escapes: the resolved folder decides.
        let e = refused(file(l.root.join("to-elsewhere/x")));
        assert!(
            matches!(&e, DestinationRefused::OutsideRoots { resolved, .. } if *resolved == l.base.join("elsewhere/x")),
            "{e:?}"
        );
        let e = refused(file(l.root.join("to-state/journal")));
        assert!(
            matches!(
                e,
                DestinationRefused::Protected {
                    key: "state_dir",
                    where_: "inside",
                    ..
                }
            ),
            "{e:?}"
        );
        let e = refused(file(l.root.join("to-vm")));
        assert!(
            matches!(e, DestinationRefused::Protected { key: "tart_home", .. }),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("whatever [artifacts] allowed_file_roots says"),
            "{e}"
        );
        // Something that exists but cannot be a folder, or a symlink to nowhere.
        let e = refused(file(l.root.join("dangling/x")));
        assert!(
            matches!(&e, DestinationRefused::Unresolvable { path, .. } if *path == l.root.join("dangling")),
            "{e:?}"
        );
        assert!(matches!(
            refused(file(l.root.join("a-file/x"))),
            DestinationRefused::Unresolvable { .. }
        ));
        // Lexical tricks never get as far as the file system.
        for url in [
            format!("file://{}/../state/", l.root.display()),
            format!("file://{}/%2e%2e/state/", l.root.display()),
            format!("file://{}/x\0/", l.root.display()),
        ] {
            assert!(
                matches!(refused(url.clone()), DestinationRefused::Malformed(_)),
                "{url}"
            );
        }
        // Absolute paths elsewhere.
        assert!(matches!(refused(file("/etc")), DestinationRefused::OutsideRoots { .. }));
    }

    #[test]
    fn the_state_dir_and_tart_home_are_refused_whatever_the_roots_say() {
        let l = Layout::new();
        // Roots that a config check would have refused, handed over anyway.
        let policy = l.policy(&[&l.base, &l.state, &l.home]);
        for (dir, key, where_) in [
            (l.state.clone(), "state_dir", "inside"),
            (l.state.join("journal/1.journal"), "state_dir", "inside"),
            (l.state.join("deadlines"), "state_dir", "inside"),
            (l.home.join("vms/mb-other"), "tart_home", "inside"),
            (l.home.clone(), "tart_home", "inside"),
            // Around: the attempt folder would sit next to the agent's own.
            (l.base.clone(), "state_dir", "around"),
        ] {
            let e = allowed_destination(&file(&dir), &policy).unwrap_err();
            assert!(
                matches!(&e, DestinationRefused::Protected { key: k, where_: w, .. } if *k == key && *w == where_),
                "{}: {e:?}",
                dir.display()
            );
            assert!(e.to_string().contains(&file(&dir)), "{e}");
        }
        // The default destination is no exception.
        let settings = ArtifactsConfig {
            destination: Some(file(l.state.join("out"))),
            ..Default::default()
        };
        let policy = DestinationPolicy::new(&settings, &l.state, Some(&l.home));
        assert!(matches!(
            allowed_destination("", &policy),
            Err(DestinationRefused::Protected { .. })
        ));
        // A protected folder that does not exist yet is compared as written.
        let policy = DestinationPolicy::new(&Default::default(), &l.base.join("new-state"), None);
        let policy = DestinationPolicy {
            file_roots: vec![l.base.clone()],
            ..policy
        };
        assert!(matches!(
            allowed_destination(&file(l.base.join("new-state/logs")), &policy),
            Err(DestinationRefused::Protected { .. })
        ));
    }

    #[test]
    fn without_roots_only_the_configured_destination_may_be_a_file() {
        let l = Layout::new();
        let default = l.root.join("default");
        let settings = ArtifactsConfig {
            destination: Some(file(&default)),
            ..Default::default()
        };
        let policy = DestinationPolicy::new(&settings, &l.state, Some(&l.home));
        let want = Destination::File { dir: default.clone() };
        assert_eq!(allowed_destination("", &policy), Ok(want.clone()));
        assert_eq!(allowed_destination(&file(&default), &policy), Ok(want.clone()));
        assert_eq!(
            allowed_destination(&format!("file://{}", default.display()), &policy),
            Ok(want.clone())
        );
        assert_eq!(
            allowed_destination(&file(l.base.join("root-link/default")), &policy),
            Ok(want)
        );
        let e = allowed_destination(&file(l.root.join("other")), &policy).unwrap_err();
        assert!(matches!(e, DestinationRefused::FileNotAllowed { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains(&file(l.root.join("other")))
                && text.contains("[artifacts] allowed_file_roots, which lists none"),
            "{text}"
        );
        // No default and no named destination.
        let none = DestinationPolicy::new(&Default::default(), &l.state, None);
        assert_eq!(allowed_destination("", &none), Err(DestinationRefused::NoDestination));
        assert!(matches!(
            allowed_destination(&file(&l.root), &none),
            Err(DestinationRefused::FileNotAllowed { .. })
        ));
    }

    #[test]
    fn buckets_are_any_unless_listed() {
        let any = DestinationPolicy::default();
        assert!(allowed_destination("s3://anything-goes/x/", &any).is_ok());
        let settings = ArtifactsConfig {
            destination: Some("s3://default-bucket/ci/".into()),
            allowed_buckets: vec!["ci-artifacts".into()],
            ..Default::default()
        };
        let listed = DestinationPolicy::new(&settings, Path::new("/state"), None);
        assert_eq!(
            allowed_destination("s3://ci-artifacts/app/", &listed),
            Ok(Destination::S3 {
                bucket: "ci-artifacts".into(),
                prefix: "app".into()
            })
        );
        assert!(allowed_destination("s3://default-bucket/elsewhere/", &listed).is_ok());
        assert!(allowed_destination("", &listed).is_ok());
        let e = allowed_destination("s3://ci-artifacts-evil/x", &listed).unwrap_err();
        assert_eq!(
            e.to_string(),
            "artifact destination \"s3://ci-artifacts-evil/x\" is refused: bucket \"ci-artifacts-evil\" is not one \
             of [artifacts] allowed_buckets (ci-artifacts)"
        );
        assert!(matches!(
            allowed_destination("s3://Bad/x", &listed),
            Err(DestinationRefused::Malformed(_))
        ));
    }

    #[tokio::test]
    async fn file_upload_copies_durably_and_retries_then_gives_up() {
        let dir = tempfile::tempdir().unwrap();
        // Resolved, as allowed_destination hands it over (the walk refuses any link, /var on a Mac too).
        let tmp = std::fs::canonicalize(dir.path()).unwrap();
        let src = tmp.join("App.ipa");
        std::fs::write(&src, b"payload").unwrap();
        let dest = Destination::File { dir: tmp.join("dest") };
        let policy = UploadPolicy {
            attempts: 2,
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
            attempt_timeout: Duration::from_secs(10),
        };
        let url = upload(&dest, "mb-x/out/App.ipa", &src, &policy, &Default::default())
            .await
            .unwrap();
        assert_eq!(url, format!("file://{}/dest/mb-x/out/App.ipa", tmp.display()));
        assert_eq!(std::fs::read(tmp.join("dest/mb-x/out/App.ipa")).unwrap(), b"payload");
        let leftovers: Vec<_> = std::fs::read_dir(tmp.join("dest/mb-x/out")).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
        // A missing source fails every attempt and the error says so.
        let e = upload(&dest, "mb-x/gone", &tmp.join("gone"), &policy, &Default::default())
            .await
            .unwrap_err();
        assert_eq!(e.attempts, 2);
        assert!(e.to_string().contains("failed after 2 attempt(s): copying"), "{e}");
    }

    /// The adversary's run: a build that can write into the destination plants `<vm>` as a link
    /// to the state dir's `deadlines/` and names an artifact after another build's deadline file.
    /// Once the artifact landed there (and the watchdog deleted the other VM); now the upload
    /// fails naming the link, for the artifact and for the log shipping's writes alike.
    #[tokio::test]
    async fn an_upload_never_follows_a_link_planted_below_the_destination() {
        let tmp = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(tmp.path()).unwrap();
        let deadlines = base.join("state/deadlines");
        std::fs::create_dir_all(&deadlines).unwrap();
        std::fs::write(deadlines.join("mb-other.json"), b"{}").unwrap();
        let dest_dir = base.join("artifacts");
        std::fs::create_dir_all(&dest_dir).unwrap();
        std::os::unix::fs::symlink(&deadlines, dest_dir.join("mb-x")).unwrap();
        let src = base.join("forged.json");
        std::fs::write(&src, b"{\"deadline\": \"1970-01-01T00:00:00Z\"}").unwrap();
        let dest = Destination::File { dir: dest_dir.clone() };
        let policy = UploadPolicy {
            attempts: 1,
            ..UploadPolicy::default()
        };
        let e = upload(&dest, "mb-x/mb-other.json", &src, &policy, &Default::default())
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("{} is a symbolic link", dest_dir.join("mb-x").display())),
            "{e}"
        );
        let e = put_bytes(&dest, None, "mb-x/logs/mb-new.json", b"{}".to_vec())
            .await
            .unwrap_err();
        assert!(
            matches!(&e, StoreError::File(why) if why.contains("is a symbolic link")),
            "{e}"
        );
        let left: Vec<_> = std::fs::read_dir(&deadlines)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec!["mb-other.json"]);
        assert_eq!(std::fs::read(deadlines.join("mb-other.json")).unwrap(), b"{}");
    }
}
