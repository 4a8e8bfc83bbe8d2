//! JUnit XML test reports: counted into passed / failed / skipped / total.
//!
//! Accepted shapes (the common dialects of Ant, Maven Surefire, xcbeautify, xcpretty, pytest):
//! a `<testsuites>` root holding `<testsuite>`s (which may nest), or a bare `<testsuite>` root.
//! Each `<testcase>` counts once: failed when it has a `<failure>` or `<error>` child, skipped
//! when it has a `<skipped>` child, passed otherwise. A report without any `<testcase>` is
//! counted from the `tests`/`failures`/`errors`/`skipped` attributes of its top-level suites
//! (some tools write only those). DTDs are refused, so entities cannot expand. The report is
//! read as a stream ([`count_report`]), never held whole nor built into a tree.
//!
//! Counts are summed as u64 with checked arithmetic and then checked for sense: more than
//! [`MAX_TESTS`] tests, or more failures, errors and skips than tests, is a report error, never a
//! count (a wrapped or saturated sum could turn a failing build into a passing one).

use std::io::Read;

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
    #[error("test report {what} could not be read: {detail}")]
    Unreadable { what: String, detail: String },
}

impl ReportError {
    /// This error with `mask`'s Secret values masked in what it quotes of the report (names,
    /// values, details), before any of it is formatted (a quoted value is escaped then, which
    /// masking the message afterwards would miss).
    pub fn masked(self, mask: &super::env::Masker) -> ReportError {
        let m = |text: String| mask.mask_text(&text);
        match self {
            ReportError::NotText { what, detail } => ReportError::NotText {
                what: m(what),
                detail: m(detail),
            },
            ReportError::Malformed { what, detail } => ReportError::Malformed {
                what: m(what),
                detail: m(detail),
            },
            ReportError::WrongRoot { what, root } => ReportError::WrongRoot {
                what: m(what),
                root: m(root),
            },
            ReportError::BadCount {
                what,
                element,
                attribute,
                value,
            } => ReportError::BadCount {
                what: m(what),
                element: m(element),
                attribute,
                value: quotable_count(&value).map_or_else(
                    || format!("({} characters, not shown)", value.chars().count()),
                    |v| m(v.to_string()),
                ),
            },
            ReportError::Untrustworthy { what, detail } => ReportError::Untrustworthy {
                what: m(what),
                detail: m(detail),
            },
            ReportError::Unreadable { what, detail } => ReportError::Unreadable {
                what: m(what),
                detail: m(detail),
            },
        }
    }
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
    count_report(what, bytes)
}

/// Counts the test cases of the JUnit XML report read from `input` as it streams by, in memory
/// bounded whatever the report holds: a fixed read buffer, the open elements (at most
/// [`MAX_DEPTH`], names of at most [`MAX_NAME`] bytes) and the few count attributes kept. No tree
/// is built (a report of millions of empty elements once took hundreds of MB as one). `what`
/// names the report in errors.
///
/// The XML is checked as it is read: UTF-8, tags that nest and close by name, one root, quoted
/// attribute values without `<`, the five predefined entities and character references only
/// (a DTD is refused, so entities cannot expand), no control characters. Element names compare
/// by their local part (`j:testcase` is a `testcase`), as namespace-aware readers do.
pub fn count_report(what: &str, input: impl Read) -> Result<TestCounts, ReportError> {
    let mut counter = Counter::new(what, input);
    let result = counter.run();
    result.and_then(|()| counter.finish())
}

/// The deepest nesting of elements accepted (JUnit reports nest suites a few levels).
pub const MAX_DEPTH: usize = 1024;
/// The longest element or attribute name accepted, in bytes.
pub const MAX_NAME: usize = 1024;
/// The longest count attribute value kept; a longer one is a bad count, shown cut.
const MAX_KEPT_VALUE: usize = 256;
/// The longest bad count quoted when the build has Secrets (see [`quotable_count`]).
const MAX_QUOTED_COUNT: usize = 32;

