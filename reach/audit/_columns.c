/*
 * reach.audit._columns: the plain calls of an audit batch as C arrays.
 *
 * The same columns as reach/audit/columns.py (``Columns``), kept without one Python
 * object per call: times and latencies as doubles, names as two-byte indexes, call ids
 * and trace ids as UTF-8 text one after the other. Recording a call copies a few numbers
 * and two short texts; the objects it was handed are let go at once. A Python list per
 * column keeps every float and id of a batch (thousands of calls, a fraction of a second)
 * alive, spread over the heap, where the call path touches them once more only when the
 * batch is packed: measured, that costs the caller more than the recording itself.
 *
 * ``encode`` returns the very map ``Columns.encode`` returns (the batch format does not
 * change: schemas/audit-batch.schema.json); ``columns`` returns the columns as Python
 * sequences, for ``reach.audit.columns.plain_events``. Built by ``make build`` beside
 * the mypyc modules (setup.py); a pure install uses ``Columns`` instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* as in columns.py: bytes a plain event takes besides its two ids (an estimate), and
   how many names or candidate sets one batch may index (two-byte indexes) */
#define PLAIN_ROW_BYTES (4 * 8 + 4 * 2 + 2 * 3)
#define MAX_VALUES 0xFFFF
#define TRACE_HEX 32

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;   /* calls recorded */
    Py_ssize_t cap; /* room in each array */
    double *ts, *latency, *score, *attempt;
    uint16_t *caller, *caller_agent, *callee, *candidates;
    /* call i's id ends at call_end[i] in text, its trace id (which starts there) at
       trace_end[i]; call 0's id starts at 0 */
    char *text;
    Py_ssize_t text_len, text_cap;
    Py_ssize_t *call_end, *trace_end;
    /* every trace id so far is 32 lowercase hex digits (so 16 raw bytes say it) */
    int trace_hex;
    /* ids that are not UTF-8 (a lone surrogate), by slot (2 i: call id, 2 i + 1: trace
       id): kept as they are, and the batch is then written as rows (NULL: none) */
    PyObject *odd;
    PyObject *values;      /* list: the names the index columns point into */
    PyObject *value_index; /* dict: name -> index */
    PyObject *sets;        /* list of (names, count) */
    PyObject *set_index;   /* dict: (names, count) -> index */
    /* the names of the last call (owned references): a caller's own id, its callee's
       and the route cache's tuple of candidates are the same objects call after call */
    PyObject *last_caller, *last_callee, *last_names;
    Py_ssize_t last_caller_at, last_callee_at, last_set;
    long long last_count;
    Py_ssize_t size; /* estimated packed size */
} Columns;

static Py_ssize_t
text_bytes(PyObject *text)
{
    /* packed size at most (without its header), as columns.py's _text_bytes */
    Py_ssize_t len = PyUnicode_GET_LENGTH(text);
    return PyUnicode_IS_ASCII(text) ? len : 4 * len;
}

