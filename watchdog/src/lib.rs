//! watchdog.
