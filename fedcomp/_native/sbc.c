/* fedcomp._native._sbc: C kernels for SBC's CPU paths (fedcomp/codecs/sbc.py, fedcomp/codecs/golomb.py).
 *
 * Each kernel does in one pass what the NumPy path does in several, and gives exactly its result
 * (same positions, values, sums and bytes; the tests compare both paths). The kernels take Python
 * buffers, check every length against what they will touch (ValueError on a mismatch), write only
 * into buffers the caller allocated, and release the GIL around their loops so that
 * fedcomp.codecs.sbc.split_run runs them on several threads at once.
 *
 *   scan(a, begin, end, thr_hi, thr_lo, limit, hi_pos, hi_vals, lo_pos, lo_vals) -> (nhi, nlo) | None
 *       positions (int64) and values (float32) in [begin, end) of a >= thr_hi and of a <= thr_lo;
 *       None when more than `limit` are found (each output holds min(limit, end - begin) entries).
 *   sample_thresholds(a, pos, r, scratch) -> (t_lo, t_hi) | None
 *       the r-th smallest and r-th largest of a[pos] (fast mode's thresholds: gather and two
 *       selections in one call, `scratch` holding 2 len(pos) floats); None if one is not finite.
 *   order_stats(a, r, scratch) -> (t_lo, t_hi) | None   the same for all of a (`scratch`: len(a) floats).
 *   sum_stats(vals) -> (sum, lo, hi)    float64 sum (exact, so in any order, where _exact_sum's test on lo and
 *       hi passes; not read otherwise) and the min/max of (bits & 0x7fffffff).
 *   fast_select(a, pos, r, limit, scratch, hi_pos, hi_vals, lo_pos, lo_vals)
 *       -> (nhi, nlo, *sum_stats(hi_vals), *sum_stats(lo_vals)) | None
 *       the three above in one call (fast mode's selection for a tensor scanned in one part): None
 *       when a sampled value is not finite or the scan passes `limit`.
 *   encode_many(tasks, order_max, ln_phi, threads, use_team) -> [(sum, nnz, b, bits) | None]
 *       a whole update's SBC encodings (fedcomp.codecs.sbc.SBC.encode_many): each task
 *       (a, pos | None, k, r) is one tensor's selection (fast mode with sample positions `pos`,
 *       falling back to exact mode as the Python path does; exact mode without), both sides' exact
 *       sums, the side kept (its exact sum returned) and the Golomb code of its positions, on
 *       `threads` threads (team.h);
 *       None where the Python path must do it (see the section below).
 *   golomb_encode(idx, b) -> bytes      the two-section Golomb-Rice layout of fedcomp/codecs/golomb.py.
 *   golomb_decode(bits, nnz, b, numel, out) -> bool   positions into int64 `out` (nnz entries);
 *       False on any inconsistency the NumPy decoder reports (the caller then reruns the NumPy path
 *       to raise its PayloadError; `out` is then partly written).
 *   reply_check(tasks, scratch) -> (bad, squares)   a server's check of one reply before it is summed
 *       (fedcomp/flower/weighted_sum.py): each task (kind, buffer, nnz, b, numel, offset, value) is a
 *       tensor's Golomb-coded positions (kind 0, decoded into int64 `scratch` at `offset`) or its
 *       float32 values (kind 1, checked finite); `squares` the update's squared norm, `bad` the
 *       first failing task (-1: none; the caller reruns the Python check to raise its error). With
 *       bases, kept, wide and values also the positions into the update's flat buffer (a device's
 *       decode) and their value, written by the decoding thread.
 *   reply_add(tasks, scratch, weight, outs, threads, use_team)   the checked reply into float64 sums:
 *       weight * value at each position of a kind 0 task (re-checked against numel), weight * each
 *       value of kind 1; tasks in list order on `threads` threads (team.h), one output each.
 *   fill(out, begin, end, pos, p0, p1, value)  out[begin:end] = 0 but `value` at pos[p0:p1] (ascending,
 *       within [begin, end)): the decoder's dense output in one write pass, no zeroed allocation.
 *   scan_variant([name]) -> str         the scan in use, "base" (SSE2 or plain C) or "avx2" (chosen at
 *       import where the CPU has it: same results, tested both ways); a name switches (tests).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "team.h"

/* --- threshold scan ---------------------------------------------------------------------------- */

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_SSE2 1
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define HAVE_AVX2_DISPATCH 1 /* an AVX2 variant, chosen at import on CPUs that have it */
#endif

/* Index of the lowest set bit of a non-zero mask. */
static inline int lowest_bit(uint32_t m) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_ctz(m);
#else
    int i = 0;
    while (!(m & 1u)) {
        m >>= 1;
        i++;
    }
    return i;
#endif
}

static inline int popcount(uint32_t m) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_popcount(m);
#else
    int n = 0;
    for (; m; m &= m - 1) n++;
    return n;
#endif
}

/* Where one scan writes: positions and values of each side, and how many so far. */
typedef struct {
    int64_t *restrict hpos, *restrict lpos;
    float *restrict hval, *restrict lval;
    Py_ssize_t nhi, nlo;
    Py_ssize_t cap; /* entries each side's buffers hold */
} scan_out;

/* Blocks of BLOCK elements: MASKS sets bit j of mh (ml) when x[i + j] >= hi (<= lo), and notes a
 * NaN where NAN_SEEN (read at the end) can tell; most blocks select nothing and cost only the
 * compares. Returns 1 when more than `limit` are found, or a NaN was: a NaN is neither >= hi nor
 * <= lo, so it would stay behind unseen (the caller's exact mode then names it). */
#define SCAN_BODY(BLOCK, MASKS, NAN_SEEN)                                                \
    Py_ssize_t i = begin;                                                                \
    for (; i + (BLOCK) <= end; i += (BLOCK)) {                                           \
        uint32_t mh = 0, ml = 0;                                                         \
        MASKS                                                                            \
        if (!(mh | ml)) continue;                                                        \
        if (o->nhi + o->nlo + popcount(mh) + popcount(ml) > limit) return 1;             \
        for (; mh; mh &= mh - 1) {                                                       \
            Py_ssize_t j = i + lowest_bit(mh);                                           \
            o->hpos[o->nhi] = j;                                                         \
            o->hval[o->nhi++] = x[j];                                                    \
        }                                                                                \
        for (; ml; ml &= ml - 1) {                                                       \
            Py_ssize_t j = i + lowest_bit(ml);                                           \
            o->lpos[o->nlo] = j;                                                         \
            o->lval[o->nlo++] = x[j];                                                    \
        }                                                                                \
    }                                                                                    \
    if (NAN_SEEN) return 1;                                                              \
    for (; i < end; i++) { /* the tail of fewer than BLOCK */                           \
        float v = x[i];                                                                  \
        int h = v >= hi, l = v <= lo;                                                    \
        if (v != v) return 1;                                                            \
        if (o->nhi + o->nlo + h + l > limit) return 1;                                   \
        if (h) {                                                                         \
            o->hpos[o->nhi] = i;                                                         \
            o->hval[o->nhi++] = v;                                                       \
        }                                                                                \
        if (l) {                                                                         \
            o->lpos[o->nlo] = i;                                                         \
            o->lval[o->nlo++] = v;                                                       \
        }                                                                                \
    }                                                                                    \
    return 0;

typedef int (*scan_fn)(const float *restrict x, Py_ssize_t begin, Py_ssize_t end, float hi, float lo,
                       Py_ssize_t limit, scan_out *o);

static int scan_base(const float *restrict x, Py_ssize_t begin, Py_ssize_t end, float hi, float lo,
                     Py_ssize_t limit, scan_out *o) {
#ifdef HAVE_SSE2
    const __m128 vh = _mm_set1_ps(hi), vl = _mm_set1_ps(lo);
    __m128 nan = _mm_setzero_ps();
    SCAN_BODY(16, for (int q = 0; q < 16; q += 4) {
        __m128 v = _mm_loadu_ps(x + i + q);
        nan = _mm_or_ps(nan, _mm_cmpunord_ps(v, v));
        mh |= (uint32_t)_mm_movemask_ps(_mm_cmpge_ps(v, vh)) << q;
        ml |= (uint32_t)_mm_movemask_ps(_mm_cmple_ps(v, vl)) << q;
    }, _mm_movemask_ps(nan))
#else
    int nan = 0;
    SCAN_BODY(16, for (int q = 0; q < 16; q++) {
        nan |= x[i + q] != x[i + q];
        mh |= (uint32_t)(x[i + q] >= hi) << q;
        ml |= (uint32_t)(x[i + q] <= lo) << q;
    }, nan)
#endif
}

#ifdef HAVE_AVX2_DISPATCH
/* Append the positions base + j of the set bits j of m (and x[base + j]) to pos and val at *n, in
 * order. The first is written without a branch on m (past the count it is scratch that the next
 * append overwrites; the caller keeps 32 spare), the rest by a loop that SBC's densities seldom
 * enter. */
static inline void append_bits(uint32_t m, Py_ssize_t base, const float *restrict x, int64_t *restrict pos,
                               float *restrict val, Py_ssize_t *n) {
    Py_ssize_t k = *n;
    int c = popcount(m);
    int j = lowest_bit(m | 0x80000000u); /* 31 when m is 0: a scratch entry, in range */
    pos[k] = base + j;
    val[k] = x[base + j];
    for (int u = 1; (m &= m - 1) != 0; u++) {
        j = lowest_bit(m);
        pos[k + u] = base + j;
        val[k + u] = x[base + j];
    }
    *n = k + c;
}

/* One block of 32 for scan_avx2: the two masks, then both appends; with SKIP a block that selects
 * nothing skips them (a branch worth taking only where such blocks are the rule). */
