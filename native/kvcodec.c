/* Decoders of the store's lossy KV codecs, and the int8 encoder (called through ctypes from
 * src/kvstore/codecs/native_decoders.py).
 *
 * One call decodes one (chunk, layer): the encoded data (int8 / e4m3 bytes, or packed int4
 * nibbles) times its float32 scales, rounded to the layout dtype (float16, bfloat16 or float32,
 * round to nearest even) and written as the layer's raw bytes [2 (K/V), H, n, D]
 * (kvcodec_decode), or its first ``use`` tokens straight into keys and values [L, H, T, D] at a
 * token offset (kvcodec_decode_into; the same row decoders, another destination). The numpy /
 * torch decoders in src/kvstore/codecs/layer_codec.py compute the same float32 product (one IEEE multiply,
 * no FMA: built with -ffp-contract=off) and round it the same way, so the bytes are identical;
 * tests/kvstore/test_codec_native.py checks that.
 *
 * Built by setup.py as the extension module kvstore._kvcodec (KVCODEC_PYMODULE adds the module
 * init so the file is a valid Python extension). Every pointer and size is checked by
 * codec_native.py before the call (each layer's encoded length against the shape, its offset
 * inside the data, the output's size, the token range); the kernels trust those. What the encoded bytes hold is
 * checked here as the numpy decoders check it: scales finite and >= 0, no e4m3 NaN.
 * The kernels hold no state: any number of threads may call them at once.
 */

#ifdef KVCODEC_PYMODULE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_HAVE_F16C 1
#endif

#if defined(_WIN32)
#define KV_API __declspec(dllexport)
#else
#define KV_API __attribute__((visibility("default")))
#endif

#define KVCODEC_ABI_VERSION 5
#define ROW 64 /* floats computed before each conversion to the output dtype */
#define KVCODEC_BAD_SCALE 1 /* a scale is negative or not finite */
#define KVCODEC_NAN 2       /* an e4m3 code is a NaN */

enum { OUT_F16 = 0, OUT_BF16 = 1, OUT_F32 = 2 };

KV_API int64_t kvcodec_abi_version(void) { return KVCODEC_ABI_VERSION; }

static inline uint32_t f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> float16 bits, round to nearest even, overflow to inf (F. Giesen's
 * float_to_half_fast3_rtne; the subnormal case rounds through one float addition, which the
 * default rounding mode makes round-to-nearest-even). */