/// A bad count value as it may be quoted when the build has Secrets: short, of one word, and not
/// cut. A longer value may hold a Secret value only in part (the kept text is cut at
/// [`MAX_KEPT_VALUE`]), and XML turns the line ends inside an attribute into spaces, so a
/// multi-line value is no longer whole: masking recognises neither, so neither is quoted.
fn quotable_count(value: &str) -> Option<&str> {
    let one_word = !value.is_empty() && !value.chars().any(|c| c.is_whitespace() || c == '…');
    (one_word && value.chars().count() <= MAX_QUOTED_COUNT).then_some(value)
}
/// The count attributes read from suites.
const COUNT_ATTRIBUTES: [&str; 5] = ["tests", "failures", "errors", "skipped", "disabled"];

/// One open element.
struct Open {
    /// Where its name as written (the end tag must repeat it) starts in [`Counter::names`].
    name_at: usize,
    testcase: bool,
    /// For a test case: which of failure, error, skipped its children hold.
    outcome: [bool; 3],
}

/// The streaming counter: input, the open elements and the sums so far.
struct Counter<'w, R> {
    what: &'w str,
    input: Input<R>,
    open: Vec<Open>,
    /// The names of the open elements, one after the other (no allocation per element).
    names: Vec<u8>,
    /// The name just read.
    scratch: Vec<u8>,
    cases: Sums,
    /// The root's name (local part) once seen.
    root: Option<Vec<u8>>,
    /// Whether the summary is the root's attributes (a `<testsuite>` root, or a root with
    /// `tests`) rather than its child suites'.
    summary_from_root: bool,
    /// The summary of the outermost suites, or its first error.
    summary: Result<Sums, ReportError>,
}

/// A byte source that checks UTF-8 as it goes and knows its offset.
struct Input<R> {
    reader: R,
    buf: Box<[u8]>,
    /// Checked bytes `pos..valid`; `valid..len` is an incomplete UTF-8 sequence kept for the next read.
    pos: usize,
    valid: usize,
    len: usize,
    /// Offset of `buf[0]` in the input.
    base: u64,
    eof: bool,
}

const READ_CHUNK: usize = 64 << 10;

/// What went wrong while reading, before it is made a [`ReportError`].
enum Fault {
    NotText(String),
    Malformed(String),
    Io(String),
}

impl<R: Read> Input<R> {
    fn new(reader: R) -> Self {
        Input {
            reader,
            buf: vec![0; READ_CHUNK].into_boxed_slice(),
            pos: 0,
            valid: 0,
            len: 0,
            base: 0,
            eof: false,
        }
    }

    fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    /// Refills the buffer; false at the end of the input.
    fn fill(&mut self) -> Result<bool, Fault> {
        while self.pos == self.valid {
            if self.eof {
                if self.valid < self.len {
                    return Err(Fault::NotText(format!(
                        "the input ends inside a UTF-8 sequence at byte {}",
                        self.offset()
                    )));
                }
                return Ok(false);
            }
            // Keep the incomplete sequence (at most 3 bytes) at the front.
            let carry = self.len - self.valid;
            self.buf.copy_within(self.valid..self.len, 0);
            self.base += self.valid as u64;
            self.pos = 0;
            self.len = carry;
            let n = loop {
                match self.reader.read(&mut self.buf[carry..]) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(Fault::Io(e.to_string())),
                }
            };
            if n == 0 {
                self.eof = true;
                self.valid = 0;
                continue;
            }
            self.len += n;
            self.valid = match std::str::from_utf8(&self.buf[..self.len]) {
                Ok(_) => self.len,
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                Err(e) => {
                    return Err(Fault::NotText(format!(
                        "invalid UTF-8 at byte {}",
                        self.base + e.valid_up_to() as u64
                    )));
                }
            };
        }
        Ok(true)
    }

    fn peek(&mut self) -> Result<Option<u8>, Fault> {
        if self.fill()? {
            Ok(Some(self.buf[self.pos]))
        } else {
            Ok(None)
        }
    }

    fn next(&mut self) -> Result<Option<u8>, Fault> {
        let b = self.peek()?;
        if b.is_some() {
            self.pos += 1;
        }
        Ok(b)
    }
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// A byte that may not end or be part of a name.
fn ends_name(b: u8) -> bool {
    is_space(b) || matches!(b, b'/' | b'>' | b'=' | b'<' | b'"' | b'\'' | b'&' | b'!' | b'?')
}

