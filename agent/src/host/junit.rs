//! JUnit XML test reports: counted into passed / failed / skipped / total.
//!
//! Accepted shapes (the common dialects of Ant, Maven Surefire, xcbeautify, xcpretty, pytest):
//! a `<testsuites>` root holding `<testsuite>`s (which may nest), or a bare `<testsuite>` root.
//! Each `<testcase>` counts once: failed when it has a `<failure>` or `<error>` child, skipped
//! when it has a `<skipped>` child, passed otherwise. A report without any `<testcase>` is
//! counted from the `tests`/`failures`/`errors`/`skipped` attributes of its top-level suites
//! (some tools write only those). DTDs are refused by the parser, so entities cannot expand.
//!
//! Counts are summed as u64 with checked arithmetic and then checked for sense: more than
//! [`MAX_TESTS`] tests, or more failures, errors and skips than tests, is a report error, never a
//! count (a wrapped or saturated sum could turn a failing build into a passing one).

use roxmltree::{Document, Node};

/// The most test cases a report may count; more is taken as a broken or hostile report.
pub const MAX_TESTS: u64 = 10_000_000;

/// What a test report says. Only [`parse_report`] makes one: every count is at most
/// [`MAX_TESTS`] and `failures + errors + skipped <= total`.
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
        // parse_report guarantees failures + errors <= total <= MAX_TESTS; saturating only keeps
        // hand-made counts from panicking.
        self.failures.saturating_add(self.errors)
    }

    /// Cases that ran and passed.
    pub fn passed(&self) -> u32 {
        self.total.saturating_sub(self.failed().saturating_add(self.skipped))
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
    #[error(
        "test report {what}: attribute {attribute}={value:?} of <{element}> is not a whole number from 0 to 2^64-1"
    )]
    BadCount {
        what: String,
        element: String,
        attribute: String,
        value: String,
    },
    #[error("test report {what} cannot be trusted: {detail}; the build is not counted as passed")]
    Untrustworthy { what: String, detail: String },
}

/// Counts as summed from the report, before they are checked.
#[derive(Clone, Copy, Debug, Default)]
struct Sums {
    total: u64,
    failures: u64,
    errors: u64,
    skipped: u64,
}

impl Sums {
    /// Adds `other`; `None` when a sum leaves u64.
    fn checked_add(self, other: Sums) -> Option<Sums> {
        Some(Sums {
            total: self.total.checked_add(other.total)?,
            failures: self.failures.checked_add(other.failures)?,
            errors: self.errors.checked_add(other.errors)?,
            skipped: self.skipped.checked_add(other.skipped)?,
        })
    }

    /// The counts, if they make sense: at most [`MAX_TESTS`] tests and no more outcomes than tests.
    fn checked(self, what: &str) -> Result<TestCounts, ReportError> {
        let untrustworthy = |detail: String| ReportError::Untrustworthy {
            what: what.to_string(),
            detail,
        };
        let Sums {
            total,
            failures,
            errors,
            skipped,
        } = self;
        if total > MAX_TESTS {
            return Err(untrustworthy(format!(
                "{total} tests, more than the {MAX_TESTS} accepted"
            )));
        }
        let outcomes = failures.checked_add(errors).and_then(|n| n.checked_add(skipped));
        if outcomes.is_none_or(|n| n > total) {
            return Err(untrustworthy(format!(
                "{failures} failures + {errors} errors + {skipped} skipped exceed its {total} tests"
            )));
        }
        // Each count is at most `total` <= MAX_TESTS, which fits u32.
        let small = |n: u64| u32::try_from(n).expect("bounded by MAX_TESTS");
        Ok(TestCounts {
            total: small(total),
            failures: small(failures),
            errors: small(errors),
            skipped: small(skipped),
        })
    }
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
    let mut counts = Sums::default();
    for case in root.descendants().filter(|n| n.has_tag_name("testcase")) {
        // u64 counters of nodes in a document held in memory cannot overflow.
        counts.total += 1;
        let has = |tag: &str| case.children().any(|c| c.has_tag_name(tag));
        if has("failure") {
            counts.failures += 1;
        } else if has("error") {
            counts.errors += 1;
        } else if has("skipped") {
            counts.skipped += 1;
        }
    }
    if counts.total > 0 {
        return counts.checked(what);
    }
    // Summary-only report: the outermost suites' attributes (never both a <testsuites> and its
    // children, which would count twice).
    let suites: Vec<Node> = if name == "testsuite" || root.attribute("tests").is_some() {
        vec![root]
    } else {
        root.children().filter(|n| n.has_tag_name("testsuite")).collect()
    };
    for suite in suites {
        let this = Sums {
            total: count_attr(what, suite, "tests")?,
            failures: count_attr(what, suite, "failures")?,
            errors: count_attr(what, suite, "errors")?,
            skipped: count_attr(what, suite, "skipped")?.max(count_attr(what, suite, "disabled")?),
        };
        counts = counts.checked_add(this).ok_or_else(|| ReportError::Untrustworthy {
            what: what.to_string(),
            detail: "its suites' counts add up to more than 2^64".to_string(),
        })?;
    }
    counts.checked(what)
}

