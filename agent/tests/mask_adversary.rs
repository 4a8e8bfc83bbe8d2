//! Found by an adversary (round 4): Secret masking where guest output reaches a status message.
//! Each test names the promise it checks; a failing one is a finding, not a flaky test.

use tartan_agent::host::env::Masker;
use tartan_agent::host::executor::{guest_read_failed, status_text};
use tartan_api::text::{TAIL_BYTES, TAIL_LINES, last_lines};

const SECRET: &str = "hunter2-deploy-token-0123";

/// What a failing step's status says, built as `guest_job::follow` (mask the raw window, then
/// lossy UTF-8) and `executor::steps` (`last_lines`, then `status_text`) build it.
fn step_failure_status(mask: &Masker, raw: &[u8]) -> String {
    let tail = String::from_utf8_lossy(&mask.mask_window(raw, 0)).into_owned();
    status_text(mask, &last_lines(tail.as_bytes(), TAIL_LINES, TAIL_BYTES))
}

/// Masking runs before cleaning, and cleaning deletes bytes (escapes, control characters, invalid
/// UTF-8, U+FFFD, bidi overrides): an occurrence of a value with such bytes inside it is not
/// masked, then cleaning joins the value back together in the status, journal and CustomRun.
/// A coloured tool (`git diff --color-words`, a highlighter) or a `\r` progress line is enough.
#[test]
fn a_value_split_by_bytes_that_cleaning_removes_never_reaches_the_status_whole() {
    let mask = Masker::new([SECRET.as_bytes()]);
    let (a, b) = SECRET.split_at(8);
    let splitters: [&[u8]; 6] = [
        b"\x1b[0m",
        b"\x1b[1;31m",
        b"\r",
        b"\x07",
        b"\xff",
        "\u{202e}".as_bytes(),
    ];
    let mut leaked = Vec::new();
    for s in splitters {
        let raw = [
            b"error: token ".as_slice(),
            a.as_bytes(),
            s,
            b.as_bytes(),
            b" rejected\n",
        ]
        .concat();
        let status = step_failure_status(&mask, &raw);
        if status.contains(SECRET) {
            leaked.push(format!("{s:?} -> {status:?}"));
        }
    }
    assert!(
        leaked.is_empty(),
        "the Secret value is whole in the status: {leaked:#?}"
    );
}

/// `guest_read_failed` trims the tail and the line before masking: a value that starts or ends
/// with whitespace (a Secret made from a file keeps its trailing space or tab) is no longer whole
/// when masked, and all of it but that whitespace is quoted.
#[test]
fn a_failed_guest_read_masks_a_value_with_edge_whitespace_before_trimming_it() {
    for value in [format!("{SECRET} "), format!("{SECRET}\t"), format!(" {SECRET}")] {
        let mask = Masker::new([value.as_bytes()]);
        let tail = format!("<x/>\nerror near {value}\n");
        let said = guest_read_failed("out/junit.xml", 1, &tail, &mask);
        assert!(!said.contains(SECRET), "value {value:?}: {said:?}");
        let tail = format!("tartan: {value}\n");
        let said = guest_read_failed("out/junit.xml", 1, &tail, &mask);
        assert!(!said.contains(SECRET), "value {value:?}, refusal form: {said:?}");
    }
}

/// Values shorter than MIN_MASKED_LEN are not masked (module doc of host::env); a 2-byte
/// non-UTF-8 value's lossy form (two U+FFFD, 6 bytes) is, so every pair of replacement
/// characters in any text is starred: the log is garbled and the stars show where the value is.
#[test]
fn a_short_non_utf8_value_is_not_masked_through_its_lossy_form() {
    let mask = Masker::new([&b"\xff\xfe"[..]]);
    assert!(mask.is_empty(), "a 2-byte value masks {mask:?}");
    let text = "decoded \u{fffd}\u{fffd} from a binary";
    assert_eq!(mask.mask_text(text), text);
}

/// `with()` rebuilds from the whole values (filtered to MIN_MASKED_LEN bytes), `new()` from the
/// given ones: the same secrets make different maskers when one is short and not UTF-8.
#[test]
fn with_nothing_more_is_the_same_masker() {
    let given: [&[u8]; 2] = [b"\xff\xfe", b"long-enough-value"];
    let built = Masker::new(given);
    assert_eq!(built.with(std::iter::empty::<&[u8]>()), built);
    assert_eq!(built.max_len(), built.with(std::iter::empty::<&[u8]>()).max_len());
}

/// A multi-line value that is not UTF-8 is masked line by line in raw output, but in text (a
/// status message quoting lossy output) only its whole lossy form is known: one line of it,
/// printed alone, is quoted in clear but for the replacement character.
#[test]
fn a_line_of_a_non_utf8_multi_line_value_is_masked_in_lossy_text() {
    let value = b"keystore-pass-\xff-line-one\nkeystore-pass-line-two";
    let mask = Masker::new([&value[..]]);
    let line_one = String::from_utf8_lossy(b"keystore-pass-\xff-line-one").into_owned();
    let said = guest_read_failed("out/a", 1, &format!("x\ncat: {line_one}\n"), &mask);
    assert!(!said.contains("line-one"), "{said:?}");
}

