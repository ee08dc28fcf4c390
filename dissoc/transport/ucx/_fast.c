/*
 * dissoc.transport.ucx._fast: the UCX transport's per-message calls into libucp, without ctypes.
 *
 * Nothing here links against UCX: dissoc.transport.ucx.calls loads libucp (the library ucxx maps) and hands
 * this module the addresses of the few functions it calls (bind). Each call is one libucp call with its
 * arguments taken straight from Python ints (no per-call ctypes conversion), and the active-message handler
 * queues eager messages as bytes without going through a Python callback. Parameter structs are made by the
 * Python side (ctypes, laid out from UCX's headers) and passed by address; the only UCX layouts this file
 * knows are ucp_tag_recv_info_t (tag, length) and the first field of ucp_am_recv_param_t (recv_attr), both
 * checked against the headers by the tests.
 *
 * Pointers that libucp returns are handed back as Python ints, whatever they are (NULL: 0; a request; an
 * error status coded as a pointer): the Python side tells them apart, as it does for the ctypes calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Bumped whenever the interface changes: the Python side uses this module only at the version it expects. */
#define FAST_ABI 3

/* ucp_am_recv_attr_t: the message is a rendezvous announcement (its data must be fetched or released). */
#define UCP_AM_RECV_ATTR_FLAG_RNDV (1ULL << 17)
#define UCS_OK 0
#define UCS_INPROGRESS 1

typedef struct {
    uint64_t sender_tag;
    size_t length;
} tag_recv_info_t; /* ucp_tag_recv_info_t */

typedef void *(*tag_probe_fn)(void *worker, uint64_t tag, uint64_t mask, int remove, tag_recv_info_t *info);
typedef void *(*tag_msg_recv_fn)(void *worker, void *buffer, size_t count, void *message, const void *param);
typedef void *(*tag_send_fn)(void *ep, const void *buffer, size_t count, uint64_t tag, const void *param);
typedef void *(*am_send_fn)(void *ep, unsigned id, const void *header, size_t header_length, const void *buffer,
                            size_t count, const void *param);
typedef signed char (*check_status_fn)(void *request); /* ucs_status_t is a packed enum: one signed byte */
typedef void (*request_free_fn)(void *request);

static tag_probe_fn p_tag_probe;
static tag_msg_recv_fn p_tag_msg_recv;
static tag_send_fn p_tag_send;
static am_send_fn p_am_send;
static check_status_fn p_check_status;
static request_free_fn p_request_free;

/* worker (int) -> (append, max_bytes): where the handler queues a worker's eager active messages. */
static PyObject *am_queues;
/* callable(worker, data, length, recv_attr): every message the handler does not queue itself. */
static PyObject *am_fallback;

static int
as_pointer(PyObject *obj, void **out)
{
    if (obj == Py_None) {
        *out = NULL;
        return 0;
    }
    *out = PyLong_AsVoidPtr(obj);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

static int
as_u64(PyObject *obj, uint64_t *out)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)value;
    return 0;
}

static int
as_size(PyObject *obj, size_t *out)
{
    size_t value = PyLong_AsSize_t(obj);
    if (value == (size_t)-1 && PyErr_Occurred())
        return -1;
    *out = value;
    return 0;
}

/* A buffer to send: a bytes object (its own storage) or an address. */
static int
as_data(PyObject *obj, const void **out)
{
    if (PyBytes_CheckExact(obj)) {
        *out = PyBytes_AS_STRING(obj);
        return 0;
    }
    void *pointer;
    if (as_pointer(obj, &pointer) < 0)
        return -1;
    *out = pointer;
    return 0;
}

static int
check_args(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    if (p_tag_probe == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dissoc.transport.ucx._fast: bind() was not called");
        return -1;
    }
    return 0;
}

