//! Adversary round 5: Secret masking (`host::env::Masker`) and how the step follower uses it
//! (`host::guest_job::take`). Each test names the promise it checks. A failing test is a
//! finding; tests marked HELD checked something that held and stay as regression guards.
//!
//! The promise: a Secret value (at least 4 bytes; each line of a multi-line value too) never
//! appears in clear in what the agent writes (host log, status, cluster), and masking stays
//! bounded in time and memory whatever the values and the guest output are.

use std::sync::mpsc;
use std::time::Duration;

use tartan_agent::host::env::{MASK, MIN_MASKED_LEN, Masker};

// ------------------------------------------------------------------------------------------------
// Helpers: a PRNG, a brute-force reference, streaming.

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// The byte strings a masker of `secrets` must mask, derived independently of the product:
/// each secret, each line of a multi-line one (`\r` before `\n` stripped), the whole value joined
/// with `\n` and with `\r\n` (and so without its final line ends, if any); those of at least
/// MIN_MASKED_LEN bytes; and the lossy UTF-8 form
/// of each that is not UTF-8.
fn reference_values(secrets: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut set = std::collections::BTreeSet::new();
    for v in secrets {
        set.insert(v.clone());
        if v.contains(&b'\n') {
            let lines: Vec<Vec<u8>> = v
                .split(|&b| b == b'\n')
                .map(|l| l.strip_suffix(b"\r").unwrap_or(l).to_vec())
                .collect();
            set.extend(lines.iter().cloned());
            set.insert(lines.join(&b"\n"[..]));
            set.insert(lines.join(&b"\r\n"[..]));
            let kept = lines.len() - lines.iter().rev().take_while(|l| l.is_empty()).count();
            set.insert(lines[..kept].join(&b"\n"[..]));
            set.insert(lines[..kept].join(&b"\r\n"[..]));
        }
    }
    let raw: Vec<Vec<u8>> = set.into_iter().filter(|v| v.len() >= MIN_MASKED_LEN).collect();
    let mut all = raw.clone();
    for v in &raw {
        if std::str::from_utf8(v).is_err() {
            // The whole value, and without its leading continuation bytes (at most 3) and its
            // trailing incomplete sequence: a lead byte before it, or continuation bytes after
            // it, decode together with those in lossy text.
            let lead = v.iter().take(3).take_while(|&&b| (0x80..0xC0).contains(&b)).count();
            let mut trail = 0;
            for k in 1..=3.min(v.len()) {
                let b = v[v.len() - k];
                if (0x80..0xC0).contains(&b) {
                    continue;
                }
                let need = match b {
                    0xC0..=0xDF => 2,
                    0xE0..=0xEF => 3,
                    0xF0..=0xF7 => 4,
                    _ => 0,
                };
                if need > k {
                    trail = k;
                }
                break;
            }
            for (a, b) in [
                (0, v.len()),
                (lead, v.len()),
                (0, v.len() - trail),
                (lead, v.len() - trail),
            ] {
                if b > a && b - a >= MIN_MASKED_LEN {
                    all.push(String::from_utf8_lossy(&v[a..b]).into_owned().into_bytes());
                }
            }
        }
    }
    all.sort();
    all.dedup();
    all
}

/// Runs of overlapping occurrences (sharing at least one byte) of `values` in `text`, as
/// (start, end), considering only occurrences that start before `limit`.
fn reference_runs(values: &[Vec<u8>], text: &[u8], limit: usize) -> Vec<(usize, usize)> {
    let mut occ: Vec<(usize, usize)> = Vec::new();
    for v in values {
        if v.len() > text.len() {
            continue;
        }
        for i in 0..=text.len() - v.len() {
            if i < limit && &text[i..i + v.len()] == v.as_slice() {
                occ.push((i, i + v.len()));
            }
        }
    }
    occ.sort();
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (s, e) in occ {
        match runs.last_mut() {
            Some(last) if s < last.1 => last.1 = last.1.max(e),
            _ => runs.push((s, e)),
        }
    }
    runs
}

