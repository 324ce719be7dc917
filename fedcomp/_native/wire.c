/* fedcomp._native._wire: the wire layer's one-pass kernels (fedcomp/wire/fast_writer.py).
 *
 * Writing a dense update used to cost a cast into the output and then a second pass over the
 * output for its CRC-32; reading one, a CRC pass and then a cast. These kernels fuse the two: the
 * values are cast (or copied) a few kilobytes at a time and each piece's CRC is taken while it is
 * still in the first-level cache, so the whole update is read from memory once. The CRC is zlib's
 * (the reflected IEEE 802.3 polynomial), computed with carry-less multiplication where the CPU has
 * it (the folding of Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", with
 * the constants the Linux kernel's crc32-pclmul uses and the 256- and 1024-bit ones derived the
 * same way, see K256_LO) and with a table elsewhere; the casts are
 * F16C's round-to-nearest-even conversions, the instructions torch's own vectorized casts use.
 *
 *   crc32(buffer, crc=0) -> int               zlib.crc32(buffer, crc).
 *   crc32_combine(crc1, crc2, len2) -> int    the CRC of A + B from crc32(A), crc32(B), len(B).
 *   run(ops, crc) -> int
 *       each op (kind, dst, src, nbytes) in order, the CRC continued over the wire side of each:
 *         COPY (0)     nbytes from src to dst (an address, or a bytes-like object for src);
 *         F32_F16 (1)  nbytes / 2 float32 values at src cast to float16 at dst (dst is the wire);
 *         F16_F32 (2)  nbytes / 2 float16 values at src (the wire) cast to float32 at dst (from
 *                      1 MiB of wire on, by non-temporal stores: the output is not read first);
 *         CRC (3)      the CRC of nbytes at src only (dst is ignored).
 *       Returns the CRC; the GIL is released while the ops run.
 *   run2(first, second) -> (crc1, crc2) | None
 *       run(first, 0) and run(second, 0) at once, on two threads of the OpenMP runtime torch has
 *       loaded (see below); None when the process has none (the caller then uses a thread of its own).
 *   features() -> dict        the instruction paths in use: "crc" (as crc_variant), "f16c" (bool).
 *   crc_variant([name]) -> str                the CRC in use, "table", "pclmul" or "vpclmul" (chosen at
 *       import: the widest this CPU has; the same values, tested each way); a name switches (tests).
 *   scan_update(...), scan_tensors(...)      an untrusted update's top-level fields and its tensors
 *       read as fedcomp.wire.serde's Python readers read them (see each; bounds-checked, they
 *       allocate nothing but their results and read nothing outside the data).
 *   frame_tensors(...)                       an update's tensors framed as the writer's parts, the
 *       bytes fedcomp.wire.serde's Python framing makes (see it).
 *
 * Addresses are plain integers: this is a private kernel, called only by the wire layer
 * (fedcomp.wire.fast_writer, and fedcomp.wire.serde.DenseFrames through it) with addresses of
 * buffers it holds and sizes it has checked against them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "team.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86_DISPATCH 1
#endif

/* --- CRC-32 ------------------------------------------------------------------------------------- */

static uint32_t CRC_TABLE[8][256];

static void crc_init_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        CRC_TABLE[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) CRC_TABLE[t][i] = (CRC_TABLE[t - 1][i] >> 8) ^ CRC_TABLE[0][CRC_TABLE[t - 1][i] & 0xFF];
}

/* The raw CRC state (not inverted) continued over p[0:n], eight bytes a step. */
static uint32_t crc_table(uint32_t state, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= state;
        state = CRC_TABLE[7][w & 0xFF] ^ CRC_TABLE[6][(w >> 8) & 0xFF] ^ CRC_TABLE[5][(w >> 16) & 0xFF] ^
                CRC_TABLE[4][(w >> 24) & 0xFF] ^ CRC_TABLE[3][(w >> 32) & 0xFF] ^ CRC_TABLE[2][(w >> 40) & 0xFF] ^
                CRC_TABLE[1][(w >> 48) & 0xFF] ^ CRC_TABLE[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) state = (state >> 8) ^ CRC_TABLE[0][(state ^ *p++) & 0xFF];
    return state;
}

#ifdef HAVE_X86_DISPATCH
/* Folding constants of the reflected polynomial: a 128-bit lane folded D bits forward is its low
 * 64 bits times x^(D+32) plus its high 64 bits times x^(D-32), modulo P (each constant bit-reflected
 * and shifted left once, as the reflected products need). D = 128, 256, 512, 1024. */
#define K128_LO 0x1751997d0LL
#define K128_HI 0x0ccaa009eLL
#define K256_LO 0x0f1da05aaLL
#define K256_HI 0x15a546366LL
#define K512_LO 0x154442bd4LL
#define K512_HI 0x1c6e41596LL
#define K1024_LO 0x1e88ef372LL
#define K1024_HI 0x14a7fe880LL

__attribute__((target("pclmul,sse4.1"))) static inline __m128i fold128(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

__attribute__((target("avx2,vpclmulqdq"))) static inline __m256i fold256(__m256i y, __m256i k) {
    return _mm256_xor_si256(_mm256_clmulepi64_epi128(y, k, 0x00), _mm256_clmulepi64_epi128(y, k, 0x11));
}

/* The 16-byte loop and the final reduction shared by both folds: x0 (the folded state) continued
 * over p[0:n] 16 bytes a step, reduced to the raw 32-bit state, the tail by the table. */
__attribute__((target("pclmul,sse4.1"))) static inline uint32_t crc_reduce(__m128i x0, __m128i k3k4, const uint8_t *p, size_t n) {
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x1F7011641LL, 0x1DB710641LL); /* lo P', hi u' (Barrett) */
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
    while (n >= 16) {
        x0 = _mm_xor_si128(fold128(x0, k3k4), _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    /* 128 -> 64 bits (appending 32 zero bits), 64 -> 32, then Barrett's reduction */
    __m128i t = _mm_clmulepi64_si128(k3k4, x0, 0x01);
    x0 = _mm_xor_si128(_mm_srli_si128(x0, 8), t);
    t = _mm_srli_si128(x0, 4);
    x0 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x0, mask32), k5, 0x00), t);
    t = x0;
    x0 = _mm_clmulepi64_si128(_mm_and_si128(x0, mask32), poly, 0x10);
    x0 = _mm_clmulepi64_si128(_mm_and_si128(x0, mask32), poly, 0x00);
    x0 = _mm_xor_si128(x0, t);
    uint32_t state = (uint32_t)_mm_extract_epi32(x0, 1);
    return crc_table(state, p, n);
}

