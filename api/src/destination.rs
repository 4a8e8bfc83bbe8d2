//! Where a build's artifacts go: the shape of `spec.artifacts.destination` (`s3://bucket/prefix/`
//! or `file:///absolute/dir/`), checked without touching any file. The controller refuses a
//! malformed one early; the agent, which alone knows its config and folders, decides whether the
//! destination is allowed (`[artifacts] allowed_file_roots`, `allowed_buckets`).

use std::path::{Component, PathBuf};

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
        if url.chars().any(char::is_control) {
            return Err(DestinationError::Path {
                url: url.to_string(),
                why: "it contains control characters (NUL, newline, ...)",
            });
        }
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
            let bad = |why| DestinationError::Path {
                url: url.to_string(),
                why,
            };
            // Nothing is percent-decoded: a '%' would be taken literally, which is never what a
            // URL writer meant (and `%2e%2e` must not look like a way around the '..' check).
            if path.contains('%') {
                return Err(bad(
                    "the path contains '%'; percent-escapes are not decoded, write the path plainly",
                ));
            }
            if path.len() > MAX_PATH_BYTES {
                return Err(bad("the path is longer than 1024 bytes"));
            }
            let dir = PathBuf::from(path);
            if dir.components().any(|c| c == Component::ParentDir) {
                return Err(bad("the path contains '..'"));
            }
            if dir.iter().any(|name| name.len() > MAX_NAME_BYTES) {
                return Err(bad("a name in the path is longer than 255 bytes"));
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

/// Longest path a `file://` destination may name, and longest single name in it (macOS's
/// `PATH_MAX` and `NAME_MAX`): a longer one could only fail later, half-way through an upload.
pub const MAX_PATH_BYTES: usize = 1024;
pub const MAX_NAME_BYTES: usize = 255;

/// Whether `b` can name an S3 bucket; otherwise why not.
pub fn check_bucket(b: &str) -> Result<(), &'static str> {
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

/// `prefix/key`, or `key` when the prefix is empty.
pub fn join_key(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}/{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

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
    fn hostile_file_urls_are_malformed_before_any_folder_is_looked_at() {
        let long_name = format!("file:///srv/{}/", "n".repeat(256));
        let long_path = format!("file:///srv{}", "/abc".repeat(300));
        for (url, why) in [
            ("file:///srv/a/../../etc/", "'..'"),
            ("file:///srv/..", "'..'"),
            ("file:///srv/%2e%2e/etc/", "percent-escapes"),
            ("file:///srv/%2E%2E/", "percent-escapes"),
            ("file:///srv/a\0b/", "control characters"),
            ("file:///srv/a\nb/", "control characters"),
            ("s3://bucket/a\0b/", "control characters"),
            ("file://srv/a/", "absolute path"),
            ("file://localhost/srv/a/", "absolute path"),
            (long_name.as_str(), "longer than 255 bytes"),
            (long_path.as_str(), "longer than 1024 bytes"),
        ] {
            let e = Destination::parse(url).unwrap_err().to_string();
            assert!(e.contains(why), "{url:?}: {e}");
        }
        // At the limits, and with trailing or doubled slashes, the folder is the same.
        let at_limit = format!("file:///srv/{}/", "n".repeat(255));
        assert!(Destination::parse(&at_limit).is_ok());
        for url in ["file:///srv/a", "file:///srv/a/", "file:///srv//a//", "file:///srv/./a"] {
            let Destination::File { dir } = Destination::parse(url).unwrap() else {
                panic!("{url}")
            };
            assert!(dir.components().eq(Path::new("/srv/a").components()), "{url}: {dir:?}");
        }
    }
}