/// `text[skip..limit]` with every run shown as one `***` (a run reaching into the window from
/// before `skip`, or past `limit`, still shows as `***`).
fn reference_mask(values: &[Vec<u8>], text: &[u8], skip: usize, limit: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = skip;
    for (s, e) in reference_runs(values, text, limit) {
        if e <= skip {
            continue;
        }
        if s > at {
            out.extend_from_slice(&text[at..s]);
        }
        out.extend_from_slice(MASK);
        at = e;
    }
    if at < limit {
        out.extend_from_slice(&text[at..limit]);
    }
    out
}

/// Masks `output` as a step follower does: pieces cut at `cuts`, the held-back rest passed again
/// with the next piece, then the rest with `last`.
fn stream(mask: &Masker, output: &[u8], cuts: &[usize]) -> Vec<u8> {
    let (mut out, mut pending) = (Vec::new(), Vec::new());
    let mut from = 0;
    for &cut in cuts.iter().chain([output.len()].iter()) {
        pending.extend_from_slice(&output[from..cut]);
        from = cut;
        let (masked, used) = mask.mask(&pending, false);
        assert!(used <= pending.len());
        out.extend(masked);
        pending.drain(..used);
    }
    out.extend(mask.mask(&pending, true).0);
    out
}

/// Runs `f` on a thread of its own; `None` if it takes longer than `bound`.
fn within<T: Send + 'static>(bound: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(bound).ok()
}

fn random_bytes(rng: &mut Rng, alphabet: &[u8], len: usize) -> Vec<u8> {
    (0..len).map(|_| *rng.pick(alphabet)).collect()
}

// ------------------------------------------------------------------------------------------------
// Differential tests against the brute-force reference.

/// HELD: random values over small alphabets (overlapping, nested, prefixes and suffixes of each
/// other, multi-line with `\n` / `\r\n`, non-UTF-8 bytes and their lossy forms), random output
/// streamed in random pieces: the streamed result equals the reference (every occurrence masked,
/// overlapping ones merged into one `***`, adjacent ones each `***`).
#[test]
fn streamed_masking_matches_a_brute_force_reference() {
    let alphabets: [&[u8]; 5] = [b"ab", b"abc", b"ab\n", b"a\r\n", b"a\xff\xef\xbf\xbd"];
    let mut rng = Rng(0x5eed_0005);
    let mut checked = 0;
    for round in 0..6000 {
        let alphabet = alphabets[round % alphabets.len()];
        let nvalues = 1 + rng.below(4);
        let secrets: Vec<Vec<u8>> = (0..nvalues)
            .map(|_| {
                let len = 1 + rng.below(9);
                let mut v = random_bytes(&mut rng, alphabet, len);
                // No NUL in values (env values cannot hold one); the alphabets have none.
                v.retain(|&b| b != 0);
                v
            })
            .filter(|v| !v.is_empty())
            .collect();
        let mask = Masker::new(secrets.iter().map(Vec::as_slice));
        let values = reference_values(&secrets);
        // Output built from the values and random filler so that occurrences are frequent.
        let mut output = Vec::new();
        while output.len() < 40 {
            if !values.is_empty() && rng.below(2) == 0 {
                let v = rng.pick(&values).clone();
                let cut = rng.below(v.len() + 1);
                output.extend_from_slice(if rng.below(4) == 0 { &v[..cut] } else { &v });
            } else {
                let len = rng.below(4);
                output.extend(random_bytes(&mut rng, alphabet, len));
            }
        }
        let want = reference_mask(&values, &output, 0, output.len());
        // One piece.
        assert_eq!(
            mask.mask(&output, true).0,
            want,
            "one piece: secrets {secrets:?} output {output:?}"
        );
        // Random pieces, and every single cut.
        let mut cuts: Vec<usize> = (0..rng.below(8)).map(|_| rng.below(output.len() + 1)).collect();
        cuts.sort();
        assert_eq!(
            stream(&mask, &output, &cuts),
            want,
            "cuts {cuts:?}: secrets {secrets:?} output {output:?}"
        );
        for cut in 0..=output.len() {
            assert_eq!(
                stream(&mask, &output, &[cut]),
                want,
                "cut {cut}: secrets {secrets:?} output {output:?}"
            );
        }
        // Byte by byte.
        let all: Vec<usize> = (1..output.len()).collect();
        assert_eq!(
            stream(&mask, &output, &all),
            want,
            "byte by byte: {secrets:?} {output:?}"
        );
        // Windows and limits.
        for skip in 0..=output.len() {
            assert_eq!(
                mask.mask_window(&output, skip),
                reference_mask(&values, &output, skip, output.len()),
                "window from {skip}: secrets {secrets:?} output {output:?}"
            );
        }
        for limit in 0..=output.len() {
            let (got, used) = mask.mask_until(&output, limit, true);
            assert_eq!(
                got,
                reference_mask(&values, &output, 0, limit),
                "until {limit}: secrets {secrets:?} output {output:?}"
            );
            assert!(used >= limit, "until {limit}: decided only {used}");
        }
        checked += 1;
    }
    assert_eq!(checked, 6000);
}

