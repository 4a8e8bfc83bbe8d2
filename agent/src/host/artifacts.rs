//! Publishing artifacts: where they go ([`Destination`], parsed from `spec.artifacts.destination`)
//! and the upload of one host file there, retried with capped backoff.
//!
//! Every attempt publishes under its own folder, `<destination>/<vm>/<guest path>`: the VM name
//! carries the build and the attempt, so a repeated attempt never overwrites another's files and
//! a reader can tell them apart (execution is at least once).
//!
//! * `file:///abs/dir/`: copied to a temp file beside the target, fsynced, renamed into place,
//!   and the directory fsynced, so a crash leaves the old file or the whole new one.
//! * `s3://bucket/prefix/`: `object_store`'s S3 client, configured from the agent config's
//!   `[artifacts]` (`s3_region`, `s3_endpoint`, `s3_access_key_id`, `s3_secret_access_key`) and,
//!   for what it leaves unset, the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//!   `AWS_SESSION_TOKEN`, `AWS_REGION` or `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` or
//!   `AWS_ENDPOINT` for S3-compatible servers);
//!   plain `http://` endpoints are allowed (a local MinIO or moto), and large files go up in
//!   multipart chunks without being held in memory.

use crate::config::ArtifactsConfig;
use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use object_store::buffered::BufWriter;
use object_store::path::Path as ObjectPath;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Where a build's artifacts go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    /// An absolute host directory.
    File { dir: PathBuf },
    /// An S3 bucket and a key prefix (no leading or trailing `/`; may be empty).
    S3 { bucket: String, prefix: String },
}

/// A destination or artifact path that cannot be used; nothing was uploaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    #[error(
        "artifact destination {0:?} is neither s3://bucket/prefix/ nor file:///absolute/dir/; nothing was uploaded"
    )]
    Scheme(String),
    #[error("artifact destination {url:?}: bucket name {bucket:?} {why}; nothing was uploaded")]
    Bucket {
        url: String,
        bucket: String,
        why: &'static str,
    },
    #[error("artifact destination {url:?}: {why}; nothing was uploaded")]
    Path { url: String, why: &'static str },
    #[error("artifact path {path:?} {why}; artifacts are paths relative to the build directory")]
    ArtifactPath { path: String, why: &'static str },
}

impl Destination {
    /// Parses `s3://bucket[/prefix][/]` or `file:///absolute/dir[/]`.
    pub fn parse(url: &str) -> Result<Destination, DestinationError> {
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            check_bucket(bucket).map_err(|why| DestinationError::Bucket {
                url: url.to_string(),
                bucket: bucket.to_string(),
                why,
            })?;
            let prefix = prefix.trim_matches('/');
            if prefix.split('/').any(|seg| seg == "." || seg == "..") || prefix.contains("//") {
                return Err(DestinationError::Path {
                    url: url.to_string(),
                    why: "the key prefix has empty, '.' or '..' segments",
                });
            }
            return Ok(Destination::S3 {
                bucket: bucket.to_string(),
                prefix: prefix.to_string(),
            });
        }
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(DestinationError::Path {
                    url: url.to_string(),
                    why: "a file destination needs an absolute path (file:///dir/)",
                });
            }
            let dir = PathBuf::from(path);
            if dir.components().any(|c| c == Component::ParentDir) {
                return Err(DestinationError::Path {
                    url: url.to_string(),
                    why: "the path contains '..'",
                });
            }
            return Ok(Destination::File { dir });
        }
        Err(DestinationError::Scheme(url.to_string()))
    }

    /// The URL of `key` (a `/`-separated relative key) under this destination.
    pub fn url_of(&self, key: &str) -> String {
        match self {
            Destination::File { dir } => format!("file://{}", dir.join(key).display()),
            Destination::S3 { bucket, prefix } => format!("s3://{bucket}/{}", join_key(prefix, key)),
        }
    }
}

fn check_bucket(b: &str) -> Result<(), &'static str> {
    if !(3..=63).contains(&b.len()) {
        return Err("must be 3 to 63 characters long");
    }
    if !b
        .bytes()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'.' || c == b'-')
    {
        return Err("may contain only lowercase letters, digits, '.' and '-'");
    }
    let edge_ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    if !edge_ok(b.as_bytes()[0]) || !edge_ok(b.as_bytes()[b.len() - 1]) {
        return Err("must start and end with a letter or digit");
    }
    Ok(())
}

fn join_key(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}/{key}")
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
    Ok(format!("{vm}/{}", segments.join("/")))
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
            Ok(Err(e)) => last = e,
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

