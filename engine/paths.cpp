#include "engine/paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>

#include "engine/data.h"
#include "engine/error.h"
#include "engine/trainer.h"

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

// Opens a new file with a short hidden name beside `target` (".<up to 16 chars of its name>.<6
// random chars>", so a 255-character file name still has room) with O_EXCL; returns its fd and
// name, or fd -1 with errno set.
std::pair<int, std::string> open_temp_beside(const fs::path& target) {
  std::string stem = target.filename().string().substr(0, 16);
  fs::path dir = target.parent_path();
  static thread_local std::mt19937_64 gen{std::random_device{}() ^ uint64_t(::getpid())};
  const char* digits = "abcdefghijklmnopqrstuvwxyz0123456789";
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string name = "." + stem + ".";
    for (int i = 0; i < 6; ++i) name += digits[gen() % 36];
    std::string tmp = (dir / name).string();
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) return {fd, tmp};
  }
  errno = EEXIST;
  return {-1, ""};
}

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
  fs::path dir = out.file.parent_path();
  std::error_code ec;
  if (!dir.empty() && !fs::exists(dir, ec))
    throw UsageError(out.flag + " " + shown + ": the directory " + dir.string() + " does not exist");
  if (!dir.empty() && !fs::is_directory(dir, ec))
    throw UsageError(out.flag + " " + shown + ": " + dir.string() + " is not a directory");
  // The file is written beside its target and renamed into place: probe exactly that.
  auto [fd, tmp] = open_temp_beside(out.file);
  if (fd < 0) throw UsageError(out.flag + " " + shown + ": cannot write there: " + std::strerror(errno));
  ::close(fd);
  ::unlink(tmp.c_str());
}

}  // namespace

void check_output_paths(const TrainOptions& o) {
  std::vector<NamedPath> outputs, inputs;
  for (auto [flag, p] : {std::pair{"--save", &o.save}, {"--report", &o.report}, {"--trace", &o.trace}})
    if (!p->empty()) outputs.push_back({flag, *p, final_target(*p)});
  for (auto [flag, p] : {std::pair{"--load", &o.load}, {"--resume", &o.resume}})
    if (!p->empty()) inputs.push_back({flag, *p, *p});
  for (const std::string& f : idx_files(o.data)) inputs.push_back({"--data", o.data, f});

  for (auto& out : outputs) check_output(out);
  for (size_t i = 0; i < outputs.size(); ++i)
    for (size_t j = i + 1; j < outputs.size(); ++j)
      if (same_file(outputs[i].file, outputs[j].file))
        throw UsageError(outputs[i].flag + " " + outputs[i].path + " and " + outputs[j].flag + " " + outputs[j].path +
                         " are the same file; one would overwrite the other: give each output its own path");
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

void write_file_atomically(const std::string& path, const std::vector<std::string_view>& parts) {
  const fs::path target = final_target(path);
  struct stat st;
  const bool existed = ::stat(target.c_str(), &st) == 0;
  // Never opened, let alone replaced: writing a FIFO would block, replacing a device breaks it.
  if (existed && !S_ISREG(st.st_mode))
    throw UsageError(path + ": is " + std::string(kind_of(st.st_mode)) + "; dp writes only regular files");
  auto [fd, tmp] = open_temp_beside(target);
  if (fd < 0) throw IoError(path + ": cannot create a file beside it: " + std::strerror(errno));
  auto fail = [&, fd = fd, tmp = tmp](const std::string& what, int err) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return IoError(path + ": " + what + ": " + std::strerror(err));
  };
  if (existed) {
    // Ownership first: chown may clear set-id bits that the chmod then restores.
    if (::fchown(fd, st.st_uid, st.st_gid) != 0 && errno != EPERM) throw fail("cannot keep the file's owner", errno);
    if (::fchmod(fd, st.st_mode & 07777) != 0) throw fail("cannot keep the file's mode", errno);
  }
  for (std::string_view part : parts) {
    const char* c = part.data();
    size_t n = part.size();
    while (n > 0) {
      ssize_t w = ::write(fd, c, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        throw fail("writing failed", errno);
      }
      c += w, n -= size_t(w);
    }
  }
  if (::fsync(fd) != 0) throw fail("flushing to disk failed", errno);
  int closed = ::close(fd);
  if (closed != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(path + ": flushing to disk failed: " + std::strerror(err));
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(path + ": cannot move the new file into place: " + std::strerror(err));
  }
  // Make the rename itself durable.
  fs::path dir = target.parent_path();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace dp
