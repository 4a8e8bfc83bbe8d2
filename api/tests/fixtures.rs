//! Every MacBuild of `tests/fixtures/` (shapes earlier releases wrote; see its README) reads into
//! today's types and writes back without losing a field. The same fixtures are created on a real
//! kube-apiserver against today's CRD by `controller/tests/deploy_real.rs`.

use serde_json::Value;
use tartan_api::MacBuild;

/// Where `now` lacks or changes something of `old` (defaults `now` adds are fine).
fn lost(old: &Value, now: &Value, path: &str, out: &mut Vec<String>) {
    match (old, now) {
        (Value::Object(o), Value::Object(n)) => {
            for (k, v) in o {
                match n.get(k) {
                    Some(nv) => lost(v, nv, &format!("{path}.{k}"), out),
                    None => out.push(format!("{path}.{k} was dropped")),
                }
            }
        }
        (Value::Array(o), Value::Array(n)) if o.len() == n.len() => {
            for (i, (a, b)) in o.iter().zip(n).enumerate() {
                lost(a, b, &format!("{path}[{i}]"), out);
            }
        }
        _ if old == now => {}
        _ => out.push(format!("{path}: was {old}, is {now}")),
    }
}

#[test]
fn every_fixture_reads_into_today_s_types_and_back_without_loss() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut checked = 0;
    let mut problems = vec![];
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let old: Value = serde_saphyr::from_str(&text).unwrap();
        match serde_saphyr::from_str::<MacBuild>(&text) {
            Ok(mb) => lost(
                &old,
                &serde_json::to_value(&mb).unwrap(),
                &path.display().to_string(),
                &mut problems,
            ),
            Err(e) => problems.push(format!("{}: does not read as a MacBuild: {e}", path.display())),
        }
        checked += 1;
    }
    assert!(checked >= 5, "expected the fixtures in {}", dir.display());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