#define AVX2_BLOCKS(SKIP)                                                                            \
    for (; i + 32 <= end && nhi + 32 <= cap && nlo + 32 <= cap; i += 32) {                           \
        uint32_t mh = 0, ml = 0;                                                                     \
        for (int q = 0; q < 32; q += 8) {                                                            \
            __m256 v = _mm256_loadu_ps(x + i + q);                                                   \
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));                               \
            mh |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, vh, _CMP_GE_OQ)) << q;               \
            ml |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, vl, _CMP_LE_OQ)) << q;               \
        }                                                                                            \
        if ((SKIP) && !(mh | ml)) continue;                                                          \
        append_bits(mh, i, x, hpos, hval, &nhi);                                                     \
        append_bits(ml, i, x, lpos, lval, &nlo);                                                     \
        if (nhi + nlo > limit) return 1;                                                             \
    }

/* The same with 8-wide compares and, unless selections are rare, no branch on whether a block
 * selects anything: at p = 1 % about half the blocks do, so that branch (and the per-hit loops of
 * SCAN_BODY) mispredicted about once a block. Measured on 2**25 student-t values out of cache:
 * 0.29 against 0.46 ns an element at p = 1 %; at p = 0.1 % the skipping loop, 0.24 ns. Near the
 * end of the output buffers the rest of the range goes to scan_base, which appends to the same
 * outputs. */
__attribute__((target("avx2"))) static int scan_avx2(const float *restrict x, Py_ssize_t begin, Py_ssize_t end,
                                                     float hi, float lo, Py_ssize_t limit, scan_out *o) {
    const __m256 vh = _mm256_set1_ps(hi), vl = _mm256_set1_ps(lo);
    __m256 nan = _mm256_setzero_ps(); /* (any NaN of the blocks: see SCAN_BODY) */
    int64_t *restrict hpos = o->hpos, *restrict lpos = o->lpos;
    float *restrict hval = o->hval, *restrict lval = o->lval;
    Py_ssize_t nhi = o->nhi, nlo = o->nlo, cap = o->cap, i = begin;
    /* fast mode's limit is 4 k = 4 p n: below p = 1/256 (under 1/4 of a selection a block) skip */
    if (limit < (end - begin) / 64) {
        AVX2_BLOCKS(1)
    } else {
        AVX2_BLOCKS(0)
    }
    if (_mm256_movemask_ps(nan)) return 1;
    o->nhi = nhi;
    o->nlo = nlo;
    return scan_base(x, i, end, hi, lo, limit, o);
}
#endif

/* The variant this CPU runs (set at import). */
static scan_fn scan_range = scan_base;

static int check_len(Py_buffer *buf, Py_ssize_t items, Py_ssize_t itemsize, const char *what) {
    if (buf->len < items * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: buffer holds %zd bytes, need %zd", what, buf->len, items * itemsize);
        return -1;
    }
    return 0;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer a, hp, hv, lp, lv;
    Py_ssize_t begin, end, limit;
    float hi, lo;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnffnw*w*w*w*", &a, &begin, &end, &hi, &lo, &limit, &hp, &hv, &lp, &lv))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = a.len / 4;
    if (begin < 0 || end < begin || end > n || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "scan: range or limit out of bounds");
        goto done;
    }
    Py_ssize_t cap = limit < end - begin ? limit : end - begin; /* the most one side can hold */
    if (check_len(&hp, cap, 8, "scan hi_pos") || check_len(&hv, cap, 4, "scan hi_vals") ||
        check_len(&lp, cap, 8, "scan lo_pos") || check_len(&lv, cap, 4, "scan lo_vals"))
        goto done;
    /* distinct arrays of the caller's (restrict: else every store forces reloads) */
    scan_out o = {(int64_t *)hp.buf, (int64_t *)lp.buf, (float *)hv.buf, (float *)lv.buf, 0, 0, cap};
    int over;
    Py_BEGIN_ALLOW_THREADS
    over = scan_range((const float *)a.buf, begin, end, hi, lo, limit, &o);
    Py_END_ALLOW_THREADS
    if (over) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        result = Py_BuildValue("nn", o.nhi, o.nlo);
    }
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&hp);
    PyBuffer_Release(&hv);
    PyBuffer_Release(&lp);
    PyBuffer_Release(&lv);
    return result;
}

/* The k-th smallest of v[0, n) (0 <= k < n), permuting v: quickselect with a three-way partition
 * (runs of equal values cost one pass) and a median-of-three pivot. Any correct selection gives the
 * same value as NumPy's partition; with a NaN it still ends, within bounds. */
static float select_kth(float *v, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t lo = 0, hi = n;
    while (hi - lo > 1) {
        float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi - 1];
        float p = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        Py_ssize_t lt = lo, i = lo, gt = hi;
        while (i < gt) {
            float x = v[i];
            if (x < p) {
                v[i++] = v[lt];
                v[lt++] = x;
            } else if (x > p) {
                v[i] = v[--gt];
                v[gt] = x;
            } else {
                i++;
            }
        }
        if (k < lt)
            hi = lt;
        else if (k >= gt)
            lo = gt;
        else
            return p;
    }
    return v[lo];
}

/* A key per finite float that orders like its value (-0.0 just below +0.0). */
static inline uint32_t order_key(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

#define KEY_SHIFT 21 /* 2048 buckets: the sign, the exponent and two mantissa bits */

/* The r-th smallest and r-th largest of v[0, m) (1 <= r <= m), v unchanged: a histogram of the
 * keys' top bits finds each one's bucket, then a quickselect runs on that bucket's values only,
 * copied into w (m floats). Two branch-free passes over v where a quickselect on all of it takes
 * several passes of unpredictable branches. */
static void order_pair(const float *v, Py_ssize_t m, Py_ssize_t r, float *w, float *t_lo, float *t_hi) {
    Py_ssize_t hist[1 << (32 - KEY_SHIFT)];
    memset(hist, 0, sizeof hist);
    for (Py_ssize_t i = 0; i < m; i++) hist[order_key(v[i]) >> KEY_SHIFT]++;
    Py_ssize_t ranks[2] = {r - 1, m - r}, bucket[2] = {0, 0}, below[2] = {0, 0};
    for (int s = 0; s < 2; s++) {
        Py_ssize_t acc = 0, bkt = 0;
        while (acc + hist[bkt] <= ranks[s]) acc += hist[bkt++];
        bucket[s] = bkt;
        below[s] = acc;
    }
    /* the low bucket's values from the front of w, the high bucket's from the back */
    Py_ssize_t nlo = 0, nhi = 0;
    int same = bucket[0] == bucket[1];
    for (Py_ssize_t i = 0; i < m; i++) {
        uint32_t bkt = order_key(v[i]) >> KEY_SHIFT;
        if (bkt == (uint32_t)bucket[0])
            w[nlo++] = v[i];
        else if (!same && bkt == (uint32_t)bucket[1])
            w[m - 1 - nhi++] = v[i];
    }
    *t_lo = select_kth(w, nlo, ranks[0] - below[0]);
    if (same)
        *t_hi = select_kth(w, nlo, ranks[1] - below[1]);
    else
        *t_hi = select_kth(w + m - nhi, nhi, ranks[1] - below[1]);
}

/* (t_lo, t_hi) as Python floats, or None when a value was not finite (exact mode reports it). */
static PyObject *thresholds_or_none(int nonfinite, float t_lo, float t_hi) {
    if (nonfinite) Py_RETURN_NONE;
    return Py_BuildValue("dd", (double)t_lo, (double)t_hi);
}

/* v[i] = x[p[i]] for i < m; sets *nonfinite when one is a NaN or an infinity. Returns 1 (and stops)
 * at a position outside [0, n). */
static int gather(const float *x, Py_ssize_t n, const int64_t *p, Py_ssize_t m, float *v, uint32_t *nonfinite) {
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t j = p[i];
#if defined(__GNUC__) || defined(__clang__)
        /* the positions are spread over the tensor: one cache miss each, overlapped this way */
        if (i + 64 < m && p[i + 64] >= 0 && p[i + 64] < n) __builtin_prefetch(x + p[i + 64]);
#endif
        if (j < 0 || j >= n) {
            *nonfinite |= bad;
            return 1;
        }
        float value = x[j];
        uint32_t bits;
        memcpy(&bits, &value, 4);
        bad |= (uint32_t)((bits & 0x7F800000u) == 0x7F800000u);
        v[i] = value;
    }
    *nonfinite |= bad;
    return 0;
}

static PyObject *sample_thresholds(PyObject *self, PyObject *args) {
    Py_buffer a, pos, scratch;
    Py_ssize_t r;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nw*", &a, &pos, &r, &scratch)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = a.len / 4, m = pos.len / 8;
    if (r < 1 || r > m || check_len(&scratch, 2 * m, 4, "sample_thresholds scratch")) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "sample_thresholds: need 1 <= r <= len(pos)");
        goto done;
    }
    const float *x = (const float *)a.buf;
    const int64_t *p = (const int64_t *)pos.buf;
    float *v = (float *)scratch.buf;
    int bad_index = 0;
    uint32_t nonfinite = 0;
    float t_lo = 0.0f, t_hi = 0.0f;
    Py_BEGIN_ALLOW_THREADS
    bad_index = gather(x, n, p, m, v, &nonfinite);
    if (!bad_index && !nonfinite) order_pair(v, m, r, v + m, &t_lo, &t_hi);
    Py_END_ALLOW_THREADS
    if (bad_index) {
        PyErr_SetString(PyExc_ValueError, "sample_thresholds: position out of range");
        goto done;
    }
    result = thresholds_or_none(nonfinite, t_lo, t_hi);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&scratch);
    return result;
}

/* 1 when one of x[0, n) is a NaN or an infinity, else 0 (one branch-free pass). */
static uint32_t any_nonfinite(const float *x, Py_ssize_t n) {
    uint32_t nonfinite = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        nonfinite |= (uint32_t)((bits & 0x7F800000u) == 0x7F800000u);
    }
    return nonfinite;
}

