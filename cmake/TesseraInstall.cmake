# Install rules and the exported CMake package: find_package(Tessera CONFIG) then link
# tessera::tessera. Headers go to include/tessera/{core,ops,io}/ plus include/tessera/tessera.hpp.
include(CMakePackageConfigHelpers)

install(TARGETS tessera EXPORT TesseraTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(layer core ops io)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${layer}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tessera/${layer}
    FILES_MATCHING PATTERN "*.hpp")
endforeach()
install(FILES ${PROJECT_SOURCE_DIR}/core/tessera.hpp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tessera)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/generated/core/config.hpp
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tessera/core)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/generated/ops/op_families.hpp
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tessera/ops)

install(EXPORT TesseraTargets NAMESPACE tessera:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Tessera)
configure_package_config_file(cmake/TesseraConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/TesseraConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Tessera)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/TesseraConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/TesseraConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/TesseraConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Tessera)