static inline uint16_t f2h(float f) {
    const uint32_t f32infty = 255u << 23, f16max = (127u + 16u) << 23;
    const float denorm_magic = bits_f(((127u - 15u) + (23u - 10u) + 1u) << 23);
    uint32_t x = f_bits(f);
    const uint32_t sign = x & 0x80000000u;
    uint16_t o;
    x ^= sign;
    if (x >= f16max) {
        o = x > f32infty ? 0x7e00 : 0x7c00;
    } else if (x < (113u << 23)) {
        o = (uint16_t)(f_bits(bits_f(x) + denorm_magic) - f_bits(denorm_magic));
    } else {
        const uint32_t mant_odd = (x >> 13) & 1u;
        x += ((uint32_t)(15 - 127) << 23) + 0xfffu;
        x += mant_odd;
        o = (uint16_t)(x >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

/* float32 -> bfloat16 bits, round to nearest even (no NaN reaches here: the products of
 * finite codes and finite scales are finite or infinite). */
static inline uint16_t f2bf(float f) {
    const uint32_t u = f_bits(f);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void put_generic(const float *x, int64_t count, int dtype, uint8_t *dst) {
    if (dtype == OUT_F32) {
        memcpy(dst, x, (size_t)count * 4);
    } else if (dtype == OUT_BF16) {
        for (int64_t i = 0; i < count; i++) {
            const uint16_t b = f2bf(x[i]);
            memcpy(dst + 2 * i, &b, 2);
        }
    } else {
        for (int64_t i = 0; i < count; i++) {
            const uint16_t b = f2h(x[i]);
            memcpy(dst + 2 * i, &b, 2);
        }
    }
}

#ifdef KV_HAVE_F16C
__attribute__((target("avx2,f16c")))
static void put_f16c(const float *x, int64_t count, int dtype, uint8_t *dst) {
    if (dtype != OUT_F16) {
        put_generic(x, count, dtype, dst);
        return;
    }
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(dst + 2 * i), h);
    }
    for (; i < count; i++) {
        const uint16_t b = f2h(x[i]);
        memcpy(dst + 2 * i, &b, 2);
    }
}
#endif

typedef void (*put_fn)(const float *, int64_t, int, uint8_t *);

static put_fn pick_put(int simd) {
#ifdef KV_HAVE_F16C
    if (simd && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2"))
        return put_f16c;
#endif
    (void)simd;
    return put_generic;
}

/* ------------------------------------------------------------------ rows
 * One output row segment of m elements: code value x scale (per element ``sc[c]``, or ``s1``
 * for all when ``sc`` is NULL), rounded to ``dtype``. Codes are int8 (``table`` NULL) or e4m3
 * bytes through ``table``. */
static void row_generic(const uint8_t *q, const float *table, const float *sc, float s1,
                        int64_t m, int dtype, uint8_t *dst) {
    float row[ROW];
    for (int64_t c0 = 0; c0 < m; c0 += ROW) {
        const int64_t k = m - c0 < ROW ? m - c0 : ROW;
        for (int64_t c = 0; c < k; c++) {
            const float x = table ? table[q[c0 + c]] : (float)(int8_t)q[c0 + c];
            row[c] = x * (sc ? sc[c0 + c] : s1);
        }
        put_generic(row, k, dtype, dst + c0 * (dtype == OUT_F32 ? 4 : 2));
    }
}

#ifdef KV_HAVE_F16C
__attribute__((target("avx2,f16c"), always_inline))
static inline void store8(__m256 y, int dtype, uint8_t *dst) {
    if (dtype == OUT_F16) {
        _mm_storeu_si128((__m128i *)dst,
                         _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (dtype == OUT_F32) {
        _mm256_storeu_ps((float *)dst, y);
    } else { /* bfloat16: (u + 0x7fff + ((u >> 16) & 1)) >> 16, as f2bf */
        const __m256i u = _mm256_castps_si256(y);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(p));
    }
}

__attribute__((target("avx2,f16c"), always_inline))
static inline void row_avx2_of(const uint8_t *q, const float *table, const float *sc, float s1,
                               int64_t m, int dtype, uint8_t *dst) {
    const int64_t esize = dtype == OUT_F32 ? 4 : 2;
    const __m256 vs1 = _mm256_set1_ps(s1);
    int64_t c = 0;
    for (; c + 8 <= m; c += 8) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(q + c));
        const __m256 x = table ? _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(b), 4)
                               : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        const __m256 y = _mm256_mul_ps(x, sc ? _mm256_loadu_ps(sc + c) : vs1);
        store8(y, dtype, dst + c * esize);
    }
    if (c < m) row_generic(q + c, table, sc ? sc + c : NULL, s1, m - c, dtype, dst + c * esize);
}

/* row_avx2_of with ``dtype`` a constant in each call, so the compiler drops the dtype branch
 * of store8 from the loop (measured: int8 into float16 ~8 -> ~10.5 GB/s here). */
__attribute__((target("avx2,f16c")))
static void row_avx2(const uint8_t *q, const float *table, const float *sc, float s1,
                     int64_t m, int dtype, uint8_t *dst) {
    if (dtype == OUT_F16)
        row_avx2_of(q, table, sc, s1, m, OUT_F16, dst);
    else if (dtype == OUT_BF16)
        row_avx2_of(q, table, sc, s1, m, OUT_BF16, dst);
    else
        row_avx2_of(q, table, sc, s1, m, OUT_F32, dst);
}
#endif

#ifdef KV_HAVE_F16C
/* The same rows, 16 values per step (AVX-512F/BW). Same products, same rounding: vcvtps2ph
 * rounds to nearest even as F16C does, and the bfloat16 rounding is the same integer sum. */
__attribute__((target("avx512f,avx512bw"), always_inline))
static inline void store16(__m512 y, int dtype, uint8_t *dst) {
    if (dtype == OUT_F16) {
        _mm256_storeu_si256((__m256i *)dst,
                            _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (dtype == OUT_F32) {
        _mm512_storeu_ps((float *)dst, y);
    } else { /* bfloat16: (u + 0x7fff + ((u >> 16) & 1)) >> 16, as f2bf */
        const __m512i u = _mm512_castps_si512(y);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
        _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(r));
    }
}

__attribute__((target("avx512f,avx512bw"), always_inline))
static inline void row_avx512_of(const uint8_t *q, const float *table, const float *sc, float s1,
                                 int64_t m, int dtype, uint8_t *dst) {
    const int64_t esize = dtype == OUT_F32 ? 4 : 2;
    const __m512 vs1 = _mm512_set1_ps(s1);
    int64_t c = 0;
    for (; c + 16 <= m; c += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + c));
        const __m512 x = table ? _mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), table, 4)
                               : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        const __m512 y = _mm512_mul_ps(x, sc ? _mm512_loadu_ps(sc + c) : vs1);
        store16(y, dtype, dst + c * esize);
    }
    if (c < m) row_generic(q + c, table, sc ? sc + c : NULL, s1, m - c, dtype, dst + c * esize);
}

