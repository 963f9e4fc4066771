/* The TFTP server's lock-step ACK loop in C: metald.boot.tftp._fastack.drain.
 *
 * Python's drain (server.py, _Transfer._readable) spends about 3 us of CPython per lock-step
 * ACK: recv, ReadTransfer.on_packet's inline path, a list slice, send. This does exactly that
 * inline path and nothing else, for a confirmed transfer with windowsize 1 whose DATA packets
 * are prebuilt (PacketCache): recv a datagram; if it is an ACK of exactly 4 bytes for the
 * block last sent, and that block is not the last, send the next prebuilt packet and advance
 * the state. Any other datagram (another opcode, an ERROR, a duplicate or out-of-order ACK,
 * the ACK of the last block, a short or long packet) is handed back to Python unread, which
 * handles it as it always did. Everything else (timers, retries, windows, errors, counters)
 * stays in Python.
 *
 * Two entry points: drain() serves one ready transfer socket (called from the transfer's own
 * event-loop callback), ready() serves every ready socket of the server's lock-step hub, an
 * epoll set of all transfer sockets that is one reader on the event loop: one loop callback
 * per wake-up instead of one per ready socket (the dispatch that was what was left of
 * metald's user time against dnsmasq, bench/BOOT.md). ready() answers from each transfer's
 * Lane, the lock-step state Python arms it with, not from the transfer's attributes.
 *
 * Why hand-written C and not a library: Python's socket module has no recvmmsg/sendmmsg, and
 * batching would not help here anyway (in lock-step each transfer socket holds one ACK at a
 * time, sendmmsg batches one socket); uvloop measured no gain; Cython or cffi would add a build
 * dependency (and, cffi, a per-call cost) for one loop. Measured (bench/BOOT.md): a bare
 * recv + send from Python costs 1.6 us per ACK, the Python path 3.9 us, this loop 2.4 us.
 *
 * Memory safety against any datagram: one fixed receive buffer of RECV_MAX bytes (a longer
 * datagram is truncated, as Python's recv(2048) truncates it); the ACK is read only when
 * exactly 4 bytes came; a packet is taken from the list only at an index checked against
 * the list's length, and only if it is a bytes object. No Python code runs inside the loop
 * (the GIL is held throughout), so the list cannot change under it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/types.h>

/* What Python's drain passes to recv (server.py). */
#define RECV_MAX 2048

/* drain(fd, packets, acked, sent, nblocks, limit)
 *   -> (handled, acked, sent, datagram | None, send_failed)
 *
 * Reads at most `limit` datagrams from the non-blocking, connected socket `fd`. `handled`:
 * ACKs answered here. `datagram`: the first datagram not handled here (Python handles it; it
 * counts against the limit), or None when the socket was drained (EAGAIN or any recv error:
 * Python's drain stops there too) or `limit` datagrams were handled. `send_failed`: the
 * packet for the last handled ACK could not be sent (a full buffer or a queued ICMP error);
 * the loop stops there and Python retries it as its own send path does.
 */
/* The loop both entry points share: answer in-order lock-step ACKs on `fd` until the first
 * datagram not handled here (stored in *datagram, a new reference), EAGAIN or an error, a
 * failed send (*send_failed = 1), or `limit` datagrams read. Returns -1 with an exception set
 * on a Python error. The caller has checked the state. */
