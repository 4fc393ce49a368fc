// dp_train --log: a JSON Lines stream of step and epoch records, every line one object pandas can read,
// the losses those of the epoch lines and the report, refused before training where it cannot be
// written, kept up to the last step by a signal, and a write failure named with the OS's reason.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/error.h"
#include "tests/util.h"
#include "train/log.h"

using namespace dp::test;

namespace {

// Every line of the file as JSON; a line that is not one object fails the test.
std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::istringstream in(slurp(path));
  for (std::string line; std::getline(in, line);) {
    CAPTURE(line);
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    REQUIRE(j.is_object());
    out.push_back(j);
  }
  return out;
}

void check_finite_numbers(const nlohmann::json& j, const std::vector<std::string>& keys) {
  for (const std::string& k : keys) {
    CAPTURE(k);
    REQUIRE(j.contains(k));
    REQUIRE(j[k].is_number());
    CHECK(std::isfinite(j[k].get<double>()));
  }
}

// A step record's host_ms: the trainer's milliseconds a step inside Engine::step (device 0's thread
// enqueueing and waiting within them) and between the steps, which add up to the record's wall time.
void check_host_ms(const nlohmann::json& j, int64_t steps, int64_t images) {
  const nlohmann::json& h = j["host_ms"];
  REQUIRE(h.size() == 4);
  for (const char* k : {"step", "enqueue", "wait", "between"}) {
    CAPTURE(k);
    REQUIRE(h[k].is_number());
    CHECK(h[k].get<double>() >= 0);
  }
  CHECK(h["step"].get<double>() > 0);
  CHECK(h["enqueue"].get<double>() + h["wait"].get<double>() <= h["step"].get<double>());
  const double wall_ms = 1e3 * double(images) / j["images_per_second"].get<double>() / double(steps);
  CHECK(h["step"].get<double>() + h["between"].get<double>() == doctest::Approx(wall_ms).epsilon(1e-9));
}

}  // namespace

TEST_CASE("log: --steps 7 --log-every 3 writes steps 3, 6, 7 and each epoch, matching the report") {
  TempDir dir;
  // 192 images in batches of 32: 6 steps an epoch, so step 7 is the second epoch's first.
  write_synthetic_dataset(dir.path.string(), 192, 64);
  CommandResult r = run_command(kTrain + " --backend cpu --data " + dir.path.string() +
                                " --batch 32 --devices 2 --steps 7 --log-every 3 --log " + dir / "run.jsonl" +
                                " --report " + dir / "r.json");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const std::vector<nlohmann::json> lines = read_lines(dir / "run.jsonl");
  REQUIRE(lines.size() == 5);
  const std::vector<std::pair<std::string, int>> expected = {
      {"step", 3}, {"step", 6}, {"epoch", 1}, {"step", 7}, {"epoch", 2}};
  int64_t last_step = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const nlohmann::json& j = lines[i];
    CAPTURE(j.dump());
    REQUIRE(j["kind"] == expected[i].first);
    if (j["kind"] == "step") {
      CHECK(j["step"] == expected[i].second);
      CHECK(j["step"].get<int64_t>() > last_step);
      check_host_ms(j, j["step"].get<int64_t>() - last_step, j["images"].get<int64_t>());
      last_step = j["step"].get<int64_t>();
      check_finite_numbers(j, {"step", "epoch", "loss", "images_per_second", "elapsed_s", "lr"});
      CHECK(j["images_per_second"].get<double>() > 0);
      CHECK(j["lr"].dump() == "0.1");  // as given, not the widened float
      for (const char* side : {"device0", "max"}) {
        REQUIRE(j["phase_ms"][side].size() == 8);
        CHECK(j["phase_ms"][side]["forward"].get<double>() > 0);
        for (auto& [name, ms] : j["phase_ms"][side].items()) CHECK(ms.get<double>() >= 0);
      }
      CHECK(j["phase_ms"]["max"]["forward"].get<double>() >= j["phase_ms"]["device0"]["forward"].get<double>());
    } else {
      CHECK(j["epoch"] == expected[i].second);
      check_finite_numbers(
          j, {"train_loss", "train_accuracy", "test_loss", "test_accuracy", "images_per_second", "seconds"});
    }
  }
  CHECK(lines[0]["epoch"] == 1);
  CHECK(lines[3]["epoch"] == 2);
  const nlohmann::json rep = read_json(dir / "r.json");
  REQUIRE(rep["epochs"].size() == 2);
  for (int e = 0; e < 2; ++e) {
    CHECK(lines[2 + 2 * e]["train_loss"] == rep["epochs"][e]["train_loss"]);
    CHECK(lines[2 + 2 * e]["test_accuracy"] == rep["epochs"][e]["test_accuracy"]);
  }
  // Epoch 2 is step 7 alone; epoch 1 is the two full intervals of 3 steps of 32 images each.
  CHECK(lines[3]["loss"] == rep["epochs"][1]["train_loss"]);
  const double mean = (lines[0]["loss"].get<double>() + lines[1]["loss"].get<double>()) / 2;
  CHECK(mean == doctest::Approx(rep["epochs"][0]["train_loss"].get<double>()).epsilon(1e-12));
}