__attribute__((target("avx512f,avx512bw")))
static void row_avx512(const uint8_t *q, const float *table, const float *sc, float s1,
                       int64_t m, int dtype, uint8_t *dst) {
    if (dtype == OUT_F16)
        row_avx512_of(q, table, sc, s1, m, OUT_F16, dst);
    else if (dtype == OUT_BF16)
        row_avx512_of(q, table, sc, s1, m, OUT_BF16, dst);
    else
        row_avx512_of(q, table, sc, s1, m, OUT_F32, dst);
}
#endif

typedef void (*row_fn)(const uint8_t *, const float *, const float *, float, int64_t, int,
                       uint8_t *);

/* ``simd``: 0 portable C; 1 at most F16C/AVX2; 2 the widest the CPU has (AVX-512F/BW). */
static row_fn pick_row(int simd) {
#ifdef KV_HAVE_F16C
    if (simd >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return row_avx512;
    if (simd >= 1 && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2"))
        return row_avx2;
#endif
    (void)simd;
    return row_generic;
}

/* Whether any of the ``n`` e4m3 codes at ``p`` is a NaN (0x7f or 0xff). */
static int any_nan_generic(const uint8_t *p, int64_t n) {
    int nan = 0;
    for (int64_t i = 0; i < n; i++) nan |= (p[i] & 0x7f) == 0x7f;
    return nan;
}

#ifdef KV_HAVE_F16C
__attribute__((target("avx2,f16c")))
static int any_nan_avx2(const uint8_t *p, int64_t n) {
    const __m256i m = _mm256_set1_epi8(0x7f);
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i x = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i)), m);
        acc = _mm256_or_si256(acc, _mm256_cmpeq_epi8(x, m));
    }
    return (_mm256_movemask_epi8(acc) != 0) | any_nan_generic(p + i, n - i);
}
#endif

typedef int (*nan_fn)(const uint8_t *, int64_t);

/* Copy ``count`` little-endian float32 scales from ``src`` (any alignment) to ``dst``; 0 if
 * every one is finite and >= 0. */
static int load_scales(float *dst, const uint8_t *src, int64_t count) {
    memcpy(dst, src, (size_t)count * 4);
    int bad = 0;
    for (int64_t i = 0; i < count; i++) bad |= !(dst[i] >= 0.0f && dst[i] <= FLT_MAX);
    return bad;
}

static inline float nibble(const uint8_t *packed, int64_t i) {
    return (float)((packed[i >> 1] >> ((i & 1) * 4)) & 15) - 8.0f;
}

/* ------------------------------------------------------------------ layers
 * Where one layer's decoded rows go: K row (head hh, token t) of D elements at
 * ``k + ((hh * tokens + start + t) * D) * esize``, V likewise at ``v``; only tokens t < use
 * are written. A whole layer [2, H, n, D] is k = out, v = out + H * n * D * esize,
 * tokens = n, start = 0, use = n; keys and values [L, H, T, D] at a token offset are the
 * layer's [H, T, D] bases, tokens = T. */
typedef struct {
    uint8_t *k, *v;
    int64_t tokens, start, use;
} dest;

static inline uint8_t *dest_row(const dest *o, int kv, int64_t hh, int64_t t, int64_t d,
                                int64_t esize) {
    return (kv ? o->v : o->k) + ((hh * o->tokens + o->start + t) * d) * esize;
}