/* The raw CRC state continued over p[0:n] by folding 64 bytes a step (n >= 64; the tail past the
 * last whole 16 bytes by the table). */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_pclmul(uint32_t state, const uint8_t *p, size_t n) {
    const __m128i k1k2 = _mm_set_epi64x(K512_HI, K512_LO);
    const __m128i k3k4 = _mm_set_epi64x(K128_HI, K128_LO);
    __m128i x0 = _mm_loadu_si128((const __m128i *)p), x1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 32)), x3 = _mm_loadu_si128((const __m128i *)(p + 48));
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)state));
    p += 64;
    n -= 64;
    while (n >= 64) {
        x0 = _mm_xor_si128(fold128(x0, k1k2), _mm_loadu_si128((const __m128i *)p));
        x1 = _mm_xor_si128(fold128(x1, k1k2), _mm_loadu_si128((const __m128i *)(p + 16)));
        x2 = _mm_xor_si128(fold128(x2, k1k2), _mm_loadu_si128((const __m128i *)(p + 32)));
        x3 = _mm_xor_si128(fold128(x3, k1k2), _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        n -= 64;
    }
    /* four lanes into one (each folded 128 bits forward onto the next) */
    x0 = _mm_xor_si128(fold128(x0, k3k4), x1);
    x0 = _mm_xor_si128(fold128(x0, k3k4), x2);
    x0 = _mm_xor_si128(fold128(x0, k3k4), x3);
    return crc_reduce(x0, k3k4, p, n);
}

/* The same with 256-bit carry-less products (VPCLMULQDQ): four lanes of 32 bytes, 128 bytes a
 * step (n >= 128), two 128-bit folds per instruction. */
__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.1"))) static uint32_t crc_vpclmul(uint32_t state, const uint8_t *p, size_t n) {
    const __m256i k1024 = _mm256_set_epi64x(K1024_HI, K1024_LO, K1024_HI, K1024_LO);
    const __m256i k256 = _mm256_set_epi64x(K256_HI, K256_LO, K256_HI, K256_LO);
    const __m128i k3k4 = _mm_set_epi64x(K128_HI, K128_LO);
    __m256i y0 = _mm256_loadu_si256((const __m256i *)p), y1 = _mm256_loadu_si256((const __m256i *)(p + 32));
    __m256i y2 = _mm256_loadu_si256((const __m256i *)(p + 64)), y3 = _mm256_loadu_si256((const __m256i *)(p + 96));
    y0 = _mm256_xor_si256(y0, _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, (int)state));
    p += 128;
    n -= 128;
    while (n >= 128) {
        y0 = _mm256_xor_si256(fold256(y0, k1024), _mm256_loadu_si256((const __m256i *)p));
        y1 = _mm256_xor_si256(fold256(y1, k1024), _mm256_loadu_si256((const __m256i *)(p + 32)));
        y2 = _mm256_xor_si256(fold256(y2, k1024), _mm256_loadu_si256((const __m256i *)(p + 64)));
        y3 = _mm256_xor_si256(fold256(y3, k1024), _mm256_loadu_si256((const __m256i *)(p + 96)));
        p += 128;
        n -= 128;
    }
    y0 = _mm256_xor_si256(fold256(y0, k256), y1);
    y0 = _mm256_xor_si256(fold256(y0, k256), y2);
    y0 = _mm256_xor_si256(fold256(y0, k256), y3);
    while (n >= 32) {
        y0 = _mm256_xor_si256(fold256(y0, k256), _mm256_loadu_si256((const __m256i *)p));
        p += 32;
        n -= 32;
    }
    /* the earlier (low) 128 bits folded onto the later */
    __m128i x0 = _mm_xor_si128(fold128(_mm256_castsi256_si128(y0), k3k4), _mm256_extracti128_si256(y0, 1));
    return crc_reduce(x0, k3k4, p, n);
}
#endif

/* 0: the table; 1: 128-bit folds (PCLMULQDQ); 2: 256-bit folds (VPCLMULQDQ), from 128 bytes. */
static int USE_PCLMUL = 0;

static uint32_t crc_raw(uint32_t state, const uint8_t *p, size_t n) {
#ifdef HAVE_X86_DISPATCH
    if (USE_PCLMUL == 2 && n >= 128) return crc_vpclmul(state, p, n);
    if (USE_PCLMUL && n >= 64) return crc_pclmul(state, p, n);
#endif
    return crc_table(state, p, n);
}

/* zlib's crc32_combine: x^(8 len2) times crc1 modulo the polynomial, plus crc2. */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ 0xEDB88320u : b >> 1;
    }
    return p;
}

static uint32_t crc_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
    uint32_t x2n = 1u << 30, p = 1u << 31; /* x^1 and x^0 */
    uint64_t n = len2;
    int k = 3; /* x^(8 len2) = x^(len2 * 2^3) */
    for (int i = 0; i < k; i++) x2n = multmodp(x2n, x2n);
    while (n) {
        if (n & 1) p = multmodp(x2n, p);
        n >>= 1;
        x2n = multmodp(x2n, x2n);
    }
    return multmodp(p, crc1) ^ crc2;
}

/* --- casts -------------------------------------------------------------------------------------- */

static int USE_F16C = 0;

#ifdef HAVE_X86_DISPATCH
__attribute__((target("avx,f16c"))) static void f32_to_f16(uint16_t *dst, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    if (i < n) { /* the tail through the same instruction (a NaN keeps the bits the body gives it) */
        float tmp[8] = {0};
        uint16_t out[8];
        memcpy(tmp, src + i, (n - i) * sizeof(float));
        _mm_storeu_si128((__m128i *)out, _mm256_cvtps_ph(_mm256_loadu_ps(tmp), _MM_FROUND_TO_NEAREST_INT));
        memcpy(dst + i, out, (n - i) * sizeof(uint16_t));
    }
}

__attribute__((target("avx,f16c"))) static void f16_to_f32(float *dst, const uint16_t *src, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    if (i < n) {
        uint16_t tmp[8] = {0};
        float out[8];
        memcpy(tmp, src + i, (n - i) * sizeof(uint16_t));
        _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tmp)));
        memcpy(dst + i, out, (n - i) * sizeof(float));
    }
}

/* f16_to_f32 with non-temporal stores (dst 32-byte aligned after a peel): for outputs larger than
 * the caches, whose lines a normal store first reads from memory (a decode writes twice the bytes
 * it reads). The caller fences once the op is done (run_op). */
