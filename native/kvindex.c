/* Index kernels for kvstore.index (called through ctypes from src/kvstore/index/native.py).
 *
 * Plain C99, no dependencies. Every function has a numpy/Python fallback in native.py that
 * gives bit-identical results, so the arithmetic here is pinned down:
 *   - a dot product of keys row r with q is   acc = k[0]*q[0]; acc += k[d]*q[d] for d = 1..D-1
 *     in float32 (each product and each sum rounded to float32, no fused multiply-add: build
 *     with -ffp-contract=off and without -ffast-math; FLT_EVAL_METHOD must be 0);
 *   - a PQ estimate is                        acc = lut[0][c0]; acc += lut[j][cj] for j = 1..m-1;
 *   - top-k order: higher score first, equal scores by lower id (kvstore.index.spec.top_ids);
 *   - the DIPR walk replays GraphIndex's Python walk: Python floats are C doubles, its heapq of
 *     (-score, id) tuples is the same binary heap with the same sift rules and the same tuple
 *     comparison, so even NaN scores (overflowing products) pop in the same order.
 *
 * Built by setup.py as the extension module kvstore.index._kvindex (KVINDEX_PYMODULE adds the
 * module init so the file is a valid Python extension); native.py opens that file with ctypes.
 * Without the macro the file compiles as a plain shared library: cc -O2 -ffp-contract=off
 * -shared -fPIC native/kvindex.c.
 *
 * Return values: 0 (or a count >= 0) on success, KV_ERR_* (< 0) on failure. Argument shapes,
 * dtypes and contiguity are checked by native.py; values the kernels index with (codes, ids,
 * adjacency) are checked here, so a bad value is an error code, never an out-of-bounds read.
 */

#ifdef KVINDEX_PYMODULE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0
#error "float expressions must be evaluated in float (FLT_EVAL_METHOD 0) to match numpy"
#endif
#ifdef __FAST_MATH__
#error "kvindex.c must not be built with -ffast-math (it reorders the sums)"
#endif

#if defined(_WIN32)
#define KV_API __declspec(dllexport)
#else
#define KV_API __attribute__((visibility("default")))
#endif

#define KV_ABI_VERSION 2
#define KV_ERR_NOMEM (-1)
#define KV_ERR_ADJ (-2)  /* adjacency: ptr not monotone / out of range, or an id outside 0..n-1 */
#define KV_ERR_CODE (-3) /* a PQ code >= K */
#define KV_ERR_ID (-4)   /* an id outside 0..n-1 */
#define KV_ERR_ARG (-5)  /* a size out of range */

KV_API int64_t kv_abi_version(void) { return KV_ABI_VERSION; }

/* ---------------------------------------------------------------- dot products */

static float dot1(const float *k, const float *q, int64_t d) {
    float acc = k[0] * q[0];
    for (int64_t i = 1; i < d; i++) acc += k[i] * q[i];
    return acc;
}

/* Four rows at once: four independent sequential chains (same per-row order as dot1). */
static void dot4(const float *k0, const float *k1, const float *k2, const float *k3,
                 const float *q, int64_t d, float *out) {
    float a0 = k0[0] * q[0], a1 = k1[0] * q[0], a2 = k2[0] * q[0], a3 = k3[0] * q[0];
    for (int64_t i = 1; i < d; i++) {
        float qi = q[i];
        a0 += k0[i] * qi;
        a1 += k1[i] * qi;
        a2 += k2[i] * qi;
        a3 += k3[i] * qi;
    }
    out[0] = a0;
    out[1] = a1;
    out[2] = a2;
    out[3] = a3;
}

/* Eight rows at once (the chains' latency, not the arithmetic, bounds dot1). */
static void dot8(const float *const *k, const float *q, int64_t d, float *out) {
    float a[8];
    for (int r = 0; r < 8; r++) a[r] = k[r][0] * q[0];
    for (int64_t i = 1; i < d; i++) {
        float qi = q[i];
        a[0] += k[0][i] * qi;
        a[1] += k[1][i] * qi;
        a[2] += k[2][i] * qi;
        a[3] += k[3][i] * qi;
        a[4] += k[4][i] * qi;
        a[5] += k[5][i] * qi;
        a[6] += k[6][i] * qi;
        a[7] += k[7][i] * qi;
    }
    for (int r = 0; r < 8; r++) out[r] = a[r];
}

