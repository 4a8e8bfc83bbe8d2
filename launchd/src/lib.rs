//! launchd.