TEST_CASE("log: a path that cannot take the log is refused before training, with exit 2") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 64, 32);
  const std::string base = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --steps 2 ";
  const std::vector<Refusal> cases = {
      {"--log " + dir / "missing/run.jsonl", "--log " + dir / "missing/run.jsonl"},
      {"--log " + dir.path.string(), "is a directory"},
      {"--log " + dir / "same.json" + " --report " + dir / "same.json", "are the same file"},
      {"--log " + dir / "train-images-idx3-ubyte.gz", "of the data set"},
      {"--log ''", "--log"},
      {"--log " + dir / "run.jsonl" + " --log-every 0", "--log-every: 0 is not a step count"},
      {"--log-every 3", "--log-every: needs --log FILE"},
  };
  check_refusals(base, cases, "epoch 1/");
  CHECK_FALSE(std::filesystem::exists(dir / "run.jsonl"));
}

TEST_CASE("log: a run stopped by a signal keeps its records, up to the step it stopped after") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 128, 32);
  CommandResult r =
      run_command("timeout -s KILL 60 env DP_TEST_AT=step-5:SIGINT " + kTrain + " --backend cpu --data " +
                  dir.path.string() + " --batch 32 --steps 8 --quiet --log-every 2 --log " + dir / "run.jsonl");
  INFO(r.output);
  CHECK(r.exit_code == 130);
  CHECK(r.output.find("log " + dir / "run.jsonl" + " kept up to step 5") != std::string::npos);
  std::vector<int64_t> steps;
  for (const nlohmann::json& j : read_lines(dir / "run.jsonl"))
    if (j["kind"] == "step") steps.push_back(j["step"].get<int64_t>());
  CHECK(steps == std::vector<int64_t>{2, 4, 5});
}

TEST_CASE("log: host_ms puts a host that is slow between two steps in `between`, not in the step") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 192, 64);
  // The trainer sleeps 400 ms as step 3 begins, before its batch is handed over and it is stepped.
  CommandResult r = run_command("timeout -s KILL 120 env DP_TEST_AT=step-3:sleep400 " + kTrain +
                                " --backend cpu --data " + dir.path.string() +
                                " --batch 32 --devices 2 --steps 5 --quiet --log-every 1 --log " + dir / "run.jsonl");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  int records = 0;
  for (const nlohmann::json& j : read_lines(dir / "run.jsonl")) {
    if (j["kind"] != "step") continue;
    CAPTURE(j.dump());
    ++records;
    check_host_ms(j, 1, 32);
    if (j["step"] == 3) {
      CHECK(j["host_ms"]["between"].get<double>() >= 400);
      CHECK(j["host_ms"]["step"].get<double>() < 400);
    }
  }
  CHECK(records == 5);
}

TEST_CASE("log: a write the system refuses throws IoError naming the file and the reason") {
  const dp::Recorder times(2, false);  // two devices, nothing timed yet
  dp::TrainLog log("/dev/full", 1, dp::find_strategy("scatter"), times);
  dp::StepResult step;
  step.loss = 2.3, step.n = 32;
  try {
    log.step(1, 1, step, 0.1, times, false);
    FAIL("no IoError");
  } catch (const dp::IoError& e) {
    const std::string what = e.what();
    CHECK(what.find("/dev/full") != std::string::npos);
    CHECK(what.find(std::strerror(ENOSPC)) != std::string::npos);
  }
}

TEST_CASE("log: a write failure mid-run exits 1 naming the file and the reason, the lines written still whole") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 128, 32);
  // A file-size limit of 4 blocks (2 KiB in sh's 512-byte blocks) fits two or three step records;
  // SIGXFSZ ignored, so the write past it fails with EFBIG, as a full disk fails with ENOSPC.
  const std::string log = dir / "run.jsonl";
  CommandResult r =
      run_command("timeout -s KILL 60 sh -c \"trap '' XFSZ; ulimit -f 4; exec " + kTrain + " --backend cpu --data " +
                  dir.path.string() + " --batch 32 --steps 8 --quiet --log-every 1 --log " + log + "\"");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find(log + ": writing the log failed: " + std::strerror(EFBIG)) != std::string::npos);
  const std::string text = slurp(log);
  REQUIRE(!text.empty());
  CHECK(text.back() == '\n');  // the refused record was cut off again
  const std::vector<nlohmann::json> lines = read_lines(log);
  CHECK(lines.size() >= 1);
  CHECK(lines.size() < 8);
}

