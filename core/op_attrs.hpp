// OpAttrs: the named attributes of an op call (stride, padding, dims, ...), typed values in a
// small map so that rules, kernels and backward functions of any op, built-in or user-written,
// read them the same way.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace tessera {

/// One attribute value.
using AttrValue =
    std::variant<int64_t, double, std::string, std::vector<int64_t>, std::vector<double>>;

class OpAttrs {
 public:
  OpAttrs() = default;
  /// Sets (or replaces) attribute `name`; returns *this for chaining.
  OpAttrs& set(const std::string& name, AttrValue value);
  /// True when `name` is set.
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  /// Typed getters; throw InvalidArgument naming the op, the attribute and the stored type.
  int64_t get_int(const std::string& name) const;
  double get_double(const std::string& name) const;
  const std::string& get_string(const std::string& name) const;
  const std::vector<int64_t>& get_ints(const std::string& name) const;
  /// A float list (an int list reads as its values in double).
  std::vector<double> get_doubles(const std::string& name) const;
  /// Getters with a default for unset attributes.
  int64_t get_int(const std::string& name, int64_t fallback) const;
  std::string get_string(const std::string& name, const std::string& fallback) const;
  /// Every set attribute, by name.
  const std::map<std::string, AttrValue>& values() const { return values_; }
  /// "stride=[2, 2] groups=1 ..." (stable order; used in cache keys and messages).
  std::string str() const;

 private:
  const AttrValue& find(const std::string& name) const;
  std::map<std::string, AttrValue> values_;
};

}  // namespace tessera