static int
drain_fd(int fd, PyObject *packets, Py_ssize_t *acked_p, Py_ssize_t *sent_p, Py_ssize_t nblocks,
         Py_ssize_t limit, Py_ssize_t *handled_p, PyObject **datagram, int *send_failed)
{
    unsigned char buf[RECV_MAX];
    Py_ssize_t acked = *acked_p, sent = *sent_p, handled = 0, reads = 0;
    int rc = 0;

    *datagram = NULL;
    *send_failed = 0;
    while (reads < limit) {
        ssize_t got = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (got < 0) {
            if (errno == EINTR)
                continue; /* as Python's recv retries (PEP 475); MSG_DONTWAIT never blocks */
            break;        /* EAGAIN: drained; or an error, which Python's drain stops at too */
        }
        reads++;
        if (got == 4 && buf[0] == 0 && buf[1] == 4) {
            /* ReadTransfer.on_packet's inline path with windowsize 1: the 16-bit block number
             * mapped onto the window in flight, k = acked + ((n - acked) mod 65536). */
            Py_ssize_t n = (Py_ssize_t)buf[2] << 8 | buf[3];
            Py_ssize_t k = acked + (Py_ssize_t)(((size_t)n - (size_t)acked) & 0xFFFFu);
            if (k == sent && k != acked && k < nblocks && k < PyList_GET_SIZE(packets)) {
                PyObject *p = PyList_GET_ITEM(packets, k); /* block k + 1 */
                if (!PyBytes_Check(p)) {
                    PyErr_SetString(PyExc_TypeError, "drain: packets must be bytes");
                    rc = -1;
                    break;
                }
                acked = k;
                sent = k + 1;
                handled++;
                ssize_t r;
                do {
                    r = send(fd, PyBytes_AS_STRING(p), (size_t)PyBytes_GET_SIZE(p), 0);
                } while (r < 0 && errno == EINTR);
                if (r < 0) {
                    *send_failed = 1;
                    break;
                }
                continue;
            }
        }
        *datagram = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)got);
        if (*datagram == NULL)
            rc = -1;
        break;
    }
    *acked_p = acked;
    *sent_p = sent;
    *handled_p = handled;
    return rc;
}

static int
consistent(Py_ssize_t acked, Py_ssize_t sent, Py_ssize_t nblocks, PyObject *packets)
{
    return acked >= 0 && sent >= acked && nblocks >= sent && nblocks <= PyList_GET_SIZE(packets);
}

/* drain(fd, packets, acked, sent, nblocks, limit)
 *   -> (handled, acked, sent, datagram | None, send_failed)
 *
 * Reads at most `limit` datagrams from the non-blocking, connected socket `fd`. `handled`:
 * ACKs answered here. `datagram`: the first datagram not handled here (Python handles it; it
 * counts against the limit), or None when the socket was drained (EAGAIN or any recv error:
 * Python's drain stops there too) or `limit` datagrams were handled. `send_failed`: the
 * packet for the last handled ACK could not be sent (a full buffer or a queued ICMP error);
 * the loop stops there and Python retries it as its own send path does.
 */
static PyObject *
drain(PyObject *self, PyObject *args)
{
    int fd;
    PyObject *packets;
    Py_ssize_t acked, sent, nblocks, limit;
    (void)self;

    if (!PyArg_ParseTuple(args, "iO!nnnn", &fd, &PyList_Type, &packets, &acked, &sent,
                          &nblocks, &limit))
        return NULL;
    if (fd < 0 || !consistent(acked, sent, nblocks, packets) || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "drain: inconsistent transfer state");
        return NULL;
    }

    Py_ssize_t handled;
    PyObject *datagram;
    int send_failed;
    if (drain_fd(fd, packets, &acked, &sent, nblocks, limit, &handled, &datagram, &send_failed))
        return NULL;
    if (datagram == NULL) {
        datagram = Py_None;
        Py_INCREF(datagram);
    }
    return Py_BuildValue("nnnNO", handled, acked, sent, datagram,
                         send_failed ? Py_True : Py_False);
}

/* A Lane: one hub transfer's lock-step state as C holds it while it may answer in Python's
 * place (server.py, _Transfer's lane). Python arms it with the transfer's state when the
 * transfer is confirmed, running, windowsize 1 with shared packets, and disarms it otherwise;
 * ready() then answers in-order ACKs from it with no Python attribute read or call (what was
 * left of metald's user time per ACK in the hub: nine attribute reads, a method call and an
 * attribute write per ready socket). What C advanced, Python takes back (take()) before it
 * touches the transfer in any other way (a datagram C did not handle, the silence timer),
 * so the transfer's own state is the truth whenever Python reads it. */
typedef struct {
    PyObject_HEAD
    PyObject *transfer; /* handed back to Python with what it must handle */
    PyObject *packets;  /* the shared DATA packets while armed, else NULL */
    Py_ssize_t acked, sent, nblocks;
    double last; /* when C last sent (the `now` of that ready() call) */
    char armed, advanced;
} Lane;

static PyTypeObject LaneType;

