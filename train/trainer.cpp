// The training behind dp_train, as a PyTorch script writes it: the setup (setup.h), then the run's
// epochs a step at a time (run.h), then what is written after the last step. Resuming and saving are
// resume.h, --verify verify.h, the progress line and signals progress.h, the record report.h, and
// what a job of several processes adds job.h.
#include "train/trainer.h"

#include <cstdio>
#include <optional>

#include "engine/failpoint.h"
#include "train/job.h"
#include "train/report.h"
#include "train/run.h"
#include "train/setup.h"
#include "train/signals.h"
#include "train/trace.h"

namespace dp {
namespace {

// What the run is, decided before any device starts: the model, the data, the schedule, the devices,
// the run's identity and where it resumes from.
struct Prepared {
  ModelSpec spec;
  DataSets data;
  Schedule plan;
  DeviceSet devs;
  RunIdentity id;
  Resumed resumed;
};

// Across processes: every process's settings against rank 0's, before any collective that depends
// on them.
void check_job_agreement(ProcessGroup& g, const TrainOptions& opt, const Prepared& p) {
  Settings s = p.id.required;
  s.insert(s.end(), p.id.exact_only.begin(), p.id.exact_only.end());
  s.insert(s.end(), {{"model", p.spec.name},
                     {"width", std::to_string(p.spec.width)},
                     {"devices_per_process", std::to_string(p.devs.devices.size())},
                     {"steps", std::to_string(p.plan.total_steps)},
                     {"test_samples", std::to_string(p.data.test.count)},
                     // Each adds collectives: rank 0's state broadcast, the gather of the weights to save.
                     {"resume", opt.resume.empty() ? "none" : "a checkpoint"},
                     {"load", opt.load.empty() ? "none" : "a checkpoint"},
                     {"save", opt.save.empty() ? "none" : "a file"},
                     {"save_every", std::to_string(opt.save_every)},
                     // Each adds collectives at the end (verify's result, the trace's gather).
                     {"verify", opt.verify ? "on" : "off"},
                     {"trace", opt.trace.empty() ? "off" : "on"},
                     {"timeout", std::to_string(opt.timeout)},
                     // Off on one process, its step fingerprints would differ from the others'.
                     {"flight_records", std::to_string(opt.flight_records)}});
  check_agreement(g, s, opt.timeout);
}

Prepared prepare(const TrainOptions& opt, ProcessGroup* g) {
  const ModelSpec spec = make_model(opt.model, opt.width);
  DataSets data = load_data(opt, spec);
  // Refuses a step count it cannot run before any device starts.
  const Schedule plan = schedule(opt, data.train.count);
  check_simulated_devices(opt, spec, g ? g->size() : 1, data.train.count);
  // A missing checkpoint to start from, before the devices start (in a job rank 0 alone reads it, and
  // every process learns its refusal from it: resume_on_rank0, starting_state).
  for (const std::string* in : {&opt.load, &opt.resume})
    if (!g && !in->empty()) require_checkpoint_file(*in);
  DeviceSet devs = make_devices(opt.devices);
  const int job_devices = int(devs.devices.size()) * (g ? g->size() : 1);
  check_model_fits(opt, spec, devs, job_devices, data.train.count);
  check_accumulate(opt, job_devices);
  check_batchnorm(opt, spec, plan, data.train.count, job_devices);
  RunIdentity id = run_identity(opt, data.train, kind_name(devs.devices[0]->kind()), job_devices, plan.lr);
  // Step 0 and no weights without --resume. Across processes rank 0 alone reads the checkpoint; the
  // others get its step now and its state from broadcast_state.
  Resumed resumed = g ? resume_on_rank0(*g, opt, spec, id) : resume_checkpoint(opt, spec, id);
  check_verified_steps(opt, plan, resumed.global_step);
  Prepared p{spec, std::move(data), plan, std::move(devs), std::move(id), std::move(resumed)};
  if (g) check_job_agreement(*g, opt, p);
  return p;
}

// The state every replica starts from: --resume's, --load's (across processes read by rank 0 alone,
// the others take its state from broadcast_state) or fresh weights from --seed.
Checkpoint starting_state(const TrainOptions& opt, const Prepared& p, ProcessGroup* g) {
  Checkpoint init;
  if (g && !opt.load.empty())
    on_rank0(*g, opt.timeout, "rank 0's reading of --load", [&] { init = initial_state(opt, p.spec, p.resumed); });
  else
    init = initial_state(opt, p.spec, p.resumed);
  if (g) broadcast_state(*g, init, opt.timeout);  // rank 0's: every replica of the job starts from it
  return init;
}

// After the last step: --verify's verdict, the device table, the final checkpoint, the report and the
// trace, each behind a safe point.
void finish(Run& run, SignalGuard& signals, const TrainOptions& opt, const Prepared& p, Engine& engine, ProcessGroup* g,
            Verifier* verify, double trace_offset_us, TrainResult& result) {
  const bool trace = engine.config().trace;
  if (opt.verify) {
    signals.doing(Activity::verify);
    VerifyResult v;
    // Under zero3 the weights are gathered from every process's devices: every rank takes part.
    std::vector<float> weights;
    if (verify || engine.strategy().zero_stage() == 3) weights = engine.params();
    if (verify) v = verify->compare(weights, engine.config().batch);  // the batch trained, not --batch
    if (g) broadcast_verify(*g, v, opt.timeout);
    result.verify_max_diff = v.max_diff, result.verify_tolerance = v.tolerance, result.verify_ok = v.ok;
  }
  run.stop_if_signalled();
  // Across processes: every device of every process, their weights checked identical; every rank's
  // trace, on rank 0.
  const nlohmann::json job_devices_json = g ? gather_devices(*g, engine, opt.timeout) : nlohmann::json();
  const nlohmann::json job_trace =
      g && trace ? job_trace_json(*g, engine, trace_offset_us, opt.timeout) : nlohmann::json();
  if (run.speak())
    std::printf("%s", (g ? device_table(job_devices_json, engine.strategy().memory_note(engine.config()))
                         : device_table(engine))
                          .c_str());
  if (!opt.save.empty()) {
    signals.doing(Activity::save);
    failpoint::at("final-save");
    run.save();  // a signal from here on still lets it finish: the trained weights are worth keeping
    if (run.speak()) std::printf("saved %s\n", opt.save.c_str());
  }
  run.stop_if_signalled();
  if (!opt.report.empty() && run.lead())
    run.output(Activity::report, [&] {
      nlohmann::json j = train_report(opt, p.spec, p.plan.epochs, p.plan.total_steps, result, engine);
      if (g) {
        j["devices"] = job_devices_json;
        j["processes"] = {{"count", g->size()}, {"hosts", g->hosts()}};
      }
      write_json(opt.report, j);
    });
  if (!opt.trace.empty() && run.lead())
    run.output(Activity::trace, [&] { write_json(opt.trace, g ? job_trace : trace_json(engine)); });
  run.stop_if_signalled();
}

}  // namespace

// The setting to blame for a diverged run. Weight decay alone is the heavy-ball iteration on
// wd/2 * w^2, stable exactly while lr * wd < 2 (1 + momentum): past that the decay makes the weights
// grow every step whatever the gradients, and --weight-decay is the setting out of range (a smaller
// --lr would mask it). Below it, the step size is the usual suspect.
std::string divergence_hint(const TrainOptions& o) {
  const double decay = double(o.lr) * double(o.weight_decay), bound = 2.0 * (1.0 + double(o.momentum));
  if (decay < bound) return " (try a smaller --lr)";
  char hint[200];
  std::snprintf(hint, sizeof hint,
                " (try a smaller --weight-decay: --lr * --weight-decay = %g is past 2 (1 + --momentum) = %g, where "
                "the decay alone makes the weights grow every step)",
                decay, bound);
  return hint;
}

TrainResult train(const TrainOptions& opt, ProcessGroup* group) {
  ProcessGroup* g = group && group->size() > 1 ? group : nullptr;  // a job of one process is no job
  const bool lead = !g || g->rank() == 0;
  // First: from here on a signal at any moment, even while the output paths are probed, stops the run
  // at its next safe point with 128 + signal and a line saying what was saved.
  SignalGuard signals(grace_seconds());
  failpoint::at("start");  // a test build reads DP_TEST_AT here: a malformed value is refused before anything runs
  if (g) {
    // A refusal anywhere is every process's, said once by rank 0.
    refuse_together(*g, opt.timeout, [&] {
      check_options(opt, lead);
      check_job_options(opt, g->size());
    });
    // Every process alike, before the fingerprints of the steps begin.
    g->flight().set_capacity(opt.flight_records);
    if (!opt.flight_dir.empty()) g->set_flight_dir(opt.flight_dir);
  } else {
    check_options(opt, lead);
  }
  const Prepared p = prepare(opt, g);

  if (!opt.quiet) std::printf("%s\n", p.devs.notice.c_str());
  if (!opt.quiet && g) print_world(*g, int(p.devs.devices.size()));
  if (!opt.quiet && !p.plan.lr.is_constant()) std::printf("lr schedule: %s\n", p.plan.lr.describe().c_str());
  if (!opt.quiet && opt.accumulate > 1) std::printf("accumulate: %s\n", accumulation_note(opt).c_str());
  EngineConfig ec = engine_config(opt, p.data.train.count);
  ec.group = g;
  Engine engine(pointers(p.devs), p.spec, ec);
  if (!opt.quiet && opt.graphs)
    std::printf("graphs: each step captured once per batch buffer, then replayed (the first and short ones eager)\n");
  if (!opt.quiet) note_clamped_sizes(opt, p.data);
  if (!opt.quiet) note_idle_devices(opt, ec.batch, engine.size());
  const Checkpoint init = starting_state(opt, p, g);
  place(engine, init);
  std::optional<Verifier> verify;  // --verify: the same steps on one device with the full batch (rank 0's)
  if (opt.verify && lead) verify.emplace(opt.devices, p.spec, ec, init, engine.comm().world());
  // Across processes, every rank's trace onto rank 0's clock (read before the first span).
  const double trace_offset_us = g && ec.trace ? clock_offset_to_rank0(*g, engine, opt.timeout) : 0;

  if (!opt.resume.empty() && !opt.quiet) print_resuming(opt, p.plan, p.resumed.global_step);
  CheckpointSaver saver(opt, p.spec, p.id, p.plan.per_epoch);
  std::optional<TrainLog> log;  // opened as training starts (truncated; resumed: kept up to its step); rank 0's alone
  if (!opt.log.empty() && lead)
    log.emplace(opt.log, opt.log_every, engine.strategy(), engine.recorder(),
                opt.resume.empty() ? 0 : p.resumed.global_step);
  Run run(opt, p.plan, engine, saver, signals, log ? &*log : nullptr, p.resumed.global_step, g);
  run.stop_if_signalled();  // one that came during the setup: nothing trained, nothing saved
  TrainResult result;
  run.epochs(p.data, verify ? &*verify : nullptr, result);
  summarize(result);
  finish(run, signals, opt, p, engine, g, verify ? &*verify : nullptr, trace_offset_us, result);
  result.log_failure = run.log_failure();
  return result;
}

}  // namespace dp
