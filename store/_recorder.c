/**
 * store._recorder
 * ~~~~~~~~~~~~~~~
 *
 * C implementation of the recording hot path.  Used instead of the Python
 * closures of store/recorders.py (and the Python entry points of
 * app/rank/recording.py) when compiled; both behave the same, byte for byte.
 *
 * Store      one agent's mapped store: record(event, value) and
 *            transfer(xfer, post, nbytes, is_write), each returning the
 *            CLOCK_MONOTONIC ns it stamped as the store's heartbeat.
 * Recording  base type of app's Exporter: export_event and record_transfer
 *            as C methods, so the Python method layer is not paid per event;
 *            they call back into Python (self._on_deadline()) only once the
 *            re-election deadline self._next_claim_ns has passed.  Without a
 *            Store bound they hand over to the Python twin (_*_py methods).
 *
 * Every error is raised by the Python validators (install()), so messages
 * are shared: C only recognises the common valid case.  Every word update is
 * one relaxed 8-byte atomic operation on the shared mapping, as in NIXL's
 * C++ plug-in: a reader never sees a torn word, and threads never lose an
 * update, GIL or not.  While a Store is detached (closed, forked child,
 * store being recreated) events go to its Python `detached` callables.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <time.h>

/* Must match store/layout.py (checked by store/recorders.py at load). */
#define SLOTS 21
#define MAX_BUCKETS 32
#define STORE_SIZE 6800
#define W_LAST_UPDATE 3
#define W_COUNTERS 94
#define W_GAUGES 115
#define W_BUCKETS 136
#define W_SUMS 829
#define BUCKET_SLOTS (MAX_BUCKETS + 1)
#define XFER_TIME 6
#define POST_TIME 7

/* What an event slot feeds (store/recorders.py: kinds()). */
enum { OFF, COUNTER, GAUGE, HISTOGRAM };

/* The Python validators: event_type(ev), event_value(v), transfer_direction(w). */
static PyObject *event_type, *event_value, *transfer_direction;
static PyObject *str_on_deadline, *str_export_event_py, *str_record_transfer_py;

typedef struct {
	PyObject_HEAD
	uint64_t *words;                /* NULL while detached */
	Py_buffer view;                 /* keeps the mapping exported while attached */
	uint64_t bounds[MAX_BUCKETS];   /* floor of each bound, saturated at 2**64-1 */
	Py_ssize_t nbounds;
	unsigned char kind[SLOTS];
	PyObject *detached;             /* (event, value) -> heartbeat */
	PyObject *detached_transfer;    /* (xfer, post, nbytes, is_write) -> heartbeat */
} Store;

static PyTypeObject Store_Type;

static int64_t
now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#define ADD(s, i, v) __atomic_fetch_add(&(s)->words[i], (v), __ATOMIC_RELAXED)
#define SET(s, i, v) __atomic_store_n(&(s)->words[i], (v), __ATOMIC_RELAXED)

/* bisect.bisect_left: on sorted bounds (Store_new refuses others) that is
 * the number of bounds below the value.  Counted without branches: transfer
 * times are random, and a mispredicted branch per bisection step would cost
 * more than the rest of the event. */
static Py_ssize_t
bucket_of(const Store *s, uint64_t value)
{
	Py_ssize_t i, below = 0;
	for (i = 0; i < s->nbounds; i++)
		below += s->bounds[i] < value;
	return below;
}

/* Apply one validated event to an attached store (no heartbeat). */
static void
apply(const Store *s, int ev, uint64_t value)
{
	switch (s->kind[ev]) {
	case HISTOGRAM:
		ADD(s, W_SUMS + ev, value);
		ADD(s, W_BUCKETS + ev * BUCKET_SLOTS + bucket_of(s, value), 1);
		/* fall through */
	case GAUGE:
		SET(s, W_GAUGES + ev, value);
		/* fall through */
	case COUNTER:
		ADD(s, W_COUNTERS + ev, value);
	}
}

/* validator(arg), holding the validator: a call of install() from Python
 * code it runs would otherwise free it mid-call. */
static PyObject *
validate(PyObject *validator, PyObject *arg)
{
	PyObject *res;
	if (!validator) {
		PyErr_SetString(PyExc_RuntimeError, "store._recorder: install() was not called");
		return NULL;
	}
	Py_INCREF(validator);
	res = PyObject_CallOneArg(validator, arg);
	Py_DECREF(validator);
	return res;
}