/// Copies `file` to `dir/key` durably: temp file beside the target, fsync, rename, fsync dir.
async fn copy_into(dir: &Path, key: &str, file: &Path) -> Result<(), String> {
    let target = dir.join(key);
    let parent = target.parent().unwrap_or(dir).to_path_buf();
    let (file, target2) = (file.to_path_buf(), target.clone());
    tokio::task::spawn_blocking(move || -> Result<(), String> {
        let target = target2;
        std::fs::create_dir_all(&parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
        let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("artifact");
        let temp = parent.join(format!(".{name}.{}.part", std::process::id()));
        let result = (|| {
            std::fs::copy(&file, &temp)
                .map_err(|e| format!("copying {} to {}: {e}", file.display(), temp.display()))?;
            std::fs::File::open(&temp)
                .and_then(|f| f.sync_all())
                .map_err(|e| format!("syncing {}: {e}", temp.display()))?;
            std::fs::rename(&temp, &target)
                .map_err(|e| format!("renaming {} to {}: {e}", temp.display(), target.display()))?;
            std::fs::File::open(&parent)
                .and_then(|d| d.sync_all())
                .map_err(|e| format!("syncing directory {}: {e}", parent.display()))
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        result
    })
    .await
    .map_err(|e| format!("copy task failed: {e}"))?
}

/// The S3 client for `bucket`, from `settings` and the environment (see the module docs).
pub fn s3_store(bucket: &str, settings: &ArtifactsConfig) -> Result<Arc<dyn ObjectStore>, String> {
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
        .map_err(|e| format!("configuring the S3 client for bucket {bucket}: {e}"))?;
    Ok(Arc::new(store))
}

async fn put_s3(bucket: &str, key: &str, file: &Path, settings: &ArtifactsConfig) -> Result<(), String> {
    let store = s3_store(bucket, settings)?;
    let location = ObjectPath::parse(key).map_err(|e| format!("object key {key:?} is not valid: {e}"))?;
    let mut source = tokio::fs::File::open(file)
        .await
        .map_err(|e| format!("opening {}: {e}", file.display()))?;
    let mut writer = BufWriter::new(store, location);
    if let Err(e) = tokio::io::copy(&mut source, &mut writer).await {
        // Drop the parts already sent of a multipart upload.
        let _ = writer.abort().await;
        return Err(format!("PUT s3://{bucket}/{key}: {e}"));
    }
    // Completes the upload (a single PUT, or the multipart completion); a failure here has
    // already cleaned up after itself.
    writer
        .shutdown()
        .await
        .map_err(|e| format!("PUT s3://{bucket}/{key}: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_parse_or_say_why_not() {
        assert_eq!(
            Destination::parse("s3://ci-artifacts/app/").unwrap(),
            Destination::S3 {
                bucket: "ci-artifacts".into(),
                prefix: "app".into()
            }
        );
        assert_eq!(
            Destination::parse("s3://ci.artifacts").unwrap(),
            Destination::S3 {
                bucket: "ci.artifacts".into(),
                prefix: "".into()
            }
        );
        assert_eq!(
            Destination::parse("s3://b12/a/b/").unwrap(),
            Destination::S3 {
                bucket: "b12".into(),
                prefix: "a/b".into()
            }
        );
        assert_eq!(
            Destination::parse("file:///var/artifacts/").unwrap(),
            Destination::File {
                dir: "/var/artifacts/".into()
            }
        );
        let e = Destination::parse("s3://Bad_Bucket/x").unwrap_err();
        assert_eq!(
            e.to_string(),
            "artifact destination \"s3://Bad_Bucket/x\": bucket name \"Bad_Bucket\" may contain only lowercase \
             letters, digits, '.' and '-'; nothing was uploaded"
        );
        assert!(matches!(
            Destination::parse("s3://ab/x"),
            Err(DestinationError::Bucket { .. })
        ));
        assert!(matches!(
            Destination::parse("s3://-ab/x"),
            Err(DestinationError::Bucket { .. })
        ));
        assert!(matches!(
            Destination::parse("s3://abc/x/../y"),
            Err(DestinationError::Path { .. })
        ));
        assert!(matches!(
            Destination::parse("file://relative/dir"),
            Err(DestinationError::Path { .. })
        ));
        assert!(matches!(
            Destination::parse("file:///a/../b"),
            Err(DestinationError::Path { .. })
        ));
        assert!(matches!(
            Destination::parse("https://x/y"),
            Err(DestinationError::Scheme(_))
        ));
        assert!(matches!(Destination::parse(""), Err(DestinationError::Scheme(_))));
    }

    #[test]
    fn artifact_keys_stay_inside_the_attempt_folder() {
        assert_eq!(artifact_key("mb-x", "out/App.ipa").unwrap(), "mb-x/out/App.ipa");
        assert_eq!(artifact_key("mb-x", "./out//App.ipa").unwrap(), "mb-x/out/App.ipa");
        assert!(artifact_key("mb-x", "/etc/passwd").is_err());
        assert!(artifact_key("mb-x", "out/../../x").is_err());
        assert!(artifact_key("mb-x", "./").is_err());
        let s3 = Destination::parse("s3://ci-artifacts/app/").unwrap();
        assert_eq!(s3.url_of("mb-x/out/App.ipa"), "s3://ci-artifacts/app/mb-x/out/App.ipa");
        let s3 = Destination::parse("s3://ci-artifacts").unwrap();
        assert_eq!(s3.url_of("mb-x/App.ipa"), "s3://ci-artifacts/mb-x/App.ipa");
        let f = Destination::parse("file:///srv/a/").unwrap();
        assert_eq!(f.url_of("mb-x/App.ipa"), "file:///srv/a/mb-x/App.ipa");
    }

    #[tokio::test]
    async fn file_upload_copies_durably_and_retries_then_gives_up() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("App.ipa");
        std::fs::write(&src, b"payload").unwrap();
        let dest = Destination::File {
            dir: tmp.path().join("dest"),
        };
        let policy = UploadPolicy {
            attempts: 2,
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
            attempt_timeout: Duration::from_secs(10),
        };
        let url = upload(&dest, "mb-x/out/App.ipa", &src, &policy, &Default::default())
            .await
            .unwrap();
        assert_eq!(url, format!("file://{}/dest/mb-x/out/App.ipa", tmp.path().display()));
        assert_eq!(
            std::fs::read(tmp.path().join("dest/mb-x/out/App.ipa")).unwrap(),
            b"payload"
        );
        let leftovers: Vec<_> = std::fs::read_dir(tmp.path().join("dest/mb-x/out")).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
        // A missing source fails every attempt and the error says so.
        let e = upload(
            &dest,
            "mb-x/gone",
            &tmp.path().join("gone"),
            &policy,
            &Default::default(),
        )
        .await
        .unwrap_err();
        assert_eq!(e.attempts, 2);
        assert!(e.to_string().contains("failed after 2 attempt(s): copying"), "{e}");
    }
}
