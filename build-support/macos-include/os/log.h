/*
 * Tartan's own minimal <os/log.h>, for checking and linking the agent for macOS on a machine
 * without Apple's SDK (scripts/check-mac, scripts/release). It is not Apple's header: it declares
 * only what tracing-oslog's C shim (its wrapper.c) uses, from the ABI of libsystem_trace (part of
 * libSystem on macOS 10.12 and later) and clang's os_log builtins. On a Mac with Xcode the SDK's
 * header is used instead (nothing passes this directory there).
 */
#ifndef TARTAN_OS_LOG_H
#define TARTAN_OS_LOG_H

#include <stdbool.h>
#include <stdint.h>

/* An opaque log handle, as returned by os_log_create. */
typedef struct os_log_s *os_log_t;

/* The level of one message; the values are libsystem_trace's. */
typedef uint8_t os_log_type_t;
#define OS_LOG_TYPE_DEFAULT ((os_log_type_t)0x00)
#define OS_LOG_TYPE_INFO ((os_log_type_t)0x01)
#define OS_LOG_TYPE_DEBUG ((os_log_type_t)0x02)
#define OS_LOG_TYPE_ERROR ((os_log_type_t)0x10)
#define OS_LOG_TYPE_FAULT ((os_log_type_t)0x11)

/* The process-wide default log is the address of this libsystem_trace object. */
extern struct os_log_s _os_log_default;
#define OS_LOG_DEFAULT ((os_log_t)&_os_log_default)

/* Set by the linker to the Mach header of the image that refers to it: libsystem_trace resolves
 * a message's format string relative to it, so it must be the header of the image whose
 * __TEXT holds the string. */
extern struct mach_header __dso_handle;

bool os_log_type_enabled(os_log_t log, os_log_type_t type);

/* Records one message: FORMAT lies in the caller's image (see __dso_handle), BUF holds the
 * arguments as encoded by __builtin_os_log_format, SIZE is its length in bytes. */
void _os_log_impl(void *dso, os_log_t log, os_log_type_t type, const char *format, uint8_t *buf,
                  uint32_t size);

/*
 * Logs FORMAT (a string literal) with its arguments at TYPE. The format string goes to the
 * __TEXT,__oslogstring section, where the logging system reads format strings from the binary;
 * the arguments are encoded into a buffer on the stack by clang's builtins, sized at compile time.
 */
#define os_log_with_type(log, type, format, ...)                                                   \
    __extension__({                                                                                \
        os_log_t tartan_oslog_log = (log);                                                         \
        os_log_type_t tartan_oslog_type = (type);                                                  \
        if (os_log_type_enabled(tartan_oslog_log, tartan_oslog_type)) {                            \
            static const char tartan_oslog_format[]                                                \
                __attribute__((section("__TEXT,__oslogstring,cstring_literals"))) = format;        \
            uint8_t tartan_oslog_buf[__builtin_os_log_format_buffer_size(format, ##__VA_ARGS__)]   \
                __attribute__((aligned(16)));                                                      \
            __builtin_os_log_format(tartan_oslog_buf, format, ##__VA_ARGS__);                      \
            _os_log_impl((void *)&__dso_handle, tartan_oslog_log, tartan_oslog_type,               \
                         tartan_oslog_format, tartan_oslog_buf,                                    \
                         (uint32_t)sizeof(tartan_oslog_buf));                                      \
        }                                                                                          \
    })

#endif
