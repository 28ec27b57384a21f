// Parsing of the CLI's shared argument formats: mesh "2x2", lists "3,4", extents "3,5;4,4".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::cli {

/// "2x2x1" -> {2, 2, 1}.
std::vector<int> parse_mesh(const std::string& text);
/// "3,4,5" -> {3, 4, 5}.
std::vector<int64_t> parse_list(const std::string& text);
/// "3,5;4,4" -> {{3, 5}, {4, 4}} (one group per mesh dim).
std::vector<std::vector<int64_t>> parse_extents(const std::string& text);
/// Seconds since the steady clock's epoch, as a double.
double now_seconds();

}  // namespace tessera::cli
