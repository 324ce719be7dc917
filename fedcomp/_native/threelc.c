/* fedcomp._native._threelc: C kernels for 3LC's CPU paths (fedcomp/codecs/threelc.py).
 *
 * Each kernel does in one pass what the NumPy path does in several, and gives exactly its result
 * (same scale, bytes, reconstruction and decoded float32 bits; the tests compare both paths). The
 * kernels take Python buffers, check every length against what they will touch (ValueError on a
 * mismatch), write only into buffers the caller allocated, and release the GIL around their loops
 * so that fedcomp.codecs.sbc.split_run runs them on several threads at once.
 *
 * Quantization compares instead of dividing, as the NumPy path does: for float32 x and the
 * threshold t of round_threshold, round(x / m) is 1 iff x >= t, -1 iff x <= -t. Both sides are
 * compared as magnitude bits (|x| as the integer bits & 0x7FFFFFFF orders like the float for
 * finite values), so the loops are integer SIMD with plain SSE2.
 *
 *   max_abs(a, begin, end) -> int
 *       the largest (bits & 0x7FFFFFFF) of the float32 a[begin:end]: max|a| as bits; above
 *       0x7F800000 means a NaN is there, equal to it an infinity (and no NaN).
 *   params(max_bits, s) -> (code, m, t_bits)
 *       the codec's m = float32(s) * max|a| (clamped to the float32 maximum) and the magnitude bits
 *       of the threshold t (0x7F800000 when m = 0: nothing reaches it). code 0: fine; 1: NaN in the
 *       input; 2: an infinity; 3: no threshold (a subnormal m; the caller divides instead).
 *   pack(a, t_bits, m, g0, g1, out, recon, zero_run, whole) -> (lead, nbytes, trail)
 *       quantize + base-3^5 pack the groups [g0, g1) of a; written from out[g0] on. Without
 *       zero_run: the g1 - g0 packed bytes. With zero_run: with `whole`, the zero-run coding of
 *       those bytes (the whole tensor's when [g0, g1) is all of it); without, only the part from
 *       the first byte other than 121 to the last, the lead and trail runs of 121 being returned
 *       for the caller to join ranges (lead = g1 - g0, nbytes = 0 when all are 121). recon (None,
 *       or float32 of a's size, zero-filled by the caller): m * q written where q != 0.
 *   encode(a, s, out, recon, zero_run) -> (code, m, nbytes)
 *       max_abs + params + pack(whole) of the whole tensor in one call; nbytes is valid for code 0.
 *   expanded_length(data) -> int
 *       how many groups a zero-run stream expands to (checked before the output is allocated).
 *   decode(data, numel, scale, zero_run, out, zeroed) -> bool
 *       zero-run decode + unpack + scale into float32 out (numel values); with `zeroed` (out
 *       already zero-filled) groups of five zeros are skipped where float32(scale) is finite.
 *       False on any inconsistency the NumPy decoder reports (the caller then reruns it to raise
 *       its PayloadError); out is then partly written.
 *   zero_runs_many(data, groups, out, lengths, threads, use_team) -> None
 *       the zero-run coding of many tensors' base-3^5 bytes, back to back in data (groups: int64,
 *       each tensor's count, adding up to len(data)), each written into out (at least len(data)
 *       bytes) where its tensor's bytes begin in data (a coding is never longer); lengths
 *       (int64): each coding's length. Tensors on up to `threads` threads (team.h). What the
 *       whole-update engine's host part does once for all tensors.
 *   check_many(tasks) -> int
 *       for each task (data, zero_run, groups), in order, whether its stream is a valid one for
 *       its groups (runs within them, every one of them; without zero runs, one byte each, none
 *       past 242): -1, or the index of the first that is not (the caller then reruns the NumPy
 *       decoder to raise its PayloadError). Reads only the streams; the whole-update engine
 *       sends them to the device as they are (fedcomp/codecs/threelc_device.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

#include "team.h"

#define ZERO_GROUP 121
#define RUN_BASE 243
#define MAX_RUN 14
#define ABS_MASK 0x7FFFFFFFu
#define SIGN_MASK 0x80000000u
#define INF_BITS 0x7F800000u
/* Groups per block of the packer: their bytes are computed branch-free (vectorisable), then
 * the block is skipped whole when they are all 121 (the usual case for a sparse update). */
#define BLOCK 64

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline Py_ssize_t groups_of(Py_ssize_t n) { return (n + 4) / 5; }

