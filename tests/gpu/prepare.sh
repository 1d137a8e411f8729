#!/usr/bin/env bash
# Fills .gpu-deps/ (ignored by git, carried to the GPU machine) with what tests/gpu/run.sh
# needs there and that machine cannot fetch (it has no network):
#   wheels/  libucx-cu13 (UCX with CUDA transports, CUDA 13) and nanobind (the version
#            this checkout builds with), both for CPython 3.12 on manylinux x86-64;
#   root/    Debian's liburing-dev and libssl-dev unpacked (dpkg -x): their headers,
#            liburing.a, and libcrypto.a compressed (libcrypto.a.xz: run.sh links it only
#            where the machine has no libcrypto.so.3 of its own).
# Run here, from anywhere: bash tests/gpu/prepare.sh   (downloads ~46 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
DEPS=.gpu-deps
NANOBIND_VERSION=${NANOBIND_VERSION:-$(.venv/bin/python -c 'import nanobind; print(nanobind.__version__)' 2>/dev/null || echo 3.1.0)}

rm -rf "$DEPS"
mkdir -p "$DEPS/wheels" "$DEPS/debs" "$DEPS/root"

echo "== wheels (CPython 3.12, manylinux x86_64)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEPS/wheels" libucx-cu13 "nanobind==$NANOBIND_VERSION"
# The UCX wheel carries static libraries, perftest and demo programs the build and the checks
# never use (about two thirds of it): repack it without them, RECORD rewritten to match.
"$PY" - "$DEPS"/wheels/libucx_cu13-*.whl <<'PYEOF'
import base64, hashlib, re, sys, zipfile
path = sys.argv[1]
drop = re.compile(r"(\.a$|perftest|/bin/)")
with zipfile.ZipFile(path) as z:
    items = [(i, z.read(i)) for i in z.infolist() if not drop.search(i.filename)]
record = next(i.filename for i, _ in items if i.filename.endswith(".dist-info/RECORD"))
lines = []
for i, data in items:
    if i.filename == record:
        continue
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    lines.append(f"{i.filename},sha256={digest},{len(data)}")
lines.append(f"{record},,")
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for i, data in items:
        z.writestr(i, "\n".join(lines) + "\n" if i.filename == record else data)
print(f"{path}: kept {len(items)} files")
PYEOF
ls -l "$DEPS/wheels"

echo "== Debian packages (headers and static libraries)"
(cd "$DEPS/debs" && apt-get download liburing-dev liburing2 libssl-dev 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
ls -l "$DEPS/debs"
for d in "$DEPS"/debs/*.deb; do dpkg -x "$d" "$DEPS/root"; done
# Only what the build may use travels: headers, liburing.a, libcrypto.a (compressed).
LIB="$DEPS/root/usr/lib/x86_64-linux-gnu"
rm -rf "$DEPS/root/usr/share" "$LIB/pkgconfig" "$DEPS/debs"
rm -f "$LIB"/libssl.* "$LIB"/libcrypto.so "$LIB"/liburing.so*
xz -9 -T0 "$LIB/libcrypto.a"
test -f "$DEPS/root/usr/include/liburing.h" && test -f "$DEPS/root/usr/include/openssl/hmac.h" \
  && test -f "$LIB/liburing.a" && test -f "$LIB/libcrypto.a.xz"

echo "== sizes"
du -sh "$DEPS"/* "$DEPS"
repo=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
extra=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
deps=$(du -sb "$DEPS" | cut -f1)
total=$(( repo + ${extra:-0} + deps ))
echo "repo (tracked) $repo B, untracked $extra B, .gpu-deps $deps B: carried $total B of 67108864 (64 MiB)"
if (( total > 64 * 1024 * 1024 )); then echo "too large to carry" >&2; exit 1; fi
