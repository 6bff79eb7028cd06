#!/usr/bin/env bash
# Every check this project runs on a lent GPU machine, in one go (one H200: layouts with one stage and replica).
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]        # logs and the timeline picture land in OUT_DIR (default $OUT or /tmp)
#
# 1. gpu_smoke, bf16-mixed, the small GPT: trains, writes durable checkpoints and snapshots, traces a timeline;
# 2. the same root again with 40 more steps: resumes from the checkpoint written on CUDA;
# 3. gpu_smoke, 16-mixed: the coordinated loss scaler with CUDA's GradScaler;
# 4. the small GPT under plain Lightning and under spot_pipeline with one micro-batch: the strategy's fixed cost;
# 5. a 340M-parameter GPT (d_model 1536, 12 layers, block 1024), bf16: MFU under spot_pipeline with 1 and 4
#    micro-batches, and under plain Lightning;
# 6. the 340M GPT with snapshots at the interval the cadence chooses (big_cadence), and with a durable checkpoint
#    every 100 steps (5.4 GB each) and snapshots: what saving costs the loop;
# 7. gpu_host_copy: what copying 5 GB of state to host memory costs (pinned or not, blocking or not);
# 8. where the small GPT's steps make the host wait for the GPU, plain Lightning and spot_pipeline (the places
#    only spot_pipeline has are the suspects for its 1.6 ms per step);
# 9. a Hugging Face Llama from transformers (below);
# 10. the MLP table of pipeline_throughput.py on the host's CPUs (gloo, no GPU): once on two cores (taskset), as on
#    the development machine, where four ranks share two cores and every rank's fixed cost adds up; once on all
#    cores, a core or more per rank, as on a GPU host (issue 26's goal of 1.10x for P2xD2 and P4xD1; about three
#    minutes each: ONLY=mlp_all runs the second alone);
# 11. torchft's traffic between pipelines over NCCL, and over gloo, one pipeline on the GPU (benchmarks/ft_nccl.py).
# Each check has its own time limit; one that fails is reported and the next one runs. ONLY='regex' runs the
# checks whose names match; PROFILE=1 also writes a cProfile of each check. Each check's whole output lands in
# OUT_DIR/logs.tgz (NAME.txt), the summary in OUT_DIR/gpu_checks.log.
set -u
out=${1:-${OUT:-/tmp}}
mkdir -p "$out"
log="$out/gpu_checks.log"
logs="$out/logs" # each check's whole output, packed into logs.tgz at the end
mkdir -p "$logs"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
root=$(mktemp -d)
failed=0

check() {  # check NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    [[ $name =~ ${ONLY:-.} ]] || return 0
    [[ ${PROFILE:-0} == 1 && $1 == python3 ]] && set -- python3 -m cProfile -o "$logs/$name.prof" "${@:2}"
    echo "=== $name ($(date +%T))" | tee -a "$log"
    local start=$SECONDS
    if timeout "$limit" "$@" >"$logs/$name.txt" 2>&1; then
        echo "=== $name: ok in $((SECONDS - start)) s" | tee -a "$log"
    else
        echo "=== $name: FAILED (exit $?) in $((SECONDS - start)) s" | tee -a "$log"
        failed=$((failed + 1))
    fi
    grep -E "gpu_smoke:|gpu_host_copy:|ft_nccl:|throughput|resumed from|resuming from|done: layout|SpotCheckpoint: [0-9s]|Error|error:" "$logs/$name.txt" | tail -n 16 | tee -a "$log"
}