static PyObject *order_stats(PyObject *self, PyObject *args) {
    Py_buffer a, scratch;
    Py_ssize_t r;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nw*", &a, &r, &scratch)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t m = a.len / 4;
    if (r < 1 || r > m || check_len(&scratch, m, 4, "order_stats scratch")) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "order_stats: need 1 <= r <= len(a)");
        goto done;
    }
    float *v = (float *)scratch.buf;
    uint32_t nonfinite = 0;
    float t_lo = 0.0f, t_hi = 0.0f;
    const float *x = (const float *)a.buf;
    Py_BEGIN_ALLOW_THREADS
    nonfinite = any_nonfinite(x, m);
    if (!nonfinite) order_pair(x, m, r, v, &t_lo, &t_hi);
    Py_END_ALLOW_THREADS
    result = thresholds_or_none(nonfinite, t_lo, t_hi);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&scratch);
    return result;
}

/* The float64 sum of x[0, m), and the least and greatest of (bits & 0x7fffffff) (the least of the
 * non-zero ones with nonzero_lo). The sum is read only where fedcomp.codecs.sbc._exact_sum's test on
 * those bits says every partial sum is a float64, and then it is the same in any order: four
 * running sums (a float add waits for the last; four do not wait on each other: 0.38 -> 0.26 ms
 * for 512K values on one core), and four of each bound. */
static void stats_of(const float *x, Py_ssize_t m, double *sum_out, uint32_t *lo_out, uint32_t *hi_out,
                     int nonzero_lo) {
    double sum[4] = {0.0, 0.0, 0.0, 0.0};
    uint32_t lo[4] = {0x7FFFFFFFu, 0x7FFFFFFFu, 0x7FFFFFFFu, 0x7FFFFFFFu}, hi[4] = {0, 0, 0, 0};
    Py_ssize_t i = 0;
    for (; i + 4 <= m; i += 4) {
        for (int j = 0; j < 4; j++) {
            uint32_t bits;
            memcpy(&bits, &x[i + j], 4);
            bits &= 0x7FFFFFFFu;
            lo[j] = bits < lo[j] && (bits != 0 || !nonzero_lo) ? bits : lo[j];
            hi[j] = bits > hi[j] ? bits : hi[j];
            sum[j] += (double)x[i + j];
        }
    }
    for (int j = 0; i < m; i++, j++) {
        uint32_t bits;
        memcpy(&bits, &x[i], 4);
        bits &= 0x7FFFFFFFu;
        lo[j] = bits < lo[j] && (bits != 0 || !nonzero_lo) ? bits : lo[j];
        hi[j] = bits > hi[j] ? bits : hi[j];
        sum[j] += (double)x[i];
    }
    uint32_t l01 = lo[0] < lo[1] ? lo[0] : lo[1], l23 = lo[2] < lo[3] ? lo[2] : lo[3];
    uint32_t h01 = hi[0] > hi[1] ? hi[0] : hi[1], h23 = hi[2] > hi[3] ? hi[2] : hi[3];
    *sum_out = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    *lo_out = l01 < l23 ? l01 : l23;
    *hi_out = h01 > h23 ? h01 : h23;
}

static PyObject *sum_stats(PyObject *self, PyObject *args) {
    Py_buffer vals;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &vals)) return NULL;
    double sum;
    uint32_t lo, hi;
    Py_BEGIN_ALLOW_THREADS
    stats_of((const float *)vals.buf, vals.len / 4, &sum, &lo, &hi, 0);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vals);
    return Py_BuildValue("dkk", sum, (unsigned long)lo, (unsigned long)hi);
}

/* sample_thresholds, scan and sum_stats of both sides in one call, the GIL released throughout:
 * fast mode's whole selection for a tensor scanned in one part (fedcomp.codecs.sbc). */
static PyObject *fast_select(PyObject *self, PyObject *args) {
    Py_buffer a, pos, scratch, hp, hv, lp, lv;
    Py_ssize_t r, limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nnw*w*w*w*w*", &a, &pos, &r, &limit, &scratch, &hp, &hv, &lp, &lv)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = a.len / 4, m = pos.len / 8;
    Py_ssize_t cap = limit < n ? limit : n;
    if (r < 1 || r > m || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "fast_select: need 1 <= r <= len(pos) and limit >= 0");
        goto done;
    }
    if (check_len(&scratch, 2 * m, 4, "fast_select scratch") || check_len(&hp, cap, 8, "fast_select hi_pos") ||
        check_len(&hv, cap, 4, "fast_select hi_vals") || check_len(&lp, cap, 8, "fast_select lo_pos") ||
        check_len(&lv, cap, 4, "fast_select lo_vals"))
        goto done;
    const float *x = (const float *)a.buf;
    const int64_t *p = (const int64_t *)pos.buf;
    float *v = (float *)scratch.buf;
    int bad_index = 0, over = 0;
    uint32_t nonfinite = 0, lo_bits[2] = {0, 0}, hi_bits[2] = {0, 0};
    double sums[2] = {0.0, 0.0};
    float t_lo = 0.0f, t_hi = 0.0f;
    scan_out o = {(int64_t *)hp.buf, (int64_t *)lp.buf, (float *)hv.buf, (float *)lv.buf, 0, 0, cap};
    Py_BEGIN_ALLOW_THREADS
    bad_index = gather(x, n, p, m, v, &nonfinite);
    if (!bad_index && !nonfinite) {
        order_pair(v, m, r, v + m, &t_lo, &t_hi);
        over = scan_range(x, 0, n, t_hi, t_lo, limit, &o);
        if (!over) {
            stats_of(o.hval, o.nhi, &sums[0], &lo_bits[0], &hi_bits[0], 0);
            stats_of(o.lval, o.nlo, &sums[1], &lo_bits[1], &hi_bits[1], 0);
        }
    }
    Py_END_ALLOW_THREADS
    if (bad_index) {
        PyErr_SetString(PyExc_ValueError, "fast_select: position out of range");
        goto done;
    }
    if (nonfinite || over) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        result = Py_BuildValue("nndkkdkk", o.nhi, o.nlo, sums[0], (unsigned long)lo_bits[0], (unsigned long)hi_bits[0],
                               sums[1], (unsigned long)lo_bits[1], (unsigned long)hi_bits[1]);
    }
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&scratch);
    PyBuffer_Release(&hp);
    PyBuffer_Release(&hv);
    PyBuffer_Release(&lp);
    PyBuffer_Release(&lv);
    return result;
}

/* --- Golomb-Rice coding ------------------------------------------------------------------------ */

/* A big-endian bit writer; four bytes are stored at once (a byte at a time took about three
 * quarters of a Golomb code's time). The buffer has GOLOMB_SLACK bytes of room past the code. */
typedef struct {
    uint8_t *out;
    uint64_t acc; /* the pending bits are its top `nacc` bits (< 32 between calls), the rest zero */
    int nacc;
} bitwriter;

#define GOLOMB_SLACK 16

/* Append v's n bits (1 <= n <= 32, v < 2**n), most significant first. */
static inline void put_bits(bitwriter *w, uint64_t v, int n) {
    w->acc |= v << (64 - w->nacc - n); /* (a shift of 1 to 63: nacc < 32, 1 <= n <= 32) */
    w->nacc += n;
    if (w->nacc >= 32) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        uint32_t word = __builtin_bswap32((uint32_t)(w->acc >> 32));
        memcpy(w->out, &word, 4);
#else
        for (int i = 0; i < 4; i++) w->out[i] = (uint8_t)(w->acc >> (56 - 8 * i));
#endif
        w->out += 4;
        w->acc <<= 32;
        w->nacc -= 32;
    }
}

/* The pending bits, the last byte padded with zeros. */
static inline void flush_bits(bitwriter *w) {
    for (; w->nacc > 0; w->nacc -= 8) {
        *w->out++ = (uint8_t)(w->acc >> 56);
        w->acc <<= 8;
    }
}

/* Position k of an ascending array of int64 (wide) or int32 positions: sides_flat takes either
 * (a device's candidates come to the host as int32 where the update's positions fit). The helpers
 * below take `wide` as a constant from their wrappers, so each is compiled once per width. */
static inline int64_t pos_at(const void *idx, int wide, Py_ssize_t k) {
    return wide ? ((const int64_t *)idx)[k] : (int64_t)((const int32_t *)idx)[k];
}

/* The Golomb-Rice code of idx[0, nnz) - base with parameter b (0 <= b <= 62): the remainders,
 * then the unary parts. Into *code a new malloc'd buffer holding it (its length in *nbytes);
 * returns 0, or -1 where the positions do not ascend within [base, last] (last >= base - 1),
 * -2 where the code's length would not fit, -3 where there is no memory (*code is then NULL). Two
 * passes over the positions: the buffer has room for the longest code such positions can have
 * (with gaps g less one, Σ floor(g / 2**b) <= floor(Σ g / 2**b) <= (last - base + 1 - nnz) >> b
 * unary bits), so the remainders are written while the positions are checked, then the unary
 * parts. */
static inline int golomb_code_of(const void *idx, int wide, Py_ssize_t nnz, int b, int64_t base, int64_t last,
                                 uint8_t **code, Py_ssize_t *nbytes) {
    *code = NULL;
    uint64_t room = (uint64_t)(last - base) + 1; /* positions in [base, last] */
    if (nnz < 0 || room < (uint64_t)nnz) return -1;
    if ((uint64_t)nnz > ((uint64_t)1 << 56)) return -2;
    uint64_t bound = (uint64_t)nnz * (uint64_t)(b + 1) + ((room - (uint64_t)nnz) >> b);
    if (bound / 8 >= (uint64_t)PY_SSIZE_T_MAX - GOLOMB_SLACK) return -2;
    uint8_t *out = malloc((size_t)(bound / 8) + GOLOMB_SLACK);
    if (out == NULL) return -3;
    bitwriter w = {out, 0, 0};
    uint64_t mask = b ? (((uint64_t)1 << b) - 1) : 0;
    int64_t prev = base - 1;
    for (Py_ssize_t k = 0; k < nnz; k++) {
        int64_t at = pos_at(idx, wide, k);
        if (at <= prev || at > last) {
            free(out);
            return -1;
        }
        uint64_t r = (uint64_t)(at - prev - 1) & mask;
        prev = at;
        if (b > 32) {
            put_bits(&w, r >> 32, b - 32);
            put_bits(&w, r & 0xFFFFFFFFu, 32);
        } else if (b) {
            put_bits(&w, r, b);
        }
    }
    prev = base - 1;
    for (Py_ssize_t k = 0; k < nnz; k++) {
        int64_t at = pos_at(idx, wide, k);
        uint64_t q = (uint64_t)(at - prev - 1) >> b;
        prev = at;
        while (q >= 31) {
            put_bits(&w, 0x7FFFFFFFu, 31);
            q -= 31;
        }
        put_bits(&w, (((uint64_t)1 << q) - 1) << 1, (int)q + 1); /* q ones, then a zero */
    }
    flush_bits(&w);
    *code = out;
    *nbytes = w.out - out;
    return 0;
}

