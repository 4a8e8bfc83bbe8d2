//! Text from outside (tart's output and errors, a guest step's output, a report's error) made fit
//! for the journal, a status message or an event: valid UTF-8, no terminal escapes, no control
//! characters but `\n` and `\t`, bounded. One function for everyone, so that what the agent
//! journals and what the controller copies into a CustomRun are cleaned the same way.

/// Marks where [`clean`] or [`last_lines`] cut text.
pub const CUT: &str = "…";

/// Lines of a failing step's output kept for its status ([`last_lines`]).
pub const TAIL_LINES: usize = 30;

/// Bytes of a failing step's output kept for its status ([`last_lines`]).
pub const TAIL_BYTES: usize = 4 << 10;

/// `input` without invalid UTF-8 (nor the U+FFFD a lossy decoding put in its place), ANSI/VT escape sequences (CSI, OSC, DCS and two-byte escapes,
/// also in their 8-bit C1 forms), control characters other than `\n` and `\t` (NUL, `\r`, BEL,
/// DEL, …) and bidirectional-override characters (which can make text read differently than it
/// is), with trailing whitespace removed; at most `max_bytes` long: longer text keeps its start
/// and ends in [`CUT`]. Idempotent.
pub fn clean(input: &[u8], max_bytes: usize) -> String {
    let text = strip(input);
    let text = text.trim_end();
    if text.len() <= max_bytes {
        return text.to_string();
    }
    let mut end = max_bytes.saturating_sub(CUT.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let kept = text[..end].trim_end();
    if kept.len() + CUT.len() > max_bytes {
        // Too small a bound for even the marker.
        return String::new();
    }
    format!("{kept}{CUT}")
}

/// [`clean`] of a `&str` (tart's errors are already lossy UTF-8 strings).
pub fn clean_str(input: &str, max_bytes: usize) -> String {
    clean(input.as_bytes(), max_bytes)
}

/// The end of `input`, cleaned as by [`clean`]: at most its last `max_lines` lines and
/// `max_bytes` bytes. Text that was cut starts with a line holding only [`CUT`] (or, when not even
/// the last line fits, with [`CUT`] followed by that line's end). For the output of a failing
/// step: its end says why. Idempotent.
pub fn last_lines(input: &[u8], max_lines: usize, max_bytes: usize) -> String {
    if max_lines == 0 || max_bytes < CUT.len() {
        return String::new();
    }
    let text = strip(input);
    let lines: Vec<&str> = text.trim_end().split('\n').collect();
    // From the end, while both bounds hold with room left for the marker line ("…\n") if any
    // line stays behind.
    let mut kept = 0;
    let mut bytes = 0;
    for (i, line) in lines.iter().rev().enumerate() {
        let add = line.len() + usize::from(kept > 0);
        let marker = if i + 1 == lines.len() {
            (0, 0)
        } else {
            (1, CUT.len() + 1)
        };
        if kept + 1 + marker.0 > max_lines || bytes + add + marker.1 > max_bytes {
            break;
        }
        kept += 1;
        bytes += add;
    }
    let tail = lines[lines.len() - kept..].join("\n");
    if kept == lines.len() {
        return tail;
    }
    if kept > 0 {
        return format!("{CUT}\n{tail}");
    }
    // Not even the last line fits: the end of it.
    let last = lines[lines.len() - 1];
    let mut start = last.len() - (max_bytes - CUT.len()).min(last.len());
    while !last.is_char_boundary(start) {
        start += 1;
    }
    format!("{CUT}{}", &last[start..])
}

/// Removes invalid UTF-8, escape sequences and unwanted control characters.
fn strip(input: &[u8]) -> String {
    Cleaner::new().push(input)
}

/// Where [`Cleaner`] is within an escape sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Escape {
    /// Not in one.
    #[default]
    None,
    /// After ESC.
    Esc,
    /// In a CSI sequence: up to a final character in `@`..`~`.
    Csi,
    /// In an nF escape: up to a final character in `0`..`~`.
    Nf,
    /// In an OSC, DCS, SOS, PM or APC string: up to BEL, ST (`ESC \`) or C1 ST.
    Str,
    /// In such a string, after ESC.
    StrEsc,
}

