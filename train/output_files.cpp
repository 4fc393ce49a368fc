#include "train/output_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>

#include "engine/error.h"
#include "engine/failpoint.h"
#include "train/data.h"
#include "train/trainer.h"

namespace dp {
namespace fs = std::filesystem;
namespace {

// Follows `path` through every symlink to the file it finally names (which may not exist yet): the
// file a write must replace. Only the last component is followed; links among the directories
// are the kernel's to follow.
fs::path final_target(const std::string& path) {
  fs::path p = path;
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code ec;
    if (!fs::is_symlink(p, ec)) return p;
    fs::path to = fs::read_symlink(p, ec);
    if (ec) throw IoError(path + ": cannot read the symlink " + p.string() + ": " + ec.message());
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  throw UsageError(path + ": too many levels of symbolic links");
}

const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

// The temporary files in flight, for remove_temp_files. A signal handler may neither allocate nor
// lock, so each name sits in a fixed buffer that an atomic state publishes: 0 free, 1 claimed (the
// name being copied in), 2 published (the handler may unlink it). dp writes one file at a time; the
// spare slots cover a writer on another thread, and a writer that finds none free (or a name that
// does not fit) simply goes unlisted.
struct TempSlot {
  std::atomic<int> state{0};
  char path[4096];
};
TempSlot g_temp_slots[4];

int publish_temp(const std::string& path) {
  if (path.size() >= sizeof(TempSlot::path)) return -1;
  for (int i = 0; i < 4; ++i) {
    int expected = 0;
    if (!g_temp_slots[i].state.compare_exchange_strong(expected, 1, std::memory_order_acquire)) continue;
    std::memcpy(g_temp_slots[i].path, path.c_str(), path.size() + 1);
    g_temp_slots[i].state.store(2, std::memory_order_release);
    return i;
  }
  return -1;
}

void unpublish_temp(int& slot) {
  if (slot >= 0) g_temp_slots[slot].state.store(0, std::memory_order_release);
  slot = -1;
}

// A new file with a short hidden name beside `target` (".<up to 16 chars of its name>.<6 random
// chars>", so a 255-character file name still has room), opened with O_EXCL. It is listed for
// remove_temp_files from before it exists until it is renamed into place or removed, so no moment
// leaves an unlisted temporary file behind. (The price: a second signal in the instant between a name
// collision and the next try would remove the other file of that exact random name, which can only
// be another dp's temporary file.) The destructor closes and removes whatever was not renamed.
class TempFile {
 public:
  explicit TempFile(const fs::path& target) {
    std::string stem = target.filename().string().substr(0, 16);
    fs::path dir = target.parent_path();
    static thread_local std::mt19937_64 gen{std::random_device{}() ^ uint64_t(::getpid())};
    const char* digits = "abcdefghijklmnopqrstuvwxyz0123456789";
    for (int attempt = 0; attempt < 100; ++attempt) {
      std::string name = "." + stem + ".";
      for (int i = 0; i < 6; ++i) name += digits[gen() % 36];
      path_ = (dir / name).string();
      slot_ = publish_temp(path_);
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd_ >= 0) return;
      err_ = errno;
      unpublish_temp(slot_);
      path_.clear();
      if (err_ != EEXIST) return;
    }
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!path_.empty()) ::unlink(path_.c_str());
    unpublish_temp(slot_);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  int fd() const { return fd_; }
  int error() const { return err_; }  // why it could not be created: errno of the last try
  // 0, or -1 with errno set.
  int close() {
    int r = ::close(fd_);
    fd_ = -1;
    return r;
  }
  // 0 once it is the target (nothing left to remove), or -1 with errno set.
  int rename_to(const fs::path& target) {
    if (::rename(path_.c_str(), target.c_str()) != 0) return -1;
    path_.clear();
    unpublish_temp(slot_);
    return 0;
  }

 private:
  int fd_ = -1, err_ = 0, slot_ = -1;
  std::string path_;
};

// Two paths name the same file: by device and inode where both exist, else by their canonical form.
bool same_file(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec) && !ec;
  fs::path ca = fs::weakly_canonical(fs::absolute(a, ec), ec), cb = fs::weakly_canonical(fs::absolute(b, ec), ec);
  return ca == cb;
}

struct NamedPath {
  std::string flag, path;
  fs::path file;  // the file it names, symlinks followed
};

// `dir` (where output `shown` goes) exists, is a directory and takes new files: probed with the
// temporary file a write of `target` would make there.
void check_directory(const std::string& flag, const std::string& shown, const fs::path& dir, const fs::path& target) {
  std::error_code ec;
  if (!dir.empty() && !fs::exists(dir, ec))
    throw UsageError(flag + " " + shown + ": the directory " + dir.string() + " does not exist");
  if (!dir.empty() && !fs::is_directory(dir, ec))
    throw UsageError(flag + " " + shown + ": " + dir.string() + " is not a directory");
  TempFile probe(target);  // removed at once, by a signal's _exit too
  if (probe.fd() < 0) throw UsageError(flag + " " + shown + ": cannot write there: " + std::strerror(probe.error()));
  failpoint::at("probe");  // a test build: a signal while the probe file exists
}