// ------------------------------------------------------------------------------------------------
// The step follower (`guest_job::take`), as `follow` drives it.

/// Follows a job whose whole output `output` was written before the first poll, as `follow`
/// does (each poll asks `poll_bytes` from the offset; `full` when it brought all it asked for;
/// `complete` when it reaches the end). Returns the host log.
fn follow_log(output: &[u8], cfg: &tartan_agent::host::guest_job::FollowConfig) -> Vec<u8> {
    use tartan_agent::host::guest_job::{poll_bytes, take};
    let size = output.len() as u64;
    let (mut log, mut offset) = (Vec::new(), 0u64);
    for _ in 0..10_000 {
        let max = poll_bytes(offset, cfg);
        let end = (offset + max).min(size);
        let bytes = &output[offset as usize..end as usize];
        let complete = end >= size;
        let full = bytes.len() as u64 == max;
        let t = take(offset, bytes, size, complete, full, cfg.log_cap, &cfg.mask);
        log.extend_from_slice(&t.bytes);
        if t.note {
            log.extend_from_slice(tartan_tart::log_cap_note(cfg.log_cap).as_bytes());
        }
        offset = t.next;
        if complete {
            return log;
        }
    }
    panic!("the follower made no progress at {offset}");
}

/// FINDING (leak into the host step log). `take` decides a full read "as if the output ended
/// there" when a run of overlapping occurrences covers the whole read (`used == 0`). The doc says
/// what then shows is "at most the start of one value per read"; but another, long value that
/// *begins inside the run's last occurrence* and reaches past the read's end is then cut: the part
/// of it after the run is logged in clear at the end of this read, and the rest is logged in clear
/// at the start of the next (no value starts there any more). Here two Secrets `xyxy` and
/// `y-deploy-token-…`: a step prints `xy` for a little over a MiB (one read) and then the token's
/// tail; nearly all of the token (everything but its first byte) reaches the host log.
#[test]
fn a_value_starting_inside_a_run_longer_than_a_read_is_not_logged_in_clear() {
    use tartan_agent::host::guest_job::{FollowConfig, poll_bytes};
    let token = b"y-deploy-token-0123456789abcdef".to_vec();
    let mask = Masker::new([&b"xyxy"[..], token.as_slice()]);
    let cfg = FollowConfig {
        mask,
        ..FollowConfig::default()
    };
    // The first read's length (1 MiB and two values' length): the token's `y` is the last byte
    // of the run's last `xyxy`, 11 bytes before the read's end.
    let read = poll_bytes(0, &cfg) as usize;
    let y_at = read - 11;
    assert_eq!(y_at % 2, 1, "the `y` of an `xy` pair");
    let mut output = b"xy".repeat(y_at.div_ceil(2));
    assert_eq!(output.len(), y_at + 1);
    output.extend_from_slice(&token[1..]);
    output.extend_from_slice(b"\ndone\n");
    // As one piece it is masked: the run and the token overlap, one `***`.
    assert_eq!(cfg.mask.mask(&output, true).0, b"***\ndone\n");
    let log = follow_log(&output, &cfg);
    let tail = String::from_utf8_lossy(&log[log.len().saturating_sub(64)..]).into_owned();
    assert!(
        !tail.contains("deploy-token-0123456789abcdef"),
        "the Secret's value (all but its first byte) is in the host log: …{tail:?}"
    );
}

