// The failpoints of a release binary: none. Every call does nothing (engine/failpoint.h).
#include "engine/failpoint.h"

namespace dp::failpoint {

void at(const char*, int64_t) {}
void device_call(const Device&, const char*) {}
std::chrono::milliseconds upload_delay(const Device&) { return std::chrono::milliseconds(0); }
std::chrono::milliseconds peer_copy_delay(const Device&) { return std::chrono::milliseconds(0); }
std::chrono::milliseconds step_end_delay(const Device&) { return std::chrono::milliseconds(0); }
void communicator_built(const Communicator&) {}
void collective(const Communicator&, int, Collective, const std::function<bool()>&, double) {}
void across_processes(const Communicator&, int, int, double) {}
bool nccl_always() { return false; }
double verify_offset() { return 0; }
int64_t recorded_bytes(int, int64_t, int64_t bytes) { return bytes; }

}  // namespace dp::failpoint