static PyObject *
Columns_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Columns() takes no arguments");
        return NULL;
    }
    Columns *self = (Columns *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->trace_hex = 1;
    self->last_count = -1;
    self->values = PyList_New(0);
    self->value_index = PyDict_New();
    self->sets = PyList_New(0);
    self->set_index = PyDict_New();
    if (!self->values || !self->value_index || !self->sets || !self->set_index) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void
Columns_dealloc(Columns *self)
{
    PyMem_Free(self->ts);
    PyMem_Free(self->latency);
    PyMem_Free(self->score);
    PyMem_Free(self->attempt);
    PyMem_Free(self->caller);
    PyMem_Free(self->caller_agent);
    PyMem_Free(self->callee);
    PyMem_Free(self->candidates);
    PyMem_Free(self->text);
    PyMem_Free(self->call_end);
    PyMem_Free(self->trace_end);
    Py_XDECREF(self->odd);
    Py_XDECREF(self->values);
    Py_XDECREF(self->value_index);
    Py_XDECREF(self->sets);
    Py_XDECREF(self->set_index);
    Py_XDECREF(self->last_caller);
    Py_XDECREF(self->last_callee);
    Py_XDECREF(self->last_names);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
grow(void **array, Py_ssize_t items, size_t item_size)
{
    void *bigger = PyMem_Realloc(*array, (size_t)items * item_size);
    if (bigger == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *array = bigger;
    return 0;
}

/* room for one more call in every array (nothing recorded changes if there is none) */
static int
reserve_row(Columns *self)
{
    if (self->n < self->cap)
        return 0;
    Py_ssize_t cap = self->cap ? 2 * self->cap : 256;
    if (grow((void **)&self->ts, cap, sizeof(double)) < 0 ||
        grow((void **)&self->latency, cap, sizeof(double)) < 0 ||
        grow((void **)&self->score, cap, sizeof(double)) < 0 ||
        grow((void **)&self->attempt, cap, sizeof(double)) < 0 ||
        grow((void **)&self->caller, cap, sizeof(uint16_t)) < 0 ||
        grow((void **)&self->caller_agent, cap, sizeof(uint16_t)) < 0 ||
        grow((void **)&self->callee, cap, sizeof(uint16_t)) < 0 ||
        grow((void **)&self->candidates, cap, sizeof(uint16_t)) < 0 ||
        grow((void **)&self->call_end, cap, sizeof(Py_ssize_t)) < 0 ||
        grow((void **)&self->trace_end, cap, sizeof(Py_ssize_t)) < 0)
        return -1;
    self->cap = cap;
    return 0;
}

/* appends ``text``'s UTF-8 to the text (1), or keeps it in ``odd`` when it has none (0) */
static int
put_text(Columns *self, PyObject *text, Py_ssize_t slot)
{
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &len);
    if (utf8 == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
            return -1;
        PyErr_Clear();
        if (self->odd == NULL && (self->odd = PyDict_New()) == NULL)
            return -1;
        PyObject *key = PyLong_FromSsize_t(slot);
        if (key == NULL)
            return -1;
        int failed = PyDict_SetItem(self->odd, key, text);
        Py_DECREF(key);
        return failed ? -1 : 0;
    }
    if (self->text_len + len > self->text_cap) {
        Py_ssize_t cap = self->text_cap ? 2 * self->text_cap : 16384;
        while (cap < self->text_len + len)
            cap *= 2;
        if (grow((void **)&self->text, cap, 1) < 0)
            return -1;
        self->text_cap = cap;
    }
    if (len)
        memcpy(self->text + self->text_len, utf8, (size_t)len);
    self->text_len += len;
    return 1;
}

static int
is_hex_trace(PyObject *text)
{
    if (!PyUnicode_IS_ASCII(text) || PyUnicode_GET_LENGTH(text) != TRACE_HEX)
        return 0;
    const unsigned char *c = PyUnicode_1BYTE_DATA(text);
    for (int i = 0; i < TRACE_HEX; i++)
        if (!((c[i] >= '0' && c[i] <= '9') || (c[i] >= 'a' && c[i] <= 'f')))
            return 0;
    return 1;
}

/* the index of ``value`` (a name or None) in the values table, added if new; -1: error */
static Py_ssize_t
value_at(Columns *self, PyObject *value)
{
    PyObject *found = PyDict_GetItemWithError(self->value_index, value);
    if (found != NULL)
        return PyLong_AsSsize_t(found);
    if (PyErr_Occurred())
        return -1;
    Py_ssize_t at = PyList_GET_SIZE(self->values);
    PyObject *index = PyLong_FromSsize_t(at);
    if (index == NULL)
        return -1;
    int failed = PyDict_SetItem(self->value_index, value, index);
    Py_DECREF(index);
    if (failed)
        return -1;
    if (PyList_Append(self->values, value) < 0) {
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        if (PyDict_DelItem(self->value_index, value) < 0)
            PyErr_Clear();
        PyErr_Restore(type, exc, tb);
        return -1;
    }
    self->size += 3 + (value == Py_None ? 0 : text_bytes(value));
    return at;
}

/* the index of the candidate set (names, count), added if new; -1: error */
static Py_ssize_t
set_at(Columns *self, PyObject *names, PyObject *count)
{
    PyObject *key = PyTuple_Pack(2, names, count);
    if (key == NULL)
        return -1;
    Py_ssize_t at;
    PyObject *found = PyDict_GetItemWithError(self->set_index, key);
    if (found != NULL) {
        at = PyLong_AsSsize_t(found);
    }
    else if (PyErr_Occurred()) {
        at = -1;
    }
    else {
        at = PyList_GET_SIZE(self->sets);
        PyObject *index = PyLong_FromSsize_t(at);
        if (index == NULL || PyDict_SetItem(self->set_index, key, index) < 0) {
            at = -1;
        }
        else if (PyList_Append(self->sets, key) < 0) {
            PyObject *type, *exc, *tb;
            PyErr_Fetch(&type, &exc, &tb);
            if (PyDict_DelItem(self->set_index, key) < 0)
                PyErr_Clear();
            PyErr_Restore(type, exc, tb);
            at = -1;
        }
        else {
            Py_ssize_t bytes = 10;
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++)
                bytes += text_bytes(PyTuple_GET_ITEM(names, i)) + 3;
            self->size += bytes;
        }
        Py_XDECREF(index);
    }
    Py_DECREF(key);
    return at;
}

/* exactly a str (a subclass could run code, or refer back to the columns) */
static int
check_text(PyObject *value, const char *name, int or_none)
{
    if (PyUnicode_CheckExact(value) || (or_none && value == Py_None))
        return 0;
    PyErr_Format(PyExc_TypeError, "Columns.add: %s must be a str%s, not %.100s", name,
                 or_none ? " or None" : "", Py_TYPE(value)->tp_name);
    return -1;
}

static int
as_double(PyObject *value, double *out)
{
    *out = PyFloat_AsDouble(value);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static void
keep(PyObject **slot, PyObject *value)
{
    Py_INCREF(value);
    Py_XSETREF(*slot, value);
}

PyDoc_STRVAR(add_doc,
"add(ts, call_id, trace_id, caller, caller_agent, callee, latency_ms, candidates,\n"
"    n_candidates, score, attempt_latency_ms)\n--\n\n"
"One plain event: answered by ``callee`` at the first attempt, scored ``score``.\n"
"Raises TypeError for an argument of the wrong type, ValueError for a count out of\n"
"range or when the columns are ``full``, recording nothing.");

static PyObject *
Columns_add(Columns *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_Format(PyExc_TypeError, "Columns.add takes 11 arguments (%zd given)", nargs);
        return NULL;
    }
    if (PyList_GET_SIZE(self->values) > MAX_VALUES - 3 ||
        PyList_GET_SIZE(self->sets) >= MAX_VALUES) {
        /* a name more would not fit its two-byte index: the batch must be sealed first */
        PyErr_SetString(PyExc_ValueError, "Columns.add: the columns are full");
        return NULL;
    }
    PyObject *call_id = args[1], *trace_id = args[2], *caller = args[3];
    PyObject *caller_agent = args[4], *callee = args[5], *candidates = args[7];
    PyObject *n_candidates = args[8], *score_arg = args[9];
    double ts, latency, score, attempt;
    if (as_double(args[0], &ts) < 0 || as_double(args[6], &latency) < 0 ||
        as_double(args[10], &attempt) < 0)
        return NULL;
    if (score_arg == Py_None)
        score = Py_NAN;
    else if (as_double(score_arg, &score) < 0)
        return NULL;
    if (check_text(call_id, "call_id", 0) < 0 || check_text(trace_id, "trace_id", 0) < 0 ||
        check_text(caller, "caller", 0) < 0 || check_text(caller_agent, "caller_agent", 1) < 0 ||
        check_text(callee, "callee", 0) < 0)
        return NULL;
    if (!PyTuple_CheckExact(candidates)) {
        PyErr_SetString(PyExc_TypeError, "Columns.add: candidates must be a tuple of str");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(candidates); i++)
        if (check_text(PyTuple_GET_ITEM(candidates, i), "a candidate", 0) < 0)
            return NULL;
    if (!PyLong_CheckExact(n_candidates)) {
        PyErr_SetString(PyExc_TypeError, "Columns.add: n_candidates must be an int");
        return NULL;
    }
    int overflow;
    long long count = PyLong_AsLongLongAndOverflow(n_candidates, &overflow);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (overflow || count < 0 || count > 0xFFFFFFFFLL) { /* as a batch's reader takes it */
        PyErr_SetString(PyExc_ValueError, "Columns.add: n_candidates must be in [0, 2**32)");
        return NULL;
    }

    /* names first (a name added to a table without its call does no harm), then room,
       then the texts (undone if the second fails), then the row */
    Py_ssize_t caller_at = self->last_caller_at;
    if (caller != self->last_caller) {
        if ((caller_at = value_at(self, caller)) < 0)
            return NULL;
        keep(&self->last_caller, caller);
        self->last_caller_at = caller_at;
    }
    Py_ssize_t agent_at = value_at(self, caller_agent);
    if (agent_at < 0)
        return NULL;
    Py_ssize_t callee_at = self->last_callee_at;
    if (callee != self->last_callee) {
        if ((callee_at = value_at(self, callee)) < 0)
            return NULL;
        keep(&self->last_callee, callee);
        self->last_callee_at = callee_at;
    }
    Py_ssize_t set = self->last_set;
    if (candidates != self->last_names || count != self->last_count) {
        if ((set = set_at(self, candidates, n_candidates)) < 0)
            return NULL;
        keep(&self->last_names, candidates);
        self->last_count = count;
        self->last_set = set;
    }
    if (reserve_row(self) < 0)
        return NULL;
    Py_ssize_t n = self->n, text_len = self->text_len;
    int stored = put_text(self, call_id, 2 * n);
    if (stored < 0)
        return NULL;
    self->call_end[n] = self->text_len;
    if (put_text(self, trace_id, 2 * n + 1) < 0) {
        self->text_len = text_len;
        if (!stored) { /* the call id went to odd: take it back */
            PyObject *type, *exc, *tb;
            PyErr_Fetch(&type, &exc, &tb);
            PyObject *key = PyLong_FromSsize_t(2 * n);
            if (key == NULL || PyDict_DelItem(self->odd, key) < 0)
                PyErr_Clear();
            Py_XDECREF(key);
            PyErr_Restore(type, exc, tb);
        }
        return NULL;
    }
    self->trace_end[n] = self->text_len;
    if (self->trace_hex && !is_hex_trace(trace_id))
        self->trace_hex = 0;
    self->ts[n] = ts;
    self->latency[n] = latency;
    self->score[n] = score;
    self->attempt[n] = attempt;
    self->caller[n] = (uint16_t)caller_at;
    self->caller_agent[n] = (uint16_t)agent_at;
    self->callee[n] = (uint16_t)callee_at;
    self->candidates[n] = (uint16_t)set;
    self->n = n + 1;
    self->size += PLAIN_ROW_BYTES + text_bytes(call_id) + text_bytes(trace_id);
    Py_RETURN_NONE;
}

/* ``n`` little-endian doubles, as struct.pack("<nd") */
static PyObject *
pack_doubles(const double *values, Py_ssize_t n)
{
    PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyFloat_Pack8(values[i], p + 8 * i, 1) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    return out;
}

/* ``n`` little-endian unsigned shorts, as struct.pack("<nH") */
static PyObject *
pack_indexes(const uint16_t *values, Py_ssize_t n)
{
    PyObject *out = PyBytes_FromStringAndSize(NULL, 2 * n);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        p[2 * i] = (unsigned char)(values[i] & 0xFF);
        p[2 * i + 1] = (unsigned char)(values[i] >> 8);
    }
    return out;
}

