// The CPU backend of the Ops interface, one implementation per instruction set, chosen once when the
// device is made: Isa::reference is the reference kernels of kernels/cpu/kernels.h (the oracle,
// kernels/cpu/reference_ops.h); Isa::avx2 and Isa::avx512 derive from it and replace convolution
// (also fused with an activation and pooling), activations and 2x2 average pooling with the fast
// kernels (kernels/cpu/fast.h). All report backend() "cpu" and their instruction set as variant().
#pragma once

#include <memory>

#include "kernels/cpu/isa.h"
#include "kernels/ops.h"

namespace dp {

// Throws std::invalid_argument when this CPU (or build) does not run isa. Every op runs on the
// calling thread: a simulated device is one thread.
std::unique_ptr<Ops> make_cpu_ops(cpu::Isa isa = cpu::detect_isa());

namespace cpu {
// True when the backend for isa runs convolution shape s the direct way (NCHW, vectors along output
// rows: layers with few taps per output, e.g. a 1-channel first layer) rather than the blocked one;
// false for Isa::reference. For tests and profiles.
bool conv2d_direct(Isa isa, const ConvShape& s);
}  // namespace cpu

}  // namespace dp