static int
Lane_init(Lane *self, PyObject *args, PyObject *kwds)
{
    PyObject *transfer;
    static char *kwlist[] = {"transfer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &transfer))
        return -1;
    Py_INCREF(transfer);
    Py_XSETREF(self->transfer, transfer);
    Py_CLEAR(self->packets);
    self->acked = self->sent = self->nblocks = 0;
    self->last = 0.0;
    self->armed = self->advanced = 0;
    return 0;
}

static int
Lane_traverse(Lane *self, visitproc visit, void *arg)
{
    Py_VISIT(self->transfer);
    Py_VISIT(self->packets);
    return 0;
}

static int
Lane_clear(Lane *self)
{
    Py_CLEAR(self->transfer);
    Py_CLEAR(self->packets);
    self->armed = 0;
    return 0;
}

static void
Lane_dealloc(Lane *self)
{
    PyObject_GC_UnTrack(self);
    Lane_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* arm(packets, acked, sent, nblocks): C may answer in-order ACKs from this state. Refused
 * (ValueError) when inconsistent, as drain() refuses it; anything C advanced and Python has
 * not taken is dropped (Python passes its current state, having taken it first). */
static PyObject *
Lane_arm(Lane *self, PyObject *args)
{
    PyObject *packets;
    Py_ssize_t acked, sent, nblocks;
    if (!PyArg_ParseTuple(args, "O!nnn", &PyList_Type, &packets, &acked, &sent, &nblocks))
        return NULL;
    if (!consistent(acked, sent, nblocks, packets)) {
        PyErr_SetString(PyExc_ValueError, "arm: inconsistent transfer state");
        return NULL;
    }
    Py_INCREF(packets);
    Py_XSETREF(self->packets, packets);
    self->acked = acked;
    self->sent = sent;
    self->nblocks = nblocks;
    self->armed = 1;
    self->advanced = 0;
    Py_RETURN_NONE;
}

/* disarm(): C answers nothing more; ready() hands every readiness to Python. */
static PyObject *
Lane_disarm(Lane *self, PyObject *Py_UNUSED(ignored))
{
    self->armed = 0;
    Py_CLEAR(self->packets);
    Py_RETURN_NONE;
}

/* take() -> (acked, sent, last) when C answered ACKs since the last take() or arm(), else
 * None. */
static PyObject *
Lane_take(Lane *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->advanced)
        Py_RETURN_NONE;
    self->advanced = 0;
    return Py_BuildValue("nnd", self->acked, self->sent, self->last);
}

static PyObject *
Lane_get_armed(Lane *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->armed);
}

static PyObject *
Lane_get_transfer(Lane *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->transfer ? self->transfer : Py_None);
}

