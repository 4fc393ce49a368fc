#include "engine/ledger.h"

#include <cstdio>

#include "engine/error.h"

namespace dp {

const char* category_name(Category c) {
  static const char* names[kCategories] = {"parameters", "gradients", "optimizer", "activations", "inputs",
                                           "outputs",    "comm",      "workspace", "gathered"};
  return names[int(c)];
}

std::string commas(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string format_bytes(int64_t bytes) {
  char buf[32];
  double b = double(bytes);
  if (b < 1024)
    std::snprintf(buf, sizeof buf, "%lld B", (long long)bytes);
  else if (b < 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024);
  else if (b < 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  return buf;
}

std::string LedgerSnapshot::describe() const {
  std::string out;
  for (int i = 0; i < kCategories; ++i) {
    if (current[i] == 0) continue;
    out += std::string(category_name(Category(i))) + " " + format_bytes(current[i]) + ", ";
  }
  return out + "total " + format_bytes(total);
}

void Ledger::book(Category c, int64_t bytes) {
  std::lock_guard lock(mu_);
  if (cap_ > 0 && s_.total + bytes > cap_) {
    throw OutOfMemory(device_, "out of memory: allocating " + format_bytes(bytes) + " of " + category_name(c) +
                                   " would exceed the device's " + format_bytes(cap_) +
                                   " (--device-memory); in use: " + s_.describe());
  }
  int i = int(c);
  s_.current[i] += bytes;
  s_.total += bytes;
  if (s_.current[i] > s_.peak[i]) s_.peak[i] = s_.current[i];
  if (s_.total > s_.total_peak) {
    s_.total_peak = s_.total;
    s_.at_peak = s_.current;
  }
}

void Ledger::release(Category c, int64_t bytes) {
  std::lock_guard lock(mu_);
  s_.current[int(c)] -= bytes;
  s_.total -= bytes;
}

void Ledger::reset_peak() {
  std::lock_guard lock(mu_);
  s_.peak = s_.current;
  s_.at_peak = s_.current;
  s_.total_peak = s_.total;
}

LedgerSnapshot Ledger::snapshot() const {
  std::lock_guard lock(mu_);
  return s_;
}

}  // namespace dp