/* An event type as a slot number, or -1 with the validator's error set.  A
 * validator that returns what is not a slot (rather than raising) gets the
 * event refused all the same. */
static int
slot_of(PyObject *event)
{
	long ev;
	PyObject *checked;
	if (PyLong_Check(event) && !PyBool_Check(event)) {
		ev = PyLong_AsLong(event);
		if (ev >= 0 && ev < SLOTS)
			return (int)ev;
		PyErr_Clear();
	}
	checked = validate(event_type, event);  /* raises */
	if (!checked)
		return -1;
	ev = PyLong_AsLong(checked);
	Py_DECREF(checked);
	if (ev >= 0 && ev < SLOTS)
		return (int)ev;
	if (!PyErr_Occurred())
		PyErr_Format(PyExc_ValueError, "unknown event type %R (valid: slots 0..%d)", event, SLOTS - 1);
	return -1;
}

/* An event value as a u64; 0 with *ok = 0 and the validator's error set. */
static uint64_t
value_of(PyObject *value, int *ok)
{
	uint64_t v;
	PyObject *checked;
	*ok = 1;
	if (PyLong_CheckExact(value)) {
		v = PyLong_AsUnsignedLongLong(value);
		if (v != (uint64_t)-1 || !PyErr_Occurred())
			return v;
		PyErr_Clear();
	}
	checked = validate(event_value, value);  /* raises, or an int in range */
	if (!checked) {
		*ok = 0;
		return 0;
	}
	v = PyLong_AsUnsignedLongLong(checked);
	Py_DECREF(checked);
	if (v == (uint64_t)-1 && PyErr_Occurred())
		*ok = 0;
	return v;
}

/* Heartbeat of a detached store's Python fallback, or -1 on error.  NULL
 * once the collector cleared the Store (a finalizer can still reach it). */
static int64_t
call_detached(PyObject *callable, PyObject *const *args, size_t nargs)
{
	int64_t t;
	PyObject *res;
	if (!callable) {
		PyErr_SetString(PyExc_RuntimeError, "store._recorder.Store was cleared");
		return -1;
	}
	Py_INCREF(callable);
	res = PyObject_Vectorcall(callable, args, nargs, NULL);
	Py_DECREF(callable);
	if (!res)
		return -1;
	t = PyLong_AsLongLong(res);
	Py_DECREF(res);
	return t;
}

static int64_t
store_record(Store *s, PyObject *event, PyObject *value)
{
	int ok, ev = slot_of(event);
	uint64_t v;
	int64_t t;
	PyObject *args[2];
	if (ev < 0)
		return -1;
	v = value_of(value, &ok);
	if (!ok)
		return -1;
	if (!s->words) {
		args[0] = event;
		args[1] = value;
		return call_detached(s->detached, args, 2);
	}
	t = now_ns();
	if (s->kind[ev] != OFF) {
		apply(s, ev, v);
		SET(s, W_LAST_UPDATE, (uint64_t)t);
	}
	return t;
}

static int64_t
store_transfer(Store *s, PyObject *const *args)
{
	int ok, is_write, ev;
	uint64_t xfer, post, nbytes;
	int64_t t;
	PyObject *checked;
	if (args[3] == Py_True)
		is_write = 1;
	else if (args[3] == Py_False)
		is_write = 0;
	else {
		/* The validator raises; should it return, its answer must be a bool too. */
		checked = validate(transfer_direction, args[3]);
		if (!checked)
			return -1;
		is_write = checked == Py_True;
		if (!is_write && checked != Py_False) {
			PyErr_Format(PyExc_TypeError, "is_write must be a bool, got %.100s %R",
				     Py_TYPE(args[3])->tp_name, args[3]);
			Py_DECREF(checked);
			return -1;
		}
		Py_DECREF(checked);
	}
	xfer = value_of(args[0], &ok);
	if (ok)
		post = value_of(args[1], &ok);
	if (ok)
		nbytes = value_of(args[2], &ok);
	if (!ok)
		return -1;
	if (!s->words)
		return call_detached(s->detached_transfer, args, 4);
	/* TX_BYTES/TX_REQUESTS_NUM (0, 2) for a write, RX_* (1, 3) otherwise. */
	ev = is_write ? 0 : 1;
	t = now_ns();
	if (s->kind[ev] | s->kind[ev + 2] | s->kind[POST_TIME] | s->kind[XFER_TIME]) {
		apply(s, ev, nbytes);
		apply(s, ev + 2, 1);
		apply(s, POST_TIME, post);
		apply(s, XFER_TIME, xfer);
		SET(s, W_LAST_UPDATE, (uint64_t)t);
	}
	return t;
}

