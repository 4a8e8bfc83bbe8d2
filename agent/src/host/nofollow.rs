//! Writing and listing below a checked folder without following any symbolic link.
//!
//! A `file://` artifact destination is checked once, resolved (see
//! [`allowed_destination`](super::artifacts::allowed_destination)); what lies below it may change
//! afterwards, and a folder a build can write to (a mount that overlaps it, refused at config load
//! since, or anything else) could hold links planted to send the agent's writes elsewhere: into
//! the state dir's `deadlines/`, another VM's folder, anywhere. So the folder is opened from `/`
//! one component at a time with `O_NOFOLLOW`, missing folders are made with `mkdirat` in the
//! folder already opened, and a file is created exclusively (`O_EXCL | O_NOFOLLOW`) under a temp
//! name and renamed into place within that same opened folder. A link anywhere on the way is an
//! error naming it; nothing is written through it.

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, renameat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, unlinkat};
use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path};
use std::sync::atomic::{AtomicU64, Ordering};

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// Folder `path` (absolute), opened from `/` without following a link at any component. With
/// `create`, missing folders are made (mode 0755, less the umask); without, a missing one gives
/// `Ok(None)`. A component that is a link, or not a folder, or `..`, is an error naming it.
pub fn open_dir(path: &Path, create: bool) -> Result<Option<OwnedFd>, String> {
    if !path.is_absolute() {
        return Err(format!("{} is not an absolute path", path.display()));
    }
    let mut dir = openat(nix::fcntl::AT_FDCWD, "/", DIR_FLAGS, Mode::empty())
        .map_err(|e| format!("opening / (the walk to {}): {e}", path.display()))?;
    let mut walked = std::path::PathBuf::from("/");
    for component in path.components() {
        let name = match component {
            Component::RootDir | Component::CurDir => continue,
            Component::Normal(name) => name,
            Component::ParentDir | Component::Prefix(_) => {
                return Err(format!("{} contains '..'; refusing to walk it", path.display()));
            }
        };
        walked.push(name);
        dir = match open_child(&dir, name) {
            Ok(child) => child,
            Err(Errno::ENOENT) if !create => return Ok(None),
            Err(Errno::ENOENT) => {
                match mkdirat(&dir, name, Mode::from_bits_truncate(0o755)) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(e) => return Err(format!("creating folder {}: {e}", walked.display())),
                }
                // Whatever is there now is opened under the same rule: a link made in the
                // meantime is refused, not followed.
                open_child(&dir, name).map_err(|e| not_a_folder(&dir, name, &walked, e))?
            }
            Err(e) => return Err(not_a_folder(&dir, name, &walked, e)),
        };
    }
    Ok(Some(dir))
}

fn open_child(dir: &OwnedFd, name: &OsStr) -> Result<OwnedFd, Errno> {
    openat(dir, name, DIR_FLAGS, Mode::empty())
}

/// What a directory entry is, as far as the walk cares.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Link,
    File,
    Folder,
    Special,
}

impl Kind {
    fn of(stat: &FileStat) -> Kind {
        let kind = SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT;
        if kind == SFlag::S_IFLNK {
            Kind::Link
        } else if kind == SFlag::S_IFREG {
            Kind::File
        } else if kind == SFlag::S_IFDIR {
            Kind::Folder
        } else {
            Kind::Special
        }
    }

    fn described(self) -> &'static str {
        match self {
            Kind::Link => "a symbolic link",
            Kind::File => "a regular file",
            Kind::Folder => "a folder",
            Kind::Special => "a special file",
        }
    }
}

/// The error for folder `name` in `dir` (at `walked`) that would not open as one.
fn not_a_folder(dir: &OwnedFd, name: &OsStr, walked: &Path, e: Errno) -> String {
    match fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(stat) if Kind::of(&stat) != Kind::Folder => format!(
            "{} is {}, not a folder; refusing to write through it",
            walked.display(),
            Kind::of(&stat).described()
        ),
        _ => format!("opening folder {}: {e}", walked.display()),
    }
}