TEST_CASE("log: a failed record stops the log, not the run: the checkpoint is saved, then exit 1 saying so") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 128, 32);
  const std::string log = dir / "run.jsonl", saved = dir / "c.st";
  CommandResult r =
      run_command("timeout -s KILL 60 env DP_TEST_AT=log-4:fail " + kTrain + " --backend cpu --data " +
                  dir.path.string() + " --batch 32 --steps 8 --quiet --log-every 2 --log " + log + " --save " + saved);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("warning: DP_TEST_AT: log-4: the write failed on purpose; the log stopped after step 2; "
                      "training goes on") != std::string::npos);
  CHECK(r.output.find("every other output was written") != std::string::npos);
  std::vector<int64_t> steps;
  for (const nlohmann::json& j : read_lines(log)) steps.push_back(j["step"].get<int64_t>());
  CHECK(steps == std::vector<int64_t>{2});
  // The trained weights were kept (they were lost with the failed write): a whole checkpoint.
  REQUIRE(std::filesystem::exists(saved));
  CHECK(run_command(kTrain + " --backend cpu --data " + dir.path.string() + " --eval --load " + saved).exit_code == 0);
}

TEST_CASE("log: --resume with the same --log keeps the records up to the checkpoint's step and goes on after them") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 128, 32);  // 4 steps an epoch
  const std::string log = dir / "run.jsonl", saved = dir / "c.st", at5 = dir / "c5.st";
  const std::string run =
      "timeout -s KILL 60 " + kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --steps 10 --quiet";
  REQUIRE(run_command("env DP_TEST_AT=step-5:SIGINT " + run + " --log-every 2 --log " + log + " --save " + saved)
              .exit_code == 130);
  std::filesystem::copy_file(saved, at5);  // step 5: the second epoch's first
  auto records = [&] {
    std::vector<std::pair<std::string, int64_t>> out;
    double elapsed = 0;
    for (const nlohmann::json& j : read_lines(log)) {
      out.push_back({j["kind"].get<std::string>(), j["step"].get<int64_t>()});
      if (j["kind"] == "step") {
        CHECK(j["elapsed_s"].get<double>() >= elapsed);  // training time, going on across the resume
        elapsed = j["elapsed_s"].get<double>();
      }
    }
    return out;
  };
  using R = std::vector<std::pair<std::string, int64_t>>;
  CHECK(records() == R{{"step", 2}, {"step", 4}, {"epoch", 4}, {"step", 5}});
  CommandResult r = run_command(run + " --log-every 2 --log " + log + " --save " + saved + " --resume " + saved);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const R whole{{"step", 2}, {"step", 4},  {"epoch", 4}, {"step", 5},  {"step", 6},
                {"step", 8}, {"epoch", 8}, {"step", 10}, {"epoch", 10}};
  CHECK(records() == whole);
  // Resumed again from step 5: the records of steps 6 to 10 are the rerun's, not a second copy.
  r = run_command(run + " --log-every 2 --log " + log + " --save " + saved + " --resume " + at5);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(records() == whole);
}

TEST_CASE("log: --resume with a --log that is not a dp_train log is refused and the file left as it was") {
  TempDir dir;
  write_synthetic_dataset(dir.path.string(), 128, 32);
  const std::string saved = dir / "c.st", log = dir / "notes.txt";
  const std::string run = kTrain + " --backend cpu --data " + dir.path.string() + " --batch 32 --quiet";
  REQUIRE(run_command(run + " --steps 3 --save " + saved).exit_code == 0);
  // A text file, and a log whose first line was spoilt: every line of either would have been cut.
  for (const std::string& text :
       {std::string("my notes\nmore notes\n"),
        std::string("{\"kind\":\"step\",\"step\":2}garbage\n{\"kind\":\"step\",\"step\":2}\n")}) {
    CAPTURE(text);
    std::ofstream(log) << text;
    CommandResult r = run_command(run + " --steps 5 --log " + log + " --resume " + saved);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(log + ": line 1 is not a dp_train --log record") != std::string::npos);
    CHECK(slurp(log) == text);
  }
}
