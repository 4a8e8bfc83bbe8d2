//! Test support for Tartan: a Kubernetes API emulator faithful to kube-apiserver on what Tartan
//! uses, served over plain HTTP so `kube::Client`, `kube::runtime::watcher`/`Controller` and
//! kubectl (current, and Debian's 1.20) run against it unchanged.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let emu = tartan_testkit::start(tartan_testkit::Options::default().crd_file("deploy/crd.yaml")).await?;
//! let client = emu.client(); // or emu.write_kubeconfig(path) for kubectl / another process
//! emu.add_deny_rule(tartan_testkit::DenyRule::new("mac-ci-deny-terminal-status").resource("tartan.dev", "macbuilds"));
//! # Ok(()) }
//! ```
//!
//! Served: CRDs from YAML (files at start, or POSTed / `kubectl apply`-ed at runtime), plus `v1`
//! namespaces (`default`, `kube-system`, `kube-public` exist), secrets, events,
//! `events.k8s.io/v1` events (one store with `v1` events), `coordination.k8s.io/v1` leases.
//!
//! Fault control over HTTP (also on `Options::control_addr`, which stays up while the API port
//! refuses connections): `GET|POST|DELETE /emulator/faults` with
//! `{"deny": [DenyRule...], "availability": "up|unavailable|refuse", "forMs": N, "latencyMs": N, "busyMs": N}`
//! (fields given replace those parts), `POST /emulator/compact` (drop watch history: older
//! resourceVersions get 410), `GET /emulator/requests` (every API request seen), `GET /emulator/answers`
//! (`{"dropped": N, "answers": [{at_ms, method, uri, user, code}...]}`: each answered request with
//! its status code).
//!
//! Knowingly not faithful: no authentication/authorization/RBAC; server-side apply merges maps
//! and replaces everything else without field ownership (no managedFields, no apply conflicts,
//! fields dropped from an apply are not removed); strategic merge patch on built-ins is a JSON
//! merge patch (no list merge keys); CEL `x-kubernetes-validations`, `anyOf`/`oneOf`/`allOf`/`not`,
//! list-type/map-type semantics and conversion webhooks are ignored; a `continue` token is a plain
//! offset (no snapshot); the watch window is global rather than per resource; deny rules and the
//! garbage collector's own writes bypass each other; no aggregated discovery (kubectl falls back).
//!
//! [`RealCluster`] is a real kube-apiserver for tests that check the emulator against it (and RBAC,
//! which the emulator does not do): a control plane started from `KUBEBUILDER_ASSETS`, or the
//! cluster of `KUBECONFIG` with `USE_EXISTING_CLUSTER=true`; without either such tests skip visibly.
//!
//! [`customrun_crd`] is the project's own CustomRun CRD, which the emulator, the demo and the tests load.
//!
//! Also shared by the other crates' tests ([`support`]): workspace binaries such as `tart-double`
//! built on demand ([`workspace_bin`]), and bounded polling ([`wait_for`]).

pub mod emulator;
pub mod real;
pub mod support;

pub use emulator::{
    Availability, DenyRule, EmulatorHandle, Faults, FaultsUpdate, HeldWrites, Options, Predicate, PredicateOp, Target,
    start,
};
pub use real::RealCluster;

/// The project's own `customruns.tekton.dev` CRD (`testkit/fixtures/customrun-crd.yaml`).
pub fn customrun_crd() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/customrun-crd.yaml")
}
pub use support::{server_socket_fds, tart_double, wait_for, workspace_bin, write_program};
