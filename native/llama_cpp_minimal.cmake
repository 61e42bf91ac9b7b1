# Included by llama.cpp's CMakeLists right after its project() call when the Makefile builds
# llama-cpp-python (CMAKE_PROJECT_llama.cpp_INCLUDE); it only shortens the build.
#
# llama-cpp-python forces LLAMA_BUILD_COMMON on, but its Python bindings load only libllama
# and libggml: a directory variable set here shadows that cache entry, so the common library
# (about 60 of the build's 140 compile steps) is not built.
set(LLAMA_BUILD_COMMON OFF)
# libllama (model loading, graph building, vocabulary, sampling) spends little of the run
# time; -O1 halves its compile time (measured: 448 -> 246 CPU-seconds of compiling). ggml, where
# the time goes, keeps -O3: llama_cpp_ggml.cmake restores it after ggml's project() call.
string(REPLACE "-O3" "-O1" CMAKE_C_FLAGS_RELEASE "${CMAKE_C_FLAGS_RELEASE}")
string(REPLACE "-O3" "-O1" CMAKE_CXX_FLAGS_RELEASE "${CMAKE_CXX_FLAGS_RELEASE}")
set(CMAKE_PROJECT_ggml_INCLUDE "${CMAKE_CURRENT_LIST_DIR}/llama_cpp_ggml.cmake")
