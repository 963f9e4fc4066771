/* The DHCP server's socket I/O in batches: metald.boot.dhcp._batchio.
 *
 * recv_batch() reads every datagram a socket holds (up to a bound) with recvmmsg, several per
 * system call; send_batch() sends a wake-up's replies with sendmmsg. Python's socket module
 * has neither (server.py, _drain and _send, use them when this is built; without it, the same
 * path with one recvfrom or sendto per datagram). They move bytes and addresses only: parsing,
 * deciding, counting and every guard stay in Python, on exactly the bytes recvfrom would have
 * returned (see recv_batch's note on length).
 *
 * Why C and not ctypes: a ctypes call costs more than the syscall it saves (measured in an
 * earlier pass, bench/BOOT.md); why not a library: none on PyPI wraps recvmmsg/sendmmsg for
 * plain Python sockets.
 *
 * Memory safety: one fixed buffer of BATCH x SLOT_MAX bytes, a datagram is never read past
 * the length the kernel reports (capped at the slot's size), and the GIL is held throughout,
 * so the buffer is never shared.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

/* Datagrams per recvmmsg/sendmmsg call. */
#define BATCH 32
/* The largest slot a caller may ask for (its `size`). */
#define SLOT_MAX 8192

static unsigned char rbuf[BATCH][SLOT_MAX];

/* (host, port) as Python's recvfrom returns it for AF_INET; the last one is kept, since a
 * relay's address repeats in most packets. */
static PyObject *last_addr;
static struct sockaddr_in last_sa;

static PyObject *
addr_tuple(const struct sockaddr_in *sa)
{
    if (last_addr != NULL && last_sa.sin_addr.s_addr == sa->sin_addr.s_addr &&
        last_sa.sin_port == sa->sin_port)
        return Py_NewRef(last_addr);
    char text[INET_ADDRSTRLEN];
    if (inet_ntop(AF_INET, &sa->sin_addr, text, sizeof text) == NULL)
        return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *t = Py_BuildValue("(si)", text, (int)ntohs(sa->sin_port));
    if (t == NULL)
        return NULL;
    Py_XSETREF(last_addr, Py_NewRef(t));
    last_sa = *sa;
    return t;
}

/* recv_batch(fd, limit, size) -> ([(datagram, (host, port))], errno)
 *
 * Reads at most `limit` datagrams from the non-blocking AF_INET UDP socket `fd`, oldest
 * first, until it is empty. `errno` is 0 when `limit` was reached, EAGAIN when the socket
 * was read empty, or the error that stopped the reads (what Python's recvfrom would have
 * raised there; the datagrams before it are returned). A datagram longer than `size` bytes
 * is returned cut to `size` bytes: the caller passes one more than the longest datagram it
 * accepts, so such a datagram is still refused as too long, as the whole one would be.
 */
