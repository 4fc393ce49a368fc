// --eval: a checkpoint evaluated on the test set by the devices and engine a run would train on.
#include <cmath>
#include <cstdio>

#include "engine/error.h"
#include "train/progress.h"
#include "train/report.h"
#include "train/run.h"
#include "train/setup.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace dp {

namespace {

// --eval's --report: what was evaluated (the checkpoint, the config with the resolved backend and
// devices, the provenance a training report has) and the result, with each device's memory.
nlohmann::json eval_report(const TrainOptions& o, const ModelSpec& spec, Engine& engine, const EvalResult& r) {
  nlohmann::json config = run_config(o, spec, 0);  // no training steps
  nlohmann::json names = nlohmann::json::array();
  for (int d = 0; d < engine.size(); ++d) names.push_back(engine.device(d).name());
  config.update({{"data", o.data},
                 {"limit_test", o.limit_test},
                 {"gpus", o.devices.ids},
                 {"strategy", o.sync},
                 {"backend_requested", o.devices.backend},
                 {"backend", kind_name(engine.device(0).kind())},
                 {"device_names", names}});
  return {{"kind", "evaluation"},
          {"version", version()},
          {"command_line", o.command_line},
          {"started_at", o.started_at},
          {"checkpoint", o.load},
          {"config", config},
          {"images", r.images},
          {"test_loss", r.test_loss},
          {"test_accuracy", r.test_accuracy},
          {"devices", device_report(engine)}};
}

}  // namespace

EvalResult evaluate_checkpoint(const TrainOptions& opt) {
  SignalGuard signals(grace_seconds());  // a signal stops it before the report, with 128 + signal
  if (opt.load.empty())
    throw UsageError("--eval: evaluates a checkpoint without training; give --load FILE (one --save wrote)");
  check_options(opt);
  const ModelSpec spec = make_model(opt.model, opt.width);
  const Checkpoint state = load_checkpoint(opt.load, spec);  // refused before any device starts
  if (!state.note.empty() && !opt.quiet) std::printf("note: %s\n", state.note.c_str());
  const Dataset test = load_set(opt, spec, "t10k", opt.limit_test);
  if (test.count == 0) throw UsageError(opt.data + ": the test set has no images; --eval has nothing to evaluate");
  DeviceSet devs = make_devices(opt.devices);
  if (!opt.quiet) std::printf("%s\n", devs.notice.c_str());
  // Evaluated in chunks of the batch a run with these options trains with (up to the set's size).
  Engine engine(pointers(devs), spec, engine_config(opt, test.count));
  engine.set_params(state.params);
  engine.set_running_stats(state.buffers);
  EpochRecord rec;
  evaluate(engine, test, rec);
  const EvalResult result{test.count, rec.test_loss, rec.test_accuracy};
  // Printed even with --quiet: it is what --eval was asked for.
  std::printf("test acc %.4f  test loss %.4f  (%lld images, %s, from %s)\n", result.test_accuracy, result.test_loss,
              (long long)result.images, spec.title().c_str(), opt.load.c_str());
  std::fflush(stdout);
  if (int sig = signals.pending())
    throw Interrupted(sig, describe_signal(sig) + " after the evaluation" +
                               (opt.report.empty() ? "" : "; report " + opt.report + " not written"));
  if (!opt.report.empty()) write_json(opt.report, eval_report(opt, spec, engine, result));
  // Finite weights (the checkpoint's were checked) whose logits overflow: exit 3, as training would.
  if (!std::isfinite(result.test_loss))
    throw NumericalError("--eval: the test loss of " + opt.load + " is not finite (" +
                         std::to_string(result.test_loss) +
                         "): its weights are finite, but the logits they give overflow float");
  return result;
}

}  // namespace dp
