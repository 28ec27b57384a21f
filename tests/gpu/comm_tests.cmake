# tessera_gpu_comm_tests (label gpu): Comm with device buffers on the local backend (1, 2, 4 ranks
# sharing one GPU) and over NCCL (one rank per GPU). Built with CUDA; without a visible GPU every
# test skips with the reason printed. Included from tests/CMakeLists.txt.
if(TESSERA_HAVE_CUDA)
  add_executable(tessera_gpu_comm_tests gpu/comm_device_gpu_test.cpp)
  target_include_directories(tessera_gpu_comm_tests PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_options(tessera_gpu_comm_tests PRIVATE -Wall -Wextra)
  target_link_libraries(tessera_gpu_comm_tests PRIVATE tessera::tessera GTest::gtest_main)
  add_test(NAME tessera_gpu_comm_tests COMMAND tessera_gpu_comm_tests)
  set_tests_properties(tessera_gpu_comm_tests PROPERTIES TIMEOUT 900 LABELS gpu
    ENVIRONMENT "TESSERA_BACKEND=local;${tessera_dist_env}")
endif()