static PyObject *
fast_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *pointers[6];
    (void)self;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "bind() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < 6; i++) {
        if (as_pointer(args[i], &pointers[i]) < 0)
            return NULL;
        if (pointers[i] == NULL) {
            PyErr_Format(PyExc_ValueError, "bind(): function %zd is NULL", i);
            return NULL;
        }
    }
    p_tag_probe = (tag_probe_fn)pointers[0];
    p_tag_msg_recv = (tag_msg_recv_fn)pointers[1];
    p_tag_send = (tag_send_fn)pointers[2];
    p_am_send = (am_send_fn)pointers[3];
    p_check_status = (check_status_fn)pointers[4];
    p_request_free = (request_free_fn)pointers[5];
    Py_RETURN_NONE;
}

/* tag_probe(worker, tag, mask, remove) -> (message, sender_tag, length) | None */
static PyObject *
fast_tag_probe(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *worker;
    uint64_t tag, mask;
    tag_recv_info_t info;
    (void)self;
    if (check_args(nargs, 4, "tag_probe") < 0 || as_pointer(args[0], &worker) < 0 || as_u64(args[1], &tag) < 0 ||
        as_u64(args[2], &mask) < 0)
        return NULL;
    int remove = PyObject_IsTrue(args[3]);
    if (remove < 0)
        return NULL;
    void *message = p_tag_probe(worker, tag, mask, remove, &info);
    if (message == NULL)
        Py_RETURN_NONE;
    PyObject *result = PyTuple_New(3);
    if (result == NULL)
        return NULL;
    PyObject *items[3] = {PyLong_FromVoidPtr(message), PyLong_FromUnsignedLongLong(info.sender_tag),
                          PyLong_FromSize_t(info.length)};
    for (int i = 0; i < 3; i++) {
        if (items[i] == NULL) {
            for (int j = 0; j < 3; j++)
                Py_XDECREF(items[j]);
            Py_DECREF(result);
            return NULL;
        }
        PyTuple_SET_ITEM(result, i, items[i]);
    }
    return result;
}

/* tag_probe_take(worker, tag, mask, most) -> (message, sender_tag, length) | None: the oldest message matching
 * tag/mask, taken out of UCX when most < 0 or its length is at most most; else looked at only (message 0). A
 * second probe with the exact tag finds the same message: it is the oldest of those matching the first. */
static PyObject *
fast_tag_probe_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *worker;
    uint64_t tag, mask;
    tag_recv_info_t info;
    (void)self;
    if (check_args(nargs, 4, "tag_probe_take") < 0 || as_pointer(args[0], &worker) < 0 || as_u64(args[1], &tag) < 0 ||
        as_u64(args[2], &mask) < 0)
        return NULL;
    long long most = PyLong_AsLongLong(args[3]);
    if (most == -1 && PyErr_Occurred())
        return NULL;
    void *message = p_tag_probe(worker, tag, mask, most < 0, &info);
    if (message == NULL)
        Py_RETURN_NONE;
    if (most >= 0) {
        if (info.length <= (unsigned long long)most) {
            tag_recv_info_t again;
            message = p_tag_probe(worker, info.sender_tag, ~(uint64_t)0, 1, &again);
            if (message == NULL) { /* cannot happen: it matched a moment ago */
                PyErr_SetString(PyExc_RuntimeError, "tag_probe_take(): the probed message went away");
                return NULL;
            }
        } else {
            message = NULL;
        }
    }
    return Py_BuildValue("(NKn)", PyLong_FromVoidPtr(message), (unsigned long long)info.sender_tag,
                         (Py_ssize_t)info.length);
}

/* The exception being raised, taken out of the error indicator (with its traceback), or None. */
static PyObject *
raised(void)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL)
        PyException_SetTraceback(value, traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value != NULL ? value : Py_NewRef(Py_None);
}