static PyMethodDef Lane_methods[] = {
    {"arm", (PyCFunction)Lane_arm, METH_VARARGS,
     "arm(packets, acked, sent, nblocks): C may answer in-order ACKs from this state."},
    {"disarm", (PyCFunction)Lane_disarm, METH_NOARGS, "disarm(): C answers nothing more."},
    {"take", (PyCFunction)Lane_take, METH_NOARGS,
     "take() -> (acked, sent, last) | None: what C advanced since the last take or arm."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lane_getset[] = {
    {"armed", (getter)Lane_get_armed, NULL, "whether C may answer ACKs", NULL},
    {"transfer", (getter)Lane_get_transfer, NULL, "the transfer", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "metald.boot.tftp._fastack.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One hub transfer's lock-step state while C may answer its ACKs.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lane_init,
    .tp_dealloc = (destructor)Lane_dealloc,
    .tp_traverse = (traverseproc)Lane_traverse,
    .tp_clear = (inquiry)Lane_clear,
    .tp_methods = Lane_methods,
    .tp_getset = Lane_getset,
};

/* One ready socket of an armed lane: the lock-step loop on the lane's state. 1 = Python must
 * look at it (*datagram, *send_failed say why), 0 = done here, -1 = a Python error. */
static int
serve_lane(Lane *lane, int fd, double now, Py_ssize_t limit, PyObject **datagram,
           int *send_failed)
{
    Py_ssize_t acked = lane->acked, sent = lane->sent, handled;
    *datagram = NULL;
    *send_failed = 0;
    if (!consistent(acked, sent, lane->nblocks, lane->packets))
        return 1; /* cannot happen (arm checked it and the list is Python's shared one) */
    if (drain_fd(fd, lane->packets, &acked, &sent, lane->nblocks, limit, &handled, datagram,
                 send_failed))
        return -1;
    if (handled) {
        lane->acked = acked;
        lane->sent = sent;
        lane->last = now;
        lane->advanced = 1;
    }
    return (*datagram != NULL || *send_failed) ? 1 : 0;
}

#define READY_MAX 256

/* ready(epfd, lanes, now, limit) -> [(transfer, datagram | None, send_failed)]
 *
 * One wake-up of the server's lock-step hub (server.py, _Hub): the transfer sockets ready in
 * the epoll set `epfd` (at most READY_MAX, no wait), each looked up in `lanes` (fd -> Lane).
 * An armed lane's socket is served by the loop above from the lane's state, at most `limit`
 * datagrams (`now` is stored as the lane's `last` when it sent). What Python must do comes
 * back: a disarmed lane's transfer (unconfirmed, windowsize > 1, finished: Python's drain
 * reads it), the first datagram the loop did not handle (Python handles it, then drains on),
 * or a failed send (Python retries it). A ready descriptor not in `lanes` is skipped.
 * The epoll set is level-triggered: a socket left with datagrams is reported again by the
 * next call, so the hub reads one datagram per socket per wake-up (server.py, HUB_READS):
 * in lock-step a socket holds one ACK at a time and a second recv would find it empty.
 * (Looking at the set again in the same call while all was served here, up to 4 or 16 times,
 * measured no difference: bench/BOOT.md.)
 */
static PyObject *
ready(PyObject *self, PyObject *args)
{
    int epfd;
    PyObject *lanes;
    double now;
    Py_ssize_t limit;
    (void)self;

    if (!PyArg_ParseTuple(args, "iO!dn", &epfd, &PyDict_Type, &lanes, &now, &limit))
        return NULL;
    if (epfd < 0 || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "ready: bad arguments");
        return NULL;
    }
    struct epoll_event evs[READY_MAX];
    PyObject *todo = PyList_New(0);
    if (todo == NULL)
        return NULL;
    int n;
    do {
        n = epoll_wait(epfd, evs, READY_MAX, 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    for (int i = 0; i < n; i++) {
        int fd = evs[i].data.fd;
        PyObject *key = PyLong_FromLong(fd);
        if (key == NULL)
            goto fail;
        PyObject *o = PyDict_GetItemWithError(lanes, key); /* borrowed */
        Py_DECREF(key);
        if (o == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        if (!PyObject_TypeCheck(o, &LaneType)) {
            PyErr_SetString(PyExc_TypeError, "ready: lanes must map descriptors to Lanes");
            goto fail;
        }
        Lane *lane = (Lane *)o;
        if (lane->transfer == NULL)
            continue;
        PyObject *datagram = NULL;
        int send_failed = 0, rc = 1;
        if (lane->armed) {
            Py_INCREF(lane);
            rc = serve_lane(lane, fd, now, limit, &datagram, &send_failed);
            Py_DECREF(lane);
            if (rc < 0)
                goto fail;
        }
        if (rc == 1) {
            PyObject *item =
                Py_BuildValue("(ONO)", lane->transfer, datagram ? datagram : Py_NewRef(Py_None),
                              send_failed ? Py_True : Py_False);
            if (item == NULL)
                goto fail;
            int a = PyList_Append(todo, item);
            Py_DECREF(item);
            if (a < 0)
                goto fail;
        }
    }
    return todo;
fail:
    Py_DECREF(todo);
    return NULL;
}

static PyMethodDef methods[] = {
    {"drain", drain, METH_VARARGS,
     "drain(fd, packets, acked, sent, nblocks, limit) -> (handled, acked, sent, datagram, "
     "send_failed): answer in-order lock-step ACKs with prebuilt DATA packets until the "
     "first datagram Python must handle, EAGAIN, or limit datagrams."},
    {"ready", ready, METH_VARARGS,
     "ready(epfd, lanes, now, limit) -> [(transfer, datagram, send_failed)]: serve the "
     "lock-step transfer sockets ready in an epoll set from their armed lanes; return what "
     "Python must handle."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "metald.boot.tftp._fastack",
    .m_doc = "The TFTP server's lock-step ACK loop in C (see server.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__fastack(void)
{
    if (PyType_Ready(&LaneType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
