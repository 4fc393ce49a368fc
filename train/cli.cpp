// The CLI11 side of the front ends' parsing (train/cli.h): an exact integer transform, the device
// flags every front end shares, and a parse whose errors become UsageErrors.
#include "train/cli.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "train/options.h"

namespace dp {

// CLI11 reads integers with strtoll in base 0, which saturates at 2^63-1 (a --steps of 2^63 trained
// 2^63-1 steps unsaid) and takes "010" as octal 8. This check reads the text as a decimal T, refuses
// what does not fit, and hands CLI11 back the decimal it read.
template <typename T>
CLI::Validator exact_integer() {
  return CLI::Validator(
      [](std::string& t) {
        T v = 0;
        const char *first = t.data(), *last = first + t.size();
        auto [end, ec] = std::from_chars(first, last, v);
        if (ec == std::errc::result_out_of_range)
          return "'" + t + "' is out of range (" + std::to_string(std::numeric_limits<T>::min()) + " to " +
                 std::to_string(std::numeric_limits<T>::max()) + ")";
        if (ec != std::errc() || end != last) return "'" + t + "' is not a whole number";
        t = std::to_string(v);
        return std::string();
      },
      "", "integer");
}

template CLI::Validator exact_integer<int>();
template CLI::Validator exact_integer<int64_t>();

void DeviceFlags::add(CLI::App& app) {
  // In a "Devices" group of --help; the front end's own options keep the group they had.
  const std::string group = app.option_defaults()->get_group();
  app.option_defaults()->group("Devices");
  app.add_option("--gpus", gpus,
                 "Device ids, comma-separated, or all: every GPU (simulated devices where there is no GPU; all is " +
                     std::to_string(kDefaultSimulatedDevices) + " of them)")
      ->capture_default_str();
  app.add_option("--devices", devices, "Shorthand for --gpus 0,1,...,N-1")
      ->excludes("--gpus")
      ->transform(exact_integer<int>());
  app.add_option("--backend", backend, "auto | cpu | cuda")->capture_default_str();
  app.add_option("--device-memory", memory,
                 "Memory cap per device: bytes, or with a suffix K, M, G, T (512M, 1.5G). On CUDA it counts dp's own "
                 "buffers only, not the CUDA context or what cuBLAS, cuDNN and NCCL allocate for themselves");
  app.add_flag("--allow-shared-device", allow_shared, "Allow a repeated id: several replicas on one device");
  app.option_defaults()->group(group);
}

DeviceConfig DeviceFlags::finish(const CLI::App& app) const {
  DeviceConfig c;
  c.backend = backend;
  if (app.count("--devices")) {
    if (devices <= 0)
      throw UsageError("--devices: " + std::to_string(devices) + " is not a device count; give at least 1");
    if (devices > kMaxDevices)
      throw UsageError("--devices: " + std::to_string(devices) + " devices in one process are more than dp runs (" +
                       std::to_string(kMaxDevices) + ": a simulated device is a thread, a GPU a device of this " +
                       "machine); give at most " + std::to_string(kMaxDevices) + ", or spread them over processes");
    c.ids.clear();
    for (int i = 0; i < devices; ++i) c.ids.push_back(i);
  } else if (gpus == "all") {
    c.all = true;
  } else {
    c.ids = parse_ids(gpus, "--gpus");
  }
  if (!memory.empty()) c.memory_cap = parse_bytes(memory, "--device-memory", kMinDeviceMemory);
  c.allow_shared_device = allow_shared;
  return c;
}

namespace {

// Edits (insertions, deletions, substitutions) between a and b.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      diagonal = std::exchange(row[j], std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])}));
  }
  return row[b.size()];
}

// An argument CLI11 did not expect, as git says it: the first that looks like an option, with the
// long option of the app (or of its subcommand) nearest to it where one is near (underscores read as
// hyphens: --bucket_kb is --bucket-kb); else the first argument.
std::string unexpected(const CLI::App& app, const std::vector<std::string>& extras) {
  auto flag = std::find_if(extras.begin(), extras.end(), [](const std::string& a) { return a.rfind("--", 0) == 0; });
  if (flag == extras.end()) return "unexpected argument '" + (extras.empty() ? std::string() : extras.front()) + "'";
  std::string given = flag->substr(2, flag->find('=') == std::string::npos ? std::string::npos : flag->find('=') - 2);
  std::replace(given.begin(), given.end(), '_', '-');
  std::string best;
  size_t best_distance = given.size() / 3 + 1;  // no nearer: no suggestion
  std::vector<const CLI::App*> apps{&app};
  for (const CLI::App* sub : app.get_subcommands()) apps.push_back(sub);
  for (const CLI::App* a : apps)
    for (const CLI::Option* o : a->get_options())
      for (const std::string& name : o->get_lnames())
        if (const size_t d = edit_distance(given, name); d < best_distance) best_distance = d, best = name;
  return *flag + " is not an option" + (best.empty() ? std::string() : "; did you mean --" + best + "?");
}

// CLI11 hands an option that needs a value the next argument even where that is another option:
// `--save --verify` saved to a file named --verify, and no --verify ran. Refused, as argparse does:
// no value of dp's options starts with --.
void refuse_options_as_values(const CLI::App& app) {
  std::vector<const CLI::App*> apps{&app};
  for (const CLI::App* sub : app.get_subcommands()) apps.push_back(sub);
  for (const CLI::App* a : apps)
    for (const CLI::Option* o : a->get_options())
      if (o->get_expected_min() > 0 && o->count() > 0)
        for (const std::string& value : o->results())
          if (value.rfind("--", 0) == 0)
            throw UsageError(o->get_name() + ": needs a value, and got the option " + value +
                             "; give the value right after " + o->get_name() +
                             " (a file whose name starts with -- "
                             "as ./" +
                             value + ")");
}

}  // namespace

bool run_parser(CLI::App& app, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return false;
  } catch (const CLI::CallForAllHelp&) {
    std::printf("%s", app.help("", CLI::AppFormatMode::All).c_str());
    return false;
  } catch (const CLI::CallForVersion& e) {
    std::printf("%s\n", e.what());
    return false;
  } catch (const CLI::ExtrasError&) {
    refuse_options_as_values(app);  // `--log --report r.json`: r.json is left over because of it
    throw UsageError(unexpected(app, app.remaining(true)) + " (see --help)");
  } catch (const CLI::ParseError& e) {
    refuse_options_as_values(app);
    const std::string what = e.what();
    // An option given twice: CLI11 says "--epochs: At Most 1 required but received 2".
    constexpr std::string_view kRepeated = ": At Most 1 required but received ";
    if (const size_t at = what.find(kRepeated); at != std::string::npos)
      throw UsageError(what.substr(0, at) + ": given " + what.substr(at + kRepeated.size()) + " times; give it once");
    throw UsageError(what + " (see --help)");
  }
  refuse_options_as_values(app);
  return true;
}

}  // namespace dp
