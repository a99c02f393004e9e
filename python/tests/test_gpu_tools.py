"""The device check's summarisers (tools/gpu/summarize.py, tools/gpu/profile_summary.py) on files shaped as
Google Benchmark, Nsight Compute and tools/gpu_check.sh write them. Pure Python: no GPU, no bindings."""
import importlib.util
import json
import pathlib
import subprocess
import sys

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools" / "gpu"


def load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_entry(name, aggregate, real_time):
    return {"name": f"{name}/manual_time_{aggregate}", "run_name": f"{name}/manual_time", "run_type": "aggregate",
            "aggregate_name": aggregate, "real_time": real_time, "time_unit": "us", "hbm_frac": 0.5}


def bench_json(entries, cut=False):
    text = json.dumps({"context": {"peak_read_GBps": "3175.8", "device": "test"}, "benchmarks": entries}, indent=2)
    if cut:  # killed after the last whole entry: Google Benchmark had not closed the array
        text = text[: text.rindex("]")].rstrip()
    return text


NCU_CSV = """==PROF== Connected to process 7 (bench_cuda_policies)
a line of the benchmark's own output
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","7","b","h","void ns::(anonymous namespace)::cov_kernel<__half>(ns::(anonymous namespace)::View<__half>, long)","1","13","(256, 1, 1)","(64, 1, 1)","0","9.0","s","gpu__time_duration.sum","nsecond","2,000"
"1","7","b","h","cov_kernel<float>","1","13","(256, 1, 1)","(64, 1, 1)","0","9.0","s","gpu__time_duration.sum","usecond","3"
"2","7","b","h","mean_kernel","1","13","(256, 1, 1)","(1, 1, 1)","0","9.0","s","gpu__time_duration.sum","msecond","0.001"
"3","7","b","h","mean_kernel","1","13","(256, 1, 1)","(1, 1, 1)","0","9.0","s","other_metric","nsecond","99999"
"""


def test_a_cut_off_benchmark_file_keeps_its_finished_entries(tmp_path):
    summarize = load("summarize")
    path = tmp_path / "bench_x.json"
    entries = [bench_entry("A/1", "median", 10.0), bench_entry("A/1", "cv", 0.01)]
    path.write_text(bench_json(entries, cut=True))
    data, truncated = summarize.load_bench(str(path))
    assert truncated
    assert [b["aggregate_name"] for b in data["benchmarks"]] == ["median", "cv"]
    path.write_text(bench_json(entries))
    data, truncated = summarize.load_bench(str(path))
    assert not truncated and len(data["benchmarks"]) == 2


def test_kernel_times_add_up_per_kernel_name_in_microseconds(tmp_path):
    profile = load("profile_summary")
    path = tmp_path / "profile.csv"
    path.write_text(NCU_CSV)
    rows = profile.summarize(str(path))
    assert [(r["kernel"], r["launches"]) for r in rows] == [("cov_kernel", 2), ("mean_kernel", 1)]
    assert rows[0]["total_us"] == 5.0 and rows[1]["total_us"] == 1.0  # 2,000 ns + 3 us; 0.001 ms; other metrics ignored
    assert abs(rows[0]["share"] - 5.0 / 6.0) < 1e-12
    assert rows[0]["grid"] == "(64, 1, 1)" and rows[0]["block"] == "(256, 1, 1)"
    (tmp_path / "empty.csv").write_text("==PROF== ncu: command not found\n")
    assert profile.summarize(str(tmp_path / "empty.csv")) == []


def test_the_summary_of_a_check_folder(tmp_path):
    (tmp_path / "tests.tsv").write_text("test_a\t0\t1.5\tAll tests passed (3 assertions in 1 test case)\n"
                                        "test_b[poisoned_buffers]\t3\t0.5\ttest cases: 2 | 1 passed | 1 failed\n"
                                        "test_c\t77\t0.0\tSKIPPED: no CUDA device\n")
    (tmp_path / "bench_cuda_policies.json").write_text(bench_json([bench_entry("CudaTopk/8192/1", "median", 33.0)], cut=True))
    (tmp_path / "profile.csv").write_text(NCU_CSV)
    subprocess.run([sys.executable, str(TOOLS / "summarize.py"), str(tmp_path)], check=True, capture_output=True)
    s = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [t["status"] for t in s["tests"]] == ["pass", "fail", "skip"]
    assert not s["all_tests_passed"]
    assert s["truncated"] == ["bench_cuda_policies.json"]
    assert s["benchmarks"]["CudaTopk/8192/1"]["median_us"] == 33.0
    assert s["context"]["peak_read_GBps"] == "3175.8"
    assert s["profile"][0]["kernel"] == "cov_kernel"
