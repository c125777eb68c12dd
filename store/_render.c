/* store._render: fill a scrape's exposition templates with the stores' words,
 * with the GIL released.
 *
 * app/exposition.py's Renderer keeps, per store and metric family, one
 * %-template of that store's sample lines ("name{labels} %d\n" ..., a label
 * value's own '%' doubled); its Python loop fills them with the store's
 * values.  render() here does the same fill for every family and store of a
 * batch in one call: it gathers pointers to the templates and words while
 * holding the GIL (no allocation per store), writes every family's lines
 * without it, and hands back one bytes object per family (a scrape renders
 * its stores a batch at a time, and the body is every family's batches in
 * turn: app/exposition.py).  Everything read without the GIL is owned by the
 * call: the caller's lists are copied into tuples first (another thread may
 * mutate them meanwhile), and each store's words are a buffer export.  The
 * Python loop stays the reference (and is used where this is not built); the
 * tests compare both byte for byte.
 *
 * Numbers are spelt as the C++ plug-in (prometheus-cpp) spells them: bucket
 * and count values as integers; counters, gauges and histogram sums are u64s
 * converted to double, which is the integer itself up to 2**53 and "%.16g"
 * beyond.  A cumulative bucket count past 2**64 (a forged store) makes
 * render() return None: the Python loop, with unbounded integers, renders it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define STORE_WORDS (6800 / 8)
#define MAX_LINE_VALUES 64      /* a family's values per store: at most 33 buckets + count + sum */
#define MAX_NUMBER 32           /* the longest number written: 20 digits, or 16 and an exponent */
#define EXACT_LIMIT (1ULL << 53)

enum { KIND_VALUES = 0, KIND_HISTOGRAM = 1 };

typedef struct {
    int kind;
    Py_ssize_t nwords;
    Py_ssize_t words[MAX_LINE_VALUES];  /* VALUES: one word per line; HISTOGRAM: first bucket, sum */
} Family;

static char *write_u64(char *out, uint64_t v) {
    char digits[20];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *out++ = digits[--n];
    return out;
}

/* A counter's, gauge's or sum's u64 as prometheus-cpp writes the double it
 * becomes: printf's "%.16g".  Not printf itself: its decimal point follows
 * the host's locale.  Beyond 2**53 the double is an integer D of 16 to 20
 * digits, a multiple of 2 (of 2048 at 20 digits), so the digits past the 16th
 * are never exactly half-way: rounding to 16 significant digits is rounding
 * half up on the 17th digit.  Then written as %g writes an exponent of 16 or
 * more, "d.ddd...e+XX" without trailing zeros. */
static char *write_as_double(char *out, uint64_t v) {
    if (v <= EXACT_LIMIT)
        return write_u64(out, v);
    double d = (double)v;
    char digits[24];
    int n = 0;
    if (d >= 18446744073709551616.0) {  /* rounded up to 2**64, which no u64 holds */
        memcpy(digits, "18446744073709551616", 20);
        n = 20;
    } else {
        n = (int)(write_u64(digits, (uint64_t)d) - digits);
    }
    if (n <= 16)
        return (char *)memcpy(out, digits, (size_t)n) + n;
    int exponent = n - 1;
    if (digits[16] >= '5') {
        int i = 15;
        while (i >= 0 && digits[i] == '9')
            digits[i--] = '0';
        if (i < 0) {  /* 9999999999999999x -> 1000000000000000, one more digit */
            digits[0] = '1';
            exponent++;
        } else {
            digits[i]++;
        }
    }
    int last = 15;
    while (last > 0 && digits[last] == '0')
        last--;
    *out++ = digits[0];
    if (last > 0) {
        *out++ = '.';
        memcpy(out, digits + 1, (size_t)last);
        out += last;
    }
    *out++ = 'e';
    *out++ = '+';
    *out++ = (char)('0' + exponent / 10);
    *out++ = (char)('0' + exponent % 10);
    return out;
}

/* Copy one template, replacing its n-th placeholder ("%d" or "%s") with the
 * n-th value and "%%" with "%".  Returns the end, or NULL if the template does
 * not have exactly `count` placeholders. */
static char *fill(char *out, const char *tmpl, Py_ssize_t len, const uint64_t *values, const char *as_double,
                  int count) {
    const char *p = tmpl, *end = tmpl + len;
    int used = 0;
    while (p < end) {
        const char *pct = memchr(p, '%', (size_t)(end - p));
        if (pct == NULL || pct + 1 >= end) {
            memcpy(out, p, (size_t)(end - p));
            out += end - p;
            break;
        }
        memcpy(out, p, (size_t)(pct - p));
        out += pct - p;
        if (pct[1] == '%') {
            *out++ = '%';
        } else {
            if (used == count)
                return NULL;
            out = as_double[used] ? write_as_double(out, values[used]) : write_u64(out, values[used]);
            used++;
        }
        p = pct + 2;
    }
    return used == count ? out : NULL;
}

