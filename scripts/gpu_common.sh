# Sourced by the scripts/gpu_*.sh device-call scripts, from the repository root: strict mode;
# wheels carried in .whl/ (the openai client of phase 10's server tests, absent from the GPU
# image) installed to /tmp/site; unbuffered Python importing this checkout; $OUT (default ./out)
# made; the clock (SECONDS) started; and two helpers:
#   fits EST NAME               true while EST seconds are left of BUDGET_S (default 580), else
#                               a line saying section NAME is skipped
#   logged NAME SECONDS CMD...  CMD under a timeout, its output in $OUT/NAME.log, "NAME rc=N"
#                               appended to $OUT/sections.log
# At exit every file of $OUT is also packed into $OUT/00-bundle.tgz, which sorts first: the device
# tool returns only the first 8 files of a call (by name), and two reports were lost that way.
# Unpack it where the files came back: tar xzf 00-bundle.tgz
set -uo pipefail
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
SECONDS=0

fits() {
    if [ $(( ${BUDGET_S:-580} - SECONDS )) -lt "$1" ]; then echo "skip $2 ($SECONDS s used)"; return 1; fi
}

logged() {
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?" >> "$OUT/sections.log"
}

bundle() {
    tar czf "$OUT/00-bundle.tgz" -C "$OUT" --exclude 00-bundle.tgz . 2> /dev/null || true
}
trap bundle EXIT
