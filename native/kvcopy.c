/* The store's gather copy (called through ctypes from src/kvstore/pipelines/gather.py).
 *
 * A get copies the KV of its chunks out of their extents (each [L, 2 (K/V), H, n, D], one
 * chunk's tokens per extent) into the caller's keys and values [L, H, T, D]. In numpy that is
 * one strided copy per (chunk, K/V) pair; here it is one call per layer range, with no per-piece
 * interpreter work, so two threads (each a layer range; ctypes releases the GIL) copy at memory
 * speed. The numpy fallback in copying.py gives the same bytes.
 *
 * Built by setup.py as the extension module kvstore._kvcopy (KVCOPY_PYMODULE adds the module
 * init so the file is a valid Python extension); copying.py opens that file with ctypes.
 * Every pointer and size is checked by copying.py before the call; the kernel trusts them.
 */

#ifdef KVCOPY_PYMODULE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KV_HAVE_STREAM 1
#endif

#if defined(_WIN32)
#define KV_API __declspec(dllexport)
#else
#define KV_API __attribute__((visibility("default")))
#endif

#define KVCOPY_ABI_VERSION 2

KV_API int64_t kvcopy_abi_version(void) { return KVCOPY_ABI_VERSION; }

/* memcpy with non-temporal (streaming) stores: the destination lines are not read first and
 * do not fill the cache. For a large gather (more than the caches hold) this measured 25 GB/s
 * on two cores here against 17.5 for memcpy. The caller issues the fence. */
static void copy_stream(char *dst, const char *src, size_t n) {
#ifdef KV_HAVE_STREAM
    size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* For layers lo..hi-1, for each piece i: tokens [0, use[i]) of extent ext[i] (ext_tokens[i]
 * tokens) go to output tokens [start[i], start[i] + use[i]) of k_out and v_out, [L, H, T, row]
 * bytes. Destination order: each (layer, head) row of the output is written front to back.
 * With ``stream``, with non-temporal stores (for outputs larger than the caches). */
KV_API int kvcopy_gather(char *k_out, char *v_out, int64_t n_heads, int64_t n_tokens,
                         int64_t row_bytes, int64_t n, char *const *ext,
                         const int64_t *ext_tokens, const int64_t *start, const int64_t *use,
                         int64_t lo, int64_t hi, int stream) {
    const int64_t out_row = n_tokens * row_bytes;  /* one (layer, head) of the output */
    for (int64_t l = lo; l < hi; l++) {
        for (int64_t kv = 0; kv < 2; kv++) {
            char *out = kv ? v_out : k_out;
            for (int64_t h = 0; h < n_heads; h++) {
                char *dst_row = out + (l * n_heads + h) * out_row;
                for (int64_t i = 0; i < n; i++) {
                    const int64_t ext_row = ext_tokens[i] * row_bytes;
                    /* extent: [L, 2, H, n_i, row] */
                    const char *src = ext[i] + ((l * 2 + kv) * n_heads + h) * ext_row;
                    if (stream)
                        copy_stream(dst_row + start[i] * row_bytes, src,
                                    (size_t)(use[i] * row_bytes));
                    else
                        memcpy(dst_row + start[i] * row_bytes, src, (size_t)(use[i] * row_bytes));
                }
            }
        }
    }
#ifdef KV_HAVE_STREAM
    if (stream) _mm_sfence(); /* the streamed bytes are visible before the caller goes on */
#endif
    return 0;
}

#ifdef KVCOPY_PYMODULE
/* An importable (empty) module, so the package build can build this file as an extension;
 * the function above is reached through ctypes. */
static struct PyModuleDef kvcopy_module = {PyModuleDef_HEAD_INIT, "_kvcopy",
                                           "kvstore gather copy (used through ctypes)", -1,
                                           NULL, NULL, NULL, NULL, NULL};
PyMODINIT_FUNC PyInit__kvcopy(void) { return PyModule_Create(&kvcopy_module); }
#endif