/*
 * tag_take_run(worker, most, lander, done, param, stop_tag, max_length)
 *     -> (status, handle, tag, length, extra, taken_bytes)
 *
 * The unclaimed tagged messages (mask 0), oldest first, each taken out of UCX while `most` admits it (most < 0:
 * any; else at most `most` bytes in all, less each message taken), placed where `lander(tag, length)` says
 * (a (payload, address) pair) and received there; each one UCX received at once is appended to `done` as
 * (tag, payload, length). The run stops at the first message it leaves to the caller, and says why:
 *   0  no message left (or none `most` admits: left in UCX, looked at only, handle 0)
 *   1  a message for the caller (handle: taken out of UCX; 0: looked at only): tagged `stop_tag`, longer than
 *      `max_length`, not admitted by `most` (handle 0), or one the lander left to the allocator (None)
 *   2  a receive UCX has not completed: handle is its request, extra its payload
 *   3  the lander raised: handle is the message (taken out of UCX), extra the exception
 *   4  the receive failed at once: handle is the error status coded as a pointer, extra the payload
 * taken_bytes: the bytes of the messages appended to `done`.
 */
static PyObject *
fast_tag_take_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *worker, *param;
    uint64_t stop_tag;
    size_t max_length;
    tag_recv_info_t info;
    (void)self;
    if (check_args(nargs, 7, "tag_take_run") < 0 || as_pointer(args[0], &worker) < 0 ||
        as_pointer(args[4], &param) < 0 || as_u64(args[5], &stop_tag) < 0 || as_size(args[6], &max_length) < 0)
        return NULL;
    long long most = PyLong_AsLongLong(args[1]);
    if (most == -1 && PyErr_Occurred())
        return NULL;
    PyObject *lander = args[2], *done = args[3];
    if (!PyList_Check(done)) {
        PyErr_SetString(PyExc_TypeError, "tag_take_run(): done must be a list");
        return NULL;
    }
    long long taken = 0;
    int status = 0;
    void *handle = NULL;
    PyObject *extra = NULL;
    info.sender_tag = 0;
    info.length = 0;
    for (;;) {
        void *message = p_tag_probe(worker, 0, 0, most < 0, &info);
        if (message == NULL)
            break; /* status 0 */
        if (most >= 0) {
            if (info.length > (unsigned long long)most) {
                status = info.sender_tag == stop_tag || info.length > max_length; /* (the caller's, looked at) */
                break;
            }
            tag_recv_info_t again;
            message = p_tag_probe(worker, info.sender_tag, ~(uint64_t)0, 1, &again);
            if (message == NULL)
                break;
        }
        if (info.sender_tag == stop_tag || info.length > max_length) {
            status = 1;
            handle = message;
            break;
        }
        PyObject *call[2] = {PyLong_FromUnsignedLongLong(info.sender_tag), PyLong_FromSize_t(info.length)};
        PyObject *placed = (call[0] != NULL && call[1] != NULL) ? PyObject_Vectorcall(lander, call, 2, NULL) : NULL;
        Py_XDECREF(call[0]);
        Py_XDECREF(call[1]);
        if (placed == NULL) {
            status = 3;
            handle = message;
            extra = raised();
            break;
        }
        if (placed == Py_None) {
            Py_DECREF(placed);
            status = 1;
            handle = message;
            break;
        }
        void *address;
        if (!PyTuple_Check(placed) || PyTuple_GET_SIZE(placed) != 2 ||
            as_pointer(PyTuple_GET_ITEM(placed, 1), &address) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "tag_take_run(): the lander must return (payload, address)");
            Py_DECREF(placed);
            status = 3;
            handle = message;
            extra = raised();
            break;
        }
        PyObject *payload = Py_NewRef(PyTuple_GET_ITEM(placed, 0));
        Py_DECREF(placed);
        void *request = p_tag_msg_recv(worker, address, info.length, message, param);
        if (request != NULL) {
            /* (uintptr_t)request >= (uintptr_t)UCS_ERR_LAST (-100): an error status, not a request */
            status = (uintptr_t)request >= (uintptr_t)(intptr_t)-100 ? 4 : 2;
            handle = request;
            extra = payload;
            break;
        }
        PyObject *entry = Py_BuildValue("(KNn)", (unsigned long long)info.sender_tag, payload,
                                        (Py_ssize_t)info.length);
        if (entry == NULL || PyList_Append(done, entry) < 0) {
            Py_XDECREF(entry);
            return NULL; /* (out of memory: the message is received, its payload dropped) */
        }
        Py_DECREF(entry);
        taken += (long long)info.length;
        if (most >= 0)
            most -= (long long)info.length;
    }
    return Py_BuildValue("(iNKnNL)", status, PyLong_FromVoidPtr(handle), (unsigned long long)info.sender_tag,
                         (Py_ssize_t)info.length, extra != NULL ? extra : Py_NewRef(Py_None), taken);
}

