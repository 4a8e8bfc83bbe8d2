//! JUnit XML test reports: counted into passed / failed / skipped / total.
//!
//! Accepted shapes (the common dialects of Ant, Maven Surefire, xcbeautify, xcpretty, pytest):
//! a `<testsuites>` root holding `<testsuite>`s (which may nest), or a bare `<testsuite>` root.
//! Each `<testcase>` counts once: failed when it has a `<failure>` or `<error>` child, skipped
//! when it has a `<skipped>` child, passed otherwise. A report without any `<testcase>` is
//! counted from the `tests`/`failures`/`errors`/`skipped` attributes of its top-level suites
//! (some tools write only those). DTDs are refused by the parser, so entities cannot expand.

use roxmltree::{Document, Node};

/// What a test report says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TestCounts {
    /// Every test case in the report.
    pub total: u32,
    /// Cases with a `<failure>`.
    pub failures: u32,
    /// Cases with an `<error>` (and no `<failure>`).
    pub errors: u32,
    /// Cases with `<skipped>` and neither failure nor error.
    pub skipped: u32,
}

impl TestCounts {
    /// Failures plus errors: what fails the build.
    pub fn failed(&self) -> u32 {
        self.failures + self.errors
    }

    /// Cases that ran and passed.
    pub fn passed(&self) -> u32 {
        self.total.saturating_sub(self.failed() + self.skipped)
    }
}

/// Why a report could not be counted. The message names the report (`what`, e.g. its guest path).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("test report {what} is not UTF-8 text: {detail}")]
    NotText { what: String, detail: String },
    #[error("test report {what} is not well-formed XML: {detail}")]
    Malformed { what: String, detail: String },
    #[error("test report {what} has root element <{root}>, expected <testsuites> or <testsuite>")]
    WrongRoot { what: String, root: String },
    #[error("test report {what}: attribute {attribute}={value:?} of <{element}> is not a whole number")]
    BadCount {
        what: String,
        element: String,
        attribute: String,
        value: String,
    },
}

/// Counts the test cases of the JUnit XML report `bytes`; `what` names it in errors.
pub fn parse_report(what: &str, bytes: &[u8]) -> Result<TestCounts, ReportError> {
    let text = std::str::from_utf8(bytes).map_err(|e| ReportError::NotText {
        what: what.to_string(),
        detail: e.to_string(),
    })?;
    let doc = Document::parse(text).map_err(|e| ReportError::Malformed {
        what: what.to_string(),
        detail: e.to_string(),
    })?;
    let root = doc.root_element();
    let name = root.tag_name().name();
    if name != "testsuites" && name != "testsuite" {
        return Err(ReportError::WrongRoot {
            what: what.to_string(),
            root: name.to_string(),
        });
    }
    let mut counts = TestCounts::default();
    let mut cases = 0u32;
    for case in root.descendants().filter(|n| n.has_tag_name("testcase")) {
        cases += 1;
        let has = |tag: &str| case.children().any(|c| c.has_tag_name(tag));
        if has("failure") {
            counts.failures += 1;
        } else if has("error") {
            counts.errors += 1;
        } else if has("skipped") {
            counts.skipped += 1;
        }
    }
    if cases > 0 {
        counts.total = cases;
        return Ok(counts);
    }
    // Summary-only report: the outermost suites' attributes (never both a <testsuites> and its
    // children, which would count twice).
    let suites: Vec<Node> = if name == "testsuite" || root.attribute("tests").is_some() {
        vec![root]
    } else {
        root.children().filter(|n| n.has_tag_name("testsuite")).collect()
    };
    for suite in suites {
        counts.total += count_attr(what, suite, "tests")?;
        counts.failures += count_attr(what, suite, "failures")?;
        counts.errors += count_attr(what, suite, "errors")?;
        counts.skipped += count_attr(what, suite, "skipped")?.max(count_attr(what, suite, "disabled")?);
    }
    Ok(counts)
}

