//! Masking benchmark: how fast the step follower masks Secret values in step output, for 0, 10,
//! 1000 and 3000 values (the last as a 3000-line PEM bundle whose every line is a value to mask).
//! The output is fed as the follower feeds it ([`poll_bytes`] per poll, [`take`] on each, the
//! held-back end read again with the next poll), so the chunking and the hold-back are measured
//! too. Prints MiB/s per count and checks that every planted value came out masked.
//!
//! ```sh
//! scripts/bench-mask [--mib 8] [--values 0,10,1000,3000] [--chunk 1048576]
//! ```

use std::time::Instant;
use tartan_agent::host::env::Masker;
use tartan_agent::host::guest_job::{FollowConfig, poll_bytes, take};

struct Args {
    mib: usize,
    counts: Vec<usize>,
    chunk: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        mib: 8,
        counts: vec![0, 10, 1000, 3000],
        chunk: 1 << 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--mib" => args.mib = value()?.parse().map_err(|e| format!("--mib: {e}"))?,
            "--chunk" => args.chunk = value()?.parse().map_err(|e| format!("--chunk: {e}"))?,
            "--values" => {
                args.counts = value()?
                    .split(',')
                    .map(|n| n.trim().parse().map_err(|e| format!("--values {n:?}: {e}")))
                    .collect::<Result<_, _>>()?
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?} (--mib N, --values A,B,..., --chunk BYTES)"
                ));
            }
        }
    }
    if args.chunk == 0 || args.mib == 0 {
        return Err("--mib and --chunk must be positive".into());
    }
    Ok(args)
}

/// A deterministic 64-character base64-looking line, as in a PEM bundle.
fn pem_line(seed: u64) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..64)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ALPHABET[(x % 64) as usize] as char
        })
        .collect()
}

/// One multi-line Secret of `lines` lines (a CA bundle): the masker masks it whole and each line.
fn bundle(lines: usize) -> Vec<u8> {
    (0..lines as u64)
        .map(pem_line)
        .collect::<Vec<_>>()
        .join("\n")
        .into_bytes()
}

/// Ordinary build output of `bytes` bytes (compiler-like lines), with one line of the bundle
/// every 64 KiB (if there is one).
fn output(bytes: usize, secret_lines: usize) -> (Vec<u8>, usize) {
    let mut out = Vec::with_capacity(bytes + 4096);
    let mut planted = 0;
    let mut n = 0u64;
    while out.len() < bytes {
        out.extend_from_slice(
            format!("CompileSwift normal arm64 Sources/Module{n}/File{n}.swift (in target 'App')\n").as_bytes(),
        );
        if secret_lines > 0 && out.len() / 65_536 > planted {
            out.extend_from_slice(b"cert: ");
            out.extend_from_slice(pem_line(n % secret_lines as u64).as_bytes());
            out.push(b'\n');
            planted += 1;
        }
        n += 1;
    }
    (out, planted)
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench-mask: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "masking {} MiB of step output, read in polls of {} bytes (and the hold-back)",
        args.mib, args.chunk
    );
    for &count in &args.counts {
        let secret = bundle(count);
        let started = Instant::now();
        let mask = if count == 0 {
            Masker::default()
        } else {
            Masker::new([secret.as_slice()])
        };
        let built = started.elapsed();
        let (out, planted) = output(args.mib << 20, count);
        let cfg = FollowConfig {
            chunk_bytes: args.chunk,
            log_cap: u64::MAX / 4,
            mask,
            ..FollowConfig::default()
        };
        let size = out.len() as u64;
        let (mut offset, mut logged) = (0u64, Vec::with_capacity(out.len()));
        let started = Instant::now();
        while offset < size {
            let max = poll_bytes(offset, &cfg);
            let end = (offset + max).min(size);
            let chunk = &out[offset as usize..end as usize];
            let complete = end == size;
            let t = take(
                offset,
                chunk,
                size,
                complete,
                chunk.len() as u64 == max,
                cfg.log_cap,
                &cfg.mask,
            );
            logged.extend_from_slice(&t.bytes);
            assert!(t.next > offset || complete, "no progress at {offset}");
            offset = t.next;
        }
        let took = started.elapsed();
        let stars = logged.windows(3).filter(|w| w == b"***").count();
        assert!(stars >= planted, "{count} values: {planted} planted, {stars} masked");
        let leaked = (0..count as u64).take(50).any(|i| {
            let line = pem_line(i);
            logged.windows(line.len()).any(|w| w == line.as_bytes())
        });
        assert!(!leaked, "{count} values: a value came out in clear");
        let mib = out.len() as f64 / f64::from(1 << 20);
        println!(
            "{count:>5} value(s): {:>10.1} MiB/s ({mib:.1} MiB in {:.3} s, {planted} planted and masked; masker built in {:.1} ms)",
            mib / took.as_secs_f64(),
            took.as_secs_f64(),
            built.as_secs_f64() * 1e3
        );
    }
}