/// FINDING (bounded time and memory). `ResolvedEnv::adopt_previous` takes the values of the
/// guest's earlier env file, which any step can rewrite (it is the step user's own file in the
/// guest) in the agent's format, up to PREVIOUS_MAX_BYTES (17 MiB); it is adopted after an agent
/// restart. `parse_env_file` does not refuse NUL bytes, yet the automaton relies on values never
/// holding NUL (it ends each value with one so that its match lists stay linear: "were a value
/// to hold it … the automaton's size bound would not hold"). Values of NULs (`\0`×4 … `\0`×m, one
/// of `\0`×n) make every deep state list every short value: n·m matches, built on the async
/// runtime's thread. Measured (debug): n=64 KiB, m=64: 7.6 s (the same file with `a` instead of
/// NUL: 0.07 s); n=128 KiB, m=128: 27.6 s, 270 MB. The 17 MiB budget allows n=8 MiB, m=256:
/// ~2^31 matches, 16 GB in the crate's builder, then a panic (state/match id overflow) or OOM.
#[test]
fn a_forged_earlier_env_file_with_nul_bytes_is_adopted_in_bounded_time() {
    use tartan_agent::host::env::{ResolvedEnv, render_env_file};
    let forged = |byte: u8| {
        let mut vars: Vec<(String, Vec<u8>)> = (4..=128).map(|j| ("TOKEN".to_string(), vec![byte; j])).collect();
        vars.push(("TOKEN".into(), vec![byte; 128 << 10]));
        render_env_file(&vars)
    };
    let adopt = |file: Vec<u8>| {
        within(Duration::from_secs(10), move || {
            let mut env = ResolvedEnv {
                vars: vec![("TOKEN".into(), b"current-token".to_vec())],
                masker: Masker::new([&b"current-token"[..]]),
                secret_names: ["TOKEN".to_string()].into_iter().collect(),
            };
            env.adopt_previous(&file)
        })
    };
    // HELD: the same shape without NUL (values of `a`) is adopted at once.
    assert!(adopt(forged(b'a')).is_some(), "values of `a` took over 10 s");
    // Either refused (NUL is no env value) or adopted quickly; not minutes of the runtime thread.
    assert!(
        adopt(forged(0)).is_some(),
        "a 129 KiB forged env file of NUL values took over 10 s to adopt (quadratic)"
    );
}

/// Follows a job that writes `grow` more bytes of `output` before each poll and exits once all is
/// written, as `follow` does, under chunk `chunk` and cap `cap`. Returns the host log.
fn follow_growing(output: &[u8], grow: usize, chunk: u64, cap: u64, mask: &Masker) -> Vec<u8> {
    use tartan_agent::host::guest_job::{FollowConfig, poll_bytes, take};
    let cfg = FollowConfig {
        chunk_bytes: chunk,
        log_cap: cap,
        mask: mask.clone(),
        ..FollowConfig::default()
    };
    let (mut log, mut offset, mut written) = (Vec::new(), 0u64, 0usize);
    for _ in 0..100_000 {
        written = (written + grow).min(output.len());
        let exited = written == output.len();
        let size = written as u64;
        let max = poll_bytes(offset, &cfg);
        let end = (offset + max).min(size).max(offset);
        let bytes = &output[offset.min(size) as usize..end as usize];
        let seen = offset + bytes.len() as u64;
        let complete = exited && seen >= size;
        let full = bytes.len() as u64 == max;
        let t = take(offset, bytes, size, complete, full, cap, mask);
        log.extend_from_slice(&t.bytes);
        if t.note {
            log.extend_from_slice(tartan_tart::log_cap_note(cap).as_bytes());
        }
        offset = t.next;
        if complete {
            return log;
        }
    }
    panic!("no progress at {offset} of {}", output.len());
}