/* -- Store ------------------------------------------------------------- */

static PyObject *
Store_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
	Store *s;
	PyObject *bounds, *detached, *detached_transfer;
	const char *kind;
	Py_ssize_t nkind, i;
	static char *kwlist[] = {"bounds", "kinds", "detached", "detached_transfer", NULL};
	if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!y#OO:Store", kwlist, &PyTuple_Type, &bounds,
					 &kind, &nkind, &detached, &detached_transfer))
		return NULL;
	if (nkind != SLOTS || PyTuple_GET_SIZE(bounds) > MAX_BUCKETS) {
		PyErr_SetString(PyExc_ValueError, "Store: 21 kinds and at most 32 bounds");
		return NULL;
	}
	s = PyObject_GC_New(Store, type);
	if (!s)
		return NULL;
	s->words = NULL;
	s->detached = s->detached_transfer = NULL;  /* before any early Py_DECREF(s) */
	s->nbounds = PyTuple_GET_SIZE(bounds);
	memcpy(s->kind, kind, SLOTS);
	for (i = 0; i < s->nbounds; i++) {
		/* Floors >= 2**64 saturate: every u64 value is <= them, as in Python. */
		int overflow;
		long long b = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(bounds, i), &overflow);
		if (b == -1 && PyErr_Occurred()) {  /* not an integer: its own TypeError */
			Py_DECREF(s);
			return NULL;
		} else if (overflow > 0)
			s->bounds[i] = UINT64_MAX;
		else if (overflow < 0 || b < 0) {
			PyErr_SetString(PyExc_ValueError, "Store: bounds must be non-negative");
			Py_DECREF(s);
			return NULL;
		} else
			s->bounds[i] = (uint64_t)b;
		if (i && s->bounds[i] < s->bounds[i - 1]) {
			PyErr_SetString(PyExc_ValueError, "Store: bounds must be sorted");
			Py_DECREF(s);
			return NULL;
		}
	}
	Py_INCREF(detached);
	s->detached = detached;
	Py_INCREF(detached_transfer);
	s->detached_transfer = detached_transfer;
	PyObject_GC_Track(s);
	return (PyObject *)s;
}

static PyObject *
Store_attach(Store *s, PyObject *buffer)
{
	Py_buffer view;
	if (s->words) {
		PyErr_SetString(PyExc_RuntimeError, "Store is attached already");
		return NULL;
	}
	/* Into a local view: an exporter written in Python may attach this Store meanwhile. */
	if (PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE) < 0)
		return NULL;
	if (s->words) {
		PyBuffer_Release(&view);
		PyErr_SetString(PyExc_RuntimeError, "Store is attached already");
		return NULL;
	}
	if (view.len < STORE_SIZE || (uintptr_t)view.buf % 8) {
		PyBuffer_Release(&view);
		PyErr_SetString(PyExc_ValueError, "Store.attach needs a writable, 8-byte aligned store buffer");
		return NULL;
	}
	s->view = view;
	s->words = view.buf;
	Py_RETURN_NONE;
}

/* Stop writing (events go to the detached callables) and let go of the
 * mapping, so that it can be closed.  With the GIL held no event is halfway
 * through an update here. */
static void
release(Store *s)
{
	if (s->words) {
		s->words = NULL;
		PyBuffer_Release(&s->view);
	}
}

static PyObject *
Store_detach(Store *s, PyObject *unused)
{
	release(s);
	Py_RETURN_NONE;
}

static PyObject *
Store_record(Store *s, PyObject *const *args, Py_ssize_t nargs)
{
	int64_t t;
	if (!_PyArg_CheckPositional("record", nargs, 2, 2))
		return NULL;
	t = store_record(s, args[0], args[1]);
	return t < 0 ? NULL : PyLong_FromLongLong(t);
}

static PyObject *
Store_transfer(Store *s, PyObject *const *args, Py_ssize_t nargs)
{
	int64_t t;
	if (!_PyArg_CheckPositional("transfer", nargs, 4, 4))
		return NULL;
	t = store_transfer(s, args);
	return t < 0 ? NULL : PyLong_FromLongLong(t);
}

static PyObject *
Store_attached(Store *s, void *closure)
{
	return PyBool_FromLong(s->words != NULL);
}

static int
Store_traverse(Store *s, visitproc visit, void *arg)
{
	Py_VISIT(s->detached);
	Py_VISIT(s->detached_transfer);
	return 0;
}