typedef struct {
    Py_ssize_t nstores, nfamilies;
    Family *families;
    Py_buffer *words;     /* per store */
    Py_ssize_t *buckets;  /* per store: bucket words per histogram (bounds + 1) */
    const char **tmpl;    /* [store * nfamilies + family] */
    Py_ssize_t *tmpl_len;
    char **out;           /* per family: where its lines go (sized by the caller) */
    Py_ssize_t *len;      /* per family: how long they came out */
} Job;

/* Write each family's lines into its out; 0, or -1 if a template did not
 * match its values or a cumulative count overflowed. */
static int run(const Job *job) {
    uint64_t values[MAX_LINE_VALUES];
    char as_double[MAX_LINE_VALUES];
    for (Py_ssize_t f = 0; f < job->nfamilies; f++) {
        const Family *fam = &job->families[f];
        char *out = job->out[f];
        for (Py_ssize_t s = 0; s < job->nstores; s++) {
            const uint64_t *w = job->words[s].buf;
            int count;
            if (fam->kind == KIND_HISTOGRAM) {
                Py_ssize_t nb = job->buckets[s], first = fam->words[0];
                uint64_t total = 0;
                for (Py_ssize_t b = 0; b < nb; b++) {
                    if (__builtin_add_overflow(total, w[first + b], &total))
                        return -1;
                    values[b] = total;
                    as_double[b] = 0;
                }
                values[nb] = total;  /* _count */
                as_double[nb] = 0;
                values[nb + 1] = w[fam->words[1]];  /* _sum */
                as_double[nb + 1] = 1;
                count = (int)nb + 2;
            } else {
                for (Py_ssize_t j = 0; j < fam->nwords; j++) {
                    values[j] = w[fam->words[j]];
                    as_double[j] = 1;
                }
                count = (int)fam->nwords;
            }
            Py_ssize_t at = s * job->nfamilies + f;
            out = fill(out, job->tmpl[at], job->tmpl_len[at], values, as_double, count);
            if (out == NULL)
                return -1;
        }
        job->len[f] = out - job->out[f];
    }
    return 0;
}

static int parse_families(PyObject *plan, Job *job) {
    job->nfamilies = PyTuple_GET_SIZE(plan);
    job->families = PyMem_Calloc((size_t)job->nfamilies, sizeof(Family));
    if (job->families == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t f = 0; f < job->nfamilies; f++) {
        Family *fam = &job->families[f];
        PyObject *entry = PyTuple_GET_ITEM(plan, f), *words;
        if (!PyTuple_Check(entry) || !PyArg_ParseTuple(entry, "iO!", &fam->kind, &PyTuple_Type, &words))
            goto bad;
        fam->nwords = PyTuple_GET_SIZE(words);
        if (fam->nwords > MAX_LINE_VALUES || (fam->kind == KIND_HISTOGRAM && fam->nwords != 2)
            || (fam->kind != KIND_HISTOGRAM && fam->kind != KIND_VALUES))
            goto bad;
        for (Py_ssize_t j = 0; j < fam->nwords; j++) {
            fam->words[j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(words, j));
            if (fam->words[j] < 0 || fam->words[j] >= STORE_WORDS)
                goto bad;
        }
    }
    return 0;
bad:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "render: a malformed family plan");
    return -1;
}

