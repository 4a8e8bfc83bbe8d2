//! The on-disk layout of a journal file, and a scanner that reads one file's bytes.
//!
//! A file starts with a 32-byte header:
//!
//! | bytes  | content                                                                  |
//! |--------|--------------------------------------------------------------------------|
//! | 0..8   | magic `TRTNJRNL`                                                         |
//! | 8..12  | format version, u32 little-endian ([`FORMAT_VERSION`])                   |
//! | 12..16 | kind, u32 LE: 1 = appended, 2 = compacted (supersedes every older file)  |
//! | 16..24 | `first_seq`, u64 LE: the sequence number the journal was to assign next  |
//! |        | when it created this file                                                |
//! | 24..28 | crc32 of bytes 0..24                                                     |
//! | 28..32 | zero                                                                     |
//!
//! Then frames, back to back: length (u32 LE) of the payload, crc32 (u32 LE) of the length
//! bytes followed by the payload, and the payload: one [`Record`] as JSON.

use crate::record::{RECORD_VERSION, Record};
use serde::Deserialize;

pub(crate) const MAGIC: &[u8; 8] = b"TRTNJRNL";
/// Layout version of journal files written by this build.
pub const FORMAT_VERSION: u32 = 1;
pub(crate) const HEADER_LEN: usize = 32;
pub(crate) const FRAME_HEADER_LEN: usize = 8;
/// The largest payload a frame may carry; a longer length field is read as damage.
pub const MAX_RECORD_BYTES: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FileKind {
    /// Written by appends.
    Appended,
    /// Written whole by a compaction; every file with a smaller id is superseded by it.
    Compacted,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: FileKind,
    pub first_seq: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut buf = [0u8; HEADER_LEN];
        buf[0..8].copy_from_slice(MAGIC);
        buf[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        let kind: u32 = match self.kind {
            FileKind::Appended => 1,
            FileKind::Compacted => 2,
        };
        buf[12..16].copy_from_slice(&kind.to_le_bytes());
        buf[16..24].copy_from_slice(&self.first_seq.to_le_bytes());
        let crc = crc32fast::hash(&buf[0..24]);
        buf[24..28].copy_from_slice(&crc.to_le_bytes());
        buf
    }
}

/// What the first bytes of a file say.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HeaderCheck {
    Valid(Header),
    /// Shorter than a header: the file's creation was cut short, so it holds no record.
    TooShort,
    /// A whole header that is not ours or is damaged.
    Invalid(String),
    /// A header of a newer layout than this build reads.
    NewerFormat(u32),
}

pub(crate) fn check_header(bytes: &[u8]) -> HeaderCheck {
    if bytes.len() < HEADER_LEN {
        return HeaderCheck::TooShort;
    }
    if &bytes[0..8] != MAGIC {
        return HeaderCheck::Invalid("magic mismatch: not a tartan journal file".into());
    }
    let crc = u32::from_le_bytes(bytes[24..28].try_into().expect("4 bytes"));
    if crc != crc32fast::hash(&bytes[0..24]) {
        return HeaderCheck::Invalid("header checksum mismatch".into());
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version > FORMAT_VERSION {
        return HeaderCheck::NewerFormat(version);
    }
    if version == 0 {
        return HeaderCheck::Invalid("format version 0".into());
    }
    let kind = match u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) {
        1 => FileKind::Appended,
        2 => FileKind::Compacted,
        other => return HeaderCheck::Invalid(format!("unknown file kind {other}")),
    };
    let first_seq = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    HeaderCheck::Valid(Header { kind, first_seq })
}

/// Appends one frame holding `record` to `out`. Fails only if the record cannot be encoded or
/// is longer than [`MAX_RECORD_BYTES`].
pub(crate) fn encode_frame(record: &Record, out: &mut Vec<u8>) -> Result<(), String> {
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_HEADER_LEN]);
    serde_json::to_writer(&mut *out, record).map_err(|e| {
        out.truncate(start);
        format!("JSON encoding failed: {e}")
    })?;
    let len = out.len() - start - FRAME_HEADER_LEN;
    if len > MAX_RECORD_BYTES {
        out.truncate(start);
        return Err(format!(
            "encoded record is {len} bytes, more than the limit of {MAX_RECORD_BYTES}"
        ));
    }
    let len_bytes = (len as u32).to_le_bytes();
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&len_bytes);
    hasher.update(&out[start + FRAME_HEADER_LEN..]);
    out[start..start + 4].copy_from_slice(&len_bytes);
    out[start + 4..start + 8].copy_from_slice(&hasher.finalize().to_le_bytes());
    Ok(())
}

/// The result of decoding the frame at one offset.
#[derive(Debug)]
pub(crate) enum Frame {
    /// A whole, verified record and the frame's length in bytes.
    Record(Box<Record>, usize),
    /// A verified frame whose record has a newer layout version than this build reads.
    NewerVersion { version: u32, seq: Option<u64> },
    /// The bytes here are not a whole, verified frame.
    Bad(String),
}