/* tag_msg_recv(worker, address, length, message, param) -> the request pointer (0: completed at once) */
static PyObject *
fast_tag_msg_recv(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *worker, *address, *message, *param;
    size_t length;
    (void)self;
    if (check_args(nargs, 5, "tag_msg_recv") < 0 || as_pointer(args[0], &worker) < 0 ||
        as_pointer(args[1], &address) < 0 || as_size(args[2], &length) < 0 || as_pointer(args[3], &message) < 0 ||
        as_pointer(args[4], &param) < 0)
        return NULL;
    return PyLong_FromVoidPtr(p_tag_msg_recv(worker, address, length, message, param));
}

/* tag_send(ep, data, length, tag, param) -> the request pointer (0: completed at once); data: bytes or address */
static PyObject *
fast_tag_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *ep, *param;
    const void *data;
    size_t length;
    uint64_t tag;
    (void)self;
    if (check_args(nargs, 5, "tag_send") < 0 || as_pointer(args[0], &ep) < 0 || as_data(args[1], &data) < 0 ||
        as_size(args[2], &length) < 0 || as_u64(args[3], &tag) < 0 || as_pointer(args[4], &param) < 0)
        return NULL;
    if (ep == NULL) {
        PyErr_SetString(PyExc_ValueError, "tag_send(): the endpoint is NULL");
        return NULL;
    }
    return PyLong_FromVoidPtr(p_tag_send(ep, data, length, tag, param));
}

/* am_send(ep, id, header, header_length, data, length, param) -> the request pointer (0: completed at once) */
static PyObject *
fast_am_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *ep, *param;
    const void *header, *data;
    size_t header_length, length, id;
    (void)self;
    if (check_args(nargs, 7, "am_send") < 0 || as_pointer(args[0], &ep) < 0 || as_size(args[1], &id) < 0 ||
        as_data(args[2], &header) < 0 || as_size(args[3], &header_length) < 0 || as_data(args[4], &data) < 0 ||
        as_size(args[5], &length) < 0 || as_pointer(args[6], &param) < 0)
        return NULL;
    if (ep == NULL) {
        PyErr_SetString(PyExc_ValueError, "am_send(): the endpoint is NULL");
        return NULL;
    }
    return PyLong_FromVoidPtr(p_am_send(ep, (unsigned)id, header, header_length, data, length, param));
}

/* request_test(request) -> its status; a request that is no longer in progress is freed */
static PyObject *
fast_request_test(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *request;
    (void)self;
    if (check_args(nargs, 1, "request_test") < 0 || as_pointer(args[0], &request) < 0)
        return NULL;
    if (request == NULL) {
        PyErr_SetString(PyExc_ValueError, "request_test(): the request is NULL");
        return NULL;
    }
    int status = p_check_status(request);
    if (status != UCS_INPROGRESS)
        p_request_free(request);
    return PyLong_FromLong(status);
}

