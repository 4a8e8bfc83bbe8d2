//! Where a guest file read by the collect phase goes as it comes out of `tart exec`: the test
//! report into memory ([`MemoryCopy`], at most the report cap), an artifact into its host file
//! for the upload, screened for Secret values on the way ([`ScreenedCopy`]). Neither puts a value
//! on the host disk: the report is never written, and an artifact's bytes are written only once
//! the stream shows they are not part of a value (the first whole value stops the read).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use tartan_tart::OutputConsumer;

use crate::host::env::ValueScreen;

/// A guest file kept in memory; clones share it (one is handed to the exec, one kept).
#[derive(Clone, Default)]
pub struct MemoryCopy(Arc<Mutex<Vec<u8>>>);

impl MemoryCopy {
    /// What came, taken out.
    pub fn take(&self) -> Vec<u8> {
        std::mem::take(&mut *lock(&self.0))
    }
}

impl OutputConsumer for MemoryCopy {
    fn consume(&mut self, data: &[u8]) -> Result<(), String> {
        lock(&self.0).extend_from_slice(data);
        Ok(())
    }
}

/// A guest file copied to a host file through a [`ValueScreen`]; clones share it.
#[derive(Clone)]
pub struct ScreenedCopy(Arc<Mutex<Screened>>);

struct Screened {
    path: PathBuf,
    file: std::fs::File,
    /// `None`: the build has no Secret value to look for.
    screen: Option<ValueScreen>,
    /// Where in the file a value was found (the read is then stopped).
    found: Option<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ScreenedCopy {
    /// Creates host file `path` (`0640`, never an existing file or a link: a stale one is
    /// removed first) for a copy through `screen`.
    pub fn create(path: &Path, screen: Option<ValueScreen>) -> Result<ScreenedCopy, String> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("removing stale {}: {e}", path.display())),
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o640)
            .open(path)
            .map_err(|e| format!("creating {}: {e}", path.display()))?;
        Ok(ScreenedCopy(Arc::new(Mutex::new(Screened {
            path: path.to_path_buf(),
            file,
            screen,
            found: None,
        }))))
    }

    /// Where a Secret value was found in the stream, if one was.
    pub fn found(&self) -> Option<u64> {
        lock(&self.0).found
    }

    /// At the stream's end (no value found): writes what the screen held back.
    pub fn finish(&self) -> std::io::Result<()> {
        let mut copy = lock(&self.0);
        let rest = copy.screen.take().map(ValueScreen::finish).unwrap_or_default();
        copy.file.write_all(&rest)?;
        copy.file.flush()
    }
}

impl OutputConsumer for ScreenedCopy {
    fn consume(&mut self, data: &[u8]) -> Result<(), String> {
        let mut copy = lock(&self.0);
        let copy = &mut *copy;
        let clean = match copy.screen.as_mut().map(|screen| screen.feed(data)) {
            None => data.to_vec(),
            Some(Ok(clean)) => clean,
            Some(Err(at)) => {
                copy.found = Some(at);
                return Err(format!("the file holds the value of a Secret of spec.env at byte {at}"));
            }
        };
        copy.file
            .write_all(&clean)
            .map_err(|e| format!("writing {}: {e}", copy.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::env::Masker;

    /// Fed in pieces of every size: the file holds exactly the stream when no value is in it,
    /// and never the value (nor more than the bytes before it) when one is.
    #[test]
    fn a_screened_copy_writes_all_of_a_clean_stream_and_never_a_value() {
        let mask = Masker::new([&b"hunter2-token"[..], b"line-one\nline-two"]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("artifact-0");
        let clean = b"hunter2-toke hunter2-tokn line-one line-two\nline-one\r\n".repeat(3);
        let dirty = [&clean[..], b"x hunter2-token y"].concat();
        for piece in [1, 2, 5, 13, 64, 4096] {
            let mut copy = ScreenedCopy::create(&path, mask.screen()).unwrap();
            for chunk in clean.chunks(piece) {
                copy.consume(chunk).unwrap();
            }
            copy.finish().unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), clean, "piece {piece}");
            let mut copy = ScreenedCopy::create(&path, mask.screen()).unwrap();
            let refused = dirty.chunks(piece).find_map(|chunk| copy.consume(chunk).err());
            assert!(refused.is_some_and(|why| why.ends_with(&format!("at byte {}", clean.len() + 2))));
            assert_eq!(copy.found(), Some(clean.len() as u64 + 2));
            // What was written is the stream up to the value's start at most.
            let written = std::fs::read(&path).unwrap();
            assert!(dirty.starts_with(&written), "piece {piece}");
            assert!(
                written.len() <= clean.len() + 2,
                "piece {piece}: {} bytes",
                written.len()
            );
        }
    }
}
