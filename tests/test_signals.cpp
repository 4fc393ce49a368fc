// Nothing lost, nothing hung: SIGINT, SIGTERM and SIGHUP at any moment of a run (after the last step,
// during the final save, between the outputs) exit 128 + signal saying what was written; a closed
// stdout does not kill a run; the grace deadline ends a hung step or save without leaving a temporary
// file or touching the previous checkpoint; a second signal leaves no temporary file either. The
// moments are hit exactly with dp_train's failpoint DP_TEST_AT (engine/failpoint.h; the test build's
// dp_train_failpoints), which makes the process raise the signal at itself, or hang, at a named point. Every run is
// bounded: timeout(1) or a wait that kills it.
#include <doctest/doctest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "models/model.h"
#include "tests/util.h"
#include "train/checkpoint.h"

using namespace dp;
using namespace dp::test;

namespace {

// On the simulated CPU devices, so --devices N means N devices on any machine, one with a GPU too.

// 128 images in batches of 32: 4 steps an epoch, a run of 2 epochs (8 steps, unless --steps says)
// well under a second (seconds under the sanitizers); 60 s only bounds a regression that hangs.
struct Fixture {
  TempDir dir;
  std::string args;
  Fixture() {
    std::filesystem::create_directory(dir / "data");
    write_synthetic_dataset(dir / "data", 128, 32);
    args = " --data " + dir / "data" + " --batch 32 --quiet";
  }
  CommandResult train(const std::string& env, const std::string& more) const {
    const std::string length = more.find("--steps") == std::string::npos ? " --epochs 2 " : " ";
    return run_command("timeout -s KILL 60 env " + env + " " + kTrainCpu + args + length + more);
  }
  // What dp leaves beside its outputs: hidden names are its temporary files.
  std::vector<std::string> temp_files() const {
    std::vector<std::string> found;
    for (auto& e : std::filesystem::directory_iterator(dir.path))
      if (e.path().filename().string()[0] == '.') found.push_back(e.path().filename().string());
    return found;
  }
};

// Waits (a minute at most) for `text` in the file at `path`.
bool wait_for_text(const std::string& path, const std::string& text) {
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (slurp(path).find(text) == std::string::npos) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

}  // namespace

TEST_CASE("signals: SIGTERM, SIGINT, SIGHUP after the last step save the checkpoint and exit 143, 130, 129") {
  Fixture f;
  const std::string ck = f.dir / "ck", report = f.dir / "r.json", trace = f.dir / "t.json";
  const std::string outputs = "--save " + ck + " --report " + report + " --trace " + trace;
  struct Case {
    std::string at;
    int code;
    std::string line;
    bool report_written;
  };
  const std::vector<Case> cases = {
      {"final-eval:SIGTERM", 143,
       "terminated (SIGTERM) after the last step (step 8); checkpoint saved to " + ck + "; report " + report +
           " and trace " + trace + " not written",
       false},
      {"final-save:SIGINT", 130,
       "interrupted (SIGINT) after the last step (step 8); checkpoint saved to " + ck + "; report " + report +
           " and trace " + trace + " not written",
       false},
      {"report:SIGHUP", 129,
       "hung up (SIGHUP) after the last step (step 8); checkpoint saved to " + ck + "; report written to " + report +
           "; trace " + trace + " not written",
       true},
  };
  for (const Case& c : cases) {
    CAPTURE(c.at);
    for (auto& p : {ck, report, trace}) std::filesystem::remove(p);
    CommandResult r = f.train("DP_TEST_AT=" + c.at, outputs);
    INFO(r.output);
    CHECK(r.exit_code == c.code);
    CHECK(r.output.find("dp_train: " + c.line + "\n") != std::string::npos);
    CHECK(global_step(ck) == 8);
    CHECK_NOTHROW(load_checkpoint(ck, make_model("lenet")));
    CHECK(std::filesystem::exists(report) == c.report_written);
    CHECK(!std::filesystem::exists(trace));
    CHECK(f.temp_files().empty());
  }
}

TEST_CASE("signals: a signal before the first step saves nothing, one after every output still exits 128 + signal") {
  Fixture f;
  const std::string ck = f.dir / "ck";
  CommandResult early = f.train("DP_TEST_AT=start:SIGTERM", "--save " + ck);
  INFO(early.output);
  CHECK(early.exit_code == 143);
  CHECK(early.output.find("terminated (SIGTERM) before the first step; nothing trained, nothing saved") !=
        std::string::npos);
  CHECK(!std::filesystem::exists(ck));

  CommandResult late = f.train("DP_TEST_AT=trace:SIGTERM", "--save " + ck + " --trace " + f.dir / "t.json");
  INFO(late.output);
  CHECK(late.exit_code == 143);
  CHECK(late.output.find("after the last step (step 8); checkpoint saved to " + ck + "; trace written to " +
                         f.dir / "t.json") != std::string::npos);
  CHECK(std::filesystem::exists(f.dir / "t.json"));
}

TEST_CASE("signals: a closed stdout (SIGPIPE) neither kills nor fails the run: exit 0, checkpoint and report") {
  Fixture f;
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  ::close(fds[0]);  // nobody reads: every write to stdout fails with EPIPE (or kills on SIGPIPE)
  const std::string ck = f.dir / "ck", report = f.dir / "r.json", log = f.dir / "log";
  // Not --quiet: the run prints its notice, epochs and device table into the closed pipe.
  Spawned run(kTrainCpu + " --data " + f.dir / "data" + " --batch 32 --epochs 2 --save " + ck + " --report " + report +
                  " 2> " + log,
              fds[1]);
  ::close(fds[1]);
  int code = run.wait();
  INFO(slurp(log));
  CHECK(code == 0);
  CHECK(global_step(ck) == 8);
  CHECK(nlohmann::json::parse(slurp(report))["epochs"].size() == 2);
}

TEST_CASE("signals: the grace deadline ends a hung step: exit 143 in seconds, previous checkpoint intact") {
  Fixture f;
  const std::string ck = f.dir / "ck", log = f.dir / "log";
  // A step that never returns, as a BLAS spinning would; the SIGTERM comes from outside, like timeout's.
  Spawned run("env DP_GRACE_SECONDS=1 DP_TEST_AT=step-4:hang " + kTrainCpu + f.args +
              " --epochs 2 --save-every 1 --save " + ck + " > " + log + " 2>&1");
  REQUIRE(wait_for_text(log, "hanging at step-4"));
  const std::string before = slurp(ck);
  CHECK(global_step(ck) == 3);
  auto t0 = std::chrono::steady_clock::now();
  REQUIRE(::kill(run.pid, SIGTERM) == 0);
  int code = run.wait();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string out = slurp(log);
  INFO(out);
  CHECK(code == 143);
  CHECK(seconds >= 1.0);
  CHECK(seconds < 10.0);  // 1 s of grace; the rest is slack for a loaded machine and the sanitizers
  CHECK(out.find("dp_train: the current step did not finish within 1 s of SIGTERM; exiting without saving it; "
                 "the last good checkpoint (step 3) in " +
                 ck + " is kept\n") != std::string::npos);
  CHECK(slurp(ck) == before);
  CHECK(f.temp_files().empty());
}

TEST_CASE("signals: the grace deadline during a save removes the temporary file, the old checkpoint stays") {
  Fixture f;
  const std::string ck = f.dir / "ck";
  REQUIRE(f.train("", "--steps 2 --save " + ck).exit_code == 0);
  const std::string before = slurp(ck);
  // The first save of the run (step 1) hangs with its temporary file written but not in place.
  CommandResult r =
      f.train("DP_GRACE_SECONDS=1 DP_TEST_AT=temp-file:SIGHUP,temp-file:hang", "--save-every 1 --save " + ck);
  INFO(r.output);
  CHECK(r.exit_code == 129);
  CHECK(r.output.find("dp_train: the checkpoint save did not finish within 1 s of SIGHUP; exiting, the unfinished "
                      "file removed; " +
                      ck + " is left as it was\n") != std::string::npos);
  CHECK(slurp(ck) == before);
  CHECK(f.temp_files().empty());
}

// coreutils' timeout signals the child, then its process group (the child again); a batch scheduler
// signals every process of a job: one request, delivered twice at once.
TEST_CASE("signals: the same signal twice at once is one request: the checkpoint is saved, exit 143") {
  Fixture f;
  const std::string ck = f.dir / "ck";
  CommandResult r = f.train("DP_TEST_AT=final-eval:SIGTERM,final-eval:SIGTERM", "--save " + ck);
  INFO(r.output);
  CHECK(r.exit_code == 143);
  CHECK(r.output.find("again: exiting at once") == std::string::npos);
  CHECK(r.output.find("terminated (SIGTERM) after the last step (step 8); checkpoint saved to " + ck) !=
        std::string::npos);
  CHECK(global_step(ck) == 8);
  CHECK(f.temp_files().empty());
}

TEST_CASE("signals: a second signal during a save or the path probe exits at once and leaves no temporary file") {
  Fixture f;
  const std::string ck = f.dir / "ck";
  REQUIRE(f.train("", "--steps 2 --save " + ck).exit_code == 0);
  const std::string before = slurp(ck);
  for (std::string at : {"temp-file", "probe"}) {
    CAPTURE(at);
    CommandResult r = f.train("DP_TEST_AT=" + at + ":SIGTERM," + at + ":SIGINT", "--save-every 1 --save " + ck);
    INFO(r.output);
    CHECK(r.exit_code == 130);  // the second signal's
    CHECK(r.output.find("dp_train: SIGINT again: exiting at once") != std::string::npos);
    CHECK(slurp(ck) == before);
    CHECK(f.temp_files().empty());
  }
}

TEST_CASE("signals: a failed save after SIGTERM names the signal and the OS's reason, and exits 1") {
  Fixture f;
  const std::string ck = f.dir / "ck";
  // A file size limit stands in for a full disk: the checkpoint (about 1 MiB) cannot be written past
  // 64 blocks, and with SIGXFSZ ignored the write fails with EFBIG instead of killing.
  CommandResult r = run_command(
      "timeout -s KILL 60 sh -c \"trap '' XFSZ; ulimit -f 64; DP_TEST_AT=final-save:SIGTERM "
      "exec " +
      kTrainCpu + f.args + " --epochs 2 --save " + ck + "\"");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("dp_train: error: " + ck +
                      ": writing failed: File too large; terminated (SIGTERM) after the "
                      "last step (step 8), and this write failed; nothing was saved") != std::string::npos);
  CHECK(!std::filesystem::exists(ck));
  CHECK(f.temp_files().empty());
}