__attribute__((target("avx,f16c"))) static void f16_to_f32_stream(float *dst, const uint16_t *src, size_t n) {
    size_t i = 0;
    size_t peel = (size_t)((32 - ((uintptr_t)dst & 31)) & 31) / sizeof(float);
    if (((uintptr_t)dst & 3) != 0 || peel >= n) { /* (a float32 buffer is 4-byte aligned) */
        f16_to_f32(dst, src, n);
        return;
    }
    if (peel) f16_to_f32(dst, src, peel);
    for (i = peel; i + 8 <= n; i += 8)
        _mm256_stream_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    if (i < n) f16_to_f32(dst + i, src + i, n - i);
}
#endif

/* --- run ---------------------------------------------------------------------------------------- */

/* Ops at least this large write their float32 output with non-temporal stores. */
#define STREAM_MIN ((size_t)1 << 20)

enum { OP_COPY = 0, OP_F32_F16 = 1, OP_F16_F32 = 2, OP_CRC = 3 };

/* Bytes of wire per piece: small enough that a piece written (or read) is still in the first-level
 * cache when its CRC is taken. */
#define PIECE 8192

typedef struct {
    int kind;
    uint8_t *dst;
    const uint8_t *src;
    size_t nbytes;
} op_t;

/* One op, a piece at a time: the piece written (or read) and its CRC taken while it is in cache. */
static uint32_t run_op(const op_t *op, uint32_t state) {
    size_t done = 0, n = op->nbytes;
    while (done < n) {
        size_t m = n - done < PIECE ? n - done : PIECE;
        switch (op->kind) {
        case OP_COPY:
            memcpy(op->dst + done, op->src + done, m);
            state = crc_raw(state, op->dst + done, m);
            break;
#ifdef HAVE_X86_DISPATCH
        case OP_F32_F16:
            f32_to_f16((uint16_t *)(op->dst + done), (const float *)(op->src + 2 * done), m / 2);
            state = crc_raw(state, op->dst + done, m);
            break;
        case OP_F16_F32:
            state = crc_raw(state, op->src + done, m);
            if (n >= STREAM_MIN) f16_to_f32_stream((float *)(op->dst + 2 * done), (const uint16_t *)(op->src + done), m / 2);
            else f16_to_f32((float *)(op->dst + 2 * done), (const uint16_t *)(op->src + done), m / 2);
            break;
#endif
        default: /* OP_CRC */
            if (n - done >= 4 * PIECE) m = n - done; /* nothing to interleave with: one long fold */
            state = crc_raw(state, op->src + done, m);
            break;
        }
        done += m;
    }
#ifdef HAVE_X86_DISPATCH
    if (op->kind == OP_F16_F32 && n >= STREAM_MIN) _mm_sfence(); /* the streamed stores, visible */
#endif
    return state;
}

static void *address(PyObject *obj) {
    void *p = PyLong_AsVoidPtr(obj);
    return (p == NULL && PyErr_Occurred()) ? NULL : p;
}

/* A parsed op list and the buffers it holds. */
typedef struct {
    PyObject *fast;
    op_t *ops;
    Py_buffer *bufs;
    Py_ssize_t count, held;
} oplist_t;

static void oplist_free(oplist_t *l) {
    for (Py_ssize_t i = 0; i < l->held; i++) PyBuffer_Release(&l->bufs[i]);
    PyMem_Free(l->bufs);
    PyMem_Free(l->ops);
    Py_XDECREF(l->fast);
    memset(l, 0, sizeof(*l));
}

/* Parse a sequence of (kind, dst, src, nbytes) into `l` (0), or set an error (-1; `l` is then
 * freed by the caller all the same). */
