// The built-in sharded ops as plain functions (each is apply_op of a registered op): one header
// per op family (ops/<family>/...), all included here through the generated ops/op_families.hpp.
#pragma once

#include "ops/op_families.hpp"
