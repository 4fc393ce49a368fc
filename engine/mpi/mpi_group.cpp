// The process group over MPI (engine/process_group.h): OpenMPI launches the processes and moves their
// host memory. Every collective is MPI's non-blocking form (MPI_Iallreduce, MPI_Ibcast, ...) waited
// for with MPI_Test under poll_until, so that each wait has the --timeout deadline and a local
// device's failure ends it; MPI's errors come back as return codes (MPI_ERRORS_RETURN) and are thrown
// with the call, file and line.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <stdexcept>

#include "engine/error.h"
#include "engine/process_group.h"

namespace dp {
namespace {

void check(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw std::runtime_error(std::string(call) + " failed: " + std::string(text, size_t(len)) + " (" + file + ":" +
                           std::to_string(line) + ")");
}
#define DP_MPI(call) check((call), #call, __FILE__, __LINE__)

int mpi_count(int64_t count, const std::string& what) {
  if (count > INT_MAX)
    throw std::invalid_argument(what + ": " + std::to_string(count) + " elements, more than MPI's int count holds");
  return int(count);
}

class MpiGroup final : public ProcessGroup {
 public:
  MpiGroup() {
    // OpenMPI's non-blocking all-reduce (coll/libnbc) picks recursive doubling or binomial trees by
    // size, and at LeNet's 516 KB gradient between 2 processes it took 1.6-1.7x as long as the blocking
    // MPI_Allreduce (dp_bench comm under mpirun); its ring took as long as the blocking call, and is
    // the algorithm the byte model counts. So the ring, unless the user chose (MCA variables are read
    // from the environment at MPI_Init; other MPIs ignore the name).
    setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "ring", 0);
    int provided = 0;
    DP_MPI(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    if (provided < MPI_THREAD_MULTIPLE) {
      MPI_Finalize();
      throw UsageError("MPI grants thread level " + std::to_string(provided) +
                       " here; dp's device threads each call MPI and need MPI_THREAD_MULTIPLE (" +
                       std::to_string(MPI_THREAD_MULTIPLE) + "): use an MPI built with thread support");
    }
    DP_MPI(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    DP_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &host_comm_));
    DP_MPI(MPI_Comm_rank(host_comm_, &rank_));
    DP_MPI(MPI_Comm_size(host_comm_, &size_));
    char name[MPI_MAX_PROCESSOR_NAME];
    int len = 0;
    DP_MPI(MPI_Get_processor_name(name, &len));
    host_.assign(name, size_t(len));
    hosts_ = all_gather(host_, Deadline::after(kDefaultTimeout), "the exchange of host names");
  }

  ~MpiGroup() override {
    for (MPI_Comm& c : channels_) MPI_Comm_free(&c);
    MPI_Comm_free(&host_comm_);
    MPI_Finalize();
  }

  void open_channels(int n) override {
    while (int(channels_.size()) < n) {
      MPI_Comm c;
      DP_MPI(MPI_Comm_dup(host_comm_, &c));
      channels_.push_back(c);
    }
  }

