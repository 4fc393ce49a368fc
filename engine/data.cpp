#include "engine/data.h"

#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>

#include "engine/error.h"

namespace dp {
namespace {

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};

// The whole file, decompressed if it is gzip'd (zlib reads plain files through unchanged).
std::vector<unsigned char> read_all(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) throw UsageError(path + ": no such file (expected an IDX file, optionally .gz)");
  if (fs::is_directory(path, ec)) throw UsageError(path + ": is a directory, expected an IDX file");
  std::unique_ptr<gzFile_s, GzCloser> f(gzopen(path.c_str(), "rb"));
  if (!f) throw UsageError(path + ": cannot open: " + std::strerror(errno));
  std::vector<unsigned char> out;
  unsigned char buf[1 << 16];
  for (;;) {
    int got = gzread(f.get(), buf, sizeof buf);
    if (got < 0) {
      int err = 0;
      const char* msg = gzerror(f.get(), &err);
      throw UsageError(path + ": read error: " + msg);
    }
    if (got == 0) break;
    out.insert(out.end(), buf, buf + got);
    if (out.size() > (size_t(1) << 34)) throw UsageError(path + ": larger than 16 GiB decompressed; not an IDX data set");
  }
  // A gzip stream cut short reads as a shorter file; zlib reports it only through gzerror.
  int err = 0;
  gzerror(f.get(), &err);
  if (err != Z_OK && err != Z_STREAM_END) throw UsageError(path + ": corrupt or truncated gzip stream");
  return out;
}

uint32_t be32(const unsigned char* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

std::string resolve(const std::string& dir, const std::string& name) {
  std::string plain = dir + "/" + name, gz = plain + ".gz";
  if (std::filesystem::exists(gz)) return gz;
  if (std::filesystem::exists(plain)) return plain;
  throw UsageError(dir + ": neither " + name + ".gz nor " + name +
                   " is there (--data expects a directory of IDX files: train-images-idx3-ubyte[.gz], "
                   "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz])");
}

}  // namespace

namespace {

struct ImagesHeader {
  uint32_t count, rows, cols;
};

ImagesHeader check_images(const unsigned char* img, size_t size, const std::string& ipath) {
  if (size < 16)
    throw UsageError(ipath + ": " + std::to_string(size) + " bytes, too short for an IDX3 header (16 bytes)");
  if (be32(img) != 0x00000803) {
    char magic[16];
    std::snprintf(magic, sizeof magic, "%08x", be32(img));
    throw UsageError(ipath + ": bad magic number 0x" + magic +
                     ", expected 0x00000803 (IDX3 unsigned bytes: an images file)");
  }
  uint32_t n = be32(img + 4), rows = be32(img + 8), cols = be32(img + 12);
  if (rows == 0 || cols == 0 || rows > 4096 || cols > 4096)
    throw UsageError(ipath + ": impossible image size " + std::to_string(rows) + "x" + std::to_string(cols) + " (expected 1..4096 per side)");
  uint64_t need = 16 + uint64_t(n) * rows * cols;  // at most 2^56: no overflow
  if (size < need)
    throw UsageError(ipath + ": truncated: the header promises " + std::to_string(n) + " images of " +
                     std::to_string(rows) + "x" + std::to_string(cols) + " (" + std::to_string(need) +
                     " bytes) but the file has " + std::to_string(size));
  if (size > need)
    throw UsageError(ipath + ": " + std::to_string(size - need) + " bytes past the " + std::to_string(n) +
                     " images the header declares");
  return {n, rows, cols};
}

uint32_t check_labels(const unsigned char* lab, size_t size, const std::string& lpath) {
  if (size < 8)
    throw UsageError(lpath + ": " + std::to_string(size) + " bytes, too short for an IDX1 header (8 bytes)");
  if (be32(lab) != 0x00000801)
    throw UsageError(lpath + ": bad magic number, expected 0x00000801 (IDX1 unsigned bytes: a labels file)");
  uint32_t nl = be32(lab + 4);
  if (size != 8 + uint64_t(nl))
    throw UsageError(lpath + ": the header declares " + std::to_string(nl) + " labels but the file holds " +
                     std::to_string(size - 8));
  return nl;
}

}  // namespace

Dataset parse_idx(const unsigned char* img, size_t img_size, const std::string& ipath, const unsigned char* lab,
                  size_t lab_size, const std::string& lpath, int64_t limit, int classes) {
  const ImagesHeader h = check_images(img, img_size, ipath);
  const uint32_t nl = check_labels(lab, lab_size, lpath);
  if (nl != h.count)
    throw UsageError(lpath + ": " + std::to_string(nl) + " labels for " + std::to_string(h.count) + " images in " +
                     ipath + "; the counts must match");
  Dataset d;
  d.count = limit > 0 ? std::min<int64_t>(limit, h.count) : h.count;
  d.rows = int(h.rows), d.cols = int(h.cols);
  d.labels.resize(size_t(d.count));
  for (int64_t i = 0; i < d.count; ++i) {
    int v = lab[8 + i];
    if (v >= classes)
      throw UsageError(lpath + ": label " + std::to_string(v) + " at index " + std::to_string(i) + " is out of range 0.." + std::to_string(classes - 1));
    d.labels[size_t(i)] = v;
  }
  d.images.resize(size_t(d.count * d.image_size()));
  for (size_t i = 0; i < d.images.size(); ++i) d.images[i] = float(img[16 + i]) / 255.0f;
  return d;
}

Dataset load_idx_files(const std::string& ipath, const std::string& lpath, int64_t limit, int classes) {
  auto img = read_all(ipath);
  check_images(img.data(), img.size(), ipath);  // a bad images file is reported before the labels are read
  auto lab = read_all(lpath);
  return parse_idx(img.data(), img.size(), ipath, lab.data(), lab.size(), lpath, limit, classes);
}

Dataset load_idx(const std::string& dir, const std::string& prefix, int64_t limit, int classes) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) throw UsageError("--data: " + dir + " is not a directory");
  return load_idx_files(resolve(dir, prefix + "-images-idx3-ubyte"), resolve(dir, prefix + "-labels-idx1-ubyte"), limit, classes);
}

std::vector<int64_t> epoch_order(int64_t count, uint64_t seed, int64_t epoch, bool shuffle) {
  std::vector<int64_t> order(static_cast<size_t>(count));
  std::iota(order.begin(), order.end(), 0);
  if (!shuffle) return order;
  std::mt19937_64 gen(seed + uint64_t(epoch));
  // Fisher-Yates with a bounded draw by rejection: the same permutation on every standard library
  // (std::shuffle's use of the generator is implementation-defined).
  for (int64_t i = count - 1; i > 0; --i) {
    uint64_t bound = uint64_t(i) + 1, limit = UINT64_MAX - UINT64_MAX % bound, v;
    do v = gen(); while (v >= limit);
    std::swap(order[i], order[v % bound]);
  }
  return order;
}

}  // namespace dp
