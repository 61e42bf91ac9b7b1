"""The optional C extensions; everything else is in pyproject.toml.

native/kvindex.c becomes kvstore.index._kvindex (opened with ctypes by kvstore.index.native),
native/kvcopy.c becomes kvstore._kvcopy (opened with ctypes by kvstore.pipelines.gather),
native/kvcodec.c becomes kvstore._kvcodec (opened with ctypes by kvstore.codecs.native_decoders).
``optional=True``: without a C compiler (or Python headers) the build warns and the package
installs anyway, using the numpy fallbacks. -ffp-contract=off and no -ffast-math keep the
float32 sums in the order the fallbacks use (bit-identical results).
"""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-std=c99", "-O2", "-ffp-contract=off",
                                            "-fno-fast-math"]

setup(ext_modules=[Extension("kvstore.index._kvindex", sources=["native/kvindex.c"],
                             define_macros=[("KVINDEX_PYMODULE", "1")],
                             extra_compile_args=flags, optional=True),
                   Extension("kvstore._kvcopy", sources=["native/kvcopy.c"],
                             define_macros=[("KVCOPY_PYMODULE", "1")],
                             extra_compile_args=flags, optional=True),
                   Extension("kvstore._kvcodec", sources=["native/kvcodec.c"],
                             define_macros=[("KVCODEC_PYMODULE", "1")],
                             libraries=[] if sys.platform == "win32" else ["m"],
                             extra_compile_args=flags, optional=True)])
