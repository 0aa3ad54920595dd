// What the kernel files use of ATen: the tensor type, its factories and parallel_for.
//
// Not <torch/extension.h>: with pybind11 and torch's C++ API behind it, it took ~19 s of
// compiling per file against ~3 s for these (one build per ISA of every file), so only
// bindings.cpp, which makes the Python module, includes torch's pybind11 headers.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
