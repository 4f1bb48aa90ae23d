/*
 * kvswap ring operations: the parts of a shared-memory ring (client/rings.py) that
 * Python cannot do, or not cheaply.
 *
 * Why C: a ring is only safe between two processes with ordered memory accesses
 * (a record's bytes before the index that publishes it; the "I am going to sleep"
 * flag before the reader's last look at the index, against the writer's index
 * before its look at the flag).  Python has no memory fences; here they are
 * __atomic builtins.  Doing a whole record (length words, frames, padding, index)
 * in one call also keeps the per-message cost of the hot path to one call.
 *
 * Every function takes the mapped segment (any writable buffer) and the byte
 * offsets of one ring's control block and data area; client/rings.py holds the
 * layout (drawn in its docstring) and checks it against the segment before any
 * call.  Control block (offsets from ctl):
 *    0  head   u64  bytes ever written (producer stores, release)
 *   64  tail   u64  bytes ever consumed (consumer stores, release)
 *   72  sleep  u32  1: the consumer may be asleep; the next producer rings the bell
 *   76  want   u32  1: the producer found the ring full; the consumer rings back
 * A record at data + (head % cap), 8-byte aligned, never across the end:
 *    u32 size (payload bytes) | u16 nframes | u16 kind (0 message, 1 wrap) |
 *    u32 frame length x nframes | frames back to back | zero padding to 8
 * Both indices are multiples of 8 with 0 <= head - tail <= cap.  Either process can
 * store anything there (same uid), so put() and get() check them before they touch
 * a byte of the data area and raise RingCorrupt on others; a consumer that will not
 * read a ring again stores an unaligned tail on purpose (shut()).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEAD 0
#define TAIL 64
#define SLEEP 72
#define WANT 76
#define KIND_MSG 0
#define KIND_WRAP 1
#define REC_HDR 8
#define MAX_FRAMES_PER_RECORD 512

static PyObject *RingCorrupt;

typedef struct {
    Py_buffer seg;
    uint64_t *head, *tail;
    uint32_t *sleep, *want;
    unsigned char *data;
    uint64_t cap;
} ring_t;

static int
ring_open(ring_t *r, PyObject *seg, Py_ssize_t ctl, Py_ssize_t data, Py_ssize_t cap)
{
    if (PyObject_GetBuffer(seg, &r->seg, PyBUF_WRITABLE) < 0)
        return -1;
    if (ctl < 0 || data < 0 || cap <= 0 || (cap & (cap - 1)) != 0 || ctl % 64 != 0
        || data % 64 != 0 || ctl + 128 > r->seg.len || data + cap > r->seg.len) {
        PyBuffer_Release(&r->seg);
        PyErr_SetString(PyExc_ValueError, "ring offsets do not fit the segment");
        return -1;
    }
    unsigned char *base = (unsigned char *)r->seg.buf;
    r->head = (uint64_t *)(base + ctl + HEAD);
    r->tail = (uint64_t *)(base + ctl + TAIL);
    r->sleep = (uint32_t *)(base + ctl + SLEEP);
    r->want = (uint32_t *)(base + ctl + WANT);
    r->data = base + data;
    r->cap = (uint64_t)cap;
    return 0;
}

/* The (seg, ctl, data, cap) arguments of get, arm and wanted, opened as a ring. */
static int
ring_args(ring_t *r, PyObject *args)
{
    PyObject *seg;
    Py_ssize_t ctl, data, cap;
    if (!PyArg_ParseTuple(args, "Onnn", &seg, &ctl, &data, &cap))
        return -1;
    return ring_open(r, seg, ctl, data, cap);
}

static inline uint64_t
pad8(uint64_t n)
{
    return (n + 7) & ~(uint64_t)7;
}

/* Indices that put() and get() never store, so some other store made them: an
 * index off the 8-byte grid, or more written than the ring holds.  Both refuse
 * them, so no record is written or read at a position that was not checked. */
static inline int
bad_indices(const ring_t *r, uint64_t head, uint64_t tail)
{
    return head - tail > r->cap || head % 8 != 0 || tail % 8 != 0;
}

/* put(seg, ctl, data, cap, frames) -> 0 written, 1 written and the bell must ring,
 * -1 full (nothing written; ``want`` is set so the consumer rings back); RingCorrupt
 * (nothing written) if the indices are not ones the two sides could have made. */
