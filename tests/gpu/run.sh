#!/usr/bin/env bash
# The GPU checks, on a machine with an NVIDIA GPU and no network: from the repository root,
#     bash tests/gpu/run.sh
# after `bash tests/gpu/prepare.sh` has filled .gpu-deps/ (carried with the checkout).
#  1. installs the carried wheels (libucx-cu13, nanobind) into /tmp/gpu-site;
#  2. builds the native module with CMake (no pip) into /tmp/gpu-build, against the
#     machine's liburing/OpenSSL headers where it has them, else the carried Debian ones
#     (OpenSSL: the machine's libcrypto.so.3 if any, else the carried libcrypto.a);
#  3. makes /tmp/gpu-pkg/mooncake_ray: the checkout's package with a Ray-free __init__ and
#     the built module (the GPU machine has no Ray and no pydantic);
#  4. prints the machine (GPU, torch, cupy, CPU flags, UCX version, memory types);
#  5. runs pytest on each file of tests/gpu, correctness first (log: $OUT/gpu.log; bandwidth:
#     $OUT/gpu_bench.json, or /tmp/gpu_bench.json without $OUT); a summary table last.
# Here (no GPU) it is a dry run: the same build, every test skips. Settings:
#   PY=python              interpreter (default python3), e.g. PY=.venv/bin/python
#   MCR_GPU_CARRIED=1      use the carried headers and libraries even where the system has them
#   MCR_GPU_STATIC_CRYPTO=1  with MCR_GPU_CARRIED=1: link the carried libcrypto.a
#   MCR_GPU_STRICT=1       fail the bandwidth test when a target is missed
#   MCR_GPU_FAKE=1         without a GPU, run the checks' logic on host memory (tests the
#                          tests; inside a network namespace here: unshare --net)
#   MCR_GPU_BENCH_BLOCKS=N blocks of the bandwidth test (default 256)
#   PYTEST_ARGS=...        more pytest arguments (e.g. -k staging)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
PY=${PY:-python3}
DEPS=$ROOT/.gpu-deps
SITE=/tmp/gpu-site
BUILD=/tmp/gpu-build
PKG=/tmp/gpu-pkg
INC=/tmp/gpu-inc
OUTDIR=${OUT:-}
LOG=${OUTDIR:+$OUTDIR/gpu.log}
LOG=${LOG:-/tmp/gpu.log}
BENCH=${OUTDIR:+$OUTDIR/gpu_bench.json}
BENCH=${BENCH:-/tmp/gpu_bench.json}

step() { printf '\n== [%s +%ss] %s\n' "$(date +%T)" "$SECONDS" "$*"; }
die() { echo "FATAL: $*" >&2; exit 2; }