static int oplist_parse(PyObject *seq, oplist_t *l) {
    memset(l, 0, sizeof(*l));
    l->fast = PySequence_Fast(seq, "run: ops must be a sequence");
    if (l->fast == NULL) return -1;
    l->count = PySequence_Fast_GET_SIZE(l->fast);
    l->ops = PyMem_Calloc(l->count ? l->count : 1, sizeof(op_t));
    l->bufs = PyMem_Calloc(l->count ? l->count : 1, sizeof(Py_buffer));
    if (l->ops == NULL || l->bufs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < l->count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(l->fast, i), *dst, *src;
        op_t *op = &l->ops[i];
        int kind;
        Py_ssize_t nbytes;
        if (!PyArg_ParseTuple(item, "iOOn;run: an op is (kind, dst, src, nbytes)", &kind, &dst, &src, &nbytes)) return -1;
        if (kind < OP_COPY || kind > OP_CRC || nbytes < 0) {
            PyErr_Format(PyExc_ValueError, "run: op %zd: kind %d or size %zd out of range", i, kind, nbytes);
            return -1;
        }
        if ((kind == OP_F32_F16 || kind == OP_F16_F32) && (!USE_F16C || nbytes % 2)) {
            PyErr_Format(PyExc_ValueError, "run: op %zd: no F16C here, or an odd size", i);
            return -1;
        }
        op->kind = kind;
        op->nbytes = (size_t)nbytes;
        if (PyLong_Check(src)) {
            op->src = address(src);
        } else {
            Py_buffer *buf = &l->bufs[l->held];
            if (PyObject_GetBuffer(src, buf, PyBUF_SIMPLE) < 0) return -1;
            l->held++;
            op->src = buf->buf;
            if (buf->len < nbytes) {
                PyErr_Format(PyExc_ValueError, "run: op %zd: source holds fewer than %zd bytes", i, nbytes);
                return -1;
            }
        }
        if (kind != OP_CRC) op->dst = address(dst);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

static uint32_t oplist_run(const oplist_t *l, uint32_t state) {
    for (Py_ssize_t i = 0; i < l->count; i++) state = run_op(&l->ops[i], state);
    return state;
}

static PyObject *run(PyObject *self, PyObject *args) {
    PyObject *seq, *result = NULL;
    unsigned long crc;
    oplist_t l;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ok", &seq, &crc)) return NULL;
    if (oplist_parse(seq, &l) == 0) {
        uint32_t state = ~(uint32_t)crc;
        Py_BEGIN_ALLOW_THREADS;
        state = oplist_run(&l, state);
        Py_END_ALLOW_THREADS;
        result = PyLong_FromUnsignedLong(~state);
    }
    oplist_free(&l);
    return result;
}

/* --- run2: two op lists on torch's OpenMP team ---------------------------------------------------
 *
 * The two halves run on the OpenMP team torch has loaded (team.h says why); when the process has
 * none, run2 says so and the caller uses a thread of its own. */

typedef struct {
    const oplist_t *lists[2];
    uint32_t states[2];
} pair_t;

static void pair_body(void *arg) {
    pair_t *job = arg;
    int t = OMP_THREAD_NUM(), n = OMP_NUM_THREADS();
    if (n == 1) { /* the runtime gave us no second thread: both here, in turn */
        job->states[0] = oplist_run(job->lists[0], job->states[0]);
        job->states[1] = oplist_run(job->lists[1], job->states[1]);
    } else if (t < 2) {
        job->states[t] = oplist_run(job->lists[t], job->states[t]);
    }
}

static PyObject *run2(PyObject *self, PyObject *args) {
    PyObject *first, *second, *result = NULL;
    oplist_t a = {0}, b = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OO", &first, &second)) return NULL;
    if (!omp_found()) Py_RETURN_NONE;
    int ok = oplist_parse(first, &a) == 0;
    ok = ok && oplist_parse(second, &b) == 0;
    if (ok) {
        pair_t job = {{&a, &b}, {0xFFFFFFFFu, 0xFFFFFFFFu}};
        Py_BEGIN_ALLOW_THREADS;
        GOMP_PARALLEL(pair_body, &job, 2, 0);
        Py_END_ALLOW_THREADS;
        result = Py_BuildValue("kk", (unsigned long)~job.states[0], (unsigned long)~job.states[1]);
    }
    oplist_free(&a);
    oplist_free(&b);
    return result;
}

static PyObject *crc32(PyObject *self, PyObject *args) {
    Py_buffer buf;
    unsigned long crc = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*|k", &buf, &crc)) return NULL;
    uint32_t state = ~(uint32_t)crc;
    if (buf.len >= 65536) {
        Py_BEGIN_ALLOW_THREADS;
        state = crc_raw(state, buf.buf, (size_t)buf.len);
        Py_END_ALLOW_THREADS;
    } else {
        state = crc_raw(state, buf.buf, (size_t)buf.len);
    }
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLong(~state);
}

static PyObject *crc32_combine(PyObject *self, PyObject *args) {
    unsigned long crc1, crc2;
    unsigned long long len2;
    (void)self;
    if (!PyArg_ParseTuple(args, "kkK", &crc1, &crc2, &len2)) return NULL;
    return PyLong_FromUnsignedLong(crc_combine((uint32_t)crc1, (uint32_t)crc2, (uint64_t)len2));
}

static const char *CRC_NAMES[] = {"table", "pclmul", "vpclmul"};

static int crc_supported(int level) {
#ifdef HAVE_X86_DISPATCH
    if (level == 2) return crc_supported(1) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
    if (level == 1) return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
    return level == 0;
}

static PyObject *features(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return Py_BuildValue("{s:s,s:O}", "crc", CRC_NAMES[USE_PCLMUL], "f16c", USE_F16C ? Py_True : Py_False);
}

/* For tests: the CRC variant in use ("table", "pclmul" or "vpclmul"); with a name, switch to it
 * first (ValueError where this CPU lacks it). */
static PyObject *crc_variant(PyObject *self, PyObject *args) {
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    if (name != NULL) {
        int level = -1;
        for (int i = 0; i < 3; i++)
            if (strcmp(name, CRC_NAMES[i]) == 0) level = i;
        if (level < 0 || !crc_supported(level)) {
            PyErr_Format(PyExc_ValueError, "crc_variant: %s is not available here", name);
            return NULL;
        }
        USE_PCLMUL = level;
    }
    return PyUnicode_FromString(CRC_NAMES[USE_PCLMUL]);
}

/* --- scan_tensors: an update's tensors read without protobuf -------------------------------------
 *
 * scan_tensors(data, spans, wide, prefixes, dtype_of, codec_ids, kinds, keys) -> list
 *
 * fedcomp.wire.serde._fast_tensor for every tensor of an update at once, the same rules byte for
 * byte (serde's tests compare the two on mutated tensors): tensor i lies at data[spans[2i],
 * spans[2i+1]) (spans: uint32, or int64 where wide); it is read here only when it is exactly the
 * canonical encoding of a tensor whose name and shape fields are prefixes[i] (None: not read), with
 * an SBC, 3LC or dense payload whose every field is what the writer makes of its value. Per tensor
 * None (left to the general parser, which reports what is wrong) or a tuple
 *   (codec index, dtype index, codec_version, float, a, b, blob start, blob stop)
 * with, for SBC, the mean, golomb_b and nnz; for 3LC the scale, numel and zero_run; for dense
 * 0.0, the encoding's dtype index and 0; the blob (bits, data) is data[start:stop]. dtype_of (256
 * bytes) maps a dtype enum byte to its index + 1 (0: unknown); codec_ids are the known codec ids'
 * bytes and kinds (bytes) each one's payload (0 SBC, 1 3LC, 2 dense, else not read here); keys
 * (bytes) the protobuf keys: dtype, codec_id, codec_version, the SBC, 3LC and dense payloads' keys,
 * then SBC mean, golomb_b, nnz, bits; 3LC scale, numel, zero_run, data; dense encoding, data.
 * Nothing is read outside data; nothing is allocated but the result. */

/* serde._varint: a minimal base-128 varint below 2**64 at d[*pos, end); 0 where there is none. */
static int scan_varint(const uint8_t *d, Py_ssize_t *pos, Py_ssize_t end, uint64_t *out) {
    Py_ssize_t p = *pos, start = p;
    uint64_t value = 0;
    int shift = 0;
    uint8_t byte;
    for (;;) {
        if (p >= end) return 0;
        byte = d[p++];
        if (shift == 63 && (byte & 0x7F) > 1) return 0; /* past 64 bits */
        value |= (uint64_t)(byte & 0x7F) << shift;
        if (!(byte & 0x80)) break;
        shift += 7;
        if (shift > 63) return 0; /* longer than 10 bytes */
    }
    if (byte == 0 && p - start > 1) return 0; /* not minimal */
    *out = value;
    *pos = p;
    return 1;
}

/* serde._last_blob: a non-empty bytes field with key `key` at d[pos] that runs to stop. */
static int scan_blob(const uint8_t *d, Py_ssize_t pos, Py_ssize_t stop, uint8_t key, Py_ssize_t *at) {
    uint64_t length;
    if (pos >= stop || d[pos] != key) return 0;
    pos++;
    if (!scan_varint(d, &pos, stop, &length)) return 0;
    if (length == 0 || length != (uint64_t)(stop - pos)) return 0;
    *at = pos;
    return 1;
}

/* A float field's four bytes as the writer writes them: not a zero, not a NaN. */
static int scan_f32(const uint8_t *d, Py_ssize_t pos, double *out) {
    uint32_t bits;
    float f;
    memcpy(&bits, d + pos, 4);
    memcpy(&f, &bits, 4);
    if ((bits & 0x7FFFFFFFu) == 0 || f != f) return 0;
    *out = (double)f;
    return 1;
}

enum { K_DTYPE, K_CODEC_ID, K_VERSION, K_SBC, K_TLC, K_DENSE, K_MEAN, K_B, K_NNZ, K_BITS, K_SCALE, K_NUMEL,
       K_ZERO_RUN, K_DATA, K_ENCODING, K_DENSE_DATA, K_COUNT };

/* One tensor: 1 and the tuple's fields where it is read here, else 0. */
static int scan_one(const uint8_t *d, Py_ssize_t stop, const uint8_t *prefix, Py_ssize_t plen, const uint8_t *dtype_of,
                    PyObject *codec_ids, const uint8_t *kinds, const uint8_t *k, long *ci, long *di, long *version,
                    double *value, uint64_t *a, uint64_t *b, Py_ssize_t *at) {
    Py_ssize_t pos = plen;
    if (stop < pos + 8 || memcmp(d, prefix, (size_t)plen) != 0 || d[pos] != k[K_DTYPE]) return 0;
    if (dtype_of[d[pos + 1]] == 0 || d[pos + 2] != k[K_CODEC_ID]) return 0;
    *di = dtype_of[d[pos + 1]] - 1;
    Py_ssize_t n = d[pos + 3];
    if (n >= 0x80 || pos + 4 + n > stop) return 0;
    *ci = -1;
    for (Py_ssize_t c = 0; c < PyTuple_GET_SIZE(codec_ids); c++) {
        PyObject *id = PyTuple_GET_ITEM(codec_ids, c);
        if (PyBytes_GET_SIZE(id) == n && memcmp(PyBytes_AS_STRING(id), d + pos + 4, (size_t)n) == 0) {
            *ci = (long)c;
            break;
        }
    }
    pos += 4 + n;
    if (*ci < 0 || stop < pos + 3 || d[pos] != k[K_VERSION]) return 0;
    *version = d[pos + 1];
    int kind = kinds[*ci];
    uint8_t payload_key = kind == 0 ? k[K_SBC] : kind == 1 ? k[K_TLC] : kind == 2 ? k[K_DENSE] : 0;
    if (!(*version > 0 && *version < 0x80) || kind > 2 || d[pos + 2] != payload_key) return 0;
    uint64_t length;
    pos += 3;
    if (!scan_varint(d, &pos, stop, &length) || length != (uint64_t)(stop - pos)) return 0;
    *a = *b = 0;
    *value = 0.0;
    if (kind == 2) { /* dense: a known encoding, then non-empty data */
        if (stop < pos + 4 || d[pos] != k[K_ENCODING] || d[pos + 2] != k[K_DENSE_DATA]) return 0;
        if (dtype_of[d[pos + 1]] == 0) return 0;
        *a = dtype_of[d[pos + 1]] - 1;
        Py_ssize_t p = pos + 3;
        if (!scan_varint(d, &p, stop, &length) || length == 0 || length != (uint64_t)(stop - p)) return 0;
        *at = p;
        return 1;
    }
    /* SBC (mean, golomb_b, nnz, bits) and 3LC (scale, numel, zero_run, data): the float first */
    if (stop < pos + 5 || d[pos] != (kind == 0 ? k[K_MEAN] : k[K_SCALE])) return 0;
    if (!scan_f32(d, pos + 1, value)) return 0;
    pos += 5;
    if (kind == 0) {
        if (pos < stop && d[pos] == k[K_B]) {
            pos++;
            if (!scan_varint(d, &pos, stop, a) || *a == 0 || *a >= ((uint64_t)1 << 32)) return 0;
        }
        if (pos < stop && d[pos] == k[K_NNZ]) {
            pos++;
            if (!scan_varint(d, &pos, stop, b) || *b == 0) return 0;
        }
        return scan_blob(d, pos, stop, k[K_BITS], at);
    }
    if (pos < stop && d[pos] == k[K_NUMEL]) {
        pos++;
        if (!scan_varint(d, &pos, stop, a) || *a == 0) return 0;
    }
    if (pos + 1 < stop && d[pos] == k[K_ZERO_RUN] && d[pos + 1] == 1) {
        *b = 1;
        pos += 2;
    }
    return scan_blob(d, pos, stop, k[K_DATA], at);
}

static PyObject *scan_tensors(PyObject *self, PyObject *args) {
    Py_buffer data = {0}, spans = {0}, dtype_of = {0}, kinds = {0}, keys = {0};
    PyObject *prefixes, *codec_ids, *result = NULL;
    int wide;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*pO!y*O!y*y*", &data, &spans, &wide, &PyTuple_Type, &prefixes, &dtype_of,
                          &PyTuple_Type, &codec_ids, &kinds, &keys))
        return NULL;
    Py_ssize_t width = wide ? 8 : 4, count = PyTuple_GET_SIZE(prefixes);
    if (spans.len != 2 * width * count || dtype_of.len != 256 || kinds.len != PyTuple_GET_SIZE(codec_ids) ||
        keys.len != K_COUNT) {
        PyErr_SetString(PyExc_ValueError, "scan_tensors: two spans per prefix, a 256-byte dtype table, a kind per "
                                          "codec id and 16 keys");
        goto done;
    }
    for (Py_ssize_t c = 0; c < PyTuple_GET_SIZE(codec_ids); c++)
        if (!PyBytes_Check(PyTuple_GET_ITEM(codec_ids, c))) {
            PyErr_SetString(PyExc_TypeError, "scan_tensors: codec ids are bytes");
            goto done;
        }
    result = PyList_New(count);
    const uint8_t *d = data.buf;
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        int64_t start, stop;
        if (wide) {
            start = ((const int64_t *)spans.buf)[2 * i];
            stop = ((const int64_t *)spans.buf)[2 * i + 1];
        } else {
            start = ((const uint32_t *)spans.buf)[2 * i];
            stop = ((const uint32_t *)spans.buf)[2 * i + 1];
        }
        PyObject *prefix = PyTuple_GET_ITEM(prefixes, i), *item = NULL;
        long ci, di, version;
        double value;
        uint64_t a, b;
        Py_ssize_t at;
        if (start < 0 || start > stop || stop > data.len) {
            PyErr_SetString(PyExc_ValueError, "scan_tensors: a span outside the data");
            Py_CLEAR(result);
            break;
        }
        if (PyBytes_Check(prefix) && scan_one(d + start, (Py_ssize_t)(stop - start), (const uint8_t *)PyBytes_AS_STRING(prefix),
                                              PyBytes_GET_SIZE(prefix), dtype_of.buf, codec_ids, kinds.buf, keys.buf,
                                              &ci, &di, &version, &value, &a, &b, &at)) {
            item = Py_BuildValue("llldKKnn", ci, di, version, value, (unsigned long long)a, (unsigned long long)b,
                                 (Py_ssize_t)start + at, (Py_ssize_t)stop);
        } else {
            Py_INCREF(Py_None);
            item = Py_None;
        }
        if (item == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, item);
    }