static int check_len(Py_buffer *buf, Py_ssize_t items, Py_ssize_t itemsize, const char *what) {
    if (items < 0 || buf->len < items * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: buffer holds %zd bytes, need %zd", what, buf->len, items * itemsize);
        return -1;
    }
    return 0;
}

/* --- max|a| and the codec's scale and threshold --------------------------------------------- */

static uint32_t max_abs_bits(const uint32_t *x, Py_ssize_t begin, Py_ssize_t end) {
    int32_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* magnitudes fit int32: signed max is SSE2 */
    Py_ssize_t i = begin;
    for (; i + 8 <= end; i += 8)
        for (int j = 0; j < 8; j++) {
            int32_t v = (int32_t)(x[i + j] & ABS_MASK);
            acc[j] = v > acc[j] ? v : acc[j];
        }
    for (; i < end; i++) {
        int32_t v = (int32_t)(x[i] & ABS_MASK);
        acc[0] = v > acc[0] ? v : acc[0];
    }
    int32_t top = 0;
    for (int j = 0; j < 8; j++) top = acc[j] > top ? acc[j] : top;
    return (uint32_t)top;
}

/* The least float32 t > 0 with round(t / m) == 1 (float32 division, ties to even), walked from
 * m / 2 one float32 step at a time, as fedcomp.codecs.threelc.round_threshold does; 0 if none. */
static int round_threshold(float m, float *t_out) {
    const float half = 0.5f;
    float t = m * half;
    for (int i = 0; i < 64; i++) {
        if (t / m > half) {
            uint32_t tb = f2u(t);
            float down = tb ? u2f(tb - 1) : t; /* nextafter(t, 0) for t >= 0 */
            if (!(down / m > half)) {
                if (t > 0.0f) {
                    *t_out = t;
                    return 1;
                }
                return 0;
            }
            t = down;
        } else {
            uint32_t tb = f2u(t);
            t = tb >= INF_BITS ? t : u2f(tb + 1); /* nextafter(t, inf) for t >= 0 */
        }
    }
    return 0;
}

static int scale_params(uint32_t max_bits, double s, float *m_out, uint32_t *t_out) {
    if (max_bits > INF_BITS) return 1;
    if (max_bits == INF_BITS) return 2;
    float m = (float)s * u2f(max_bits); /* float32 product, rounded once */
    if ((f2u(m) & ABS_MASK) >= INF_BITS) m = FLT_MAX;
    *m_out = m;
    if (m == 0.0f) {
        *t_out = INF_BITS; /* no finite value reaches it: every group is 121 */
        return 0;
    }
    float t;
    if (!round_threshold(m, &t)) return 3;
    *t_out = f2u(t);
    return 0;
}

/* --- quantize + pack + zero-run encode ------------------------------------------------------- */

/* q in {-1, 0, 1} of one value: branch-free on its bits. */
static inline int32_t quant(uint32_t u, int32_t tb) {
    int32_t mag = (int32_t)(u & ABS_MASK) >= tb;
    int32_t neg = -(int32_t)(u >> 31);
    return (mag ^ neg) - neg;
}

static inline uint8_t *put_run(uint8_t *o, Py_ssize_t run) {
    Py_ssize_t full = run / MAX_RUN;
    if (full) {
        memset(o, RUN_BASE + MAX_RUN - 2, (size_t)full);
        o += full;
        run -= full * MAX_RUN;
    }
    if (run >= 2)
        *o++ = (uint8_t)(RUN_BASE - 2 + run);
    else if (run == 1)
        *o++ = ZERO_GROUP;
    return o;
}

typedef struct {
    const uint32_t *x;
    Py_ssize_t n, g;
    int32_t tb;
    uint32_t mb;
    uint32_t *recon; /* NULL, or zero-filled float32 bits of n values */
    int zero_run, whole;
    uint8_t *out; /* where the range's output starts */
    uint8_t *o;   /* cursor (zero_run) */
    Py_ssize_t run, lead;
} packer;

/* Reconstruction of group j: m * q at the values with q != 0 (the rest stay +0.0). */
static inline void recon_group(packer *p, Py_ssize_t j) {
    for (int k = 0; k < 5; k++) {
        Py_ssize_t i = (Py_ssize_t)k * p->g + j;
        if (i >= p->n) break;
        uint32_t u = p->x[i];
        if ((int32_t)(u & ABS_MASK) >= p->tb) p->recon[i] = p->mb | (u & SIGN_MASK);
    }
}