static PyObject *render(PyObject *module, PyObject *args) {
    PyObject *plan, *words_of, *buckets_of, *smalls_of;
    if (!PyArg_ParseTuple(args, "O!O!O!O!:render", &PyTuple_Type, &plan, &PyList_Type, &words_of,
                          &PyList_Type, &buckets_of, &PyList_Type, &smalls_of))
        return NULL;
    Job job = {0};
    Py_ssize_t *bound = NULL;
    PyObject *result = NULL;
    Py_ssize_t acquired = 0;
    /* Our own references: the templates are read without the GIL, while the caller's lists are
     * not ours (and a buffer export may run Python code that changes them). */
    PyObject *words = PyList_AsTuple(words_of);
    PyObject *buckets = words ? PyList_AsTuple(buckets_of) : NULL;
    PyObject *templates = buckets ? PyList_AsTuple(smalls_of) : NULL;
    if (templates == NULL)
        goto done;
    job.nstores = PyTuple_GET_SIZE(words);
    if (PyTuple_GET_SIZE(buckets) != job.nstores || PyTuple_GET_SIZE(templates) != job.nstores) {
        PyErr_SetString(PyExc_ValueError, "render: words, buckets and templates differ in length");
        goto done;
    }
    if (parse_families(plan, &job) != 0)
        goto done;
    job.words = PyMem_Calloc((size_t)job.nstores + 1, sizeof(Py_buffer));
    job.buckets = PyMem_Calloc((size_t)job.nstores + 1, sizeof(Py_ssize_t));
    job.tmpl = PyMem_Calloc((size_t)(job.nstores * job.nfamilies) + 1, sizeof(char *));
    job.tmpl_len = PyMem_Calloc((size_t)(job.nstores * job.nfamilies) + 1, sizeof(Py_ssize_t));
    job.out = PyMem_Calloc((size_t)job.nfamilies + 1, sizeof(char *));
    job.len = PyMem_Calloc((size_t)job.nfamilies + 1, sizeof(Py_ssize_t));
    bound = PyMem_Calloc((size_t)job.nfamilies + 1, sizeof(Py_ssize_t));
    if (!job.words || !job.buckets || !job.tmpl || !job.tmpl_len || !job.out || !job.len || !bound) {
        PyErr_NoMemory();
        goto done;
    }
    /* Each family's bound: every template byte, plus MAX_NUMBER per value it takes. */
    for (Py_ssize_t s = 0; s < job.nstores; s++) {
        /* The buffer export also keeps the words array from being resized meanwhile. */
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(words, s), &job.words[s], PyBUF_SIMPLE) != 0)
            goto done;
        acquired++;
        job.buckets[s] = PyLong_AsSsize_t(PyTuple_GET_ITEM(buckets, s));
        PyObject *smalls = PyTuple_GET_ITEM(templates, s);
        /* Words are read as u64s: a misaligned buffer (a memoryview sliced at an odd offset) is refused. */
        if (job.words[s].len < STORE_WORDS * 8 || (uintptr_t)job.words[s].buf % _Alignof(uint64_t)
            || job.buckets[s] < 1 || job.buckets[s] > MAX_LINE_VALUES - 2
            || !PyTuple_Check(smalls) || PyTuple_GET_SIZE(smalls) != job.nfamilies) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "render: a malformed store");
            goto done;
        }
        for (Py_ssize_t f = 0; f < job.nfamilies; f++) {
            PyObject *t = PyTuple_GET_ITEM(smalls, f);
            const Family *fam = &job.families[f];
            if (!PyBytes_Check(t)) {
                PyErr_SetString(PyExc_TypeError, "render: a template is not bytes");
                goto done;
            }
            Py_ssize_t first = fam->words[0];
            if (fam->kind == KIND_HISTOGRAM && first + job.buckets[s] > STORE_WORDS) {
                PyErr_SetString(PyExc_ValueError, "render: a histogram runs past the store");
                goto done;
            }
            job.tmpl[s * job.nfamilies + f] = PyBytes_AS_STRING(t);
            job.tmpl_len[s * job.nfamilies + f] = PyBytes_GET_SIZE(t);
            bound[f] += PyBytes_GET_SIZE(t)
                + MAX_NUMBER * (fam->kind == KIND_HISTOGRAM ? job.buckets[s] + 2 : fam->nwords);
        }
    }
    /* Written straight into the bytes objects (nobody else can see them yet),
     * then shrunk: the lines are neither copied nor faulted in twice. */
    if ((result = PyTuple_New(job.nfamilies)) == NULL)
        goto done;
    for (Py_ssize_t f = 0; f < job.nfamilies; f++) {
        /* (one byte more: never the shared empty bytes, which must not be resized) */
        PyObject *lines = PyBytes_FromStringAndSize(NULL, bound[f] + 1);
        if (lines == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyTuple_SET_ITEM(result, f, lines);
        job.out[f] = PyBytes_AS_STRING(lines);
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run(&job);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        Py_SETREF(result, Py_NewRef(Py_None));
        goto done;
    }
    for (Py_ssize_t f = 0; f < job.nfamilies; f++) {
        /* (the tuple is ours alone: its items may still be resized in place) */
        PyObject *lines = PyTuple_GET_ITEM(result, f);
        if (_PyBytes_Resize(&lines, job.len[f]) != 0) {  /* on failure: lines is freed and the error set */
            PyTuple_SET_ITEM(result, f, NULL);
            Py_CLEAR(result);
            goto done;
        }
        PyTuple_SET_ITEM(result, f, lines);
    }
done:
    PyMem_Free(bound);
    PyMem_Free(job.out);
    PyMem_Free(job.len);
    for (Py_ssize_t s = 0; s < acquired; s++)
        PyBuffer_Release(&job.words[s]);
    PyMem_Free(job.families);
    PyMem_Free(job.words);
    PyMem_Free(job.buckets);
    PyMem_Free(job.tmpl);
    PyMem_Free(job.tmpl_len);
    Py_XDECREF(words);
    Py_XDECREF(buckets);
    Py_XDECREF(templates);
    return result;
}

static PyMethodDef methods[] = {
    {"render", render, METH_VARARGS,
     "render(plan, words_of, buckets_of, smalls_of) -> one bytes per family, or None to let the Python loop "
     "do it; see app/exposition.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "store._render", NULL, -1, methods, NULL, NULL, NULL,
                                    NULL};

PyMODINIT_FUNC PyInit__render(void) { return PyModule_Create(&module); }
