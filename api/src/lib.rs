//! Tartan's shared vocabulary: the MacBuild CRD types, condition/reason/outcome names, the
//! deadline-file format and the label/finalizer/annotation keys.

pub mod vocab;

pub use vocab::{
    API_VERSION, AttemptState, ConditionType, FINALIZER, GROUP, KIND, Outcome, Reason, UnknownName, VERSION, VM_PREFIX,
};
