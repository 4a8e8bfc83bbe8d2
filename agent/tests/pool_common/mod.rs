//! Test support for the warm-pool adversary rounds: a host's `Builds` over a real journal, warm
//! records as the pool writes them, and a peer's Lease carrying annotations.

#![allow(dead_code)] // each test binary uses a different part of this module

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use tartan_agent::journal::{Journal, JournalOptions};
use tartan_agent::lock::StateLock;
use tartan_agent::pool::WarmProfile;
use tartan_agent::record::Record;
use tartan_agent::runtime::core::{Builds, warm_record};
use tartan_api::AttemptState;

/// One host's build state over a journal in a temporary state directory.
pub struct Host {
    pub builds: Builds,
    pub dir: tempfile::TempDir,
    _lock: StateLock,
}

impl Host {
    pub fn new() -> Host {
        Host::with_options(JournalOptions::default())
    }

    /// `max_file_bytes = 1`: every append starts a new journal file, so a file placed at the name
    /// of the next-but-one id makes exactly the second append from now fail.
    pub fn rotating() -> Host {
        Host::with_options(JournalOptions { max_file_bytes: 1 })
    }

    pub fn with_options(options: JournalOptions) -> Host {
        let dir = tempfile::tempdir().unwrap();
        let lock = StateLock::acquire(dir.path()).unwrap();
        let (journal, _) = Journal::open(&lock, options).unwrap();
        Host {
            builds: Builds::new(journal),
            dir,
            _lock: lock,
        }
    }

    /// Takes in `records` as agent start does (replay, then the build state's load).
    pub async fn load(&self, records: &[Record]) {
        let replayed = tartan_agent::recovery::replay(records, &tartan_agent::machine::Config::default());
        self.builds.load_replay(&replayed, records).await;
    }
}

/// A warm VM's record of `image` as the pool journals it (`warm_record`), at `seq` in `slot`.
pub fn warm(vm: &str, image: &str, seq: u64, from: Option<AttemptState>, to: AttemptState, slot: Option<u8>) -> Record {
    Record {
        seq,
        slot,
        ..warm_record(vm, &WarmProfile::new(image, None, None), from, to)
    }
}

/// A live agent's Lease (renewed now, 20 s) with `annotations`.
pub fn lease(agent: &str, annotations: &[(&str, String)]) -> Lease {
    Lease {
        metadata: kube::api::ObjectMeta {
            annotations: Some(annotations.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(agent.into()),
            renew_time: Some(MicroTime(Timestamp::now())),
            lease_duration_seconds: Some(20),
            ..Default::default()
        }),
    }
}