/* The active-message handler (ucp_am_recv_callback_t), inside the worker's progress call. */
static signed char
am_handler(void *arg, const void *header, size_t header_length, void *data, size_t length, const void *param)
{
    (void)header;
    (void)header_length;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    uint64_t attr = *(const uint64_t *)param; /* ucp_am_recv_param_t.recv_attr */
    int queued = 0;
    PyObject *key = PyLong_FromVoidPtr(arg);
    if (key != NULL && am_queues != NULL && !(attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        PyObject *entry = PyDict_GetItemWithError(am_queues, key); /* borrowed */
        if (entry != NULL && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2) {
            size_t most = PyLong_AsSize_t(PyTuple_GET_ITEM(entry, 1));
            if (!(most == (size_t)-1 && PyErr_Occurred()) && length <= most) {
                PyObject *bytes = PyBytes_FromStringAndSize(length ? (const char *)data : "", (Py_ssize_t)length);
                if (bytes != NULL) {
                    PyObject *done = PyObject_CallOneArg(PyTuple_GET_ITEM(entry, 0), bytes);
                    Py_DECREF(bytes);
                    if (done != NULL) {
                        queued = 1;
                        Py_DECREF(done);
                    }
                }
            }
        }
        if (PyErr_Occurred())
            PyErr_WriteUnraisable(am_queues);
    }
    if (!queued && key != NULL && am_fallback != NULL) {
        PyObject *call[4] = {key, PyLong_FromVoidPtr(data), PyLong_FromSize_t(length),
                             PyLong_FromUnsignedLongLong(attr)};
        if (call[1] != NULL && call[2] != NULL && call[3] != NULL) {
            PyObject *done = PyObject_Vectorcall(am_fallback, call, 4, NULL);
            Py_XDECREF(done);
        }
        for (int i = 1; i < 4; i++)
            Py_XDECREF(call[i]);
        if (PyErr_Occurred())
            PyErr_WriteUnraisable(am_fallback);
    }
    if (key == NULL)
        PyErr_WriteUnraisable(NULL);
    Py_XDECREF(key);
    PyErr_Restore(type, value, traceback);
    PyGILState_Release(gil);
    return UCS_OK;
}

/* am_setup(queues, fallback) -> the handler's address (for ucp_worker_set_am_recv_handler) */
static PyObject *
fast_am_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "am_setup() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyDict_CheckExact(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "am_setup(): expected a dict and a callable");
        return NULL;
    }
    /* Kept for the life of the process: UCX may call the handler until each worker is destroyed. */
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(am_queues, args[0]);
    Py_XSETREF(am_fallback, args[1]);
    return PyLong_FromVoidPtr((void *)am_handler);
}

static PyMethodDef fast_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))fast_bind, METH_FASTCALL,
     "bind(tag_probe_nb, tag_msg_recv_nbx, tag_send_nbx, am_send_nbx, request_check_status, request_free)"},
    {"tag_probe", (PyCFunction)(void (*)(void))fast_tag_probe, METH_FASTCALL,
     "tag_probe(worker, tag, mask, remove) -> (message, sender_tag, length) | None"},
    {"tag_probe_take", (PyCFunction)(void (*)(void))fast_tag_probe_take, METH_FASTCALL,
     "tag_probe_take(worker, tag, mask, most) -> (message, sender_tag, length) | None; message 0: left in UCX"},
    {"tag_take_run", (PyCFunction)(void (*)(void))fast_tag_take_run, METH_FASTCALL,
     "tag_take_run(worker, most, lander, done, param, stop_tag, max_length) -> (status, handle, tag, length, "
     "extra, taken_bytes)"},
    {"tag_msg_recv", (PyCFunction)(void (*)(void))fast_tag_msg_recv, METH_FASTCALL,
     "tag_msg_recv(worker, address, length, message, param) -> request pointer"},
    {"tag_send", (PyCFunction)(void (*)(void))fast_tag_send, METH_FASTCALL,
     "tag_send(ep, data, length, tag, param) -> request pointer"},
    {"am_send", (PyCFunction)(void (*)(void))fast_am_send, METH_FASTCALL,
     "am_send(ep, id, header, header_length, data, length, param) -> request pointer"},
    {"request_test", (PyCFunction)(void (*)(void))fast_request_test, METH_FASTCALL,
     "request_test(request) -> status (the request is freed unless still in progress)"},
    {"am_setup", (PyCFunction)(void (*)(void))fast_am_setup, METH_FASTCALL,
     "am_setup(queues, fallback) -> the active-message handler's address"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fast_module = {
    PyModuleDef_HEAD_INIT, "dissoc.transport.ucx._fast",
    "The UCX transport's per-message calls into libucp (see dissoc.transport.ucx.calls).", -1, fast_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__fast(void)
{
    PyObject *module = PyModule_Create(&fast_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddIntConstant(module, "ABI", FAST_ABI) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
