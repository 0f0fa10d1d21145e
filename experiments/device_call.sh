# The next lent GPU's first call (issue 48 item 6), prepared so that one call of the run tool spends it well.
#
#   mkdir -p .device/data && cp -r ../shared/data/fashion_mnist ../shared/data/mnist .device/data/
#   # run tool: command "bash experiments/device_call.sh", carry [".device"], timeout_s 580
#
# In order, each step under its own time limit so that one failing or slow step costs only itself:
#   1. FSL cohorts 25 / 100 / 250 (packed and vmap) since large layers bisect off the CPU: the H200's
#      fsl_cohort record predates that change (perf/README.md, gpu_targets_h200.json).        ~100 s
#   2. Personalised evaluation of 100 SpaFL FMNIST clients, per_client against the batched reference
#      (vmap over chunks, batched im2col since issue 48): whether an accelerator's personal_eval
#      should be batched (the H200's per_client: 81 ms against a 20 ms target).               ~90 s
#   3. FSL MNIST at the paper's 2000 rounds, alone on the GPU (0.076 s a round on an H200); its run
#      folder comes back packed, so a later call can resume it.                                ~250 s
# What is left after a 580 s call: SFSL 50 % at 2000 rounds (the same command with --methods sfsl50),
# spafl_eval_every_1 and sweep_3x3 (gpu_targets.py --parts ...), each a call of its own.
# Everything lands in $OUT (at most 8 files, none nested deeper than the device tool returns).
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia_smi.csv" 2>&1
{
  timeout -s KILL 170 python3 experiments/gpu_targets.py --parts fsl_cohort --data-dir .device/data \
      --out "$OUT/gpu_targets.json" --budget-seconds 160
  timeout -s KILL 120 python3 experiments/bench/bench_eval.py --data-dir .device/data --repeats 5 \
      --chunk-examples 2048 8192 --granularity 32 --out "$OUT/eval_personal.json" > /dev/null
  R=.device/runs
  timeout -s TERM 260 python3 experiments/reproduce/fsl_mnist.py --tables table1 --methods fsl --rounds 2000 \
      --eval-every 100 --data-dir .device/data --out $R
  tar czf "$OUT/fsl_run.tgz" -C $R .
} 2>&1 | tee "$OUT/log.txt"
