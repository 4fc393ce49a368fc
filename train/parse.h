// The values of flags read exactly, shared by the front ends (dp_train, dp_bench): every bad argument
// becomes a UsageError that says what is wrong and what is accepted. No CLI11 here (see cli.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dp {

// "4096", "512M", "1.5G", "2TiB" -> bytes (suffixes K, M, G, T: powers of 1024; a fraction of a byte
// is dropped). Anything else, and sizes under min_bytes or from 2^63 bytes on, throws UsageError
// naming the flag and the accepted forms.
int64_t parse_bytes(const std::string& text, const std::string& flag, int64_t min_bytes = 1);
// The accepted forms of a size, as parse_bytes's messages give them ("give a size of at least ...").
std::string size_forms(int64_t min_bytes);
// The smallest --device-memory: LeNet-5's parameters alone take 241 KiB, so a cap under 64 KiB is a
// slip (0.5 meant "no cap" before it was refused), not a request.
inline constexpr int64_t kMinDeviceMemory = 64 << 10;
// "12345" -> 12345: a seed, exactly 0..2^64-1; a sign, a fraction, an exponent or a larger value
// throws UsageError naming the flag (nothing wraps).
uint64_t parse_seed(const std::string& text, const std::string& flag);
// "0.1", "1e-3" -> the float; a value float cannot hold (underflows to 0, overflows to infinity) or
// text that is not a number throws UsageError naming the flag. NaN, infinity and negative values
// pass: the range checks after parsing name those.
float parse_float(const std::string& text, const std::string& flag);
// --clip-grad-norm's value: a positive finite norm, else UsageError saying what to give.
float parse_clip_grad_norm(const std::string& text);
// Whether text has only what a decimal number is written with (digits, a sign, a point, an exponent):
// dp's one number syntax, where strtod would also take hexadecimal, inf and nan.
bool decimal_characters(const std::string& text);
// "2,4,8" -> {2, 4, 8}: comma-separated integers >= 0. Throws UsageError naming the flag, the item
// that is not a `what` ("device id", "batch size") and an example list.
std::vector<int> parse_int_list(const std::string& text, const std::string& flag, const std::string& what,
                                const std::string& example);
// "0,1,2" -> {0, 1, 2}: device ids. Throws UsageError naming the flag.
std::vector<int> parse_ids(const std::string& text, const std::string& flag);
// argv as one line a POSIX shell would run again: arguments joined by spaces, each with a character
// outside [A-Za-z0-9_@%+=:,./-] in single quotes ('it'\''s'), an empty one as ''.
std::string shell_command_line(int argc, const char* const* argv);
std::string shell_quote(const std::string& arg);

}  // namespace dp
