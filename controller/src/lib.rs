//! `tartan-controller`: turns Tekton CustomRuns naming `tartan.dev/v1alpha1 MacBuild` into
//! MacBuilds, and MacBuild status back into CustomRun status, with the CustomRun deadline,
//! grace, cancellation and `HostUnreachable` rules ([`decide`]).
//!
//! Pure logic ([`customrun`], [`duration`], [`params`], [`decide`]) is apart from I/O.

pub mod customrun;
pub mod decide;
pub mod duration;
pub mod leader;
pub mod metrics;
pub mod params;
pub mod reconcile;
pub mod run;
pub mod view;
pub mod wire;