/// The cleaning of [`clean`] (without its trimming and bound) for a stream that comes in pieces:
/// an escape sequence or a UTF-8 character split across pieces is cleaned as if it came whole.
/// Memory is bounded whatever the input (at most 3 bytes of an unfinished character are held).
/// `kubectl tartan logs` cleans build output with it; [`clean`] and [`last_lines`] use it too, so
/// there is one definition of clean text.
#[derive(Clone, Debug, Default)]
pub struct Cleaner {
    /// The start of a UTF-8 character whose end has not come yet.
    partial: Vec<u8>,
    escape: Escape,
}

impl Cleaner {
    pub fn new() -> Cleaner {
        Cleaner::default()
    }

    /// Cleans the next piece of the stream; returns what of it is clean text so far.
    pub fn push(&mut self, input: &[u8]) -> String {
        let mut out = String::with_capacity(input.len());
        if self.partial.is_empty() {
            self.decode(input, &mut out);
        } else {
            let mut joined = std::mem::take(&mut self.partial);
            joined.extend_from_slice(input);
            self.decode(&joined, &mut out);
        }
        out
    }

    /// Starts over, as for a new stream: an unfinished character is dropped, an unfinished escape
    /// sequence ends (it swallowed what followed it in its stream).
    pub fn reset(&mut self) {
        self.partial.clear();
        self.escape = Escape::None;
    }

    /// Decodes `bytes` (dropping invalid sequences, holding an unfinished one at the end) and
    /// feeds the characters.
    fn decode(&mut self, mut bytes: &[u8], out: &mut String) {
        loop {
            match std::str::from_utf8(bytes) {
                Ok(text) => {
                    self.feed(text, out);
                    return;
                }
                Err(e) => {
                    let (valid, rest) = bytes.split_at(e.valid_up_to());
                    self.feed(std::str::from_utf8(valid).expect("valid up to here"), out);
                    match e.error_len() {
                        Some(n) => bytes = &rest[n..],
                        None => {
                            self.partial = rest.to_vec();
                            return;
                        }
                    }
                }
            }
        }
    }

