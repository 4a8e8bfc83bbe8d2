//! Reading a file that someone other than its writer may have replaced: only a regular file is
//! read, never through a symbolic link, never blocking on a FIFO or device, and never more than a
//! cap. The watchdog (deadline files) and the agent's journal read their own files this way, so a
//! FIFO, a symlink to `/dev/zero` or a huge sparse file planted in their folder is refused at once
//! instead of blocking or exhausting the reader.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum ReadFileError {
    /// The operating system refused to open or read it (including "not found").
    #[error("{0}")]
    Io(io::Error),
    /// Not a regular file: what it is instead ("a symbolic link", "a FIFO", ...).
    #[error("it is {0}, not a regular file")]
    NotRegular(&'static str),
    /// Larger than the caller's cap.
    #[error("it is {len} bytes, more than the {max} bytes such a file can be")]
    TooLarge { len: u64, max: u64 },
}

/// Opens `path` for reading if it is a regular file reached without following a symbolic link
/// at its last component: `O_NOFOLLOW | O_NONBLOCK` (so a FIFO's open does not wait for a writer),
/// then `fstat` on the open descriptor decides (so a swap after a check cannot fool it).
pub fn open_regular_file(path: &Path) -> Result<File, ReadFileError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            // O_NOFOLLOW on a symbolic link: ELOOP (Linux, macOS); EMLINK on some BSDs.
            Some(libc::ELOOP) | Some(libc::EMLINK) => ReadFileError::NotRegular("a symbolic link"),
            _ => ReadFileError::Io(e),
        })?;
    let kind = file.metadata().map_err(ReadFileError::Io)?.file_type();
    if kind.is_file() {
        Ok(file)
    } else if kind.is_dir() {
        Err(ReadFileError::NotRegular("a directory"))
    } else if kind.is_fifo() {
        Err(ReadFileError::NotRegular("a FIFO"))
    } else if kind.is_socket() {
        Err(ReadFileError::NotRegular("a socket"))
    } else if kind.is_char_device() || kind.is_block_device() {
        Err(ReadFileError::NotRegular("a device"))
    } else {
        Err(ReadFileError::NotRegular("not a regular file"))
    }
}

/// Reads all of the regular file at `path` (see [`open_regular_file`]), refusing one longer than
/// `max` bytes before reading anything, and reading at most `max` bytes even if it grows meanwhile.
pub fn read_regular_file(path: &Path, max: u64) -> Result<Vec<u8>, ReadFileError> {
    let file = open_regular_file(path)?;
    let len = file.metadata().map_err(ReadFileError::Io)?.len();
    if len > max {
        return Err(ReadFileError::TooLarge { len, max });
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    // One byte past the cap tells a file that grew after the fstat from one exactly at the cap.
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(ReadFileError::Io)?;
    if bytes.len() as u64 > max {
        return Err(ReadFileError::TooLarge {
            len: bytes.len() as u64,
            max,
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(
            unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
            0,
            "{}",
            io::Error::last_os_error()
        );
    }

    #[test]
    fn reads_a_regular_file_and_refuses_everything_else_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"hello").unwrap();
        assert_eq!(read_regular_file(&plain, 5).unwrap(), b"hello");

        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        // Without O_NONBLOCK this open would wait forever for a writer.
        assert!(matches!(
            read_regular_file(&fifo, 5),
            Err(ReadFileError::NotRegular("a FIFO"))
        ));

        let zero = dir.path().join("zero");
        symlink("/dev/zero", &zero).unwrap();
        assert!(matches!(
            read_regular_file(&zero, 5),
            Err(ReadFileError::NotRegular("a symbolic link"))
        ));
        let to_plain = dir.path().join("to-plain");
        symlink(&plain, &to_plain).unwrap();
        assert!(matches!(
            read_regular_file(&to_plain, 5),
            Err(ReadFileError::NotRegular("a symbolic link"))
        ));
        assert!(matches!(
            read_regular_file(Path::new("/dev/zero"), 5),
            Err(ReadFileError::NotRegular("a device"))
        ));
        assert!(matches!(
            read_regular_file(dir.path(), 5),
            Err(ReadFileError::NotRegular("a directory"))
        ));
        let missing = read_regular_file(&dir.path().join("missing"), 5).unwrap_err();
        assert!(matches!(&missing, ReadFileError::Io(e) if e.kind() == io::ErrorKind::NotFound));
    }

    #[test]
    fn a_file_over_the_cap_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let sparse = dir.path().join("sparse");
        // 1 GiB of nothing: instant to create, slow and huge to read whole.
        File::create(&sparse).unwrap().set_len(1 << 30).unwrap();
        let started = std::time::Instant::now();
        let err = read_regular_file(&sparse, 64 << 10).unwrap_err();
        assert!(
            matches!(err, ReadFileError::TooLarge { len, max } if len == 1 << 30 && max == 64 << 10),
            "{err:?}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        assert!(err.to_string().contains("1073741824 bytes"), "{err}");
        std::fs::write(&sparse, b"123456").unwrap();
        assert!(matches!(
            read_regular_file(&sparse, 5),
            Err(ReadFileError::TooLarge { len: 6, max: 5 })
        ));
    }
}