/* int8 / fp8 layer: data = qk [H, n, D] codes, qv [H, n, D], sk [H, D] float32, sv [H, n].
 * Every scale and (fp8) every code is checked, also those of tokens not written. */
static int dec_scaled(const uint8_t *data, int64_t h, int64_t n, int64_t d, const float *table,
                      int dtype, const dest *o, row_fn row, nan_fn any_nan, float *scales) {
    const int64_t esize = dtype == OUT_F32 ? 4 : 2, hnd = h * n * d;
    const uint8_t *qk = data, *qv = data + hnd;
    float *sk = scales, *sv = scales + h * d;
    if (load_scales(scales, data + 2 * hnd, h * d + h * n)) return KVCODEC_BAD_SCALE;
    if (table && any_nan(data, 2 * hnd)) return KVCODEC_NAN;
    for (int64_t hh = 0; hh < h; hh++)
        for (int64_t t = 0; t < o->use; t++) {
            const int64_t r = (hh * n + t) * d;
            row(qk + r, table, sk + hh * d, 0.0f, d, dtype, dest_row(o, 0, hh, t, d, esize));
            row(qv + r, table, NULL, sv[hh * n + t], d, dtype, dest_row(o, 1, hh, t, d, esize));
        }
    return 0;
}

/* int4 layer: data = packed codes (two per byte, low nibble first, each code + 8): K
 * [H, groups * 32, D] then V [H, n, D]; then sk [H, groups, D] float32 (per channel, per group
 * of 32 tokens) and sv [H, n, D / g] (per token, per group of g channels). Every scale is
 * checked, also those of tokens not written. */
static int dec_int4(const uint8_t *data, int64_t h, int64_t n, int64_t d, int64_t groups,
                    int64_t g, int dtype, const dest *o, int simd, float *scales) {
    const put_fn put = pick_put(simd);
    const int64_t esize = dtype == OUT_F32 ? 4 : 2, hnd = h * n * d;
    const int64_t nk = h * groups * 32 * d, nsk = h * groups * d;
    float *sk = scales, *sv = scales + nsk;
    if (load_scales(scales, data + (nk + hnd + 1) / 2, nsk + h * n * (d / g)))
        return KVCODEC_BAD_SCALE;
    float row[ROW];
    for (int kv = 0; kv < 2; kv++)
        for (int64_t hh = 0; hh < h; hh++)
            for (int64_t t = 0; t < o->use; t++) {
                const int64_t base = kv ? nk + (hh * n + t) * d : (hh * groups * 32 + t) * d;
                uint8_t *dst = dest_row(o, kv, hh, t, d, esize);
                for (int64_t c0 = 0; c0 < d; c0 += ROW) {
                    const int64_t m = d - c0 < ROW ? d - c0 : ROW;
                    if (kv == 0) {
                        const float *s = sk + (hh * groups + t / 32) * d + c0;
                        for (int64_t c = 0; c < m; c++) row[c] = nibble(data, base + c0 + c) * s[c];
                    } else {
                        const float *s = sv + (hh * n + t) * (d / g);
                        for (int64_t c = 0; c < m; c++)
                            row[c] = nibble(data, base + c0 + c) * s[(c0 + c) / g];
                    }
                    put(row, m, dtype, dst + c0 * esize);
                }
            }
    return 0;
}

/* Decode ``n_layers`` layers of one chunk: layer l's encoded bytes start at
 * ``data + offsets[l]`` (each exactly the codec's encoded size, checked by the caller); its
 * rows go to ``o`` with both bases moved by ``l * layer_stride`` bytes. Returns as
 * kvcodec_decode. */
static int64_t decode_chunk(int codec, const uint8_t *data, const int64_t *offsets,
                            int64_t n_layers, int64_t h, int64_t n, int64_t d, int64_t groups,
                            int64_t g, const float *table, int dtype, dest o,
                            int64_t layer_stride, int simd) {
    const int64_t nscales = codec == 4 ? h * groups * d + h * n * (d / g) : h * d + h * n;
    float *scales = malloc((size_t)nscales * sizeof(float) + 1);
    if (!scales) return -1;
    const row_fn row = pick_row(simd);
    nan_fn any_nan = any_nan_generic;
#ifdef KV_HAVE_F16C
    if (row == row_avx2 || row == row_avx512) any_nan = any_nan_avx2;
#endif
    int64_t rc = 0;
    for (int64_t l = 0; l < n_layers && rc == 0; l++) {
        const uint8_t *src = data + offsets[l];
        const int err = codec == 4 ? dec_int4(src, h, n, d, groups, g, dtype, &o, simd, scales)
                                   : dec_scaled(src, h, n, d, codec == 3 ? table : NULL, dtype,
                                                &o, row, any_nan, scales);
        if (err) rc = l * 4 + err;
        o.k += layer_stride;
        o.v += layer_stride;
    }
    free(scales);
    return rc;
}