/* The column at ``offset`` in Columns (a double * or uint16_t *) as a list of n numbers.
   Read only once the list exists: allocating a list may collect garbage, and a finalizer
   may then add to these very columns, which moves their arrays. */
static PyObject *
doubles_list(Columns *self, size_t offset, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    const double *values = *(double **)((char *)self + offset);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyFloat_FromDouble(values[i]);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *
indexes_list(Columns *self, size_t offset, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    const uint16_t *values = *(uint16_t **)((char *)self + offset);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyLong_FromLong(values[i]);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* the first n call ids (which = 0) or trace ids (which = 1) as a list of str */
static PyObject *
texts_list(Columns *self, int which, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = NULL;
        if (self->odd != NULL) {
            PyObject *key = PyLong_FromSsize_t(2 * i + which);
            if (key == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            item = PyDict_GetItemWithError(self->odd, key);
            Py_DECREF(key);
            if (item == NULL && PyErr_Occurred()) {
                Py_DECREF(out);
                return NULL;
            }
            Py_XINCREF(item);
        }
        if (item == NULL) {
            Py_ssize_t start = which ? self->call_end[i] : (i ? self->trace_end[i - 1] : 0);
            Py_ssize_t end = which ? self->trace_end[i] : self->call_end[i];
            item = end > start ? PyUnicode_DecodeUTF8(self->text + start, end - start, NULL)
                               : PyUnicode_New(0, 0);
            if (item == NULL) {
                Py_DECREF(out);
                return NULL;
            }
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static int
hex_digit(char c)
{
    return c <= '9' ? c - '0' : c - 'a' + 10;
}

/* every trace id as 16 raw bytes, one after the other (only when trace_hex) */
static PyObject *
raw_traces(Columns *self, Py_ssize_t n)
{
    PyObject *out = PyBytes_FromStringAndSize(NULL, 16 * n);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *hex = self->text + self->call_end[i];
        for (int j = 0; j < 16; j++)
            *p++ = (unsigned char)(hex_digit(hex[2 * j]) << 4 | hex_digit(hex[2 * j + 1]));
    }
    return out;
}

static PyObject *
sets_list(Columns *self)
{
    /* [[list(names), count], ...] */
    Py_ssize_t n = PyList_GET_SIZE(self->sets);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(self->sets, i);
        PyObject *names = PySequence_List(PyTuple_GET_ITEM(key, 0));
        PyObject *item = names ? PyList_New(2) : NULL;
        if (item == NULL) {
            Py_XDECREF(names);
            Py_DECREF(out);
            return NULL;
        }
        PyObject *count = PyTuple_GET_ITEM(key, 1);
        Py_INCREF(count);
        PyList_SET_ITEM(item, 0, names);
        PyList_SET_ITEM(item, 1, count);
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* map[key] = value, taking over the reference to value (NULL: an error before) */
static int
set_item(PyObject *map, const char *key, PyObject *value)
{
    if (value == NULL)
        return -1;
    int failed = PyDict_SetItemString(map, key, value);
    Py_DECREF(value);
    return failed;
}

PyDoc_STRVAR(encode_doc,
"encode(capability)\n--\n\n"
"The batch's ``plain`` map (as ``Columns.encode``). ValueError if an id is not UTF-8:\n"
"the batch is then written as rows.");

static PyObject *
Columns_encode(Columns *self, PyObject *capability)
{
    if (self->odd != NULL && PyDict_GET_SIZE(self->odd)) {
        PyErr_SetString(PyExc_ValueError, "a call id or trace id that is not UTF-8");
        return NULL;
    }
    Py_ssize_t n = self->n; /* (the maps and lists made here may collect garbage: the
                               arrays are read after each, up to this n) */
    PyObject *map = PyDict_New();
    if (map == NULL)
        return NULL;
    if (set_item(map, "n", PyLong_FromSsize_t(n)) < 0 ||
        PyDict_SetItemString(map, "capability", capability) < 0 ||
        set_item(map, "ts", pack_doubles(self->ts, n)) < 0 ||
        set_item(map, "call_id", texts_list(self, 0, n)) < 0 ||
        set_item(map, "trace_id", self->trace_hex ? raw_traces(self, n) : texts_list(self, 1, n)) < 0 ||
        set_item(map, "caller", pack_indexes(self->caller, n)) < 0 ||
        set_item(map, "caller_agent", pack_indexes(self->caller_agent, n)) < 0 ||
        set_item(map, "callee", pack_indexes(self->callee, n)) < 0 ||
        set_item(map, "latency_ms", pack_doubles(self->latency, n)) < 0 ||
        set_item(map, "candidates", pack_indexes(self->candidates, n)) < 0 ||
        set_item(map, "score", pack_doubles(self->score, n)) < 0 ||
        set_item(map, "attempt_latency_ms", pack_doubles(self->attempt, n)) < 0 ||
        set_item(map, "values", PyList_GetSlice(self->values, 0, PyList_GET_SIZE(self->values))) < 0 ||
        set_item(map, "candidate_sets", sets_list(self)) < 0) {
        Py_DECREF(map);
        return NULL;
    }
    return map;
}

PyDoc_STRVAR(columns_doc,
"columns()\n--\n\n"
"(ts, call_id, trace_id, caller, caller_agent, callee, latency_ms, candidates, score,\n"
"attempt_latency_ms, values, sets): the columns as Python sequences, indexes unresolved\n"
"(``reach.audit.columns.plain_events`` reads them).");

static PyObject *
Columns_columns(Columns *self, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t n = self->n;
    PyObject *out = PyTuple_New(12);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < 12; i++) {
        PyObject *part;
        switch (i) {
        case 0: part = doubles_list(self, offsetof(Columns, ts), n); break;
        case 1: part = texts_list(self, 0, n); break;
        case 2: part = texts_list(self, 1, n); break;
        case 3: part = indexes_list(self, offsetof(Columns, caller), n); break;
        case 4: part = indexes_list(self, offsetof(Columns, caller_agent), n); break;
        case 5: part = indexes_list(self, offsetof(Columns, callee), n); break;
        case 6: part = doubles_list(self, offsetof(Columns, latency), n); break;
        case 7: part = indexes_list(self, offsetof(Columns, candidates), n); break;
        case 8: part = doubles_list(self, offsetof(Columns, score), n); break;
        case 9: part = doubles_list(self, offsetof(Columns, attempt), n); break;
        case 10: part = PyList_GetSlice(self->values, 0, PyList_GET_SIZE(self->values)); break;
        default: part = PyList_GetSlice(self->sets, 0, PyList_GET_SIZE(self->sets)); break;
        }
        if (part == NULL) { /* nothing more is made once something failed */
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, part);
    }
    return out;
}

static Py_ssize_t
Columns_len(Columns *self)
{
    return self->n;
}

static PyObject *
Columns_get_full(Columns *self, void *Py_UNUSED(closure))
{
    /* no room for another event's names (indexes are two bytes) */
    return PyBool_FromLong(PyList_GET_SIZE(self->values) > MAX_VALUES - 3 ||
                           PyList_GET_SIZE(self->sets) >= MAX_VALUES);
}

static PyObject *
Columns_get_size(Columns *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->size);
}

static PyMethodDef Columns_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Columns_add, METH_FASTCALL, add_doc},
    {"encode", (PyCFunction)Columns_encode, METH_O, encode_doc},
    {"columns", (PyCFunction)Columns_columns, METH_NOARGS, columns_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Columns_getset[] = {
    {"full", (getter)Columns_get_full, NULL,
     "No room for another event's names (indexes are two bytes).", NULL},
    {"size", (getter)Columns_get_size, NULL, "Estimated packed size.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Columns_as_sequence = {
    .sq_length = (lenfunc)Columns_len,
};

static PyTypeObject ColumnsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reach.audit._columns.Columns",
    .tp_basicsize = sizeof(Columns),
    .tp_dealloc = (destructor)Columns_dealloc,
    .tp_as_sequence = &Columns_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("The plain events of one batch being filled, as C arrays."),
    .tp_methods = Columns_methods,
    .tp_getset = Columns_getset,
    .tp_new = Columns_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "reach.audit._columns",
    .m_doc = PyDoc_STR("The plain calls of an audit batch as C arrays (see columns.py)."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__columns(void)
{
    if (PyType_Ready(&ColumnsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ColumnsType);
    if (PyModule_AddObject(m, "Columns", (PyObject *)&ColumnsType) < 0) {
        Py_DECREF(&ColumnsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