static PyObject *
put(PyObject *self, PyObject *args)
{
    PyObject *seg, *frames;
    Py_ssize_t ctl, data, cap;
    if (!PyArg_ParseTuple(args, "OnnnO", &seg, &ctl, &data, &cap, &frames))
        return NULL;
    PyObject *seq = PySequence_Fast(frames, "frames must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > MAX_FRAMES_PER_RECORD) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "a ring record holds 1 to %d frames, got %zd",
                            MAX_FRAMES_PER_RECORD, n);
    }
    Py_buffer views[MAX_FRAMES_PER_RECORD];
    Py_ssize_t got = 0;
    uint64_t payload = 4 * (uint64_t)n;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        payload += (uint64_t)views[got].len;
    }
    ring_t r;
    if (ring_open(&r, seg, ctl, data, cap) < 0)
        goto fail;
    uint64_t need = pad8(REC_HDR + payload);
    if (need > r.cap / 2 || payload > UINT32_MAX) {
        PyBuffer_Release(&r.seg);
        PyErr_Format(PyExc_ValueError, "a record of %llu bytes exceeds half the ring (%llu)",
                     (unsigned long long)need, (unsigned long long)r.cap / 2);
        goto fail;
    }
    uint64_t head = *r.head; /* only this producer writes it */
    uint64_t tail = __atomic_load_n(r.tail, __ATOMIC_ACQUIRE);
    if (bad_indices(&r, head, tail)) {
        /* Another process wrote an index (a hostile or buggy writer, or a consumer
         * that shut the ring): a record placed by it could land past the data area
         * (an unaligned head leaves under 8 bytes for the wrap marker).  Write
         * nothing; the caller stops using this ring (docs/protocol.md section 15). */
        PyBuffer_Release(&r.seg);
        PyErr_Format(RingCorrupt, "ring indices out of bounds: head %llu, tail %llu; "
                     "nothing was written", (unsigned long long)head,
                     (unsigned long long)tail);
        goto fail;
    }
    uint64_t pos = head % r.cap;
    uint64_t skip = (r.cap - pos < need) ? r.cap - pos : 0;
    long result;
    if (head - tail + skip + need > r.cap) {
        __atomic_store_n(r.want, 1, __ATOMIC_SEQ_CST);
        /* the consumer may have freed space between the two looks: look again */
        tail = __atomic_load_n(r.tail, __ATOMIC_SEQ_CST);
        if (head - tail + skip + need > r.cap) {
            result = -1;
            goto done;
        }
    }
    if (skip) {
        uint32_t wrap[2] = {0, (uint32_t)KIND_WRAP << 16};
        memcpy(r.data + pos, wrap, sizeof wrap);
        head += skip;
        pos = 0;
    }
    unsigned char *p = r.data + pos;
    uint32_t hdr[2] = {(uint32_t)payload, (uint32_t)n | ((uint32_t)KIND_MSG << 16)};
    memcpy(p, hdr, sizeof hdr);
    p += REC_HDR;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t len = (uint32_t)views[i].len;
        memcpy(p, &len, 4);
        p += 4;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(p, views[i].buf, (size_t)views[i].len);
        p += views[i].len;
    }
    memset(p, 0, (size_t)(r.data + pos + need - p));
    __atomic_store_n(r.head, head + need, __ATOMIC_SEQ_CST);
    uint32_t asleep = 1;
    result = __atomic_compare_exchange_n(r.sleep, &asleep, 0, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST) ? 1 : 0;
done:
    PyBuffer_Release(&r.seg);
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    return PyLong_FromLong(result);
fail:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *
corrupt(ring_t *r, uint64_t head, const char *why, unsigned long long a)
{
    /* nothing past a bad record can be trusted: drop everything written so far */
    __atomic_store_n(r->tail, head, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&r->seg);
    return PyErr_Format(RingCorrupt, "%s %llu; every unread byte was discarded", why, a);
}

/* get(seg, ctl, data, cap) -> list of bytes (one record's frames), or None when the
 * ring is empty.  A record that breaks the format raises RingCorrupt after the
 * ring was emptied. */
static PyObject *
get(PyObject *self, PyObject *args)
{
    ring_t r;
    if (ring_args(&r, args) < 0)
        return NULL;
    uint64_t tail = *r.tail; /* only this consumer writes it */
    uint64_t head = __atomic_load_n(r.head, __ATOMIC_ACQUIRE);
    /* Empty comes first: nothing is read, whatever the indices.  So a ring emptied by
     * corrupt() with an unaligned head reads as empty from then on, instead of
     * raising at every look (its producer's put() refuses the same indices and
     * stops using the ring). */
    if (head != tail && bad_indices(&r, head, tail))
        return corrupt(&r, head, "ring indices out of bounds: head - tail", head - tail);
    for (;;) {
        if (head == tail) {
            PyBuffer_Release(&r.seg);
            Py_RETURN_NONE;
        }
        uint64_t pos = tail % r.cap;
        uint32_t hdr[2];
        memcpy(hdr, r.data + pos, sizeof hdr);
        if ((hdr[1] >> 16) == KIND_WRAP && hdr[0] == 0) {
            tail += r.cap - pos;
            if (tail > head)
                return corrupt(&r, head, "wrap record past the written end at", pos);
            continue;
        }
        uint64_t payload = hdr[0], n = hdr[1] & 0xFFFF, need = pad8(REC_HDR + payload);
        if ((hdr[1] >> 16) != KIND_MSG || n < 1 || n > MAX_FRAMES_PER_RECORD)
            return corrupt(&r, head, "bad record header at", pos);
        if (need > r.cap - pos || need > head - tail || 4 * n > payload)
            return corrupt(&r, head, "record size beyond the written bytes", payload);
        const unsigned char *p = r.data + pos + REC_HDR;
        uint32_t lens[MAX_FRAMES_PER_RECORD];
        memcpy(lens, p, 4 * n);
        uint64_t sum = 4 * n;
        for (uint64_t i = 0; i < n; i++)
            sum += lens[i];
        if (sum != payload)
            return corrupt(&r, head, "frame lengths do not add up to the record size", sum);
        PyObject *out = PyList_New((Py_ssize_t)n);
        if (out == NULL) {
            PyBuffer_Release(&r.seg);
            return NULL;
        }
        p += 4 * n;
        for (uint64_t i = 0; i < n; i++) {
            PyObject *b = PyBytes_FromStringAndSize((const char *)p, lens[i]);
            if (b == NULL) {
                Py_DECREF(out);
                PyBuffer_Release(&r.seg);
                return NULL;
            }
            PyList_SET_ITEM(out, (Py_ssize_t)i, b);
            p += lens[i];
        }
        __atomic_store_n(r.tail, tail + need, __ATOMIC_SEQ_CST);
        PyBuffer_Release(&r.seg);
        return out;
    }
}

