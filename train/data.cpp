#include "train/data.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <optional>
#include <random>

#include "engine/error.h"

namespace dp {
namespace {

// A byte stream read front to back: a file, gzip'd or raw, or bytes already in memory. read() fills
// `out` and returns fewer than `n` bytes only at the end of the stream.
class Source {
 public:
  virtual ~Source() = default;
  virtual size_t read(unsigned char* out, size_t n) = 0;
  // The stream's total length where it is known without reading it (raw files, memory).
  virtual std::optional<uint64_t> size() const = 0;
  const std::string& name() const { return name_; }

 protected:
  explicit Source(std::string name) : name_(std::move(name)) {}

 private:
  std::string name_;
};

class MemorySource final : public Source {
 public:
  MemorySource(const unsigned char* p, size_t size, const std::string& name) : Source(name), p_(p), size_(size) {}
  size_t read(unsigned char* out, size_t n) override {
    n = std::min(n, size_ - at_);
    if (n > 0) std::memcpy(out, p_ + at_, n);
    at_ += n;
    return n;
  }
  std::optional<uint64_t> size() const override { return size_; }

 private:
  const unsigned char* p_;
  size_t size_, at_ = 0;
};

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};

// zlib reads plain files through unchanged, so one reader takes both.
class FileSource final : public Source {
 public:
  explicit FileSource(const std::string& path) : Source(path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::exists(path, ec)) throw UsageError(path + ": no such file (expected an IDX file, optionally .gz)");
    if (fs::is_directory(path, ec)) throw UsageError(path + ": is a directory, expected an IDX file");
    // A FIFO or a device would block the read, or never end it: refused before it is opened.
    if (!fs::is_regular_file(path, ec))
      throw UsageError(path + ": is not a regular file (a FIFO, socket or device); expected an IDX file");
    file_size_ = fs::file_size(path, ec);
    f_.reset(gzopen(path.c_str(), "rb"));
    if (!f_) throw UsageError(path + ": cannot open: " + std::strerror(errno));
  }
  size_t read(unsigned char* out, size_t n) override {
    size_t total = 0;
    while (total < n) {
      int got = gzread(f_.get(), out + total, unsigned(std::min<size_t>(n - total, size_t(1) << 20)));
      if (got < 0) {
        int err = 0;
        throw UsageError(name() + ": read error: " + gzerror(f_.get(), &err));
      }
      if (got == 0) break;
      total += size_t(got);
    }
    if (total < n) {  // a gzip stream cut short reads as a shorter file; zlib reports it only through gzerror
      int err = 0;
      gzerror(f_.get(), &err);
      if (err != Z_OK && err != Z_STREAM_END) throw UsageError(name() + ": corrupt or truncated gzip stream");
    }
    return total;
  }
  std::optional<uint64_t> size() const override {
    // gzdirect is meaningful once the first bytes are read, which the header does before asking.
    if (file_size_ && gzdirect(f_.get())) return file_size_;
    return std::nullopt;
  }

 private:
  std::unique_ptr<gzFile_s, GzCloser> f_;
  std::optional<uint64_t> file_size_;
};

