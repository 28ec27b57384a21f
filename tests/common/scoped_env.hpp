// ScopedEnv: sets (or, with a null value, unsets) an environment variable for the lifetime of
// the object and restores the previous value (or its absence) afterwards. For tests of settings
// read from the environment; not thread-safe against concurrent getenv in other threads.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace tessera::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace tessera::testing
