// OpAttrs accessors.
#include "core/op_attrs.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/errors.hpp"

namespace tessera {

namespace {
const char* type_name(const AttrValue& value) {
  switch (value.index()) {
    case 0: return "int";
    case 1: return "double";
    case 2: return "string";
    case 3: return "int list";
    default: return "float list";
  }
}
}  // namespace

OpAttrs& OpAttrs::set(const std::string& name, AttrValue value) {
  values_[name] = std::move(value);
  return *this;
}

const AttrValue& OpAttrs::find(const std::string& name) const {
  const auto it = values_.find(name);
  // (The message only when it is thrown: str() formats every attribute.)
  if (it == values_.end())
    throw InvalidArgument("attrs", fmt::format("attribute '{}' is not set ({})", name, str()));
  return it->second;
}

template <typename T>
static const T& typed(const AttrValue& value, const std::string& name, const char* wanted) {
  const T* result = std::get_if<T>(&value);
  check_arg(result != nullptr, "attrs", "attribute '{}' is a {}, not a {}", name, type_name(value),
            wanted);
  return *result;
}

int64_t OpAttrs::get_int(const std::string& name) const {
  return typed<int64_t>(find(name), name, "int");
}
double OpAttrs::get_double(const std::string& name) const {
  const AttrValue& value = find(name);
  if (const int64_t* integer = std::get_if<int64_t>(&value)) return static_cast<double>(*integer);
  return typed<double>(value, name, "double");
}
const std::string& OpAttrs::get_string(const std::string& name) const {
  return typed<std::string>(find(name), name, "string");
}
const std::vector<int64_t>& OpAttrs::get_ints(const std::string& name) const {
  return typed<std::vector<int64_t>>(find(name), name, "int list");
}
std::vector<double> OpAttrs::get_doubles(const std::string& name) const {
  const AttrValue& value = find(name);
  if (const auto* integers = std::get_if<std::vector<int64_t>>(&value))
    return std::vector<double>(integers->begin(), integers->end());
  return typed<std::vector<double>>(value, name, "float list");
}
int64_t OpAttrs::get_int(const std::string& name, int64_t fallback) const {
  return has(name) ? get_int(name) : fallback;
}
std::string OpAttrs::get_string(const std::string& name, const std::string& fallback) const {
  return has(name) ? get_string(name) : fallback;
}

std::string OpAttrs::str() const {
  std::string text;
  for (const auto& [name, value] : values_) {
    if (!text.empty()) text += ' ';
    text += name + '=';
    std::visit([&](const auto& v) { text += fmt::format("{}", v); }, value);
  }
  return text;
}

}  // namespace tessera
