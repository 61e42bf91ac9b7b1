# Included by llama.cpp's CMakeLists right after its project() call when llama-cpp-python is
# built by the Makefile (CMAKE_PROJECT_llama.cpp_INCLUDE). llama-cpp-python forces
# LLAMA_BUILD_COMMON on, but its Python bindings load only libllama and libggml; a directory
# variable set here shadows that cache entry, so the common library (about 60 of the build's
# 140 compile steps) is not built.
set(LLAMA_BUILD_COMMON OFF)
