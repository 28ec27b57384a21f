// Op signatures: attribute parsing and checking (op_schema.hpp).
#include "core/op_schema.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "core/errors.hpp"

namespace tessera {

namespace {

/// The declared names, "a, b, c" (or "none").
std::string declared_names(const std::vector<OpAttr>& attrs) {
  if (attrs.empty()) return "none";
  std::vector<std::string> names;
  for (const OpAttr& attr : attrs) names.push_back(attr.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

const OpAttr* find_attr(const std::vector<OpAttr>& attrs, const std::string& name) {
  for (const OpAttr& attr : attrs)
    if (attr.name == name) return &attr;
  return nullptr;
}

/// A whole-text integer, or nullopt.
std::optional<int64_t> integer_of(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return std::nullopt;
  return static_cast<int64_t>(value);
}

/// A whole-text finite number, or nullopt.
std::optional<double> number_of(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (errno != 0 || end != text.c_str() + text.size() || !std::isfinite(value)) return std::nullopt;
  return value;
}

}  // namespace

const char* attr_type_name(AttrType type) {
  switch (type) {
    case AttrType::int_scalar: return "int";
    case AttrType::int_list: return "int list";
    case AttrType::float_scalar: return "float";
    case AttrType::float_list: return "float list";
    case AttrType::boolean: return "bool";
    case AttrType::string: return "string";
  }
  return "?";
}

bool attr_value_fits(const AttrValue& value, AttrType type) {
  switch (type) {
    case AttrType::int_scalar: return std::holds_alternative<int64_t>(value);
    case AttrType::boolean: {
      const int64_t* flag = std::get_if<int64_t>(&value);
      return flag != nullptr && (*flag == 0 || *flag == 1);
    }
    case AttrType::float_scalar:
      return std::holds_alternative<double>(value) || std::holds_alternative<int64_t>(value);
    case AttrType::int_list: return std::holds_alternative<std::vector<int64_t>>(value);
    case AttrType::float_list:
      return std::holds_alternative<std::vector<double>>(value) ||
             std::holds_alternative<std::vector<int64_t>>(value);
    case AttrType::string: return std::holds_alternative<std::string>(value);
  }
  return false;
}

std::string attr_value_text(const AttrValue& value) {
  if (const auto* list = std::get_if<std::vector<int64_t>>(&value))
    return fmt::format("{}", fmt::join(*list, ","));
  if (const auto* list = std::get_if<std::vector<double>>(&value))
    return fmt::format("{}", fmt::join(*list, ","));
  if (const auto* number = std::get_if<double>(&value)) return fmt::format("{}", *number);
  if (const auto* integer = std::get_if<int64_t>(&value)) return fmt::format("{}", *integer);
  return std::get<std::string>(value);
}

AttrValue parse_attr_value(const std::string& op, const OpAttr& attr, const std::string& text) {
  const auto refuse = [&](const char* expected) {
    throw InvalidArgument(
        op, fmt::format("attribute '{}' = '{}': expected {}", attr.name, text, expected));
  };
  switch (attr.type) {
    case AttrType::int_scalar:
      if (const auto value = integer_of(text)) return *value;
      refuse("an integer");
      break;
    case AttrType::boolean: {
      const auto value = integer_of(text);
      if (value && (*value == 0 || *value == 1)) return *value;
      refuse("a boolean, 0 or 1");
      break;
    }
    case AttrType::float_scalar:
      if (const auto value = number_of(text)) return *value;
      refuse("a finite number");
      break;
    case AttrType::int_list: {
      std::vector<int64_t> values;
      std::stringstream stream(text);
      std::string part;
      while (std::getline(stream, part, ',')) {
        const auto value = integer_of(part);
        if (!value) refuse("a comma-separated list of integers, e.g. 1,2");
        values.push_back(*value);
      }
      if (values.empty() || text.back() == ',')
        refuse("a comma-separated list of integers, e.g. 1,2");
      return values;
    }
    case AttrType::float_list: {
      std::vector<double> values;
      std::stringstream stream(text);
      std::string part;
      while (std::getline(stream, part, ',')) {
        const auto value = number_of(part);
        if (!value) refuse("a comma-separated list of finite numbers, e.g. 1.5,2");
        values.push_back(*value);
      }
      if (values.empty() || text.back() == ',')
        refuse("a comma-separated list of finite numbers, e.g. 1.5,2");
      return values;
    }
    case AttrType::string: return text;
  }
  refuse("a value");
  return {};
}

OpAttrs parse_attrs(const std::string& op, const std::vector<OpAttr>& attrs,
                    const std::vector<std::string>& assignments) {
  OpAttrs result;
  for (const std::string& assignment : assignments) {
    const size_t equals = assignment.find('=');
    TESSERA_CHECK_ARG(equals != std::string::npos && equals > 0, op,
                      "attribute '{}': expected NAME=VALUE (attributes of {}: {})", assignment, op,
                      declared_names(attrs));
    const std::string name = assignment.substr(0, equals);
    const OpAttr* attr = find_attr(attrs, name);
    TESSERA_CHECK_ARG(attr != nullptr, op, "unknown attribute '{}' (attributes of {}: {})", name,
                      op, declared_names(attrs));
    check_arg(!result.has(name), op, "attribute '{}' given twice", name);
    result.set(name, parse_attr_value(op, *attr, assignment.substr(equals + 1)));
  }
  check_attrs(op, attrs, result);
  return result;
}

void check_attrs(const std::string& op, const std::vector<OpAttr>& attrs, const OpAttrs& given) {
  // Runs on every op call: each message is formatted only when its check fails.
  for (const auto& [name, value] : given.values()) {
    const OpAttr* attr = find_attr(attrs, name);
    TESSERA_CHECK_ARG(attr != nullptr, op, "unknown attribute '{}' (attributes of {}: {})", name,
                      op, declared_names(attrs));
    TESSERA_CHECK_ARG(
        attr_value_fits(value, attr->type), op, "attribute '{}' = {}: expected {} {}", name,
        attr_value_text(value),
        attr->type == AttrType::int_scalar || attr->type == AttrType::int_list ? "an" : "a",
        attr->type == AttrType::boolean ? "bool (0 or 1)" : attr_type_name(attr->type));
  }
  for (const OpAttr& attr : attrs)
    TESSERA_CHECK_ARG(!attr.required || given.has(attr.name), op,
                      "missing required attribute '{}' ({}{})", attr.name,
                      attr_type_name(attr.type), attr.doc.empty() ? "" : ": " + attr.doc);
}

}  // namespace tessera
