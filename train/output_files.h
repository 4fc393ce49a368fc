// dp's output files: the up-front check of their paths, and the one atomic file writer
// that checkpoints, reports and traces share. Outputs are regular files only: a device, FIFO,
// socket or directory at an output path is refused, a symlink is followed to its target (the link
// stays a link), and an existing file keeps its mode.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dp {

struct TrainOptions;

// Refuses, with a UsageError naming the flags, before anything is trained or written: an output
// (--save, --report, --trace, --log) that exists and is not a regular file, whose directory is missing or
// not writable, two outputs that are the same file, and an output that is an input (--load,
// --resume, a file of the --data directory). --save may name the --resume checkpoint: continuing
// a run in place is what --resume is for.
void check_output_paths(const TrainOptions& o);

// The same checks for other front ends' outputs (dp_bench's --json, --trace, --plot), each with the
// flag it came from; an empty path is one not given. check_output_file: one output file as above.
// check_distinct_outputs: two outputs (flag, path) that are the same file. check_output_directory:
// a directory of outputs, which may not exist yet (then only its last level will be made: its parent
// must exist, be a directory and take new files).
void check_output_file(const std::string& flag, const std::string& path);
void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& outputs);
void check_output_directory(const std::string& flag, const std::string& path);

// Writes `parts`, concatenated, to `path`: into a short hidden temporary file beside the target,
// fsynced, then renamed over it, so a crash leaves the old file or the new one. A symlink is followed
// to its final target; an existing target keeps its mode and owner; a failed write removes the
// temporary file. Throws UsageError where the path is not a regular file, IoError where the system
// refuses (disk full, permission), naming the path and the OS's reason.
void write_file_atomically(const std::string& path, const std::vector<std::string_view>& parts);

// Removes every temporary file a write (or check_output_paths' writability probe) has in flight, so
// that a process leaving with _exit (a second signal, the grace deadline) leaves none behind; the
// target keeps its previous contents. Async-signal-safe: only atomics, unlink and fixed buffers.
void remove_temp_files() noexcept;

}  // namespace dp