/// Distinguishes the temp files of concurrent writes in one process.
static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Creates file `dir/key` (`key` relative, `/`-separated, without `..`) durably and without
/// following a link: the folders are opened (and made) by [`open_dir`], the content goes to a
/// temp file created exclusively in the last one and filled by `fill`, synced, renamed over
/// `key`'s last name within that folder (replacing the entry, never writing through it), and the
/// folder synced. A crash leaves the old file or the whole new one, plus at most a temp file.
pub fn place_file(dir: &Path, key: &str, fill: impl FnOnce(&mut File) -> Result<(), String>) -> Result<(), String> {
    let target = dir.join(key);
    let mut names: Vec<&str> = key.split('/').filter(|s| !s.is_empty() && *s != ".").collect();
    let Some(name) = names.pop() else {
        return Err(format!("{key:?} names no file under {}", dir.display()));
    };
    if name == ".." || names.contains(&"..") {
        return Err(format!(
            "{key:?} contains '..'; refusing to write it under {}",
            dir.display()
        ));
    }
    let parent = names.iter().fold(dir.to_path_buf(), |p, n| p.join(n));
    let folder = open_dir(&parent, true)?.expect("created when missing");
    let (temp_name, temp) = create_temp(&folder, &parent)?;
    let written = (|| {
        let mut file = File::from(temp);
        fill(&mut file)?;
        file.sync_all()
            .map_err(|e| format!("syncing {}: {e}", parent.join(&temp_name).display()))?;
        renameat(&folder, temp_name.as_str(), &folder, name).map_err(|e| {
            format!(
                "renaming {} to {}: {e}",
                parent.join(&temp_name).display(),
                target.display()
            )
        })
    })();
    if written.is_err() {
        let _ = unlinkat(&folder, temp_name.as_str(), UnlinkatFlags::NoRemoveDir);
        return written;
    }
    File::from(folder)
        .sync_all()
        .map_err(|e| format!("syncing folder {}: {e}", parent.display()))
}

/// A new temp file in `folder` (at `path`), created exclusively: whatever sits at a name (a
/// leftover, a planted link) is skipped, never opened.
fn create_temp(folder: &OwnedFd, path: &Path) -> Result<(String, OwnedFd), String> {
    let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut last = Errno::EEXIST;
    for _ in 0..16 {
        let n = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
        let name = format!(".tartan-{}-{n}.part", std::process::id());
        match openat(folder.as_fd(), name.as_str(), flags, Mode::from_bits_truncate(0o644)) {
            Ok(fd) => return Ok((name, fd)),
            Err(Errno::EEXIST) => last = Errno::EEXIST,
            Err(e) => return Err(format!("creating a temp file in {}: {e}", path.display())),
        }
    }
    Err(format!(
        "creating a temp file in {}: 16 names taken ({last})",
        path.display()
    ))
}

