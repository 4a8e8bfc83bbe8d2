//! Reading a build's logs folder (`status.logs`) with the user's own access: an S3 bucket
//! through the AWS environment (and `~/.aws/credentials`), or a `file://` folder this machine can
//! see (the Mac itself, or a share of the agent's destination).

use futures::TryStreamExt;
use object_store::ObjectStore;
use object_store::ObjectStoreExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use std::io::{Read as _, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tartan_api::destination::Destination;

/// Limit of one request to the store.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// A logs folder.
pub enum Store {
    File {
        dir: PathBuf,
    },
    S3 {
        store: Arc<dyn ObjectStore>,
        bucket: String,
        /// The folder's key, without a trailing `/`.
        folder: String,
    },
}

impl Store {
    /// The store of location `url` (`s3://bucket/…/logs/` or `file:///…/logs/`).
    pub fn open(url: &str) -> anyhow::Result<Store> {
        match Destination::parse(url).map_err(|e| anyhow::anyhow!("the logs location {url:?} cannot be read: {e}"))? {
            Destination::File { dir } => Ok(Store::File { dir }),
            Destination::S3 { bucket, prefix } => {
                let store =
                    s3_client(&bucket).map_err(|e| anyhow::anyhow!("configuring the S3 client for {url}: {e}"))?;
                Ok(Store::S3 {
                    store,
                    bucket,
                    folder: prefix,
                })
            }
        }
    }

    /// Names and sizes of the folder's objects; an absent folder is empty (nothing shipped yet).
    pub async fn list(&self) -> anyhow::Result<Vec<(String, u64)>> {
        match self {
            Store::File { dir } => {
                let entries = match std::fs::read_dir(dir) {
                    Ok(e) => e,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
                    Err(e) => anyhow::bail!("the logs folder {} is unreachable: {e}", dir.display()),
                };
                Ok(entries
                    .flatten()
                    .filter_map(|e| Some((e.file_name().into_string().ok()?, e.metadata().ok()?.len())))
                    .collect())
            }
            Store::S3 { store, bucket, folder } => {
                let path = ObjectPath::parse(folder)?;
                let listed = tokio::time::timeout(REQUEST_TIMEOUT, store.list(Some(&path)).try_collect::<Vec<_>>())
                    .await
                    .map_err(|_| anyhow::anyhow!("the store is unreachable: listing s3://{bucket}/{folder}/ got no answer within {REQUEST_TIMEOUT:?}"))?
                    .map_err(|e| anyhow::anyhow!("the store is unreachable: listing s3://{bucket}/{folder}/: {e}"))?;
                Ok(listed
                    .into_iter()
                    .filter_map(|m| Some((m.location.filename()?.to_string(), m.size)))
                    .collect())
            }
        }
    }

    /// Bytes `from..to` of object `name` of the folder.
    pub async fn get(&self, name: &str, from: u64, to: u64) -> anyhow::Result<Vec<u8>> {
        match self {
            Store::File { dir } => {
                let path = dir.join(name);
                let read = || -> std::io::Result<Vec<u8>> {
                    let mut f = std::fs::File::open(&path)?;
                    f.seek(SeekFrom::Start(from))?;
                    let mut buf = Vec::new();
                    f.take(to - from).read_to_end(&mut buf)?;
                    Ok(buf)
                };
                read().map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))
            }
            Store::S3 { store, bucket, folder } => {
                let key = format!("{folder}/{name}");
                let path = ObjectPath::parse(&key)?;
                let got = tokio::time::timeout(REQUEST_TIMEOUT, store.get_range(&path, from..to))
                    .await
                    .map_err(|_| {
                        anyhow::anyhow!(
                            "the store is unreachable: GET s3://{bucket}/{key} got no answer within {REQUEST_TIMEOUT:?}"
                        )
                    })?
                    .map_err(|e| anyhow::anyhow!("GET s3://{bucket}/{key}: {e}"))?;
                Ok(got.to_vec())
            }
        }
    }
}

