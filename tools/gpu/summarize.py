#!/usr/bin/env python3
"""One JSON summary of a tools/gpu_check.sh run (argv[1]: its output folder).

Reads tests.tsv (test, exit code, seconds, Catch2 summary line), the Google
Benchmark JSON files (bench_*.json; medians of the repetitions) and
torch_reference.json, and writes gpu_check.json beside them: pass/fail per
test, each benchmark's median with its fraction of the measured peaks, the
ratio torch time / kvpolicy time where both ran the same shape, and with
profile.csv (gpu_check.sh --profile) the kernel time per kernel name.
"""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_summary import summarize as kernel_times  # noqa: E402


def load_bench(path):
    """A Google Benchmark JSON file; one cut off mid-run (the program killed by
    its timeout) is closed after its last whole benchmark entry and marked
    truncated, so the benchmarks that finished still count."""
    text = open(path).read()
    try:
        return json.loads(text), False
    except ValueError:
        cut = text.rfind("\n    }")
        if cut < 0 or '"benchmarks": [' not in text:
            raise
        return json.loads(text[: cut + len("\n    }")] + "\n  ]\n}\n"), True


def main():
    d = sys.argv[1]
    out = {"tests": [], "benchmarks": {}, "context": {}, "vs_torch": {}}
    tsv = os.path.join(d, "tests.tsv")
    if os.path.exists(tsv):
        for line in open(tsv):
            name, rc, secs, summary = (line.rstrip("\n").split("\t") + ["", "", "", ""])[:4]
            status = "pass" if rc == "0" else ("skip" if rc == "77" else "fail")
            out["tests"].append({"test": name, "status": status, "exit": int(rc), "seconds": float(secs), "summary": summary})
    for path in sorted(glob.glob(os.path.join(d, "bench_*.json"))):
        try:
            data, truncated = load_bench(path)
        except (OSError, ValueError) as e:
            out["benchmarks"][os.path.basename(path)] = {"error": str(e)}
            continue
        if truncated:
            out.setdefault("truncated", []).append(os.path.basename(path))
        out["context"].update({k: v for k, v in data.get("context", {}).items() if k.startswith(("peak_", "device", "sm_"))})
        for b in data.get("benchmarks", []):
            if b.get("aggregate_name") not in (None, "median"):
                continue
            name = b["run_name"] if "run_name" in b else b["name"]
            name = name.replace("/manual_time", "")
            entry = {"median_us": b.get("real_time"), "time_unit": b.get("time_unit")}
            if b.get("error_occurred"):
                entry = {"error": b.get("error_message")}
            for key in ("fp32_frac", "hbm_frac", "tokens_per_s", "graph_nodes", "key_bw_frac_of_copy", "k", "bytes_per_second"):
                if key in b:
                    entry[key] = b[key]
            out["benchmarks"][name] = entry
    ref_path = os.path.join(d, "torch_reference.json")
    if os.path.exists(ref_path):
        ref = json.load(open(ref_path))
        out["torch"] = {"device": ref.get("device"), "version": ref.get("torch")}
        pairs = {"snapkv/4096": "CudaSnapKV/4096", "snapkv/32768": "CudaSnapKV/32768",
                 "snapkv_graph/4096": "CudaSnapKVGraph/4096", "snapkv_graph/32768": "CudaSnapKVGraph/32768"}
        for n in (8192, 32768, 131072):
            for pct in (1, 50):
                pairs[f"topk/{n}/{pct}"] = f"CudaTopk/{n}/{pct}"
        for c in (4096, 32768):
            pairs[f"h2o_step/{c}"] = f"CudaH2OStep/{c}"
        for b in (1, 16):
            pairs[f"quest/{b}"] = f"CudaQuestSelect/{b}"
        for tk, ours in pairs.items():
            t = ref.get("cases", {}).get(tk, {}).get("median_ms")
            b = out["benchmarks"].get(ours, {})
            if t and b.get("median_us"):
                us = b["median_us"] if b.get("time_unit") == "us" else None
                if us:
                    out["vs_torch"][ours] = {"kvpolicy_us": us, "torch_us": t * 1e3, "speedup": t * 1e3 / us}
    prof = os.path.join(d, "profile.csv")
    if os.path.exists(prof):
        out["profile"] = kernel_times(prof)
    out["all_tests_passed"] = bool(out["tests"]) and all(t["status"] == "pass" for t in out["tests"])
    with open(os.path.join(d, "gpu_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
