// The memory ledger: current and peak bytes per category for one device, and an optional cap.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>

namespace dp {

// gathered: zero3's layers, all-gathered whole for the pass that uses them (booked by zero3 alone;
// tables leave it out where no device booked any).
enum class Category { parameters, gradients, optimizer, activations, inputs, outputs, comm, workspace, gathered };
inline constexpr int kCategories = 9;
const char* category_name(Category c);

struct LedgerSnapshot {
  std::array<int64_t, kCategories> current{};
  std::array<int64_t, kCategories> peak{};     // each category's own peak
  std::array<int64_t, kCategories> at_peak{};  // the breakdown at the moment total peaked
  int64_t total = 0;
  int64_t total_peak = 0;
  std::string describe() const;  // "parameters 516.3 KB, gradients ..., total 3.1 MB"
};

// Whether a table of devices has a row (column) for category c, the largest of their peaks of it:
// every category but gathered, which only where some device booked it.
inline bool shown(Category c, int64_t largest_peak) { return c != Category::gathered || largest_peak > 0; }

class Ledger {
 public:
  explicit Ledger(int device, int64_t cap_bytes = 0) : device_(device), cap_(cap_bytes) {}
  // Throws OutOfMemory naming the device, the category and the ledger when past the cap.
  void book(Category c, int64_t bytes);
  void release(Category c, int64_t bytes);
  void reset_peak();
  LedgerSnapshot snapshot() const;
  int64_t cap() const { return cap_; }

 private:
  int device_;
  int64_t cap_;
  mutable std::mutex mu_;
  LedgerSnapshot s_;
};

std::string format_bytes(int64_t bytes);  // "512 B", "1.5 KiB", "8.58 MiB", "1.20 GiB"
std::string commas(int64_t v);            // 1234567 -> "1,234,567"

}  // namespace dp
