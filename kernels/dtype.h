// The element types a gradient may travel in between devices (--grad-dtype): float32, as computed, or
// one of the two 16-bit types DDP's compression hooks use (bf16_compress_hook, fp16_compress_hook).
// 16-bit values are held as their bits in a uint16_t, on every backend; the conversions and the
// reduction's add are in kernels/math.h, shared by the CPU kernels and their CUDA twins.
#pragma once

#include <cstdint>

namespace dp {

enum class DType : uint8_t { fp32, bf16, fp16 };

// Bytes per element.
constexpr int64_t dtype_size(DType t) { return t == DType::fp32 ? 4 : 2; }
// "fp32", "bf16", "fp16": how --grad-dtype and the report name it.
constexpr const char* dtype_name(DType t) { return t == DType::fp32 ? "fp32" : t == DType::bf16 ? "bf16" : "fp16"; }

}  // namespace dp
