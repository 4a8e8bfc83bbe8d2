//! Tartan's shared vocabulary: the MacBuild CRD types, condition/reason/outcome names, the
//! deadline-file format and the label/finalizer/annotation keys.
//!
//! Derive only: this crate has no Kubernetes client and no async runtime, so the agent, the
//! watchdog and the controller can all depend on it.

pub mod condition;
pub mod crd;
pub mod deadline;
pub mod destination;
pub mod duration;
pub mod env;
pub mod files;
pub mod lease_clock;
pub mod logs;
pub mod names;
pub mod text;
pub mod vocab;

pub use condition::{Condition, ConditionReason, ConditionStatus, find_condition, set_condition};
pub use crd::{
    Artifacts, AttemptRecord, BuildResults, Claim, DEFAULT_MAX_ATTEMPTS, DEFAULT_TIMEOUT_SECONDS, MAX_ATTEMPTS_LIMIT,
    MAX_STEPS, MacBuild, MacBuildSpec, MacBuildStatus, Phase, Resources, Source, Step,
};
pub use crd::{EnvVar, EnvVarSource, SecretKeySelector};
pub use names::{
    AGENT_FIELD_MANAGER, AGENT_LABEL, CONTROLLER_FIELD_MANAGER, CUSTOM_RUN_LABEL, FINISHED_LABEL, UNFINISHED_SELECTOR,
    VM_NAME_MAX_LEN, WARM_VM_PREFIX, attempt_id, check_label_key, check_label_value, check_vm_name, is_warm_vm,
    parse_attempt_id, vm_name,
};
pub use vocab::{
    API_VERSION, AttemptState, ConditionType, FINALIZER, GROUP, KIND, Outcome, Reason, UnknownName, VERSION, VM_PREFIX,
};