/* One byte other than 121 of the zero-run stream. */
static inline void literal(packer *p, uint8_t v) {
    if (p->lead < 0) {
        p->lead = p->run;
        if (p->whole) p->o = put_run(p->o, p->run);
    } else {
        p->o = put_run(p->o, p->run);
    }
    p->run = 0;
    *p->o++ = v;
}

static inline void group_byte(packer *p, Py_ssize_t j, uint8_t v) {
    if (v != ZERO_GROUP && p->recon) recon_group(p, j);
    if (!p->zero_run)
        p->out[j] = v;
    else if (v == ZERO_GROUP)
        p->run++;
    else
        literal(p, v);
}

static void pack_range(packer *p, Py_ssize_t g0, Py_ssize_t g1, Py_ssize_t *lead, Py_ssize_t *nbytes,
                       Py_ssize_t *trail) {
    const uint32_t *x = p->x;
    Py_ssize_t g = p->g, n = p->n;
    int32_t tb = p->tb;
    p->o = p->out + g0;
    p->run = 0;
    p->lead = -1;
    /* groups below jfull have all five values inside the tensor; the rest have padding (q = -1) */
    Py_ssize_t jfull = n - 4 * g;
    if (jfull < 0) jfull = 0;
    Py_ssize_t jend = g1 < jfull ? g1 : jfull;
    Py_ssize_t j0 = g0;
    for (; j0 < jend; j0 += BLOCK) {
        int len = (int)(jend - j0 < BLOCK ? jend - j0 : BLOCK);
        const uint32_t *p0 = x + j0, *p1 = p0 + g, *p2 = p1 + g, *p3 = p2 + g, *p4 = p3 + g;
        uint8_t b[BLOCK];
        int32_t any = 0;
        for (int jj = 0; jj < len; jj++) {
            int32_t acc = quant(p0[jj], tb);
            acc = 3 * acc + quant(p1[jj], tb);
            acc = 3 * acc + quant(p2[jj], tb);
            acc = 3 * acc + quant(p3[jj], tb);
            acc = 3 * acc + quant(p4[jj], tb);
            any |= acc;
            b[jj] = (uint8_t)(acc + ZERO_GROUP);
        }
        if (!any) {
            if (p->zero_run)
                p->run += len;
            else
                memset(p->out + j0, ZERO_GROUP, (size_t)len);
            continue;
        }
        for (int jj = 0; jj < len; jj++) group_byte(p, j0 + jj, b[jj]);
    }
    for (Py_ssize_t j = jend > g0 ? jend : g0; j < g1; j++) {
        int32_t acc = 0;
        for (int k = 0; k < 5; k++) {
            Py_ssize_t i = (Py_ssize_t)k * g + j;
            acc = 3 * acc + (i < n ? quant(x[i], tb) : -1);
        }
        group_byte(p, j, (uint8_t)(acc + ZERO_GROUP));
    }
    *trail = 0;
    if (p->zero_run) {
        if (p->lead < 0) {
            p->lead = p->run;
        } else {
            *trail = p->run;
        }
        if (p->whole) p->o = put_run(p->o, p->run);
        *lead = p->lead;
        *nbytes = p->o - (p->out + g0);
    } else {
        *lead = 0;
        *nbytes = g1 - g0;
    }
}

/* Values per chunk of scan_select: the chunk stays in L1 between its max and its selection. */
#define SCAN_CHUNK 2048

/* max|x| over [begin, end) as bits (as max_abs_bits) and, in the same read, the ascending
 * positions of a superset of the values the codec will quantize to +-1: those at or above
 * 0.49 * min(s * running max, float32 max), which is below the final threshold (about m / 2,
 * m = s * max|x| clamped to the float32 maximum). *count is how many, or -1 when more than
 * `limit` (or the bound is zero or subnormal, or the input not finite): then pack densely. */
static uint32_t scan_select(const uint32_t *x, Py_ssize_t begin, Py_ssize_t end, double s, int64_t *cand,
                            Py_ssize_t limit, Py_ssize_t *count) {
    uint32_t running = 0;
    int32_t bound = (int32_t)INF_BITS;
    Py_ssize_t c = 0;
    int ok = 1;
    double s32 = (double)(float)s;
    for (Py_ssize_t i = begin; i < end; i += SCAN_CHUNK) {
        Py_ssize_t stop = end - i < SCAN_CHUNK ? end : i + SCAN_CHUNK;
        uint32_t top = max_abs_bits(x, i, stop);
        if (top > running) {
            running = top;
            if (running >= INF_BITS) { /* not finite: only the maximum matters now */
                ok = 0;
                running = top > max_abs_bits(x, stop, end) ? top : max_abs_bits(x, stop, end);
                break;
            }
            double sm = s32 * (double)u2f(running);
            float bf = (float)(0.49 * (sm < (double)FLT_MAX ? sm : (double)FLT_MAX));
            if (!(bf > FLT_MIN)) ok = 0; /* a zero or subnormal bound would keep nearly everything */
            bound = (int32_t)f2u(bf);
        }
        if (!ok || (int32_t)top < bound) continue;
        for (Py_ssize_t j = i; j < stop; j++) {
            if ((int32_t)(x[j] & ABS_MASK) < bound) continue;
            if (c >= limit) {
                ok = 0;
                break;
            }
            cand[c++] = j;
        }
    }
    *count = ok ? c : -1;
    return running;
}

