//! Test support for Tartan: a Kubernetes API emulator faithful to kube-apiserver on what Tartan
//! uses (see [`emulator`]).

pub mod emulator;

pub use emulator::{
    Availability, DenyRule, EmulatorHandle, Faults, FaultsUpdate, Options, Predicate, PredicateOp, Target, start,
};