/* out[t] = keys[rows[t]] . q for t < cnt (rows already checked). */
static void dot_rows(const float *keys, int64_t d, const int64_t *rows, int64_t cnt,
                     const float *q, float *out) {
    int64_t t = 0;
    for (; t + 8 <= cnt; t += 8) {
        const float *k[8];
        for (int r = 0; r < 8; r++) k[r] = keys + rows[t + r] * d;
        dot8(k, q, d, out + t);
    }
    for (; t + 4 <= cnt; t += 4)
        dot4(keys + rows[t] * d, keys + rows[t + 1] * d, keys + rows[t + 2] * d,
             keys + rows[t + 3] * d, q, d, out + t);
    for (; t < cnt; t++) out[t] = dot1(keys + rows[t] * d, q, d);
}

/* out[t] = keys[ids[t]] . q (ids NULL: every row, nids = n). */
KV_API int kv_dot_seq(const float *keys, int64_t n, int64_t d, const float *q,
                      const int64_t *ids, int64_t nids, float *out) {
    if (n < 1 || d < 1 || nids < 0) return KV_ERR_ARG;
    if (ids == NULL) {
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            const float *k[8];
            for (int r = 0; r < 8; r++) k[r] = keys + (t + r) * d;
            dot8(k, q, d, out + t);
        }
        for (; t + 4 <= n; t += 4)
            dot4(keys + t * d, keys + (t + 1) * d, keys + (t + 2) * d, keys + (t + 3) * d, q, d,
                 out + t);
        for (; t < n; t++) out[t] = dot1(keys + t * d, q, d);
        return 0;
    }
    for (int64_t t = 0; t < nids; t++)
        if (ids[t] < 0 || ids[t] >= n) return KV_ERR_ID;
    dot_rows(keys, d, ids, nids, q, out);
    return 0;
}

/* ---------------------------------------------------------------- PQ scoring and top-k */

/* est[i] = sum_j lut[j, codes[i, j]] for i < limit, sequentially in j. */
static int pq_est(const float *lut, int64_t m, int64_t kk, const uint8_t *codes, int64_t limit,
                  float *est) {
    if (kk < 256) { /* a code may point past the table */
        int64_t total = limit * m;
        for (int64_t t = 0; t < total; t++)
            if (codes[t] >= kk) return KV_ERR_CODE;
    }
    int64_t i = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (m == 8) { /* the default: a row's 8 codes in one load, four rows at a time */
        const float *l0 = lut, *l1 = lut + kk, *l2 = lut + 2 * kk, *l3 = lut + 3 * kk;
        const float *l4 = lut + 4 * kk, *l5 = lut + 5 * kk, *l6 = lut + 6 * kk;
        const float *l7 = lut + 7 * kk;
        for (; i + 4 <= limit; i += 4) {
            uint64_t w[4];
            memcpy(w, codes + i * 8, sizeof w);
            float a[4];
            for (int r = 0; r < 4; r++) {
                uint64_t x = w[r];
                float acc = l0[x & 0xFF];
                acc += l1[(x >> 8) & 0xFF];
                acc += l2[(x >> 16) & 0xFF];
                acc += l3[(x >> 24) & 0xFF];
                acc += l4[(x >> 32) & 0xFF];
                acc += l5[(x >> 40) & 0xFF];
                acc += l6[(x >> 48) & 0xFF];
                acc += l7[x >> 56];
                a[r] = acc;
            }
            memcpy(est + i, a, sizeof a);
        }
    }
#endif
    for (; i + 4 <= limit; i += 4) { /* four independent chains */
        const uint8_t *c = codes + i * m;
        float a0 = lut[c[0]], a1 = lut[c[m]], a2 = lut[c[2 * m]], a3 = lut[c[3 * m]];
        for (int64_t j = 1; j < m; j++) {
            const float *l = lut + j * kk;
            a0 += l[c[j]];
            a1 += l[c[m + j]];
            a2 += l[c[2 * m + j]];
            a3 += l[c[3 * m + j]];
        }
        est[i] = a0;
        est[i + 1] = a1;
        est[i + 2] = a2;
        est[i + 3] = a3;
    }
    for (; i < limit; i++) {
        const uint8_t *c = codes + i * m;
        float acc = lut[c[0]];
        for (int64_t j = 1; j < m; j++) acc += lut[j * kk + c[j]];
        est[i] = acc;
    }
    return 0;
}