/// The local part of a qualified name.
fn local(name: &[u8]) -> &[u8] {
    match name.iter().rposition(|b| *b == b':') {
        Some(i) => &name[i + 1..],
        None => name,
    }
}

impl<'w, R: Read> Counter<'w, R> {
    fn new(what: &'w str, reader: R) -> Self {
        Counter {
            what,
            input: Input::new(reader),
            open: Vec::new(),
            names: Vec::new(),
            scratch: Vec::new(),
            cases: Sums::default(),
            root: None,
            summary_from_root: false,
            summary: Ok(Sums::default()),
        }
    }

    fn run(&mut self) -> Result<(), ReportError> {
        self.document().map_err(|fault| {
            let what = self.what.to_string();
            match fault {
                Fault::NotText(detail) => ReportError::NotText { what, detail },
                Fault::Malformed(detail) => ReportError::Malformed { what, detail },
                Fault::Io(detail) => ReportError::Unreadable { what, detail },
            }
        })
    }

    fn malformed<T>(&self, why: impl std::fmt::Display) -> Result<T, Fault> {
        Err(Fault::Malformed(format!("{why} at byte {}", self.input.offset())))
    }

    fn next(&mut self) -> Result<u8, Fault> {
        match self.input.next()? {
            Some(b) if b < 0x20 && !is_space(b) => self.malformed(format_args!("control character {b:#04x}")),
            Some(b) => Ok(b),
            None => self.malformed("unexpected end of the document"),
        }
    }

    fn expect(&mut self, want: &[u8]) -> Result<(), Fault> {
        for w in want {
            if self.next()? != *w {
                return self.malformed(format_args!("expected {:?}", String::from_utf8_lossy(want)));
            }
        }
        Ok(())
    }

    fn skip_space(&mut self) -> Result<bool, Fault> {
        let mut any = false;
        while let Some(b) = self.input.peek()? {
            if !is_space(b) {
                break;
            }
            self.input.pos += 1;
            any = true;
        }
        Ok(any)
    }

    /// Skips to just past `end` (`-->`, `?>` or `]]>`: a comment's, a PI's or a CDATA section's).
    fn skip_past(&mut self, end: &[u8]) -> Result<(), Fault> {
        let mut last = [0u8; 3];
        loop {
            last.rotate_left(1);
            last[2] = self.next()?;
            if last[3 - end.len()..] == *end {
                return Ok(());
            }
        }
    }

    /// A name into `scratch`, up to the first byte that ends one (not consumed).
    fn name(&mut self) -> Result<(), Fault> {
        self.scratch.clear();
        while self.input.fill()? {
            let chunk = &self.input.buf[self.input.pos..self.input.valid];
            let n = chunk
                .iter()
                .position(|&b| ends_name(b) || b < 0x20)
                .unwrap_or(chunk.len());
            let whole = n < chunk.len();
            if self.scratch.len() + n > MAX_NAME {
                return self.malformed(format_args!("a name longer than {MAX_NAME} bytes"));
            }
            self.scratch.extend_from_slice(&chunk[..n]);
            self.input.pos += n;
            if whole {
                break;
            }
        }
        let name = &self.scratch;
        match name.first() {
            None => self.malformed("expected a name"),
            Some(b'-' | b'.' | b'0'..=b'9' | b':') => self.malformed("a name starts with a character names cannot"),
            Some(_) if name.ends_with(b":") || name.iter().filter(|b| **b == b':').count() > 1 => {
                self.malformed("a malformed prefixed name")
            }
            Some(_) => Ok(()),
        }
    }

    /// Skips text up to the next byte that needs a look (`<`, `&`, a control character), within
    /// what is buffered: the bulk of a report's text never goes byte by byte.
    fn skip_plain_text(&mut self) -> Result<(), Fault> {
        while self.input.fill()? {
            let chunk = &self.input.buf[self.input.pos..self.input.valid];
            match chunk
                .iter()
                .position(|&b| b == b'<' || b == b'&' || (b < 0x20 && !is_space(b)))
            {
                Some(i) => {
                    self.input.pos += i;
                    return Ok(());
                }
                None => self.input.pos = self.input.valid,
            }
        }
        Ok(())
    }

