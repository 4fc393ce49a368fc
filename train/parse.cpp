#include "train/parse.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string_view>

#include "engine/error.h"

namespace dp {
namespace {

// Sizes in messages: "1 byte", "4 bytes", "64 KiB", exact (format_bytes would round).
std::string exact_size(int64_t bytes) {
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  int u = -1;
  while (u < 3 && bytes >= 1024 && bytes % 1024 == 0) bytes /= 1024, ++u;
  if (u >= 0) return std::to_string(bytes) + " " + units[u];
  return std::to_string(bytes) + (bytes == 1 ? " byte" : " bytes");
}

}  // namespace

std::string size_forms(int64_t min_bytes) {
  return "give a size of at least " + exact_size(min_bytes) +
         ": a number of bytes, whole or with a suffix K, M, G or T (powers of 1024; k, KB, KiB read the same), "
         "e.g. 4096, 512M, 1.5G";
}

int64_t parse_bytes(const std::string& text, const std::string& flag, int64_t min_bytes) {
  auto bad = [&](const std::string& why) {
    return UsageError(flag + ": '" + text + "' " + why + "; " + size_forms(min_bytes));
  };
  // Digits with an optional fraction, then the suffix: no sign, space, exponent or hex (strtod, used
  // before, also read " 5", "0x10" and "1e3").
  auto digit = [&](size_t i) { return i < text.size() && text[i] >= '0' && text[i] <= '9'; };
  size_t used = 0;
  while (digit(used)) ++used;
  bool any_digit = used > 0;
  if (used < text.size() && text[used] == '.')
    for (++used; digit(used); ++used) any_digit = true;
  if (used == 0 && text.size() > 1 && text[0] == '-' && (digit(1) || (text[1] == '.' && digit(2))))
    throw bad("is negative");
  if (!any_digit) throw bad("is not a size");
  std::string suffix = text.substr(used);
  for (auto& c : suffix) c = char(std::toupper(static_cast<unsigned char>(c)));
  if (suffix.size() > 1 && suffix.back() == 'B') suffix.pop_back();  // KB, KIB
  if (suffix.size() == 2 && suffix[1] == 'I') suffix.pop_back();     // KI(B)
  const std::string units = "KMGT";
  long double scale = 1;
  if (suffix.size() == 1 && units.find(suffix[0]) != std::string::npos)
    scale = std::ldexp(1.0L, 10 * int(units.find(suffix[0]) + 1));
  else if (!suffix.empty() && suffix != "B")
    throw bad("is not a size (the suffix '" + text.substr(used) + "' is none of K, M, G, T)");
  // long double (80 or 128 bits on Linux) holds every integer up to 2^64: the bound is exact.
  const long double bytes = std::strtold(text.substr(0, used).c_str(), nullptr) * scale;
  if (bytes >= std::ldexp(1.0L, 63)) throw bad("is too large: a size is less than 2^63 bytes (8 EiB)");
  const int64_t whole = int64_t(bytes);  // a fraction of a byte is dropped
  if (whole < min_bytes)
    throw bad("is " + (whole == 0 ? std::string("0 bytes") : exact_size(whole)) +
              (bytes != (long double)whole ? " (rounded down to whole bytes)" : ""));
  return whole;
}

uint64_t parse_seed(const std::string& text, const std::string& flag) {
  uint64_t v = 0;
  const char *first = text.data(), *last = first + text.size();
  // Digits only: from_chars takes no sign, no space, no exponent, and says when the value is past 2^64-1
  // (strtoull, which CLI11 uses, wraps "-1" to 2^64-1 and saturates larger values there).
  auto [end, ec] = std::from_chars(first, last, v);
  bool digits = !text.empty() && std::all_of(first, last, [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || ec != std::errc() || end != last)
    throw UsageError(flag + ": '" + text + "' is not a seed; give a whole number from 0 to " +
                     std::to_string(UINT64_MAX) + (digits ? " (it is larger)" : ""));
  return v;
}

bool decimal_characters(const std::string& text) {
  return text.find_first_not_of("0123456789+-.eE") == std::string::npos;
}

float parse_float(const std::string& text, const std::string& flag) {
  auto bad = [&](const std::string& why) { return UsageError(flag + ": '" + text + "' " + why); };
  const char* first = text.c_str();
  char* end = nullptr;
  errno = 0;
  long double v = std::strtold(first, &end);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || end != first + text.size())
    throw bad("is not a number");
  // One syntax, decimal (strtold also reads hexadecimal floats, inf and nan): digits, a point, an exponent.
  if (!decimal_characters(text)) throw bad("is not a decimal number (write it as 0.125 or 1.25e-1)");
  const bool range = errno == ERANGE;
  const float f = float(v);
  // A value float cannot hold is refused rather than rounded to 0 or infinity, where the checks after
  // parsing would call it "not positive" or "not finite" when it is neither.
  if ((range && std::fabs(v) < 1) || (v != 0 && f == 0))
    throw bad("is too small for a float (it would round to 0; the smallest positive float is 1.4e-45)");
  if ((range && std::fabs(v) >= 1) || (std::isfinite(v) && !std::isfinite(f)))
    throw bad("is too large for a float (at most 3.4e38)");
  return f;
}

float parse_clip_grad_norm(const std::string& text) {
  const float v = parse_float(text, "--clip-grad-norm");
  if (!std::isfinite(v) || v <= 0)
    throw UsageError("--clip-grad-norm: " + text +
                     " is not a positive finite norm; give the largest gradient norm to allow, e.g. 1.0 (leave "
                     "the option out for no clipping)");
  return v;
}

std::vector<int> parse_int_list(const std::string& text, const std::string& flag, const std::string& what,
                                const std::string& example) {
  std::vector<int> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    size_t used = 0;
    int v = -1;
    try {
      v = std::stoi(item, &used);
    } catch (...) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0)
      throw UsageError(flag + ": '" + item + "' in '" + text + "' is not a " + what + "; give comma-separated " + what +
                       "s >= 0, e.g. " + example);
    out.push_back(v);
  }
  if (out.empty()) throw UsageError(flag + ": the list is empty; give at least one " + what + ", e.g. " + example);
  return out;
}

std::vector<int> parse_ids(const std::string& text, const std::string& flag) {
  return parse_int_list(text, flag, "device id", "0,1");
}

std::string shell_quote(const std::string& arg) {
  auto plain = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) ||
           std::string_view("_@%+=:,./-").find(c) != std::string_view::npos;
  };
  if (!arg.empty() && std::all_of(arg.begin(), arg.end(), plain)) return arg;
  std::string out = "'";
  for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string shell_command_line(int argc, const char* const* argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {  // two appends: GCC 12 warns (-Wrestrict) at " " + a temporary
    if (i) out += ' ';
    out += shell_quote(argv[i]);
  }
  return out;
}

}  // namespace dp
