// dp_train's command line. The readers of flag values both front ends share are parse.h; what needs
// CLI11 itself is cli.h, included by the two front ends alone: CLI11's header costs seconds of
// compile time in every file that includes it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/parse.h"
#include "train/trainer.h"

namespace dp {

// Parses dp_train's arguments into `out`, with the command line and the start time. Returns false
// when --help or --version was printed.
bool parse_train_args(int argc, const char* const* argv, TrainOptions& out);

}  // namespace dp
