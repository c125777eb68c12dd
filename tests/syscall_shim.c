/* An LD_PRELOAD library for tests/test_scan.py (built by support_native.syscall_shim).
 *
 * While armed (shim_arm(1), through ctypes), every other openat, fstat, flock
 * and pread fails with EINTR before doing anything, as when a signal
 * interrupts the call, and the flags of every openat of a "nixl." name are
 * kept.  Both scans (store._scan and its twin) make these calls through the
 * C library's dynamic symbols, so both meet the same interruptions.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

enum { OPENAT, FSTAT, FLOCK, PREAD, CALLS };
#define MAX_OPENS 4096

static int armed;
static unsigned long calls[CALLS], interrupted[CALLS];
static int open_flags[MAX_OPENS], opens;

void shim_arm(int on) {
    armed = on;
    if (on) {
        memset(calls, 0, sizeof(calls));
        memset(interrupted, 0, sizeof(interrupted));
        opens = 0;
    }
}

unsigned long shim_interrupted(int call) { return call >= 0 && call < CALLS ? interrupted[call] : 0; }
int shim_opens(void) { return opens; }
int shim_open_flags(int i) { return i >= 0 && i < opens ? open_flags[i] : -1; }

/* Whether this call is one to fail (every other one while armed, starting with the first). */
static int interrupt(int call) {
    if (!armed || calls[call]++ % 2)
        return 0;
    interrupted[call]++;
    errno = EINTR;
    return 1;
}

static void note_open(const char *path, int flags) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (armed && strncmp(base, "nixl.", 5) == 0 && opens < MAX_OPENS)
        open_flags[opens++] = flags;
}

/* The C library's own function `name`, of type `type`, as next_. */
#define NEXT(type, name) static type next_; if (!next_) next_ = (type)dlsym(RTLD_NEXT, name)

typedef int (*openat_fn)(int, const char *, int, ...);
typedef int (*fstat_fn)(int, struct stat *);
typedef int (*fstat64_fn)(int, struct stat64 *);
typedef int (*flock_fn)(int, int);
typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);
typedef ssize_t (*pread64_fn)(int, void *, size_t, off64_t);
static int shim_openat(openat_fn next, int dir_fd, const char *path, int flags, va_list args) {
    mode_t mode = (flags & O_CREAT) || (flags & __O_TMPFILE) == __O_TMPFILE ? (mode_t)va_arg(args, int) : 0;
    if (interrupt(OPENAT))
        return -1;
    note_open(path, flags);
    return next(dir_fd, path, flags, mode);
}

/* openat and openat64 (what a build with 64-bit offsets calls): the same wrapper. */
#define OPENAT(symbol)                                                \
    int symbol(int dir_fd, const char *path, int flags, ...) {        \
        NEXT(openat_fn, #symbol);                                     \
        va_list args;                                                 \
        va_start(args, flags);                                        \
        int fd = shim_openat(next_, dir_fd, path, flags, args);       \
        va_end(args);                                                 \
        return fd;                                                    \
    }
OPENAT(openat)
OPENAT(openat64)

int fstat(int fd, struct stat *st) {
    NEXT(fstat_fn, "fstat");
    return interrupt(FSTAT) ? -1 : next_(fd, st);
}

int fstat64(int fd, struct stat64 *st) {
    NEXT(fstat64_fn, "fstat64");
    return interrupt(FSTAT) ? -1 : next_(fd, st);
}

int flock(int fd, int operation) {
    NEXT(flock_fn, "flock");
    return interrupt(FLOCK) ? -1 : next_(fd, operation);
}

ssize_t pread(int fd, void *buf, size_t count, off_t offset) {
    NEXT(pread_fn, "pread");
    return interrupt(PREAD) ? -1 : next_(fd, buf, count, offset);
}

ssize_t pread64(int fd, void *buf, size_t count, off64_t offset) {
    NEXT(pread64_fn, "pread64");
    return interrupt(PREAD) ? -1 : next_(fd, buf, count, offset);
}