    /// After `&`: a reference, decoded. `keep` receives the character.
    fn reference(&mut self, keep: &mut impl FnMut(char)) -> Result<(), Fault> {
        let mut body = Vec::new();
        loop {
            let b = self.next()?;
            if b == b';' {
                break;
            }
            if body.len() == 16 {
                return self.malformed("an entity reference too long");
            }
            body.push(b);
        }
        let c = match body.as_slice() {
            b"lt" => '<',
            b"gt" => '>',
            b"amp" => '&',
            b"apos" => '\'',
            b"quot" => '"',
            [b'#', b'x', hex @ ..] if !hex.is_empty() && hex.iter().all(u8::is_ascii_hexdigit) => self.char_ref(
                std::str::from_utf8(hex)
                    .ok()
                    .and_then(|h| u32::from_str_radix(h, 16).ok()),
            )?,
            [b'#', dec @ ..] if !dec.is_empty() && dec.iter().all(u8::is_ascii_digit) => {
                self.char_ref(std::str::from_utf8(dec).ok().and_then(|d| d.parse().ok()))?
            }
            _ => {
                return self.malformed(format_args!("unknown entity &{};", String::from_utf8_lossy(&body)));
            }
        };
        keep(c);
        Ok(())
    }

    fn char_ref(&self, code: Option<u32>) -> Result<char, Fault> {
        match code.and_then(char::from_u32) {
            Some(c) if c >= ' ' || matches!(c, '\t' | '\n' | '\r') => Ok(c),
            _ => self.malformed("a character reference to no valid character"),
        }
    }

    /// The document: prolog, the root element, then only comments, PIs and space.
    fn document(&mut self) -> Result<(), Fault> {
        // A byte order mark.
        if self.input.peek()? == Some(0xEF) {
            self.expect("\u{feff}".as_bytes())?;
        }
        loop {
            self.skip_space()?;
            match self.input.next()? {
                None if self.root.is_some() => return Ok(()),
                None => return self.malformed("no root element"),
                Some(b'<') => {}
                Some(_) => return self.malformed("text outside the root element"),
            }
            match self.input.peek()? {
                Some(b'?') => {
                    self.input.pos += 1;
                    self.skip_past(b"?>")?;
                }
                Some(b'!') => {
                    self.input.pos += 1;
                    if self.input.peek()? == Some(b'-') {
                        self.expect(b"--")?;
                        self.skip_past(b"-->")?;
                    } else {
                        return self.malformed("a DTD or declaration (not allowed)");
                    }
                }
                _ if self.root.is_some() => return self.malformed("a second root element"),
                _ => self.element_tree()?,
            }
        }
    }

    /// From just after the root's `<` to the end of its end tag.
    fn element_tree(&mut self) -> Result<(), Fault> {
        self.start_tag()?;
        while !self.open.is_empty() {
            // Content: text up to the next `<`.
            loop {
                self.skip_plain_text()?;
                match self.next()? {
                    b'<' => break,
                    b'&' => self.reference(&mut |_| {})?,
                    _ => {}
                }
            }
            match self.input.peek()? {
                Some(b'/') => {
                    self.input.pos += 1;
                    self.end_tag()?;
                }
                Some(b'!') => {
                    self.input.pos += 1;
                    match self.next()? {
                        b'-' => {
                            self.expect(b"-")?;
                            self.skip_past(b"-->")?;
                        }
                        b'[' => {
                            self.expect(b"CDATA[")?;
                            self.skip_past(b"]]>")?;
                        }
                        _ => return self.malformed("a declaration inside an element"),
                    }
                }
                Some(b'?') => {
                    self.input.pos += 1;
                    self.skip_past(b"?>")?;
                }
                _ => self.start_tag()?,
            }
        }
        Ok(())
    }

