//! The soft open-files limit is raised at start (its own test binary: it lowers the limit first,
//! which no other test may run under).

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use tartan_serve::{WANTED_OPEN_FILES, raise_open_files_limit};

#[test]
fn a_launchd_like_soft_limit_of_256_is_raised_toward_the_hard_limit() {
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if hard <= 256 {
        eprintln!("SKIPPED: the hard limit is {hard}, nothing to raise to");
        return;
    }
    setrlimit(Resource::RLIMIT_NOFILE, 256, hard).unwrap();
    let raised = raise_open_files_limit().unwrap();
    let want = hard.min(WANTED_OPEN_FILES);
    assert_eq!((raised.before, raised.after, raised.hard), (256, want, hard));
    assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (want, hard));
    // Again: nothing to do, nothing lowered.
    let again = raise_open_files_limit().unwrap();
    assert_eq!((again.before, again.after), (want, want));
}