uint32_t be32(const unsigned char* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

std::string resolve(const std::string& dir, const std::string& name) {
  std::string plain = dir + "/" + name, gz = plain + ".gz";
  if (std::filesystem::exists(gz)) return gz;
  if (std::filesystem::exists(plain)) return plain;
  throw UsageError(dir + ": neither " + name + ".gz nor " + name +
                   " is there (--data expects a directory of IDX files: train-images-idx3-ubyte[.gz], "
                   "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz])");
}

// The most pixel bytes a header may declare: far above any IDX data set (Fashion-MNIST holds 55 MB),
// far below what would take the machine's memory (the images are kept as floats, 4 bytes a pixel).
constexpr uint64_t kMaxPixels = uint64_t(1) << 34;  // 16 GiB
constexpr size_t kChunk = size_t(1) << 20;
constexpr size_t kReserve = size_t(1) << 26;

std::string hw(uint32_t rows, uint32_t cols) { return std::to_string(rows) + "x" + std::to_string(cols); }

struct ImagesHeader {
  uint32_t count, rows, cols;
  uint64_t body() const { return uint64_t(count) * rows * cols; }  // at most 2^56: no overflow
};

ImagesHeader images_header(Source& src, const ImageShape& shape) {
  const std::string& ipath = src.name();
  unsigned char h[16];
  size_t got = src.read(h, sizeof h);
  if (got < sizeof h)
    throw UsageError(ipath + ": " + std::to_string(got) + " bytes, too short for an IDX3 header (16 bytes)");
  if (be32(h) != 0x00000803) {
    char magic[16];
    std::snprintf(magic, sizeof magic, "%08x", be32(h));
    throw UsageError(ipath + ": bad magic number 0x" + magic +
                     ", expected 0x00000803 (IDX3 unsigned bytes: an images file)");
  }
  ImagesHeader ih{be32(h + 4), be32(h + 8), be32(h + 12)};
  if (ih.rows == 0 || ih.cols == 0 || ih.rows > 4096 || ih.cols > 4096)
    throw UsageError(ipath + ": impossible image size " + hw(ih.rows, ih.cols) + " (expected 1..4096 per side)");
  if (shape.rows > 0 && (ih.rows != uint32_t(shape.rows) || ih.cols != uint32_t(shape.cols)))
    throw UsageError(ipath + ": holds " + std::to_string(ih.count) + " images of " + hw(ih.rows, ih.cols) + ", " +
                     (shape.model.empty() ? std::string("the model") : shape.model) + " takes " +
                     hw(uint32_t(shape.rows), uint32_t(shape.cols)));
  const uint64_t need = 16 + ih.body();
  if (auto size = src.size(); size && *size < need)
    throw UsageError(ipath + ": truncated: the header promises " + std::to_string(ih.count) + " images of " +
                     hw(ih.rows, ih.cols) + " (" + std::to_string(need) + " bytes) but the file has " +
                     std::to_string(*size));
  if (ih.body() > kMaxPixels)
    throw UsageError(ipath + ": the header declares " + std::to_string(ih.count) + " images of " +
                     hw(ih.rows, ih.cols) + " (" + std::to_string(ih.body()) +
                     " bytes), more than the 16 GiB dp reads; not an IDX data set");
  return ih;
}

uint32_t labels_header(Source& src) {
  const std::string& lpath = src.name();
  unsigned char h[8];
  size_t got = src.read(h, sizeof h);
  if (got < sizeof h)
    throw UsageError(lpath + ": " + std::to_string(got) + " bytes, too short for an IDX1 header (8 bytes)");
  if (be32(h) != 0x00000801)
    throw UsageError(lpath + ": bad magic number, expected 0x00000801 (IDX1 unsigned bytes: a labels file)");
  uint32_t nl = be32(h + 4);
  if (auto size = src.size(); size && *size < 8 + uint64_t(nl))
    throw UsageError(lpath + ": the header declares " + std::to_string(nl) + " labels but the file holds " +
                     std::to_string(*size - 8));
  return nl;
}

// Reads `body` bytes in chunks, handing each to `take(chunk, n, offset)`, then one byte more to
// make sure the stream ends there. Returns the bytes read if the stream ended early.
template <typename Take>
uint64_t stream_body(Source& src, uint64_t body, Take take) {
  std::vector<unsigned char> buf(size_t(std::min<uint64_t>(std::max<uint64_t>(body, 1), kChunk)));
  uint64_t done = 0;
  while (done < body) {
    size_t want = size_t(std::min<uint64_t>(body - done, buf.size()));
    size_t got = src.read(buf.data(), want);
    take(buf.data(), got, done);
    done += got;
    if (got < want) return done;
  }
  return src.read(buf.data(), 1) == 0 ? body : body + 1;
}

Dataset read_idx(Source& img, Source& lab, int64_t limit, int classes, const ImageShape& shape) {
  const std::string &ipath = img.name(), &lpath = lab.name();
  // Both headers before either body: a mismatch costs no inflating.
  const ImagesHeader h = images_header(img, shape);
  const uint32_t nl = labels_header(lab);
  if (nl != h.count)
    throw UsageError(lpath + ": " + std::to_string(nl) + " labels for " + std::to_string(h.count) + " images in " +
                     ipath + "; the counts must match");
  Dataset d;
  d.count = limit > 0 ? std::min<int64_t>(limit, h.count) : h.count;
  d.rows = int(h.rows), d.cols = int(h.cols);

  // The labels first: a byte each, they are the cheaper body to find wrong.
  const uint64_t kept_labels = uint64_t(d.count);
  d.labels.reserve(size_t(std::min<uint64_t>(kept_labels, kChunk)));
  uint64_t lgot = stream_body(lab, nl, [&](const unsigned char* p, size_t n, uint64_t at) {
    for (size_t i = 0; i < n && at + i < kept_labels; ++i) {
      int v = p[i];
      if (v >= classes)
        throw UsageError(lpath + ": label " + std::to_string(v) + " at index " + std::to_string(at + i) +
                         " is out of range 0.." + std::to_string(classes - 1));
      d.labels.push_back(v);
    }
  });
  if (lgot < nl)
    throw UsageError(lpath + ": the header declares " + std::to_string(nl) + " labels but the file holds " +
                     std::to_string(lgot));
  if (lgot > nl)
    throw UsageError(lpath + ": the header declares " + std::to_string(nl) +
                     " labels but the file holds more bytes after them");

  // The images grow with what arrives, never with what the header promises.
  const uint64_t kept_pixels = uint64_t(d.count) * uint64_t(d.image_size());
  // Reserved whole up to 256 MiB of floats (Fashion-MNIST's 47M pixels fit: one allocation, no
  // doubling); past that the vector grows with the data, so a lying header costs at most that.
  d.images.reserve(size_t(std::min<uint64_t>(kept_pixels, kReserve)));
  uint64_t igot = stream_body(img, h.body(), [&](const unsigned char* p, size_t n, uint64_t at) {
    if (at >= kept_pixels) return;
    size_t use = size_t(std::min<uint64_t>(n, kept_pixels - at)), old = d.images.size();
    d.images.resize(old + use);
    for (size_t i = 0; i < use; ++i) d.images[old + i] = float(p[i]) / 255.0f;
  });
  if (igot < h.body())
    throw UsageError(ipath + ": truncated: the header promises " + std::to_string(h.count) + " images of " +
                     hw(h.rows, h.cols) + " (" + std::to_string(16 + h.body()) + " bytes) but the file has " +
                     std::to_string(16 + igot));
  if (igot > h.body())
    throw UsageError(ipath + ": bytes past the " + std::to_string(h.count) + " images of " + hw(h.rows, h.cols) +
                     " the header declares (" + std::to_string(16 + h.body()) + " bytes)");
  return d;
}

}  // namespace