static int golomb_code(const void *idx, int wide, Py_ssize_t nnz, int b, int64_t base, int64_t last, uint8_t **code,
                       Py_ssize_t *nbytes) {
    return wide ? golomb_code_of(idx, 1, nnz, b, base, last, code, nbytes)
                : golomb_code_of(idx, 0, nnz, b, base, last, code, nbytes);
}

static PyObject *golomb_encode(PyObject *self, PyObject *args) {
    Py_buffer ib;
    int b;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*i", &ib, &b)) return NULL;
    PyObject *result = NULL;
    if (b < 0 || b > 62) {
        PyErr_SetString(PyExc_ValueError, "golomb_encode: b must be in [0, 62]");
        goto done;
    }
    Py_ssize_t nnz = ib.len / 8, nbytes = 0;
    const int64_t *idx = (const int64_t *)ib.buf;
    int64_t last = nnz ? idx[nnz - 1] : -1; /* the positions in [0, last]: the code's room */
    uint8_t *code = NULL;
    int rc;
    if (last < -1) last = -1; /* (then the first check fails) */
    Py_BEGIN_ALLOW_THREADS
    rc = golomb_code(idx, 1, nnz, b, 0, last, &code, &nbytes);
    Py_END_ALLOW_THREADS
    if (rc == -3) PyErr_NoMemory();
    else if (rc != 0)
        PyErr_SetString(PyExc_ValueError, rc == -1 ? "golomb_encode: positions must be non-negative and ascending"
                                                   : "golomb_encode: stream too long");
    else result = PyBytes_FromStringAndSize((const char *)code, nbytes);
    free(code);
done:
    PyBuffer_Release(&ib);
    return result;
}

/* --- encode_many: a whole update's SBC tensors in one call ------------------------------------------
 *
 * Each task is one tensor's whole encoding as fedcomp.codecs.sbc.SBC._payload does it: fast mode's
 * selection (sample thresholds, scan; exact mode when a side comes back empty or over 2 k), exact
 * mode's (both order statistics of all values, then every value beyond each and the first ties up
 * to k), both sides' sums, the side with the larger mean magnitude and the Golomb-Rice code of its
 * positions. A task that needs what only the Python path does (a value not finite, exact mode above
 * `order_max` values, sums whose exponents span too far for a float64 to hold them exactly) is
 * left to it. The tasks run on `threads` threads (team.h), the next one taken by whichever thread
 * is free: the caller lists them largest first. */

/* What a task coded (the first member of encode_many's and sides_flat's tasks, so that one
 * helper reads both): the side kept, its exact sum and the Golomb-Rice code of its positions. */
typedef struct {
    int done;     /* 0: left to the Python path */
    int positive; /* the side kept: the values above the threshold */
    double sum;   /* the exact sum of the side kept */
    Py_ssize_t nnz;
    int b;
    uint8_t *bits; /* malloc'd, nbytes long */
    Py_ssize_t nbytes;
} sbc_coded;

typedef struct {
    sbc_coded out;
    const float *x;
    Py_ssize_t n;
    const int64_t *where; /* fast mode's sample positions (s of them), or NULL: exact mode */
    Py_ssize_t s, k, r;
} sbc_task;

typedef struct {
    sbc_task *tasks;
    Py_ssize_t ntasks, next; /* next: the first task no thread has taken (atomic) */
    Py_ssize_t work, cap;    /* per thread: floats of order-statistic scratch, entries a side holds */
    Py_ssize_t order_max;
    double ln_phi;
} sbc_job;

/* Of x[0, n): every value beyond t (above it when largest, else below) and the first ties at t,
 * k in all, ascending, into pos and val (t is the k-th most extreme value: exact mode's rule). */
static Py_ssize_t exact_side(const float *x, Py_ssize_t n, float t, Py_ssize_t k, int largest, int64_t *pos,
                             float *val) {
    Py_ssize_t strict = 0, c = 0;
    for (Py_ssize_t i = 0; i < n; i++) strict += largest ? x[i] > t : x[i] < t;
    Py_ssize_t ties = k - strict;
    for (Py_ssize_t i = 0; i < n; i++) {
        float v = x[i];
        int beyond = largest ? v > t : v < t;
        if (beyond || (v == t && ties > 0)) {
            ties -= !beyond;
            pos[c] = i;
            val[c++] = v;
        }
    }
    return c;
}

/* The float64 sum of x[0, m) in order into *sum; returns whether it is exact: every value finite and
 * the non-zero ones' exponents spanning little enough that each partial sum is a float64 (the test
 * of fedcomp.codecs.sbc._exact_sum, there with zeros counted as the least exponent: they add
 * nothing, so leaving them out only takes more sums as exact; an exact sum is the sum either way). */
static int exact_sum(const float *x, Py_ssize_t m, double *sum) {
    uint32_t lo, hi;
    stats_of(x, m, sum, &lo, &hi, 1);
    if (hi == 0) return 1; /* all zeros (or none) */
    int elo = (int)(lo >> 23), ehi = (int)(hi >> 23), count_bits = 0;
    if (elo < 1) elo = 1;
    for (uint64_t c = (uint64_t)m; c; c >>= 1) count_bits++;
    return ehi != 0xFF && ehi - elo + 24 + count_bits <= 53;
}

#if defined(__SIZEOF_INT128__)
#define HAVE_INT128 1
/* The sign of a * ca + b * cb, exactly (a, b finite float64; 0 <= ca, cb < 2**62). */
static int sign_of_sum(double a, int64_t ca, double b, int64_t cb) {
    int ea, eb;
    /* a = ma * 2**(ea - 53) with ma an integer below 2**53 in magnitude; the same for b */
    __int128 A = (__int128)(int64_t)ldexp(frexp(a, &ea), 53) * ca;
    __int128 B = (__int128)(int64_t)ldexp(frexp(b, &eb), 53) * cb;
    if (A == 0 || B == 0) {
        __int128 v = A == 0 ? B : A;
        return (v > 0) - (v < 0);
    }
    if ((A > 0) == (B > 0)) return A > 0 ? 1 : -1;
    if (ea < eb) { /* the larger exponent first */
        __int128 t = A;
        A = B;
        B = t;
        int te = ea;
        ea = eb;
        eb = te;
    }
    /* a * ca + b * cb = 2**(eb - 53) * (A * 2**d + B), |A|, |B| < 2**115 */
    int d = ea - eb, bits = 0;
    unsigned __int128 mag = A > 0 ? (unsigned __int128)A : (unsigned __int128)(-A);
    for (unsigned __int128 m = mag; m; m >>= 1) bits++;
    if (bits + d > 124) return A > 0 ? 1 : -1; /* |A| * 2**d > 2**123 > |B| */
    __int128 shifted = (__int128)(mag << d);
    __int128 total = (A > 0 ? shifted : -shifted) + B;
    return (total > 0) - (total < 0);
}
#endif

/* golomb_b of fedcomp.codecs.golomb for the density nnz / n (the caller checks it against Python's). */
static int golomb_b_of(Py_ssize_t nnz, Py_ssize_t n, double ln_phi) {
    double p = (double)nnz / (double)n;
    if (p <= 0.0) return 62;
    if (p >= 1.0) return 0;
    double ratio = ln_phi / log1p(-p);
    if (ratio <= 0.0 || isinf(ratio)) return 62;
    double b = 1.0 + floor(log2(ratio));
    return b < 0.0 ? 0 : b > 62.0 ? 62 : (int)b;
}

/* Both sides' exact sums, the side with the larger mean magnitude (the positive one on a tie) and
 * the Golomb-Rice code of its positions (ascending, in [base, base + n), coded less base; int64
 * where wide, else int32) into *c; c->done stays 0 where a sum is not exact in float64, a value is
 * not finite or the positions are not so. */
static void code_side(sbc_coded *c, const void *hp, const float *hv, Py_ssize_t nhi, const void *lp, const float *lv,
                      Py_ssize_t nlo, Py_ssize_t n, int64_t base, int wide, double ln_phi) {
    double sums[2];
    if (!exact_sum(hv, nhi, &sums[0]) || !exact_sum(lv, nlo, &sums[1])) return;
#ifdef HAVE_INT128
    /* mean+ = s_hi / c_hi against |mean-| = -s_lo / c_lo: the positive side on a tie */
    int positive = sign_of_sum(sums[0], nlo, sums[1], nhi) >= 0;
#else
    return;
#endif
    const void *pos = positive ? hp : lp;
    Py_ssize_t nnz = positive ? nhi : nlo;
    int b = golomb_b_of(nnz, n, ln_phi);
    Py_ssize_t nbytes = 0;
    uint8_t *bits = NULL;
    if (golomb_code(pos, wide, nnz, b, base, base + n - 1, &bits, &nbytes) != 0) return;
    c->positive = positive;
    c->sum = positive ? sums[0] : sums[1];
    c->nnz = nnz;
    c->b = b;
    c->bits = bits;
    c->nbytes = nbytes;
    c->done = 1;
}

/* The result list of `ntasks` tasks of `stride` bytes, each starting with its sbc_coded: None where
 * left to the Python path, else (sum, nnz, b, bits). */
