# Included right after ggml's project() call (see llama_cpp_minimal.cmake): ggml's kernels are
# where llama.cpp spends its time, so they keep the release optimization level.
string(REPLACE "-O1" "-O3" CMAKE_C_FLAGS_RELEASE "${CMAKE_C_FLAGS_RELEASE}")
string(REPLACE "-O1" "-O3" CMAKE_CXX_FLAGS_RELEASE "${CMAKE_CXX_FLAGS_RELEASE}")
