/* DHCP reply encoding in C: metald.boot.dhcp._codec.serialize300.
 *
 * The same bytes as packet.py's serialize(pkt) with its default min_size (300), for the
 * well-typed packets the server builds: int header fields in range, IPv4Address addresses,
 * bytes chaddr/sname/file (sname <= 63, file <= 127 bytes), a dict of int codes (0-255) to
 * bytes values. Anything else returns None and the caller encodes it in Python, which raises
 * what it raises; so this never decides an error and never differs on odd input.
 * Layout (RFC 2131): the 236-byte BOOTP header, the magic cookie, option 53 first, the other
 * options in the dict's order (a value over 255 bytes split into several instances, RFC 3396),
 * END, zeros to 300 bytes.
 *
 * Why C: Python's serialize (header pack, four address conversions, the options block) was
 * one of the largest items per DORA (bench/BOOT.md); the whole packet here is one pass over a
 * stack buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#define MIN_SIZE 300
#define HEADER 236
/* Bytes written at most: the header, the cookie, END, and the options (each value split in
 * chunks of 255 with two bytes of code and length per chunk). Bigger replies go to Python. */
#define OUT_MAX 4096

static PyObject *s_fields[15];
static const char *field_names[15] = {"op",     "htype",  "hlen",   "hops",   "xid",
                                      "secs",   "flags",  "ciaddr", "yiaddr", "siaddr",
                                      "giaddr", "chaddr", "sname",  "file",   "options"};
static PyObject *s_ip;

/* An int attribute in [0, max], or -1 (not the common case; no exception left set). */
static long long
uint_field(PyObject *v, unsigned long long max)
{
    if (!PyLong_CheckExact(v))
        return -1;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || x < 0 || (unsigned long long)x > max) {
        PyErr_Clear();
        return -1;
    }
    return x;
}

/* An IPv4Address's four bytes; 0 = done, 1 = not an IPv4Address, -1 = error. */
static int
ip_field(PyObject *v, PyObject *ipv4_type, unsigned char *to)
{
    if (Py_TYPE(v) != (PyTypeObject *)ipv4_type)
        return 1;
    PyObject *ip = PyObject_GetAttr(v, s_ip);
    if (ip == NULL)
        return -1;
    long long x = uint_field(ip, 0xFFFFFFFFull);
    Py_DECREF(ip);
    if (x < 0)
        return 1;
    to[0] = (unsigned char)(x >> 24);
    to[1] = (unsigned char)(x >> 16);
    to[2] = (unsigned char)(x >> 8);
    to[3] = (unsigned char)x;
    return 0;
}

/* Appends one option (split per 255 bytes); 0 = done, 1 = too big for OUT_MAX. */
static int
put_option(unsigned char *out, size_t *n, long code, PyObject *value)
{
    const unsigned char *v = (const unsigned char *)PyBytes_AS_STRING(value);
    size_t len = (size_t)PyBytes_GET_SIZE(value);
    size_t chunks = len ? (len + 254) / 255 : 1;
    if (*n + len + 2 * chunks + 1 > OUT_MAX)
        return 1;
    if (len == 0) {
        out[(*n)++] = (unsigned char)code;
        out[(*n)++] = 0;
        return 0;
    }
    for (size_t at = 0; at < len; at += 255) {
        size_t k = len - at < 255 ? len - at : 255;
        out[(*n)++] = (unsigned char)code;
        out[(*n)++] = (unsigned char)k;
        memcpy(out + *n, v + at, k);
        *n += k;
    }
    return 0;
}

