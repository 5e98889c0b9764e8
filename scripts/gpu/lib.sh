# Sourced by the GPU entry scripts (attention.sh, e2e.sh, stream.sh, regression.sh), not run:
# the output folder, the wheels the GPU image lacks, and what the card was doing.

# $out := $OUT (default .devout), created, as an absolute path
gpu_out() {
  out=${OUT:-.devout}
  mkdir -p "$out" && out=$(cd "$out" && pwd)
}

# NIXL, msgspec and pyzmq: the GPU image has none of them. They travel as cp312 wheels in $WHL
# (default .whl, ignored by git; call the device with carry: [".whl"]):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl nixl-cu13==1.5.1 nixl==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
# nixl-cu13's wheel (59 MB) is over what a call carries with the rest: repack it without
# nixl_ep_cu13/ (the expert-parallel torch extensions), nixl_cu13.scripts/ and UCX's perftest library
# (and their RECORD lines): 28 MB. nixl's meta package then picks nixl_cu13 by itself (torch is cu130).
# With nixl-cu12 instead, VRAM registration fails ("VRAM memory is detected as host by UCX") unless
# UCX_MEMTYPE_CACHE=n (docs/bench/2026-12-01-e2e-stream-nixl/): set here unless already set.
# No wheels: nothing installed (the bench then streams with its side-stream copy instead of NIXL).
gpu_wheels() {
  local whl=${WHL:-.whl}
  [ -n "${_GPU_WHEELS_DONE:-}" ] && return 0
  if ls "$whl"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$whl"/*.whl || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export UCX_MEMTYPE_CACHE=${UCX_MEMTYPE_CACHE:-n}
  fi
  export _GPU_WHEELS_DONE=1
}

# the card and the software, one line each
gpu_info() {
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
    --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, 'cudnn', torch.backends.cudnn.version())"
}

# SM clock, power, memory and throttle reasons every $2 ms (default 200) into $1, in the background,
# to line up with a bench's "phases"; gpu_smi_stop ends it
gpu_smi_start() {
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,memory.used,clocks_event_reasons.active \
    --format=csv,noheader -lms "${2:-200}" > "$1" 2>&1 &
  _gpu_smi=$!
}
gpu_smi_stop() {
  [ -n "${_gpu_smi:-}" ] && kill "$_gpu_smi" 2>/dev/null
  _gpu_smi=
}
