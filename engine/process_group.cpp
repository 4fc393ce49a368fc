#include "engine/process_group.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "engine/error.h"

namespace dp {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"})
    if (const char* s = std::getenv(v); s && *s) return true;
  return false;
}

std::unique_ptr<ProcessGroup> join_if_launched(const char* program) {
  if (!launched_by_mpi()) return nullptr;
  std::unique_ptr<ProcessGroup> group;
  try {
    group = join_process_group();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    std::exit(2);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: could not join the other processes: %s\n", program, e.what());
    std::exit(1);
  }
  if (group->rank() != 0 && !std::freopen("/dev/null", "w", stdout)) {
    std::fprintf(stderr, "%s: %s: error: cannot silence stdout\n", group->who().c_str(), program);
    group->abort(1);
  }
  return group;
}

std::string ProcessGroup::flight_path() const {
  return (std::filesystem::path(flight_dir_) / ("rank" + std::to_string(rank_) + ".json")).string();
}

std::string ProcessGroup::write_flight_record(const std::string& why) {
  const std::string path = flight_path();
  std::error_code ec;
  std::filesystem::create_directories(flight_dir_, ec);
  const nlohmann::json j = {{"rank", rank_},
                            {"size", size_},
                            {"host", host_},
                            {"hosts", hosts_},
                            {"why", why},
                            {"capacity", flight_.capacity()},
                            {"records", flight_.json()}};
  // Written whole, then renamed into place: several threads of a process may time out at once, and a
  // reader may look while the process still writes.
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  const std::string temp = path + ".tmp";
  std::ofstream out(temp, std::ios::trunc);
  out << j.dump(1) << "\n";
  out.close();
  if (!ec && out) std::filesystem::rename(temp, path, ec);
  if (ec || !out) return path + " could not be written (" + (ec ? ec.message() : std::string("a write failed")) + ")";
  return path;
}

std::string ProcessGroup::who(int rank) const {
  const std::string host = size_t(rank) < hosts_.size() ? hosts_[size_t(rank)] : host_;
  return "rank " + std::to_string(rank) + " (" + host + ")";
}

}  // namespace dp
