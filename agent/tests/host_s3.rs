//! Artifact upload to S3 through a real S3-compatible server: moto's server mode, started and
//! killed by this test (`pip install 'moto[server]'`). Without moto the test says SKIPPED and
//! passes; CI installs it. One test in this binary: it configures the S3 client through the
//! process environment (AWS_*), as the agent does.

mod host_common;

use host_common::*;
use object_store::ObjectStoreExt;
use object_store::path::Path as ObjectPath;
use std::time::Duration;
use tartan_agent::host::{artifacts::s3_store, cancel_pair, drive};
use tartan_agent::machine::Config;
use tartan_api::{Artifacts, AttemptState as S, Outcome, Reason};
use tartan_testkit::support::Moto;

#[test]
fn artifacts_go_to_s3_in_one_piece_or_multipart_and_a_missing_bucket_fails_after_retries() {
    let Some(moto) = Moto::start() else {
        eprintln!("SKIPPED: moto is not installed (pip install 'moto[server]'); the S3 upload was not tested");
        return;
    };
    // SAFETY: no other thread of this test binary reads or writes the environment: this is its
    // only test and the runtime is built afterwards.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "tartan-test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "tartan-test-secret");
        std::env::set_var("AWS_REGION", "us-east-1");
        std::env::set_var("AWS_ENDPOINT_URL", moto.endpoint());
    }
    assert!(moto.create_bucket("artifacts").contains(" 200"), "bucket not created");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let rig = Rig::new();
        let mut spec = spec(vec![step(
            "build",
            "mkdir -p out && printf ipa > out/App.ipa && head -c 12000000 /dev/zero | tr '\\0' x > out/big.bin",
        )]);
        spec.artifacts = Some(Artifacts {
            paths: vec!["out/App.ipa".into(), "out/big.bin".into()],
            destination: "s3://artifacts/app/".into(),
        });
        let (_cancel, signal) = cancel_pair();
        let (mut a, mut exec) = attempt(&rig, "s3", spec.clone(), signal);
        let vm = a.vm.clone();
        let mut journal = MemJournal::new();
        let end = tokio::time::timeout(
            Duration::from_secs(120),
            drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(end, S::Retired);
        let retiring = journal.records.lock().unwrap()[4].clone();
        assert_eq!(retiring.outcome, Some(Outcome::Succeeded), "{:#?}", journal.lines());
        assert_eq!(
            exec.results().artifact_url.as_deref(),
            Some(format!("s3://artifacts/app/{vm}/").as_str())
        );
        let store = s3_store("artifacts", &Default::default()).unwrap();
        let get = |key: String| {
            let store = store.clone();
            async move {
                store
                    .get(&ObjectPath::parse(&key).unwrap())
                    .await
                    .unwrap()
                    .bytes()
                    .await
                    .unwrap()
            }
        };
        assert_eq!(&get(format!("app/{vm}/out/App.ipa")).await[..], b"ipa");
        let big = get(format!("app/{vm}/out/big.bin")).await;
        assert_eq!(big.len(), 12_000_000, "the multipart upload is whole");
        assert!(big.iter().all(|b| *b == b'x'));
        assert!(rig.vms().is_empty());

        // A bucket that does not exist: every attempt fails, the build fails with the reason.
        spec.artifacts.as_mut().unwrap().destination = "s3://no-such-bucket/x/".into();
        let (_cancel, signal) = cancel_pair();
        let (mut a, mut exec) = attempt(&rig, "s3-missing", spec, signal);
        let mut journal = MemJournal::new();
        tokio::time::timeout(
            Duration::from_secs(120),
            drive(&mut exec, &mut a, admit(600), &Config::default(), &mut journal),
        )
        .await
        .unwrap()
        .unwrap();
        let retiring = journal.records.lock().unwrap()[4].clone();
        assert_eq!(
            (retiring.reason, retiring.outcome),
            (Some(Reason::ArtifactUploadFailed), Some(Outcome::Failed))
        );
        assert!(
            retiring.detail.contains("to s3://no-such-bucket/x/")
                && retiring.detail.contains("failed after 3 attempt(s)"),
            "{retiring}"
        );
        assert!(rig.vms().is_empty());
    });
}
