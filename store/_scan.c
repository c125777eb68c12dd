/* store._scan: a scrape's directory scan with the GIL released once per batch.
 *
 * The collector's per-store system calls (open, fstat, flock probe, unlock,
 * pread, close) each release the GIL.  When a thread of the serving process
 * is busy in Python, every one of them then waits up to a switch interval
 * (5 ms) to take the GIL back, so a scrape of N stores costs N x 6 x 5 ms.
 * scan() lists the directory and reads its first batch of stores, read() each
 * later batch, each call in one Py_BEGIN_ALLOW_THREADS block, into C buffers,
 * and only then builds the Python objects: O(1) GIL hand-offs per batch,
 * whatever the file count, and one for a directory of one batch.  (A scrape reads its stores a batch at a time so that it never
 * holds every store's bytes at once: app/collector.py.)
 *
 * store/scan.py is the pure-Python twin and documents the result; the tests
 * prove both give identical results on the same directory.  Any change here
 * must be made there too.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define STORE_SIZE 6800
#define NAME_MAX_LEN 255

/* Outcomes: keep in step with store/scan.py. */
enum { OK = 0, MISSING = 1, FOREIGN = 2, NOT_REGULAR = 3, UNREADABLE = 4, SHORT = 5 };

/* What the scan keeps per store until the Python objects are built: only
 * what was read, so a directory of many short or foreign files costs little. */
typedef struct {
    const char *name;  /* the caller's (read() holds a reference to it) */
    int outcome;
    int err;       /* errno of the failed call, else 0 */
    int alive;     /* a writer holds the lock (or the probe failed) */
    unsigned long long uid, ino;  /* from fstat, else 0 */
    Py_ssize_t size;   /* bytes read (OK and SHORT) */
    char *data;        /* those bytes, malloc'ed; NULL when none */
} Entry;

/* As the twin's os calls (PEP 475): a call interrupted by a signal is made
 * again.  The signal's Python handler runs once the scan has returned. */
#define RETRY(rc, call) do (rc) = (call); while ((rc) < 0 && errno == EINTR)

/* A descriptor of ours is never 0, 1 or 2 (store/fds.py).  store.scan calls
 * this with 0-2 held open, so each lands at 3 or above; one that still lands
 * low (a direct caller, or a host thread that closed 0-2 meanwhile) is moved
 * to 3 or above at once. */
static int above_stdio(int fd) {
    if (fd < 0 || fd > 2)
        return fd;
    int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    int saved = errno;
    close(fd);
    errno = saved;
    return moved;
}

/* nixl.<pid>.<run_marker>.<instance>.mmap, each field one or more ASCII
 * digits: nothing else in the directory is ever opened (store.layout's
 * is_store_name). */
static int is_store_name(const char *s) {
    if (strncmp(s, "nixl.", 5) != 0)
        return 0;
    s += 5;
    for (int field = 0; field < 3; field++) {
        const char *start = s;
        while (*s >= '0' && *s <= '9')
            s++;
        if (s == start || *s != '.')
            return 0;
        s++;
    }
    return strcmp(s, "mmap") == 0;
}

/* One store: open without following links, blocking or taking a terminal
 * (a device node named like a store is opened, then never read), check it is
 * a regular file we own, probe the writer's lock, read it into `scratch`
 * (STORE_SIZE bytes).  Same order and same calls as the twin's _one(). */