/* The whole tensor's output (whole = 1) from the ascending candidate positions cand[0:c] (a
 * superset of the values with q != 0, all < n): the groups they fall in, merged over the five
 * parts in group order; every other group is 121. The last groups (with padding) are computed
 * directly. Returns the number of bytes written from p->out. */
static Py_ssize_t pack_sparse(packer *p, const int64_t *cand, Py_ssize_t c) {
    Py_ssize_t g = p->g, n = p->n;
    Py_ssize_t jfull = n - 4 * g;
    if (jfull < 0) jfull = 0;
    Py_ssize_t h[5], e[5], idx = 0;
    for (int k = 0; k < 5; k++) {
        h[k] = idx;
        while (idx < c && cand[idx] < (Py_ssize_t)(k + 1) * g) idx++;
        e[k] = idx;
    }
    p->o = p->out;
    p->run = 0;
    p->lead = -1;
    if (!p->zero_run) memset(p->out, ZERO_GROUP, (size_t)g);
    Py_ssize_t next = 0; /* the first group not yet written */
    for (;;) {
        Py_ssize_t j = PY_SSIZE_T_MAX;
        for (int k = 0; k < 5; k++)
            if (h[k] < e[k] && cand[h[k]] - (Py_ssize_t)k * g < j) j = cand[h[k]] - (Py_ssize_t)k * g;
        if (j >= jfull) break;
        int32_t acc = 0;
        for (int k = 0; k < 5; k++) {
            int32_t q = 0;
            if (h[k] < e[k] && cand[h[k]] - (Py_ssize_t)k * g == j) q = quant(p->x[cand[h[k]++]], p->tb);
            acc = 3 * acc + q;
        }
        if (p->zero_run) p->run += j - next;
        group_byte(p, j, (uint8_t)(acc + ZERO_GROUP));
        next = j + 1;
    }
    if (p->zero_run && jfull > next) p->run += jfull - next;
    for (Py_ssize_t j = jfull > next ? jfull : next; j < g; j++) {
        int32_t acc = 0;
        for (int k = 0; k < 5; k++) {
            Py_ssize_t i = (Py_ssize_t)k * g + j;
            acc = 3 * acc + (i < n ? quant(p->x[i], p->tb) : -1);
        }
        group_byte(p, j, (uint8_t)(acc + ZERO_GROUP));
    }
    if (!p->zero_run) return g;
    p->o = put_run(p->o, p->run);
    return p->o - p->out;
}

static int check_cand(Py_buffer *buf, const int64_t *cand, Py_ssize_t c, Py_ssize_t n) {
    if (check_len(buf, c, 8, "candidates")) return -1;
    for (Py_ssize_t i = 0; i < c; i++)
        if (cand[i] < 0 || cand[i] >= n || (i && cand[i] <= cand[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "candidates must be ascending positions inside the tensor");
            return -1;
        }
    return 0;
}

static int get_recon(PyObject *obj, Py_buffer *buf, Py_ssize_t n) {
    if (obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, buf, PyBUF_CONTIG) < 0) return -1;
    if (check_len(buf, n, 4, "recon")) {
        PyBuffer_Release(buf);
        return -1;
    }
    return 1;
}

static PyObject *max_abs(PyObject *self, PyObject *args) {
    Py_buffer a;
    Py_ssize_t begin, end;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nn", &a, &begin, &end)) return NULL;
    PyObject *result = NULL;
    if (begin < 0 || end < begin || end > a.len / 4) {
        PyErr_SetString(PyExc_ValueError, "max_abs: range out of bounds");
        goto done;
    }
    uint32_t top;
    Py_BEGIN_ALLOW_THREADS
    top = max_abs_bits((const uint32_t *)a.buf, begin, end);
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLong(top);
done:
    PyBuffer_Release(&a);
    return result;
}