KV_API int kv_pq_scores(const float *lut, int64_t m, int64_t kk, const uint8_t *codes,
                        int64_t limit, float *out) {
    if (m < 1 || kk < 1 || kk > 256 || limit < 1) return KV_ERR_ARG;
    return pq_est(lut, m, kk, codes, limit, out);
}

/* Top-k without NaN (native.py checks the lut, and a sum of finite terms overflows to an
 * infinity, never to NaN). Each (score, id) becomes one uint64 whose ascending order is the
 * ranking (score descending, then id ascending): the score's order-preserving bits, inverted,
 * above the id. The keys are distinct, so a quickselect leaves the k smallest in front and a
 * heap sort orders them. */

static uint64_t rank_key(float f, int64_t id) {
    uint32_t u;
    f += 0.0f; /* -0.0 becomes +0.0: the two compare equal */
    memcpy(&u, &f, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending with f */
    return ((uint64_t)(~u) << 32) | (uint64_t)(uint32_t)id;
}

static void swapu(uint64_t *a, uint64_t *b) {
    uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* Reorder a[0..n) so that a[0..k) hold the k smallest (1 <= k < n; distinct keys). The
 * partition is branch-free (a plain one mispredicts on every other element); the pivot is
 * pseudo-random with a fixed seed. */
static void select_smallest(uint64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n;
    uint64_t x = 0x9E3779B97F4A7C15ull;
    while (hi - lo > 1) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        swapu(&a[lo + (int64_t)(x % (uint64_t)(hi - lo))], &a[hi - 1]);
        uint64_t p = a[hi - 1];
        int64_t j = lo; /* [lo, j) < p */
        for (int64_t i = lo; i < hi - 1; i++) {
            uint64_t v = a[i];
            a[i] = a[j];
            a[j] = v;
            j += v < p;
        }
        swapu(&a[j], &a[hi - 1]); /* the pivot at j: [0, j] are the j+1 smallest */
        if (k <= j)
            hi = j;
        else if (k == j + 1)
            return;
        else
            lo = j + 1;
    }
}

static void heap_sort(uint64_t *a, int64_t n) {
    for (int64_t start = n / 2 - 1, end = n; end > 1;) {
        int64_t root;
        if (start >= 0) {
            root = start--; /* heapify */
        } else {
            swapu(&a[0], &a[--end]); /* the largest to the back */
            root = 0;
        }
        uint64_t item = a[root];
        for (;;) {
            int64_t c = 2 * root + 1;
            if (c >= end) break;
            if (c + 1 < end && a[c + 1] > a[c]) c++;
            if (a[c] <= item) break;
            a[root] = a[c];
            root = c;
        }
        a[root] = item;
    }
}

/* Keys at most `thr` moved to the front of a[0..n) (in place); how many. */
static int64_t keep_at_most(uint64_t *a, int64_t n, uint64_t thr) {
    int64_t j = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t v = a[i];
        a[j] = v;
        j += v <= thr;
    }
    return j;
}

#define SAMPLE_STEP 16

/* The ids of the min(k, n) best of s[0..n), best first, into out. keys: scratch for
 * n + n / SAMPLE_STEP keys. For k well below n, a threshold from every SAMPLE_STEP-th key
 * first discards most keys in one cheap pass (if fewer than k survive, all are used). */