/* serialize300(pkt, ipv4_type) -> bytes | None */
static PyObject *
serialize300(PyObject *self, PyObject *args)
{
    PyObject *pkt, *ipv4_type;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!", &pkt, &PyType_Type, &ipv4_type))
        return NULL;
    PyObject *f[15] = {NULL};
    PyObject *result = NULL;
    unsigned char out[OUT_MAX];
    for (int i = 0; i < 15; i++) {
        f[i] = PyObject_GetAttr(pkt, s_fields[i]);
        if (f[i] == NULL)
            goto done; /* not a packet: let Python raise */
    }
    long long op = uint_field(f[0], 255), htype = uint_field(f[1], 255),
              hlen = uint_field(f[2], 255), hops = uint_field(f[3], 255),
              xid = uint_field(f[4], 0xFFFFFFFFull), secs = uint_field(f[5], 0xFFFF),
              flags = uint_field(f[6], 0xFFFF);
    if (op < 0 || htype < 0 || hlen < 0 || hops < 0 || xid < 0 || secs < 0 || flags < 0)
        goto fallback;
    PyObject *chaddr = f[11], *sname = f[12], *file = f[13], *opts = f[14];
    if (!PyBytes_CheckExact(chaddr) || !PyBytes_CheckExact(sname) || !PyBytes_CheckExact(file) ||
        !PyDict_CheckExact(opts) || PyBytes_GET_SIZE(sname) > 63 || PyBytes_GET_SIZE(file) > 127)
        goto fallback;
    memset(out, 0, HEADER);
    out[0] = (unsigned char)op;
    out[1] = (unsigned char)htype;
    out[2] = (unsigned char)hlen;
    out[3] = (unsigned char)hops;
    out[4] = (unsigned char)(xid >> 24);
    out[5] = (unsigned char)(xid >> 16);
    out[6] = (unsigned char)(xid >> 8);
    out[7] = (unsigned char)xid;
    out[8] = (unsigned char)(secs >> 8);
    out[9] = (unsigned char)secs;
    out[10] = (unsigned char)(flags >> 8);
    out[11] = (unsigned char)flags;
    for (int i = 0; i < 4; i++) {
        int r = ip_field(f[7 + i], ipv4_type, out + 12 + 4 * i);
        if (r < 0)
            goto done;
        if (r > 0)
            goto fallback;
    }
    Py_ssize_t clen = PyBytes_GET_SIZE(chaddr);
    memcpy(out + 28, PyBytes_AS_STRING(chaddr), (size_t)(clen < 16 ? clen : 16));
    memcpy(out + 44, PyBytes_AS_STRING(sname), (size_t)PyBytes_GET_SIZE(sname));
    memcpy(out + 108, PyBytes_AS_STRING(file), (size_t)PyBytes_GET_SIZE(file));
    size_t n = HEADER;
    out[n++] = 0x63;
    out[n++] = 0x82;
    out[n++] = 0x53;
    out[n++] = 0x63;
    /* Every key and value checked before anything is written, option 53 first. */
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(opts, &pos, &k, &v)) {
        long long code = uint_field(k, 255);
        if (code < 0 || !PyBytes_CheckExact(v))
            goto fallback;
    }
    PyObject *key53 = PyLong_FromLong(53);
    if (key53 == NULL)
        goto done;
    PyObject *mt = PyDict_GetItemWithError(opts, key53); /* borrowed */
    Py_DECREF(key53);
    if (mt == NULL && PyErr_Occurred())
        goto done;
    if (mt != NULL && put_option(out, &n, 53, mt))
        goto fallback;
    pos = 0;
    while (PyDict_Next(opts, &pos, &k, &v)) {
        long code = PyLong_AsLong(k);
        if (code == 53)
            continue;
        if (put_option(out, &n, code, v))
            goto fallback;
    }
    out[n++] = 0xFF;
    if (n < MIN_SIZE) {
        memset(out + n, 0, MIN_SIZE - n);
        n = MIN_SIZE;
    }
    result = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)n);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < 15; i++)
        Py_XDECREF(f[i]);
    if (result == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear(); /* not a packet: Python's serialize says so */
        result = Py_NewRef(Py_None);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"serialize300", serialize300, METH_VARARGS,
     "serialize300(pkt, IPv4Address) -> bytes | None: packet.serialize(pkt) for the common, "
     "well-typed reply; None: encode it in Python."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "metald.boot.dhcp._codec",
    .m_doc = "DHCP reply encoding in C (see packet.py, serialize).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__codec(void)
{
    for (int i = 0; i < 15; i++)
        if ((s_fields[i] = PyUnicode_InternFromString(field_names[i])) == NULL)
            return NULL;
    if ((s_ip = PyUnicode_InternFromString("_ip")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