/// HELD: random values and output, followed with random chunk sizes, caps and write rates: the
/// host log is the output masked as one piece (cut at the cap, a value straddling the cap shown as
/// `***`, then the note), whenever no run of overlapping values is longer than a read (the one
/// shape `take` decides early by design, see the finding above).
#[test]
fn followed_logs_match_the_reference_under_random_chunks_caps_and_rates() {
    let alphabets: [&[u8]; 3] = [b"ab", b"abc\n", b"a\r\n\xff"];
    let mut rng = Rng(0xadd5_0001);
    let mut compared = 0;
    for round in 0..3000 {
        let alphabet = alphabets[round % alphabets.len()];
        let secrets: Vec<Vec<u8>> = (0..1 + rng.below(3))
            .map(|_| {
                let len = 1 + rng.below(8);
                random_bytes(&mut rng, alphabet, len)
            })
            .collect();
        let mask = Masker::new(secrets.iter().map(Vec::as_slice));
        let values = reference_values(&secrets);
        let mut output = Vec::new();
        while output.len() < 30 + rng.below(30) {
            if !values.is_empty() && rng.below(2) == 0 {
                let v = rng.pick(values.as_slice()).clone();
                output.extend_from_slice(&v);
            } else {
                let len = rng.below(5);
                output.extend(random_bytes(&mut rng, alphabet, len));
            }
        }
        let chunk = 1 + rng.below(12) as u64;
        let cap = 1 + rng.below(output.len() + 8) as u64;
        let grow = *rng.pick(&[1usize, 3, 7, 1 << 20]);
        let read = chunk as usize + 2 * mask.max_len();
        if reference_runs(&values, &output, output.len())
            .iter()
            .any(|&(s, e)| e - s + mask.max_len() >= read)
        {
            continue;
        }
        let log = follow_growing(&output, grow, chunk, cap, &mask);
        let want = if output.len() as u64 <= cap {
            reference_mask(&values, &output, 0, output.len())
        } else {
            let mut w = reference_mask(&values, &output, 0, cap as usize);
            w.extend_from_slice(tartan_tart::log_cap_note(cap).as_bytes());
            w
        };
        assert_eq!(
            log, want,
            "secrets {secrets:?} output {output:?} chunk {chunk} cap {cap} grow {grow}"
        );
        compared += 1;
    }
    assert!(compared > 1000, "{compared}");
}

// ------------------------------------------------------------------------------------------------
// Text made lossy before masking (status messages).

/// FINDING (leak into a status message, low). Where guest output reaches a status as lossy UTF-8
/// *before* masking (`guest_read_failed` masks `tart exec`'s tail, which tart made with
/// `from_utf8_lossy`), a non-UTF-8 value is looked for in its lossy form as made from the value
/// alone. A value that starts with continuation bytes (`\x9f\x98`, as a random binary key may)
/// decodes alone to two U+FFFD; printed right after a lead byte (`\xf0`), the three bytes decode
/// as one maximal invalid sequence, one U+FFFD: neither the raw value nor its lossy form is in the
/// text, and every other byte of the value is quoted in the build's status.
#[test]
fn a_non_utf8_value_after_a_lead_byte_is_masked_in_lossy_text() {
    use tartan_agent::host::executor::guest_read_failed;
    let value = b"\x9f\x98deploy-token-0123456789";
    let mask = Masker::new([&value[..]]);
    // The raw output: the file's bytes, then `cat`'s complaint quoting them.
    let raw = [&b"<x/>\ncat: \xf0"[..], value, b": Input/output error\n"].concat();
    let tail = String::from_utf8_lossy(&raw).into_owned();
    // HELD: masked in raw output (the step log's path), whatever precedes it.
    assert!(!String::from_utf8_lossy(&mask.mask(&raw, true).0).contains("deploy-token"));
    let said = guest_read_failed("out/junit.xml", 1, &tail, &mask);
    assert!(!said.contains("deploy-token-0123456789"), "{said:?}");
}