/* Decode ``n_layers`` layers of one chunk: layer l's encoded bytes start at
 * ``data + offsets[l]`` (each exactly the codec's encoded size, checked by the caller) and its
 * raw bytes [2 (K/V), H, n, D] go to ``out + l * out_stride``. ``codec``: 2 int8, 3 fp8
 * (``table``: the 256 e4m3 values), 4 int4 (``groups``, ``g``). Returns 0, or
 * layer * 4 + KVCODEC_BAD_SCALE / KVCODEC_NAN for the first layer that does not decode (its
 * output is then partly written), or -1 if out of memory. */
KV_API int64_t kvcodec_decode(int codec, const uint8_t *data, const int64_t *offsets,
                              int64_t n_layers, int64_t h, int64_t n, int64_t d, int64_t groups,
                              int64_t g, const float *table, int dtype, uint8_t *out,
                              int64_t out_stride, int simd) {
    const int64_t esize = dtype == OUT_F32 ? 4 : 2;
    const dest o = {out, out + h * n * d * esize, n, 0, n};
    return decode_chunk(codec, data, offsets, n_layers, h, n, d, groups, g, table, dtype, o,
                        out_stride, simd);
}

/* The same decode straight into keys and values: ``k_out`` and ``v_out`` [n_layers, H, T, D]
 * (C order, elements of ``dtype``); token t < use of layer l, head hh goes to output token
 * start + t (the caller checks 0 < use <= n and start + use <= T). Every scale and fp8 code
 * of the chunk is still checked, so the errors are kvcodec_decode's. */
KV_API int64_t kvcodec_decode_into(int codec, const uint8_t *data, const int64_t *offsets,
                                   int64_t n_layers, int64_t h, int64_t n, int64_t d,
                                   int64_t groups, int64_t g, const float *table, int dtype,
                                   uint8_t *k_out, uint8_t *v_out, int64_t tokens, int64_t start,
                                   int64_t use, int simd) {
    const int64_t esize = dtype == OUT_F32 ? 4 : 2;
    const dest o = {k_out, v_out, tokens, start, use};
    return decode_chunk(codec, data, offsets, n_layers, h, n, d, groups, g, table, dtype, o,
                        h * tokens * d * esize, simd);
}

/* ------------------------------------------------------------------ int8 encode
 * float16 / bfloat16 bits -> float32 (exact). */
static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return bits_f(sign | 0x7f800000u | (m << 13));
    if (e) return bits_f(sign | ((e + 112u) << 23) | (m << 13));
    const float f = (float)m * 5.9604644775390625e-08f; /* m * 2^-24, exact */
    return sign ? -f : f;
}

static void get_generic(const uint8_t *src, int64_t count, int dtype, float *x) {
    for (int64_t i = 0; i < count; i++) {
        uint16_t b;
        if (dtype == OUT_F32) {
            memcpy(&x[i], src + 4 * i, 4);
            continue;
        }
        memcpy(&b, src + 2 * i, 2);
        x[i] = dtype == OUT_BF16 ? bits_f((uint32_t)b << 16) : h2f(b);
    }
}

#ifdef KV_HAVE_F16C
__attribute__((target("avx2,f16c")))
static void get_f16c(const uint8_t *src, int64_t count, int dtype, float *x) {
    if (dtype != OUT_F16) {
        get_generic(src, count, dtype, x);
        return;
    }
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
    get_generic(src + 2 * i, count - i, dtype, x + i);
}
#endif

static inline int8_t quant(float x, float div) {
    float q = rintf(x / div); /* round half to even, as torch.round */
    q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
    return (int8_t)q;
}

