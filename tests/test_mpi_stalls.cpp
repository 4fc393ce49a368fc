// A job that stalls explains itself (engine/flight_recorder.h, engine/mpi/mpi_group.cpp): a rank frozen
// with SIGSTOP is named by the others once --timeout passes, each of them writes its flight records where
// the message says, scripts/flight.py marks the collective they wait in, and the job ends with no
// process left; processes whose collectives differ are stopped by the step's desync check, naming the
// first collective that differs. The recorder's ring and fingerprint are checked on their own first.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "engine/flight_recorder.h"
#include "engine/process_group.h"
#include "tests/mpi_job.h"
#include "tests/util.h"

using namespace dp;
using namespace dp::test;
using namespace dp::test::mpi;

namespace {

const std::string kFlightPy = "/usr/bin/python3 " + std::string(DP_SOURCE_DIR) + "/scripts/flight.py ";

// The dp_train process of job rank `rank` among those whose command line holds `marker`, or -1.
pid_t rank_pid(const std::string& marker, int rank) {
  CommandResult pids = run_command("pgrep -f '^" + std::string(DP_TRAIN_BIN) + ".*" + marker + "'");
  std::istringstream in(pids.output);
  for (pid_t pid; in >> pid;)
    if (slurp("/proc/" + std::to_string(pid) + "/environ").find("OMPI_COMM_WORLD_RANK=" + std::to_string(rank)) !=
        std::string::npos)
      return pid;
  return -1;
}

}  // namespace

TEST_CASE("flight recorder: a ring of the last N, a fingerprint blind to the channels' interleaving, 0 is off") {
  FlightRecorder a(4), b(4);
  a.set_step(7), b.set_step(7);  // two processes at the same step
  for (int i = 0; i < 6; ++i) a.end(a.begin(i % 2, "all_reduce", 100 + i % 2, "x"), FlightRecord::State::done);
  const std::vector<FlightRecord> kept = a.records();
  REQUIRE(kept.size() == 4);  // the last 4 of 6, oldest first
  CHECK(kept.front().id == 3);
  CHECK(kept.back().id == 6);
  CHECK(kept.back().seq == 3);  // channel 1's third
  CHECK(kept.back().step == 7);
  CHECK(kept.back().state == FlightRecord::State::done);
  // The same collectives begun in another order across channels (each channel's own order kept).
  for (int i : {1, 0, 3, 2, 5, 4}) b.begin(i % 2, "all_reduce", 100 + i % 2, "y");
  CHECK(a.take_fingerprint() == b.take_fingerprint());
  CHECK(a.take_fingerprint() == 0);  // nothing since
  a.begin(0, "all_reduce", 100, "x");
  b.begin(0, "all_reduce", 104, "y");  // another size: another fingerprint
  std::vector<std::string> lines;
  CHECK(a.take_fingerprint(&lines) != b.take_fingerprint());
  CHECK(lines == std::vector<std::string>{"0 4 all_reduce 100 7"});  // to_line: channel seq kind bytes step
  a.begin(0, "all_gather", 8, "x");
  CHECK(a.records().back().state == FlightRecord::State::pending);
  CHECK(a.json().back()["end_s"].is_null());
  FlightRecorder off(0);
  CHECK(off.begin(0, "all_reduce", 100, "x") == 0);
  CHECK(off.take_fingerprint() == 0);
  CHECK(off.records().empty());
}

TEST_CASE("mpi: a rank frozen with SIGSTOP is named, the others' flight records mark where they wait, none left") {
  if (!have_mpi()) return;
  Job job;
  const std::string flight = job.dir / "flight", out = job.dir / "out.txt", marker = job.dir / "data";
  const auto start = std::chrono::steady_clock::now();
  Spawned run(kMpirun + " -np 3 " + kTrainCpu + job.with("--epochs 100000 --timeout 5 --flight-dir " + flight) + " > " +
              out + " 2>&1");
  pid_t victim = -1;
  for (int i = 0; i < 200 && victim < 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    victim = rank_pid(marker, 2);
  }
  REQUIRE(victim > 0);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // training, every rank in its steps
  REQUIRE(::kill(victim, SIGSTOP) == 0);
  int status = 0;
  REQUIRE(::waitpid(run.pid, &status, 0) == run.pid);
  run.pid = -1;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::kill(victim, SIGKILL);  // should mpirun have left it stopped (the check below says so)
  const std::string output = slurp(out);
  INFO(output);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) != 0);
  CHECK(seconds < 40);  // a bound on a hang, not a speed: 5 s --timeout, 5 s for the others' answers
  CHECK(output.find("rank 2 (") != std::string::npos);
  CHECK(output.find("did not answer within 5 s (stopped, or busy outside any collective)") != std::string::npos);
  CHECK(output.find("this rank's last collectives: " + flight + "/rank") != std::string::npos);
  for (int r : {0, 1}) {  // every surviving rank's records, the collective it waited in marked
    CAPTURE(r);
    const std::string path = flight + "/rank" + std::to_string(r) + ".json";
    REQUIRE(std::filesystem::exists(path));
    const nlohmann::json j = nlohmann::json::parse(slurp(path));
    CHECK(j["rank"] == r);
    REQUIRE(!j["records"].empty());
    // Each of its two devices waits on its own channel; the wait that timed out is marked, and it need
    // not be the one that began last (the other's may be aborted when the first gives up).
    const auto& records = j["records"];
    CHECK(
        std::any_of(records.begin(), records.end(), [](const nlohmann::json& x) { return x["state"] == "timed out"; }));
  }
  const CommandResult view = run_command(kFlightPy + flight);
  INFO(view.output);
  CHECK(view.exit_code == 0);
  // The collective ranks 0 and 1 wait in is marked. (mpirun resumes the stopped rank to end it, so it
  // may write its own records too, as it ends: then its column shows where it stopped.)
  bool marked = false;
  std::istringstream lines(view.output);
  for (std::string line; std::getline(lines, line);)
    marked = marked || (line.rfind(">> ", 0) == 0 && line.find("timed out") != std::string::npos);
  CHECK(marked);
  CHECK(run_command("pgrep -f '^" + std::string(DP_TRAIN_BIN) + ".*" + marker + "'").exit_code == 1);  // none left
}

TEST_CASE("mpi: processes whose collectives differ are stopped at that step's check, the first difference named") {
  if (!have_mpi()) return;
  Job job;
  const std::string flight = job.dir / "flight";
  // A test-only seam: process 1 records its first collective of step 3 as 4 bytes larger.
  CommandResult r = job.mpirun(2, "--devices 2 --steps 6 --flight-dir " + flight, "DP_TEST_DESYNC=1:3");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("the processes ran different collectives in step 3: collective #1 of the step on channel ") !=
        std::string::npos);
  CHECK(r.output.find("rank 1 (") != std::string::npos);
  CHECK(r.output.find("MPI_ABORT") == std::string::npos);  // every process found it: each ends normally
  const CommandResult view = run_command(kFlightPy + flight);
  INFO(view.output);
  CHECK(view.output.find("the ranks differ") != std::string::npos);
  // Without the seam the same job passes every step's check; with the recorder off there is no check.
  CHECK(job.mpirun(2, "--devices 2 --steps 6").exit_code == 0);
  CHECK(job.mpirun(2, "--devices 2 --steps 6 --flight-records 0", "DP_TEST_DESYNC=1:3").exit_code == 0);
}
