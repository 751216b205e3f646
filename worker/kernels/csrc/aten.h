// The kernel sources' one torch include: ATen's tensor API, with `torch::` naming it and its dtypes as
// torch/types.h does (ATen alone took 10 s to compile on AMD Zen 3, torch/types.h 18 s, torch/extension.h 34 s).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace sy_dtypes {  // torch/types.h's names (where it is also included, its own declarations win the lookup)
constexpr auto kInt8 = at::kChar;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat32 = at::kFloat;
}  // namespace sy_dtypes

namespace torch {
using namespace at;
using namespace sy_dtypes;
}  // namespace torch