static PyObject *params(PyObject *self, PyObject *args) {
    unsigned long max_bits;
    double s;
    (void)self;
    if (!PyArg_ParseTuple(args, "kd", &max_bits, &s)) return NULL;
    if (max_bits > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "params: max_bits must fit 32 bits");
        return NULL;
    }
    float m = 0.0f;
    uint32_t tb = INF_BITS;
    int code = scale_params((uint32_t)max_bits, s, &m, &tb);
    return Py_BuildValue("idk", code, (double)m, (unsigned long)tb);
}

static PyObject *pack(PyObject *self, PyObject *args) {
    Py_buffer a, out, rb;
    unsigned long tbits;
    float m;
    Py_ssize_t g0, g1;
    PyObject *recon_obj;
    int zero_run, whole;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*kfnnw*Opp", &a, &tbits, &m, &g0, &g1, &out, &recon_obj, &zero_run, &whole))
        return NULL;
    PyObject *result = NULL;
    int has_recon = 0;
    Py_ssize_t n = a.len / 4, g = groups_of(n);
    if (g0 < 0 || g1 < g0 || g1 > g || tbits > INF_BITS) {
        PyErr_SetString(PyExc_ValueError, "pack: group range or threshold out of bounds");
        goto done;
    }
    if (check_len(&out, g1, 1, "pack out")) goto done;
    has_recon = get_recon(recon_obj, &rb, n);
    if (has_recon < 0) goto done;
    packer p = {(const uint32_t *)a.buf, n, g, (int32_t)tbits, f2u(m), has_recon ? (uint32_t *)rb.buf : NULL,
                zero_run, whole, (uint8_t *)out.buf, NULL, 0, -1};
    Py_ssize_t lead, nbytes, trail;
    Py_BEGIN_ALLOW_THREADS
    pack_range(&p, g0, g1, &lead, &nbytes, &trail);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nnn", lead, nbytes, trail);
done:
    if (has_recon > 0) PyBuffer_Release(&rb);
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer a, cb;
    Py_ssize_t begin, end, off, limit;
    double s;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nndw*nn", &a, &begin, &end, &s, &cb, &off, &limit)) return NULL;
    PyObject *result = NULL;
    if (begin < 0 || end < begin || end > a.len / 4 || off < 0 || limit < 0 ||
        check_len(&cb, off + limit, 8, "scan candidates")) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "scan: range out of bounds");
        goto done;
    }
    Py_ssize_t count;
    uint32_t top;
    Py_BEGIN_ALLOW_THREADS
    top = scan_select((const uint32_t *)a.buf, begin, end, s, (int64_t *)cb.buf + off, limit, &count);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("kn", (unsigned long)top, count);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&cb);
    return result;
}

