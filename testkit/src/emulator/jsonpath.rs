//! The JSONPath subset CRD `additionalPrinterColumns` use: `.a.b`, `[n]`, `[*]`, `['key']`,
//! and filters `[?(@.x=="v")]` / `[?(@.x!="v")]`.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
enum Step {
    Field(String),
    Index(i64),
    All,
    Filter { path: Vec<String>, eq: bool, value: String },
}

fn parse(expr: &str) -> Result<Vec<Step>, String> {
    let e = expr.trim();
    let e = e.strip_prefix('{').and_then(|x| x.strip_suffix('}')).unwrap_or(e);
    let e = e.strip_prefix('$').unwrap_or(e);
    let chars: Vec<char> = e.chars().collect();
    let mut i = 0;
    let mut steps = Vec::new();
    while i < chars.len() {
        match chars[i] {
            '.' => {
                i += 1;
                let start = i;
                while i < chars.len() && chars[i] != '.' && chars[i] != '[' {
                    i += 1;
                }
                let name: String = chars[start..i].iter().collect();
                if !name.is_empty() {
                    steps.push(Step::Field(name));
                }
            }
            '[' => {
                let mut depth = 0;
                let start = i + 1;
                while i < chars.len() {
                    match chars[i] {
                        '[' => depth += 1,
                        ']' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    i += 1;
                }
                if i >= chars.len() {
                    return Err(format!("unterminated [ in {expr:?}"));
                }
                let inner: String = chars[start..i].iter().collect();
                i += 1;
                let inner = inner.trim();
                if inner == "*" {
                    steps.push(Step::All);
                } else if let Some(f) = inner.strip_prefix("?(").and_then(|f| f.strip_suffix(')')) {
                    let (lhs, eq, rhs) = if let Some((l, r)) = f.split_once("!=") {
                        (l, false, r)
                    } else if let Some((l, r)) = f.split_once("==") {
                        (l, true, r)
                    } else {
                        return Err(format!("unsupported filter {f:?}"));
                    };
                    let path = lhs
                        .trim()
                        .strip_prefix("@.")
                        .ok_or_else(|| format!("unsupported filter {f:?}"))?
                        .split('.')
                        .map(str::to_string)
                        .collect();
                    let value = rhs.trim().trim_matches(|c| c == '"' || c == '\'').to_string();
                    steps.push(Step::Filter { path, eq, value });
                } else if let Ok(n) = inner.parse::<i64>() {
                    steps.push(Step::Index(n));
                } else {
                    steps.push(Step::Field(inner.trim_matches(|c| c == '"' || c == '\'').to_string()));
                }
            }
            c => return Err(format!("unexpected {c:?} in {expr:?}")),
        }
    }
    Ok(steps)
}

/// Evaluates `expr` on `obj`, returning every match in order.
pub fn eval(expr: &str, obj: &Value) -> Result<Vec<Value>, String> {
    let steps = parse(expr)?;
    let mut cur = vec![obj.clone()];
    for step in &steps {
        let mut next = Vec::new();
        for v in &cur {
            match step {
                Step::Field(f) => next.extend(v.get(f).cloned()),
                Step::Index(n) => {
                    if let Some(a) = v.as_array() {
                        let idx = if *n < 0 { a.len() as i64 + n } else { *n };
                        next.extend(usize::try_from(idx).ok().and_then(|i| a.get(i)).cloned());
                    }
                }
                Step::All => match v {
                    Value::Array(a) => next.extend(a.iter().cloned()),
                    Value::Object(m) => next.extend(m.values().cloned()),
                    _ => {}
                },
                Step::Filter { path, eq, value } => {
                    if let Some(a) = v.as_array() {
                        for item in a {
                            let mut x = Some(item);
                            for p in path {
                                x = x.and_then(|x| x.get(p));
                            }
                            let s = match x {
                                Some(Value::String(s)) => Some(s.clone()),
                                Some(Value::Null) | None => None,
                                Some(other) => Some(other.to_string()),
                            };
                            if s.is_some() && (s.as_deref() == Some(value.as_str())) == *eq {
                                next.push(item.clone());
                            }
                        }
                    }
                }
            }
        }
        cur = next;
    }
    Ok(cur)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn printer_column_paths() {
        let o = json!({"status": {"conditions": [
            {"type": "Ready", "status": "False"},
            {"type": "Succeeded", "status": "True", "reason": "TestsPassed"}
        ], "claim": {"holder": "mac-1"}}, "spec": {"steps": [{"name": "a"}, {"name": "b"}]}});
        assert_eq!(
            eval(".status.conditions[?(@.type==\"Succeeded\")].status", &o).unwrap(),
            vec![json!("True")]
        );
        assert_eq!(eval(".status.claim.holder", &o).unwrap(), vec![json!("mac-1")]);
        assert_eq!(eval(".spec.steps[*].name", &o).unwrap(), vec![json!("a"), json!("b")]);
        assert_eq!(eval(".spec.steps[1].name", &o).unwrap(), vec![json!("b")]);
        assert!(eval(".status.missing", &o).unwrap().is_empty());
    }
}