TEST_CASE("signals: DP_GRACE_SECONDS must be a positive number of seconds") {
  Fixture f;
  for (std::string bad : {"abc", "0", "-1", "inf", "nan", "1e9", "''", "5s", "0x10", "' 5'", "'5 '"}) {
    CAPTURE(bad);
    CommandResult r = f.train("DP_GRACE_SECONDS=" + bad, "--steps 1");
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("DP_GRACE_SECONDS") != std::string::npos);
  }
  CHECK(f.train("DP_GRACE_SECONDS=0.5", "--steps 1").exit_code == 0);
}

TEST_CASE("signals: an empty test set has no accuracy: n/a on the epoch line, null in the report") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 0);
  CommandResult r = run_command("timeout -s KILL 60 " + kTrainCpu + " --data " + dir.path.string() +
                                " --batch 32 --epochs 1 --report " + dir / "r.json");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("test acc n/a (empty test set)") != std::string::npos);
  nlohmann::json rep = nlohmann::json::parse(slurp(dir / "r.json"));
  CHECK(rep["test_accuracy"].is_null());
  CHECK(rep["epochs"][0]["test_accuracy"].is_null());
}

TEST_CASE("signals: a run that diverges from weight decay is told to lower --weight-decay, not --lr") {
  Fixture f;
  CommandResult decay = f.train("", "--weight-decay 1e30");
  INFO(decay.output);
  CHECK(decay.exit_code == 3);
  CHECK(decay.output.find("try a smaller --weight-decay") != std::string::npos);
  CommandResult lr = f.train("", "--lr 1e6");
  INFO(lr.output);
  CHECK(lr.exit_code == 3);
  CHECK(lr.output.find("try a smaller --lr") != std::string::npos);
}

// Past the file size limit (ulimit -f) SIGXFSZ would kill the process mid-write, leaving the temporary
// file: it is ignored, the write fails with EFBIG, and that is handled as a full disk is.
TEST_CASE("signals: a save past the file size limit exits 1 naming it, no temporary file, the old checkpoint kept") {
  Fixture f;
  const std::string ck = f.dir / "ck";
  REQUIRE(f.train("", "--steps 1 --save " + ck).exit_code == 0);
  const std::string before = slurp(ck);
  REQUIRE(before.size() > 200 * 1024);  // lenet's weights and momentum: past the limit below
  CommandResult r =
      run_command("ulimit -f 200 && timeout -s KILL 60 " + kTrainCpu + f.args + " --steps 2 --save " + ck);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find(ck + ": writing failed: File too large") != std::string::npos);
  CHECK(slurp(ck) == before);
  CHECK(f.temp_files().empty());
}