static PyObject *pack_sparse_py(PyObject *self, PyObject *args) {
    Py_buffer a, cb, out, rb;
    unsigned long tbits;
    float m;
    PyObject *recon_obj;
    int zero_run;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*kfw*Op", &a, &cb, &tbits, &m, &out, &recon_obj, &zero_run)) return NULL;
    PyObject *result = NULL;
    int has_recon = 0;
    Py_ssize_t n = a.len / 4, g = groups_of(n), c = cb.len / 8;
    if (tbits > INF_BITS) {
        PyErr_SetString(PyExc_ValueError, "pack_sparse: threshold out of bounds");
        goto done;
    }
    if (check_len(&out, g, 1, "pack_sparse out") || check_cand(&cb, (const int64_t *)cb.buf, c, n)) goto done;
    has_recon = get_recon(recon_obj, &rb, n);
    if (has_recon < 0) goto done;
    packer p = {(const uint32_t *)a.buf, n, g, (int32_t)tbits, f2u(m), has_recon ? (uint32_t *)rb.buf : NULL,
                zero_run, 1, (uint8_t *)out.buf, NULL, 0, -1};
    Py_ssize_t nbytes;
    Py_BEGIN_ALLOW_THREADS
    nbytes = pack_sparse(&p, (const int64_t *)cb.buf, c);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(nbytes);
done:
    if (has_recon > 0) PyBuffer_Release(&rb);
    PyBuffer_Release(&a);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer a, out, rb, cb;
    double s;
    PyObject *recon_obj;
    int zero_run;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*dw*Opw*", &a, &s, &out, &recon_obj, &zero_run, &cb)) return NULL;
    PyObject *result = NULL;
    int has_recon = 0;
    Py_ssize_t n = a.len / 4, g = groups_of(n);
    if (check_len(&out, g, 1, "encode out")) goto done;
    has_recon = get_recon(recon_obj, &rb, n);
    if (has_recon < 0) goto done;
    packer p = {(const uint32_t *)a.buf, n, g, 0, 0, has_recon ? (uint32_t *)rb.buf : NULL,
                zero_run, 1, (uint8_t *)out.buf, NULL, 0, -1};
    Py_ssize_t lead = 0, nbytes = 0, trail = 0, count;
    float m = 0.0f;
    uint32_t tb = INF_BITS, top;
    int code;
    Py_BEGIN_ALLOW_THREADS
    top = scan_select(p.x, 0, n, s, (int64_t *)cb.buf, cb.len / 8, &count);
    code = scale_params(top, s, &m, &tb);
    if (code == 0) {
        p.tb = (int32_t)tb;
        p.mb = f2u(m);
        if (count >= 0)
            nbytes = pack_sparse(&p, (const int64_t *)cb.buf, count);
        else
            pack_range(&p, 0, g, &lead, &nbytes, &trail);
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("idn", code, code == 1 || code == 2 ? (double)u2f(top) : (double)m, nbytes);
done:
    if (has_recon > 0) PyBuffer_Release(&rb);
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    PyBuffer_Release(&cb);
    return result;
}

/* --- decode ---------------------------------------------------------------------------------- */

typedef struct {
    float *out;
    Py_ssize_t n, g, jfull;
    float table[243][5]; /* the five values of each byte 0..242 */
} unpacker;

static inline void put_group(unpacker *u, Py_ssize_t j, uint8_t v) {
    const float *t = u->table[v];
    if (j < u->jfull) {
        for (int k = 0; k < 5; k++) u->out[(Py_ssize_t)k * u->g + j] = t[k];
    } else {
        for (int k = 0; k < 5; k++) {
            Py_ssize_t i = (Py_ssize_t)k * u->g + j;
            if (i < u->n) u->out[i] = t[k];
        }
    }
}

/* Groups [j, j + len) as 121s, i.e. five values 0 * scale each (the padding excluded). */
static void put_zero_groups(unpacker *u, Py_ssize_t j, Py_ssize_t len, float z) {
    for (int k = 0; k < 5; k++) {
        Py_ssize_t lo = (Py_ssize_t)k * u->g + j, hi = lo + len;
        if (hi > u->n) hi = u->n;
        for (Py_ssize_t i = lo; i < hi; i++) u->out[i] = z;
    }
}

static int decode_core(unpacker *u, const uint8_t *d, Py_ssize_t len, int zero_run, int skip_zero, float z) {
    Py_ssize_t g = u->g, j = 0;
    if (!zero_run) {
        if (len != g) return 0;
        for (Py_ssize_t i = 0; i < len; i++)
            if (d[i] >= RUN_BASE) return 0;
        for (j = 0; j < g; j++)
            if (!skip_zero || d[j] != ZERO_GROUP) put_group(u, j, d[j]);
        return 1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        uint8_t v = d[i];
        if (v >= RUN_BASE) {
            Py_ssize_t run = (Py_ssize_t)v - (RUN_BASE - 2);
            if (run > g - j) return 0;
            if (!skip_zero) put_zero_groups(u, j, run, z);
            j += run;
        } else {
            if (j >= g) return 0;
            if (!skip_zero || v != ZERO_GROUP) put_group(u, j, v);
            j++;
        }
    }
    return j == g;
}

static PyObject *expanded_length(PyObject *self, PyObject *args) {
    Py_buffer data;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    const uint8_t *d = (const uint8_t *)data.buf;
    Py_ssize_t total = data.len;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < data.len; i++) total += d[i] >= RUN_BASE ? d[i] - (RUN_BASE - 1) : 0;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromSsize_t(total);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    Py_ssize_t numel;
    double scale;
    int zero_run, zeroed;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*ndpw*p", &data, &numel, &scale, &zero_run, &out, &zeroed)) return NULL;
    PyObject *result = NULL;
    unpacker *u = NULL;
    if (numel < 0 || check_len(&out, numel, 4, "decode out")) goto done;
    if (!(scale >= 0.0) || scale > DBL_MAX) {
        PyErr_SetString(PyExc_ValueError, "decode: scale must be a finite number >= 0");
        goto done;
    }
    u = PyMem_RawMalloc(sizeof(unpacker));
    if (u == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    /* float32(scale) as NumPy rounds it: to nearest, inf past the float32 range */
    float s32 = scale >= (double)FLT_MAX + 0.5 * ((double)FLT_MAX - (double)u2f(0x7F7FFFFEu)) ? u2f(INF_BITS)
                                                                                               : (float)scale;
    u->out = (float *)out.buf;
    u->n = numel;
    u->g = groups_of(numel);
    u->jfull = numel - 4 * u->g > 0 ? numel - 4 * u->g : 0;
    for (int v = 0; v < 243; v++) {
        int r = v;
        for (int k = 4; k >= 0; k--) {
            u->table[v][k] = (float)(r % 3 - 1) * s32;
            r /= 3;
        }
    }
    float z = 0.0f * s32;
    int skip_zero = zeroed && (f2u(s32) & ABS_MASK) < INF_BITS; /* then z is +0.0, already there */
    ok = decode_core(u, (const uint8_t *)data.buf, data.len, zero_run, skip_zero, z);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyMem_RawFree(u);
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

/* --- whole updates: many tensors in one call (fedcomp/codecs/threelc_device.py) --------------- */

/* Whether the 32 bytes at d are all 121 (four 8-byte loads: vectorised by the compiler). */
static inline int all_zero_groups32(const uint8_t *d) {
    const uint64_t k = 0x7979797979797979ull; /* 121 in every byte */
    uint64_t w[4];
    memcpy(w, d, sizeof w);
    return ((w[0] ^ k) | (w[1] ^ k) | (w[2] ^ k) | (w[3] ^ k)) == 0;
}

/* The zero-run coding of the 8 bytes at d, `run` groups of 121 pending before them: each byte
 * other than 121 (found by a bit trick on the word, not a compare per byte) ends the run before
 * it. A block of mostly 121 with a few others (an update with error feedback: a third of the
 * blocks after some rounds) costs its few others, not eight branches. Little-endian only: the
 * lowest set bit is the first byte in memory. */
static inline uint8_t *zero_runs8(const uint8_t *d, uint8_t *o, Py_ssize_t *run) {
    const uint64_t k = 0x7979797979797979ull, low7 = 0x7f7f7f7f7f7f7f7full;
    uint64_t x;
    memcpy(&x, d, sizeof x);
    x ^= k; /* 0 where the byte is 121 */
    uint64_t other = (((x & low7) + low7) | x) & ~low7; /* top bit of each byte that is not 0 */
    int last = 0;
    while (other) {
        int at = __builtin_ctzll(other) >> 3;
        *run += at - last;
        o = put_run(o, *run);
        *run = 0;
        *o++ = d[at];
        last = at + 1;
        other &= other - 1;
    }
    *run += 8 - last;
    return o;
}

/* The zero-run coding of the n bytes at d into o; returns its length. */
static Py_ssize_t zero_runs_one(const uint8_t *d, Py_ssize_t n, uint8_t *o) {
    uint8_t *start = o;
    Py_ssize_t run = 0, j = 0;
    while (j < n) {
        if (j + 32 <= n && all_zero_groups32(d + j)) { /* the usual case: a sparse update */
            run += 32;
            j += 32;
            continue;
        }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (j + 32 <= n) {
            for (int w = 0; w < 32; w += 8) o = zero_runs8(d + j + w, o, &run);
            j += 32;
            continue;
        }
#endif
        Py_ssize_t stop = j + 32 <= n ? j + 32 : n;
        for (; j < stop; j++) {
            uint8_t v = d[j];
            if (v == ZERO_GROUP) {
                run++;
            } else {
                o = put_run(o, run);
                run = 0;
                *o++ = v;
            }
        }
    }
    o = put_run(o, run);
    return o - start;
}

typedef struct {
    const uint8_t *data;
    uint8_t *out;
    const int64_t *groups, *starts;
    int64_t *lengths;
    Py_ssize_t ntasks, next;
} zero_runs_job;

static void zero_runs_body(void *arg) {
    zero_runs_job *job = arg;
    for (Py_ssize_t i; (i = team_next(&job->next, job->ntasks)) >= 0;) {
        int64_t at = job->starts[i];
        job->lengths[i] = (int64_t)zero_runs_one(job->data + at, (Py_ssize_t)job->groups[i], job->out + at);
    }
}

static PyObject *zero_runs_many(PyObject *self, PyObject *args) {
    Py_buffer data, gb, out, lb;
    int threads, use_team;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*w*ip", &data, &gb, &out, &lb, &threads, &use_team)) return NULL;
    PyObject *result = NULL;
    int64_t *starts = NULL;
    Py_ssize_t ntensors = gb.len / 8, total = 0;
    const int64_t *g = (const int64_t *)gb.buf;
    if (gb.len % 8 || check_len(&lb, ntensors, 8, "zero_runs_many lengths")) goto done;
    starts = PyMem_Malloc(ntensors ? (size_t)ntensors * sizeof(int64_t) : 1);
    if (starts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < ntensors; i++) {
        if (g[i] < 0 || g[i] > data.len - total) {
            PyErr_SetString(PyExc_ValueError, "zero_runs_many: the groups do not add up to the data's length");
            goto done;
        }
        starts[i] = (int64_t)total;
        total += g[i];
    }
    if (total != data.len) {
        PyErr_SetString(PyExc_ValueError, "zero_runs_many: the groups do not add up to the data's length");
        goto done;
    }
    if (check_len(&out, data.len, 1, "zero_runs_many out")) goto done; /* a coding is never longer */
    zero_runs_job job = {(const uint8_t *)data.buf, (uint8_t *)out.buf, g, starts, (int64_t *)lb.buf, ntensors, 0};
    Py_BEGIN_ALLOW_THREADS
    team_run(zero_runs_body, &job, threads, use_team);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(starts);
    PyBuffer_Release(&data);
    PyBuffer_Release(&gb);
    PyBuffer_Release(&out);
    PyBuffer_Release(&lb);
    return result;
}

/* Whether a stream is valid: 0, or -1 (the NumPy decoder's checks: runs past g or fewer than g
 * groups; without zero runs, a length other than g or a byte past 242). */
static int stream_valid(const uint8_t *d, Py_ssize_t len, int zero_run, Py_ssize_t g) {
    Py_ssize_t j = 0;
    if (!zero_run) {
        if (len != g) return -1;
        for (Py_ssize_t i = 0; i < len; i++)
            if (d[i] >= RUN_BASE) return -1;
        return 0;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        uint8_t v = d[i];
        Py_ssize_t run = v >= RUN_BASE ? (Py_ssize_t)v - (RUN_BASE - 2) : 1;
        if (run > g - j) return -1;
        j += run;
    }
    return j == g ? 0 : -1;
}

/* check_many([(data, zero_run, groups), ...]): -1, or the index of the first invalid stream. */
static PyObject *check_many(PyObject *self, PyObject *args) {
    PyObject *list;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &list)) return NULL;
    Py_ssize_t ntasks = PyList_GET_SIZE(list);
    for (Py_ssize_t i = 0; i < ntasks; i++) {
        PyObject *task = PyList_GET_ITEM(list, i);
        PyObject *buf;
        int zr;
        Py_ssize_t g;
        Py_buffer view;
        if (!PyArg_ParseTuple(task, "Opn;check_many: a task is (data, zero_run, groups)", &buf, &zr, &g)) return NULL;
        if (g < 0) {
            PyErr_SetString(PyExc_ValueError, "check_many: groups must be >= 0");
            return NULL;
        }
        if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0) return NULL;
        int bad = stream_valid((const uint8_t *)view.buf, view.len, zr, g);
        PyBuffer_Release(&view);
        if (bad) return PyLong_FromSsize_t(i);
    }
    return PyLong_FromSsize_t(-1);
}