#[derive(Deserialize)]
struct VersionProbe {
    v: u32,
    seq: Option<u64>,
}

pub(crate) fn decode_frame(bytes: &[u8], pos: usize) -> Frame {
    let rest = &bytes[pos..];
    if rest.len() < FRAME_HEADER_LEN {
        return Frame::Bad(format!("{} byte(s) left, less than a frame header", rest.len()));
    }
    let len = u32::from_le_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
    if len == 0 || len > MAX_RECORD_BYTES {
        return Frame::Bad(format!("implausible record length {len}"));
    }
    if rest.len() < FRAME_HEADER_LEN + len {
        return Frame::Bad(format!(
            "record of {len} bytes cut short: {} byte(s) left",
            rest.len() - FRAME_HEADER_LEN
        ));
    }
    let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
    let payload = &rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + len];
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&rest[0..4]);
    hasher.update(payload);
    if hasher.finalize() != crc {
        return Frame::Bad("checksum mismatch".into());
    }
    match serde_json::from_slice::<Record>(payload) {
        Ok(record) if record.version > RECORD_VERSION => Frame::NewerVersion {
            version: record.version,
            seq: Some(record.seq),
        },
        Ok(record) => Frame::Record(Box::new(record), FRAME_HEADER_LEN + len),
        Err(e) => match serde_json::from_slice::<VersionProbe>(payload) {
            Ok(probe) if probe.v > RECORD_VERSION => Frame::NewerVersion {
                version: probe.v,
                seq: probe.seq,
            },
            _ => Frame::Bad(format!("verified frame holds no readable record: {e}")),
        },
    }
}

/// The next offset after `from` where a whole, verified frame starts, if any.
pub(crate) fn find_next_frame(bytes: &[u8], from: usize) -> Option<usize> {
    let last_start = bytes.len().checked_sub(FRAME_HEADER_LEN + 2)?;
    (from..=last_start).find(|&p| {
        let len = u32::from_le_bytes(bytes[p..p + 4].try_into().expect("4 bytes")) as usize;
        // Cheap filters first: a plausible length that fits, and a JSON object after the header.
        (2..=MAX_RECORD_BYTES).contains(&len)
            && p + FRAME_HEADER_LEN + len <= bytes.len()
            && bytes[p + FRAME_HEADER_LEN] == b'{'
            && !matches!(decode_frame(bytes, p), Frame::Bad(_))
    })
}

/// Damage found in a file: an offset and what is wrong there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Damage {
    pub offset: u64,
    pub what: String,
}

/// One file's bytes, read: the readable records and where it is damaged.
#[derive(Debug)]
pub(crate) struct Scan {
    pub records: Vec<Record>,
    /// Unreadable stretches followed by at least one readable record, or records out of order.
    pub damage: Vec<Damage>,
    /// Where trailing bytes that hold no readable record start (a torn last write).
    pub torn_at: Option<u64>,
    /// A verified record of a newer layout: offset, version, seq.
    pub newer: Option<(u64, u32, Option<u64>)>,
}

/// Reads every frame after the header. A frame that does not verify is skipped by searching for
/// the next frame that does; if there is none, the file ends in a torn write at that offset.
/// A record whose `seq` is not above `prev_seq` (or, in an appended file, below its
/// `first_seq`) counts as damage too.
pub(crate) fn scan(bytes: &[u8], header: Header, mut prev_seq: Option<u64>) -> Scan {
    let mut scan = Scan {
        records: Vec::new(),
        damage: Vec::new(),
        torn_at: None,
        newer: None,
    };
    let mut pos = HEADER_LEN;
    while pos < bytes.len() {
        match decode_frame(bytes, pos) {
            Frame::Record(record, frame_len) => {
                let below_first = header.kind == FileKind::Appended && record.seq < header.first_seq;
                if below_first || prev_seq.is_some_and(|p| record.seq <= p) {
                    scan.damage.push(Damage {
                        offset: pos as u64,
                        what: format!(
                            "record #{} out of order (after #{}, file starts at #{})",
                            record.seq,
                            prev_seq.map_or_else(|| "-".to_string(), |p| p.to_string()),
                            header.first_seq
                        ),
                    });
                } else {
                    prev_seq = Some(record.seq);
                    scan.records.push(*record);
                }
                pos += frame_len;
            }
            Frame::NewerVersion { version, seq } => {
                scan.newer = Some((pos as u64, version, seq));
                return scan;
            }
            Frame::Bad(what) => match find_next_frame(bytes, pos + 1) {
                Some(next) => {
                    scan.damage.push(Damage {
                        offset: pos as u64,
                        what: format!("{what}; {} byte(s) skipped", next - pos),
                    });
                    pos = next;
                }
                None => {
                    scan.torn_at = Some(pos as u64);
                    return scan;
                }
            },
        }
    }
    scan
}