done:
    Py_buffer *views[] = {&data, &spans, &dtype_of, &kinds, &keys};
    for (size_t i = 0; i < sizeof(views) / sizeof(views[0]); i++)
        if (views[i]->obj != NULL) PyBuffer_Release(views[i]);
    return result;
}

/* scan_update(data, end, most, wide, spans) -> (format_version, base_model_version, count) | None
 *
 * fedcomp.wire.serde._scan_update's walk of an update's top-level fields in data[0, end) for an
 * update that passes it: fields 1 and 2 (non-zero varints, in order), then field 3 (tensors)
 * repeated, each tensor's start and stop into spans (uint32, or int64 where wide; room for `most`
 * tensors); None where the walk would raise (the caller then runs it in Python, which says what
 * is wrong). */
static PyObject *scan_update(PyObject *self, PyObject *args) {
    Py_buffer data = {0}, spans = {0};
    Py_ssize_t end, most;
    int wide;
    PyObject *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnpw*", &data, &end, &most, &wide, &spans)) return NULL;
    if (end < 0 || end > data.len || most < 0 || spans.len < 2 * most * (wide ? 8 : 4)) {
        PyErr_SetString(PyExc_ValueError, "scan_update: end within the data and room for `most` tensors");
        goto done;
    }
    const uint8_t *d = data.buf;
    Py_ssize_t pos = 0, count = 0;
    uint64_t key, value, version = 0, base = 0, last = 0;
    int ok = 1;
    while (ok && pos < end) {
        if (!scan_varint(d, &pos, end, &key)) {
            ok = 0;
            break;
        }
        uint64_t field = key >> 3, wire = key & 7;
        if ((field == 1 || field == 2) && wire == 0 && field > last) {
            if (!scan_varint(d, &pos, end, &value) || value == 0) ok = 0;
            else if (field == 1) version = value;
            else base = value;
        } else if (field == 3 && wire == 2 && last <= 3) {
            if (!scan_varint(d, &pos, end, &value) || value > (uint64_t)(end - pos) || count == most) {
                ok = 0;
            } else {
                if (wide) {
                    ((int64_t *)spans.buf)[2 * count] = pos;
                    ((int64_t *)spans.buf)[2 * count + 1] = pos + (Py_ssize_t)value;
                } else {
                    ((uint32_t *)spans.buf)[2 * count] = (uint32_t)pos;
                    ((uint32_t *)spans.buf)[2 * count + 1] = (uint32_t)(pos + (Py_ssize_t)value);
                }
                count++;
                pos += (Py_ssize_t)value;
            }
        } else {
            ok = 0;
        }
        last = field;
    }
    if (ok) {
        result = Py_BuildValue("KKn", (unsigned long long)version, (unsigned long long)base, count);
    } else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    if (data.obj != NULL) PyBuffer_Release(&data);
    if (spans.obj != NULL) PyBuffer_Release(&spans);
    return result;
}

