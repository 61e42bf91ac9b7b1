/* The store's gather copy (called through ctypes from src/kvstore/copying.py).
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

#if defined(_WIN32)
#define KV_API __declspec(dllexport)
#else
#define KV_API __attribute__((visibility("default")))
#endif

#define KVCOPY_ABI_VERSION 1

KV_API int64_t kvcopy_abi_version(void) { return KVCOPY_ABI_VERSION; }

/* For layers lo..hi-1, for each piece i: tokens [0, use[i]) of extent ext[i] (ext_tokens[i]
 * tokens) go to output tokens [start[i], start[i] + use[i]) of k_out and v_out, [L, H, T, row]
 * bytes. Destination order: each (layer, head) row of the output is written front to back. */
KV_API int kvcopy_gather(char *k_out, char *v_out, int64_t n_heads, int64_t n_tokens,
                         int64_t row_bytes, int64_t n, char *const *ext,
                         const int64_t *ext_tokens, const int64_t *start, const int64_t *use,
                         int64_t lo, int64_t hi) {
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
                    memcpy(dst_row + start[i] * row_bytes, src, (size_t)(use[i] * row_bytes));
                }
            }
        }
    }
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
