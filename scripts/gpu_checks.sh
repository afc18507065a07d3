#!/usr/bin/env bash
# The GPU checks to run whenever a session is lent a GPU machine (docs/benchmarks.md keeps the figures).
#
# That machine has Python 3.12 with CUDA torch, numpy, numba, transformers, nvidia-ml-py and
# prometheus-client, but no network and no Ray (too big to carry), so moeless travels as a wheel
# with the few packages it lacks. Here, first:
#   mkdir -p .whl && echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .whl .
#   .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl grpcio==1.85.1 protobuf==7.36.2 grpcio-reflection==1.85.1
# and NIXL (transport nixl; bench transport then adds its nixl and nixl_device rows), the build for that
# machine's CUDA 13 torch (nixl-cu12's UCX cannot register GPU memory beside it: measured 2026-11-27).
# Its 59 MB wheel is near the 64 MiB a run carries; its nixl_ep_cu13 kernels (3 x 31 MB, for NIXL's own
# expert dispatch, which moeless does not import) and UCX's perftest come out, leaving 29 MB:
#   .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl nixl-cu13==1.5.1 && \
#       zip -q -d .whl/nixl_cu13-*.whl 'nixl_ep_cu13/*' 'nixl_cu13.libs/ucx/libucx_perftest*'
# then run `bash scripts/gpu_checks.sh [STEP...]` there with .whl carried; steps: planner, forward,
# transport, mps, serving, peer, cpu (default: all). Results land in $OUT: gpu_checks.log and one JSON file per
# run (more than 8 files: tar $OUT into one to bring it back).
set -u
OUT=${OUT:-/tmp/moeless-gpu}
STEPS=${*:-planner forward transport mps serving peer cpu}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_checks.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --ignore-requires-python \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp  # not the checkout: its moeless/ folder would shadow the installed package
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, numba, transformers; print('torch', torch.__version__, 'numba', numba.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
step() { [[ " $STEPS " == *" $1 "* ]]; }
# 1. The cost profile measured on the GPU (the default model's geometry, its loads replayed).
step planner && timeout 150 python3 -m moeless bench planner --device cuda --quick --out "$OUT/planner"
# 2. Which expert forward a GPU host should run (grouped or sequential, float32 or bfloat16).
step forward && timeout 120 python3 "$OLDPWD/scripts/gpu_forward_check.py" "$OUT/forward.json"
# 3. Expert hosts computing on the GPU, reached over every transport, at Mixtral-8x7B's shapes in
#    bfloat16, computing in float32 (bit-identical to the float32 reference) and in bfloat16.
if step transport; then
  for dtype in float32 store; do
    timeout 200 python3 -m moeless bench transport --device cuda --geometry mixtral-8x7b --quick \
        --compute-dtype $dtype --out "$OUT/transport-$dtype"
  done
fi
# 4. The same in bfloat16 with the node's MPS daemon on: the host and this process take turns on one
#    GPU (local_device, CUDA IPC), and without MPS each turn is a context switch.
if step mps && command -v nvidia-cuda-mps-control >/dev/null; then
  nvidia-cuda-mps-control -d && sleep 1
  timeout 200 python3 -m moeless bench transport --device cuda --geometry mixtral-8x7b --quick \
      --compute-dtype store --out "$OUT/transport-store-mps"
  echo quit | nvidia-cuda-mps-control
fi
# 5. A serving replica on the GPU (`moeless serve --device cuda` without Ray): its experts on local
#    hosts over every transport, each layer call bit-identical to in-process on the GPU, the tokens
#    equal, the logits the unmodified model's; the MoE layer's ratio to in-process per phase.
step serving && timeout 150 python3 "$OLDPWD/scripts/gpu_serving_check.py" --device cuda --out "$OUT/serving"
# 6. A replica copied from a peer host's GPU memory (over NIXL GPU to GPU, the hosts' first route: within the one
#    GPU here; and over CUDA IPC, on a host with --no-nixl) against the host's own store and
#    host tier (pinned memory -> GPU); the copies computing exactly. At the default model's 0.33 MB experts,
#    then DeepSeek-V2-Lite's 34.6 MB (random weights of those shapes: the default model is not carried there).
#    Its "region" row asks for one link region's worth at a time (--peer-ask-mb 0: one 34.6 MB expert an ask),
#    against asks streamed through the region (the default): what an ask's fixed part costs on the GPU route.
if step peer; then
  timeout 150 python3 -m moeless bench peer-copy --device cuda --expert-shape 48x576 --layers 8 --out "$OUT/peer-copy"
  timeout 150 python3 -m moeless bench peer-copy --device cuda --expert-shape 1408x2048 --layers 1 --experts 16 \
      --out "$OUT/peer-copy-35mb"
fi
# 7. The CPU rows on that machine's 16 cores (the hosts kept off the GPU: --cpu): what the pod path costs
#    where the replica and each host have cores of their own, blocking and polling, and a CPU replica.
if step cpu; then
  timeout 90 python3 -m moeless bench transport --geometry default --quick --out "$OUT/cpu-transport"
  timeout 90 python3 -m moeless bench transport --geometry default --quick --poll-us 1000 1000 --out "$OUT/cpu-transport-poll"
  timeout 120 python3 "$OLDPWD/scripts/gpu_serving_check.py" --device cpu --out "$OUT/cpu-serving"
fi