    fn feed(&mut self, text: &str, out: &mut String) {
        for c in text.chars() {
            self.escape = match self.escape {
                Escape::None => match c {
                    '\u{1b}' => Escape::Esc,
                    '\u{9b}' => Escape::Csi,
                    '\u{9d}' | '\u{90}' | '\u{98}' | '\u{9e}' | '\u{9f}' => Escape::Str,
                    '\n' | '\t' => {
                        out.push(c);
                        Escape::None
                    }
                    c if c.is_control() => Escape::None,
                    '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' => Escape::None,
                    // What a lossy UTF-8 decoding (tart's output) put where invalid bytes were.
                    '\u{fffd}' => Escape::None,
                    c => {
                        out.push(c);
                        Escape::None
                    }
                },
                Escape::Esc => match c {
                    '[' => Escape::Csi,
                    ']' | 'P' | 'X' | '^' | '_' => Escape::Str,
                    ' '..='/' => Escape::Nf,
                    // A two-byte escape (ESC and one more character).
                    _ => Escape::None,
                },
                Escape::Csi if ('@'..='~').contains(&c) => Escape::None,
                Escape::Csi => Escape::Csi,
                Escape::Nf if ('0'..='~').contains(&c) => Escape::None,
                Escape::Nf => Escape::Nf,
                Escape::Str | Escape::StrEsc if c == '\u{7}' || c == '\u{9c}' => Escape::None,
                Escape::StrEsc if c == '\\' => Escape::None,
                Escape::Str | Escape::StrEsc if c == '\u{1b}' => Escape::StrEsc,
                Escape::Str | Escape::StrEsc => Escape::Str,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escapes_controls_and_invalid_utf8_are_removed() {
        let raw = b"\x1b[1;31merror:\x1b[0m build \x00failed\r\n\x1b]0;title\x07\tdone\xff\xfe\x1b(B\x7f\xc2\x9b2Kok\xe2\x80\xae!";
        assert_eq!(clean(raw, 1000), "error: build failed\n\tdoneok!");
        assert_eq!(clean(b"a\x1bPdcs\x1b\\b\x1b_apc\x07c", 100), "abc");
        // An unterminated sequence swallows the rest (it would have on a terminal too).
        assert_eq!(clean(b"ok\x1b[31", 100), "ok");
        assert_eq!(clean(String::from_utf8_lossy(b"a\xffb").as_bytes(), 100), "ab");
        assert_eq!(clean(b"  trailing  \n\n", 100), "  trailing");
    }

    #[test]
    fn clean_keeps_the_start_within_the_bound() {
        assert_eq!(clean(b"abcdefghij", 10), "abcdefghij");
        assert_eq!(clean(b"abcdefghijk", 10), "abcdefg…");
        assert_eq!(clean("ééééé".as_bytes(), 8), "éé…");
        assert_eq!(clean(b"abcdef", 2), "");
    }

    #[test]
    fn last_lines_keeps_the_end_in_whole_lines() {
        let out: String = (1..=100).map(|i| format!("line {i}\n")).collect();
        let tail = last_lines(out.as_bytes(), 30, 4096);
        let lines: Vec<&str> = tail.lines().collect();
        assert_eq!(lines.len(), 30);
        assert_eq!(lines[0], CUT);
        assert_eq!(lines[1], "line 72");
        assert_eq!(lines[29], "line 100");
        // The byte bound wins over the line bound.
        assert_eq!(last_lines(out.as_bytes(), 30, 20), "…\nline 99\nline 100");
        // One overlong last line: its end.
        assert_eq!(last_lines(b"first\nxxxxxxxxxxyz", 5, 6), "…xyz");
        assert_eq!(last_lines(b"a\nb\n", 30, 100), "a\nb");
        assert_eq!(last_lines(b"a\nb", 0, 100), "");
        assert_eq!(last_lines(b"", 3, 100), "");
    }

    /// What a build can print to reach the terminal of whoever reads its logs.
    const HOSTILE: &[(&[u8], &str)] = &[
        (b"a\x1b]52;c;cHduZWQ=\x07b", "OSC 52 clipboard write, BEL"),
        (b"a\x1b]52;c;cHduZWQ=\x1b\\b", "OSC 52 clipboard write, ST"),
        (b"a\x1b]0;owned title\x07b", "window title"),
        (b"a\x1b]2;title\x1b\\b", "window title, ST"),
        (b"a\x1b]8;;http://evil/\x1b\\b", "hyperlink"),
        (b"a\x1bP1$qm\x1b\\b", "DCS (DECRQSS)"),
        (b"a\x1b_apc payload\x1b\\b", "APC"),
        (b"a\x1b^pm payload\x07b", "PM"),
        (b"a\x1bXsos payload\x1b\\b", "SOS"),
        (b"a\x1b[2J\x1b[3J\x1b[Hb", "clear screen and scrollback"),
        (b"a\x1b[6nb", "cursor report request"),
        (b"a\x1bcb", "full reset (RIS)"),
        (b"a\x1b(0b", "charset switch (nF)"),
        ("a\u{9b}2Jb".as_bytes(), "C1 CSI (UTF-8)"),
        ("a\u{9d}0;t\u{9c}b".as_bytes(), "C1 OSC with C1 ST"),
        ("a\u{90}dcs\u{9c}b".as_bytes(), "C1 DCS"),
        // Invalid UTF-8, dropped: what follows is plain text (`2J`, `0;t` below).
        (b"a\x9b\x9d\x90\x07b", "raw 8-bit C1 bytes (invalid UTF-8)"),
        (b"a\rb", "carriage return"),
        (b"a\x08\x7fb", "backspace, DEL"),
        ("a\u{202e}b".as_bytes(), "bidi override"),
        (b"a\x1b]52;c;\x1b\x1b\\b", "ESC ESC \\ inside a string"),
    ];

    #[test]
    fn every_hostile_sequence_is_removed_whole_or_split_anywhere() {
        for (raw, what) in HOSTILE {
            let whole = clean(raw, 1000);
            assert_eq!(whole, "ab", "{what}");
            // Split at every byte, and byte by byte: the same text.
            for cut in 0..=raw.len() {
                let mut c = Cleaner::new();
                let text = c.push(&raw[..cut]) + &c.push(&raw[cut..]);
                assert_eq!(text, "ab", "{what}, cut at {cut}");
            }
            let mut c = Cleaner::new();
            let text: String = raw.iter().map(|b| c.push(std::slice::from_ref(b))).collect();
            assert_eq!(text, "ab", "{what}, byte by byte");
        }
        // A character split across pieces comes through once; a reset drops what is unfinished.
        let mut c = Cleaner::new();
        assert_eq!(c.push(b"caf\xc3"), "caf");
        assert_eq!(c.push(b"\xa9!"), "é!");
        assert_eq!(c.push(b"x\x1b]0;"), "x");
        c.reset();
        assert_eq!(c.push(b"after"), "after");
    }

    fn noisy() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..8),
            Just(b"\x1b[31m".to_vec()),
            Just(b"\x1b]0;t\x07".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b"\x00".to_vec()),
            Just("é€😀".as_bytes().to_vec()),
            Just(b"line of text ".to_vec()),
        ];
        proptest::collection::vec(piece, 0..60).prop_map(|v| v.concat())
    }

