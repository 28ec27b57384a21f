// `tessera ops [--json]`: every registered op (built-in and user-registered) with its inputs,
// outputs, attributes (name, type, default or required), the devices it has kernels for and
// whether it is differentiable; a table by default, JSON with --json.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "apps/tessera/commands.hpp"
#include "core/op_registry.hpp"

namespace tessera::cli {

namespace {

/// An attribute value as JSON: a number, a list of numbers, a bool or a string.
nlohmann::json value_json(const AttrValue& value, AttrType type) {
  if (const auto* list = std::get_if<std::vector<int64_t>>(&value)) return *list;
  if (const auto* list = std::get_if<std::vector<double>>(&value)) return *list;
  if (const auto* number = std::get_if<double>(&value)) return *number;
  if (const auto* integer = std::get_if<int64_t>(&value))
    return type == AttrType::boolean ? nlohmann::json(*integer != 0) : nlohmann::json(*integer);
  return std::get<std::string>(value);
}

nlohmann::json op_json(const OpDef& op) {
  nlohmann::json inputs = nlohmann::json::array();
  for (const OpInput& input : op.inputs)
    inputs.push_back({{"name", input.name}, {"optional", input.optional}});
  nlohmann::json attrs = nlohmann::json::array();
  for (const OpAttr& attr : op.attrs)
    attrs.push_back({{"name", attr.name},
                     {"type", attr_type_name(attr.type)},
                     {"required", attr.required},
                     {"default", attr.default_value ? value_json(*attr.default_value, attr.type)
                                                    : nlohmann::json(nullptr)},
                     {"doc", attr.doc}});
  return {{"name", op.name},
          {"summary", op.summary},
          {"signature", op.has_signature()},
          {"inputs", inputs},
          {"outputs", op.outputs},
          {"attrs", attrs},
          {"devices", op.devices()},
          {"differentiable", static_cast<bool>(op.backward)},
          {"sharding_rule", static_cast<bool>(op.rule)}};
}

/// "stride: int list = 1", "kernel_size: int list, required", "dims: int list (unset: ...)".
std::string attr_text(const OpAttr& attr) {
  std::string text = fmt::format("{}: {}", attr.name, attr_type_name(attr.type));
  if (attr.required) return text + ", required";
  if (attr.default_value) return text + " = " + attr_value_text(*attr.default_value);
  return text + " (optional)";
}

void print_table(const std::vector<std::shared_ptr<const OpDef>>& ops) {
  std::vector<std::array<std::string, 6>> rows{
      {"op", "inputs", "outputs", "devices", "grad", "attributes"}};
  for (const auto& op : ops) {
    std::vector<std::string> inputs, attrs;
    for (const OpInput& input : op->inputs)
      inputs.push_back(input.optional ? input.name + "?" : input.name);
    for (const OpAttr& attr : op->attrs) attrs.push_back(attr_text(attr));
    rows.push_back({op->name,
                    op->has_signature() ? fmt::format("{}", fmt::join(inputs, ", ")) : "?",
                    op->has_signature() ? fmt::format("{}", fmt::join(op->outputs, ", ")) : "?",
                    fmt::format("{}", fmt::join(op->devices(), ",")), op->backward ? "yes" : "no",
                    attrs.empty() ? "-" : fmt::format("{}", fmt::join(attrs, "; "))});
  }
  std::array<size_t, 6> widths{};
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c + 1 < row.size(); ++c) line += fmt::format("{:<{}}  ", row[c], widths[c]);
    fmt::print("{}{}\n", line, row.back());
  }
  fmt::print(
      "(? after an input: optional; '?' for inputs and outputs: the op declares no "
      "signature)\n");
}

}  // namespace

void register_ops_list(CLI::App& app) {
  auto* command = app.add_subcommand(
      "ops", "List the registered ops: inputs, outputs, attributes, devices, differentiable");
  auto as_json = std::make_shared<bool>(false);
  command->add_flag("--json", *as_json, "Print JSON");
  command->callback([as_json] {
    std::vector<std::shared_ptr<const OpDef>> ops;
    for (const std::string& name : registered_ops()) ops.push_back(find_op(name));
    if (*as_json) {
      nlohmann::json list = nlohmann::json::array();
      for (const auto& op : ops) list.push_back(op_json(*op));
      std::cout << nlohmann::json{{"ops", list}}.dump(2) << "\n";
      return;
    }
    print_table(ops);
  });
}

}  // namespace tessera::cli
