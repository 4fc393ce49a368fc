// libFuzzer target for the IDX reader. Each input is tried three ways:
//   as an images file, beside a labels file that matches the count its header declares;
//   as a labels file, beside 1x1 images that match its count;
//   through the file reader (gzip'd or raw, as --data reads it), as both files at once.
// A clean Dataset or a UsageError is the only acceptable outcome; anything else (another exception,
// a sanitizer report, a Dataset that breaks its own invariants) is a bug.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/error.h"
#include "train/data.h"

namespace {

uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

std::vector<unsigned char> header(std::vector<uint32_t> words) {  // big-endian, as IDX stores them
  std::vector<unsigned char> h;
  for (uint32_t v : words)
    for (int i = 3; i >= 0; --i) h.push_back((v >> (8 * i)) & 0xff);
  return h;
}

void check(const dp::Dataset& d, int classes) {
  if (d.count < 0 || d.rows <= 0 || d.cols <= 0) __builtin_trap();
  if (d.images.size() != size_t(d.count * d.image_size()) || d.labels.size() != size_t(d.count)) __builtin_trap();
  for (float x : d.images)
    if (!(x >= 0.0f && x <= 1.0f)) __builtin_trap();
  for (int32_t y : d.labels)
    if (y < 0 || y >= classes) __builtin_trap();
}

void parse(const std::vector<unsigned char>& img, const std::vector<unsigned char>& lab) {
  for (int64_t limit : {0, 1}) {
    try {
      check(dp::parse_idx(img.data(), img.size(), "images", lab.data(), lab.size(), "labels", limit, 10), 10);
    } catch (const dp::UsageError&) {
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<unsigned char> input(data, data + size);
  // The count the input declares, capped at its size: an input cannot hold more items than bytes,
  // so a larger count fails on its own and the companion file may stay small.
  uint32_t declared = size >= 8 ? uint32_t(std::min<uint64_t>(be32(data + 4), size)) : 0;

  std::vector<unsigned char> labels = header({0x801, declared});
  labels.resize(labels.size() + declared, 7);
  parse(input, labels);

  std::vector<unsigned char> images = header({0x803, declared, 1, 1});
  images.resize(images.size() + declared, 0x80);
  parse(images, input);

  // In memory where there is a tmpfs: the file round is otherwise the slowest part of an input.
  static const std::string path =
      std::string(::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp") + "/dp_fuzz_idx." + std::to_string(::getpid());
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(data, 1, size, f);
    std::fclose(f);
    try {
      check(dp::load_idx_files(path, path), 10);
    } catch (const dp::UsageError&) {
    }
    std::remove(path.c_str());
  }
  return 0;
}