{
    nvidia-smi -L
    python3 -c "import torch, lightning, torchmetrics; print('torch', torch.__version__, 'lightning', lightning.__version__, \
'torchmetrics', torchmetrics.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee -a "$log"

small=(python3 benchmarks/gpu_smoke.py --max-steps 100 --val-every 50)
check smoke_bf16 150 "${small[@]}" --root "$root/small"
check resume_bf16 120 "${small[@]}" --root "$root/small" --max-steps 140 --timeline-steps 0
cp "$root"/small/pipeline_timeline/*.png "$out/" 2>/dev/null
check smoke_fp16 120 "${small[@]}" --root "$root/fp16" --precision 16-mixed --max-steps 60 --timeline-steps 0
lean=(--max-steps 60 --val-every 1000 --timeline-steps 0 --microbatches 1 --checkpoint-every 100000 --no-resume)
check small_plain 120 "${small[@]}" "${lean[@]}" --root "$root/small_plain" --plain
check small_spot_m1 120 "${small[@]}" "${lean[@]}" --root "$root/small_m1"
rm -rf "$root"/small_*
big=(python3 benchmarks/gpu_smoke.py --d-model 1536 --n-layer 12 --n-head 12 --block-size 1024 --batch-size 16
    --max-steps 40 --val-every 1000 --timeline-steps 0 --checkpoint-every 100000 --no-resume)
check big_plain 180 "${big[@]}" --root "$root/big_plain" --plain
check big_spot_m1 180 "${big[@]}" --root "$root/big_m1" --microbatches 1
rm -rf "$root"/big_m1
check big_spot_m4 180 "${big[@]}" --root "$root/big_m4" --microbatches 4
rm -rf "$root"/big_m4
check big_cadence 150 "${big[@]}" --root "$root/big_cadence" --microbatches 1 --max-steps 400
rm -rf "$root"/big_cadence
check big_checkpoints 240 "${big[@]}" --root "$root/big_ckpt" --microbatches 1 --max-steps 320 --checkpoint-every 100
rm -rf "$root"/big_ckpt
check host_copy 120 python3 benchmarks/gpu_host_copy.py
sync=(--max-steps 30 --val-every 1000 --timeline-steps 0 --microbatches 1 --checkpoint-every 100000 --no-resume --sync-debug)
check sync_plain 120 "${small[@]}" "${sync[@]}" --root "$root/sync_plain" --plain
check sync_spot 120 "${small[@]}" "${sync[@]}" --root "$root/sync_spot"
for name in sync_plain sync_spot; do # the places that synchronise (each reported once), into the log
    [[ -f $logs/$name.txt ]] || continue
    echo "--- $name: where the host waits for the GPU" | tee -a "$log"
    grep -A1 "synchronizing CUDA operation" "$logs/$name.txt" | grep -v -- "^--" | head -n 60 | tee -a "$log"
done
# 9. a Hugging Face Llama (tied embeddings, ~200M parameters, random init) through examples/hf_llama: trains bf16 on
#    CUDA, saves, and resumes from its own checkpoint. transformers comes from .whl/hf when the image lacks it
#    (`pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl/hf
#    transformers==5.25.0`, then drop the numpy, fsspec and typing_extensions wheels the image has).
hf_path=
if ! python3 -c "import transformers" 2>/dev/null && compgen -G ".whl/hf/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$root/hf" .whl/hf/*.whl &&
        hf_path="$root/hf"
fi
hf=(env PYTHONPATH="$PYTHONPATH${hf_path:+:$hf_path}" python3 examples/hf_llama/train.py --accelerator gpu --devices 1
    --pipeline-stages 1 --microbatches 2 --precision bf16-mixed --hidden-size 1024 --layers 12 --heads 16
    --block-size 512 --batch-size 16 --val-every 1000 --root "$root/hf_llama")
check hf_llama 180 "${hf[@]}" --max-steps 40 --checkpoint-every 20
check hf_llama_resume 120 "${hf[@]}" --max-steps 60 --checkpoint-every 20
# 11. torchft on the GPU (issue 62): one pipeline whose traffic between pipelines goes over NCCL
#    (ProcessGroupBabyNCCL), then the same over gloo (copies through host memory). torchft comes from .whl/ft when the
#    image lacks it (`pip download --only-binary=:all: --no-deps --python-version 3.12 --platform
#    manylinux_2_28_x86_64 -d .whl/ft torchft==0.2.0`).
ft_path=
if ! python3 -c "import torchft" 2>/dev/null && compgen -G ".whl/ft/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$root/ft" .whl/ft/*.whl &&
        ft_path="$root/ft"
fi
ft=(env PYTHONPATH="$PYTHONPATH${ft_path:+:$ft_path}" python3 benchmarks/ft_nccl.py --steps 30)
check ft_nccl 150 "${ft[@]}"
check ft_gloo 150 "${ft[@]}" --group gloo
# 10. (CPU only) four ranks on two cores, then on all of them
mlp=(python3 benchmarks/pipeline_throughput.py --model mlp --layouts P2xD2,P4xD1 --steps 200 --repeats 3)
if command -v taskset >/dev/null; then
    check mlp_two_cores 300 taskset -c 0,1 "${mlp[@]}"
fi
check mlp_all_cores 300 "${mlp[@]}"
for name in mlp_two_cores mlp_all_cores; do # the table and its rounds, into the log
    [[ -f $logs/$name.txt ]] && grep -E "^mlp |^per round|OMP_NUM_THREADS" "$logs/$name.txt" | tee -a "$log"
done
rm -rf "$root"
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$logs" # few files come back from a lent machine
echo "gpu_checks: $failed failed" | tee -a "$log"
exit "$failed"
