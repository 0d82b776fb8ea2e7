#!/usr/bin/env bash
# On the CPU machine: fetch what the GPU image lacks to run the Ray Serve app there (no internet
# on the GPU machine), into .devcarry/ray (git-ignored; ~45 MB, under the 64 MiB a device call carries).
#   bash scripts/device_ray_wheels.sh            then name .devcarry in the device call's carry
# Facts behind the list: ../shared/notes/ray-on-the-device.md (the GPU image has torch, cupy, numpy,
# requests, pyyaml, ... but no ray and none of Ray Serve's web stack).
#   ray.tar.xz   the ray 2.60.0 cp312 wheel unpacked without ray/jars, ray/rllib, the dashboard's web UI and
#                the test folders (Serve needs none; the tree plus this carry must stay under 64 MiB)
#   wheels/      the cp312 manylinux wheels of the packages the image lacks, at the versions that
#                `pip install 'ray[serve]==2.60.0'` resolves (grpcio >= 1.85.1 for grpcio_reflection)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.devcarry/ray
DL=.devcarry/dl
mkdir -p "$DL" "$DEST/wheels"
plat=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    plat+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$DL" 'ray[serve]==2.60.0' 2> >(grep -v "is ignored" >&2)
# What the GPU image lacks (names as wheel files spell them).
NEED="aiohappyeyeballs aiohttp aiohttp_cors aiosignal annotated_doc annotated_types attrs cffi colorful
cryptography fastapi frozenlist google_api_core google_auth googleapis_common_protos grpcio grpcio_reflection
httptools jsonschema jsonschema_specifications mmh3 multidict opencensus opencensus_context opentelemetry_api
opentelemetry_sdk opentelemetry_proto opentelemetry_semantic_conventions opentelemetry_exporter_prometheus
packaging prometheus_client propcache proto_plus protobuf pyasn1 pyasn1_modules pycparser pydantic pydantic_core
python_dotenv referencing rpds_py smart_open starlette typing_extensions typing_inspection uvicorn watchfiles
websockets yarl"
rm -f "$DEST"/wheels/*.whl
for n in $NEED; do
    f=$(ls "$DL" | grep -i -E "^${n//_/[-_.]}-[0-9]" | head -n 1 || true)
    [ -n "$f" ] || { echo "missing wheel for $n" >&2; exit 1; }
    cp "$DL/$f" "$DEST/wheels/"
done
if [ ! -f "$DEST/ray.tar.xz" ]; then
    tmp=$(mktemp -d)
    unzip -q "$DL"/ray-2.60.0-*.whl -d "$tmp"  # unzip keeps the executables' mode bits
    rm -rf "$tmp/ray/jars" "$tmp/ray/rllib" "$tmp/ray/dashboard/client/build"
    find "$tmp/ray" -type d -name tests -prune -exec rm -rf {} +
    (cd "$tmp" && XZ_OPT=-9 tar cJf - ray ray-2.60.0.dist-info) > "$DEST/ray.tar.xz"
    rm -rf "$tmp"
fi
du -sh "$DEST"