static void topk_ids(const float *s, int64_t n, int64_t k, int64_t *out, uint64_t *keys) {
    if (k > n) k = n;
    for (int64_t i = 0; i < n; i++) keys[i] = rank_key(s[i], i);
    int64_t cnt = n;
    if (n >= 1024 && k * 8 <= n) {
        int64_t ns = n / SAMPLE_STEP, r = k * ns / n;
        uint64_t *sample = keys + n;
        r += r / 2 + 16; /* margin: the sample's quantile is only an estimate */
        if (r < ns) {
            for (int64_t i = 0; i < ns; i++) sample[i] = keys[i * SAMPLE_STEP];
            select_smallest(sample, ns, r);
            uint64_t thr = sample[0];
            for (int64_t i = 1; i < r; i++)
                if (sample[i] > thr) thr = sample[i];
            cnt = keep_at_most(keys, n, thr);
            if (cnt < k) { /* too few survived: start over with every key */
                for (int64_t i = 0; i < n; i++) keys[i] = rank_key(s[i], i);
                cnt = n;
            }
        }
    }
    if (k < cnt) select_smallest(keys, cnt, k);
    heap_sort(keys, k);
    for (int64_t i = 0; i < k; i++) out[i] = (int64_t)(keys[i] & 0xFFFFFFFFu);
}

/* G queries: luts [G, m, K], out [G, min(k, limit)]. */
KV_API int kv_pq_topk(const float *luts, int64_t g, int64_t m, int64_t kk, const uint8_t *codes,
                      int64_t limit, int64_t k, int64_t *out) {
    if (g < 1 || m < 1 || kk < 1 || kk > 256 || limit < 1 || limit > (int64_t)UINT32_MAX ||
        k < 1)
        return KV_ERR_ARG;
    int64_t kk_out = k < limit ? k : limit;
    float *est = (float *)malloc((size_t)limit * sizeof(float));
    uint64_t *keys = (uint64_t *)malloc((size_t)(limit + limit / SAMPLE_STEP) * sizeof(uint64_t));
    int rc = 0;
    if (est == NULL || keys == NULL) {
        rc = KV_ERR_NOMEM;
        goto done;
    }
    for (int64_t q = 0; q < g && rc == 0; q++) {
        rc = pq_est(luts + q * m * kk, m, kk, codes, limit, est);
        if (rc == 0) topk_ids(est, limit, k, out + q * kk_out, keys);
    }
done:
    free(est);
    free(keys);
    return rc;
}

/* ---------------------------------------------------------------- DIPR walk */

/* A frontier entry: the Python tuple (-score, id); score as a Python float (a C double). */
typedef struct {
    double neg;
    int64_t id;
} hent;

/* (a.neg, a.id) < (b.neg, b.id) as Python compares tuples: the first unequal item decides. */
static int tuple_lt(const hent *a, const hent *b) {
    if (a->neg == b->neg) return a->id < b->id;
    return a->neg < b->neg;
}

/* heapq._siftdown */
static void py_siftdown(hent *h, int64_t startpos, int64_t pos) {
    hent newitem = h[pos];
    while (pos > startpos) {
        int64_t parentpos = (pos - 1) >> 1;
        if (tuple_lt(&newitem, &h[parentpos])) {
            h[pos] = h[parentpos];
            pos = parentpos;
            continue;
        }
        break;
    }
    h[pos] = newitem;
}

