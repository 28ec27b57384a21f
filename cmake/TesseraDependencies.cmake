# Optional dependencies of Tessera. Each TESSERA_WITH_<X> is AUTO (use it when found), ON (fail
# when missing) or OFF; the outcome is TESSERA_HAVE_<X> (0/1), written to core/config.hpp.

find_package(Threads REQUIRED)
find_package(fmt REQUIRED)

function(tessera_option name description)
  set(TESSERA_WITH_${name} AUTO CACHE STRING "${description} (AUTO|ON|OFF)")
  set_property(CACHE TESSERA_WITH_${name} PROPERTY STRINGS AUTO ON OFF)
endfunction()

# tessera_resolve(<X> <found>): sets TESSERA_HAVE_<X> in the caller from the option and <found>.
macro(tessera_resolve name found)
  if(TESSERA_WITH_${name} STREQUAL "OFF")
    set(TESSERA_HAVE_${name} 0)
  elseif(${found})
    set(TESSERA_HAVE_${name} 1)
  elseif(TESSERA_WITH_${name} STREQUAL "ON")
    message(FATAL_ERROR "TESSERA_WITH_${name}=ON but ${name} was not found")
  else()
    set(TESSERA_HAVE_${name} 0)
  endif()
endmacro()

tessera_option(CUDA "CUDA device tensors and kernels")
tessera_option(NCCL "NCCL communication backend")
tessera_option(MPI "MPI communication backend")
tessera_option(HDF5 "HDF5 input and output")
tessera_option(DNNL "oneDNN CPU convolution")
tessera_option(OPENMP "OpenMP threads in the CPU kernels")
tessera_option(ONNX "ONNX model import (libonnx-dev, libprotobuf-dev)")
tessera_option(PLPLOT "PNG plots of the tessera tool (libplplot-dev, plplot-driver-cairo)")

# CUDA: a working nvcc is enough to build; a GPU is only needed to run.
set(cuda_found FALSE)
if(NOT TESSERA_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)  # H100; override with -DCMAKE_CUDA_ARCHITECTURES=...
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit)
    set(cuda_found ${CUDAToolkit_FOUND})
  endif()
endif()
tessera_resolve(CUDA cuda_found)

set(TESSERA_HAVE_CUDNN 0)
set(nccl_found FALSE)
if(TESSERA_HAVE_CUDA)
  find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(CUDNN_INCLUDE_DIR AND CUDNN_LIBRARY)
    set(TESSERA_HAVE_CUDNN 1)
  endif()
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(nccl_found TRUE)
  endif()
endif()
tessera_resolve(NCCL nccl_found)

set(mpi_found FALSE)
if(NOT TESSERA_WITH_MPI STREQUAL "OFF")
  # The C API through the CXX component (consumers need not enable C); no C++ bindings.
  set(MPI_CXX_SKIP_MPICXX ON)
  set(MPI_DETERMINE_LIBRARY_VERSION ON)  # MPI_CXX_LIBRARY_VERSION_STRING names the MPI
  find_package(MPI COMPONENTS CXX)
  set(mpi_found ${MPI_CXX_FOUND})
endif()
tessera_resolve(MPI mpi_found)

