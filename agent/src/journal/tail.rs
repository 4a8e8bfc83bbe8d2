//! Following a live journal without the lock: read-only, bounded memory, never repairs.

use super::format::{self, Frame, HEADER_LEN, HeaderCheck};
use super::{JOURNAL_DIR, JournalError, list_files};
use crate::record::Record;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use tartan_api::files::{ReadFileError, open_regular_file};

/// At most this many bytes are read per file per [`Tail::poll`] (always more than one frame).
const CHUNK_BYTES: usize = 4 << 20;

/// Follows a journal as it grows: each [`Tail::poll`] returns the records appended since the last
/// one, in order. Records come out once each, by sequence number: a record whose number was
/// already returned (a compaction's copy, or a number reused after a failed append) is skipped.
/// Bytes that do not form a whole record are waited on while their file is the newest; once a
/// newer file exists they are skipped with a warning.
#[derive(Debug)]
pub struct Tail {
    dir: PathBuf,
    cursor: Option<Cursor>,
    /// The id of the last file read to its end (or found removed).
    done: Option<u64>,
    last_seq: Option<u64>,
}

#[derive(Debug)]
struct Cursor {
    id: u64,
    path: PathBuf,
    /// Kept open, so a file removed by a compaction can still be read to its end.
    file: File,
    /// `None` until the header has been read.
    offset: Option<u64>,
    /// A newer file was seen: this one is complete, read it once more then move on.
    final_read: bool,
}

impl Tail {
    pub fn new(state_dir: &Path) -> Tail {
        Tail {
            dir: state_dir.join(JOURNAL_DIR),
            cursor: None,
            done: None,
            last_seq: None,
        }
    }

    /// The sequence number of the last record returned.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Records appended since the last call (possibly none). Reads at most a few MiB per call, so
    /// call again at once while it returns records. A missing journal directory reads as empty.
    pub fn poll(&mut self) -> Result<Vec<Record>, JournalError> {
        let mut out = Vec::new();
        loop {
            let files = match list_files(&self.dir) {
                Ok(listing) => listing.files,
                Err(JournalError::Io { error, .. }) if error.kind() == io::ErrorKind::NotFound => return Ok(out),
                Err(e) => return Err(e),
            };
            if self.cursor.is_none() {
                // Start at the oldest file, or move to the next one after the file we finished.
                let after = self.done;
                let Some((id, path)) = files.iter().find(|(id, _)| after.is_none_or(|a| *id > a)).cloned() else {
                    return Ok(out);
                };
                match open_regular_file(&path) {
                    Ok(file) => {
                        self.cursor = Some(Cursor {
                            id,
                            path,
                            file,
                            offset: None,
                            final_read: false,
                        })
                    }
                    // Removed by a compaction between listing and opening: list again.
                    Err(ReadFileError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
                        self.done = Some(id);
                        continue;
                    }
                    // The journal writes only regular files: whatever else is named like one (a
                    // FIFO would block, a link could lead anywhere) holds nothing of it.
                    Err(ReadFileError::NotRegular(what)) => {
                        tracing::warn!("skipping {}: it is {what}, not a journal file", path.display());
                        self.done = Some(id);
                        continue;
                    }
                    Err(ReadFileError::TooLarge { .. }) => unreachable!("open_regular_file reads nothing"),
                    Err(ReadFileError::Io(error)) => {
                        return Err(JournalError::Io {
                            action: "opening journal file".into(),
                            path,
                            error,
                            next: "cannot follow the journal",
                        });
                    }
                }
            }
            let cursor = self.cursor.as_mut().expect("set above");
            let newer_exists = files.iter().any(|(id, _)| *id > cursor.id);
            let (stopped_at, chunk_full) = read_cursor(cursor, &mut self.last_seq, &mut out)?;
            if chunk_full {
                return Ok(out);
            }
            if !newer_exists {
                return Ok(out);
            }
            if !cursor.final_read {
                // The newer file proves this one is complete; read it once more to its end.
                cursor.final_read = true;
                continue;
            }
            if let Some(offset) = stopped_at {
                tracing::warn!(
                    "skipping unreadable bytes at offset {offset} of {} to its end: a newer journal file exists",
                    cursor.path.display()
                );
            }
            self.done = Some(cursor.id);
            self.cursor = None;
        }
    }
}

/// Reads the cursor's file from its offset: at most [`CHUNK_BYTES`]. Returns the offset of bytes
/// that do not (yet) form a whole record, if reading stopped there, and whether it stopped only
/// because the chunk was full.
fn read_cursor(
    cursor: &mut Cursor,
    last_seq: &mut Option<u64>,
    out: &mut Vec<Record>,
) -> Result<(Option<u64>, bool), JournalError> {
    let io_err = |error| JournalError::Io {
        action: "reading journal file".into(),
        path: cursor.path.clone(),
        error,
        next: "cannot follow the journal",
    };
    let file_len = cursor.file.metadata().map_err(io_err)?.len();
    let start = cursor.offset.unwrap_or(0);
    if file_len <= start {
        return Ok((None, false));
    }
    let to_read = usize::try_from(file_len - start).unwrap_or(usize::MAX).min(CHUNK_BYTES);
    let mut buf = vec![0u8; to_read];
    cursor.file.read_exact_at(&mut buf, start).map_err(io_err)?;
    let at_eof = start + to_read as u64 == file_len;
    let mut pos = 0;
    if cursor.offset.is_none() {
        match format::check_header(&buf) {
            HeaderCheck::Valid(_) => pos = HEADER_LEN,
            HeaderCheck::NewerFormat(found) => {
                return Err(JournalError::NewerFormat {
                    path: cursor.path.clone(),
                    found,
                });
            }
            HeaderCheck::TooShort | HeaderCheck::Invalid(_) => return Ok((Some(0), false)),
        }
        cursor.offset = Some(HEADER_LEN as u64);
    }
    while pos < buf.len() {
        match format::decode_frame(&buf, pos) {
            Frame::Record(record, frame_len) => {
                if last_seq.is_none_or(|last| record.seq > last) {
                    *last_seq = Some(record.seq);
                    out.push(*record);
                }
                pos += frame_len;
                cursor.offset = Some(start + pos as u64);
            }
            Frame::NewerVersion { version, seq } => {
                return Err(JournalError::NewerRecord {
                    path: cursor.path.clone(),
                    offset: start + pos as u64,
                    found: version,
                    seq,
                });
            }
            Frame::Bad(_) => {
                let room = buf.len() - pos;
                if !at_eof && room < format::FRAME_HEADER_LEN + format::MAX_RECORD_BYTES {
                    return Ok((None, true));
                }
                return Ok((Some(start + pos as u64), false));
            }
        }
    }
    Ok((None, !at_eof))
}