/* heapq._siftup */
static void py_siftup(hent *h, int64_t endpos, int64_t pos) {
    int64_t startpos = pos;
    hent newitem = h[pos];
    int64_t childpos = 2 * pos + 1;
    while (childpos < endpos) {
        int64_t rightpos = childpos + 1;
        if (rightpos < endpos && !tuple_lt(&h[childpos], &h[rightpos])) childpos = rightpos;
        h[pos] = h[childpos];
        pos = childpos;
        childpos = 2 * pos + 1;
    }
    h[pos] = newitem;
    py_siftdown(h, startpos, pos);
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

#define VISITED 1u
#define IN_CAND 2u

/* AlayaDB Algorithm 1 as GraphIndex.dipr's Python walk does it. keys [n, D]; layer-0 adjacency
 * as CSR: the neighbours of u are idx[ptr[u] .. ptr[u+1]) (idx int32, or int64 if idx64);
 * seed in 0..limit-1; floor used if has_floor. out: room for `limit` ids. Returns how many ids
 * it wrote (ascending), or KV_ERR_*. */
KV_API int64_t kv_dipr_walk(const float *keys, int64_t n, int64_t d, const int64_t *ptr,
                            const void *idx, int idx64, int64_t nnz, const float *q, int64_t seed,
                            double beta, int has_floor, double floor, int64_t limit,
                            int64_t capacity, int64_t *out) {
    if (n < 1 || d < 1 || nnz < 0 || limit < 1 || limit > n || seed < 0 || seed >= limit ||
        capacity < 1)
        return KV_ERR_ARG;
    if (capacity > limit) capacity = limit; /* a short prefix never fills a larger list */
    const int32_t *idx32 = (const int32_t *)idx;
    const int64_t *idx64p = (const int64_t *)idx;

    int64_t rc = 0;
    unsigned char *state = (unsigned char *)calloc((size_t)n, 1);
    float *cscore = (float *)malloc((size_t)limit * sizeof(float)); /* scores of out[] */
    int64_t hcap = 256, hsize = 0;
    hent *heap = (hent *)malloc((size_t)hcap * sizeof(hent));
    int64_t bcap = 64;
    int64_t *nb = (int64_t *)malloc((size_t)bcap * sizeof(int64_t));
    float *sc = (float *)malloc((size_t)bcap * sizeof(float));
    if (!state || !cscore || !heap || !nb || !sc) {
        rc = KV_ERR_NOMEM;
        goto done;
    }

    float s0 = dot1(keys + seed * d, q, d);
    double best = (double)s0;
    if (has_floor && floor > best) best = floor; /* Python's max(s0, floor) */
    int64_t ncand = 1;
    out[0] = seed;
    cscore[0] = s0;
    state[seed] = VISITED | IN_CAND;
    heap[0].neg = -(double)s0;
    heap[0].id = seed;
    hsize = 1;

    while (hsize > 0) {
        /* heapq.heappop */
        hent top;
        hent last = heap[--hsize];
        if (hsize > 0) {
            top = heap[0];
            heap[0] = last;
            py_siftup(heap, hsize, 0);
        } else {
            top = last;
        }
        if (ncand >= capacity && -top.neg < best - beta) break;
        int64_t u = top.id;
        int64_t a = ptr[u], b = ptr[u + 1];
        if (a < 0 || b < a || b > nnz) {
            rc = KV_ERR_ADJ;
            goto done;
        }
        if (b - a > bcap) {
            bcap = b - a;
            int64_t *nb2 = (int64_t *)realloc(nb, (size_t)bcap * sizeof(int64_t));
            if (nb2) nb = nb2;
            float *sc2 = (float *)realloc(sc, (size_t)bcap * sizeof(float));
            if (sc2) sc = sc2;
            if (!nb2 || !sc2) {
                rc = KV_ERR_NOMEM;
                goto done;
            }
        }
        /* nb = adj[u][~visited[adj[u]]] (the whole row is checked first) */
        int64_t cnt = 0;
        for (int64_t t = a; t < b; t++) {
            int64_t v = idx64 ? idx64p[t] : (int64_t)idx32[t];
            if (v < 0 || v >= n) {
                rc = KV_ERR_ADJ;
                goto done;
            }
        }
        for (int64_t t = a; t < b; t++) {
            int64_t v = idx64 ? idx64p[t] : (int64_t)idx32[t];
            if (!(state[v] & VISITED)) nb[cnt++] = v;
        }
        if (cnt == 0) continue;
        for (int64_t t = 0; t < cnt; t++) state[nb[t]] |= VISITED;
        dot_rows(keys, d, nb, cnt, q, sc);
        /* best = max(best, float(sc[nb < limit].max())): numpy's max propagates NaN, and
         * Python's max keeps `best` unless the other is greater */
        int any = 0, nan = 0;
        float mx = 0.0f;
        for (int64_t t = 0; t < cnt; t++) {
            if (nb[t] >= limit) continue;
            float x = sc[t];
            if (x != x) nan = 1;
            if (!any || x > mx) mx = x;
            any = 1;
        }
        if (any && !nan && (double)mx > best) best = (double)mx;
        for (int64_t t = 0; t < cnt; t++) {
            int64_t v = nb[t];
            double sv = (double)sc[t];
            if (ncand < capacity || sv >= best - beta) {
                if (hsize == hcap) {
                    hcap *= 2;
                    hent *h2 = (hent *)realloc(heap, (size_t)hcap * sizeof(hent));
                    if (!h2) {
                        rc = KV_ERR_NOMEM;
                        goto done;
                    }
                    heap = h2;
                }
                /* heapq.heappush */
                heap[hsize].neg = -sv;
                heap[hsize].id = v;
                hsize++;
                py_siftdown(heap, 0, hsize - 1);
                if (v < limit && !(state[v] & IN_CAND)) {
                    state[v] |= IN_CAND;
                    out[ncand] = v;
                    cscore[ncand] = sc[t];
                    ncand++;
                }
            }
        }
    }
    {
        double thr = best - beta;
        int64_t kept = 0;
        for (int64_t t = 0; t < ncand; t++)
            if ((double)cscore[t] >= thr) out[kept++] = out[t];
        qsort(out, (size_t)kept, sizeof(int64_t), cmp_i64);
        rc = kept;
    }
done:
    free(state);
    free(cscore);
    free(heap);
    free(nb);
    free(sc);
    return rc;
}

/* ---------------------------------------------------------------- beam search (top-k) */

/* The result heap: Python tuples (score, id), smallest on top (heapq): the same hent and
   sift functions as above, with hent.neg holding +score. */

static int cmp_rank(const void *a, const void *b) { /* score descending, then id ascending */
    const hent *x = (const hent *)a, *y = (const hent *)b;
    if (x->neg != y->neg) return x->neg > y->neg ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static double finite_or_low(float x) { return x != x ? -INFINITY : (double)x; }

/* Best-first beam search over the CSR graph (HNSW's searchLayer on one layer), replaying
 * native.py's _beam_py step for step: `cand` is a heapq of (-score, id), `res` a heapq of
 * (score, id) holding at most ef ids < limit; a NaN score counts as -inf. entries: distinct
 * ids in 0..n-1. out: room for min(k, ef) ids, best first. Returns how many. */
KV_API int64_t kv_graph_search(const float *keys, int64_t n, int64_t d, const int64_t *ptr,
                               const void *idx, int idx64, int64_t nnz, const float *q,
                               const int64_t *entries, int64_t nent, int64_t ef, int64_t limit,
                               int64_t k, int64_t *out) {
    if (n < 1 || d < 1 || nnz < 0 || nent < 1 || ef < 1 || limit < 1 || limit > n || k < 1)
        return KV_ERR_ARG;
    const int32_t *idx32 = (const int32_t *)idx;
    const int64_t *idx64p = (const int64_t *)idx;
    int64_t rc = 0;
    unsigned char *state = (unsigned char *)calloc((size_t)n, 1);
    int64_t ccap = 256, csize = 0, rsize = 0;
    hent *cand = (hent *)malloc((size_t)ccap * sizeof(hent));
    hent *res = (hent *)malloc((size_t)(ef + 1) * sizeof(hent));
    int64_t bcap = nent > 64 ? nent : 64;
    int64_t *nb = (int64_t *)malloc((size_t)bcap * sizeof(int64_t));
    float *sc = (float *)malloc((size_t)bcap * sizeof(float));
    if (!state || !cand || !res || !nb || !sc) {
        rc = KV_ERR_NOMEM;
        goto done;
    }
    for (int64_t t = 0; t < nent; t++) {
        if (entries[t] < 0 || entries[t] >= n || state[entries[t]]) {
            rc = KV_ERR_ID;
            goto done;
        }
        state[entries[t]] = VISITED;
    }
    dot_rows(keys, d, entries, nent, q, sc);
    int64_t cnt = nent;
    memcpy(nb, entries, (size_t)nent * sizeof(int64_t));
    int first = 1;
    for (;;) {
        if (!first) {
            if (csize == 0) break;
            hent top; /* heapq.heappop(cand) */
            hent last = cand[--csize];
            if (csize > 0) {
                top = cand[0];
                cand[0] = last;
                py_siftup(cand, csize, 0);
            } else {
                top = last;
            }
            if (rsize >= ef && -top.neg < res[0].neg) break;
            int64_t u = top.id;
            int64_t a = ptr[u], b = ptr[u + 1];
            if (a < 0 || b < a || b > nnz) {
                rc = KV_ERR_ADJ;
                goto done;
            }
            if (b - a > bcap) {
                bcap = b - a;
                int64_t *nb2 = (int64_t *)realloc(nb, (size_t)bcap * sizeof(int64_t));
                if (nb2) nb = nb2;
                float *sc2 = (float *)realloc(sc, (size_t)bcap * sizeof(float));
                if (sc2) sc = sc2;
                if (!nb2 || !sc2) {
                    rc = KV_ERR_NOMEM;
                    goto done;
                }
            }
            for (int64_t t = a; t < b; t++) {
                int64_t v = idx64 ? idx64p[t] : (int64_t)idx32[t];
                if (v < 0 || v >= n) {
                    rc = KV_ERR_ADJ;
                    goto done;
                }
            }
            cnt = 0; /* unvisited neighbours, a repeated link once */
            for (int64_t t = a; t < b; t++) {
                int64_t v = idx64 ? idx64p[t] : (int64_t)idx32[t];
                if (!(state[v] & VISITED)) {
                    state[v] |= VISITED;
                    nb[cnt++] = v;
                }
            }
            if (cnt == 0) continue;
            dot_rows(keys, d, nb, cnt, q, sc);
        }
        for (int64_t t = 0; t < cnt; t++) {
            int64_t v = nb[t];
            double sv = finite_or_low(sc[t]);
            if (!first && !(rsize < ef || sv > res[0].neg)) continue;
            if (csize == ccap) {
                ccap *= 2;
                hent *c2 = (hent *)realloc(cand, (size_t)ccap * sizeof(hent));
                if (!c2) {
                    rc = KV_ERR_NOMEM;
                    goto done;
                }
                cand = c2;
            }
            cand[csize].neg = -sv;
            cand[csize].id = v;
            csize++;
            py_siftdown(cand, 0, csize - 1);
            if (v < limit) {
                res[rsize].neg = sv;
                res[rsize].id = v;
                rsize++;
                py_siftdown(res, 0, rsize - 1);
                if (rsize > ef) { /* heapq.heappop(res) */
                    hent last = res[--rsize];
                    res[0] = last;
                    py_siftup(res, rsize, 0);
                }
            }
        }
        first = 0;
    }
    qsort(res, (size_t)rsize, sizeof(hent), cmp_rank);
    rc = rsize < k ? rsize : k;
    for (int64_t t = 0; t < rc; t++) out[t] = res[t].id;
done:
    free(state);
    free(cand);
    free(res);
    free(nb);
    free(sc);
    return rc;
}

#ifdef KVINDEX_PYMODULE
/* An importable (empty) module, so the package build can build this file as an extension;
 * the functions above are reached through ctypes. */
static struct PyModuleDef kvindex_module = {PyModuleDef_HEAD_INIT, "_kvindex",
                                            "kvstore index kernels (used through ctypes)", -1,
                                            NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kvindex(void) { return PyModule_Create(&kvindex_module); }
#endif