static int
Store_clear(Store *s)
{
	Py_CLEAR(s->detached);
	Py_CLEAR(s->detached_transfer);
	return 0;
}

static void
Store_dealloc(Store *s)
{
	PyObject_GC_UnTrack(s);
	release(s);
	Store_clear(s);
	PyObject_GC_Del(s);
}

static PyMethodDef Store_methods[] = {
	{"attach", (PyCFunction)Store_attach, METH_O, "attach(buffer): write into this store buffer."},
	{"detach", (PyCFunction)Store_detach, METH_NOARGS, "detach(): release the buffer; events go to `detached`."},
	{"record", (PyCFunction)(void (*)(void))Store_record, METH_FASTCALL,
	 "record(event, value) -> heartbeat ns"},
	{"transfer", (PyCFunction)(void (*)(void))Store_transfer, METH_FASTCALL,
	 "transfer(xfer_time_us, post_time_us, nbytes, is_write) -> heartbeat ns"},
	{NULL}
};

static PyGetSetDef Store_getset[] = {
	{"attached", (getter)Store_attached, NULL, "True while writing into a buffer.", NULL},
	{NULL}
};

static PyTypeObject Store_Type = {
	PyVarObject_HEAD_INIT(NULL, 0)
	.tp_name = "store._recorder.Store",
	.tp_basicsize = sizeof(Store),
	.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
	.tp_doc = "Store(bounds, kinds, detached, detached_transfer): one agent's store, recorded from C.",
	.tp_new = Store_new,
	.tp_dealloc = (destructor)Store_dealloc,
	.tp_traverse = (traverseproc)Store_traverse,
	.tp_clear = (inquiry)Store_clear,
	.tp_methods = Store_methods,
	.tp_getset = Store_getset,
};

/* -- Recording: the Exporter's entry points ----------------------------- */

typedef struct {
	PyObject_HEAD
	Store *store;
	unsigned long long next_claim_ns;
} Recording;

/* Past the deadline: self._on_deadline() (re-election, store checks). */
static PyObject *
after(Recording *self, int64_t t)
{
	PyObject *res;
	if (t < 0)
		return NULL;
	if ((unsigned long long)t < self->next_claim_ns)
		Py_RETURN_NONE;
	res = PyObject_CallMethodNoArgs((PyObject *)self, str_on_deadline);
	if (!res)
		return NULL;
	Py_DECREF(res);
	Py_RETURN_NONE;
}

/* No Store bound (the writer runs the Python path), keyword arguments or a
 * wrong count: the Python twin (which also raises the right TypeError). */