static void scan_one(int dir_fd, Entry *e, uid_t euid, char *scratch) {
    int fd, rc;
    RETRY(fd, openat(dir_fd, e->name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
    fd = above_stdio(fd);
    if (fd < 0) {
        e->err = errno;
        e->outcome = errno == ENOENT ? MISSING : UNREADABLE;
        return;
    }
    struct stat st;
    RETRY(rc, fstat(fd, &st));
    if (rc != 0) {
        e->err = errno;
        e->outcome = UNREADABLE;
        close(fd);
        return;
    }
    e->uid = st.st_uid;
    e->ino = st.st_ino;
    if (!S_ISREG(st.st_mode)) {
        e->outcome = NOT_REGULAR;
    } else if (st.st_uid != euid) {
        e->outcome = FOREIGN;  /* never read: another user cannot inject series */
    } else {
        /* Probe before reading: a writer that dies in between then only makes
         * us publish values that were final anyway.  Any failure to take the
         * shared lock reads as alive: a false "dead" would get a live
         * writer's store reaped. */
        RETRY(rc, flock(fd, LOCK_SH | LOCK_NB));
        e->alive = rc != 0;  /* a lock we took goes with close() */
        ssize_t got;
        RETRY(got, pread(fd, scratch, STORE_SIZE, 0));
        if (got > 0) {  /* kept at its size: most of a scan's files may be short */
            if ((e->data = malloc((size_t)got)) != NULL) {
                memcpy(e->data, scratch, (size_t)got);
            } else {
                got = -1;
                errno = ENOMEM;
            }
        }
        if (got < 0) {
            e->err = errno;
            e->outcome = UNREADABLE;
            e->alive = 0;  /* as the twin: only a store that was read has a liveness */
        } else {
            e->size = got;
            e->outcome = got < STORE_SIZE ? SHORT : OK;
        }
    }
    close(fd);
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void free_names(char **names, size_t count) {
    for (size_t i = 0; i < count; i++)
        free(names[i]);
    free(names);
}

static int open_dir(const char *directory) {
    int dir_fd;
    RETRY(dir_fd, open(directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    return above_stdio(dir_fd);
}

/* The store names in the directory, sorted; on failure -1 with errno set
 * (nothing allocated).  Runs without the GIL: no Python API in here. */
static int list_dir(const char *directory, char ***out, size_t *out_count) {
    int dir_fd = open_dir(directory);
    if (dir_fd < 0)
        return -1;
    DIR *dir = fdopendir(dir_fd);
    if (dir == NULL) {
        int saved = errno;
        close(dir_fd);
        errno = saved;
        return -1;
    }
    size_t count = 0, capacity = 64;
    char **names = malloc(capacity * sizeof(char *));
    int failed = names == NULL ? ENOMEM : 0;
    while (!failed) {
        errno = 0;
        struct dirent *d = readdir(dir);
        if (d == NULL) {
            failed = errno;
            break;
        }
        if (strlen(d->d_name) > NAME_MAX_LEN || !is_store_name(d->d_name))
            continue;
        if (count == capacity) {
            char **grown = realloc(names, 2 * capacity * sizeof(char *));
            if (grown == NULL) {
                failed = ENOMEM;
                break;
            }
            names = grown;
            capacity *= 2;
        }
        if ((names[count] = strdup(d->d_name)) == NULL) {
            failed = ENOMEM;
            break;
        }
        count++;
    }
    closedir(dir);
    if (failed) {
        free_names(names, names == NULL ? 0 : count);
        errno = failed;
        return -1;
    }
    qsort(names, count, sizeof(char *), by_name);
    *out = names;
    *out_count = count;
    return 0;
}

/* Read the given stores; on failure to open the directory -1 with errno set.
 * Runs without the GIL.  The directory's one descriptor serves every openat(),
 * so a process short of descriptors fails as the twin does: no store opened
 * without a second free descriptor. */
static int read_dir(const char *directory, Entry *entries, size_t count) {
    int dir_fd = open_dir(directory);
    if (dir_fd < 0)
        return -1;
    char *scratch = malloc(STORE_SIZE);
    if (scratch == NULL) {
        close(dir_fd);
        errno = ENOMEM;
        return -1;
    }
    uid_t euid = geteuid();
    for (size_t i = 0; i < count; i++)
        scan_one(dir_fd, &entries[i], euid, scratch);
    free(scratch);
    close(dir_fd);
    return 0;
}

static void free_data(Entry *entries, size_t count) {
    for (size_t i = 0; i < count; i++)
        free(entries[i].data);
    free(entries);
}

/* OSError for errno ``err`` (saved while the GIL was released) on ``filename``. */
static void os_error(int err, PyObject *filename) {
    errno = err;
    PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, filename);
}

/* One Entry as the twin's tuple: (name, outcome, errno, alive, uid, ino, data). */
static PyObject *entry_tuple(const Entry *e, PyObject *name) {
    PyObject *data = e->outcome != OK && e->outcome != SHORT ? Py_NewRef(Py_None)
        : PyBytes_FromStringAndSize(e->data, e->size);
    return data == NULL ? NULL : Py_BuildValue("(OiiOKKN)", name, e->outcome, e->err, e->alive ? Py_True : Py_False,
                                               e->uid, e->ino, data);
}

static PyObject *read_stores(PyObject *module, PyObject *args) {
    PyObject *directory, *names_list, *path_bytes = NULL, *result = NULL;
    if (!PyArg_ParseTuple(args, "OO!:read", &directory, &PyList_Type, &names_list))
        return NULL;
    /* Our own reference to the names: their UTF-8 is read without the GIL. */
    PyObject *names = PyList_AsTuple(names_list);
    if (names == NULL)
        return NULL;
    size_t count = (size_t)PyTuple_GET_SIZE(names);
    Entry *entries = calloc(count + 1, sizeof(Entry));
    if (entries == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < count; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, (Py_ssize_t)i);
        Py_ssize_t len;
        /* Only a store name is ever opened, whoever asks. */
        if (!PyUnicode_Check(name) || (entries[i].name = PyUnicode_AsUTF8AndSize(name, &len)) == NULL
            || len > NAME_MAX_LEN || (Py_ssize_t)strlen(entries[i].name) != len
            || !is_store_name(entries[i].name)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "read: %R is not a store name", name);
            goto done;
        }
    }
    if (!PyUnicode_FSConverter(directory, &path_bytes))
        goto done;
    int rc, saved_errno = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = read_dir(PyBytes_AS_STRING(path_bytes), entries, count);
    if (rc != 0)
        saved_errno = errno;
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        os_error(saved_errno, directory);
        goto done;
    }
    result = PyList_New((Py_ssize_t)count);
    for (size_t i = 0; result != NULL && i < count; i++) {
        PyObject *item = entry_tuple(&entries[i], PyTuple_GET_ITEM(names, (Py_ssize_t)i));
        if (item == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, (Py_ssize_t)i, item);
    }
done:
    if (entries != NULL)
        free_data(entries, count);
    Py_XDECREF(path_bytes);
    Py_DECREF(names);
    return result;
}

/* Whether two store names are of one pid ("nixl.<pid>." alike): a batch never
 * separates them (store/scan.py's batch_end). */
static int same_pid(const char *a, const char *b) {
    const char *dot = strchr(a + 5, '.');  /* a store name: "nixl." digits "." ... */
    return dot != NULL && strncmp(a, b, (size_t)(dot - a) + 1) == 0;
}

static PyObject *scan(PyObject *module, PyObject *args) {
    PyObject *directory, *path_bytes = NULL, *result = NULL;
    Py_ssize_t first;
    if (!PyArg_ParseTuple(args, "On:scan", &directory, &first))
        return NULL;
    if (!PyUnicode_FSConverter(directory, &path_bytes))
        return NULL;
    char **names = NULL;
    size_t count = 0, batch = 0;
    Entry *entries = NULL;
    int rc, saved_errno = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = list_dir(PyBytes_AS_STRING(path_bytes), &names, &count);
    if (rc == 0) {
        batch = first < 0 ? 0 : (size_t)first < count ? (size_t)first : count;
        while (batch > 0 && batch < count && same_pid(names[batch - 1], names[batch]))
            batch++;
        if ((entries = calloc(batch + 1, sizeof(Entry))) == NULL) {
            rc = -1;
            errno = ENOMEM;
        } else if (batch > 0) {
            for (size_t i = 0; i < batch; i++)
                entries[i].name = names[i];
            rc = read_dir(PyBytes_AS_STRING(path_bytes), entries, batch);
        }
    }
    if (rc != 0)
        saved_errno = errno;
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        os_error(saved_errno, directory);
        goto done;
    }
    PyObject *listed = PyList_New((Py_ssize_t)count), *first_read = listed ? PyList_New((Py_ssize_t)batch) : NULL;
    result = first_read ? PyTuple_Pack(2, listed, first_read) : NULL;
    Py_XDECREF(listed);
    Py_XDECREF(first_read);
    for (size_t i = 0; result != NULL && i < count; i++) {
        PyObject *name = PyUnicode_DecodeFSDefault(names[i]);
        if (name == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(listed, (Py_ssize_t)i, name);
    }
    for (size_t i = 0; result != NULL && i < batch; i++) {
        PyObject *item = entry_tuple(&entries[i], PyList_GET_ITEM(listed, (Py_ssize_t)i));
        if (item == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(first_read, (Py_ssize_t)i, item);
    }
done:
    if (entries != NULL)
        free_data(entries, batch);
    if (names != NULL)
        free_names(names, count);
    Py_DECREF(path_bytes);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(directory, first) -> (the store names in it, sorted; the first batch of them read); see store/scan.py"},
    {"read", read_stores, METH_VARARGS,
     "read(directory, names) -> list of (name, outcome, errno, alive, uid, ino, data); see store/scan.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "store._scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
