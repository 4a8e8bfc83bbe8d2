/*
 * Tartan's own stand-in for <os/activity.h> (see log.h beside it). tracing-oslog's C shim
 * includes it but uses none of it: the crate declares the activity functions it calls in Rust.
 */
#ifndef TARTAN_OS_ACTIVITY_H
#define TARTAN_OS_ACTIVITY_H
#endif