/* --- frame_tensors: an update's tensors framed in one call ----------------------------------------
 *
 * frame_tensors(tensors, heads, prefix, types, keys, encodings, fallback) -> (size, parts)
 *
 * fedcomp.wire.serde.update_to_bytes' framing of every tensor at once, the bytes its Python
 * framing (serde._hand_framed, serde._tensor_parts) makes (serde's tests compare the two): tensor i
 * is the field key keys[0] and length, its envelope heads[i] (fields 1-5, as serde._head makes
 * them), then its payload. types = (SBCPayload, ThreeLCPayload, DensePayload,
 * DeferredDensePayload), each matched exactly (not a subclass). An SBC or 3LC payload is framed
 * here where the writer writes its scalars by hand (the float exactly a float32, neither zero nor
 * NaN: a Python float; the integers Python ints in their field's range; zero_run a bool; a
 * non-empty bytes blob); a dense one where its data is a non-empty C-contiguous buffer, or,
 * deferred, where its nbytes is not zero; its encoding's field is encodings[encoding]. Any other tensor's parts come
 * from fallback(tensor) -> (parts, n) (serde._tensor_parts), framed by the key and length here.
 * keys (bytes, one byte each): the tensors' field, the SBC, 3LC and dense payloads' fields, then
 * SBC mean, golomb_b, nnz, bits; 3LC scale, numel, zero_run, data; dense data.
 *
 * The parts come out as fedcomp.wire.fast_writer.Layout would hold them after adding prefix and
 * each tensor's parts in order: consecutive small byte parts merged into one bytes object; a
 * deferred payload, and any other part of at least 4096 bytes, a part of its own (the object
 * itself); empty parts dropped. size is their total length. */

enum { F_TENSORS, F_SBC, F_TLC, F_DENSE, F_MEAN, F_B, F_NNZ, F_BITS, F_SCALE, F_NUMEL, F_ZERO_RUN, F_DATA,
       F_DENSE_DATA, F_COUNT };

static PyObject *S_PAYLOAD, *S_MEAN, *S_GOLOMB_B, *S_NNZ, *S_BITS, *S_SCALE, *S_NUMEL, *S_ZERO_RUN, *S_DATA,
    *S_ENCODING, *S_NBYTES;

/* Small parts gathered before they become one bytes object. */
typedef struct {
    uint8_t *buf;
    Py_ssize_t len, cap;
} small_t;

static int small_add(small_t *s, const void *p, Py_ssize_t n) {
    if (s->len + n > s->cap) {
        Py_ssize_t cap = s->cap ? s->cap : 4096;
        while (cap < s->len + n) cap *= 2;
        uint8_t *grown = PyMem_Realloc(s->buf, (size_t)cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->buf = grown;
        s->cap = cap;
    }
    memcpy(s->buf + s->len, p, (size_t)n);
    s->len += n;
    return 0;
}

/* The merged small parts, if any, as one bytes part of `parts`. */
static int small_flush(small_t *s, PyObject *parts) {
    if (s->len == 0) return 0;
    PyObject *b = PyBytes_FromStringAndSize((const char *)s->buf, s->len);
    if (b == NULL) return -1;
    int rc = PyList_Append(parts, b);
    Py_DECREF(b);
    s->len = 0;
    return rc;
}

/* Layout.add of a part of n bytes (n >= 1): a small bytes-like one (not deferred) merged, any
 * other a part of its own. */
static int add_sized(small_t *s, PyObject *parts, PyObject *part, Py_ssize_t n, int is_deferred) {
    if (n >= 4096 || is_deferred) return small_flush(s, parts) || PyList_Append(parts, part);
    Py_buffer view = {0};
    int rc = PyObject_GetBuffer(part, &view, PyBUF_C_CONTIGUOUS) < 0 || view.len != n;
    if (!rc) rc = small_add(s, view.buf, n);
    else if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "frame_tensors: a payload changed size");
    if (view.obj != NULL) PyBuffer_Release(&view);
    return rc;
}

