"""The README's results table from a compare sweep's report.csv (median of the repeats, min-max beside it):

    python benchmarks/readme_results_table.py runs/quick/report.csv
"""

from __future__ import annotations

import csv
import sys

MIB = 1 << 20
NAMES = {"deepspeed-z1": "deepspeed ZeRO-1", "deepspeed-z2": "deepspeed ZeRO-2", "deepspeed-z3": "deepspeed ZeRO-3"}


def spread(row: dict[str, str], key: str, lo: str, hi: str, fmt: str) -> str:
    value = fmt.format(float(row[key]))
    if row.get(lo) and row.get(hi) and row[lo] != row[hi]:
        value += f" ({fmt.format(float(row[lo]))}-{fmt.format(float(row[hi]))})"
    return value


def predicted(row: dict[str, str]) -> str:
    if not row.get("predicted_step_s"):
        return "n/a"
    return f"{float(row['predicted_step_s']) * 1e3:.1f} ms ({float(row['predicted_step_error_pct']):+.0f}%)"


def allocator(row: dict[str, str]) -> str:
    if not row.get("alloc_peak_bytes"):
        return "n/a"
    peak = float(row["alloc_peak_bytes"]) / MIB
    text = f"{peak:.1f} MiB" if peak < 1024 else f"{peak / 1024:.2f} GiB"
    if row.get("prediction_error_pct"):
        text += f" ({float(row['prediction_error_pct']):+.1f}%)"
    return text


def main(path: str) -> int:
    rows = [r for r in csv.DictReader(open(path, newline="")) if r["status"] == "ok"]
    print("| method | precision | devices | batch / device | peak memory / device¹ | train time² (min-max) "
          "| throughput (samples/s) | speed-up | step time | predicted step³ (error) | allocator peak⁴ (estimate error) "
          "| not compute | comm / step (vs ddp) | val accuracy | final loss |")  # fmt: skip
    print("|" + "---|" * 15)
    for r in rows:
        comm = float(r["comm_wire_bytes_per_step"] or 0) / MIB
        vs = f" ({float(r['comm_vs_ddp']):.2f}x)" if r["comm_vs_ddp"] not in ("", "n/a") and comm else ""
        print(
            f"| {NAMES.get(r['label'], r['label'])} | {r['precision']} | {r['world_size']} | {r['batch_device']} "
            f"| {float(r['peak_memory_bytes']) / MIB:.0f} MiB | {spread(r, 'train_time_s', 'train_time_min_s', 'train_time_max_s', '{:.2f}')} s "
            f"| {float(r['throughput_samples_per_s']):.0f} | {float(r['speedup']):.2f}x "
            f"| {float(r['step_time_median_s']) * 1e3:.1f} ms | {predicted(r)} | {allocator(r)} "
            f"| {float(r['not_compute_share']):.1%} "
            f"| {comm:.2f} MiB{vs} | {float(r['val_accuracy']):.2%} | {float(r['final_loss']):.4f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
