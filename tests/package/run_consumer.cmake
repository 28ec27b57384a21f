# Driver of the out-of-tree tests (cmake -P): install Tessera into a scratch prefix, configure
# the outside project CONSUMER_SOURCE_DIR against it, build it, run EXECUTABLE. CONSUMER_CXX_FLAGS
# (a list, e.g. the sanitizer flags of a sanitizer build) are compiled and linked into it.
file(REMOVE_RECURSE ${SCRATCH_DIR})
set(prefix ${SCRATCH_DIR}/prefix)
string(JOIN " " consumer_flags ${CONSUMER_CXX_FLAGS})

function(run_step description)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  message("${output}")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${description} failed (${result})")
  endif()
endfunction()

run_step("install" ${CMAKE_COMMAND} --install ${TESSERA_BUILD_DIR} --prefix ${prefix})
run_step("configure consumer" ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${SCRATCH_DIR}/build
  -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix}
  "-DCMAKE_CXX_FLAGS=${consumer_flags}" "-DCMAKE_EXE_LINKER_FLAGS=${consumer_flags}")
run_step("build consumer" ${CMAKE_COMMAND} --build ${SCRATCH_DIR}/build)
run_step("run ${EXECUTABLE}" ${SCRATCH_DIR}/build/${EXECUTABLE})
