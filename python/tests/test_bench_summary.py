"""benchmarks/summarize.py (the table `./tools/kvp.sh bench` prints) on result files shaped as Google Benchmark and
tools/compare_kvpress_speed.py write them. Pure Python: no bindings, no benchmark run."""
import importlib.util
import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "summarize.py"


def load():
    spec = importlib.util.spec_from_file_location("summarize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median(name, time, unit="us", **counters):
    return {"name": name + "_median", "run_name": name, "run_type": "aggregate", "aggregate_name": "median",
            "real_time": time, "cpu_time": time, "time_unit": unit, **counters}


def write(tmp_path, program, entries, context=None):
    (tmp_path / f"{program}.json").write_text(json.dumps({"context": context or {}, "benchmarks": entries}))


def results(tmp_path):
    peaks = {"peak_fma_gflops": "200.0", "peak_fma_avx2_gflops": "100.0", "peak_read_gbps": "15.0", "peak_fma_isa": "avx512",
             "kvpolicy_cpu_best_isa": "avx512", "load_avg": [1.0, 0.5, 0.25]}
    write(tmp_path, "bench_ops", [
        median("window_scores/cpu/avx512/f16", 6.0, "ms", **{"GFLOP/s": 170.0, "pct_peak_fma": 85.0}),
        median("window_scores/cpu/avx2/f16", 12.0, "ms", **{"GFLOP/s": 50.0, "pct_peak_fma": 25.0, "pct_peak_fma_avx2": 50.0}),
        median("read_pass/n:1024", 0.02),
        median("topk/cpu/avx512/n:1024/k:10", 0.03),
        median("topk/cpu/avx512/n:8192/k:64", 0.5),
        median("read_pass/n:131072/k:1310/rows:32", 100.0),
        median("topk/cpu/avx512/n:131072/k:1310/rows:32", 120.0),
        median("topk/cpu/sse2/n:131072/k:1310/rows:32", 400.0),
        median("window_scores_layer/cpu/avx512/f16/threads:1/process_time", 80.0, "ms"),
        median("window_scores_layer/cpu/avx512/f16/threads:2/process_time", 82.0, "ms"),
        median("window_scores_layer/cpu/avx512/f16/threads:2/process_time/real_time", 42.0, "ms"),
    ], peaks)
    # bench_quest: its own top-k rows have no "/n:" in their names (the table once failed on them).
    write(tmp_path, "bench_quest", [
        median("topk/cpu/1024", 32.0),
        median("topk_vs_pass/cpu/4096/iterations:200", 70.0, topk_over_pass=6.1, topk_us=70.0, pass_us=11.5),
        median("estimate_vs_read_cold/cpu/in_order:1/iterations:24", 7.8, "ms", est_GBps=13.0, pct_read_bw=86.0,
               read_GBps=15.1, pages_GBps=16.0, pct_pattern_bw=81.0),
    ], {"load_avg": [1.1, 1.0, 0.9]})
    # bench_scoring reports bare rates (flop/s) and no peaks of its own: the probe of the other programs divides them.
    write(tmp_path, "bench_scoring", [
        median("expected_attention/T4096/real_time", 100.0, "ms", **{"flop/s": 60e9}),
        median("observed_attention/T2560/query_block/64/real_time", 200.0, "ms", **{"flop/s": 120e9}),
    ])
    write(tmp_path, "bench_batching", [
        median("quest/threads:1/batched:1/repeats:3/real_time", 4.0, "ms"),
        median("quest/threads:2/batched:1/repeats:3/real_time", 2.5, "ms"),
        median("quest/threads:1/batched:0/repeats:3/real_time", 4.0, "ms"),
        median("quest/threads:2/batched:0/repeats:3/real_time", 2.2, "ms"),
    ], {"load_avg": [0.9, 0.9, 1.3]})
    write(tmp_path, "bench_quant", [
        median("quantize/q8_0/repeats:5", 7.0, "ms", **{"GB/s": 7.3, "pct_peak_bw": 50.0}),
        {"name": "quantize/q4_0/repeats:5", "run_name": "quantize/q4_0/repeats:5", "error_occurred": True},
    ])
    (tmp_path / "kvpress.jsonl").write_text(
        json.dumps({"policy": "SnapKV", "tokens": 32768, "threads": 1, "kvpress_median_ms": 2758.0, "kvpolicy_median_ms": 109.0,
                    "speedup": 25.3}) + "\n" +
        json.dumps({"policy": "TOVA", "tokens": 32768, "threads": 1, "kvpress_median_ms": 144.0, "kvpolicy_median_ms": 16.0,
                    "speedup": 9.0}) + "\n")
    return tmp_path


def line_of(text, start):
    found = [line for line in text.splitlines() if line.startswith(start)]
    assert found, f"no line starts with {start!r} in:\n{text}"
    return found[0]


def test_every_goal_gets_a_verdict(tmp_path):
    text = load().summarize(str(results(tmp_path)))
    assert line_of(text, "window_scores/cpu/avx512/f16 ").endswith(">=80% #15.1 met")
    assert line_of(text, "window_scores/cpu/avx2/f16 ").endswith(">=60% #15.1 not")  # judged by its AVX2 share, 50 %
    assert line_of(text, "estimate_vs_read_cold/").endswith(">=85% #15.2 met")
    # flop/s over the 200 GFLOP/s probe: 30 % and 60 %.
    assert "30.0%" in line_of(text, "expected_attention/") and line_of(text, "expected_attention/").endswith("#15.5 not")
    assert "60.0%" in line_of(text, "observed_attention/") and line_of(text, "observed_attention/").endswith("#15.4 met")
    assert line_of(text, "quantize/q8_0/").endswith(">=80% #11.5 not")
    assert "quantize/q4_0" not in text  # a failed benchmark prints no row


def test_ratio_goals(tmp_path):
    text = load().summarize(str(results(tmp_path)))
    assert line_of(text, "ratio topk/cpu/avx512/n:1024/k:10 / read_pass/n:1024").endswith("1.50x  <=2x #15.3 met")
    assert line_of(text, "ratio topk/cpu/avx512/n:131072/k:1310/rows:32 / read_pass/n:131072/k:1310/rows:32").endswith(
        "1.20x  <=1.3x #15.3 met")
    assert line_of(text, "ratio topk/cpu/sse2/").endswith("4.00x")  # below the best level: shown, not judged
    assert "ratio topk/cpu/avx512/n:8192/k:64" not in text  # no read pass of that length in the results
    assert line_of(text, "ratio topk_vs_pass/cpu/4096").endswith("6.10x  <=2x #15.3 not")
    assert "topk/cpu/1024 /" not in text
    assert line_of(text, "scaling quest/threads:1/batched:1").endswith("1.60x  >=1.8x #15.6 not")
    assert line_of(text, "scaling window_scores_layer/cpu/avx512/f16/threads:1/process_time").endswith("1.90x  >=1.8x #15.6 met")
    assert "scaling quest/threads:1/batched:0" not in text  # per-sequence loops are not the batch decision the goal names
    assert "bench_batching 0.90 0.90 1.30" in line_of(text, "load average during the runs")
    assert "86% of a read pass" in line_of(text, "estimate_vs_read_cold/cpu/in_order:1/iterations:24:")
    assert line_of(text, "SnapKV ").endswith("25.30x  >=10x #15.7 met")
    assert line_of(text, "TOVA ").endswith("9.00x  >=10x #15.7 not")


def test_command_line_reads_the_named_programs_only(tmp_path):
    results(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "bench_quest", "bench_missing"], check=True,
                         capture_output=True, text=True).stdout
    assert "topk/cpu/1024" in out and "window_scores" not in out
    assert subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True).returncode != 0
