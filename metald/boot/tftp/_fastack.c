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
 * metald's user time against dnsmasq, bench/BOOT.md).
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

/* Attribute names read by ready(), interned once at import. */
static PyObject *s_confirmed, *s_machine, *s_window, *s_result, *s_packets, *s_acked, *s_sent,
    *s_nblocks, *s_last;

/* An attribute as a Py_ssize_t; -1 (and no exception) when it is missing or not an int. */
static Py_ssize_t
int_attr(PyObject *o, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t r = PyLong_Check(v) ? PyLong_AsSsize_t(v) : -1;
    Py_DECREF(v);
    if (r == -1 && PyErr_Occurred())
        PyErr_Clear();
    return r;
}

/* One ready transfer socket: the lock-step loop when the transfer is confirmed, running with
 * windowsize 1 and shared packets (exactly ReadTransfer.lockstep_packets' condition plus the
 * shell's own `confirmed`, so its "confirmed" event has gone out); 1 = Python must look at it
 * (*datagram, *send_failed say why; neither: the transfer is not one the loop may answer),
 * 0 = done here, -1 = a Python error. */
static int
serve_one(PyObject *t, int fd, PyObject *running, PyObject *now, Py_ssize_t limit,
          PyObject **datagram, int *send_failed)
{
    *datagram = NULL;
    *send_failed = 0;
    PyObject *confirmed = PyObject_GetAttr(t, s_confirmed);
    if (confirmed == NULL)
        return -1;
    int ok = confirmed == Py_True;
    Py_DECREF(confirmed);
    if (!ok)
        return 1;
    PyObject *m = PyObject_GetAttr(t, s_machine);
    if (m == NULL)
        return -1;
    int rc = 1;
    PyObject *result = NULL, *packets = NULL;
    if (int_attr(m, s_window) != 1)
        goto out;
    result = PyObject_GetAttr(m, s_result);
    if (result == NULL) {
        rc = -1;
        goto out;
    }
    if (result != running)
        goto out;
    packets = PyObject_GetAttr(m, s_packets);
    if (packets == NULL) {
        rc = -1;
        goto out;
    }
    if (!PyList_CheckExact(packets))
        goto out;
    Py_ssize_t acked = int_attr(m, s_acked), sent = int_attr(m, s_sent),
               nblocks = int_attr(m, s_nblocks), handled;
    if (!consistent(acked, sent, nblocks, packets))
        goto out;
    if (drain_fd(fd, packets, &acked, &sent, nblocks, limit, &handled, datagram, send_failed)) {
        rc = -1;
        goto out;
    }
    if (handled) {
        PyObject *r = PyObject_CallMethod(m, "lockstep_advanced", "nn", acked, sent);
        if (r == NULL || PyObject_SetAttr(t, s_last, now) < 0) {
            Py_XDECREF(r);
            Py_CLEAR(*datagram);
            rc = -1;
            goto out;
        }
        Py_DECREF(r);
    }
    rc = (*datagram != NULL || *send_failed) ? 1 : 0;
out:
    Py_XDECREF(packets);
    Py_XDECREF(result);
    Py_DECREF(m);
    return rc;
}

#define READY_MAX 256

/* ready(epfd, transfers, running, now, limit) -> [(transfer, datagram | None, send_failed)]
 *
 * One wake-up of the server's lock-step hub (server.py, _Hub): the transfer sockets ready in
 * the epoll set `epfd` (at most READY_MAX, no wait), each looked up in `transfers` (fd ->
 * _Transfer) and served by the loop above, at most `limit` datagrams each; `now` is stored
 * as the transfer's `last` when it sent. What Python must do is returned: a transfer the loop
 * may not answer (unconfirmed, windowsize > 1, finished: Python's drain reads it), the first
 * datagram the loop did not handle (Python handles it, then drains on), or a failed send
 * (Python retries it). A ready descriptor not in `transfers` is skipped.
 * (Looking at the set again in the same call while all was served here, up to 4 or 16 times,
 * measured no difference: bench/BOOT.md.)
 */
static PyObject *
ready(PyObject *self, PyObject *args)
{
    int epfd;
    PyObject *transfers, *running, *now;
    Py_ssize_t limit;
    (void)self;

    if (!PyArg_ParseTuple(args, "iO!OOn", &epfd, &PyDict_Type, &transfers, &running, &now,
                          &limit))
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
        PyObject *t = PyDict_GetItemWithError(transfers, key); /* borrowed */
        Py_DECREF(key);
        if (t == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        Py_INCREF(t);
        PyObject *datagram;
        int send_failed;
        int rc = serve_one(t, fd, running, now, limit, &datagram, &send_failed);
        if (rc < 0) {
            Py_DECREF(t);
            goto fail;
        }
        if (rc == 1) {
            PyObject *item = Py_BuildValue(
                "(NNO)", t, datagram ? datagram : Py_NewRef(Py_None),
                send_failed ? Py_True : Py_False);
            if (item == NULL)
                goto fail;
            int a = PyList_Append(todo, item);
            Py_DECREF(item);
            if (a < 0)
                goto fail;
        } else {
            Py_DECREF(t);
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
     "ready(epfd, transfers, running, now, limit) -> [(transfer, datagram, send_failed)]: "
     "serve the lock-step transfer sockets ready in an epoll set; return what Python must "
     "handle."},
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
#define INTERN(var, text)                                                                      \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                      \
        return NULL;
    INTERN(s_confirmed, "confirmed")
    INTERN(s_machine, "machine")
    INTERN(s_window, "window")
    INTERN(s_result, "result")
    INTERN(s_packets, "_packets")
    INTERN(s_acked, "acked")
    INTERN(s_sent, "sent")
    INTERN(s_nblocks, "nblocks")
    INTERN(s_last, "last")
#undef INTERN
    return PyModule_Create(&module);
}