/* Layout.add of one part of any length (an empty one dropped). */
static int add_part(small_t *s, PyObject *parts, PyObject *part, PyObject *deferred, Py_ssize_t *size) {
    int is_deferred = Py_TYPE(part) == (PyTypeObject *)deferred;
    Py_ssize_t n;
    if (is_deferred) {
        PyObject *nb = PyObject_GetAttr(part, S_NBYTES);
        if (nb == NULL) return -1;
        n = PyLong_AsSsize_t(nb);
        Py_DECREF(nb);
        if (n < 0) return PyErr_Occurred() ? -1 : 0;
    } else {
        Py_buffer view;
        if (PyObject_GetBuffer(part, &view, PyBUF_C_CONTIGUOUS) < 0) return -1;
        n = view.len;
        PyBuffer_Release(&view);
    }
    if (n == 0) return 0;
    *size += n;
    return add_sized(s, parts, part, n, is_deferred);
}

static Py_ssize_t put_varint(uint8_t *out, uint64_t v) {
    Py_ssize_t n = 0;
    while (v >= 0x80) {
        out[n++] = (uint8_t)(v & 0x7F) | 0x80;
        v >>= 7;
    }
    out[n++] = (uint8_t)v;
    return n;
}

/* A float field's value as the writer writes it by hand: 1 and its four bytes where `o` is a
 * Python float exactly a float32, neither zero nor NaN (serde._float32_field); else 0. */
static int take_f32(PyObject *o, uint8_t *out) {
    if (o == NULL || !PyFloat_CheckExact(o)) return 0;
    double v = PyFloat_AS_DOUBLE(o);
    float f = (float)v;
    if ((double)f != v || v == 0.0) return 0; /* (NaN compares unequal; out of range becomes inf) */
    memcpy(out, &f, 4);
    return 1;
}

/* A Python int in [0, 2**bits): 1 and its value; else 0 (any error cleared). */
static int take_uint(PyObject *o, int bits, uint64_t *out) {
    if (o == NULL || !PyLong_CheckExact(o)) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (bits < 64 && v >> bits) return 0;
    *out = v;
    return 1;
}

/* The payload's scalar fields and its blob's key and length into pre (at most 40 bytes) and its
 * blob: 1 where framed here, 0 where the fallback frames it, -1 on an error. */
static int frame_payload(PyObject *p, PyObject *types, PyObject *encodings, const uint8_t *k, uint8_t *pre,
                         Py_ssize_t *plen, uint8_t *payload_key, PyObject **blob, Py_ssize_t *n) {
    PyTypeObject *type = Py_TYPE(p);
    PyObject *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    int ok = 0;
    Py_ssize_t len = 0;
    *blob = NULL;
    if (type == (PyTypeObject *)PyTuple_GET_ITEM(types, 0) || type == (PyTypeObject *)PyTuple_GET_ITEM(types, 1)) {
        int sbc = type == (PyTypeObject *)PyTuple_GET_ITEM(types, 0);
        a = PyObject_GetAttr(p, sbc ? S_MEAN : S_SCALE);
        b = PyObject_GetAttr(p, sbc ? S_GOLOMB_B : S_NUMEL);
        c = PyObject_GetAttr(p, sbc ? S_NNZ : S_ZERO_RUN);
        d = PyObject_GetAttr(p, sbc ? S_BITS : S_DATA);
        if (a == NULL || b == NULL || c == NULL || d == NULL) {
            ok = -1;
            goto done;
        }
        uint64_t x, y = 0;
        pre[len++] = sbc ? k[F_MEAN] : k[F_SCALE];
        if (!take_f32(a, pre + len)) goto done;
        len += 4;
        if (!take_uint(b, sbc ? 32 : 64, &x)) goto done;
        if (sbc ? !take_uint(c, 64, &y) : (c != Py_True && c != Py_False)) goto done;
        if (!PyBytes_CheckExact(d) || PyBytes_GET_SIZE(d) == 0) goto done;
        if (x) {
            pre[len++] = sbc ? k[F_B] : k[F_NUMEL];
            len += put_varint(pre + len, x);
        }
        if (sbc && y) {
            pre[len++] = k[F_NNZ];
            len += put_varint(pre + len, y);
        } else if (!sbc && c == Py_True) {
            pre[len++] = k[F_ZERO_RUN];
            pre[len++] = 1;
        }
        *n = PyBytes_GET_SIZE(d);
        pre[len++] = sbc ? k[F_BITS] : k[F_DATA];
        *payload_key = sbc ? k[F_SBC] : k[F_TLC];
        *blob = d;
        d = NULL;
        ok = 1;
    } else if (type == (PyTypeObject *)PyTuple_GET_ITEM(types, 2) || type == (PyTypeObject *)PyTuple_GET_ITEM(types, 3)) {
        int deferred = type == (PyTypeObject *)PyTuple_GET_ITEM(types, 3);
        a = PyObject_GetAttr(p, S_ENCODING);
        if (a == NULL) {
            ok = -1;
            goto done;
        }
        PyObject *field = PyDict_GetItemWithError(encodings, a); /* borrowed */
        if (field == NULL || !PyBytes_CheckExact(field) || PyBytes_GET_SIZE(field) > 11) {
            ok = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
        if (deferred) {
            b = PyObject_GetAttr(p, S_NBYTES);
            if (b == NULL) {
                ok = -1;
                goto done;
            }
            *n = PyLong_AsSsize_t(b);
            if (*n <= 0) {
                ok = PyErr_Occurred() ? -1 : 0;
                goto done;
            }
            Py_INCREF(p);
            *blob = p;
        } else {
            d = PyObject_GetAttr(p, S_DATA);
            if (d == NULL) {
                ok = -1;
                goto done;
            }
            Py_buffer view; /* (bytes-like, as the writer takes it: C-contiguous, else the fallback's error) */
            if (PyObject_GetBuffer(d, &view, PyBUF_C_CONTIGUOUS) < 0) {
                PyErr_Clear();
                goto done;
            }
            *n = view.len;
            PyBuffer_Release(&view);
            if (*n == 0) goto done;
            *blob = d;
            d = NULL;
        }
        memcpy(pre, PyBytes_AS_STRING(field), (size_t)PyBytes_GET_SIZE(field));
        len = PyBytes_GET_SIZE(field);
        pre[len++] = k[F_DENSE_DATA];
        *payload_key = k[F_DENSE];
        ok = 1;
    }
    if (ok == 1) len += put_varint(pre + len, (uint64_t)*n);
done:
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    Py_XDECREF(d);
    *plen = len;
    return ok;
}

/* One tensor by the fallback: its key and length, then its parts. */
static int frame_fallback(PyObject *t, PyObject *fallback, const uint8_t *k, PyObject *deferred, small_t *s,
                          PyObject *parts, Py_ssize_t *size) {
    PyObject *got = PyObject_CallOneArg(fallback, t);
    if (got == NULL) return -1;
    PyObject *list, *length;
    int rc = -1;
    if (!PyArg_ParseTuple(got, "O!O", &PyList_Type, &list, &length)) goto done;
    Py_ssize_t n = PyLong_AsSsize_t(length);
    if (n < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "frame_tensors: a negative length");
        goto done;
    }
    uint8_t head[11];
    head[0] = k[F_TENSORS];
    Py_ssize_t hl = 1 + put_varint(head + 1, (uint64_t)n);
    if (small_add(s, head, hl) < 0) goto done;
    *size += hl;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(list); j++)
        if (add_part(s, parts, PyList_GET_ITEM(list, j), deferred, size) < 0) goto done;
    rc = 0;
