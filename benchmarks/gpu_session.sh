#!/usr/bin/env bash
# Every GPU check of issue 16 in one command, for a session that is lent a GPU. Parts env, tests and precision
# ran on one H100 on 2026-11-22 in about 4 minutes (results: benchmarks/gpu_h100_2026-11-22/); env, fast (3 min),
# trace (0.5 min), source (3 min), pipeline (1.5 min) and methods without DeepSpeed (16 s to 26 s a cell) on one
# H200 on 2026-11-26 (benchmarks/gpu_h200_2026-11-26/); env, calhw (41 s), heldout (6 min) and tests (1.3 min) on one
# H200 on 2026-11-28 (benchmarks/gpu_h200_2026-11-28/). Not run yet: seed, tplibs (2 GPUs), zeropp, longctx, infer.
#
#   OUT=/some/folder benchmarks/gpu_session.sh            # every part, in the order below
#   OUT=/some/folder benchmarks/gpu_session.sh fast source # only these parts
#   DEADLINE=450 benchmarks/gpu_session.sh ...  # start no part (and no heldout run) after 450 s, for a call's limit
#   PACK=$OUT/results.tgz OUT=/tmp/sb-out benchmarks/gpu_session.sh ...  # the device tool brings back at most 8
#              files: everything (OUT, and each run's result.json, logs, reports; no checkpoints) in one tar.gz,
#              rewritten after every part, so a call cut off at its limit still brings back the finished parts
#
# Parts (each writes one file into $OUT; compare sweeps and train runs go under $WORK, default /tmp/sb-gpu):
#   env        nvidia-smi, versions                                                      -> env.txt
#   precision  stratbench compare --preset gpu-precision (7 cells)               ~4 min  -> precision.md
#   seed       compare --preset seed --data synthetic --only single (4 cells)   ~3 min  -> seed_single.md
#   methods    compare --preset gpu-fast --world-size 1: every method at world 1 on CUDA (NCCL), 40 steps of
#              ResNet-50 at 224 px, compile off (a compile per cell would not fit one call) ~6 min -> methods_w1.md
#   fsdpw1     issue 42 item 11: the single, fsdp and fsdp1 cells of methods (the same settings), each FSDP row's
#              median step over single's with its units and weight casting, PASS within 1.2x (2026-11-26, one
#              H200, a unit per BatchNorm: fsdp 2.7x, fsdp1 4.1x; not run since BatchNorm stays in its block's
#              unit)                                                           ~1.5 min -> fsdp_w1.md
#   fast       ResNet-50 224 px training throughput, fast recipe: batch 256 compiled, eager and with the
#              DataLoader instead of the device pipeline, batch 128 eager                    ~4 min -> fast.md
#   trace      a torch.profiler trace (CPU + CUDA) of 3 steps of the fast, compiled b256 step ~1 min
#                                                     -> trace.md, trace_fast_b256_rank0.json.gz
#   source     the source experiment with the fast recipe: ResNet-50, CIFAR-10's size (50,000 synthetic images
#              unless CIFAR_DIR holds cifar-10-batches-py) at 224 px, 5 epochs, batch 128  ~3 min -> source.md
#   pipeline   benchmarks/input_pipeline.py on CUDA: loader vs device, 32 and 224 px       ~2 min -> pipeline.md
#   tplibs     the libraries' tensor parallelism (issue 31 item 7), needs 2+ GPUs (on one GPU each run stops in
#              one line, in $WORK/NAME.log, and its row reads "no result.json"): DeepSpeed AutoTP (deepspeed --autotp-size 2, ZeRO-1) and accelerate's
#              ParallelismConfig(tp_size=2) (accelerate-tp, which accelerate refuses on CPU), gpt-tiny, 40 steps,
#              beside tp on the same 2 GPUs                                            ~3 min -> tplibs.md
#   zeropp     issue 45: DeepSpeed ZeRO-3, qwZ (--zero-quantized-weights), qgZ (--zero-quantized-gradients) and, with
#              2+ GPUs, hpZ (--zero-hpz 2) on gpt-tiny, every parameter freed after forward; measured collectives
#              against the formula. Needs the DeepSpeed wheels; one GPU: world 1, the config accepted and the
#              quantizer kernel built, nothing gathered (not run yet)                ~4 min -> zeropp.md
#   longctx    issue 46 on gpt2-small at sequence 1024, bf16-mixed: --ac-mode none / full / selective / every:2 on
#              one GPU (peak allocated against the estimate, the step time each recomputation costs); --float8
#              tensorwise / rowwise, eager and compiled, against bf16-mixed compiled (torchao on an H100); with 2+ GPUs
#              fsdp against fsdp --cp 2 at a global batch of 2 sequences (one per GPU: what cp is for) and the
#              zero-bubble schedules against 1f1b on gpt-tiny (not run yet)              ~8 min -> longctx.md
#   infer      issue 48: bench-infer on CUDA with every backend - eager fp32/bf16/fp16, compile, onnxruntime CUDA and
#              TensorRT execution providers (onnxruntime-gpu; without it the rows say so), torch-tensorrt (where
#              installed), the CPU rows (onnxruntime int8/fp16, torchao) beside them - on a resnet18 trained on digits
#              and a gpt-tiny trained on text, each opening with the fastest backend within --max-quality-loss
#              (not run yet)                                  ~6 min -> infer_resnet18.md, infer_gpt-tiny.md (+ .png)
#   calhw      issue 49 item 1: stratbench calibrate-hw on the GPU (the roofline's achievable fractions per op class:
#              large/small/thin GEMMs, 3x3/1x1/depthwise convolutions, SDPA in bf16, fp16 and fp32, add, sum,
#              layer norm, embedding; GPU sizes), written as the GPU's measured_roofline (an H200, which has no
#              built-in system, in H100 SXM's node), then estimate --basis roofline with it on resnet50 and
#              gpt2-small                                  ~1 min -> calibrate_hw.yaml, calibrate_hw.txt
#   heldout    issue 49: eight families trained eager in bf16-mixed on this GPU (ResNet-50, ResNeXt-50, MobileNet-V2,
#              EfficientNet-B0, ConvNeXt-T, ViT-B/16, gpt2-small, llama-1b), then EfficientNet-B0 and gpt2-small
#              compiled, ResNet-50 in fp32, ResNet-50 and MobileNet-V2 channels-last and Swin-T (the last three not
#              run yet), each with a 2-step trace; projected afterwards on any machine by
#              benchmarks/projection_h200.py from calhw's profile                 ~7 min -> heldout.md, traces_*.json.gz
#   tests      pytest -m gpu (CUDA memory vs the estimator, precisions, the device pipeline on CUDA; with 2+ GPUs
#              also DataParallel, SyncBatchNorm, model-parallel across 2 GPUs and the pipeline over NCCL in fp64
#              and fp16-mixed: tests/strategies/test_gpu.py; on one GPU they are skipped, listed by -ra)  -> tests.txt
# On the device tool, one call must end within 10 minutes: run the parts in groups, e.g.
#   "env precision seed", "methods", "fsdpw1", "fast source pipeline", "tplibs", "zeropp", "longctx", "infer",
#   "calhw heldout", "tests".
#
# DeepSpeed is not in the GPU image: carry wheels in .whl (see benchmarks/gpu_wheels.sh); without them the
# deepspeed cells are listed as skipped ("not available in this install").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-session}
WORK=${WORK:-/tmp/sb-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SB=("$PY" -m stratbench)
# the fast recipe's ResNet-50 runs (parts fast and trace): synthetic 224 px images, 10 warm-up steps
FAST=(--recipe fast --model resnet50 --data synthetic --image-size 224 --epochs 1 --timing-warmup-steps 10
      --save-every-epoch false --device cuda)
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(env precision seed methods fsdpw1 fast trace source pipeline tplibs zeropp longctx infer calhw heldout tests)

summary() {  # summary OUTFILE TITLE RUN_DIR...: one markdown row per train run (from its result.json)
    local out=$1 title=$2
    shift 2
    "$PY" - "$out" "$title" "$@" <<'EOF'
import json, sys
from pathlib import Path
out, title, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
lines = [f"## {title}", "", "| run | status | precision | compile | pipeline | batch | throughput (img/s) | MFU | train time (s) | peak allocated (GiB) | GPU util mean (%) | val acc |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for run in runs:
    p = Path(run) / "result.json"
    if not p.exists():
        lines.append(f"| {Path(run).name} | no result.json | | | | | | | | | | |")
        continue
    r = json.loads(p.read_text()); m = r.get("metrics", {}); c = r.get("config", {})
    f = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "n/a"
    peak = m.get("peak_memory_bytes") or [None]
    util = m.get("gpu_util_mean_pct") or [None]
    lines.append(f"| {Path(run).name} | {r.get('status')} {r.get('reason', '')[:80]} | {r.get('precision')} | {c.get('compile')} | "
                 f"{r.get('data_pipeline', c.get('data_pipeline'))} | {r.get('global_batch_size')} | {f(m.get('throughput_samples_per_s'), '.0f')} | "
                 f"{f(m.get('mfu') and 100 * m['mfu'], '.1f')}% | {f(m.get('train_time_s'), '.1f')} | "
                 f"{f(peak[0] and peak[0] / 2**30, '.2f')} | {f(util[0], '.0f')} | {f(m.get('val_accuracy'), '.4f')} |")
env = None
for run in runs:
    p = Path(run) / "result.json"
    if p.exists():
        env = json.loads(p.read_text()).get("environment"); break
lines += ["", f"environment: {json.dumps(env)}", ""]
Path(out).write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

train() {  # train NAME FLAGS...: one stratbench train run under $WORK/NAME; the log goes to $WORK/NAME.log
    local name=$1
    shift
    rm -rf "${WORK:?}/$name"
    echo "+ stratbench train --output $WORK/$name $*"
    "${SB[@]}" train --output "$WORK/$name" --progress false "$@" >"$WORK/$name.log" 2>&1 || tail -20 "$WORK/$name.log"
}

pack() {  # PACK=FILE: $OUT and every run's small files (no checkpoints) in one tar.gz, replaced after each part
    [ -n "${PACK:-}" ] || return 0
    (cd "$(dirname "$WORK")" && find "$(basename "$WORK")" -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' \
        -o -name '*.log' -o -name '*.csv' -o -name '*.yaml' \) -not -path '*/checkpoints/*' -not -path '*/plugins/*' \
        -not -path '*/traces/*' -size -20M) >"$PACK.list"
    tar czf "$PACK.tmp" -C "$(dirname "$WORK")" -T "$PACK.list" -C "$(cd "$OUT" && pwd)/.." "$(basename "$OUT")" \
        && mv "$PACK.tmp" "$PACK"
    rm -f "$PACK.list"
}

for part in "${PARTS[@]}"; do
    pack
    if [ "$SECONDS" -ge "${DEADLINE:-100000}" ]; then echo "=== $part skipped: past DEADLINE=$DEADLINE s"; continue; fi
    echo "=== $part ($(date -u +%H:%M:%S))"
    case $part in
    env)
        { nvidia-smi; "$PY" -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(0), "bf16", torch.cuda.is_bf16_supported())'
          "$PY" -m pip list 2>/dev/null | grep -i -E "^(torch|torchvision|accelerate|deepspeed|triton|numpy) "; git log -1 --format='stratbench commit %H'; } >"$OUT/env.txt" 2>&1
        cat "$OUT/env.txt" ;;
    precision)
        "${SB[@]}" compare --preset gpu-precision --output "$WORK/gpu-precision"
        cp "$WORK/gpu-precision/report.md" "$OUT/precision.md" ;;
    seed)
        "${SB[@]}" compare --preset seed --data synthetic --only single --output "$WORK/seed-single"
        cp "$WORK/seed-single/report.md" "$OUT/seed_single.md" ;;
    methods)
        "${SB[@]}" compare --preset gpu-fast --world-size 1 --data synthetic --synthetic-samples 5120 --epochs 1 \
            --max-steps 40 --compile false --output "$WORK/gpu-fast-w1"
        cp "$WORK/gpu-fast-w1/report.md" "$OUT/methods_w1.md" ;;
    fsdpw1)
        "${SB[@]}" compare --preset gpu-fast --world-size 1 --data synthetic --synthetic-samples 5120 --epochs 1 \
            --max-steps 40 --compile false --only single,fsdp,fsdp1 --output "$WORK/fsdp-w1"
        "$PY" - "$WORK/fsdp-w1" "$OUT/fsdp_w1.md" <<'EOF'
import json, sys
from pathlib import Path
runs = {}
for p in Path(sys.argv[1]).rglob("result.json"):
    r = json.loads(p.read_text())
    runs[r.get("strategy")] = r
lines = ["## fsdp and fsdp1 at world 1 against single: ResNet-50, 224 px, batch 128, bf16-mixed (target: within 1.2x)", "",
         "| method | status | median step (ms) | x single | units | weights | verdict |", "|---|---|---|---|---|---|---|"]
base = runs.get("single", {}).get("metrics", {}).get("step_time_median_s")
for name in ("single", "fsdp", "fsdp1"):
    r = runs.get(name)
    if r is None:
        lines.append(f"| {name} | no result.json | | | | | |")
        continue
    step = r.get("metrics", {}).get("step_time_median_s")
    ratio = step / base if step and base else None
    f = r.get("fsdp", {})
    verdict = "" if name == "single" or ratio is None else ("PASS" if ratio <= 1.2 else "FAIL")
    lines.append(f"| {name} | {r.get('status')} | {step * 1e3 if step else float('nan'):.1f} | "
                 f"{ratio if ratio else float('nan'):.2f} | {f.get('units', '')} | {f.get('weights', '')} | {verdict} |")
env = next((r.get("environment") for r in runs.values()), None)
lines += ["", f"environment: {json.dumps(env)}", ""]
Path(sys.argv[2]).write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
        ;;
    fast)
        # most telling first: a call cut off at its time limit still brings back the runs that finished
        train fast-b256-compile "${FAST[@]}" --batch-size 256 --synthetic-samples 20480 --max-steps 60
        train fast-b256-eager "${FAST[@]}" --batch-size 256 --synthetic-samples 20480 --max-steps 60 --compile false
        train fast-b256-loader "${FAST[@]}" --batch-size 256 --synthetic-samples 20480 --max-steps 60 --compile false \
            --data-pipeline loader --num-workers 8
        train fast-b128-eager "${FAST[@]}" --batch-size 128 --synthetic-samples 10240 --max-steps 60 --compile false
        # b128 with compile is the source part's run (the same recipe and batch)
        summary "$OUT/fast.md" "ResNet-50, 224 px, fast recipe (target >= 5,000 img/s on one H100)" \
            "$WORK"/fast-b256-compile "$WORK"/fast-b256-eager "$WORK"/fast-b256-loader "$WORK"/fast-b128-eager ;;
    trace)
        # one profiler trace of the fast step (b256, compiled: after the fast part, inductor's cache on disk
        # makes the compile short), 3 steps after 10 warm-up steps, in its own run so that the profiled steps
        # do not count in fast.md's timings
        train trace-b256-compile "${FAST[@]}" --batch-size 256 --synthetic-samples 5120 --max-steps 16 --profile 3
        if [ -f "$WORK/trace-b256-compile/traces/rank0.json" ]; then
            gzip -c "$WORK/trace-b256-compile/traces/rank0.json" >"$OUT/trace_fast_b256_rank0.json.gz"
        fi
        summary "$OUT/trace.md" "The profiled run (the 3 profiled steps are kept out of its step times)" "$WORK"/trace-b256-compile ;;
    source)
        if [ -n "${CIFAR_DIR:-}" ] && [ -d "$CIFAR_DIR/cifar-10-batches-py" ]; then
            data=(--data cifar10 --data-dir "$CIFAR_DIR")
        else
            data=(--data synthetic --synthetic-samples 50000)
        fi
        train source-fast --recipe fast --model resnet50 "${data[@]}" --image-size 224 --epochs 5 --batch-size 128 --device cuda
        summary "$OUT/source.md" "The source experiment, fast recipe (target <= 60 s of training; the source: 1,546 s on one P40)" \
            "$WORK"/source-fast ;;
    pipeline)
        "$PY" benchmarks/input_pipeline.py --device cuda --sizes 32 224 --workers 0 8 --n-train 50000 --batches 50 \
            --repeats 5 --output "$OUT/pipeline.md" ;;
    tplibs)
        lm=(--model gpt-tiny --data text --seq-len 128 --batch-size 16 --epochs 1 --max-steps 40 --optimizer adamw
            --lr 0.003 --precision bf16-mixed --device cuda --nproc 2 --timing-warmup-steps 5)
        train tp-gpu2 --strategy tp "${lm[@]}"
        train autotp-gpu2 --strategy deepspeed --autotp-size 2 --zero-stage 1 "${lm[@]}"
        train accelerate-tp-gpu2 --strategy accelerate-tp "${lm[@]}"
        summary "$OUT/tplibs.md" "Tensor parallelism through the libraries on 2 GPUs: tp, DeepSpeed AutoTP, accelerate-tp" \
            "$WORK"/tp-gpu2 "$WORK"/autotp-gpu2 "$WORK"/accelerate-tp-gpu2 ;;
    zeropp)
        # ZeRO++ (issue 45): ZeRO-3, qwZ, qgZ and hpZ on gpt-tiny. Every parameter is freed after forward
        # (persistence 0, reuse distance 0, prefetch 0), so forward and backward gather and qwZ quantises them.
        gpus=$(nvidia-smi -L 2>/dev/null | wc -l); n=$(( gpus >= 2 ? 2 : 1 ))
        echo '{"zero_optimization": {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}' >"$WORK/release.json"
        lm=(--model gpt-tiny --data text --seq-len 128 --batch-size 16 --epochs 1 --max-steps 40 --optimizer adamw
            --lr 0.003 --precision bf16-mixed --device cuda --nproc "$n" --timing-warmup-steps 5 --comm-volume true
            --strategy deepspeed --zero-stage 3 --deepspeed-config "$WORK/release.json")
        train zero3-gpu$n "${lm[@]}"
        train qwz-gpu$n "${lm[@]}" --zero-quantized-weights
        train qgz-gpu$n "${lm[@]}" --zero-quantized-gradients
        runs=("$WORK"/zero3-gpu$n "$WORK"/qwz-gpu$n "$WORK"/qgz-gpu$n)
        # hpZ needs a secondary group of 2+ ranks inside the node: 2 GPUs (S = the world: it runs, and gathers
        # backward over the same 2 ranks); on one GPU DeepSpeed gathers nothing (one partition), and qwZ/qgZ
        # show only that the config is accepted and the quantizer kernel builds (qgZ's all-to-all runs only
        # across nodes: DeepSpeed's own condition).
        if [ "$n" -ge 2 ]; then train hpz-gpu$n "${lm[@]}" --zero-hpz 2; runs+=("$WORK"/hpz-gpu$n); fi
        summary "$OUT/zeropp.md" "ZeRO++ on $n GPU(s): ZeRO-3, qwZ, qgZ, hpZ (gpt-tiny, bf16-mixed)" "${runs[@]}"
        "$PY" - "$OUT/zeropp.md" "${runs[@]}" <<'EOF'
import json, sys
from pathlib import Path
lines = ["| run | kind | measured payload (B/step) | formula (B/step) | error |", "|---|---|---|---|---|"]
for run in sys.argv[2:]:
    p = Path(run) / "result.json"
    comm = json.loads(p.read_text()).get("metrics", {}).get("comm", {}) if p.exists() else {}
    for kind, c in sorted((comm.get("check") or {}).items()):
        lines.append(f"| {Path(run).name} | {kind} | {c['measured_payload_bytes']:.0f} | {c['predicted_payload_bytes']} | {c['error_pct']:.2f}% |")
with open(sys.argv[1], "a") as f:
    f.write("\n".join(["", "Collectives of step 3 against the comm_model rows (docs/communication.md, ZeRO++):", ""] + lines) + "\n")
print("\n".join(lines))
EOF
        ;;
    longctx)
        # issue 46: recomputation modes on one GPU; context parallelism and zero-bubble schedules on 2+ GPUs
        gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
        lm=(--model gpt2-small --data synthetic-tokens --vocab-size 50304 --seq-len 1024 --batch-size 8 --epochs 1
            --max-steps 30 --optimizer adamw --lr 3e-4 --precision bf16-mixed --device cuda --timing-warmup-steps 5
            --eval-samples 8)
        train ac-none "${lm[@]}"
        runs=("$WORK"/ac-none)
        for mode in full selective every:2; do
            train "ac-${mode/:/}" "${lm[@]}" --activation-checkpointing --ac-mode "$mode"; runs+=("$WORK/ac-${mode/:/}")
        done
        # float8 (torchao): eager and compiled, against bf16-mixed compiled (torchtitan's comparison)
        for f8 in tensorwise rowwise; do
            train "f8-$f8" "${lm[@]}" --float8 "$f8"; train "f8-$f8-compile" "${lm[@]}" --float8 "$f8" --compile
            runs+=("$WORK/f8-$f8" "$WORK/f8-$f8-compile")
        done
        train bf16-compile "${lm[@]}" --compile; runs+=("$WORK"/bf16-compile)
        if [ "$gpus" -ge 2 ]; then
            cp=("${lm[@]}" --batch-size 2 --nproc 2 --strategy fsdp --comm-volume true)
            train fsdp-b2-gpu2 "${cp[@]}"; train fsdp-cp2-b2-gpu2 "${cp[@]}" --cp 2
            runs+=("$WORK"/fsdp-b2-gpu2 "$WORK"/fsdp-cp2-b2-gpu2)
            pp=(--model gpt-tiny --data text --seq-len 256 --batch-size 32 --epochs 1 --max-steps 30 --device cuda
                --nproc 2 --strategy pipeline --microbatches 8 --timing-warmup-steps 5)
            for sch in 1f1b zb-interleaved zbv dualpipev; do
                train "pp-$sch-gpu2" "${pp[@]}" --schedule "$sch"; runs+=("$WORK/pp-$sch-gpu2")
            done
        fi
        summary "$OUT/longctx.md" "Issue 46 on $gpus GPU(s): recomputation modes, context parallelism, zero-bubble schedules" "${runs[@]}"
        "$PY" - "$OUT/longctx.md" "${runs[@]}" <<'EOF'
import json, sys
from pathlib import Path
from stratbench.core.config import TrainConfig, from_dict
from stratbench.predicting.estimate import estimate


def estimate_error(r):
    """The estimate's peak against the run's own: torch.cuda.max_memory_allocated per rank (on CUDA)."""
    peaks = [a for a in r["metrics"].get("peak_memory_bytes") or [] if a]
    device = "cuda" if r["metrics"].get("peak_memory_kind") == "cuda_max_allocated" else "cpu"
    if device == "cpu":
        peaks = [a for a in r["metrics"].get("cpu_alloc_peak_bytes") or [] if a]
    e = estimate(from_dict(TrainConfig, dict(r["config"])), r["world_size"], device)
    return (e.peak_bytes - max(peaks)) / max(peaks)


lines = ["| run | step median (ms) | tokens/s | estimate vs peak | bubble (median per rank) | all_to_all B/step (formula) |", "|---|---|---|---|---|---|"]
for run in sys.argv[2:]:
    p = Path(run) / "result.json"
    if not p.exists():
        lines.append(f"| {Path(run).name} | no result.json | | | | |")
        continue
    r = json.loads(p.read_text()); m = r.get("metrics", {})
    try:
        err = f"{100 * estimate_error(r):+.1f}%"
    except Exception as exc:  # a run whose estimate cannot be read says why
        err = f"n/a ({str(exc)[:60]})"
    bubble = [round(x["bubble"].get("median", 0), 3) for x in (r.get("pipeline") or {}).get("ranks", [])]
    a2a = (m.get("comm") or {}).get("check", {}).get("all_to_all", {})
    a2a_s = f"{a2a['measured_payload_bytes']:.0f} ({a2a['predicted_payload_bytes']})" if a2a else ""
    lines.append(f"| {Path(run).name} | {1e3 * (m.get('step_time_median_s') or 0):.1f} | {m.get('throughput_tokens_per_s') or 0:.0f} | {err} | {bubble or ''} | {a2a_s} |")
with open(sys.argv[1], "a") as f:
    f.write("\n".join(["", "Step time, the memory estimate against the measured peak, pipeline bubbles, cp's all-to-all:", ""] + lines) + "\n")
print("\n".join(lines))
EOF
        ;;
    infer)
        train infer-resnet18 --strategy single --model resnet18 --data digits --batch-size 64 --epochs 4 \
            --optimizer adamw --lr 0.002 --device cuda
        train infer-gpt-tiny --strategy single --model gpt-tiny --data text --seq-len 128 --batch-size 16 --epochs 1 \
            --max-steps 300 --optimizer adamw --lr 0.003 --device cuda
        for name in resnet18 gpt-tiny; do
            "${SB[@]}" bench-infer --checkpoint "$WORK/infer-$name/checkpoints/last" --device cuda \
                --batch-sizes 1,8,32,128 --warmup 3 --iters 50 --min-iters 10 --max-seconds 10 \
                --output "$OUT/infer_$name.csv" --report "$OUT/infer_$name.md" 2>&1 | tail -40
        done ;;
    calhw)
        "${SB[@]}" calibrate-hw --device cuda --output "$OUT/calibrate_hw.yaml" 2>&1 | tee "$OUT/calibrate_hw.txt"
        for model in "resnet50 --batch-size 256" "gpt2-small --data synthetic-tokens --seq-len 1024 --batch-size 8"; do
            echo "+ stratbench estimate --model $model --precision bf16-mixed --time --basis roofline --hardware $OUT/calibrate_hw.yaml"
            # shellcheck disable=SC2086  # $model: the model and its data flags
            "${SB[@]}" estimate --model $model --precision bf16-mixed --strategy single --time --basis roofline \
                --hardware "$OUT/calibrate_hw.yaml" 2>&1 | tail -12
        done >>"$OUT/calibrate_hw.txt" ;;
    heldout)
        # issue 49: training throughput of a spread of families on this GPU (eager, bf16-mixed, the device pipeline,
        # 224 px / the models' own context), each with a 2-step profiler trace (kept out of its step times) for the
        # roofline's per-op check; projected afterwards with calibrate_hw.yaml (calhw) on any machine, never fitted
        # to these runs                                                           ~5 min -> heldout.md, traces_*.json.gz
        img=(--data synthetic --image-size 224 --epochs 1 --max-steps 40 --timing-warmup-steps 10 --profile 2
             --save-every-epoch false --precision bf16-mixed --device cuda --optimizer sgd --lr 0.001)
        tok=(--data synthetic-tokens --vocab-size 50304 --epochs 1 --max-steps 40 --timing-warmup-steps 10 --profile 2
             --save-every-epoch false --precision bf16-mixed --device cuda --optimizer adamw --lr 3e-4 --eval-samples 8)
        runs=()
        heldout_run() {  # NAME FLAGS...: one timed run (at most 150 s) and its trace gzipped into $OUT
            local name=$1; shift
            [ "$SECONDS" -lt "${DEADLINE:-100000}" ] || { echo "skip $name: past DEADLINE"; return; }
            local SB=(timeout 150 "$PY" -m stratbench)
            train "$name" "$@"
            [ -f "$WORK/$name/traces/rank0.json" ] && gzip -c "$WORK/$name/traces/rank0.json" >"$OUT/traces_$name.json.gz"
            runs+=("$WORK/$name")
            pack  # a call cut off mid-part still brings back the runs that finished
        }
        for spec in "resnet50 256" "torchvision.models:resnext50_32x4d 128" "torchvision.models:mobilenet_v2 256" \
                    "torchvision.models:efficientnet_b0 256" "torchvision.models:convnext_tiny 128" \
                    "torchvision.models:vit_b_16 128"; do
            set -- $spec
            heldout_run "ho-${1##*:}-b$2" --model "$1" --batch-size "$2" --synthetic-samples $(( $2 * 52 )) "${img[@]}"
        done
        heldout_run ho-gpt2-small-s1024-b8 --model gpt2-small --seq-len 1024 --batch-size 8 "${tok[@]}"
        heldout_run ho-llama-1b-s2048-b4 --model llama-1b --seq-len 2048 --batch-size 4 "${tok[@]}"
        # then the same recipe compiled (fusion: the roofline's eager vs compiled) and in fp32 (TF32 off: torch's default)
        heldout_run ho-efficientnet_b0-b256-compile --model torchvision.models:efficientnet_b0 --batch-size 256 \
            --synthetic-samples 13312 "${img[@]}" --compile
        heldout_run ho-gpt2-small-s1024-b8-compile --model gpt2-small --seq-len 1024 --batch-size 8 "${tok[@]}" --compile
        heldout_run ho-resnet50-b128-fp32 --model resnet50 --batch-size 128 --synthetic-samples 6656 "${img[@]}" \
            --precision fp32
        # channels-last (NHWC: cuDNN's batch norm instead of torch's NCHW kernel, which took 58% of ResNet-50's GPU
        # time on 2026-11-28) and a Swin transformer; not run yet
        heldout_run ho-resnet50-b256-nhwc --model resnet50 --batch-size 256 --synthetic-samples 13312 "${img[@]}" \
            --channels-last
        heldout_run ho-mobilenet_v2-b256-nhwc --model torchvision.models:mobilenet_v2 --batch-size 256 \
            --synthetic-samples 13312 "${img[@]}" --channels-last
        heldout_run ho-swin_t-b128 --model torchvision.models:swin_t --batch-size 128 --synthetic-samples 6656 "${img[@]}"
        summary "$OUT/heldout.md" "Issue 49: a spread of families on this GPU (eager bf16-mixed, then compiled and fp32)" "${runs[@]}" ;;
    tests)
        "$PY" -m pytest -m gpu tests -q -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" | tail -30 ;;
    pack) ;;  # only the packing every part is preceded by (after a part cut off by a time limit)
    *)
        echo "unknown part $part; parts: env precision seed methods fsdpw1 fast trace source pipeline tplibs zeropp longctx infer calhw heldout tests pack" >&2
        exit 2 ;;
    esac
done
pack
echo "=== done ($(date -u +%H:%M:%S)); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