static PyObject *
recv_batch(PyObject *self, PyObject *args)
{
    int fd;
    Py_ssize_t limit, size;
    (void)self;
    if (!PyArg_ParseTuple(args, "inn", &fd, &limit, &size))
        return NULL;
    if (fd < 0 || limit < 0 || size < 1 || size > SLOT_MAX) {
        PyErr_SetString(PyExc_ValueError, "recv_batch: bad arguments");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in from[BATCH];
    int err = 0;
    Py_ssize_t got = 0;
    while (got < limit) {
        unsigned int want = (unsigned int)(limit - got < BATCH ? limit - got : BATCH);
        memset(msgs, 0, sizeof(msgs[0]) * want);
        for (unsigned int i = 0; i < want; i++) {
            iov[i].iov_base = rbuf[i];
            iov[i].iov_len = (size_t)size;
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_name = &from[i];
            msgs[i].msg_hdr.msg_namelen = sizeof from[i];
        }
        int n = recvmmsg(fd, msgs, want, MSG_DONTWAIT, NULL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        for (int i = 0; i < n; i++) {
            if (msgs[i].msg_hdr.msg_namelen < sizeof(struct sockaddr_in) ||
                from[i].sin_family != AF_INET) {
                PyErr_SetString(PyExc_OSError, "recv_batch: not an AF_INET datagram socket");
                goto fail;
            }
            size_t len = msgs[i].msg_len < (size_t)size ? msgs[i].msg_len : (size_t)size;
            PyObject *data = PyBytes_FromStringAndSize((const char *)rbuf[i], (Py_ssize_t)len);
            if (data == NULL)
                goto fail;
            PyObject *addr = addr_tuple(&from[i]);
            if (addr == NULL) {
                Py_DECREF(data);
                goto fail;
            }
            PyObject *item = PyTuple_Pack(2, data, addr);
            Py_DECREF(data);
            Py_DECREF(addr);
            if (item == NULL)
                goto fail;
            int a = PyList_Append(out, item);
            Py_DECREF(item);
            if (a < 0)
                goto fail;
        }
        got += n;
        if ((unsigned int)n < want) { /* the socket held fewer: it is empty now */
            err = EAGAIN;
            break;
        }
    }
    return Py_BuildValue("(Ni)", out, err);
fail:
    Py_DECREF(out);
    return NULL;
}

/* send_batch(fd, packets, hosts, ports) -> [(index, errno)]
 *
 * Sends packets[i] to (hosts[i], ports[i]) for every i, in order, from the AF_INET UDP
 * socket `fd`, with as few sendmmsg calls as it takes; returns the ones that failed with
 * the error each got (what sendto would have raised for it), and goes on with the next. A
 * host that is not a dotted IPv4 address fails with EINVAL (the server only sends to
 * addresses it formatted itself).
 */
static PyObject *
send_batch(PyObject *self, PyObject *args)
{
    int fd;
    PyObject *packets, *hosts, *ports;
    (void)self;
    if (!PyArg_ParseTuple(args, "iO!O!O!", &fd, &PyList_Type, &packets, &PyList_Type, &hosts,
                          &PyList_Type, &ports))
        return NULL;
    Py_ssize_t total = PyList_GET_SIZE(packets);
    if (fd < 0 || PyList_GET_SIZE(hosts) != total || PyList_GET_SIZE(ports) != total) {
        PyErr_SetString(PyExc_ValueError, "send_batch: bad arguments");
        return NULL;
    }
    PyObject *failed = PyList_New(0);
    if (failed == NULL)
        return NULL;
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in to[BATCH];
    Py_ssize_t idx[BATCH];
    Py_ssize_t next = 0;
    while (next < total) {
        /* Fill a batch: skip (and report) the entries whose address is not valid. */
        unsigned int k = 0;
        while (k < BATCH && next < total) {
            Py_ssize_t i = next++;
            PyObject *p = PyList_GET_ITEM(packets, i), *h = PyList_GET_ITEM(hosts, i),
                     *o = PyList_GET_ITEM(ports, i);
            if (!PyBytes_Check(p) || !PyUnicode_Check(h) || !PyLong_Check(o)) {
                PyErr_SetString(PyExc_TypeError, "send_batch: bytes, str and int expected");
                goto fail;
            }
            const char *host = PyUnicode_AsUTF8(h);
            if (host == NULL)
                goto fail;
            long port = PyLong_AsLong(o);
            if (port == -1 && PyErr_Occurred())
                goto fail;
            memset(&to[k], 0, sizeof to[k]);
            to[k].sin_family = AF_INET;
            if (port < 0 || port > 65535 || inet_pton(AF_INET, host, &to[k].sin_addr) != 1) {
                PyObject *f = Py_BuildValue("(ni)", i, EINVAL);
                if (f == NULL || PyList_Append(failed, f) < 0) {
                    Py_XDECREF(f);
                    goto fail;
                }
                Py_DECREF(f);
                continue;
            }
            to[k].sin_port = htons((unsigned short)port);
            iov[k].iov_base = PyBytes_AS_STRING(p);
            iov[k].iov_len = (size_t)PyBytes_GET_SIZE(p);
            memset(&msgs[k], 0, sizeof msgs[k]);
            msgs[k].msg_hdr.msg_iov = &iov[k];
            msgs[k].msg_hdr.msg_iovlen = 1;
            msgs[k].msg_hdr.msg_name = &to[k];
            msgs[k].msg_hdr.msg_namelen = sizeof to[k];
            idx[k] = i;
            k++;
        }
        /* Send it; a message that fails is reported and the rest of the batch goes on. */
        unsigned int at = 0;
        while (at < k) {
            int n = sendmmsg(fd, msgs + at, k - at, 0);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                PyObject *f = Py_BuildValue("(ni)", idx[at], errno);
                if (f == NULL || PyList_Append(failed, f) < 0) {
                    Py_XDECREF(f);
                    goto fail;
                }
                Py_DECREF(f);
                at++;
                continue;
            }
            at += (unsigned int)n;
        }
    }
    return failed;
fail:
    Py_DECREF(failed);
    return NULL;
}

static PyMethodDef methods[] = {
    {"recv_batch", recv_batch, METH_VARARGS,
     "recv_batch(fd, limit, size) -> ([(datagram, (host, port))], errno): read up to limit "
     "datagrams with recvmmsg until the socket is empty."},
    {"send_batch", send_batch, METH_VARARGS,
     "send_batch(fd, packets, hosts, ports) -> [(index, errno)]: send each packet with "
     "sendmmsg; the ones that failed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "metald.boot.dhcp._batchio",
    .m_doc = "The DHCP server's socket I/O in batches (recvmmsg, sendmmsg): see server.py.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__batchio(void)
{
    return PyModule_Create(&module);
}
