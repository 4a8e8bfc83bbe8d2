//! The JUnit counter's memory stays bounded whatever the report: reports far larger than any
//! buffer (more than 100 MiB of empty elements, one text of 100 MiB, suites nested to the limit)
//! are counted from a `Read` that makes them on the fly, while a counting allocator records the
//! most bytes live at once. A tree of the 8 million empty elements once took the agent from
//! 30 MB to 612 MB (issue 25 item 9).
//!
//! Its own test binary: the allocator counts every allocation of the process, so nothing else
//! may run beside it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Read;
use std::sync::atomic::{AtomicUsize, Ordering};
use tartan_agent::host::junit::{MAX_DEPTH, ReportError, TestCounts, count_report};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A report made while it is read: `head`, then `body` `times` times, then `tail`.
struct Generated {
    parts: Vec<(Vec<u8>, u64)>,
    part: usize,
    at: usize,
    left: u64,
    produced: u64,
}

impl Generated {
    fn new(head: &str, body: &str, times: u64, tail: &str) -> Generated {
        let parts = vec![
            (head.as_bytes().to_vec(), 1),
            (body.as_bytes().to_vec(), times),
            (tail.as_bytes().to_vec(), 1),
        ];
        Generated {
            left: parts[0].1,
            parts,
            part: 0,
            at: 0,
            produced: 0,
        }
    }
}

impl Read for Generated {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let mut n = 0;
        while n < out.len() && self.part < self.parts.len() {
            let (bytes, _) = &self.parts[self.part];
            if self.left == 0 || bytes.is_empty() {
                self.part += 1;
                self.at = 0;
                self.left = self.parts.get(self.part).map_or(0, |p| p.1);
                continue;
            }
            let take = (bytes.len() - self.at).min(out.len() - n);
            out[n..n + take].copy_from_slice(&bytes[self.at..self.at + take]);
            n += take;
            self.at += take;
            if self.at == bytes.len() {
                self.at = 0;
                self.left -= 1;
            }
        }
        self.produced += n as u64;
        Ok(n)
    }
}

/// Counts `report`; returns the result, the bytes read and the most bytes allocated at once
/// above what was live before.
fn measure(mut report: Generated) -> (Result<TestCounts, ReportError>, u64, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let counted = count_report("big.xml", &mut report);
    let peak = PEAK.load(Ordering::Relaxed) - before;
    (counted, report.produced, peak)
}

const MIB: u64 = 1 << 20;
/// What the counter may hold at once: its 64 KiB read buffer and the open elements.
const BOUND: usize = 1 << 20;

#[test]
fn huge_reports_are_counted_in_bounded_memory() {
    // 9.6 million empty cases, 105 MiB.
    let cases = 9_600_000;
    let (counted, read, peak) = measure(Generated::new(
        "<?xml version=\"1.0\"?>\n<testsuites><testsuite name=\"all\">",
        "<testcase/>",
        cases,
        "</testsuite></testsuites>\n",
    ));
    assert!(read > 100 * MIB, "{read}");
    let c = counted.unwrap();
    assert_eq!((u64::from(c.total), c.failed(), c.passed()), (cases, 0, cases as u32));
    assert!(
        peak < BOUND,
        "{peak} bytes live at once counting {read} bytes of empty cases"
    );

    // One text of 100 MiB is skipped, never held.
    let (counted, read, peak) = measure(Generated::new(
        "<testsuite><testcase><system-out>",
        &"x".repeat(1 << 20),
        100,
        "</system-out><failure/></testcase></testsuite>",
    ));
    assert!(read > 100 * MIB);
    assert_eq!(counted.unwrap().failures, 1);
    assert!(peak < BOUND, "{peak}");

    // Nesting is bounded too: at the limit it counts, past it the report is malformed.
    // The root and the cases count towards the depth.
    let depth = MAX_DEPTH as u64 - 2;
    let open = "<testsuite>".repeat(depth as usize);
    let close = "</testsuite>".repeat(depth as usize);
    let (counted, _, peak) = measure(Generated::new(
        &format!("<testsuites>{open}"),
        "<testcase/>",
        3,
        &format!("{close}</testsuites>"),
    ));
    assert_eq!(counted.unwrap().total, 3);
    assert!(peak < BOUND, "{peak}");
    let (counted, _, peak) = measure(Generated::new("<testsuites>", "<testsuite>", 1_000_000, ""));
    let e = counted.unwrap_err().to_string();
    assert!(e.contains(&format!("elements nested deeper than {MAX_DEPTH}")), "{e}");
    assert!(peak < BOUND, "{peak}");
}