static PyObject *coded_results(const void *tasks, size_t stride, Py_ssize_t ntasks) {
    PyObject *result = PyList_New(ntasks);
    for (Py_ssize_t i = 0; result != NULL && i < ntasks; i++) {
        const sbc_coded *c = (const sbc_coded *)((const char *)tasks + (size_t)i * stride);
        PyObject *item;
        if (!c->done) {
            Py_INCREF(Py_None);
            item = Py_None;
        } else {
            item = Py_BuildValue("dniy#", c->sum, c->nnz, c->b, (const char *)c->bits, c->nbytes);
        }
        if (item == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, item);
    }
    return result;
}

/* Run `body` over `job` on up to `threads` threads without the GIL, then coded_results. */
static PyObject *run_coded(void (*body)(void *), void *job, int threads, int use_team, const void *tasks, size_t stride,
                           Py_ssize_t ntasks) {
    Py_BEGIN_ALLOW_THREADS;
    team_run(body, job, threads, use_team);
    Py_END_ALLOW_THREADS;
    return coded_results(tasks, stride, ntasks);
}

/* Release what a call of coded tasks holds: views[0, held), the tasks' codes and both arrays. */
static void release_coded(Py_buffer *views, Py_ssize_t held, void *tasks, size_t stride, Py_ssize_t ntasks) {
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    if (tasks != NULL)
        for (Py_ssize_t i = 0; i < ntasks; i++) free(((sbc_coded *)((char *)tasks + (size_t)i * stride))->bits);
    PyMem_Free(tasks);
    PyMem_Free(views);
}

static void sbc_run(const sbc_job *job, sbc_task *t, float *work, int64_t *hp, float *hv, int64_t *lp, float *lv) {
    const float *x = t->x;
    Py_ssize_t n = t->n, k = t->k, nhi = 0, nlo = 0;
    float t_lo = 0.0f, t_hi = 0.0f;
    int found = 0;
    if (t->where != NULL) { /* fast mode */
        uint32_t nonfinite = 0;
        if (gather(x, n, t->where, t->s, work, &nonfinite) || nonfinite) return;
        order_pair(work, t->s, t->r, work + t->s, &t_lo, &t_hi);
        Py_ssize_t limit = 4 * k;
        scan_out o = {hp, lp, hv, lv, 0, 0, limit < n ? limit : n};
        if (!scan_range(x, 0, n, t_hi, t_lo, limit, &o) && o.nhi > 0 && o.nhi <= 2 * k && o.nlo > 0 &&
            o.nlo <= 2 * k) {
            nhi = o.nhi;
            nlo = o.nlo;
            found = 1;
        }
    }
    if (!found) { /* exact mode */
        if (n < 2 || n > job->order_max) return;
        if (any_nonfinite(x, n)) return;
        order_pair(x, n, k, work, &t_lo, &t_hi);
        nhi = exact_side(x, n, t_hi, k, 1, hp, hv);
        nlo = exact_side(x, n, t_lo, k, 0, lp, lv);
    }
    code_side(&t->out, hp, hv, nhi, lp, lv, nlo, n, 0, 1, job->ln_phi);
}

static void sbc_body(void *arg) {
    sbc_job *job = arg;
    size_t cap = (size_t)job->cap + 1;
    float *work = malloc(sizeof(float) * (size_t)(job->work + 1));
    int64_t *hp = malloc(8 * cap), *lp = malloc(8 * cap);
    float *hv = malloc(4 * cap), *lv = malloc(4 * cap);
    if (work != NULL && hp != NULL && lp != NULL && hv != NULL && lv != NULL) /* else the others do it */
        for (Py_ssize_t i; (i = team_next(&job->next, job->ntasks)) >= 0;) {
            sbc_run(job, &job->tasks[i], work, hp, hv, lp, lv);
        }
    free(work);
    free(hp);
    free(lp);
    free(hv);
    free(lv);
}

static PyObject *encode_many(PyObject *self, PyObject *args) {
    PyObject *list, *result = NULL;
    Py_ssize_t order_max;
    double ln_phi;
    int threads, use_team;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!ndip", &PyList_Type, &list, &order_max, &ln_phi, &threads, &use_team)) return NULL;
    Py_ssize_t ntasks = PyList_GET_SIZE(list);
    sbc_task *tasks = PyMem_Calloc(ntasks ? (size_t)ntasks : 1, sizeof(sbc_task));
    Py_buffer *views = PyMem_Calloc(ntasks ? (size_t)(2 * ntasks) : 1, sizeof(Py_buffer));
    Py_ssize_t held = 0; /* views[0, held) hold buffers */
    if (tasks == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    sbc_job job = {tasks, ntasks, 0, 0, 0, order_max, ln_phi};
    for (Py_ssize_t i = 0; i < ntasks; i++) {
        PyObject *a, *where;
        sbc_task *t = &tasks[i];
        if (!PyArg_ParseTuple(PyList_GET_ITEM(list, i), "OOnn", &a, &where, &t->k, &t->r)) goto done;
        if (PyObject_GetBuffer(a, &views[held], PyBUF_SIMPLE) < 0) goto done;
        t->x = (const float *)views[held].buf;
        t->n = views[held++].len / 4;
        if (where != Py_None) {
            if (PyObject_GetBuffer(where, &views[held], PyBUF_SIMPLE) < 0) goto done;
            t->where = (const int64_t *)views[held].buf;
            t->s = views[held++].len / 8;
        }
        if (t->k < 1 || t->k > t->n || (t->where != NULL && (t->r < 1 || t->r > t->s))) {
            PyErr_Format(PyExc_ValueError, "encode_many: task %zd needs 1 <= k <= n and, with positions, 1 <= r <= s", i);
            goto done;
        }
        Py_ssize_t cap = t->k, work = t->n <= order_max ? t->n : 0;
        if (t->where != NULL) {
            Py_ssize_t limit = 4 * t->k;
            cap = limit < t->n ? limit : t->n;
            work = 2 * t->s > work ? 2 * t->s : work;
        }
        job.cap = cap > job.cap ? cap : job.cap;
        job.work = work > job.work ? work : job.work;
    }
    result = run_coded(sbc_body, &job, threads, use_team, tasks, sizeof(sbc_task), ntasks);
done:
    release_coded(views, held, tasks, sizeof(sbc_task), ntasks);
    return result;
}

/* --- sides_flat's tasks: the side, sum and Golomb code of candidates chosen elsewhere ---------------
 *
 * What encode_many does after its selection, for candidates a device selected
 * (fedcomp.codecs.sbc_device): per task, both sides' exact sums, the side with the larger mean
 * magnitude (the positive one on a tie) and the Golomb-Rice code of its positions. A task whose
 * sums a float64 cannot hold exactly (or whose values are not finite) is left to the Python path. */

typedef struct {
    sbc_coded out;
    const void *hp, *lp; /* int64 where the job is wide, else int32 */
    const float *hv, *lv;
    Py_ssize_t nhi, nlo, n;
    int64_t base; /* the positions are base + the tensor's own (sides_flat) */
    Py_ssize_t at; /* where its kept positions go in sides_flat's output (set after the sides) */
} side_task;

typedef struct {
    side_task *tasks;
    Py_ssize_t ntasks, next;
    double ln_phi;
    int wide;
    void *kept; /* sides_flat's outputs (the fill pass): positions of the job's width, and values */
    float *value;
    const double *means;
} side_job;

static void side_run(const side_job *job, side_task *t) {
    code_side(&t->out, t->hp, t->hv, t->nhi, t->lp, t->lv, t->nlo, t->n, t->base, job->wide, job->ln_phi);
}

static void side_body(void *arg) {
    side_job *job = arg;
    for (Py_ssize_t i; (i = team_next(&job->next, job->ntasks)) >= 0;) {
        side_run(job, &job->tasks[i]);
    }
}

/* The fill pass: each tensor's kept positions (its side's, as given) and its mean, at t->at. */
static void fill_body(void *arg) {
    side_job *job = arg;
    size_t width = job->wide ? 8 : 4;
    for (Py_ssize_t i; (i = team_next(&job->next, job->ntasks)) >= 0;) {
        const side_task *t = &job->tasks[i];
        Py_ssize_t nnz = t->out.nnz;
        memcpy((char *)job->kept + (size_t)t->at * width, t->out.positive ? t->hp : t->lp, (size_t)nnz * width);
        float mean = (float)job->means[i], *v = job->value + t->at;
        for (Py_ssize_t j = 0; j < nnz; j++) v[j] = mean;
    }
}

#ifdef HAVE_INT128
/* sum / nnz rounded to the nearest float32, ties to even, subnormals included (sum: an exact sum of
 * float32 values, finite; nnz >= 1): fedcomp.codecs.sbc._round_f32(_units(sum), nnz << 149). */
static double mean_f32(double sum, int64_t nnz) {
    if (sum == 0.0) return 0.0;
    int e;
    uint64_t m = (uint64_t)ldexp(frexp(fabs(sum), &e), 53); /* |sum| = m * 2**(e - 53), 2**52 <= m < 2**53 */
    unsigned __int128 num = (unsigned __int128)m << 64;     /* |sum| = num * 2**(e - 117) */
    unsigned __int128 q = num / (uint64_t)nnz, rem = num % (uint64_t)nnz;
    int scale = e - 117; /* |mean| = (q + rem / nnz) * 2**scale, q >= 2**116 / nnz >= 2**54 */
    int bits = 0;
    for (unsigned __int128 t = q; t; t >>= 1) bits++;
    int last = bits - 1 + scale - 23; /* the exponent of the float32's last mantissa bit */
    if (last < -149) last = -149;
    int shift = last - scale; /* in [bits - 24, 116]: e >= -148 for a sum of float32 values */
    unsigned __int128 mant = q >> shift, low = q - (mant << shift), half = (unsigned __int128)1 << (shift - 1);
    if (low > half || (low == half && (rem != 0 || (mant & 1)))) mant++;
    double out = ldexp((double)(uint64_t)mant, last);
    return sum < 0 ? -out : out;
}

/* --- sides_flat: the sides of every tensor of an update, its candidates laid out flat ------------
 *
 * sides_flat(positions, values, ranges, bases, numels, wide, ln_phi, threads, use_team, kept, value)
 *     -> (per tensor None or (mean, nnz, b, bits, positive), count)
 *
 * What fedcomp.codecs.sbc_device hands over without a Python object per tensor: every tensor's
 * candidates in two flat arrays (positions into the update's flat buffer, int64 where wide is
 * true, else int32, as a device copied them; values float32), tensor i's high side
 * positions[ranges[4i], ranges[4i+1]), its low side positions[ranges[4i+2], ranges[4i+3]), its positions
 * in [bases[i], bases[i] + numels[i]), coded less bases[i]. Per tensor as above (the side, its exact
 * sum, its Golomb code), the mean rounded to float32 here (mean_f32). Where every tensor was coded,
 * kept (the positions' width) and value (float32) get, in tensor order, each kept position as given
 * and its tensor's mean (on the threads too), and count is how many; else count is -1 and they are
 * not written. */
static PyObject *sides_flat(PyObject *self, PyObject *args) {
    Py_buffer ps = {0}, vs = {0}, rg = {0}, bs = {0}, nm = {0}, kp = {0}, vl = {0};
    double ln_phi;
    int wide, threads, use_team;
    PyObject *result = NULL, *list = NULL;
    side_task *tasks = NULL;
    double *means = NULL; /* each coded tensor's mean, rounded to float32 */
    Py_ssize_t ntasks = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*pdipw*w*", &ps, &vs, &rg, &bs, &nm, &wide, &ln_phi, &threads, &use_team,
                          &kp, &vl))
        return NULL;
    Py_ssize_t width = wide ? 8 : 4, np_ = ps.len / width;
    ntasks = bs.len / 8;
    if (ps.len % width || vs.len != 4 * np_ || bs.len % 8 ||
        rg.len != 32 * ntasks || nm.len != 8 * ntasks || kp.len % width || vl.len != 4 * (kp.len / width)) {
        PyErr_SetString(PyExc_ValueError,
                        "sides_flat: positions (int64 if wide, else int32) with as many float32 values, 4 int64 "
                        "per tensor in ranges, one in bases and numels, and as many float32 in value as "
                        "positions in kept");
        goto done;
    }
    tasks = PyMem_Calloc(ntasks ? (size_t)ntasks : 1, sizeof(side_task));
    means = PyMem_Calloc(ntasks ? (size_t)ntasks : 1, sizeof(double));
    if (tasks == NULL || means == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *r = rg.buf, *base = bs.buf, *numel = nm.buf;
    for (Py_ssize_t i = 0; i < ntasks; i++) {
        const int64_t *q = r + 4 * i;
        if (q[0] < 0 || q[0] > q[1] || q[1] > np_ || q[2] < 0 || q[2] > q[3] || q[3] > np_ || numel[i] < 1) {
            PyErr_Format(PyExc_ValueError, "sides_flat: tensor %zd's ranges are not within the arrays, or n < 1", i);
            goto done;
        }
        side_task *t = &tasks[i];
        t->hp = (const char *)ps.buf + q[0] * width;
        t->hv = (const float *)vs.buf + q[0];
        t->nhi = q[1] - q[0];
        t->lp = (const char *)ps.buf + q[2] * width;
        t->lv = (const float *)vs.buf + q[2];
        t->nlo = q[3] - q[2];
        t->n = numel[i];
        t->base = base[i];
    }
    side_job job = {tasks, ntasks, 0, ln_phi, wide, kp.buf, vl.buf, means};
    Py_BEGIN_ALLOW_THREADS;
    team_run(side_body, &job, threads, use_team);
    Py_END_ALLOW_THREADS;
    list = PyList_New(ntasks);
    Py_ssize_t count = 0;
    int all = 1;
    for (Py_ssize_t i = 0; list != NULL && i < ntasks; i++) {
        side_task *t = &tasks[i];
        const sbc_coded *c = &t->out;
        PyObject *item;
        if (!c->done) {
            all = 0;
            Py_INCREF(Py_None);
            item = Py_None;
        } else {
            t->at = count;
            count += c->nnz;
            means[i] = c->nnz ? mean_f32(c->sum, c->nnz) : 0.0;
            item = Py_BuildValue("dniy#O", means[i], c->nnz, c->b, (const char *)c->bits, c->nbytes,
                                 c->positive ? Py_True : Py_False);
        }
        if (item == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, item);
    }
    if (list == NULL) goto done;
    if (!all || count > kp.len / width) {
        count = -1;
    } else {
        job.next = 0;
        Py_BEGIN_ALLOW_THREADS;
        team_run(fill_body, &job, threads, use_team);
        Py_END_ALLOW_THREADS;
    }
    result = Py_BuildValue("Nn", list, count);
    list = NULL;
done:
    Py_XDECREF(list);
    if (tasks != NULL)
        for (Py_ssize_t i = 0; i < ntasks; i++) free(tasks[i].out.bits);
    PyMem_Free(tasks);
    PyMem_Free(means);
    Py_buffer *views[] = {&ps, &vs, &rg, &bs, &nm, &kp, &vl};
    for (size_t i = 0; i < sizeof(views) / sizeof(views[0]); i++)
        if (views[i]->obj != NULL) PyBuffer_Release(views[i]);
    return result;
}
#endif

