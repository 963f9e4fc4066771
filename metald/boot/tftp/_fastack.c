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
    if (fd < 0 || acked < 0 || sent < acked || nblocks < sent
        || nblocks > PyList_GET_SIZE(packets) || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "drain: inconsistent transfer state");
        return NULL;
    }

    unsigned char buf[RECV_MAX];
    Py_ssize_t handled = 0, reads = 0;
    PyObject *datagram = NULL;
    int send_failed = 0;

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
                    return NULL;
                }
                acked = k;
                sent = k + 1;
                handled++;
                ssize_t r;
                do {
                    r = send(fd, PyBytes_AS_STRING(p), (size_t)PyBytes_GET_SIZE(p), 0);
                } while (r < 0 && errno == EINTR);
                if (r < 0) {
                    send_failed = 1;
                    break;
                }
                continue;
            }
        }
        datagram = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)got);
        if (datagram == NULL)
            return NULL;
        break;
    }
    if (datagram == NULL) {
        datagram = Py_None;
        Py_INCREF(datagram);
    }
    return Py_BuildValue("nnnNO", handled, acked, sent, datagram,
                         send_failed ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"drain", drain, METH_VARARGS,
     "drain(fd, packets, acked, sent, nblocks, limit) -> (handled, acked, sent, datagram, "
     "send_failed): answer in-order lock-step ACKs with prebuilt DATA packets until the "
     "first datagram Python must handle, EAGAIN, or limit datagrams."},
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
    return PyModule_Create(&module);
}
