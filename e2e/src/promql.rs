//! The metric names a PromQL expression reads, and the names a `/metrics` page serves: enough to
//! check that no alert or dashboard panel in deploy/monitoring names a metric nobody exports.
//! (Tests: e2e/tests/scenarios/harness/monitoring.rs, run in CI as scenario `harness`.)

use std::collections::BTreeSet;

/// Words of PromQL that are not metric names when they are not followed by `(`.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
];

/// Aggregation operators: not names when followed by `(` or by `by`/`without` (`sum by (x) (...)`).
const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// Keywords followed by a parenthesised list of label names (not expressions).
const LABEL_LISTS: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];

/// The metric names `expr` selects: identifiers not followed by `(` (functions, aggregations),
/// outside label matchers `{...}`, ranges and subqueries `[...]`, strings and label lists
/// (`by (...)`, `on (...)`, ...), and not keywords. Fails on an unterminated string or bracket.
pub fn metric_names(expr: &str) -> Result<BTreeSet<String>, String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let skip_to = |from: usize, close: char| -> Result<usize, String> {
        let mut j = from;
        while j < chars.len() {
            match chars[j] {
                c if c == close => return Ok(j + 1),
                '"' | '\'' | '`' => j = skip_string(&chars, j)?,
                _ => j += 1,
            }
        }
        Err(format!("no closing {close:?} after position {from} in {expr:?}"))
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i)?;
        } else if c == '{' {
            i = skip_to(i + 1, '}')?;
        } else if c == '[' {
            i = skip_to(i + 1, ']')?;
        } else if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c.is_ascii_digit() || c == '.' {
            // A number or a duration (`5m`, `1e3`, `0x1f`): never a name.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.' || chars[i] == '_') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let paren = chars.get(next) == Some(&'(');
            let lower = word.to_ascii_lowercase();
            let then: String = chars[next..]
                .iter()
                .take_while(|c| c.is_ascii_alphanumeric() || **c == '_')
                .collect::<String>()
                .to_ascii_lowercase();
            let grouped = AGGREGATIONS.contains(&lower.as_str()) && (then == "by" || then == "without");
            if LABEL_LISTS.contains(&lower.as_str()) {
                if paren {
                    i = skip_to(next + 1, ')')?;
                }
            } else if paren || grouped || KEYWORDS.contains(&lower.as_str()) {
                // A function or aggregation (its arguments are read on), or a keyword.
            } else {
                names.insert(word);
            }
        } else if c == '$' {
            // A Grafana variable outside a matcher (`$__interval`): not a name.
            i += 1;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    Ok(names)
}

/// The index just after the string literal starting at `start`.
fn skip_string(chars: &[char], start: usize) -> Result<usize, String> {
    let quote = chars[start];
    let mut j = start + 1;
    while j < chars.len() {
        match chars[j] {
            '\\' if quote != '`' => j += 2,
            c if c == quote => return Ok(j + 1),
            _ => j += 1,
        }
    }
    Err(format!("unterminated string from position {start}"))
}

/// Every sample name a text exposition (Prometheus or OpenMetrics) serves, families with no
/// sample yet included: a `# TYPE` line says which names its samples take (a counter `x` serves
/// `x_total`, a histogram `x` serves `x_bucket`, `x_sum`, `x_count`, a summary `x`, `x_sum`,
/// `x_count`), so a Family nobody has touched still counts as served.
pub fn exposed_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" if name.ends_with("_total") => &[""],
                "counter" => &["_total"],
                "histogram" | "gaugehistogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["", "_sum", "_count"],
                "info" => &["_info"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}
