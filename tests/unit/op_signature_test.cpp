// Op signatures: every built-in op declares a complete one (summary, inputs, outputs, attributes
// with a type and a default or "required", devices); attribute values parse from text by type
// and bad ones are refused naming the op and the attribute; apply_op and register_op enforce the
// signature.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "core/agree.hpp"
#include "core/comm/local_comm.hpp"
#include "core/op_registry.hpp"
#include "core/op_schema.hpp"
#include "ops/ops.hpp"

namespace tessera {
namespace {

const std::vector<std::string> kBuiltins{
    "conv",  "na",       "relu",     "gelu",     "silu",          "tanh",     "exp",
    "scale", "add",      "sub",      "mul",      "div",           "bias_add", "sum",
    "mean",  "mse_loss", "max_pool", "avg_pool", "conv_transpose"};

/// Runs `body` and returns the message of the InvalidArgument it throws ("" when none).
template <typename Body>
std::string error_of(Body body) {
  try {
    body();
  } catch (const InvalidArgument& error) {
    return error.what();
  }
  return "";
}

TEST(OpSignature, EveryBuiltinOpIsRegisteredWithACompleteSignature) {
  const std::vector<std::string> names = registered_ops();
  for (const std::string& name : kBuiltins)
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  for (const std::string& name : kBuiltins) {
    SCOPED_TRACE(name);
    const OpDef& op = *find_op(name);
    EXPECT_FALSE(op.summary.empty());
    EXPECT_TRUE(op.has_signature());
    EXPECT_FALSE(op.outputs.empty());
    EXPECT_TRUE(op.rule && op.cpu && op.backward) << "rule, cpu kernel and backward";
    std::set<std::string> seen;
    for (const OpInput& input : op.inputs) EXPECT_TRUE(seen.insert(input.name).second);
    for (const std::string& output : op.outputs) EXPECT_TRUE(seen.insert(output).second);
    for (const OpAttr& attr : op.attrs) {
      SCOPED_TRACE(attr.name);
      EXPECT_FALSE(attr.doc.empty());
      EXPECT_NE(attr.required,
                attr.default_value.has_value() || attr.doc.find("unset") != std::string::npos)
          << "required, with a default, or saying what unset means";
      if (attr.default_value) {
        EXPECT_TRUE(attr_value_fits(*attr.default_value, attr.type));
      }
    }
  }
}

TEST(OpSignature, DevicesAreTheKernelsAnOpHas) {
  EXPECT_EQ(find_op("conv")->devices(), (std::vector<std::string>{"cpu", "cuda"}));
  EXPECT_EQ(find_op("gelu")->devices(), (std::vector<std::string>{"cpu", "cuda"}));
  EXPECT_EQ(find_op("sum")->devices(), (std::vector<std::string>{"cpu", "cuda"}));
  EXPECT_EQ(find_op("na")->devices(), (std::vector<std::string>{"cpu", "cuda"}));
  EXPECT_EQ(find_op("conv")->inputs.back().name, "b");
  EXPECT_TRUE(find_op("conv")->inputs.back().optional);
  EXPECT_EQ(find_op("na")->outputs, (std::vector<std::string>{"o", "lse"}));
}

TEST(OpSignature, AttributeValuesParseByType) {
  const auto parse = [](AttrType type, const std::string& text) {
    return parse_attr_value("op", OpAttr{.name = "a", .type = type}, text);
  };
  EXPECT_EQ(std::get<int64_t>(parse(AttrType::int_scalar, "-3")), -3);
  EXPECT_EQ(std::get<std::vector<int64_t>>(parse(AttrType::int_list, "1,-2,3")),
            (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(std::get<std::vector<int64_t>>(parse(AttrType::int_list, "4")),
            std::vector<int64_t>{4});
  EXPECT_EQ(std::get<double>(parse(AttrType::float_scalar, "0.5")), 0.5);
  EXPECT_EQ(std::get<double>(parse(AttrType::float_scalar, "2")), 2.0);
  EXPECT_EQ(std::get<double>(parse(AttrType::float_scalar, "1e-3")), 1e-3);
  EXPECT_EQ(std::get<int64_t>(parse(AttrType::boolean, "1")), 1);
  EXPECT_EQ(std::get<int64_t>(parse(AttrType::boolean, "0")), 0);
  EXPECT_EQ(std::get<std::string>(parse(AttrType::string, "circular")), "circular");
  EXPECT_EQ(std::get<std::vector<double>>(parse(AttrType::float_list, "1.5,2,0.6")),
            (std::vector<double>{1.5, 2.0, 0.6}));
  EXPECT_EQ(attr_value_text(std::vector<int64_t>{1, 2}), "1,2");
  EXPECT_EQ(attr_value_text(std::vector<double>{1.7, 2}), "1.7,2");
  // A float list attribute reads an int list as its values.
  OpAttrs attrs;
  attrs.set("f", std::vector<double>{0.5, 3}).set("i", std::vector<int64_t>{2});
  EXPECT_EQ(attrs.get_doubles("f"), (std::vector<double>{0.5, 3.0}));
  EXPECT_EQ(attrs.get_doubles("i"), std::vector<double>{2.0});
  EXPECT_TRUE(attr_value_fits(std::vector<int64_t>{2}, AttrType::float_list));
  EXPECT_FALSE(attr_value_fits(std::vector<double>{2.5}, AttrType::int_list));
}

TEST(OpSignature, BadAttributeValuesAreRefusedNamingTheOpAndTheAttribute) {
  const std::vector<std::pair<AttrType, std::string>> bad{
      {AttrType::int_scalar, "1.5"},
      {AttrType::int_scalar, "x"},
      {AttrType::int_scalar, ""},
      {AttrType::int_scalar, " 1"},
      {AttrType::int_scalar, "99999999999999999999"},
      {AttrType::int_list, "1,,2"},
      {AttrType::int_list, "1,"},
      {AttrType::int_list, "a"},
      {AttrType::int_list, ""},
      {AttrType::float_scalar, "nan"},
      {AttrType::float_scalar, "inf"},
      {AttrType::float_scalar, "1x"},
      {AttrType::float_list, "1.5,"},
      {AttrType::float_list, "1.5,,2"},
      {AttrType::float_list, "1.5,inf"},
      {AttrType::float_list, ""},
      {AttrType::boolean, "2"},
      {AttrType::boolean, "true"}};
  for (const auto& [type, text] : bad) {
    SCOPED_TRACE(std::string(attr_type_name(type)) + " '" + text + "'");
    const std::string message =
        error_of([&] { parse_attr_value("myop", OpAttr{.name = "stride", .type = type}, text); });
    EXPECT_NE(message.find("[myop]"), std::string::npos) << message;
    EXPECT_NE(message.find("'stride'"), std::string::npos) << message;
  }
}

TEST(OpSignature, ParseAttrsRefusesUnknownMissingAndRepeatedAttributes) {
  const std::vector<OpAttr>& conv = find_op("conv")->attrs;
  const OpAttrs attrs =
      parse_attrs("conv", conv, {"stride=2,2", "groups=2", "padding_mode=circular"});
  EXPECT_EQ(attrs.get_ints("stride"), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(attrs.get_int("groups"), 2);
  EXPECT_EQ(attrs.get_string("padding_mode"), "circular");
  EXPECT_FALSE(attrs.has("dilation")) << "defaults stay implicit";

  std::string message = error_of([&] { parse_attrs("conv", conv, {"strides=2"}); });
  EXPECT_NE(message.find("[conv] unknown attribute 'strides'"), std::string::npos) << message;
  EXPECT_NE(message.find("stride, dilation"), std::string::npos) << "lists the declared ones";
  message = error_of([&] { parse_attrs("conv", conv, {"groups"}); });
  EXPECT_NE(message.find("'groups'"), std::string::npos) << message;
  message = error_of([&] { parse_attrs("conv", conv, {"groups=1", "groups=2"}); });
  EXPECT_NE(message.find("'groups' given twice"), std::string::npos) << message;
  message = error_of([&] { parse_attrs("conv", conv, {"groups=two"}); });
  EXPECT_NE(message.find("'groups'"), std::string::npos) << message;

  const std::vector<OpAttr>& na = find_op("na")->attrs;
  message = error_of([&] { parse_attrs("na", na, {"kernel_size=3", "dilation=1", "causal=0"}); });
  EXPECT_NE(message.find("[na] missing required attribute 'scale'"), std::string::npos) << message;
  EXPECT_NO_THROW(parse_attrs("na", na, {"kernel_size=3", "dilation=1", "causal=0", "scale=0.25"}));
  EXPECT_EQ(parse_attrs("sum", find_op("sum")->attrs, {"keepdim=1"}).get_int("keepdim"), 1);
}

TEST(OpSignature, ApplyOpRefusesAttributesOutsideTheSignatureOnEveryRank) {
  run_local_ranks(2, [](std::shared_ptr<Comm> world) {
    DeviceMesh mesh(world, {2});
    const ShardTensor x =
        ShardTensor::distribute(Tensor::zeros({4, 3}, DType::f64), mesh, {Placement::shard(0)});
    auto expect_agreed = [](auto body, const std::string& needle) {
      try {
        body();
        ADD_FAILURE() << "expected an AgreedError containing " << needle;
      } catch (const AgreedError& error) {
        EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
      }
    };
    expect_agreed([&] { apply_op("gelu", {x}, OpAttrs().set("factor", 2.0)); },
                  "[gelu] unknown attribute 'factor'");
    expect_agreed([&] { apply_op("sum", {x}, OpAttrs().set("dims", int64_t{0})); },
                  "[sum] attribute 'dims' = 0: expected an int list");
    expect_agreed([&] { apply_op("sum", {x}, OpAttrs().set("keepdim", int64_t{2})); },
                  "[sum] attribute 'keepdim' = 2: expected a bool (0 or 1)");
    expect_agreed([&] { apply_op("scale", {x}); }, "[scale] missing required attribute 'factor'");
    expect_agreed([&] { apply_op("add", {x}); }, "[add] 1 inputs, expected 2");
    // A declared attribute of the right type passes (an int for a float too).
    EXPECT_NO_THROW(apply_op("scale", {x}, OpAttrs().set("factor", int64_t{2})));
    EXPECT_NO_THROW(apply_op("sum", {x}, OpAttrs().set("dims", std::vector<int64_t>{1})));
  });
}

// The messages apply_op and OpAttrs format only when they throw: a missing attribute names
// the attributes that are set; inputs on two meshes or two devices name both.
TEST(OpSignature, ChecksOnTheCallPathNameWhatTheyFound) {
  const OpAttrs attrs = OpAttrs().set("dim", int64_t{1}).set("p", 0.5);
  try {
    attrs.get_int("groups");
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("[attrs] attribute 'groups' is not set (dim=1 p=0.5)"),
              std::string::npos)
        << error.what();
  }
  run_local_ranks(2, [](std::shared_ptr<Comm> world) {
    DeviceMesh mesh(world, {2}), flat(world, {2, 1});
    const ShardTensor x =
        ShardTensor::distribute(Tensor::zeros({4, 3}, DType::f64), mesh, {Placement::shard(0)});
    const ShardTensor y = ShardTensor::distribute(Tensor::zeros({4, 3}, DType::f64), flat,
                                                  {Placement::shard(0), Placement::replicate()});
    try {
      apply_op("add", {x, y});
      ADD_FAILURE() << "expected InvalidArgument";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("[add] inputs live on different meshes ("),
                std::string::npos)
          << error.what();
    }
  });
}

// TESSERA_CHECK_ARG evaluates its op, format and arguments only when the check fails, and then
// throws the same InvalidArgument as check_arg.
TEST(OpSignature, LazyChecksBuildTheirMessageOnlyWhenTheyFail) {
  int built = 0;
  const auto costly = [&built] {
    ++built;
    return std::string("the costly part");
  };
  for (int i = 0; i < 3; ++i) TESSERA_CHECK_ARG(i < 3, "lazy", "message {}", costly());
  EXPECT_EQ(built, 0);
  try {
    TESSERA_CHECK_ARG(built > 0, std::string("lazy"), "{} of {} and {}", costly(), 1, "two");
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& error) {
    EXPECT_EQ(std::string(error.what()), "[lazy] the costly part of 1 and two");
    EXPECT_EQ(error.op(), "lazy");
  }
  EXPECT_EQ(built, 1);
}

TEST(OpSignature, AnOpWithRequiredAndDefaultedAttributesRegistersAndChecksCalls) {
  register_op(OpDef{
      .name = "test_signature_pool",
      .summary = "identity with a pool-like signature",
      .inputs = {{.name = "x"}},
      .outputs = {"y"},
      .attrs = {{.name = "kernel_size", .type = AttrType::int_list, .required = true, .doc = "k"},
                {.name = "ceil_mode",
                 .type = AttrType::boolean,
                 .default_value = int64_t{0},
                 .doc = "round up"}},
      .cpu = [](const KernelContext&, const std::vector<Tensor>& inputs) { return inputs; }});
  const OpDef& op = *find_op("test_signature_pool");
  EXPECT_NO_THROW(
      check_attrs(op.name, op.attrs, OpAttrs().set("kernel_size", std::vector<int64_t>{2})));
  const std::string message =
      error_of([&] { check_attrs(op.name, op.attrs, OpAttrs().set("ceil_mode", int64_t{1})); });
  EXPECT_NE(message.find("[test_signature_pool] missing required attribute 'kernel_size'"),
            std::string::npos)
      << message;
  const std::string bad_default = error_of([] {
    register_op(OpDef{.name = "test_bad_default",
                      .inputs = {{.name = "x"}},
                      .outputs = {"y"},
                      .attrs = {{.name = "p",
                                 .type = AttrType::float_scalar,
                                 .default_value = std::string("half"),
                                 .doc = "d"}}});
  });
  EXPECT_NE(bad_default.find("[test_bad_default] the default half of attribute 'p' is not a float"),
            std::string::npos)
      << bad_default;
}

TEST(OpSignature, RegisterOpRefusesAnOptionalInputBeforeARequiredOne) {
  const std::string message = error_of([] {
    register_op(OpDef{.name = "test_bad_signature",
                      .inputs = {{.name = "a", .optional = true}, {.name = "b"}},
                      .outputs = {"y"}});
  });
  EXPECT_NE(message.find("[test_bad_signature] optional input 'a' comes before required input 'b'"),
            std::string::npos)
      << message;
  EXPECT_ANY_THROW(find_op("test_bad_signature"));
}

}  // namespace
}  // namespace tessera