  void all_reduce(int channel, float* buf, int64_t count, const Deadline& deadline, const std::string& what,
                  const std::function<bool()>& aborted) override {
    MPI_Request req;
    DP_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, mpi_count(count, what), MPI_FLOAT, MPI_SUM, comm(channel), &req));
    wait(req, deadline, what, aborted);
  }

  // MPI_IN_PLACE would leave the sum at the start of buf, not at this rank's block: a separate
  // receive buffer, copied into place.
  void reduce_scatter(int channel, float* buf, int64_t count, const Deadline& deadline, const std::string& what,
                      const std::function<bool()>& aborted) override {
    std::vector<float> mine(static_cast<size_t>(count));
    MPI_Request req;
    DP_MPI(
        MPI_Ireduce_scatter_block(buf, mine.data(), mpi_count(count, what), MPI_FLOAT, MPI_SUM, comm(channel), &req));
    wait(req, deadline, what, aborted);
    std::copy(mine.begin(), mine.end(), buf + int64_t(rank_) * count);
  }

  void all_gather(int channel, float* buf, int64_t count, const Deadline& deadline, const std::string& what,
                  const std::function<bool()>& aborted) override {
    MPI_Request req;
    DP_MPI(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, mpi_count(count, what), MPI_FLOAT, comm(channel),
                          &req));
    wait(req, deadline, what, aborted);
  }

  void all_reduce_sum(double* buf, int count, const Deadline& deadline, const std::string& what) override {
    MPI_Request req;
    DP_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_DOUBLE, MPI_SUM, host_comm_, &req));
    wait(req, deadline, what, nullptr);
  }

  void all_reduce_max(double* buf, int count, const Deadline& deadline, const std::string& what) override {
    MPI_Request req;
    DP_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_DOUBLE, MPI_MAX, host_comm_, &req));
    wait(req, deadline, what, nullptr);
  }

  void broadcast(int channel, void* buf, int64_t bytes, int root, const Deadline& deadline, const std::string& what,
                 const std::function<bool()>& aborted) override {
    MPI_Request req;
    DP_MPI(MPI_Ibcast(buf, mpi_count(bytes, what), MPI_BYTE, root, comm(channel), &req));
    wait(req, deadline, what, aborted);
  }

  std::vector<std::string> all_gather(const std::string& mine, const Deadline& deadline,
                                      const std::string& what) override {
    int len = mpi_count(int64_t(mine.size()), what);
    std::vector<int> lens(static_cast<size_t>(size_)), at(static_cast<size_t>(size_));
    MPI_Request req;
    DP_MPI(MPI_Iallgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, host_comm_, &req));
    wait(req, deadline, what, nullptr);
    int64_t total = 0;
    for (int r = 0; r < size_; ++r) at[size_t(r)] = mpi_count(total, what), total += lens[size_t(r)];
    std::string all(size_t(total), '\0');
    DP_MPI(MPI_Iallgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), at.data(), MPI_CHAR, host_comm_, &req));
    wait(req, deadline, what, nullptr);
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r) out.push_back(all.substr(size_t(at[size_t(r)]), size_t(lens[size_t(r)])));
    return out;
  }

  void barrier(const Deadline& deadline, const std::string& what) override {
    MPI_Request req;
    DP_MPI(MPI_Ibarrier(host_comm_, &req));
    wait(req, deadline, what, nullptr);
  }

  void all_reduce_blocking(float* buf, int64_t count) override {
    DP_MPI(MPI_Allreduce(MPI_IN_PLACE, buf, mpi_count(count, "all_reduce_blocking"), MPI_FLOAT, MPI_SUM, host_comm_));
  }
  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; should it, the process still ends
  }

 private:
  MPI_Comm comm(int channel) const {
    if (channel == kHostChannel) return host_comm_;
    if (channel < 0 || channel >= int(channels_.size()))
      throw std::logic_error("process group: channel " + std::to_string(channel) + " was never opened");
    return channels_[size_t(channel)];
  }

  // OpenMPI's non-blocking collectives (coll/libnbc) advance only inside MPI_Test: a wait that sleeps
  // 100 µs between tests stalls each of the ring's rounds that long. So the test is repeated with a
  // yield for the first kSpin of a wait (MPI's blocking calls poll the whole time), and only a longer
  // wait (a peer still computing, saving) sleeps between tests.
  static constexpr std::chrono::microseconds kSpin = std::chrono::milliseconds(20);

  // MPI_Test until the request completes. Past the deadline or on an abort the request stays active:
  // the caller's failure ends the job (MPI_Abort), which is the only way to end an MPI collective.
  void wait(MPI_Request& req, const Deadline& deadline, const std::string& what, const std::function<bool()>& aborted) {
    auto done = [&] {
      int flag = 0;
      DP_MPI(MPI_Test(&req, &flag, MPI_STATUS_IGNORE));
      return flag != 0;
    };
    try {
      poll_until(
          done, aborted ? aborted : [] { return false; }, deadline, rank_, [&] { return what + " on " + who(); },
          kSpin);
    } catch (const TimedOut&) {
      // Not one device's error but the processes': named by rank and host (a device thread's caller
      // adds its device).
      throw std::runtime_error(timeout_message(what + " on " + who(), deadline.seconds,
                                               "another process stopped answering (it never joined)"));
    }
  }

  MPI_Comm host_comm_ = MPI_COMM_NULL;
  std::vector<MPI_Comm> channels_;
};

}  // namespace

bool mpi_built() { return true; }

std::unique_ptr<ProcessGroup> join_process_group() { return std::make_unique<MpiGroup>(); }

}  // namespace dp
