// IDX data sets (MNIST, Fashion-MNIST and any set in that format), gzip'd or raw, and the
// per-epoch sample order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dp {

struct Dataset {
  int64_t count = 0;
  int rows = 0, cols = 0;
  std::vector<float> images;    // (count, 1, rows, cols), pixels scaled to [0, 1]
  std::vector<int32_t> labels;  // (count)
  int64_t image_size() const { return int64_t(rows) * cols; }
};

// The image size a model takes, to hold a data set to before its body is read: rows = cols = 0 takes
// any size; `model` names the taker in errors ("lenet").
struct ImageShape {
  int rows = 0, cols = 0;
  std::string model;
};

// Reads <dir>/<prefix>-images-idx3-ubyte[.gz] and <prefix>-labels-idx1-ubyte[.gz] (prefix "train" or
// "t10k"). limit > 0 keeps the first `limit` samples. Every malformed input (missing file, wrong
// magic, impossible dimensions or an image size other than `shape`'s, truncated data or data past
// what the header declares, label >= classes, count mismatch) throws UsageError naming the file.
// Both headers are read and checked before either body, and bodies are streamed: no file is read
// past its declared size plus one byte, so a decompression bomb or /dev/zero fails at its header
// or after at most the bytes its header declares (itself capped at 16 GiB of pixels).
Dataset load_idx(const std::string& dir, const std::string& prefix, int64_t limit = 0, int classes = 10,
                 const ImageShape& shape = {});
// The data files of a --data directory that exist, each of the four names plain and .gz: the files a
// run reads, which no output may overwrite.
std::vector<std::string> idx_files(const std::string& dir);
Dataset load_idx_files(const std::string& images_path, const std::string& labels_path, int64_t limit = 0,
                       int classes = 10, const ImageShape& shape = {});
// The same checks on bytes already in memory and decompressed (the fuzzer's entry point);
// `images_name` and `labels_name` are what errors call the two inputs.
Dataset parse_idx(const unsigned char* images, size_t images_size, const std::string& images_name,
                  const unsigned char* labels, size_t labels_size, const std::string& labels_name, int64_t limit = 0,
                  int classes = 10, const ImageShape& shape = {});

// The sample order of an epoch: a permutation drawn from (seed, epoch), as DistributedSampler's
// set_epoch does, or file order when shuffle is off. Same on every platform.
std::vector<int64_t> epoch_order(int64_t count, uint64_t seed, int64_t epoch, bool shuffle);

}  // namespace dp