main() {
  step "machine"
  uname -srm
  (nvidia-smi -L && nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv) 2>&1 \
    || echo "(no nvidia-smi)"
  PYBIN=$(command -v "$PY") || die "no interpreter $PY"
  echo "python: $PYBIN ($("$PYBIN" -c 'import sys; print(sys.version.split()[0])'))"
  grep -m1 '^model name' /proc/cpuinfo || true
  echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512bw|avx512_bf16|amx_tile|amx_bf16|amx_int8|sha_ni)$' | tr '\n' ' ')"
  echo "cores: $(nproc); memory: $(free -g 2>/dev/null | awk '/^Mem:/ {print $2 " GiB"}'); /dev/shm: $(df -h /dev/shm 2>/dev/null | awk 'NR==2 {print $2 " (" $4 " free)"}')"
  "$PYBIN" -c 'import sysconfig, os; i = sysconfig.get_paths()["include"]; print("Python.h:", i, "present" if os.path.exists(os.path.join(i, "Python.h")) else "MISSING")'
  command -v c++ >/dev/null || die "no C++ compiler (c++)"

  step "carried wheels -> $SITE"
  ls "$DEPS"/wheels/*.whl >/dev/null 2>&1 || die "no wheels in $DEPS/wheels: run bash tests/gpu/prepare.sh here first, and carry .gpu-deps"
  rm -rf "$SITE"
  "$PYBIN" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$SITE" "$DEPS"/wheels/*.whl \
    || die "pip could not install the carried wheels"
  export PYTHONPATH=$SITE
  "$PYBIN" -c 'import libucx, nanobind; print("libucx", libucx.__version__, libucx.__file__); print("nanobind", nanobind.__version__, nanobind.__file__)' \
    || die "the carried wheels do not import"

  step "native module: cmake -> $BUILD"
  rm -rf "$BUILD" "$INC"
  mkdir -p "$INC/uring" "$INC/ssl"
  local R=$DEPS/root/usr LIBD=$DEPS/root/usr/lib/x86_64-linux-gnu
  local args=(-DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PYBIN" -DMCR_UCX=wheel)
  command -v ninja >/dev/null && args+=(-G Ninja)
  local carried=${MCR_GPU_CARRIED:-0}
  # liburing: the system's if its header compiles, else Debian's (liburing.a, static)
  if [[ $carried != 1 ]] && echo '#include <liburing.h>' | c++ -x c++ -fsyntax-only - 2>/dev/null; then
    echo "liburing: the system's"
  else
    cp -r "$R/include/liburing.h" "$R/include/liburing" "$INC/uring/"
    args+=(-DURING_INCLUDE="$INC/uring" -DURING_LIB="$LIBD/liburing.a")
    echo "liburing: carried (Debian liburing-dev, static)"
  fi
  # OpenSSL (libcrypto): the system's if its header compiles; else Debian's headers with the
  # machine's own libcrypto.so.3 (OpenSSL 3 keeps its ABI), else Debian's libcrypto.a.
  if [[ $carried != 1 ]] && echo '#include <openssl/hmac.h>' | c++ -x c++ -fsyntax-only - 2>/dev/null; then
    echo "openssl: the system's"
  else
    cp -r "$R/include/openssl" "$INC/ssl/"
    cp -r "$R/include/x86_64-linux-gnu/openssl/." "$INC/ssl/openssl/"
    local crypto
    crypto=$( (ldconfig -p 2>/dev/null | awk '/libcrypto\.so\.3 .*x86-64/ {print $NF; exit}'); true)
    if [[ -z $crypto ]]; then
      for d in /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu /usr/lib64 /lib64 /usr/lib; do
        [[ -e $d/libcrypto.so.3 ]] && { crypto=$d/libcrypto.so.3; break; }
      done
    fi
    if [[ $carried == 1 && ${MCR_GPU_STATIC_CRYPTO:-0} == 1 ]]; then crypto=""; fi
    if [[ -n $crypto ]]; then
      args+=(-DOPENSSL_INCLUDE_DIR="$INC/ssl" -DOPENSSL_CRYPTO_LIBRARY="$crypto")
      echo "openssl: carried headers (Debian libssl-dev) + the machine's $crypto"
    else
      "$PYBIN" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$LIBD/libcrypto.a.xz" "$INC/libcrypto.a" || die "cannot unpack libcrypto.a.xz"
      args+=(-DOPENSSL_INCLUDE_DIR="$INC/ssl" -DOPENSSL_CRYPTO_LIBRARY="$INC/libcrypto.a" -DOPENSSL_USE_STATIC_LIBS=TRUE)
      echo "openssl: carried (Debian libssl-dev headers, static libcrypto.a)"
    fi
  fi
  cmake -S "$ROOT" -B "$BUILD" "${args[@]}" || die "cmake configure failed"
  cmake --build "$BUILD" -j 16 --target _native || die "build failed"
  local so
  so=$(ls "$BUILD"/_native*.so 2>/dev/null | head -1)
  [[ -n $so ]] || die "no _native*.so in $BUILD"
  echo "built $so"

  step "Ray-free package -> $PKG"
  rm -rf "$PKG"
  mkdir -p "$PKG"
  cp -r "$ROOT/mooncake_ray" "$PKG/"
  find "$PKG" -name __pycache__ -prune -exec rm -rf {} +
  rm -f "$PKG"/mooncake_ray/_native*.so
  cat > "$PKG/mooncake_ray/__init__.py" <<'PYEOF'
"""mooncake_ray without Ray, for the GPU checks (tests/gpu/run.sh)."""
from mooncake_ray.errors import *  # noqa: F401,F403
PYEOF
  cp "$so" "$PKG/mooncake_ray/"
  ln -s "$SITE/libucx" "$PKG/libucx"  # the module's RPATH: $ORIGIN/../libucx/lib
  (ldd "$PKG"/mooncake_ray/_native*.so | grep -E 'crypto|uring|ucp|not found') || true
  export PYTHONPATH=$PKG:$SITE
  export MCR_GPU_PKG=$PKG

  step "environment as the checks see it"
  if [[ -x $SITE/libucx/bin/ucx_info ]]; then  # UCX's own view: which transports loaded (cuda_copy, cuda_ipc, gdr_copy?)
    LD_LIBRARY_PATH=$SITE/libucx/lib "$SITE"/libucx/bin/ucx_info -v 2>&1 | head -1
    echo "UCX transports: $(LD_LIBRARY_PATH=$SITE/libucx/lib "$SITE"/libucx/bin/ucx_info -d 2>/dev/null \
      | awk '/^# +Transport:/ {print $3}' | sort -u | tr '\n' ' ')"
  fi
  "$PYBIN" tests/gpu/gpu_env.py || die "the stub package does not import"

  # One pytest a file, correctness first: a crash in native code (a signal) ends only its
  # own file's run, and the bandwidth figures come last.
  local rc=0 f
  rm -f /tmp/gpu-junit-*.xml "$BENCH"
  for f in test_staging_layouts:90 test_copy_kernel:90 test_transport_gpu:240 test_bandwidth:240; do  # file:seconds
    local limit=${f#*:}
    f=${f%:*}
    step "pytest tests/gpu/$f.py"
    PYTHONUNBUFFERED=1 timeout "$limit" "$PYBIN" -m pytest -q -s -rA -p no:cacheprovider \
      -o 'filterwarnings=ignore::DeprecationWarning' --junitxml="/tmp/gpu-junit-$f.xml" \
      "tests/gpu/$f.py" ${PYTEST_ARGS:-}
    local r=$?
    # 5: nothing collected (a -k that leaves none of this file's tests)
    if (( r != 0 && r != 5 )); then rc=$r; echo "pytest tests/gpu/$f.py: exit $r$( ((r == 124)) && echo " (timed out after ${limit}s)")"; fi
  done

  step "summary (pytest exit $rc)"
  "$PYBIN" - "$BENCH" /tmp/gpu-junit-{test_staging_layouts,test_copy_kernel,test_transport_gpu,test_bandwidth}.xml <<'PYEOF'
import json, os, sys, xml.etree.ElementTree as ET
bench, junits = sys.argv[1], [j for j in sys.argv[2:] if os.path.exists(j)]
if junits:
    rows = []
    for tc in (t for j in junits for t in ET.parse(j).getroot().iter("testcase")):
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                why = (el.get("message") or "").splitlines()[0][:110] if el.get("message") else ""
                break
        rows.append((tc.get("classname", "").split(".")[-1] + "::" + tc.get("name", ""), outcome,
                     float(tc.get("time", 0)), why))
    w = max([len(r[0]) for r in rows] + [10])
    print(f"{'test':<{w}}  {'outcome':<8} {'s':>6}  note")
    for name, outcome, t, why in rows:
        print(f"{name:<{w}}  {outcome:<8} {t:6.1f}  {why}")
else:
    print("no junit report (pytest did not run)")
if os.path.exists(bench):
    b = json.load(open(bench))
    print(f"\nbandwidth on {b.get('card')} ({b['bytes'] >> 20} MiB, {b['ranges']} ranges, median of {b['repeats']}); "
          f"UCX {b.get('env', {}).get('ucx_version')}, memory_types {b.get('memory_types')}, "
          f"cpu {' '.join(b.get('env', {}).get('cpu', {}).get('flags', []))}")
    for k, v in b["gbps"].items():
        print(f"  {k:<20} {v:8.1f} GB/s")
    for k, v in b.get("ratios", {}).items():
        t = b["targets"][k]
        print(f"  {k:<22} {v:6.2f}  target >= {t}: {'met' if v >= t else 'MISSED'}")
    if "submit_overhead_ms" in b:
        print(f"  transfer call of {b['ranges']} ops before anything moves: {b['submit_overhead_ms']:.2f} ms as a list, "
              f"{b.get('submit_overhead_arrays_ms', float('nan')):.2f} ms as arrays")
    print(f"  paths: {b.get('paths')}")
    print(f"  verified: {b.get('verified')}")
    for n in b.get("notes", []):
        print(f"  note: {n}")
    print(f"  ({bench})")
PYEOF
  echo "total ${SECONDS}s; log $LOG"
  return $rc
}

[[ -n $OUTDIR ]] && mkdir -p "$OUTDIR"
main "$@" 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
