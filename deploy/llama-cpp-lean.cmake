# Passed to llama-cpp-python's build as CMAKE_PROJECT_INCLUDE (README, .ci/run): CMake runs this after every
# project() call, so the last run comes after llama-cpp-python has forced LLAMA_BUILD_COMMON on and before
# llama.cpp reads it. The Python binding loads only libllama and libggml; llama.cpp's common library (argument
# parsing, chat templates, JSON: about half the compile time) is not needed by it or by us.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp's common library: not used by the Python binding" FORCE)