/* A big-endian bit reader over buf[0, end): the next `avail` bits (at most 63) are the top of `acc`;
 * the bits below them are zero or the stream's next bits, in place (a refill ORs the same bits
 * again); `p` is the first byte none of whose bits are counted in `avail` or consumed. */
typedef struct {
    const uint8_t *buf;
    Py_ssize_t p, end;
    uint64_t acc;
    int avail;
} bit_reader;

/* At least 56 bits in acc, or every bit left (reads only buf[p, end)). Eight bytes at a time
 * where they are there (the bytes past the 64 bits that fit are loaded again next time). */
static inline void refill(bit_reader *r) {
    if (r->p + 8 <= r->end) {
        uint64_t w;
        memcpy(&w, r->buf + r->p, 8);
        w = __builtin_bswap64(w); /* (GCC and Clang, as the atomics above) */
        r->acc |= w >> r->avail;
        r->p += (63 - r->avail) >> 3;
        r->avail |= 56;
    } else {
        while (r->avail <= 55 && r->p < r->end) {
            r->acc |= (uint64_t)r->buf[r->p++] << (56 - r->avail);
            r->avail += 8;
        }
    }
}

/* n bits (1 <= n <= avail <= 63) off the top of acc. */
static inline uint64_t take_bits(bit_reader *r, int n) {
    uint64_t v = r->acc >> (64 - n);
    r->acc <<= n;
    r->avail -= n;
    return v;
}

/* Decode nnz codewords into pos. Returns 1 if the stream is one the NumPy decoder accepts, else 0.
 * Reads only bits[0, nbytes): the remainders (nnz * b bits) from the start, the unary quotients
 * after them, each section by a 64-bit reader. */
static int decode_core(const uint8_t *bits, Py_ssize_t nbytes, int64_t nnz, int b, int64_t numel, int64_t *pos) {
    uint64_t rem_len = (uint64_t)nnz * (uint64_t)b;
    if ((uint64_t)nbytes * 8 < rem_len + (uint64_t)nnz) return 0;
    uint64_t max_q = (uint64_t)(numel - 1) >> b;
    bit_reader rr = {bits, 0, nbytes, 0, 0};
    bit_reader ur = {bits, (Py_ssize_t)(rem_len / 8), nbytes, 0, 0};
    refill(&ur); /* the byte holding bit rem_len is there (nbytes * 8 > rem_len): 8 bits or more */
    if (rem_len % 8) take_bits(&ur, (int)(rem_len % 8));
    uint64_t cur = 0;
    for (int64_t k = 0; k < nnz; k++) {
        uint64_t r = 0;
        if (b) {
            if (b <= 56) {
                if (rr.avail < b) refill(&rr);
                r = take_bits(&rr, b); /* rem_len bits are there: nbytes * 8 >= rem_len */
            } else {
                refill(&rr);
                r = take_bits(&rr, 32);
                refill(&rr);
                r = (r << (b - 32)) | take_bits(&rr, b - 32);
            }
        }
        uint64_t q = 0;
        for (;;) {
            if (ur.avail < 56) refill(&ur);
            if (ur.avail == 0) return 0; /* the unary section runs out of zero bits */
            int ones = ~ur.acc ? __builtin_clzll(~ur.acc) : 64;
            if (ones >= ur.avail) { /* all ones so far: take them and read on */
                q += (uint64_t)ur.avail;
                ur.acc = 0;
                ur.avail = 0;
                if (q > max_q) return 0;
                continue;
            }
            q += (uint64_t)ones;
            take_bits(&ur, ones + 1);
            break;
        }
        if (q > max_q) return 0;
        uint64_t d = (q << b) + r + 1; /* <= numel + 2**62 < 2**63 */
        cur = k ? cur + d : d - 1;     /* cur < numel < 2**62 before: no uint64 wrap */
        if (cur >= (uint64_t)numel) return 0;
        pos[k] = (int64_t)cur;
    }
    /* the stream ends with the byte holding the last zero bit; its padding bits are zero */
    uint64_t end = (uint64_t)ur.p * 8 - (uint64_t)ur.avail;
    if ((end + 7) / 8 != (uint64_t)nbytes) return 0;
    if (end % 8 && (bits[nbytes - 1] & (0xFF >> (end % 8)))) return 0;
    return 1;
}

static int check_decode_args(int64_t nnz, int b, int64_t numel) {
    if (nnz < 1 || numel < nnz || numel >= ((int64_t)1 << 62) || b < 0 || b > 62) {
        PyErr_SetString(PyExc_ValueError, "golomb decode: need 1 <= nnz <= numel < 2**62 and 0 <= b <= 62");
        return -1;
    }
    return 0;
}