static PyMethodDef methods[] = {
    {"max_abs", max_abs, METH_VARARGS, "Largest magnitude bits of float32 a[begin:end]."},
    {"params", params, METH_VARARGS, "(code, m, t_bits): 3LC's scale and threshold for max|a| bits and s."},
    {"pack", pack, METH_VARARGS, "Quantize + pack (+ zero-run code) the groups [g0, g1): (lead, nbytes, trail)."},
    {"scan", scan, METH_VARARGS, "max|a| bits and candidate positions for +-1 in [begin, end): (bits, count)."},
    {"pack_sparse", pack_sparse_py, METH_VARARGS, "The whole tensor's bytes from candidate positions: nbytes."},
    {"encode", encode, METH_VARARGS, "The whole 3LC encoding of a tensor: (code, m, nbytes)."},
    {"expanded_length", expanded_length, METH_VARARGS, "Groups a zero-run stream expands to."},
    {"decode", decode, METH_VARARGS, "Zero-run decode + unpack + scale; False on an invalid stream."},
    {"zero_runs_many", zero_runs_many, METH_VARARGS, "Zero-run code many tensors' packed bytes: lengths filled."},
    {"check_many", check_many, METH_VARARGS, "Whether many streams are valid: -1 or the first bad."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_threelc", "C kernels for 3LC's CPU paths.", -1, methods};

PyMODINIT_FUNC PyInit__threelc(void) { return PyModule_Create(&module); }