# tessera_mpi_flavor(<out> <text>): openmpi, mpich or "" from a version string or library paths.
function(tessera_mpi_flavor out text)
  string(TOLOWER "${text}" lower)
  if(lower MATCHES "open mpi|openmpi|openrte")
    set(${out} openmpi PARENT_SCOPE)
  elseif(lower MATCHES "mpich|mvapich|intel\\(r\\) mpi")
    set(${out} mpich PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

# The MPI in use (the one MPI_CXX_COMPILER / mpicxx belongs to): its flavor picks the parallel
# HDF5 built for it (Debian installs one per MPI: h5pcc.mpich, h5pcc.openmpi), whatever the
# system default (update-alternatives) points at.
set(TESSERA_MPI_FLAVOR "")
if(TESSERA_HAVE_MPI)
  if(MPI_CXX_LIBRARY_VERSION_STRING)
    tessera_mpi_flavor(TESSERA_MPI_FLAVOR "${MPI_CXX_LIBRARY_VERSION_STRING}")
  endif()
  if(NOT TESSERA_MPI_FLAVOR)
    tessera_mpi_flavor(TESSERA_MPI_FLAVOR "${MPI_CXX_LIBRARIES};${MPI_CXX_INCLUDE_DIRS}")
  endif()
endif()

set(hdf5_found FALSE)
set(TESSERA_HAVE_PARALLEL_HDF5 0)
if(NOT TESSERA_WITH_HDF5 STREQUAL "OFF")
  if(TESSERA_MPI_FLAVOR AND NOT HDF5_C_COMPILER_EXECUTABLE)
    find_program(tessera_h5pcc_for_mpi NAMES h5pcc.${TESSERA_MPI_FLAVOR})
    if(tessera_h5pcc_for_mpi)
      set(HDF5_C_COMPILER_EXECUTABLE ${tessera_h5pcc_for_mpi} CACHE FILEPATH
          "HDF5 C compiler wrapper (the parallel HDF5 of the MPI in use)")
    endif()
  endif()
  find_package(HDF5 COMPONENTS C)
  set(hdf5_found ${HDF5_FOUND})
endif()
tessera_resolve(HDF5 hdf5_found)
if(TESSERA_HAVE_HDF5 AND HDF5_IS_PARALLEL AND TESSERA_HAVE_MPI)
  # A parallel HDF5 links its own MPI: one built for another MPI than Tessera's puts two MPI
  # libraries in every program (each HDF5 call then fails inside MPI). Refuse it.
  set(hdf5_libraries ${HDF5_C_LIBRARIES} ${HDF5_C_INCLUDE_DIRS} ${HDF5_INCLUDE_DIRS})
  list(FILTER hdf5_libraries INCLUDE REGEX "hdf5")
  list(REMOVE_DUPLICATES hdf5_libraries)
  tessera_mpi_flavor(hdf5_mpi_flavor "${hdf5_libraries}")
  if(hdf5_mpi_flavor AND TESSERA_MPI_FLAVOR AND NOT hdf5_mpi_flavor STREQUAL TESSERA_MPI_FLAVOR)
    message(FATAL_ERROR
      "The parallel HDF5 found (${hdf5_libraries}) is built for ${hdf5_mpi_flavor}, but Tessera "
      "builds with ${TESSERA_MPI_FLAVOR} (${MPI_CXX_COMPILER}); mixing them aborts every HDF5 "
      "call under mpiexec. Install the HDF5 of ${TESSERA_MPI_FLAVOR} (Debian: "
      "libhdf5-${TESSERA_MPI_FLAVOR}-dev; scripts/install-deps.sh with "
      "TESSERA_MPI=${TESSERA_MPI_FLAVOR}) and point -DHDF5_C_COMPILER_EXECUTABLE at its h5pcc, "
      "or configure with -DTESSERA_WITH_HDF5=OFF.")
  endif()
  set(TESSERA_HAVE_PARALLEL_HDF5 1)
endif()

set(dnnl_found FALSE)
if(NOT TESSERA_WITH_DNNL STREQUAL "OFF")
  # Located directly: Debian's dnnl-config.cmake insists on OpenCL, which the CPU path never uses.
  find_path(DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
  find_library(DNNL_LIBRARY dnnl)
  if(DNNL_INCLUDE_DIR AND DNNL_LIBRARY)
    set(dnnl_found TRUE)
  endif()
endif()
tessera_resolve(DNNL dnnl_found)

# OpenMP: the CPU kernels' threads (core/parallel_for.hpp); without it they run on one thread per
# rank. oneDNN needs it too (ops/CMakeLists.txt).
set(openmp_found FALSE)
if(NOT TESSERA_WITH_OPENMP STREQUAL "OFF")
  find_package(OpenMP COMPONENTS CXX)
  set(openmp_found ${OpenMP_CXX_FOUND})
endif()
tessera_resolve(OPENMP openmp_found)

# ONNX: the protobuf classes of the onnx library (libonnx-dev) and protobuf itself
# (libprotobuf-dev) parse model files (io/onnx). Located directly, as plain library paths, so the
# exported package needs no ONNX or protobuf CMake targets.
set(onnx_found FALSE)
if(NOT TESSERA_WITH_ONNX STREQUAL "OFF")
  find_package(Protobuf QUIET)
  find_path(ONNX_INCLUDE_DIR onnx/onnx_pb.h)
  find_library(ONNX_PROTO_LIBRARY onnx_proto)
  if(Protobuf_FOUND AND ONNX_INCLUDE_DIR AND ONNX_PROTO_LIBRARY)
    set(onnx_found TRUE)
  endif()
endif()
tessera_resolve(ONNX onnx_found)
if(NOT TESSERA_HAVE_ONNX AND NOT TESSERA_WITH_ONNX STREQUAL "OFF")
  message(STATUS "ONNX import disabled: onnx/onnx_pb.h, libonnx_proto or protobuf not found "
                 "(Debian: libonnx-dev libprotobuf-dev; scripts/install-deps.sh)")
endif()

# PLplot: the PNG plots of the tessera tool (apps/plot; its pngcairo device comes from the
# plplot-driver-cairo package and is looked for at run time). Located directly, as plain paths:
# only the tool links it, never the exported library.
set(plplot_found FALSE)
if(NOT TESSERA_WITH_PLPLOT STREQUAL "OFF")
  find_path(PLPLOT_INCLUDE_DIR plplot.h PATH_SUFFIXES plplot)
  find_library(PLPLOT_LIBRARY plplot)
  if(PLPLOT_INCLUDE_DIR AND PLPLOT_LIBRARY)
    set(plplot_found TRUE)
  endif()
endif()
tessera_resolve(PLPLOT plplot_found)
if(NOT TESSERA_HAVE_PLPLOT AND NOT TESSERA_WITH_PLPLOT STREQUAL "OFF")
  message(STATUS "Plots disabled: plplot.h or libplplot not found "
                 "(Debian: libplplot-dev plplot-driver-cairo; scripts/install-deps.sh)")
endif()