done:
    Py_DECREF(got);
    return rc;
}

static PyObject *frame_tensors(PyObject *self, PyObject *args) {
    PyObject *tensors, *heads, *types, *encodings, *fallback, *parts = NULL, *result = NULL;
    Py_buffer prefix = {0}, keys = {0};
    small_t s = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!y*O!y*O!O", &tensors, &PyList_Type, &heads, &prefix, &PyTuple_Type, &types, &keys,
                          &PyDict_Type, &encodings, &fallback))
        return NULL;
    PyObject *seq = PySequence_Fast(tensors, "frame_tensors: tensors must be a sequence");
    if (seq == NULL) goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (keys.len != F_COUNT || PyTuple_GET_SIZE(types) != 4 || PyList_GET_SIZE(heads) != count) {
        PyErr_SetString(PyExc_ValueError, "frame_tensors: a head per tensor, four types, the keys");
        goto done;
    }
    for (Py_ssize_t i = 0; i < 4; i++)
        if (!PyType_Check(PyTuple_GET_ITEM(types, i))) {
            PyErr_SetString(PyExc_TypeError, "frame_tensors: types must be classes");
            goto done;
        }
    const uint8_t *k = keys.buf;
    PyObject *deferred = PyTuple_GET_ITEM(types, 3);
    parts = PyList_New(0);
    Py_ssize_t size = prefix.len;
    if (parts == NULL || small_add(&s, prefix.buf, prefix.len) < 0) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i), *head = PyList_GET_ITEM(heads, i), *blob = NULL;
        if (!PyBytes_CheckExact(head)) {
            PyErr_SetString(PyExc_TypeError, "frame_tensors: heads must be bytes");
            goto done;
        }
        PyObject *p = PyObject_GetAttr(t, S_PAYLOAD);
        if (p == NULL) goto done;
        uint8_t pre[48], frame[32], payload_key = 0;
        Py_ssize_t plen = 0, n = 0;
        int got = frame_payload(p, types, encodings, k, pre, &plen, &payload_key, &blob, &n);
        Py_DECREF(p);
        if (got < 0) goto done;
        if (got == 0) {
            if (frame_fallback(t, fallback, k, deferred, &s, parts, &size) < 0) goto done;
            continue;
        }
        /* key, len(inner) + n, head, payload key, len(pre) + n, pre, then the blob */
        Py_ssize_t hlen = PyBytes_GET_SIZE(head);
        uint8_t sub[11];
        Py_ssize_t sublen = put_varint(sub, (uint64_t)(plen + n));
        Py_ssize_t inner = hlen + 1 + sublen + plen;
        frame[0] = k[F_TENSORS];
        Py_ssize_t flen = 1 + put_varint(frame + 1, (uint64_t)(inner + n));
        int rc = small_add(&s, frame, flen) || small_add(&s, PyBytes_AS_STRING(head), hlen) ||
                 small_add(&s, &payload_key, 1) || small_add(&s, sub, sublen) || small_add(&s, pre, plen);
        size += flen + inner + n;
        if (!rc) rc = add_sized(&s, parts, blob, n, Py_TYPE(blob) == (PyTypeObject *)deferred);
        Py_DECREF(blob);
        if (rc) goto done;
    }
    if (small_flush(&s, parts) == 0) result = Py_BuildValue("nO", size, parts);
done:
    Py_XDECREF(seq);
    Py_XDECREF(parts);
    PyMem_Free(s.buf);
    if (prefix.obj != NULL) PyBuffer_Release(&prefix);
    if (keys.obj != NULL) PyBuffer_Release(&keys);
    return result;
}

static PyMethodDef methods[] = {
    {"crc32", crc32, METH_VARARGS, "zlib.crc32(buffer, crc)."},
    {"crc32_combine", crc32_combine, METH_VARARGS, "The CRC-32 of A + B from crc32(A), crc32(B) and len(B)."},
    {"run", run, METH_VARARGS, "Copy, cast and CRC a list of (kind, dst, src, nbytes) ops in one pass."},
    {"run2", run2, METH_VARARGS, "run() of two op lists at once on the process's OpenMP team; None without one."},
    {"features", features, METH_NOARGS, "The instruction paths in use."},
    {"crc_variant", crc_variant, METH_VARARGS, "The CRC variant in use; switch with a name (tests)."},
    {"scan_tensors", scan_tensors, METH_VARARGS, "An update's canonical SBC, 3LC and dense tensors read without protobuf."},
    {"frame_tensors", frame_tensors, METH_VARARGS, "An update's tensors framed as the writer's Layout parts."},
    {"scan_update", scan_update, METH_VARARGS, "An update's top-level fields and tensor spans, or None to ask Python why not."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", "One-pass casts, copies and CRC-32 for the wire layer.", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__wire(void) {
    crc_init_tables();
#ifdef HAVE_X86_DISPATCH
    __builtin_cpu_init();
    USE_PCLMUL = crc_supported(2) ? 2 : crc_supported(1) ? 1 : 0;
    USE_F16C = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
    const char *names[] = {"payload", "mean", "golomb_b", "nnz", "bits", "scale", "numel", "zero_run", "data",
                           "encoding", "nbytes"};
    PyObject **slots[] = {&S_PAYLOAD, &S_MEAN, &S_GOLOMB_B, &S_NNZ, &S_BITS, &S_SCALE, &S_NUMEL, &S_ZERO_RUN,
                          &S_DATA, &S_ENCODING, &S_NBYTES};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    return PyModule_Create(&module);
}