fn count_attr(what: &str, node: Node, attribute: &str) -> Result<u32, ReportError> {
    match node.attribute(attribute) {
        None => Ok(0),
        Some(v) => v.trim().parse().map_err(|_| ReportError::BadCount {
            what: what.to_string(),
            element: node.tag_name().name().to_string(),
            attribute: attribute.to_string(),
            value: v.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(xml: &str) -> Result<TestCounts, ReportError> {
        parse_report("out/junit.xml", xml.as_bytes())
    }

    #[test]
    fn testsuites_root_counts_cases_across_nested_suites() {
        let c = parse(
            r#"<?xml version="1.0" encoding="UTF-8"?>
            <testsuites tests="99" failures="99">
              <testsuite name="AppTests" tests="3">
                <testcase name="a" classname="AppTests"/>
                <testcase name="b"><failure message="boom">trace</failure><system-out>x</system-out></testcase>
                <testcase name="c"><skipped/></testcase>
                <testsuite name="Nested">
                  <testcase name="d"><error type="Crash"/></testcase>
                  <testcase name="e"></testcase>
                </testsuite>
              </testsuite>
              <testsuite name="Empty"/>
            </testsuites>"#,
        )
        .unwrap();
        assert_eq!(
            c,
            TestCounts {
                total: 5,
                failures: 1,
                errors: 1,
                skipped: 1
            }
        );
        assert_eq!((c.passed(), c.failed()), (2, 2));
    }

    #[test]
    fn testsuite_root_and_namespaces() {
        let c = parse(r#"<testsuite xmlns="urn:x"><testcase name="a"/><testcase name="b"/></testsuite>"#).unwrap();
        assert_eq!((c.total, c.passed(), c.failed()), (2, 2, 0));
        // A case with both failure and error counts once, as a failure.
        let c = parse(r#"<testsuite><testcase name="a"><failure/><error/></testcase></testsuite>"#).unwrap();
        assert_eq!((c.total, c.failures, c.errors, c.passed()), (1, 1, 0, 0));
    }

    #[test]
    fn summary_only_reports_use_the_outermost_attributes() {
        let c =
            parse(r#"<testsuites tests="7" failures="1" errors="1" skipped="2"><testsuite tests="7"/></testsuites>"#)
                .unwrap();
        assert_eq!((c.total, c.failed(), c.skipped, c.passed()), (7, 2, 2, 3));
        let c = parse(r#"<testsuites><testsuite tests="2"/><testsuite tests="3" failures="1"/></testsuites>"#).unwrap();
        assert_eq!((c.total, c.failed(), c.passed()), (5, 1, 4));
        let c = parse(r#"<testsuite tests="4" disabled="1"/>"#).unwrap();
        assert_eq!((c.total, c.skipped, c.passed()), (4, 1, 3));
        assert_eq!(parse("<testsuites/>").unwrap(), TestCounts::default());
    }

    #[test]
    fn bad_reports_say_what_is_wrong() {
        let e = parse("<testsuite><testcase></testsuite>").unwrap_err();
        assert!(matches!(e, ReportError::Malformed { .. }), "{e}");
        assert!(
            e.to_string()
                .starts_with("test report out/junit.xml is not well-formed XML: "),
            "{e}"
        );
        let e = parse("<html><body/></html>").unwrap_err();
        assert_eq!(
            e.to_string(),
            "test report out/junit.xml has root element <html>, expected <testsuites> or <testsuite>"
        );
        let e = parse(r#"<testsuite tests="many"/>"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "test report out/junit.xml: attribute tests=\"many\" of <testsuite> is not a whole number"
        );
        let e = parse_report("r.xml", b"\xff\xfe<testsuite/>").unwrap_err();
        assert!(matches!(e, ReportError::NotText { .. }), "{e}");
        let e = parse("").unwrap_err();
        assert!(matches!(e, ReportError::Malformed { .. }), "{e}");
        // Entity expansion (billion laughs) is refused, not performed.
        let bomb =
            r#"<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;">]><testsuite name="&b;"/>"#;
        assert!(matches!(parse(bomb).unwrap_err(), ReportError::Malformed { .. }));
    }
}