    /// A start tag from just after its `<`: the element is opened (or, for `<x/>`, opened and
    /// closed).
    fn start_tag(&mut self) -> Result<(), Fault> {
        if self.open.len() == MAX_DEPTH {
            return self.malformed(format_args!("elements nested deeper than {MAX_DEPTH}"));
        }
        self.name()?;
        let name_at = self.names.len();
        self.names.extend_from_slice(&self.scratch);
        let depth = self.open.len();
        let is_root = depth == 0;
        let local_name = local(&self.scratch);
        let is_suite = local_name == b"testsuite";
        let is_case = local_name == b"testcase";
        let outcome = [&b"failure"[..], b"error", b"skipped"]
            .iter()
            .position(|n| *n == local_name);
        if is_root {
            // Anything else is refused once the document proved well-formed (a malformed one
            // says so first).
            self.summary_from_root = is_suite;
            self.root = Some(local_name.to_vec());
        }
        // Count attributes matter on the root and, for a `<testsuites>` root, its child suites.
        let summary_suite = is_root || (depth == 1 && is_suite);
        let mut kept: [Option<String>; 5] = Default::default();
        let mut seen = [false; 5];
        let closed = loop {
            let spaced = self.skip_space()?;
            match self.next()? {
                b'>' => break false,
                b'/' => {
                    self.expect(b">")?;
                    break true;
                }
                _ if !spaced => return self.malformed("expected space before an attribute"),
                _ => {
                    self.input.pos -= 1;
                    self.name()?;
                    self.skip_space()?;
                    self.expect(b"=")?;
                    self.skip_space()?;
                    let quote = self.next()?;
                    if quote != b'"' && quote != b'\'' {
                        return self.malformed("an attribute value without quotes");
                    }
                    let slot = COUNT_ATTRIBUTES
                        .iter()
                        .position(|a| a.as_bytes() == self.scratch.as_slice());
                    if let Some(i) = slot {
                        if seen[i] {
                            return self.malformed(format_args!("attribute {} given twice", COUNT_ATTRIBUTES[i]));
                        }
                        seen[i] = true;
                    }
                    let mut value = String::new();
                    let mut cut = false;
                    let mut keep = |c: char| {
                        if slot.is_some() && summary_suite {
                            if value.len() < MAX_KEPT_VALUE {
                                value.push(c);
                            } else {
                                cut = true;
                            }
                        }
                    };
                    loop {
                        match self.next()? {
                            b if b == quote => break,
                            b'<' => return self.malformed("'<' in an attribute value"),
                            b'&' => self.reference(&mut keep)?,
                            // Attribute-value normalization: literal tabs and newlines read as spaces.
                            b'\t' | b'\n' | b'\r' => keep(' '),
                            b if b < 0x80 => keep(char::from(b)),
                            b => {
                                // A multi-byte character (UTF-8 already checked): kept whole.
                                let mut bytes = vec![b];
                                while let Some(c) = self.input.peek()? {
                                    if c & 0xC0 != 0x80 {
                                        break;
                                    }
                                    bytes.push(c);
                                    self.input.pos += 1;
                                }
                                String::from_utf8_lossy(&bytes).chars().for_each(&mut keep);
                            }
                        }
                    }
                    if let Some(i) = slot.filter(|_| summary_suite) {
                        if cut {
                            value.push('…');
                        }
                        kept[i] = Some(value);
                    }
                }
            }
        };
        if is_root && kept[0].is_some() {
            self.summary_from_root = true;
        }
        if summary_suite && (is_root == self.summary_from_root) {
            let element = local(&self.names[name_at..]).to_vec();
            self.add_summary(&element, &kept);
        }
        // A direct child of an open test case marks its outcome.
        if let Some(parent) = self.open.last_mut()
            && parent.testcase
            && let Some(i) = outcome
        {
            parent.outcome[i] = true;
        }
        self.open.push(Open {
            name_at,
            testcase: !is_root && is_case,
            outcome: [false; 3],
        });
        if closed {
            self.close();
        }
        Ok(())
    }