static PyObject *golomb_decode(PyObject *self, PyObject *args) {
    Py_buffer bits, out;
    long long nnz, numel;
    int b;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*LiLw*", &bits, &nnz, &b, &numel, &out)) return NULL;
    PyObject *result = NULL;
    if (check_decode_args(nnz, b, numel) || check_len(&out, (Py_ssize_t)nnz, 8, "golomb_decode out")) goto done;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = decode_core((const uint8_t *)bits.buf, bits.len, nnz, b, numel, (int64_t *)out.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&bits);
    PyBuffer_Release(&out);
    return result;
}

/* --- the server's running sum of replies (fedcomp/flower/weighted_sum.py) ---------------------- */

/* One tensor of a reply: its kept positions (kind 0: a Golomb stream of nnz positions in
 * [0, numel), decoded into scratch[offset, offset + nnz), sharing one value) or its values (kind 1:
 * numel float32 values, little-endian, at any alignment). */
typedef struct {
    int kind;
    const uint8_t *buf;
    Py_ssize_t len;
    long long nnz, numel;
    int b;
    Py_ssize_t offset;
    double value;
} reply_task;

/* The tasks of `list` (tuples (kind, buffer, nnz, b, numel, offset, value)) with their buffers held
 * in views[0, *held); -1 with an exception set on a malformed list. */
static int reply_tasks(PyObject *list, Py_ssize_t scratch_len, reply_task *tasks, Py_buffer *views, Py_ssize_t *held) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t i = 0; i < n; i++) {
        reply_task *t = &tasks[i];
        PyObject *buf;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(list, i), "iOLiLnd", &t->kind, &buf, &t->nnz, &t->b, &t->numel, &t->offset, &t->value))
            return -1;
        if (PyObject_GetBuffer(buf, &views[*held], PyBUF_SIMPLE) < 0) return -1;
        t->buf = (const uint8_t *)views[*held].buf;
        t->len = views[(*held)++].len;
        int bad;
        if (t->kind == 0)
            bad = check_decode_args(t->nnz, t->b, t->numel) < 0 || t->offset < 0 || t->offset > scratch_len ||
                  t->nnz > scratch_len - t->offset;
        else if (t->kind == 1)
            bad = t->numel < 0 || t->numel > PY_SSIZE_T_MAX / 4 || t->len != (Py_ssize_t)t->numel * 4;
        else
            bad = 1;
        if (bad) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "reply task %zd: bad kind, counts, offset or length", i);
            return -1;
        }
    }
    return 0;
}

static inline float load_f32(const uint8_t *p) {
    float x;
    memcpy(&x, p, 4);
    return x;
}

/* reply_check's optional flat outputs (a device's decode, fedcomp/methods/flat_update.py): each kind 0
 * task's positions plus its base (where its tensor starts in the update's flat buffer), int64 where
 * wide else int32, and its value as float32, at the task's offset, written by the thread that decoded
 * them while they are in its cache (the host then neither adds, casts nor repeats). */
typedef struct {
    const int64_t *bases; /* one per task */
    void *kept;
    int wide;
    float *values;
} flat_out;

static void flat_write(const flat_out *f, const reply_task *t, const int64_t *pos, int64_t base) {
    Py_ssize_t at = t->offset;
    const int64_t *p = pos + at;
    float v = (float)t->value; /* (a float32 already: the mean as the sender rounded it) */
    if (f->wide) {
        int64_t *k = (int64_t *)f->kept + at;
        for (long long j = 0; j < t->nnz; j++) k[j] = base + p[j];
    } else {
        int32_t *k = (int32_t *)f->kept + at;
        for (long long j = 0; j < t->nnz; j++) k[j] = (int32_t)(base + p[j]);
    }
    float *out = f->values + at;
    for (long long j = 0; j < t->nnz; j++) out[j] = v;
}

/* One task of reply_check (task i): 1 where it passes (its positions decoded, its values finite),
 * and its squares into *squares; with `flat`, a passing kind 0 task's flat outputs written too. */
static int check_task(const reply_task *t, Py_ssize_t i, int64_t *pos, double *squares, const flat_out *flat) {
    if (t->kind == 0) {
        *squares = (double)t->nnz * t->value * t->value;
        int ok = decode_core(t->buf, t->len, t->nnz, t->b, t->numel, pos + t->offset);
        if (ok && flat != NULL) flat_write(flat, t, pos, flat->bases[i]);
        return ok;
    }
    double s = 0.0;
    int finite = 1;
    for (Py_ssize_t j = 0; j < (Py_ssize_t)t->numel; j++) {
        double x = (double)load_f32(t->buf + 4 * j);
        finite &= isfinite(x) != 0;
        s += x * x;
    }
    *squares = s;
    return finite;
}

typedef struct {
    const reply_task *tasks;
    Py_ssize_t ntasks, next; /* next: the first task no thread has taken (atomic) */
    int64_t *pos;
    double *squares;
    int *ok;
    const flat_out *flat;
} check_job;

static void check_body(void *arg) {
    check_job *job = arg;
    for (Py_ssize_t i; (i = team_next(&job->next, job->ntasks)) >= 0;) {
        job->ok[i] = check_task(&job->tasks[i], i, job->pos, &job->squares[i], job->flat);
    }
}

/* reply_check(tasks, scratch[, threads, use_team, bases, kept, wide, values]) -> (bad, squares):
 * decode kind 0's positions into int64 `scratch` and check kind 1's values are finite, summing the
 * squares of all (nnz * value**2 for kind 0, in the tasks' order); `bad` is the index of the first
 * task that fails (the caller reruns its Python check for the error), else -1. On one thread (the
 * default: a server checks replies while others are added) the tasks after a failing one are not
 * run; on more, every task runs (each writes only its own part of scratch) and the result is the
 * same. With `bases` (int64, one per task), also kept[j] = base + scratch[j] (int64 where `wide`,
 * else int32; the caller sees that every base + numel fits) and values[j] = the task's value
 * (float32) over each passing kind 0 task's part: `kept` and `values` as long as `scratch`. */
static PyObject *reply_check(PyObject *self, PyObject *args) {
    PyObject *list, *result = NULL;
    Py_buffer scratch, bases = {0}, kept = {0}, values = {0};
    int threads = 1, use_team = 0, wide = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!w*|ipy*w*pw*", &PyList_Type, &list, &scratch, &threads, &use_team, &bases, &kept,
                          &wide, &values))
        return NULL;
    Py_ssize_t ntasks = PyList_GET_SIZE(list), held = 0;
    flat_out flat = {(const int64_t *)bases.buf, kept.buf, wide, (float *)values.buf};
    if (bases.obj != NULL) {
        Py_ssize_t n = scratch.len / 8;
        if (kept.obj == NULL || values.obj == NULL || bases.len != ntasks * 8 || kept.len != n * (wide ? 8 : 4) ||
            values.len != n * 4) {
            PyErr_SetString(PyExc_ValueError,
                            "reply_check: bases (int64, one per task), kept (int64 if wide, else int32) and values "
                            "(float32) as long as scratch");
            PyBuffer_Release(&scratch);
            if (kept.obj != NULL) PyBuffer_Release(&kept);
            if (values.obj != NULL) PyBuffer_Release(&values);
            PyBuffer_Release(&bases);
            return NULL;
        }
    }
    const flat_out *flat_p = bases.obj != NULL ? &flat : NULL;
    reply_task *tasks = PyMem_Calloc(ntasks ? (size_t)ntasks : 1, sizeof(reply_task));
    Py_buffer *views = PyMem_Calloc(ntasks ? (size_t)ntasks : 1, sizeof(Py_buffer));
    double *squares = PyMem_Calloc(ntasks ? (size_t)ntasks : 1, sizeof(double));
    int *ok = PyMem_Calloc(ntasks ? (size_t)ntasks : 1, sizeof(int));
    if (tasks == NULL || views == NULL || squares == NULL || ok == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (reply_tasks(list, scratch.len / 8, tasks, views, &held) < 0) goto done;
    for (Py_ssize_t i = 0; flat_p != NULL && i < ntasks; i++) {
        /* (each position is below its task's numel, so base + numel bounds what is written) */
        int64_t base = flat.bases[i];
        if (tasks[i].kind == 0 && (base < 0 || base > (wide ? INT64_MAX : INT32_MAX) - tasks[i].numel)) {
            PyErr_Format(PyExc_ValueError, "reply_check: task %zd's base plus its numel does not fit the positions", i);
            goto done;
        }
    }
    Py_ssize_t bad = -1;
    double total = 0.0;
    int64_t *pos = (int64_t *)scratch.buf;
    Py_BEGIN_ALLOW_THREADS;
    if (threads > 1 && ntasks > 1) {
        check_job job = {tasks, ntasks, 0, pos, squares, ok, flat_p};
        team_run(check_body, &job, threads, use_team);
    } else {
        for (Py_ssize_t i = 0; i < ntasks; i++)
            if (!(ok[i] = check_task(&tasks[i], i, pos, &squares[i], flat_p))) {
                ntasks = i + 1; /* (the rest are not run, nor counted) */
                break;
            }
    }
    for (Py_ssize_t i = 0; i < ntasks && bad < 0; i++) {
        total += squares[i];
        if (!ok[i]) bad = i;
    }
    Py_END_ALLOW_THREADS;
    result = Py_BuildValue("nd", bad, total);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyBuffer_Release(&scratch);
    if (bases.obj != NULL) {
        PyBuffer_Release(&bases);
        PyBuffer_Release(&kept);
        PyBuffer_Release(&values);
    }
    PyMem_Free(tasks);
    PyMem_Free(views);
    PyMem_Free(squares);
    PyMem_Free(ok);
    return result;
}

typedef struct {
    const reply_task *tasks;
    Py_ssize_t ntasks, next;
    const int64_t *pos;
    double weight;
    double **outs;
    int bad;
} reply_job;

static void reply_add_task(const reply_job *job, const reply_task *t, double *o, int *bad) {
    if (t->kind == 0) {
        double wv = job->weight * t->value;
        const int64_t *p = job->pos + t->offset;
        for (long long k = 0; k < t->nnz; k++) {
            if (p[k] < 0 || p[k] >= t->numel) { /* scratch is the caller's: never trusted */
                *bad = 1;
                return;
            }
            o[p[k]] += wv;
        }
    } else {
        for (Py_ssize_t j = 0; j < (Py_ssize_t)t->numel; j++) o[j] += job->weight * (double)load_f32(t->buf + 4 * j);
    }
}