/// The S3 client for `bucket` as the AWS tools would make it: `AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`/`AWS_DEFAULT_REGION` and
/// `AWS_ENDPOINT_URL` from the environment; keys not in it come from the `AWS_PROFILE` (else
/// `default`) section of `~/.aws/credentials` (or `AWS_SHARED_CREDENTIALS_FILE`), the region from
/// `~/.aws/config`; an endpoint means an S3-compatible server (path-style, http allowed).
fn s3_client(bucket: &str) -> anyhow::Result<Arc<dyn ObjectStore>> {
    // object_store's reqwest has no TLS provider of its own; installing fails harmlessly when one is.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
    let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".into());
    let home = env("HOME").map(PathBuf::from);
    if env("AWS_ACCESS_KEY_ID").is_none() {
        let file = env("AWS_SHARED_CREDENTIALS_FILE")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws/credentials")));
        if let Some(text) = file.and_then(|f| std::fs::read_to_string(f).ok()) {
            let section = ini_section(&text, &profile);
            for (key, value) in section {
                builder = match key.as_str() {
                    "aws_access_key_id" => builder.with_access_key_id(value),
                    "aws_secret_access_key" => builder.with_secret_access_key(value),
                    "aws_session_token" => builder.with_token(value),
                    _ => builder,
                };
            }
        }
    }
    let mut region = env("AWS_REGION").or_else(|| env("AWS_DEFAULT_REGION"));
    if region.is_none() {
        let file = env("AWS_CONFIG_FILE")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws/config")));
        let section = if profile == "default" {
            "default".to_string()
        } else {
            format!("profile {profile}")
        };
        region = file
            .and_then(|f| std::fs::read_to_string(f).ok())
            .and_then(|text| ini_section(&text, &section).into_iter().find(|(k, _)| k == "region"))
            .map(|(_, v)| v);
    }
    builder = builder.with_region(region.unwrap_or_else(|| "us-east-1".into()));
    if let Some(endpoint) = env("AWS_ENDPOINT_URL").or_else(|| env("AWS_ENDPOINT")) {
        builder = builder
            .with_allow_http(endpoint.starts_with("http://"))
            .with_endpoint(endpoint)
            .with_virtual_hosted_style_request(false);
    }
    let retry = object_store::RetryConfig {
        max_retries: 2,
        retry_timeout: Duration::from_secs(15),
        ..Default::default()
    };
    Ok(Arc::new(builder.with_retry(retry).build()?))
}

/// The `key = value` lines of section `[name]` of an INI text (the AWS files' format): keys
/// lowercased, values trimmed, comments (`#`, `;`) skipped.
pub fn ini_section(text: &str, name: &str) -> Vec<(String, String)> {
    let mut inside = false;
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = header.trim() == name;
            continue;
        }
        if inside && let Some((k, v)) = line.split_once('=') {
            out.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn ini_sections_as_the_aws_files_write_them() {
        let text = "[default]\naws_access_key_id = AKIA1\n# note\naws_secret_access_key=s1\n\n[ci]\nAWS_ACCESS_KEY_ID = AKIA2\n; x\n[profile ci]\nregion = eu-west-1\n";
        assert_eq!(
            ini_section(text, "default"),
            [
                ("aws_access_key_id".to_string(), "AKIA1".to_string()),
                ("aws_secret_access_key".to_string(), "s1".to_string())
            ]
        );
        assert_eq!(
            ini_section(text, "ci"),
            [("aws_access_key_id".to_string(), "AKIA2".to_string())]
        );
        assert_eq!(
            ini_section(text, "profile ci"),
            [("region".to_string(), "eu-west-1".to_string())]
        );
        assert!(ini_section(text, "absent").is_empty());
    }

    #[test]
    fn locations_open_as_their_store() {
        assert!(
            matches!(Store::open("file:///srv/a/mb-x/logs/").unwrap(), Store::File { dir } if dir == Path::new("/srv/a/mb-x/logs"))
        );
        match Store::open("s3://ci-artifacts/app/mb-x/logs/").unwrap() {
            Store::S3 { bucket, folder, .. } => {
                assert_eq!((bucket.as_str(), folder.as_str()), ("ci-artifacts", "app/mb-x/logs"))
            }
            Store::File { .. } => panic!("not a file location"),
        }
        let e = Store::open("https://example.com/x").err().unwrap().to_string();
        assert!(e.contains("cannot be read"), "{e}");
    }
}