// ------------------------------------------------------------------------------------------------
// The artifact scan (`find_in`).

/// FINDING (leak into a published artifact, medium). `find_in` looks for whole values only (by
/// design: a public line of a Secret must not refuse every artifact). A Secret made from a file
/// (`kubectl create secret generic --from-file`) ends with a newline; the shell drops trailing
/// newlines in `$(…)` and a tool writing the value into a JSON string or at the end of a file
/// omits it. The whole key, less its final `\n`, is then in the artifact and not found: the
/// artifact is published with every line of the key (each of which the log masks).
#[test]
fn an_artifact_holding_a_file_secret_without_its_final_newline_is_refused() {
    let key = b"-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\nBKcwggSjAgEAAoIBAQC7secretbody\n-----END PRIVATE KEY-----\n";
    let mask = Masker::new([&key[..]]);
    // HELD: the value as given is found.
    let as_given = [&b"{\"key\": \""[..], key, b"\"}"].concat();
    assert_eq!(mask.find_in(&as_given[..], 1 << 20).unwrap(), Some(9));
    // HELD: each line is masked in the log.
    assert!(!String::from_utf8_lossy(&mask.mask(&key[..key.len() - 1], true).0).contains("secretbody"));
    let trimmed = [&b"config: "[..], &key[..key.len() - 1]].concat();
    assert_eq!(
        mask.find_in(&trimmed[..], 1 << 20).unwrap(),
        Some(8),
        "an artifact holding the whole key but its final newline is published"
    );
}

// ------------------------------------------------------------------------------------------------
// Guest-controlled text outside the step's output.

/// FINDING (leak into the agent's log, and escaped past masking into the status). The poll
/// script prints `tartan-job exited $(cat "$d/exit")`: the exit file of the step's own job folder
/// (`.tartan/<vm>/NN-<step>/exit`, the step user's file, writable by the step before the
/// wrapper writes it). A step that writes its Secret there makes the header unparsable;
/// `parse_poll` quotes the header (Debug-escaped) in its error, which becomes
/// `JobError::Protocol`, which `executor::steps` logs with `tracing::warn!(error = %e)` *unmasked*
/// and puts into the status through `status_text` (masked, but a value holding `"` or `\` is
/// escaped first, so the mask no longer matches it).
#[test]
fn a_value_in_the_job_folders_exit_file_never_reaches_a_message_in_clear() {
    use tartan_agent::host::executor::status_text;
    use tartan_agent::host::guest_job::{JobError, parse_poll, poll_argv, poll_error};
    let secret = "s3cr3t\"deploy-token-0123";
    let mask = Masker::new([secret.as_bytes()]);
    let home = tempfile::tempdir().unwrap();
    let dir = ".tartan/vm/00-build";
    std::fs::create_dir_all(home.path().join(dir)).unwrap();
    std::fs::write(home.path().join(dir).join("out.log"), b"building\n").unwrap();
    // What the step wrote (printf '%s' "$TOKEN" > "$d/exit").
    std::fs::write(home.path().join(dir).join("exit"), secret).unwrap();
    let argv = poll_argv(dir, 0, 1 << 20);
    let out = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .current_dir(home.path())
        .output()
        .unwrap();
    assert!(parse_poll(&out.stdout, 0, 1 << 20).is_err());
    // What the follower makes of it (follow.rs: `poll`).
    let detail = poll_error(&out.stdout, 0, 1 << 20, &mask);
    let e = JobError::Protocol {
        vm: "vm".into(),
        step: "build".into(),
        dir: dir.into(),
        what: "poll",
        detail,
    };
    let logged = e.to_string();
    let status = status_text(&mask, &logged);
    let escaped = format!("{secret:?}");
    let escaped = escaped.trim_matches('"');
    let mut leaks = Vec::new();
    if logged.contains(secret) || logged.contains(escaped) {
        leaks.push(format!("agent log (tracing::warn error = %e, unmasked): {logged}"));
    }
    if status.contains(secret) || status.contains(escaped) {
        leaks.push(format!("status: {status}"));
    }
    assert!(leaks.is_empty(), "{leaks:#?}");
}