// The output exists as a regular file or can be created: its directory is there and writable.
void check_output(const NamedPath& out) {
  const std::string shown = out.path + (out.file.string() != out.path ? " (a link to " + out.file.string() + ")" : "");
  struct stat st;
  if (::stat(out.file.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) throw UsageError(out.flag + " " + shown + ": is a directory; give a file name");
    if (!S_ISREG(st.st_mode))
      throw UsageError(out.flag + " " + shown + ": is " + kind_of(st.st_mode) +
                       "; dp writes its outputs only to regular files");
  }
  check_directory(out.flag, shown, out.file.parent_path(), out.file);
}

void refuse_same_files(const std::vector<NamedPath>& outputs) {
  for (size_t i = 0; i < outputs.size(); ++i)
    for (size_t j = i + 1; j < outputs.size(); ++j)
      if (same_file(outputs[i].file, outputs[j].file))
        throw UsageError(outputs[i].flag + " " + outputs[i].path + " and " + outputs[j].flag + " " + outputs[j].path +
                         " are the same file; one would overwrite the other: give each output its own path");
}

}  // namespace

void check_output_paths(const TrainOptions& o) {
  std::vector<NamedPath> outputs, inputs;
  for (auto [flag, p] :
       {std::pair{"--save", &o.save}, {"--report", &o.report}, {"--trace", &o.trace}, {"--log", &o.log}})
    if (!p->empty()) outputs.push_back({flag, *p, final_target(*p)});
  for (auto [flag, p] : {std::pair{"--load", &o.load}, {"--resume", &o.resume}})
    if (!p->empty()) inputs.push_back({flag, *p, *p});
  for (const std::string& f : idx_files(o.data)) inputs.push_back({"--data", o.data, f});

  for (auto& out : outputs) check_output(out);
  refuse_same_files(outputs);
  for (auto& out : outputs)
    for (auto& in : inputs) {
      if (out.flag == std::string("--save") && in.flag == std::string("--resume")) continue;  // continuing in place
      if (!same_file(out.file, in.file)) continue;
      if (in.flag == std::string("--data"))
        throw UsageError(out.flag + " " + out.path + " is " + in.file.filename().string() +
                         " of the data set (--data " + in.path + "); writing it would destroy the data");
      throw UsageError(out.flag + " " + out.path + " and " + in.flag + " " + in.path +
                       " are the same file; writing the output would destroy the input this run reads");
    }
}

void check_output_file(const std::string& flag, const std::string& path) {
  if (!path.empty()) check_output({flag, path, final_target(path)});
}

void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& outputs) {
  std::vector<NamedPath> named;
  for (auto& [flag, path] : outputs)
    if (!path.empty()) named.push_back({flag, path, final_target(path)});
  refuse_same_files(named);
}

void check_output_directory(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);  // symlinks followed
  if (fs::exists(st) && !fs::is_directory(st))
    throw UsageError(flag + " " + path + ": is a file, not a directory; " + flag +
                     " takes a directory (made if missing)");
  if (fs::is_directory(st)) return check_directory(flag, path, path, fs::path(path) / "probe");
  // "plots/" names the directory plots: its parent is the one above, where it will be made.
  fs::path p = fs::path(path).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  check_directory(flag, path, p.parent_path(), p);
}

void remove_temp_files() noexcept {
  for (TempSlot& slot : g_temp_slots)
    if (slot.state.load(std::memory_order_acquire) == 2) ::unlink(slot.path);
}

void write_file_atomically(const std::string& path, const std::vector<std::string_view>& parts) {
  const fs::path target = final_target(path);
  struct stat st;
  const bool existed = ::stat(target.c_str(), &st) == 0;
  // Never opened, let alone replaced: writing a FIFO would block, replacing a device breaks it.
  if (existed && !S_ISREG(st.st_mode))
    throw UsageError(path + ": is " + std::string(kind_of(st.st_mode)) + "; dp writes only regular files");
  TempFile tmp(target);  // removed on every way out but the rename
  if (tmp.fd() < 0) throw IoError(path + ": cannot create a file beside it: " + std::strerror(tmp.error()));
  auto fail = [&](const std::string& what, int err) { return IoError(path + ": " + what + ": " + std::strerror(err)); };
  if (existed) {
    // Ownership first: chown may clear set-id bits that the chmod then restores.
    if (::fchown(tmp.fd(), st.st_uid, st.st_gid) != 0 && errno != EPERM)
      throw fail("cannot keep the file's owner", errno);
    if (::fchmod(tmp.fd(), st.st_mode & 07777) != 0) throw fail("cannot keep the file's mode", errno);
  }
  for (std::string_view part : parts) {
    const char* c = part.data();
    size_t n = part.size();
    while (n > 0) {
      ssize_t w = ::write(tmp.fd(), c, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        throw fail("writing failed", errno);
      }
      c += w, n -= size_t(w);
    }
  }
  failpoint::at("temp-file");  // a test build: a signal or a hang while the temporary file is full but not in place
  if (::fsync(tmp.fd()) != 0) throw fail("flushing to disk failed", errno);
  if (tmp.close() != 0) throw fail("flushing to disk failed", errno);
  if (tmp.rename_to(target) != 0) throw fail("cannot move the new file into place", errno);
  // Make the rename itself durable.
  fs::path dir = target.parent_path();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace dp