/// The regular files directly in folder `path` (walked as [`open_dir`] does) with their sizes;
/// links and anything else are left out. A missing folder is empty.
pub fn list_files(path: &Path) -> Result<Vec<(String, u64)>, String> {
    let Some(folder) = open_dir(path, false)? else {
        return Ok(Vec::new());
    };
    let mut dir = nix::dir::Dir::from_fd(folder).map_err(|e| format!("listing {}: {e}", path.display()))?;
    let fd = dir
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| format!("listing {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for entry in dir.iter() {
        let entry = entry.map_err(|e| format!("listing {}: {e}", path.display()))?;
        let Ok(name) = entry.file_name().to_str() else { continue };
        if name == "." || name == ".." {
            continue;
        }
        match fstatat(&fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(stat) if Kind::of(&stat) == Kind::File => {
                out.push((name.to_string(), u64::try_from(stat.st_size).unwrap_or(0)));
            }
            _ => continue,
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;

    /// A destination folder and, beside it, the places a planted link aims at.
    struct Layout {
        _tmp: tempfile::TempDir,
        dest: PathBuf,
        victim: PathBuf,
    }

    fn layout() -> Layout {
        let tmp = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(tmp.path()).unwrap();
        let dest = base.join("dest");
        let victim = base.join("state/deadlines");
        std::fs::create_dir_all(&dest).unwrap();
        std::fs::create_dir_all(&victim).unwrap();
        std::fs::write(victim.join("mb-other.json"), b"the other build's deadline").unwrap();
        Layout {
            _tmp: tmp,
            dest,
            victim,
        }
    }

    fn write(dir: &Path, key: &str, bytes: &[u8]) -> Result<(), String> {
        place_file(dir, key, |f| f.write_all(bytes).map_err(|e| e.to_string()))
    }

    /// Everything below `dir`, as relative paths (links not followed).
    fn tree(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                out.push(e.path().strip_prefix(dir).unwrap().display().to_string());
                if e.file_type().unwrap().is_dir() {
                    stack.push(e.path());
                }
            }
        }
        out.sort();
        out
    }

    fn victim_untouched(l: &Layout) {
        assert_eq!(tree(&l.victim), vec!["mb-other.json"]);
        assert_eq!(
            std::fs::read(l.victim.join("mb-other.json")).unwrap(),
            b"the other build's deadline"
        );
    }

    #[test]
    fn writes_make_folders_and_replace_only_the_entry() {
        let l = layout();
        write(&l.dest, "mb-a/out/App.ipa", b"one").unwrap();
        write(&l.dest, "mb-a/out/App.ipa", b"two").unwrap();
        assert_eq!(std::fs::read(l.dest.join("mb-a/out/App.ipa")).unwrap(), b"two");
        assert_eq!(
            tree(&l.dest),
            vec!["mb-a", "mb-a/out", "mb-a/out/App.ipa"],
            "no temp file left"
        );
        // A hard link planted at the target: the rename replaces the entry, the other name keeps
        // its bytes.
        std::fs::hard_link(l.victim.join("mb-other.json"), l.dest.join("mb-a/out/linked")).unwrap();
        write(&l.dest, "mb-a/out/linked", b"artifact").unwrap();
        assert_eq!(std::fs::read(l.dest.join("mb-a/out/linked")).unwrap(), b"artifact");
        victim_untouched(&l);
        // A failed fill leaves no temp file.
        let e = place_file(&l.dest, "mb-a/out/failing", |_| Err("fill failed".into())).unwrap_err();
        assert_eq!(e, "fill failed");
        assert!(
            !tree(&l.dest)
                .iter()
                .any(|p| p.contains(".part") || p.contains("failing"))
        );
    }

    #[test]
    fn a_link_at_any_component_is_refused_and_nothing_is_written_through_it() {
        let l = layout();
        // The attempt folder itself, a folder in the middle, and the last component.
        symlink(&l.victim, l.dest.join("mb-a")).unwrap();
        let e = write(&l.dest, "mb-a/mb-other.json", b"forged").unwrap_err();
        assert!(
            e.contains(&format!("{} is a symbolic link", l.dest.join("mb-a").display())),
            "{e}"
        );
        std::fs::create_dir_all(l.dest.join("mb-b")).unwrap();
        symlink(&l.victim, l.dest.join("mb-b/out")).unwrap();
        let e = write(&l.dest, "mb-b/out/deep/mb-other.json", b"forged").unwrap_err();
        assert!(e.contains("mb-b/out is a symbolic link"), "{e}");
        // A link as the file itself is replaced, not written through.
        std::fs::create_dir_all(l.dest.join("mb-c")).unwrap();
        symlink(l.victim.join("mb-other.json"), l.dest.join("mb-c/file")).unwrap();
        write(&l.dest, "mb-c/file", b"artifact").unwrap();
        assert!(std::fs::symlink_metadata(l.dest.join("mb-c/file")).unwrap().is_file());
        // A link to nowhere in the middle is not created through either.
        symlink(l.victim.join("new"), l.dest.join("mb-d")).unwrap();
        assert!(
            write(&l.dest, "mb-d/x", b"forged")
                .unwrap_err()
                .contains("is a symbolic link")
        );
        assert!(!l.victim.join("new").exists());
        // A file where a folder is expected.
        std::fs::write(l.dest.join("mb-e"), b"").unwrap();
        let e = write(&l.dest, "mb-e/x", b"y").unwrap_err();
        assert!(e.contains("mb-e is a regular file, not a folder"), "{e}");
        // A link above the destination counts as much as one below it.
        let via = l.dest.parent().unwrap().join("via");
        symlink(&l.dest, &via).unwrap();
        assert!(
            write(&via, "mb-f/x", b"y")
                .unwrap_err()
                .contains("via is a symbolic link")
        );
        victim_untouched(&l);
    }

    #[test]
    fn a_folder_swapped_for_a_link_after_the_walk_began_is_not_followed() {
        // The swap happens between the walk that made `mb-a/out` and the next write: what was
        // checked then no longer counts, the write walks again and stops at the link.
        let l = layout();
        write(&l.dest, "mb-a/out/1.log", b"x").unwrap();
        std::fs::remove_dir_all(l.dest.join("mb-a/out")).unwrap();
        symlink(&l.victim, l.dest.join("mb-a/out")).unwrap();
        assert!(write(&l.dest, "mb-a/out/mb-other.json", b"forged").is_err());
        // And within one write: the fill (running after the folder was opened) swaps the folder;
        // the rename stays in the folder that was opened, now detached, never the link's target.
        let dest = l.dest.clone();
        let victim = l.victim.clone();
        place_file(&l.dest, "mb-b/out/mb-other.json", move |f| {
            std::fs::rename(dest.join("mb-b/out"), dest.join("mb-b/moved")).unwrap();
            symlink(&victim, dest.join("mb-b/out")).unwrap();
            f.write_all(b"forged").map_err(|e| e.to_string())
        })
        .unwrap();
        assert_eq!(
            std::fs::read(l.dest.join("mb-b/moved/mb-other.json")).unwrap(),
            b"forged"
        );
        victim_untouched(&l);
    }

    #[test]
    fn temp_names_already_taken_are_skipped_not_opened() {
        let l = layout();
        std::fs::create_dir_all(l.dest.join("mb-a")).unwrap();
        // Every name the next writes could pick, planted as links to the victim.
        let next = TEMP_SEQ.load(Ordering::Relaxed);
        // Twelve: fewer than the names tried, more than other tests take meanwhile.
        for n in next..next + 12 {
            let name = format!(".tartan-{}-{n}.part", std::process::id());
            symlink(l.victim.join("mb-other.json"), l.dest.join("mb-a").join(name)).unwrap();
        }
        write(&l.dest, "mb-a/file", b"artifact").unwrap();
        assert_eq!(std::fs::read(l.dest.join("mb-a/file")).unwrap(), b"artifact");
        victim_untouched(&l);
    }

    #[test]
    fn listing_shows_regular_files_only_and_never_through_a_link() {
        let l = layout();
        write(&l.dest, "mb-a/logs/build.1.log", b"12345").unwrap();
        symlink(l.victim.join("mb-other.json"), l.dest.join("mb-a/logs/build.2.log")).unwrap();
        std::fs::create_dir(l.dest.join("mb-a/logs/sub")).unwrap();
        assert_eq!(
            list_files(&l.dest.join("mb-a/logs")).unwrap(),
            vec![("build.1.log".to_string(), 5)]
        );
        assert!(list_files(&l.dest.join("mb-none/logs")).unwrap().is_empty());
        symlink(&l.victim, l.dest.join("mb-b")).unwrap();
        assert!(
            list_files(&l.dest.join("mb-b"))
                .unwrap_err()
                .contains("is a symbolic link")
        );
    }
}