static void reply_body(void *arg) {
    reply_job *job = arg;
    int bad = 0;
    for (Py_ssize_t i; (i = team_next(&job->next, job->ntasks)) >= 0;) {
        reply_add_task(job, &job->tasks[i], job->outs[i], &bad);
    }
    if (bad) __atomic_store_n(&job->bad, 1, __ATOMIC_RELAXED);
}

/* reply_add(tasks, scratch, weight, outs, threads, use_team): outs[i] (float64, numel entries) +=
 * weight * task i (kind 0: weight * value at the positions reply_check decoded into `scratch`,
 * each position checked again against numel; kind 1: weight * each value), the tasks taken in
 * list order by whichever of `threads` threads is free (team.h; each output is one task's alone). */
static PyObject *reply_add(PyObject *self, PyObject *args) {
    PyObject *list, *outs, *result = NULL;
    Py_buffer scratch;
    double weight;
    int threads, use_team;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!y*dO!ip", &PyList_Type, &list, &scratch, &weight, &PyList_Type, &outs, &threads, &use_team))
        return NULL;
    Py_ssize_t ntasks = PyList_GET_SIZE(list), held = 0, nouts = 0;
    size_t room = ntasks ? (size_t)ntasks : 1;
    reply_task *tasks = PyMem_Calloc(room, sizeof(reply_task));
    Py_buffer *views = PyMem_Calloc(room, sizeof(Py_buffer));
    Py_buffer *dst = PyMem_Calloc(room, sizeof(Py_buffer));
    double **outp = PyMem_Calloc(room, sizeof(double *));
    if (tasks == NULL || views == NULL || dst == NULL || outp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyList_GET_SIZE(outs) != ntasks) {
        PyErr_SetString(PyExc_ValueError, "reply_add: one output per task");
        goto done;
    }
    if (reply_tasks(list, scratch.len / 8, tasks, views, &held) < 0) goto done;
    for (; nouts < ntasks; nouts++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(outs, nouts), &dst[nouts], PyBUF_WRITABLE) < 0) goto done;
        outp[nouts] = (double *)dst[nouts].buf;
        if (dst[nouts].len != (Py_ssize_t)tasks[nouts].numel * 8) {
            PyErr_Format(PyExc_ValueError, "reply_add: output %zd is not numel float64 values", nouts);
            nouts++;
            goto done;
        }
        for (Py_ssize_t j = 0; j < nouts; j++) /* two tasks writing one output would race */
            if (dst[j].buf == dst[nouts].buf) {
                PyErr_Format(PyExc_ValueError, "reply_add: outputs %zd and %zd are the same buffer", j, nouts);
                nouts++;
                goto done;
            }
    }
    reply_job job = {tasks, ntasks, 0, (const int64_t *)scratch.buf, weight, outp, 0};
    Py_BEGIN_ALLOW_THREADS;
    team_run(reply_body, &job, threads, use_team);
    Py_END_ALLOW_THREADS;
    if (job.bad) PyErr_SetString(PyExc_ValueError, "reply_add: a position in scratch is outside its tensor");
    else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    for (Py_ssize_t i = 0; i < nouts; i++) PyBuffer_Release(&dst[i]);
    PyBuffer_Release(&scratch);
    PyMem_Free(tasks);
    PyMem_Free(views);
    PyMem_Free(dst);
    PyMem_Free(outp);
    return result;
}

/* fill's ordinary writes of [*at, stop): zeros, and `value` at the positions p[*i] below stop
 * (ascending from *at, each below `end`); 0 on a position out of order or range. */
static int fill_plain(float *o, Py_ssize_t *at, Py_ssize_t stop, const int64_t *p, Py_ssize_t *i, Py_ssize_t p1,
                      Py_ssize_t end, float value) {
    for (; *i < p1 && p[*i] < stop; (*i)++) {
        int64_t j = p[*i];
        if (j < *at || j >= end) return 0;
        memset(o + *at, 0, (size_t)(j - *at) * 4);
        o[j] = value;
        *at = (Py_ssize_t)j + 1;
    }
    if (stop > *at) {
        memset(o + *at, 0, (size_t)(stop - *at) * 4);
        *at = stop;
    }
    return 1;
}

#ifdef HAVE_SSE2
/* Outputs at least this long (floats) are written with non-temporal stores. */
#define FILL_STREAM_MIN ((Py_ssize_t)1 << 18)

/* fill_plain of [*at, end) for a long output: its 16-byte-aligned middle written four floats at a
 * time by non-temporal stores (a decode into a receiver's buffer larger than the caches: the
 * lines are not read from memory before they are written), the ends the ordinary way. Asked for
 * by the caller (fill's `stream`): into fresh pages, which the kernel has just zeroed through the
 * cache, these stores measured slower (a ResNet-50 update's decode into new arrays 14-20 ->
 * 26-27 ms), into a warm buffer faster (10.4-10.6 -> 8.2-8.8 ms). */
static int fill_stream(float *o, Py_ssize_t *at, const int64_t *p, Py_ssize_t *i, Py_ssize_t p1, Py_ssize_t end,
                       float value) {
    Py_ssize_t first = *at + (Py_ssize_t)(((16 - ((uintptr_t)(o + *at) & 15)) & 15) / 4);
    if (((uintptr_t)o & 3) != 0 || first + 4 > end) return fill_plain(o, at, end, p, i, p1, end, value);
    Py_ssize_t last = first + (end - first) / 4 * 4;
    if (!fill_plain(o, at, first, p, i, p1, end, value)) return 0;
    const __m128 zero = _mm_setzero_ps();
    for (Py_ssize_t blk = first; blk < last; blk += 4) {
        if (*i < p1 && p[*i] < blk + 4) {
            float lanes[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (; *i < p1 && p[*i] < blk + 4; (*i)++) {
                int64_t j = p[*i];
                if (j < *at) return 0;
                lanes[j - blk] = value;
                *at = (Py_ssize_t)j + 1;
            }
            _mm_stream_ps(o + blk, _mm_loadu_ps(lanes));
        } else {
            _mm_stream_ps(o + blk, zero);
        }
    }
    _mm_sfence();
    *at = last;
    return fill_plain(o, at, end, p, i, p1, end, value);
}
#endif

static PyObject *fill(PyObject *self, PyObject *args) {
    Py_buffer out, pos;
    Py_ssize_t begin, end, p0, p1;
    float value;
    int stream = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*nny*nnf|p", &out, &begin, &end, &pos, &p0, &p1, &value, &stream)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = out.len / 4, m = pos.len / 8;
    if (begin < 0 || end < begin || end > n || p0 < 0 || p1 < p0 || p1 > m) {
        PyErr_SetString(PyExc_ValueError, "fill: range out of bounds");
        goto done;
    }
    float *o = (float *)out.buf;
    const int64_t *p = (const int64_t *)pos.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t at = begin, i = p0; /* everything below `at` is written; p[i] is the next position */
#ifdef HAVE_SSE2
    if (stream && end - begin >= FILL_STREAM_MIN) bad = !fill_stream(o, &at, p, &i, p1, end, value);
    else
#endif
        bad = !fill_plain(o, &at, end, p, &i, p1, end, value);
    if (!bad && i < p1) bad = 1; /* a position at or past end */
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "fill: positions must ascend within [begin, end)");
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&pos);
    return result;
}

/* For tests: the scan variant in use ("base" or "avx2"); with a name, switch to it first. */
static PyObject *scan_variant(PyObject *self, PyObject *args) {
    const char *name = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    if (name != NULL) {
        if (strcmp(name, "base") == 0) {
            scan_range = scan_base;
        }
#ifdef HAVE_AVX2_DISPATCH
        else if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2")) {
            scan_range = scan_avx2;
        }
#endif
        else {
            PyErr_Format(PyExc_ValueError, "scan_variant: %s is not available here", name);
            return NULL;
        }
    }
#ifdef HAVE_AVX2_DISPATCH
    if (scan_range == scan_avx2) return PyUnicode_FromString("avx2");
#endif
    return PyUnicode_FromString("base");
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS, "out[begin:end] = 0, then value at the ascending positions pos[p0:p1]."},
    {"scan", scan, METH_VARARGS, "Positions and values of a >= thr_hi and of a <= thr_lo in [begin, end)."},
    {"scan_variant", scan_variant, METH_VARARGS, "The scan variant in use; switch with a name (tests)."},
    {"order_stats", order_stats, METH_VARARGS, "The r-th smallest and largest of a (None if any is not finite)."},
    {"sample_thresholds", sample_thresholds, METH_VARARGS, "The r-th smallest and largest of a[pos] (None if any is not finite)."},
    {"sum_stats", sum_stats, METH_VARARGS, "float64 sum and min/max magnitude bits of float32 values."},
    {"fast_select", fast_select, METH_VARARGS, "sample_thresholds, scan and both sides' sum_stats in one call."},
    {"encode_many", encode_many, METH_VARARGS, "Whole SBC encodings of a list of tensors on several threads."},
#ifdef HAVE_INT128
    {"sides_flat", sides_flat, METH_VARARGS, "Side, mean and Golomb code of every tensor, its candidates selected elsewhere and laid out flat."},
#endif
    {"golomb_encode", golomb_encode, METH_VARARGS, "Golomb-Rice code ascending int64 positions."},
    {"golomb_decode", golomb_decode, METH_VARARGS, "Decode positions; False on an invalid stream."},
    {"reply_check", reply_check, METH_VARARGS, "Decode a reply's positions into scratch, check its values; (bad, squares)."},
    {"reply_add", reply_add, METH_VARARGS, "Add weight * a checked reply into float64 sums."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sbc", "C kernels for SBC's CPU paths.", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sbc(void) {
#ifdef HAVE_AVX2_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) scan_range = scan_avx2;
#endif
    return PyModule_Create(&module);
}