    /// Adds an outermost suite's attributes to the summary (the first error stays).
    fn add_summary(&mut self, element: &[u8], kept: &[Option<String>; 5]) {
        let Ok(sums) = self.summary else { return };
        let what = self.what;
        let count = |i: usize| -> Result<u64, ReportError> {
            match &kept[i] {
                None => Ok(0),
                Some(v) => v.trim().parse().map_err(|_| ReportError::BadCount {
                    what: what.to_string(),
                    element: String::from_utf8_lossy(element).into_owned(),
                    attribute: COUNT_ATTRIBUTES[i].to_string(),
                    value: v.clone(),
                }),
            }
        };
        let this = (|| {
            Ok(Sums {
                total: count(0)?,
                failures: count(1)?,
                errors: count(2)?,
                skipped: count(3)?.max(count(4)?),
            })
        })();
        self.summary = this.and_then(|this| {
            sums.checked_add(this).ok_or_else(|| ReportError::Untrustworthy {
                what: what.to_string(),
                detail: "its suites' counts add up to more than 2^64".to_string(),
            })
        });
    }

    /// An end tag from just after its `</`.
    fn end_tag(&mut self) -> Result<(), Fault> {
        self.name()?;
        self.skip_space()?;
        self.expect(b">")?;
        let open = &self.names[self.open.last().expect("inside an element").name_at..];
        if *open != self.scratch {
            let (open, name) = (String::from_utf8_lossy(open), String::from_utf8_lossy(&self.scratch));
            return self.malformed(format_args!("</{name}> closes <{open}>"));
        }
        self.close();
        Ok(())
    }

    /// Closes the innermost element; a test case is counted.
    fn close(&mut self) {
        let Some(open) = self.open.pop() else { return };
        self.names.truncate(open.name_at);
        if open.testcase {
            // u64 counters of elements read cannot overflow.
            self.cases.total += 1;
            match open.outcome {
                [true, _, _] => self.cases.failures += 1,
                [false, true, _] => self.cases.errors += 1,
                [false, false, true] => self.cases.skipped += 1,
                _ => {}
            }
        }
    }