static PyObject *
python_twin(Recording *self, PyObject *name, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
	PyObject *stack[8] = {(PyObject *)self}, *res;
	Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
	Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
	PyObject **big = NULL, **all = stack;
	if (total + 1 > 8) {
		big = PyMem_Malloc((total + 1) * sizeof(PyObject *));
		if (!big)
			return PyErr_NoMemory();
		big[0] = (PyObject *)self;
		all = big;
	}
	memcpy(all + 1, args, total * sizeof(PyObject *));
	res = PyObject_VectorcallMethod(name, all, (nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
	PyMem_Free(big);
	return res;
}

static PyObject *
Recording_export_event(Recording *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
	Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
	Store *s = self->store;
	int64_t t;
	if (!s || kwnames || nargs != 2)
		return python_twin(self, str_export_event_py, args, nargsf, kwnames);
	/* Held for the call: the validators run Python code, which may rebind _store. */
	Py_INCREF(s);
	t = store_record(s, args[0], args[1]);
	Py_DECREF(s);
	return after(self, t);
}

static PyObject *
Recording_record_transfer(Recording *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
	Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
	Store *s = self->store;
	int64_t t;
	if (!s || kwnames || nargs != 4)
		return python_twin(self, str_record_transfer_py, args, nargsf, kwnames);
	Py_INCREF(s);  /* as in export_event */
	t = store_transfer(s, args);
	Py_DECREF(s);
	return after(self, t);
}

static PyObject *
Recording_get_store(Recording *self, void *closure)
{
	PyObject *store = self->store ? (PyObject *)self->store : Py_None;
	Py_INCREF(store);
	return store;
}

static int
Recording_set_store(Recording *self, PyObject *value, void *closure)
{
	if (!value || !PyObject_TypeCheck(value, &Store_Type)) {
		PyErr_SetString(PyExc_TypeError, "_store must be a store._recorder.Store");
		return -1;
	}
	Py_INCREF(value);
	Py_XSETREF(self->store, (Store *)value);
	return 0;
}

static int
Recording_traverse(Recording *self, visitproc visit, void *arg)
{
	Py_VISIT(self->store);
	return 0;
}

static int
Recording_clear(Recording *self)
{
	Py_CLEAR(self->store);
	return 0;
}

static void
Recording_dealloc(Recording *self)
{
	/* Untracked first: dropping the Store runs Python code (its callables'
	 * finalizers), and a collection that then found this object tracked
	 * would free it a second time.  A heap subclass's dealloc drops the
	 * type's reference (it re-tracks the object before calling this one). */
	PyObject_GC_UnTrack(self);
	Recording_clear(self);
	Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Recording_methods[] = {
	{"export_event", (PyCFunction)(void (*)(void))Recording_export_event, METH_FASTCALL | METH_KEYWORDS,
	 "export_event(event, value): record one event."},
	{"record_transfer", (PyCFunction)(void (*)(void))Recording_record_transfer, METH_FASTCALL | METH_KEYWORDS,
	 "record_transfer(xfer_time_us, post_time_us, nbytes, is_write): one completed transfer."},
	{NULL}
};

static PyMemberDef Recording_members[] = {
	{"_next_claim_ns", T_ULONGLONG, offsetof(Recording, next_claim_ns), 0,
	 "CLOCK_MONOTONIC ns from which an event calls self._on_deadline()."},
	{NULL}
};

static PyGetSetDef Recording_getset[] = {
	{"_store", (getter)Recording_get_store, (setter)Recording_set_store, "The Store events go to.", NULL},
	{NULL}
};

static PyTypeObject Recording_Type = {
	PyVarObject_HEAD_INIT(NULL, 0)
	.tp_name = "store._recorder.Recording",
	.tp_basicsize = sizeof(Recording),
	.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
	.tp_doc = "Base type of the Exporter: export_event and record_transfer in C.",
	.tp_new = PyType_GenericNew,
	.tp_dealloc = (destructor)Recording_dealloc,
	.tp_traverse = (traverseproc)Recording_traverse,
	.tp_clear = (inquiry)Recording_clear,
	.tp_methods = Recording_methods,
	.tp_members = Recording_members,
	.tp_getset = Recording_getset,
};

/* -- the module ---------------------------------------------------------- */

static PyObject *
install(PyObject *module, PyObject *args)
{
	PyObject *et, *ev, *td;
	if (!PyArg_ParseTuple(args, "OOO:install", &et, &ev, &td))
		return NULL;
	Py_INCREF(et);
	Py_XSETREF(event_type, et);
	Py_INCREF(ev);
	Py_XSETREF(event_value, ev);
	Py_INCREF(td);
	Py_XSETREF(transfer_direction, td);
	Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
	{"install", (PyCFunction)install, METH_VARARGS,
	 "install(event_type, event_value, transfer_direction): the validators that raise."},
	{NULL}
};

static struct PyModuleDef module_definition = {
	PyModuleDef_HEAD_INIT, "store._recorder", NULL, -1, module_methods
};

PyMODINIT_FUNC
PyInit__recorder(void)
{
	PyObject *module, *layout;
	if (PyType_Ready(&Store_Type) < 0 || PyType_Ready(&Recording_Type) < 0)
		return NULL;
	str_on_deadline = PyUnicode_InternFromString("_on_deadline");
	str_export_event_py = PyUnicode_InternFromString("_export_event_py");
	str_record_transfer_py = PyUnicode_InternFromString("_record_transfer_py");
	if (!str_on_deadline || !str_export_event_py || !str_record_transfer_py)
		return NULL;
	module = PyModule_Create(&module_definition);
	if (!module)
		return NULL;
	/* store/recorders.py refuses this module unless LAYOUT matches store/layout.py. */
	layout = Py_BuildValue("(iiiiiiii)", SLOTS, MAX_BUCKETS, STORE_SIZE, W_LAST_UPDATE, W_COUNTERS,
			       W_GAUGES, W_BUCKETS, W_SUMS);
	if (!layout || PyModule_AddObjectRef(module, "LAYOUT", layout) < 0
	    || PyModule_AddObjectRef(module, "Store", (PyObject *)&Store_Type) < 0
	    || PyModule_AddObjectRef(module, "Recording", (PyObject *)&Recording_Type) < 0) {
		Py_XDECREF(layout);
		Py_DECREF(module);
		return NULL;
	}
	Py_DECREF(layout);
	return module;
}
