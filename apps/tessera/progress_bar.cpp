// The CLI's progress bar (progress_bar.hpp).
#include "apps/tessera/progress_bar.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>

#include "apps/tessera/cli_parse.hpp"

namespace tessera::cli {

void ProgressBar::operator()(int64_t done, int64_t total, const std::string& detail) {
  const double now = now_seconds();
  if (done < total && now - last_ < 0.1) return;
  last_ = now;
  constexpr int kWidth = 40;
  const int filled = total > 0 ? static_cast<int>(kWidth * done / total) : kWidth;
  // Clear to the end of the line: a shorter detail must not leave the old one's tail.
  std::fprintf(stderr, "\r[%s%s] %lld/%lld steps%s%s\x1b[K", std::string(filled, '#').c_str(),
               std::string(kWidth - filled, '.').c_str(), static_cast<long long>(done),
               static_cast<long long>(total), detail.empty() ? "" : ", ", detail.c_str());
  if (done >= total) std::fputc('\n', stderr);
  std::fflush(stderr);
}

std::string format_eta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto whole = static_cast<long long>(std::llround(seconds));
  if (whole < 60) return fmt::format("{} s", whole);
  if (whole < 3600) return fmt::format("{} min {:02} s", whole / 60, whole % 60);
  return fmt::format("{} h {:02} min", whole / 3600, (whole % 3600) / 60);
}

}  // namespace tessera::cli
