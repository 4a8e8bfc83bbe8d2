//! Adversary round 10. A failing test is a finding.
//!
//! Promise: text copied from a MacBuild and shown to people (artifact keys in `kubectl tartan
//! describe`, object listings, status URLs) cannot be made to read other than it is.
//! `artifact_key` refuses C0/C1 controls and the bidi overrides/isolates (U+202A-E, U+2066-9),
//! but lets through U+2028 LINE SEPARATOR / U+2029 PARAGRAPH SEPARATOR (rendered as a line break
//! by many terminals/UIs: a key can forge a second line) and the implicit bidi marks U+200F RLM /
//! U+061C ALM (reorder neutral runs such as `/`, `.`, digits). Input: `spec.artifacts.paths`
//! (untrusted pipeline author). Found: accepted at admission and published under that key.
//! Severity: low (display spoofing only; no host path escape).

use tartan_agent::host::artifacts::artifact_key;

#[test]
fn artifact_key_refuses_line_and_paragraph_separators() {
    for path in ["out/report.txt\u{2028}uploaded: mb-other/secret.txt", "a\u{2029}b"] {
        assert!(
            artifact_key("mb-x", path).is_err(),
            "{path:?} accepted as key {:?}",
            artifact_key("mb-x", path)
        );
    }
}

#[test]
fn artifact_key_refuses_implicit_bidi_marks() {
    for path in ["out/\u{200F}txt.exe", "out/\u{061C}1.2.3/a"] {
        assert!(
            artifact_key("mb-x", path).is_err(),
            "{path:?} accepted as key {:?}",
            artifact_key("mb-x", path)
        );
    }
}

/// HELD: the explicit overrides and isolates are refused.
#[test]
fn artifact_key_refuses_overrides_held() {
    for path in ["out/\u{202E}txt.exe", "out/\u{2067}x"] {
        assert!(artifact_key("mb-x", path).is_err(), "{path:?}");
    }
}
