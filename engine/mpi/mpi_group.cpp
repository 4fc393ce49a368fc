// The process group over MPI (engine/process_group.h): OpenMPI launches the processes and moves their
// host memory. Every collective is MPI's non-blocking form (MPI_Iallreduce, MPI_Ibcast, ...) waited
// for with MPI_Test under poll_until, so that each wait has the --timeout deadline and a local
// device's failure ends it; MPI's errors come back as return codes (MPI_ERRORS_RETURN) and are thrown
// with the call, file and line.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "engine/error.h"
#include "engine/failpoint.h"
#include "engine/process_group.h"
#include "kernels/cpu/kernels.h"

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

// --grad-dtype's sums across processes: MPI has no bf16 and (before MPI 4.1's MPIX types) no fp16,
// so the bits travel as MPI_UINT16_T and these user operations add them, each partial sum rounded to
// the type by the CPU kernel the rings inside a process use (cpu::add_typed: math::add16). Declared
// commutative, as MPI_SUM is.
template <DType T>
void sum16(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  cpu::add_typed(T, *len, static_cast<const uint16_t*>(in), static_cast<uint16_t*>(inout));
}

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
    DP_MPI(MPI_Comm_dup(host_comm_, &inspect_comm_));
    DP_MPI(MPI_Op_create(&sum16<DType::bf16>, 1, &bf16_sum_));
    DP_MPI(MPI_Op_create(&sum16<DType::fp16>, 1, &fp16_sum_));
    // Every host name, and rank 0's pid, which names the job's flight-record directory.
    std::vector<std::string> hosts = all_gather(host_ + " " + std::to_string(::getpid()),
                                                Deadline::after(kDefaultTimeout), "the exchange of host names");
    for (std::string& h : hosts) hosts_.push_back(h.substr(0, h.rfind(' ')));
    const char* tmp = std::getenv("TMPDIR");
    flight_dir_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/dp-flight-" + hosts_[0] + "-" +
                  hosts[0].substr(hosts[0].rfind(' ') + 1);
  }

  ~MpiGroup() override {
    for (MPI_Comm& c : channels_) MPI_Comm_free(&c);
    MPI_Comm_free(&inspect_comm_);
    MPI_Op_free(&bf16_sum_);
    MPI_Op_free(&fp16_sum_);
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

  void all_reduce(int channel, void* buf, int64_t count, DType type, const Deadline& deadline, const std::string& what,
                  const std::function<bool()>& aborted) override {
    const int64_t id = record(channel, "all_reduce", count * dtype_size(type), what);
    MPI_Request req;
    DP_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, mpi_count(count, what), datatype(type), sum(type), comm(channel), &req));
    wait(req, deadline, what, aborted, id);
  }

  // MPI_IN_PLACE would leave the sum at the start of buf, not at this rank's block: a separate
  // receive buffer, copied into place.
  void reduce_scatter(int channel, void* buf, int64_t count, DType type, const Deadline& deadline,
                      const std::string& what, const std::function<bool()>& aborted) override {
    const int64_t block = count * dtype_size(type);
    std::vector<std::byte> mine(static_cast<size_t>(block));
    const int64_t id = record(channel, "reduce_scatter", block * size_, what);
    MPI_Request req;
    DP_MPI(MPI_Ireduce_scatter_block(buf, mine.data(), mpi_count(count, what), datatype(type), sum(type), comm(channel),
                                     &req));
    wait(req, deadline, what, aborted, id);
    std::copy(mine.begin(), mine.end(), static_cast<std::byte*>(buf) + int64_t(rank_) * block);
  }

  void all_gather(int channel, float* buf, int64_t count, const Deadline& deadline, const std::string& what,
                  const std::function<bool()>& aborted) override {
    const int64_t id = record(channel, "all_gather", count * 4 * size_, what);
    MPI_Request req;
    DP_MPI(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, mpi_count(count, what), MPI_FLOAT, comm(channel),
                          &req));
    wait(req, deadline, what, aborted, id);
  }

  void all_reduce_sum(double* buf, int count, const Deadline& deadline, const std::string& what) override {
    const int64_t id = record(kHostChannel, "all_reduce_sum", count * 8, what);
    MPI_Request req;
    DP_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_DOUBLE, MPI_SUM, host_comm_, &req));
    wait(req, deadline, what, nullptr, id);
  }

  void all_reduce_max(double* buf, int count, const Deadline& deadline, const std::string& what) override {
    const int64_t id = record(kHostChannel, "all_reduce_max", count * 8, what);
    MPI_Request req;
    DP_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_DOUBLE, MPI_MAX, host_comm_, &req));
    wait(req, deadline, what, nullptr, id);
  }

  void broadcast(int channel, void* buf, int64_t bytes, int root, const Deadline& deadline, const std::string& what,
                 const std::function<bool()>& aborted) override {
    const int64_t id = record(channel, "broadcast", bytes, what);
    MPI_Request req;
    DP_MPI(MPI_Ibcast(buf, mpi_count(bytes, what), MPI_BYTE, root, comm(channel), &req));
    wait(req, deadline, what, aborted, id);
  }

  std::vector<std::string> all_gather(const std::string& mine, const Deadline& deadline,
                                      const std::string& what) override {
    int len = mpi_count(int64_t(mine.size()), what);
    std::vector<int> lens(static_cast<size_t>(size_)), at(static_cast<size_t>(size_));
    // Recorded with 0 bytes: each process's string has its own length.
    const int64_t id = record(kHostChannel, "all_gather_strings", 0, what);
    MPI_Request req;
    DP_MPI(MPI_Iallgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, host_comm_, &req));
    wait(req, deadline, what, nullptr, id, /*last=*/false);
    int64_t total = 0;
    for (int r = 0; r < size_; ++r) at[size_t(r)] = mpi_count(total, what), total += lens[size_t(r)];
    std::string all(size_t(total), '\0');
    DP_MPI(MPI_Iallgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), at.data(), MPI_CHAR, host_comm_, &req));
    wait(req, deadline, what, nullptr, id);
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r) out.push_back(all.substr(size_t(at[size_t(r)]), size_t(lens[size_t(r)])));
    return out;
  }

  void barrier(const Deadline& deadline, const std::string& what) override {
    const int64_t id = record(kHostChannel, "barrier", 0, what);
    MPI_Request req;
    DP_MPI(MPI_Ibarrier(host_comm_, &req));
    wait(req, deadline, what, nullptr, id);
  }

  void all_reduce_blocking(float* buf, int64_t count) override {
    DP_MPI(MPI_Allreduce(MPI_IN_PLACE, buf, mpi_count(count, "all_reduce_blocking"), MPI_FLOAT, MPI_SUM, host_comm_));
  }
  [[noreturn]] void abort(int code) override {
    // The records of this process, for the side-by-side view of every rank's (scripts/flight.py).
    if (flight_.capacity() > 0 && !flight_written_) {
      const std::string path = write_flight_record("this process failed (exit " + std::to_string(code) + ")");
      std::fprintf(stderr, "%s: the last collectives across processes: %s\n", who().c_str(), path.c_str());
      std::fflush(stderr);
    }
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; should it, the process still ends
  }

 private:
  static MPI_Datatype datatype(DType t) { return t == DType::fp32 ? MPI_FLOAT : MPI_UINT16_T; }
  MPI_Op sum(DType t) const { return t == DType::fp32 ? MPI_SUM : t == DType::bf16 ? bf16_sum_ : fp16_sum_; }
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

  // A collective begins: its flight record (the test build's DP_TEST_DESYNC records one with more bytes
  // than it moves, a process made to disagree; engine/failpoint.h).
  int64_t record(int channel, const char* kind, int64_t bytes, const std::string& what) {
    return flight_.begin(channel, kind, failpoint::recorded_bytes(rank_, flight_.step(), bytes), what);
  }

  // MPI_Test until the request completes (the collective's record done with the `last` wait). Past the
  // deadline or on an abort the request stays active: the caller's failure ends the job (MPI_Abort),
  // which is the only way to end an MPI collective. Past the deadline this rank's records are written
  // and the other processes asked where they are (inspect), so the message names the missing ranks.
  void wait(MPI_Request& req, const Deadline& deadline, const std::string& what, const std::function<bool()>& aborted,
            int64_t id, bool last = true) {
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
      flight_.end(id, FlightRecord::State::timed_out);
      flight_written_ = true;
      const std::string path = flight_.capacity() > 0 ? write_flight_record("a collective timed out") : "";
      // Not one device's error but the processes': named by rank and host (a device thread's caller
      // adds its device).
      std::string why = inspect(std::min(std::max(deadline.seconds, 1.0), 30.0));
      if (!path.empty())
        why += "; this rank's last collectives: " + path + " (every rank's: scripts/flight.py " + flight_dir_ + ")";
      throw std::runtime_error(timeout_message(what + " on " + who(), deadline.seconds, why));
    } catch (...) {
      flight_.end(id, FlightRecord::State::aborted);
      throw;
    }
    if (last) flight_.end(id, FlightRecord::State::done);
  }

  // After a timeout: where this process waits (its pending collectives) to every other process, and
  // theirs asked for, over a communicator of its own, as Horovod's stall inspector asks. A process
  // answers once its own first wait times out, so the question stays open `window` seconds (the
  // --timeout: a process that began its wait up to that much later still answers); those that never
  // answer are named. Once per process: its other threads' timeouts take the same answer.
  std::string inspect(double window) {
    std::lock_guard<std::mutex> lock(inspect_m_);
    if (!inspected_.empty()) return inspected_;
    std::string* status = new std::string;  // kept alive: a send to a stopped process may never complete
    for (const FlightRecord& r : flight_.records())
      if (r.state == FlightRecord::State::pending || r.state == FlightRecord::State::timed_out)
        *status += to_line(r) + "\n";
    constexpr int kTag = 1, kMax = 1 << 16;
    std::vector<MPI_Request> sends(size_t(size_), MPI_REQUEST_NULL), recvs(size_t(size_), MPI_REQUEST_NULL);
    auto* bufs = new std::vector<std::vector<char>>(size_t(size_), std::vector<char>(kMax));  // as status
    std::vector<std::string> got(static_cast<size_t>(size_));
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      MPI_Isend(status->data(), int(std::min<size_t>(status->size(), kMax)), MPI_CHAR, p, kTag, inspect_comm_,
                &sends[size_t(p)]);
      MPI_Irecv((*bufs)[size_t(p)].data(), kMax, MPI_CHAR, p, kTag, inspect_comm_, &recvs[size_t(p)]);
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(window);
    for (int open = size_ - 1; open > 0 && std::chrono::steady_clock::now() < until;) {
      for (int p = 0; p < size_; ++p) {
        int flag = 0, n = 0;
        MPI_Status st;
        if (recvs[size_t(p)] == MPI_REQUEST_NULL || MPI_Test(&recvs[size_t(p)], &flag, &st) != MPI_SUCCESS || !flag)
          continue;
        MPI_Get_count(&st, MPI_CHAR, &n);
        got[size_t(p)].assign((*bufs)[size_t(p)].data(), size_t(n));
        --open;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::string missing;
    inspected_ = who() + " waits in " + waits_in(*status);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      if (recvs[size_t(p)] != MPI_REQUEST_NULL)
        missing += (missing.empty() ? "" : ", ") + who(p);
      else
        inspected_ += "; " + who(p) + " waits in " + waits_in(got[size_t(p)]);
    }
    if (!missing.empty())
      inspected_ = missing + " did not answer within " + std::to_string(int(window)) +
                   " s (stopped, or busy outside any collective); " + inspected_;
    return inspected_;
  }

  // The pending collectives of an inspect() status, described.
  static std::string waits_in(const std::string& status) {
    std::string out;
    for (const FlightRecord& r : from_lines(status)) out += (out.empty() ? "" : " and ") + describe(r);
    return out.empty() ? "no recorded collective" : out;
  }

  MPI_Comm host_comm_ = MPI_COMM_NULL, inspect_comm_ = MPI_COMM_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL, fp16_sum_ = MPI_OP_NULL;
  std::vector<MPI_Comm> channels_;
  std::atomic<bool> flight_written_{false};
  std::mutex inspect_m_;
  std::string inspected_;  // inspect()'s answer, once found
};

}  // namespace

bool mpi_built() { return true; }

std::unique_ptr<ProcessGroup> join_process_group() { return std::make_unique<MpiGroup>(); }

}  // namespace dp
