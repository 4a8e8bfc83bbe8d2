//! The agent's Kubernetes side: its Lease ([`lease`]), claiming MacBuilds and the finalizer
//! ([`claim`]) and when to ([`placement`]), which MacBuilds it reads ([`view`]), status delivery
//! ([`delivery`]) and Events ([`events`]).
//!
//! (The module is called `cluster`, not `kube`, so that `kube::…` paths keep meaning the kube
//! crate everywhere in this crate.)
//!
//! Every API request here runs under a timeout ([`timed`]) shorter than whatever waits for it: the
//! Lease loop's period, a delivery try's backoff, the runtime's claim step.

pub mod claim;
pub mod delivery;
pub mod events;
pub mod lease;
pub mod placement;
pub mod view;

use crate::config::Config;
use anyhow::Context as _;
use kube::api::PatchParams;
use std::future::Future;
use std::time::Duration;
use tartan_api::AGENT_FIELD_MANAGER;

/// A kube client as the config says: the kubeconfig file and context if given, else the
/// standard inference (`$KUBECONFIG`, `~/.kube/config`, in-cluster).
/// The client, and the API server's URL (for log lines that must name it).
pub async fn client(config: &Config) -> anyhow::Result<(kube::Client, String)> {
    let options = kube::config::KubeConfigOptions {
        context: config.context.clone(),
        ..Default::default()
    };
    let kube_config = match &config.kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &options)
                .await
                .with_context(|| format!("loading kubeconfig {} (context {:?})", path.display(), config.context))?
        }
        None if config.context.is_some() => kube::Config::from_kubeconfig(&options)
            .await
            .with_context(|| format!("loading the default kubeconfig with context {:?}", config.context))?,
        None => kube::Config::infer()
            .await
            .context("finding a kubeconfig ($KUBECONFIG, ~/.kube/config) or in-cluster config")?,
    };
    let server = kube_config.cluster_url.to_string();
    let client = kube::Client::try_from(kube_config).context("building the Kubernetes client")?;
    Ok((client, server))
}

/// Why one API request failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No answer within the limit; the request may or may not have been applied.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The API answered with an error Status, or the request could not be sent.
    #[error("{0}")]
    Kube(#[from] kube::Error),
}

impl CallError {
    /// The HTTP code of an error Status from the API, if there was one.
    pub fn code(&self) -> Option<u16> {
        match self {
            CallError::Kube(kube::Error::Api(status)) => Some(status.code),
            _ => None,
        }
    }

    pub fn is_not_found(&self) -> bool {
        self.code() == Some(404)
    }

    /// 409 Conflict (stale resourceVersion) or 422 (a failed JSON patch `test`, or an admission
    /// policy's `Invalid`): the write's precondition did not hold, or it was refused; only a
    /// fresh read tells which.
    pub fn is_precondition(&self) -> bool {
        matches!(self.code(), Some(409 | 422))
    }
}

/// Runs one API request with a time limit.
pub async fn timed<T>(limit: Duration, request: impl Future<Output = kube::Result<T>>) -> Result<T, CallError> {
    match tokio::time::timeout(limit, request).await {
        Ok(result) => result.map_err(CallError::Kube),
        Err(_) => Err(CallError::Timeout(limit)),
    }
}

/// Patch parameters of every agent write (field manager `tartan-agent`).
pub fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(AGENT_FIELD_MANAGER.to_string()),
        ..Default::default()
    }
}

/// A JSON pointer from `/`-separated parts, escaping `~` and `/` inside each part.
pub(crate) fn pointer(parts: &[&str]) -> json_patch::jsonptr::PointerBuf {
    json_patch::jsonptr::PointerBuf::from_tokens(parts.iter().copied())
}

/// `test` op: the document holds `value` at `parts` (else the API answers 422).
pub(crate) fn op_test(parts: &[&str], value: serde_json::Value) -> json_patch::PatchOperation {
    json_patch::PatchOperation::Test(json_patch::TestOperation {
        path: pointer(parts),
        value,
    })
}

/// `add` op: sets `parts` (replacing an existing member; appending for a trailing `-`).
pub(crate) fn op_add(parts: &[&str], value: serde_json::Value) -> json_patch::PatchOperation {
    json_patch::PatchOperation::Add(json_patch::AddOperation {
        path: pointer(parts),
        value,
    })
}

/// `replace` op: `parts` must exist.
pub(crate) fn op_replace(parts: &[&str], value: serde_json::Value) -> json_patch::PatchOperation {
    json_patch::PatchOperation::Replace(json_patch::ReplaceOperation {
        path: pointer(parts),
        value,
    })
}

/// `remove` op: `parts` must exist.
pub(crate) fn op_remove(parts: &[&str]) -> json_patch::PatchOperation {
    json_patch::PatchOperation::Remove(json_patch::RemoveOperation { path: pointer(parts) })
}
