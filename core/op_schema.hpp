// An op's signature, as tools see it: its inputs (name, optional or not), outputs, attributes
// (name, type, default or required) and a one-line summary. `tessera ops` lists it, `tessera
// run-op` reads datasets and parses --attr NAME=VALUE through it, and apply_op checks a call's
// attributes against it (docs/op-rules.md).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/op_attrs.hpp"

namespace tessera {

/// The type of an attribute, and how it is stored in OpAttrs: int (int64), int_list
/// (vector<int64>), float (double), boolean (int64 0 or 1), string.
enum class AttrType { int_scalar, int_list, float_scalar, float_list, boolean, string };

/// "int", "int list", "float", "float list", "bool" or "string".
const char* attr_type_name(AttrType type);

/// One input of an op. Optional inputs come after the required ones (inputs are positional).
struct OpInput {
  std::string name{};
  bool optional = false;
};

/// One attribute of an op: required (no default), with a default value, or neither, when the op
/// derives the value from its inputs (`doc` says how, e.g. "D^-0.5").
struct OpAttr {
  std::string name{};
  AttrType type = AttrType::int_scalar;
  std::optional<AttrValue> default_value = std::nullopt;  ///< the value an unset attribute means
  bool required = false;
  std::string doc{};  ///< one line: what it is, and what unset means when there is no default
};

/// Whether `value` is stored as an attribute of `type` is (an int for a float too; 0 or 1 for a
/// bool).
bool attr_value_fits(const AttrValue& value, AttrType type);

/// `value` as a tool writes it: "3", "1,2", "0.5", "zeros" (lists comma-separated).
std::string attr_value_text(const AttrValue& value);

/// Parses `text` as attribute `attr` of op `op` (lists comma-separated, booleans 0 or 1);
/// throws InvalidArgument tagged `op` naming the attribute, its type and the text.
AttrValue parse_attr_value(const std::string& op, const OpAttr& attr, const std::string& text);

/// The attributes of a call to `op` from NAME=VALUE strings: unknown names, malformed values and
/// missing required attributes throw InvalidArgument tagged `op` naming the attribute. Only the
/// given attributes are set (defaults stay implicit, as in a call from C++).
OpAttrs parse_attrs(const std::string& op, const std::vector<OpAttr>& attrs,
                    const std::vector<std::string>& assignments);

/// Checks `given` against the declared `attrs` of `op`: every name declared, every value of the
/// declared type (an int is accepted for a float), every required one set. Throws
/// InvalidArgument tagged `op` naming the attribute.
void check_attrs(const std::string& op, const std::vector<OpAttr>& attrs, const OpAttrs& given);

}  // namespace tessera