/// `find_in` keeps `max_len - 1` bytes across pieces: a value is found wherever it falls across
/// pieces of any size, and at the offset where it starts.
#[test]
fn find_in_finds_a_value_at_every_offset_for_every_piece_size() {
    let values: [&[u8]; 3] = [b"abcdefgh", b"zz\nyy", b"\xff\xfeQQ"];
    let mask = Masker::new(values);
    for value in values {
        for piece in 1..=12 {
            for at in 0..20 {
                let mut input = vec![b'.'; at];
                input.extend_from_slice(value);
                input.extend_from_slice(b"....");
                let found = mask.find_in(&input[..], piece).unwrap();
                assert_eq!(found, Some(at as u64), "value {value:?} piece {piece} at {at}");
            }
        }
    }
    // CRLF form of a multi-line value.
    assert_eq!(mask.find_in(&b"..zz\r\nyy"[..], 1).unwrap(), Some(2));
    assert_eq!(mask.find_in(&b"nothing here"[..], 3).unwrap(), None);
}

/// Masks `output` as a step follower does (pieces of `piece` bytes, the held-back rest passed
/// again with the next), on a thread of its own: `None` if that takes longer than `bound`.
fn mask_streamed_within(mask: &Masker, output: Vec<u8>, piece: usize, bound: std::time::Duration) -> Option<Vec<u8>> {
    let mask = mask.clone();
    let (done, result) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut out, mut pending) = (Vec::new(), Vec::new());
        for chunk in output.chunks(piece) {
            pending.extend_from_slice(chunk);
            let (masked, used) = mask.mask(&pending, false);
            out.extend(masked);
            pending.drain(..used);
        }
        out.extend(mask.mask(&pending, true).0);
        let _ = done.send(out);
    });
    result.recv_timeout(bound).ok()
}

/// Values as large as the env allows, made of one repeated byte with a line end each, and a step
/// that prints that byte: every place of the output is the start of a value that the next byte
/// may break. Deciding where to hold back by comparing each place with the values took minutes
/// per piece (quadratic in the values' length: 64 KiB of `a`s and a `b` cost 0.34 s, 1 MiB
/// would be 86 s); the automaton's tables decide it in one pass. The bound is a hang detector,
/// two orders above what a debug build takes here.
#[test]
fn values_of_one_repeated_byte_at_the_env_limit_mask_a_stream_of_it_in_bounded_time() {
    let value = |line_at: usize| {
        let mut v = vec![b'a'; 1 << 20];
        v[line_at] = b'\n';
        v
    };
    let values: Vec<Vec<u8>> = (0..4).map(|i| value((1 << 19) + i * 1000)).collect();
    let mask = Masker::new(values.iter().map(Vec::as_slice));
    let mut output = vec![b'a'; 3 << 19];
    output.extend_from_slice(b"b\nthe end\n");
    let out = mask_streamed_within(&mask, output, 64 << 10, std::time::Duration::from_secs(300))
        .expect("masking a stream of the repeated byte did not end within 300 s");
    // 1.5 MiB of `a`s holds each value's longest line (512 KiB and more) and no whole value.
    assert!(
        out.starts_with(b"***"),
        "{:?}",
        String::from_utf8_lossy(&out[..out.len().min(80)])
    );
    assert!(out.ends_with(b"b\nthe end\n"));
    assert!(out.len() < 1 << 19, "the lines were not masked: {} bytes", out.len());
}

/// Thousands of values that are each a suffix of the next (`aaaa`, `aaaaa`, …, as the lines of
/// one multi-line Secret): each byte of a stream of `a`s ends thousands of occurrences at once.
/// Listing each of them cost time in their count per byte; the longest one at each place is all
/// a run needs.
#[test]
fn thousands_of_nested_values_mask_a_stream_in_bounded_time() {
    let lines: Vec<Vec<u8>> = (4..2_500).map(|n| vec![b'a'; n]).collect();
    let bundle = lines.join(&b'\n');
    let mask = Masker::new([bundle.as_slice()]);
    let mut output = b"x ".to_vec();
    output.extend(vec![b'a'; 4 << 20]);
    output.extend_from_slice(b" y\n");
    let out = mask_streamed_within(&mask, output, 64 << 10, std::time::Duration::from_secs(300))
        .expect("masking a stream of nested values did not end within 300 s");
    assert!(
        out.starts_with(b"x ***"),
        "{:?}",
        String::from_utf8_lossy(&out[..out.len().min(80)])
    );
    assert!(out.ends_with(b" y\n"));
    assert!(!out.contains(&b'a'), "an `a` of the stream was left in clear");
}

/// The artifact scan looks for whole values: thousands of separate values of nested lengths
/// (`aaaa` to 2,400 `a`s) beside one of 1 MiB made each deep state of the long one list every
/// short one, past the automaton's 2^31 states (a panic on the agent's thread). Found at once now.
#[test]
fn an_artifact_scan_for_nested_values_and_a_long_one_finds_them() {
    let mut values: Vec<Vec<u8>> = (4..2_400).map(|n| vec![b'a'; n]).collect();
    values.push(vec![b'a'; 1 << 20]);
    let mask = Masker::new(values.iter().map(Vec::as_slice));
    let mut artifact = b"header\n".to_vec();
    artifact.extend(vec![b'a'; 2 << 20]);
    assert_eq!(mask.find_in(&artifact[..], 64 << 10).unwrap(), Some(7));
    assert_eq!(mask.find_in(&b"header\naaa\n"[..], 64 << 10).unwrap(), None);
}