    fn is_clean(s: &str) -> bool {
        s.chars().all(|c| c == '\n' || c == '\t' || !c.is_control()) && !s.contains('\u{202e}')
    }

    proptest! {
        #[test]
        fn clean_is_clean_bounded_and_idempotent(input in noisy(), max in 0usize..300) {
            let once = clean(&input, max);
            prop_assert!(once.len() <= max);
            prop_assert!(is_clean(&once), "{:?}", once);
            prop_assert_eq!(clean(once.as_bytes(), max), once.clone());
        }

        #[test]
        fn last_lines_is_clean_bounded_and_idempotent(input in noisy(), lines in 0usize..8, max in 0usize..300) {
            let once = last_lines(&input, lines, max);
            prop_assert!(once.len() <= max);
            prop_assert!(once.is_empty() || once.split('\n').count() <= lines, "{:?}", once);
            prop_assert!(is_clean(&once), "{:?}", once);
            prop_assert_eq!(last_lines(once.as_bytes(), lines, max), once.clone());
        }

        #[test]
        fn cleaning_in_pieces_is_cleaning_whole(input in noisy(), cuts in proptest::collection::vec(0usize..400, 0..6)) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(input.len())).collect();
            cuts.sort();
            let mut c = Cleaner::new();
            let mut pieces = String::new();
            let mut from = 0;
            for cut in cuts.into_iter().chain([input.len()]) {
                pieces.push_str(&c.push(&input[from..cut]));
                from = cut;
            }
            prop_assert_eq!(pieces, strip(&input));
        }

        #[test]
        fn clean_text_passes_unchanged(text in "[a-zA-Z0-9 .,:;!?/\t\n-]{0,200}") {
            let want = text.trim_end();
            prop_assert_eq!(clean(text.as_bytes(), 1000), want);
            let lines = want.split('\n').count();
            prop_assert_eq!(last_lines(text.as_bytes(), lines, 1000), want);
        }
    }
}