fn count_attr(what: &str, node: Node, attribute: &str) -> Result<u64, ReportError> {
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
            "test report out/junit.xml: attribute tests=\"many\" of <testsuite> is not a whole number from 0 to 2^64-1"
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

    #[test]
    fn counts_that_overflow_or_make_no_sense_are_errors_not_passes() {
        // Once a panic in a debug build and a wrap to 0 failures (a pass) in a release build.
        let e = parse(r#"<testsuite tests="5" failures="4294967295" errors="1"/>"#).unwrap_err();
        assert!(matches!(e, ReportError::Untrustworthy { .. }), "{e}");
        assert_eq!(
            e.to_string(),
            "test report out/junit.xml cannot be trusted: 4294967295 failures + 1 errors + 0 skipped exceed its 5 tests; \
             the build is not counted as passed"
        );
        // Sums across suites that leave u64.
        let e = parse(
            r#"<testsuites><testsuite tests="18446744073709551615" failures="18446744073709551615"/>
               <testsuite tests="1" failures="1"/></testsuites>"#,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "test report out/junit.xml cannot be trusted: its suites' counts add up to more than 2^64; \
             the build is not counted as passed"
        );
        let e = parse(r#"<testsuite tests="10000001"/>"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("10000001 tests, more than the 10000000 accepted"),
            "{e}"
        );
        let e = parse(r#"<testsuite tests="3" failures="1" errors="1" skipped="2"/>"#).unwrap_err();
        assert!(matches!(e, ReportError::Untrustworthy { .. }), "{e}");
        let e = parse(r#"<testsuite tests="0" failures="1"/>"#).unwrap_err();
        assert!(matches!(e, ReportError::Untrustworthy { .. }), "{e}");
        let e = parse(r#"<testsuite tests="18446744073709551616"/>"#).unwrap_err();
        assert!(matches!(e, ReportError::BadCount { .. }), "{e}");
        // At the limits, still counted.
        let c = parse(r#"<testsuite tests="10000000" failures="9999999" errors="1"/>"#).unwrap();
        assert_eq!((c.total, c.failed(), c.passed()), (10_000_000, 10_000_000, 0));
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        /// The reference: what a report of these suites means, summed without any limit.
        fn reference(suites: &[(u64, u64, u64, u64)]) -> Option<TestCounts> {
            let sum = |f: fn(&(u64, u64, u64, u64)) -> u64| suites.iter().map(|s| u128::from(f(s))).sum::<u128>();
            let (total, failures, errors, skipped) = (sum(|s| s.0), sum(|s| s.1), sum(|s| s.2), sum(|s| s.3));
            (total <= u128::from(MAX_TESTS) && failures + errors + skipped <= total).then_some(TestCounts {
                total: total as u32,
                failures: failures as u32,
                errors: errors as u32,
                skipped: skipped as u32,
            })
        }

        fn count() -> impl Strategy<Value = u64> {
            prop_oneof![
                0u64..20,
                0u64..=MAX_TESTS,
                any::<u64>(),
                Just(u64::from(u32::MAX)),
                Just(u64::MAX)
            ]
        }

        fn accepted_counts_are_consistent(c: &TestCounts) -> Result<(), TestCaseError> {
            prop_assert!(u64::from(c.total) <= MAX_TESTS);
            prop_assert!(u64::from(c.failures) + u64::from(c.errors) + u64::from(c.skipped) <= u64::from(c.total));
            prop_assert_eq!(c.passed() + c.failed() + c.skipped, c.total);
            Ok(())
        }

        proptest! {
            #[test]
            fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
                if let Ok(c) = parse_report("r.xml", &bytes) {
                    accepted_counts_are_consistent(&c)?;
                }
            }

            #[test]
            fn arbitrary_attribute_values_never_panic_nor_pass_unchecked(
                values in proptest::collection::vec(".{0,24}", 5),
            ) {
                let attr = |v: &str| v.replace('&', "&amp;").replace('"', "&quot;").replace('<', "&lt;");
                let xml = format!(
                    r#"<testsuite tests="{}" failures="{}" errors="{}" skipped="{}" disabled="{}"/>"#,
                    attr(&values[0]), attr(&values[1]), attr(&values[2]), attr(&values[3]), attr(&values[4])
                );
                if let Ok(c) = parse_report("r.xml", xml.as_bytes()) {
                    accepted_counts_are_consistent(&c)?;
                }
            }

            #[test]
            fn summary_totals_equal_the_reference_sum(
                suites in proptest::collection::vec((count(), count(), count(), count()), 0..5),
            ) {
                let body: String = suites
                    .iter()
                    .map(|(t, f, e, s)| format!(r#"<testsuite tests="{t}" failures="{f}" errors="{e}" skipped="{s}"/>"#))
                    .collect();
                let got = parse_report("r.xml", format!("<testsuites>{body}</testsuites>").as_bytes());
                match reference(&suites) {
                    Some(want) => prop_assert_eq!(got, Ok(want)),
                    // Counts that cannot be trusted are an error, never a pass.
                    None => prop_assert!(matches!(got, Err(ReportError::Untrustworthy { .. })), "{:?}", got),
                }
            }

            #[test]
            fn case_totals_equal_the_reference_sum(kinds in proptest::collection::vec(0u8..4, 0..200)) {
                let body: String = kinds
                    .iter()
                    .map(|k| match k {
                        0 => "<testcase/>",
                        1 => "<testcase><failure/></testcase>",
                        2 => "<testcase><error/></testcase>",
                        _ => "<testcase><skipped/></testcase>",
                    })
                    .collect();
                let got = parse_report("r.xml", format!("<testsuite>{body}</testsuite>").as_bytes()).unwrap();
                let n = |k: u8| kinds.iter().filter(|x| **x == k).count() as u32;
                let want = TestCounts { total: kinds.len() as u32, failures: n(1), errors: n(2), skipped: n(3) };
                prop_assert_eq!(got, want);
                prop_assert_eq!(got.passed(), n(0));
            }
        }
    }
}
