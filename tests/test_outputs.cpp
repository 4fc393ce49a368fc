// What dp_train writes (--save, --report, --trace) never destroys something else: outputs that
// clash with each other or with an input, empty paths and paths that are not regular files are
// refused before training; symlinks are followed and modes kept; a failed write exits 1 with the
// OS's reason and leaves no temporary file. Every dp_train run here is bounded by timeout(1).
#include <doctest/doctest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "engine/error.h"
#include "models/model.h"
#include "tests/util.h"
#include "train/checkpoint.h"
#include "train/output_files.h"

using namespace dp;
using namespace dp::test;

namespace {

// On the simulated CPU devices, so --devices N means N devices on any machine, one with a GPU too.

// A refusal is immediate; a 2-step run on 64 images takes well under a second. 60 s only bounds a bug.
CommandResult train(const TempDir& dir, const std::string& args) {
  return run_command("timeout -k 5 60 " + kTrainCpu + " --data " + dir.path.string() + " --quiet --batch 16 " +
                     (args.find("--steps") == std::string::npos ? "--steps 2 " : "") + args);
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (auto& e : std::filesystem::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("dp_train: outputs that are the same file as another output or an input are refused up front") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  REQUIRE(train(dir, "--save " + dir / "c.st").exit_code == 0);
  std::filesystem::create_symlink(dir / "c.st", dir / "link");
  std::filesystem::create_directory(dir / "sub");
  const std::string ck = slurp(dir / "c.st"), labels = slurp(dir / "train-labels-idx1-ubyte.gz");
  struct Case {
    std::string args, first, second;
  };
  std::vector<Case> cases = {
      {"--save " + dir / "c.st" + " --report " + dir / "c.st", "--save", "--report"},
      {"--resume " + dir / "c.st" + " --trace " + dir / "c.st", "--trace", "--resume"},
      {"--report " + dir / "train-labels-idx1-ubyte.gz", "--report", "--data"},
      {"--trace " + dir / "sub/../t10k-images-idx3-ubyte.gz", "--trace", "--data"},
      {"--save " + dir / "link" + " --report " + dir / "c.st", "--save", "--report"},  // a link and its target
      {"--load " + dir / "c.st" + " --save " + dir / "link", "--save", "--load"},
      {"--report " + dir / "sub/../new.json" + " --trace " + dir / "new.json", "--report",
       "--trace"},  // neither exists
  };
  for (auto& c : cases) {
    CAPTURE(c.args);
    CommandResult r = train(dir, c.args);
    CAPTURE(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(c.first) != std::string::npos);
    CHECK(r.output.find(c.second) != std::string::npos);
    const bool said =
        r.output.find("same file") != std::string::npos || r.output.find("of the data set") != std::string::npos;
    CHECK(said);
    CHECK(r.output.find("saved") == std::string::npos);
  }
  CHECK(slurp(dir / "c.st") == ck);
  CHECK(slurp(dir / "train-labels-idx1-ubyte.gz") == labels);
  CHECK(!std::filesystem::exists(dir / "new.json"));
  // Continuing a run in place is what --resume is for.
  CommandResult r = train(dir, "--steps 4 --resume " + dir / "c.st" + " --save " + dir / "c.st");
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(slurp(dir / "c.st") != ck);
}

TEST_CASE("dp_train: an empty path given explicitly is refused, not taken as absent") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  REQUIRE(train(dir, "--steps 4 --save " + dir / "keep.st").exit_code == 0);
  const std::string keep = slurp(dir / "keep.st");
  for (std::string flag : {"--save", "--report", "--trace", "--load", "--resume"}) {
    CAPTURE(flag);
    CommandResult r =
        train(dir, flag + " '' " + (flag == "--save" ? "--report " + dir / "other.json" : "--save " + dir / "keep.st"));
    CAPTURE(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(flag + ": an empty path") != std::string::npos);
  }
  CHECK(slurp(dir / "keep.st") == keep);  // --resume '' did not start afresh over the 4-step checkpoint
  CHECK(!std::filesystem::exists(dir / "other.json"));
}

TEST_CASE("dp_train: an output path that is not a regular file is refused before training and left alone") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0644) == 0);
  std::filesystem::create_directory(dir / "adir");
  std::filesystem::create_symlink(dir / "fifo", dir / "to-fifo");
  // A unix socket's file stays after its socket is closed.
  int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(s >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::string sock = dir / "sock";
  REQUIRE(sock.size() < sizeof addr.sun_path);
  std::strcpy(addr.sun_path, sock.c_str());
  REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  ::close(s);
  struct Case {
    std::string args, words, node;
  };
  std::vector<Case> cases = {
      {"--report " + dir / "fifo", "is a FIFO", dir / "fifo"},
      {"--save " + dir / "to-fifo", "is a FIFO", dir / "fifo"},
      {"--trace " + sock, "is a socket", sock},
      {"--save " + dir / "adir", "is a directory", dir / "adir"},
  };
  // A copy of /dev/null made in the temp dir (root only): the real /dev is never touched.
  if (::mknod((dir / "null").c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0)
    cases.push_back({"--report " + dir / "null", "is a character device", dir / "null"});
  else
    MESSAGE("mknod failed (not root?): the device case is skipped");
  for (auto& c : cases) {
    CAPTURE(c.args);
    struct stat before, after;
    REQUIRE(::lstat(c.node.c_str(), &before) == 0);
    CommandResult r = train(dir, c.args);
    CAPTURE(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(c.words) != std::string::npos);
    REQUIRE(::lstat(c.node.c_str(), &after) == 0);
    CHECK((after.st_mode & S_IFMT) == (before.st_mode & S_IFMT));
    CHECK(after.st_ino == before.st_ino);
  }
  CHECK(std::filesystem::is_symlink(dir / "to-fifo"));
  CHECK(std::filesystem::is_empty(dir / "adir"));

  // The writer refuses too, without opening the FIFO (opening it for writing would block).
  CHECK_THROWS_AS(write_file_atomically(dir / "fifo", {"x"}), UsageError);
  CHECK(std::filesystem::is_fifo(dir / "fifo"));
}

TEST_CASE("dp_train: an output through a symlink replaces its target, keeps the link and the file's mode") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  std::filesystem::create_directory(dir / "store");
  std::filesystem::create_symlink("store/ck.st", dir / "ck");  // relative, and dangling until the first save
  CommandResult r = train(dir, "--save " + dir / "ck");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(std::filesystem::is_symlink(dir / "ck"));
  REQUIRE(std::filesystem::is_regular_file(dir / "store/ck.st"));
  const ModelSpec spec = make_model("lenet");
  CHECK(load_checkpoint(dir / "ck", spec).metadata.at("global_step") == "2");

  ::chmod((dir / "store/ck.st").c_str(), 0600);
  r = train(dir, "--steps 3 --resume " + dir / "ck" + " --save " + dir / "ck");
  REQUIRE(r.exit_code == 0);
  CHECK(std::filesystem::is_symlink(dir / "ck"));
  CHECK(load_checkpoint(dir / "store/ck.st", spec).metadata.at("global_step") == "3");
  struct stat st;
  REQUIRE(::stat((dir / "store/ck.st").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0600);

  // The report and trace writer follows links the same way.
  write_file(dir / "store/r.json", "{}", false);
  ::chmod((dir / "store/r.json").c_str(), 0640);
  std::filesystem::create_symlink(dir / "store/r.json", dir / "r.json");
  REQUIRE(train(dir, "--report " + dir / "r.json").exit_code == 0);
  CHECK(std::filesystem::is_symlink(dir / "r.json"));
  CHECK(slurp(dir / "store/r.json").find("\"test_accuracy\"") != std::string::npos);
  REQUIRE(::stat((dir / "store/r.json").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0640);
  CHECK(names_in(dir / "store") == std::vector<std::string>{"ck.st", "r.json"});  // no temporary file left
}

TEST_CASE("dp_train: a file name of 250 characters is written (the temporary name stays short)") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  const std::string name(250, 'c');
  CommandResult r = train(dir, "--save " + dir / name + " --report " + dir / (std::string(245, 'r') + ".json"));
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(std::filesystem::is_regular_file(dir / name));
}

TEST_CASE("dp_train: a write the system refuses exits 1 with its reason and leaves no temporary file") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  std::filesystem::create_directory(dir / "out");
  REQUIRE(train(dir, "--save " + dir / "out/ck.st").exit_code == 0);
  const std::string before = slurp(dir / "out/ck.st");
  // A 100 KiB file size limit makes the ~1 MB checkpoint's write fail with EFBIG, as a full disk
  // fails with ENOSPC; SIGXFSZ is ignored so the write returns the error instead of killing.
  CommandResult r = run_command("sh -c \"trap '' XFSZ; ulimit -f 100; exec timeout -k 5 60 " + kTrainCpu + " --data " +
                                dir.path.string() + " --quiet --batch 16 --steps 3 --save " + dir / "out/ck.st" + "\"");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find(std::strerror(EFBIG)) != std::string::npos);
  CHECK(r.output.find("out/ck.st") != std::string::npos);
  CHECK(slurp(dir / "out/ck.st") == before);
  CHECK(names_in(dir / "out") == std::vector<std::string>{"ck.st"});
}

TEST_CASE("dp_train: an output under a file, not a directory, is called that") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 16);
  write_file(dir / "afile", "x", false);
  CommandResult r = train(dir, "--save " + dir / "afile/x.st");
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("afile is not a directory") != std::string::npos);
}
