//! tart driver.
