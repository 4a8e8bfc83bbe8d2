//! Which bytes of a shipped step log to fetch next (pure): the layout is
//! [`tartan_api::logs`]'s: numbered parts while the build runs, the whole log once it ended.

use tartan_api::logs::{LogObject, parse_object_name};

/// One fetch: bytes `from..to` of object `name` (a name in the logs folder).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Read {
    pub name: String,
    pub from: u64,
    pub to: u64,
}

/// What the folder holds for one step past a reader's offset.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The fetches that bring every byte past the offset, in order.
    pub reads: Vec<Read>,
    /// The whole log is there: nothing more will come for this step.
    pub complete: bool,
    /// Anything at all was shipped for the step.
    pub shipped: bool,
}

/// The fetches that bring `step`'s log from byte `offset` on, given the folder's objects
/// (`(name, size)`; other names are skipped). The whole log, once written, is read from there;
/// until then the parts are, from part 1 on and only as far as they follow each other (a part
/// missing from a listing ends what is read now; it is read once it shows).
pub fn plan(objects: &[(String, u64)], step: &str, offset: u64) -> Plan {
    let mut parts: Vec<(u32, &str, u64)> = Vec::new();
    let mut whole = None;
    for (name, size) in objects {
        match parse_object_name(name) {
            Some(LogObject::Whole { step: s }) if s == step => whole = Some((name.as_str(), *size)),
            Some(LogObject::Part { step: s, n }) if s == step => parts.push((n, name.as_str(), *size)),
            _ => {}
        }
    }
    let shipped = whole.is_some() || !parts.is_empty();
    if let Some((name, size)) = whole {
        let reads = (offset < size)
            .then(|| Read {
                name: name.to_string(),
                from: offset,
                to: size,
            })
            .into_iter()
            .collect();
        return Plan {
            reads,
            complete: true,
            shipped,
        };
    }
    parts.sort();
    let mut reads = Vec::new();
    let mut start = 0u64;
    for (expected, (n, name, size)) in (1u32..).zip(parts) {
        if n != expected {
            break;
        }
        let end = start + size;
        if end > offset && size > 0 {
            reads.push(Read {
                name: name.to_string(),
                from: offset.saturating_sub(start),
                to: size,
            });
        }
        start = end;
    }
    Plan {
        reads,
        complete: false,
        shipped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objects(v: &[(&str, u64)]) -> Vec<(String, u64)> {
        v.iter().map(|(n, s)| (n.to_string(), *s)).collect()
    }

    fn reads(p: &Plan) -> Vec<(&str, u64, u64)> {
        p.reads.iter().map(|r| (r.name.as_str(), r.from, r.to)).collect()
    }

    #[test]
    fn parts_are_read_in_order_from_the_offset_until_a_gap() {
        let folder = objects(&[
            ("build.log.part000002", 5),
            ("build.log.part000001", 10),
            ("build.log.part000004", 3),
            ("test.log.part000001", 7),
            (".build.log.part000003.12.part", 9),
        ]);
        let p = plan(&folder, "build", 0);
        assert_eq!(
            reads(&p),
            [("build.log.part000001", 0, 10), ("build.log.part000002", 0, 5)]
        );
        assert!(!p.complete && p.shipped);
        // Mid-way through part 2.
        let p = plan(&folder, "build", 12);
        assert_eq!(reads(&p), [("build.log.part000002", 2, 5)]);
        // Everything read: nothing to fetch until part 3 shows.
        assert!(plan(&folder, "build", 15).reads.is_empty());
        let p = plan(&folder, "absent", 0);
        assert_eq!(p, Plan::default());
    }

    #[test]
    fn the_whole_log_takes_over_at_the_same_offset() {
        let folder = objects(&[
            ("build.log.part000001", 10),
            ("build.log.part000002", 5),
            ("build.log", 18),
        ]);
        let p = plan(&folder, "build", 15);
        assert_eq!(reads(&p), [("build.log", 15, 18)]);
        assert!(p.complete);
        let p = plan(&folder, "build", 18);
        assert!(p.reads.is_empty() && p.complete);
        // An empty step's whole log: complete, nothing to read.
        let p = plan(&objects(&[("quiet.log", 0)]), "quiet", 0);
        assert!(p.reads.is_empty() && p.complete && p.shipped);
    }
}