/* q[c] = quant(x[c], div ? div[c] : div1) for c < m. */
static void quant_generic(const float *x, const float *div, float div1, int64_t m, int8_t *q) {
    for (int64_t c = 0; c < m; c++) q[c] = quant(x[c], div ? div[c] : div1);
}

#ifdef KV_HAVE_F16C
__attribute__((target("avx2,f16c")))
static void quant_avx2(const float *x, const float *div, float div1, int64_t m, int8_t *q) {
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256 d1 = _mm256_set1_ps(div1);
    int64_t c = 0;
    for (; c + 8 <= m; c += 8) {
        const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + c), div ? _mm256_loadu_ps(div + c) : d1);
        const __m256 r = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        int32_t t[8];
        _mm256_storeu_si256((__m256i *)t, _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)));
        for (int k = 0; k < 8; k++) q[c + k] = (int8_t)t[k];
    }
    quant_generic(x + c, div ? div + c : NULL, div1, m - c, q + c);
}
#endif

/* int8 encode of one layer: ``raw`` [2 (K/V), H, n, D] elements of ``dtype``; ``out``: qk
 * [H, n, D] int8, qv [H, n, D], sk [H, D] float32 (per channel: max |k| over the tokens / 127),
 * sv [H, n] float32 (per token: max |v| over the channels / 127), little-endian, as
 * codecs._enc_scaled writes them. Returns 0, 1 if a value is not finite (nothing useful is
 * written then), -1 if out of memory. */
KV_API int kvcodec_encode_int8(const uint8_t *raw, int64_t h, int64_t n, int64_t d, int dtype,
                               uint8_t *out, int simd) {
    const int64_t hnd = h * n * d;
    float *x = malloc((size_t)(2 * hnd + h * d) * sizeof(float));
    if (!x) return -1;
    float *amax = x + 2 * hnd;
    void (*qrow)(const float *, const float *, float, int64_t, int8_t *) = quant_generic;
#ifdef KV_HAVE_F16C
    if (simd && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2")) {
        get_f16c(raw, 2 * hnd, dtype, x);
        qrow = quant_avx2;
    } else
#endif
        get_generic(raw, 2 * hnd, dtype, x);
    int bad = 0;
    for (int64_t i = 0; i < 2 * hnd; i++) bad |= !(fabsf(x[i]) <= FLT_MAX);
    if (bad) {
        free(x);
        return 1;
    }
    int8_t *qk = (int8_t *)out, *qv = (int8_t *)out + hnd;
    uint8_t *sk = out + 2 * hnd, *sv = sk + 4 * h * d;
    for (int64_t hh = 0; hh < h; hh++) { /* K: a scale per channel */
        float *a = amax + hh * d;
        for (int64_t c = 0; c < d; c++) a[c] = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            const float *row = x + (hh * n + t) * d;
            for (int64_t c = 0; c < d; c++) a[c] = fabsf(row[c]) > a[c] ? fabsf(row[c]) : a[c];
        }
        for (int64_t c = 0; c < d; c++) {
            const float sc = a[c] / 127.0f;
            memcpy(sk + 4 * (hh * d + c), &sc, 4);
            a[c] = sc > 0.0f ? sc : 1.0f; /* the divisor */
        }
        for (int64_t t = 0; t < n; t++) {
            const int64_t r = (hh * n + t) * d;
            qrow(x + r, a, 0.0f, d, qk + r);
        }
    }
    for (int64_t hh = 0; hh < h; hh++) /* V: a scale per token */
        for (int64_t t = 0; t < n; t++) {
            const int64_t r = (hh * n + t) * d;
            const float *row = x + hnd + r;
            float m = 0.0f;
            for (int64_t c = 0; c < d; c++) m = fabsf(row[c]) > m ? fabsf(row[c]) : m;
            const float sc = m / 127.0f, div = sc > 0.0f ? sc : 1.0f;
            memcpy(sv + 4 * (hh * n + t), &sc, 4);
            qrow(row, NULL, div, d, qv + r);
        }
    free(x);
    return 0;
}

#ifdef KVCODEC_PYMODULE
static struct PyModuleDef kvcodec_module = {PyModuleDef_HEAD_INIT, "_kvcodec",
                                            "KV codec decoders (used through ctypes)", -1, NULL};
PyMODINIT_FUNC PyInit__kvcodec(void) { return PyModule_Create(&kvcodec_module); }
#endif
