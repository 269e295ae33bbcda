# The CUDA backend (src/kernels/cuda) and the NCCL communicator, built with -DMOE_CUDA=ON.
# Only the CUDA runtime is linked (never libcuda: a CUDA-enabled moecore starts, and passes every
# cpu test, on a machine without a GPU driver); cuBLASLt, NCCL and cuDNN are loaded at run time. Header-only CUTLASS and cuDNN frontend come from
# the pinned wheels that scripts/cuda_headers.sh unpacks into .cache/cuda-headers.
enable_language(CUDA)
# "-isystem DIR" rather than nvcc's default "-isystem=DIR": ccache makes the first relative to
# CCACHE_BASEDIR, not the second, and the CUTLASS headers live in the clone (.ci/run's cache).
set(CMAKE_INCLUDE_SYSTEM_FLAG_CUDA "-isystem ")
find_package(CUDAToolkit 13 REQUIRED)
# CMake 3.25 knows no C++20 flag for nvcc 13; tell it.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)

set(MOE_CUDA_HEADERS ${PROJECT_SOURCE_DIR}/.cache/cuda-headers CACHE PATH "CUTLASS and cuDNN frontend headers")
if(NOT EXISTS ${MOE_CUDA_HEADERS}/cutlass/include/cutlass/cutlass.h)
  message(FATAL_ERROR "MOE_CUDA: no CUTLASS headers in ${MOE_CUDA_HEADERS}: run scripts/cuda_headers.sh")
endif()

# Targets. Our own kernels use no architecture-specific instruction: SASS for Hopper (sm_90) and
# Blackwell (sm_100, which sm_103 runs), plus compute_100 PTX for later GPUs. The CUTLASS kernels
# use wgmma/TMA (sm_90a) and tcgen05 (the Blackwell family target sm_100f, which covers sm_100
# and sm_103 in one compile: CUTLASS 4.2 enables its SM100 paths under CUDA_ARCH_FAMILY(1000)).
set(MOE_CUDA_GENERIC_GENCODE -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_100,code=sm_100
    -gencode=arch=compute_100,code=compute_100)
set(MOE_CUDA_SM90_GENCODE -gencode=arch=compute_90a,code=sm_90a)
set(MOE_CUDA_SM100_GENCODE -gencode=arch=compute_100f,code=sm_100f)

file(GLOB MOE_CUDA_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/kernels/cuda/*.cu
     ${PROJECT_SOURCE_DIR}/src/kernels/cuda/*.cpp ${PROJECT_SOURCE_DIR}/src/parallel/nccl_*.cpp)
# cuDNN (optional): its SDPA runs attention with bf16 products; without it our kernel does. Only
# its headers are needed here: the frontend loads libcudnn and libnvrtc at run time.
find_path(MOE_CUDNN_INCLUDE cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
if(NOT MOE_CUDNN_INCLUDE)
  list(FILTER MOE_CUDA_SOURCES EXCLUDE REGEX "sdpa_cudnn")
  message(STATUS "MOE_CUDA: no cuDNN found: attention runs on our kernels only")
endif()
if(MOE_WERROR)
  set(MOE_CUDA_WARNINGS -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror,-Wno-unknown-pragmas)
else()
  set(MOE_CUDA_WARNINGS -Xcompiler=-Wall,-Wextra,-Wno-unknown-pragmas)
endif()
add_library(moe_cuda OBJECT ${MOE_CUDA_SOURCES})
set_target_properties(moe_cuda PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE OFF)
target_include_directories(moe_cuda PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_include_directories(moe_cuda SYSTEM PRIVATE ${MOE_CUDA_HEADERS}/cutlass/include
                           ${MOE_CUDA_HEADERS}/cutlass/util/include ${MOE_CUDA_HEADERS}/cudnn_frontend/include
                           ${CUDAToolkit_INCLUDE_DIRS})
target_compile_options(moe_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CXX>:${MOE_WARNINGS} ${MOE_OPT_FLAGS}>
  $<$<COMPILE_LANGUAGE:CUDA>:${MOE_CUDA_WARNINGS} --expt-relaxed-constexpr -lineinfo -Xptxas=-v>)
# ptxas's resource report of every kernel goes to <object>.ptxas (scripts/check_kernels.sh).
# Through ccache when it is on (it replays the compile's output, the report with it).
set(MOE_NVCC_LAUNCHER ${PROJECT_SOURCE_DIR}/cmake/nvcc_resources.sh)
if(MOE_CCACHE AND MOE_CCACHE_PROGRAM)
  list(APPEND MOE_NVCC_LAUNCHER ${MOE_CCACHE_PROGRAM})
endif()
set_target_properties(moe_cuda PROPERTIES CUDA_COMPILER_LAUNCHER "${MOE_NVCC_LAUNCHER}")
foreach(src IN LISTS MOE_CUDA_SOURCES)
  if(src MATCHES "_sm90\\.cu$")
    set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "${MOE_CUDA_SM90_GENCODE}")
  elseif(src MATCHES "_sm100\\.cu$")
    set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "${MOE_CUDA_SM100_GENCODE}")
  elseif(src MATCHES "\\.cu$")
    set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "${MOE_CUDA_GENERIC_GENCODE}")
  endif()
endforeach()

target_sources(moecore_lib PRIVATE $<TARGET_OBJECTS:moe_cuda>)
target_compile_definitions(moecore_lib PUBLIC MOE_WITH_CUDA=1)
if(MOE_CUDNN_INCLUDE)
  target_compile_definitions(moe_cuda PRIVATE MOE_WITH_CUDNN=1)
  target_include_directories(moe_cuda SYSTEM PRIVATE ${MOE_CUDNN_INCLUDE})
  target_link_libraries(moecore_lib PUBLIC ${CMAKE_DL_LIBS})
endif()
# cuBLASLt and NCCL are loaded at run time (src/core/dynamic_library.h); only their headers are
# needed here.
target_link_libraries(moecore_lib PUBLIC CUDA::cudart ${CMAKE_DL_LIBS})
