//! Emulator benchmark: status PATCHes per second with no watchers, on the emulator and on the real
//! kube-apiserver of `KUBEBUILDER_ASSETS` (or `USE_EXISTING_CLUSTER=true`), with 0, 1,000 and 10,000 other objects stored. A write's
//! cost must not grow with what is stored. Run it with `scripts/bench-emulator`:
//!
//! ```text
//! scripts/bench-emulator [--patches 1000] [--stored 0,1000,10000] [--backend both|emulator|real]
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use serde_json::json;
use tartan_testkit::RealCluster;

const NS: &str = "bench";

struct Args {
    patches: usize,
    stored: Vec<usize>,
    emulator: bool,
    real: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        patches: 1000,
        stored: vec![0, 1000, 10_000],
        emulator: true,
        real: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--patches" => a.patches = value()?.parse().context("--patches: a number")?,
            "--stored" => {
                a.stored = value()?
                    .split(',')
                    .map(|s| s.trim().replace('_', "").parse())
                    .collect::<Result<_, _>>()
                    .context("--stored: numbers separated by commas")?
            }
            "--backend" => match value()?.as_str() {
                "both" => (a.emulator, a.real) = (true, true),
                "emulator" => (a.emulator, a.real) = (true, false),
                "real" => (a.emulator, a.real) = (false, true),
                other => bail!("--backend {other}: expected both, emulator or real"),
            },
            other => bail!("unknown argument {other}; see the header of testkit/examples/bench-emulator.rs"),
        }
    }
    Ok(a)
}

fn crd_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crd.yaml")
}

fn macbuilds(client: &kube::Client) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("tartan.dev", "v1alpha1", "MacBuild"),
        "macbuilds",
    );
    Api::namespaced_with(client.clone(), NS, &ar)
}

fn macbuild(name: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "tartan.dev/v1alpha1",
        "kind": "MacBuild",
        "metadata": {"name": name},
        "spec": {"image": "ghcr.io/cirruslabs/macos-sequoia-xcode:latest", "steps": [{"name": "build", "run": ["true"]}]},
    }))
    .expect("valid MacBuild")
}

/// Brings the number of stored `fill-*` MacBuilds up to `n` (16 creations in flight).
async fn fill_to(api: &Api<DynamicObject>, from: usize, n: usize) -> anyhow::Result<()> {
    futures::stream::iter(from..n)
        .map(|i| async move {
            api.create(&PostParams::default(), &macbuild(&format!("fill-{i}")))
                .await
                .with_context(|| format!("creating fill-{i}"))
        })
        .buffer_unordered(16)
        .try_for_each(|_| async { Ok(()) })
        .await
}

/// `patches` status PATCHes of one MacBuild, one after another (each changes the status); per second.
async fn patch_rate(api: &Api<DynamicObject>, round: usize, patches: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    for i in 0..patches {
        let seq = round * patches + i;
        let body = json!({"status": {"phase": "Running", "journalSeq": seq, "message": format!("step {seq}")}});
        api.patch_status("target", &PatchParams::default(), &Patch::Merge(body))
            .await
            .with_context(|| format!("status PATCH {i} of macbuilds/target"))?;
    }
    Ok(patches as f64 / start.elapsed().as_secs_f64())
}

/// Rates for each stored count, in the order given.
async fn run(client: &kube::Client, args: &Args) -> anyhow::Result<Vec<f64>> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}}))?,
        )
        .await
        .context("creating namespace bench")?;
    let api = macbuilds(client);
    api.create(&PostParams::default(), &macbuild("target"))
        .await
        .context("creating macbuilds/target")?;
    let mut stored = 0;
    let mut rates = Vec::new();
    let mut order = args.stored.clone();
    order.sort_unstable();
    for (round, &n) in order.iter().enumerate() {
        if n > stored {
            let t = Instant::now();
            fill_to(&api, stored, n).await?;
            eprintln!("  stored {n} MacBuilds in {:.1} s", t.elapsed().as_secs_f64());
            stored = n;
        }
        let rate = patch_rate(&api, round, args.patches).await?;
        eprintln!("  {n} stored: {rate:.0} status PATCHes/s");
        rates.push(rate);
    }
    // Back to the order asked for.
    Ok(args
        .stored
        .iter()
        .map(|n| rates[order.iter().position(|m| m == n).expect("sorted copy")])
        .collect())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let mut emu_rates = None;
    let mut real_rates = None;
    if args.emulator {
        eprintln!("emulator (release, in process)");
        let emu = tartan_testkit::start(tartan_testkit::Options::default().crd_file(crd_path())).await?;
        emu_rates = Some(run(&emu.client(), &args).await?);
    }
    if args.real {
        eprintln!("real kube-apiserver (KUBEBUILDER_ASSETS or an existing cluster)");
        match RealCluster::start("bench-emulator --real").context("starting the real cluster")? {
            None => {}
            Some(cluster) => {
                cluster.kubectl(
                    &["apply", "-f", crd_path().to_str().context("CRD path is UTF-8")?],
                    None,
                )?;
                cluster.kubectl(
                    &[
                        "wait",
                        "--for=condition=Established",
                        "--timeout=60s",
                        "crd/macbuilds.tartan.dev",
                    ],
                    None,
                )?;
                real_rates = Some(run(&cluster.admin_client().await?, &args).await?);
            }
        }
    }
    let cell = |r: &Option<Vec<f64>>, i: usize| r.as_ref().map_or("-".to_string(), |v| format!("{:.0}/s", v[i]));
    println!(
        "{} status PATCHes of one MacBuild, one at a time, no watchers",
        args.patches
    );
    println!("{:>16} {:>12} {:>16}", "stored objects", "emulator", "kube-apiserver");
    for (i, n) in args.stored.iter().enumerate() {
        println!("{:>16} {:>12} {:>16}", n, cell(&emu_rates, i), cell(&real_rates, i));
    }
    Ok(())
}
