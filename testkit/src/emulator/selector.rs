//! Label selectors (`=`, `==`, `!=`, `in`, `notin`, exists, `!key`) and field selectors.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LabelSelector(Vec<Req>);

/// Splits on commas that are not inside parentheses.
fn split_top(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => {
                depth += 1;
                cur.push(c);
            }
            ')' => {
                depth -= 1;
                cur.push(c);
            }
            ',' if depth == 0 => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out.into_iter()
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

fn set_values(rest: &str, whole: &str) -> Result<Vec<String>, String> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("unable to parse requirement: found '{rest}', expected: '(' in {whole:?}"))?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for part in split_top(s) {
            if let Some(k) = part.strip_prefix('!') {
                reqs.push(Req::NotExists(k.trim().to_string()));
            } else if let Some((k, v)) = part.split_once("!=") {
                reqs.push(Req::Ne(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = part.split_once("==") {
                reqs.push(Req::Eq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = part.split_once('=') {
                reqs.push(Req::Eq(k.trim().into(), v.trim().into()));
            } else if let Some((k, rest)) = part.split_once(" notin ") {
                reqs.push(Req::NotIn(k.trim().into(), set_values(rest, s)?));
            } else if let Some((k, rest)) = part.split_once(" in ") {
                reqs.push(Req::In(k.trim().into(), set_values(rest, s)?));
            } else if part.chars().all(|c| c.is_alphanumeric() || "-_./".contains(c)) {
                reqs.push(Req::Exists(part));
            } else {
                return Err(format!("unable to parse requirement: {part:?}"));
            }
        }
        Ok(LabelSelector(reqs))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Req::Eq(k, v) => get(k) == Some(v.as_str()),
            Req::Ne(k, v) => get(k) != Some(v.as_str()),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Req::NotIn(k, vs) => get(k).is_none_or(|x| !vs.iter().any(|v| v == x)),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
        })
    }
}

/// A parsed field selector: `field=value`, `field==value`, `field!=value`, comma-separated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for part in split_top(s) {
            if let Some((k, v)) = part.split_once("!=") {
                reqs.push((k.trim().to_string(), false, v.trim().to_string()));
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                reqs.push((k.trim().to_string(), true, v.trim().to_string()));
            } else {
                return Err(format!("invalid selector: '{s}'; can't understand '{part}'"));
            }
        }
        Ok(FieldSelector(reqs))
    }

    pub fn fields(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _, _)| k.as_str())
    }

    /// The value a `metadata.name=x` requirement pins, if any.
    pub fn exact(&self, field: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, eq, _)| k == field && *eq)
            .map(|(_, _, v)| v.as_str())
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(k, eq, v)| {
            let actual = field_value(obj, k);
            (actual == *v) == *eq
        })
    }
}

/// The string form of a dotted field path on an object ("" when absent), as field selectors see it.
pub fn field_value(obj: &Value, path: &str) -> String {
    let mut cur = obj;
    for seg in path.split('.') {
        match cur.get(seg) {
            Some(v) => cur = v,
            None => return String::new(),
        }
    }
    match cur {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_selectors() {
        let o = json!({"metadata": {"labels": {"app": "mac", "tier": "ci"}}});
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(m("app=mac"));
        assert!(m("app==mac,tier"));
        assert!(!m("app!=mac"));
        assert!(m("app in (mac, linux),tier notin (prod)"));
        assert!(!m("app notin (mac)"));
        assert!(m("!missing"));
        assert!(!m("missing"));
        assert!(m(""));
    }

    #[test]
    fn field_selectors() {
        let o = json!({"metadata": {"name": "a", "namespace": "ci"}, "involvedObject": {"kind": "MacBuild"}});
        let f = FieldSelector::parse("metadata.name=a,involvedObject.kind==MacBuild,metadata.namespace!=x").unwrap();
        assert!(f.matches(&o));
        assert!(!FieldSelector::parse("metadata.name=b").unwrap().matches(&o));
        assert_eq!(f.exact("metadata.name"), Some("a"));
    }
}