/* arm(seg, ctl, data, cap) -> True if the ring is empty with ``sleep`` set (the
 * consumer may block on its bell), False if records are waiting (``sleep`` cleared). */
static PyObject *
arm(PyObject *self, PyObject *args)
{
    ring_t r;
    if (ring_args(&r, args) < 0)
        return NULL;
    __atomic_store_n(r.sleep, 1, __ATOMIC_SEQ_CST);
    int empty = __atomic_load_n(r.head, __ATOMIC_SEQ_CST) == *r.tail;
    if (!empty)
        __atomic_store_n(r.sleep, 0, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&r.seg);
    return PyBool_FromLong(empty);
}

/* wanted(seg, ctl, data, cap) -> True once after the producer found the ring full
 * (the consumer, having made room, rings the producer's bell). */
static PyObject *
wanted(PyObject *self, PyObject *args)
{
    ring_t r;
    if (ring_args(&r, args) < 0)
        return NULL;
    uint32_t one = 1;
    int hit = __atomic_compare_exchange_n(r.want, &one, 0, 0, __ATOMIC_SEQ_CST,
                                          __ATOMIC_SEQ_CST);
    PyBuffer_Release(&r.seg);
    return PyBool_FromLong(hit);
}

/* shut(seg, ctl, data, cap): the consumer will not read this ring again (its reply
 * path is gone): it stores an unaligned ``tail``, so every later put() of the
 * producer raises RingCorrupt and writes nothing, and the producer moves to its
 * other channel instead of writing records nobody reads. */
static PyObject *
shut(PyObject *self, PyObject *args)
{
    ring_t r;
    if (ring_args(&r, args) < 0)
        return NULL;
    __atomic_store_n(r.tail, __atomic_load_n(r.head, __ATOMIC_SEQ_CST) | 4, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&r.seg);
    Py_RETURN_NONE;
}

/* swap_owner(seg, offset, expected, new) -> True if the u64 at ``offset`` held
 * ``expected`` and now holds ``new`` (claiming and releasing a ring). */
static PyObject *
swap_owner(PyObject *self, PyObject *args)
{
    PyObject *seg;
    Py_ssize_t off;
    unsigned long long expected, desired;
    if (!PyArg_ParseTuple(args, "OnKK", &seg, &off, &expected, &desired))
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(seg, &b, PyBUF_WRITABLE) < 0)
        return NULL;
    if (off < 0 || off % 8 != 0 || off + 8 > b.len) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "owner offset outside the segment");
        return NULL;
    }
    uint64_t exp = expected;
    int ok = __atomic_compare_exchange_n((uint64_t *)((unsigned char *)b.buf + off), &exp,
                                         (uint64_t)desired, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST);
    PyBuffer_Release(&b);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"put", put, METH_VARARGS, "Write one record of frames; 1 if the bell must ring, -1 if full."},
    {"get", get, METH_VARARGS, "Read one record as a list of bytes, or None if empty."},
    {"arm", arm, METH_VARARGS, "Set the sleep flag; True if the ring is empty."},
    {"wanted", wanted, METH_VARARGS, "True once after the producer found the ring full."},
    {"shut", shut, METH_VARARGS, "Make every later put() of the producer raise RingCorrupt."},
    {"swap_owner", swap_owner, METH_VARARGS, "Compare-and-swap of a u64 owner word."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ringops", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__ringops(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    RingCorrupt = PyErr_NewException("kvswap.client._ringops.RingCorrupt", PyExc_ValueError,
                                     NULL);
    if (RingCorrupt == NULL || PyModule_AddObject(m, "RingCorrupt", RingCorrupt) < 0) {
        Py_XDECREF(RingCorrupt);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