Dataset parse_idx(const unsigned char* img, size_t img_size, const std::string& ipath, const unsigned char* lab,
                  size_t lab_size, const std::string& lpath, int64_t limit, int classes, const ImageShape& shape) {
  MemorySource images(img, img_size, ipath), labels(lab, lab_size, lpath);
  return read_idx(images, labels, limit, classes, shape);
}

Dataset load_idx_files(const std::string& ipath, const std::string& lpath, int64_t limit, int classes,
                       const ImageShape& shape) {
  FileSource images(ipath), labels(lpath);
  return read_idx(images, labels, limit, classes, shape);
}

std::vector<std::string> idx_files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const char* prefix : {"train", "t10k"})
    for (const char* kind : {"-images-idx3-ubyte", "-labels-idx1-ubyte"})
      for (const char* ext : {"", ".gz"}) {
        std::string f = dir + "/" + prefix + kind + ext;
        if (std::filesystem::exists(f, ec)) out.push_back(f);
      }
  return out;
}

Dataset load_idx(const std::string& dir, const std::string& prefix, int64_t limit, int classes,
                 const ImageShape& shape) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) throw UsageError("--data: " + dir + " is not a directory");
  return load_idx_files(resolve(dir, prefix + "-images-idx3-ubyte"), resolve(dir, prefix + "-labels-idx1-ubyte"), limit,
                        classes, shape);
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
    do v = gen();
    while (v >= limit);
    std::swap(order[i], order[v % bound]);
  }
  return order;
}

}  // namespace dp