    /// The counts of a document read whole: its cases, or without any, its summary.
    fn finish(self) -> Result<TestCounts, ReportError> {
        let root = self.root.as_deref().unwrap_or_default();
        if root != b"testsuites" && root != b"testsuite" {
            return Err(ReportError::WrongRoot {
                what: self.what.to_string(),
                root: String::from_utf8_lossy(root).into_owned(),
            });
        }
        if self.cases.total > 0 {
            return self.cases.checked(self.what);
        }
        self.summary?.checked(self.what)
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

    /// What a report error quotes of the report is masked before it is escaped and formatted.
    #[test]
    fn report_errors_mask_the_secret_values_they_quote() {
        let mask = crate::host::env::Masker::new([&b"tok\"en\nline-two"[..]]);
        for xml in [
            "<testsuite tests=\"tok&quot;en&#10;line-two\"/>",
            "<line-two/>",
            "<testsuite>&line-two;</testsuite>",
            "<testsuite></line-two>",
        ] {
            let e = parse_report("r.xml", xml.as_bytes())
                .unwrap_err()
                .masked(&mask)
                .to_string();
            // Masked, or (a multi-line count value) not quoted at all.
            assert!(
                (e.contains("***") || e.contains("not shown")) && !e.contains("line-two") && !e.contains("tok"),
                "{xml}: {e}"
            );
        }
    }

    /// Adversary finding: a count attribute is kept up to 256 bytes then cut with `…`, and the
    /// cut text is masked: a longer value (a JWT, a PEM line run) is no longer whole there, so
    /// its first 256 bytes are quoted in clear into the journal, status and pipeline.
    #[test]
    fn a_long_secret_in_a_count_attribute_is_not_quoted_in_part() {
        let value: String = (0..400).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        let mask = crate::host::env::Masker::new([value.as_bytes()]);
        let xml = format!("<testsuite tests=\"{value}\"/>");
        let e = parse_report("r.xml", xml.as_bytes())
            .unwrap_err()
            .masked(&mask)
            .to_string();
        assert!(!e.contains(&value[..64]), "a Secret value's start is quoted: {e}");
    }

    /// Adversary finding: attribute-value normalization turns a multi-line value's line ends
    /// into spaces before the value is masked; lines shorter than 4 bytes are never masked alone,
    /// so such a value is quoted whole, in clear.
    #[test]
    fn a_short_lined_multi_line_secret_in_a_count_attribute_is_masked() {
        let mask = crate::host::env::Masker::new([&b"ab1\ncd2\nef3"[..]]);
        let e = parse_report("r.xml", b"<testsuite tests=\"ab1\ncd2\nef3\"/>")
            .unwrap_err()
            .masked(&mask)
            .to_string();
        assert!(!e.contains("ab1 cd2 ef3"), "a Secret value is quoted: {e}");
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

    /// The counter as it was, on a whole tree (roxmltree): the reference the streaming counter
    /// must agree with on every well-formed report.
    fn tree_count(what: &str, bytes: &[u8]) -> Result<TestCounts, ReportError> {
        use roxmltree::{Document, Node};
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
        let count_attr = |node: Node, attribute: &str| -> Result<u64, ReportError> {
            match node.attribute(attribute) {
                None => Ok(0),
                Some(v) => v.trim().parse().map_err(|_| ReportError::BadCount {
                    what: what.to_string(),
                    element: node.tag_name().name().to_string(),
                    attribute: attribute.to_string(),
                    value: v.to_string(),
                }),
            }
        };
        let suites: Vec<Node> = if name == "testsuite" || root.attribute("tests").is_some() {
            vec![root]
        } else {
            root.children().filter(|n| n.has_tag_name("testsuite")).collect()
        };
        for suite in suites {
            let this = Sums {
                total: count_attr(suite, "tests")?,
                failures: count_attr(suite, "failures")?,
                errors: count_attr(suite, "errors")?,
                skipped: count_attr(suite, "skipped")?.max(count_attr(suite, "disabled")?),
            };
            counts = counts.checked_add(this).ok_or_else(|| ReportError::Untrustworthy {
                what: what.to_string(),
                detail: "its suites' counts add up to more than 2^64".to_string(),
            })?;
        }
        counts.checked(what)
    }

    #[test]
    fn xml_edges_read_as_the_tree_reader_did() {
        for xml in [
            "\u{feff}<?xml version=\"1.0\"?><!-- c --><testsuite><testcase/></testsuite><!-- after -->\n",
            "<testsuite><testcase><![CDATA[<failure/> ]] ]>]]></testcase><testcase><!----><failure/></testcase></testsuite>",
            "<testsuite><testcase>&lt;&#x41;&#65;&amp;<?pi <failure/>?></testcase></testsuite>",
            "<testsuite tests=' 3 ' failures=\"&#x31;\"/>",
            "<testsuite tests=\"\t2\n\"/>",
            "<testsuites tests=\"x\"><testsuite tests=\"2\"/></testsuites>",
            "<testsuites><testsuite tests=\"2\"><testsuite tests=\"9\"/></testsuite><other tests=\"5\"/></testsuites>",
            "<j:testsuites xmlns:j=\"urn:j\"><j:testcase><j:skipped/></j:testcase><testcase><x><failure/></x></testcase></j:testsuites>",
            "<testsuite><testcase><testcase><error/></testcase><failure/></testcase></testsuite>",
            "<testsuite  tests = \"1\" ></testsuite >",
            "<testsuite><testcase/></testsuite><testsuite/>",
            "<testsuite><testcase/>",
            "<testsuite><testcase></testsuite>",
            "<testsuite tests=\"1\" tests=\"2\"/>",
            "<testsuite tests=\"1\"failures=\"0\"/>",
            "<testsuite tests=1/>",
            "<testsuite tests=\"<\"/>",
            "<testsuite>&bogus;</testsuite>",
            "<testsuite>&#0;</testsuite>",
            "<testsuite>\u{1}</testsuite>",
            "text<testsuite/>",
            "<testsuite/>text",
            "<!DOCTYPE testsuite><testsuite/>",
            "<html><body></html>",
            "<html/>",
            "<testsuite><!-- unterminated </testsuite>",
            "<testsuite><![CDATA[ x ]]</testsuite>",
            "<1testsuite/>",
            "<testsuite tests=\"\u{e9}\"/>",
            "  ",
        ] {
            let want = tree_count("r.xml", xml.as_bytes());
            let got = parse_report("r.xml", xml.as_bytes());
            match (&want, &got) {
                (Err(ReportError::Malformed { .. }), Err(ReportError::Malformed { .. })) => {}
                _ => assert_eq!(got, want, "{xml:?}"),
            }
        }
    }

    mod props {
        use super::super::*;
        use super::tree_count;
        use proptest::prelude::*;

        /// A random report tree: element names JUnit uses and some it does not, count
        /// attributes (some not numbers), text with references, comments and CDATA.
        fn element(depth: u32) -> BoxedStrategy<String> {
            let name = prop_oneof![
                Just("testsuite"),
                Just("testcase"),
                Just("failure"),
                Just("error"),
                Just("skipped"),
                Just("system-out"),
                Just("j:testcase"),
                Just("properties"),
            ];
            let attr = (
                prop_oneof![
                    Just("tests"),
                    Just("failures"),
                    Just("errors"),
                    Just("skipped"),
                    Just("disabled"),
                    Just("name")
                ],
                prop_oneof![
                    (0u64..30).prop_map(|n| n.to_string()),
                    Just(" 7 ".to_string()),
                    Just("&#52;".to_string()),
                    Just("x&amp;y".to_string()),
                    Just("18446744073709551615".to_string()),
                ],
            );
            let text = prop_oneof![
                Just(""),
                Just("text &lt; &amp; &#x263A;"),
                Just("<!-- <testcase/> -->"),
                Just("<![CDATA[<testcase/>]]>"),
                Just("\n  "),
            ];
            let leaf = (
                name.clone(),
                proptest::collection::btree_map(attr.0.clone(), attr.1.clone(), 0..3),
                text.clone(),
            )
                .prop_map(|(n, attrs, t)| {
                    let a: String = attrs.iter().map(|(k, v)| format!(" {k}=\"{v}\"")).collect();
                    if t.is_empty() {
                        format!("<{n}{a}/>")
                    } else {
                        format!("<{n}{a}>{t}</{n}>")
                    }
                });
            if depth == 0 {
                return leaf.boxed();
            }
            prop_oneof![
                leaf,
                (
                    name,
                    proptest::collection::btree_map(attr.0, attr.1, 0..3),
                    proptest::collection::vec(element(depth - 1), 0..5),
                    text
                )
                    .prop_map(|(n, attrs, children, t)| {
                        let a: String = attrs.iter().map(|(k, v)| format!(" {k}=\"{v}\"")).collect();
                        format!("<{n}{a}>{t}{}</{n}>", children.concat())
                    }),
            ]
            .boxed()
        }

        fn report() -> impl Strategy<Value = String> {
            (
                prop_oneof![Just("testsuites"), Just("testsuite"), Just("html")],
                prop_oneof![
                    Just(""),
                    Just(" tests=\"4\""),
                    Just(" tests=\"3\" failures=\"1\""),
                    Just(" tests=\"x\"")
                ],
                proptest::collection::vec(element(3), 0..5),
            )
                .prop_map(|(root, attrs, children)| {
                    format!(
                        "<?xml version=\"1.0\"?>\n<{root} xmlns:j=\"urn:j\"{attrs}>{}</{root}>\n",
                        children.concat()
                    )
                })
        }

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

            /// Any report the generator makes counts as the tree reader counted it, and cut
            /// anywhere it fails as that one did (malformed, or not text inside a character).
            #[test]
            fn the_stream_counts_as_the_tree_did(xml in report(), cut in any::<prop::sample::Index>()) {
                let want = tree_count("r.xml", xml.as_bytes());
                prop_assert_eq!(parse_report("r.xml", xml.as_bytes()), want);
                let cut = &xml.as_bytes()[..cut.index(xml.len())];
                let (want, got) = (tree_count("r.xml", cut), parse_report("r.xml", cut));
                prop_assert_eq!(std::mem::discriminant(&got), std::mem::discriminant(&want), "{:?} {:?}", got, want);
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