// ------------------------------------------------------------------------------------------------
// Memory.

/// The resident memory of this process (Linux `/proc`), in bytes.
fn resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb << 10)
}

/// FINDING (memory, medium). One Secret value of 1 MiB (a quarter of the env's 4 MiB) made of
/// `\xff\n` pairs, a shape a binary Secret may have: `Masker::new` keeps the value, its `\r\n`
/// form (1.5 MiB) and the lossy UTF-8 forms of both (2 MiB, 2.5 MiB): 7 MiB of values, each byte
/// a state of the automaton with its two tables. Measured: ~320 MB resident for the masker
/// (~400 MB peak while building), 5.3 s to build in a debug build on the async runtime's thread
/// (`resolve`); at the env's 4 MiB limit 1.1 GB resident, 1.4 GB peak, 23 s; the first artifact
/// scan builds a second automaton (+0.3 GB). The doc's bound ("values are at most twice
/// ENV_MAX_TOTAL_BYTES") does not hold (7×), and a forged earlier env file (PREVIOUS_MAX_BYTES,
/// 17 MiB, see `adopt_previous`) makes it ~6 GB. The bound here, 64 bytes of memory per byte of
/// Secret, is generous against that. Measured in a child process so other tests do not count.
#[test]
#[ignore = "open finding (medium): the lossy forms of a binary multi-line value take ~7x its size"]
fn a_masker_of_a_binary_multi_line_value_takes_memory_proportionate_to_it() {
    const CHILD: &str = "TARTAN_ADV5_MEMORY_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let value = b"\xff\n".repeat(1 << 19);
        let before = resident().unwrap();
        let mask = Masker::new([value.as_slice()]);
        let after = resident().unwrap();
        println!("\nGROWTH {}", after.saturating_sub(before));
        assert!(!mask.is_empty());
        return;
    }
    if resident().is_none() {
        return; // no /proc: nothing to measure
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_masker_of_a_binary_multi_line_value_takes_memory_proportionate_to_it",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let growth: u64 = stdout
        .lines()
        .find_map(|l| l.split("GROWTH ").nth(1))
        .and_then(|n| n.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("the child said: {stdout} {}", String::from_utf8_lossy(&out.stderr)));
    assert!(
        growth <= 64 << 20,
        "the masker of one 1 MiB Secret holds {} MiB",
        growth >> 20
    );
}

// ------------------------------------------------------------------------------------------------
// Time.

/// HELD: a wide automaton (256 Ki random 4-byte values over every byte but NUL, 1 MiB of values)
/// builds and masks 4 MiB of random output, streamed in 64 KiB pieces, within a generous bound
/// (debug build; a hang detector, not a benchmark).
#[test]
fn many_short_values_over_every_byte_mask_a_stream_in_bounded_time() {
    let done = within(Duration::from_secs(240), || {
        let mut rng = Rng(0xb17e_5005);
        let values: Vec<Vec<u8>> = (0..1 << 18)
            .map(|_| (0..4).map(|_| 1 + rng.below(255) as u8).collect())
            .collect();
        let mask = Masker::new(values.iter().map(Vec::as_slice));
        let mut output: Vec<u8> = (0..4 << 20).map(|_| rng.below(256) as u8).collect();
        output.extend_from_slice(&values[7]);
        let cuts: Vec<usize> = (1..64).map(|i| i * (64 << 10)).collect();
        let out = stream(&mask, &output, &cuts);
        out.ends_with(MASK)
    });
    assert_eq!(
        done,
        Some(true),
        "masking did not end within 240 s (or missed the last value)"
    );
}
