#!/usr/bin/env bash
# Downloads into wheels/ (git-ignored; it travels with the working tree) the wheels tools/gpu_check.sh installs on a
# GPU machine that has no network: CPython 3.12, manylinux x86_64. That machine has Python 3.12 with a CUDA PyTorch,
# numpy, h5py, fsspec and a C compiler; these are what the project's tests and benchmark need beyond them (the
# versions the project is tested with, and their dependencies), plus pip itself for a Python that lacks it.
#
#     tools/gpu_wheels.sh            # (re)creates wheels/, at most 64 MiB
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=wheels
LIMIT_MIB=64

# top-level packages first, then their dependencies not on that machine (torch, numpy, h5py and fsspec are, with
# theirs: typing_extensions, setuptools, filelock, ...; typing_extensions and setuptools are here all the same, for a
# machine whose ones are older than these need)
PACKAGES=(
  zarr==3.1.6 numcodecs==0.16.6 gymnasium==1.4.0 stable-baselines3==2.9.2 pytest==9.0.3 rich==15.0.0
  hypothesis==6.155.2 setuptools==84.2.1 pip==25.3
  cloudpickle==3.1.3 donfig==0.8.1.post1 Farama-Notifications==0.0.6 google-crc32c==1.9.0 iniconfig==2.3.1
  markdown-it-py==4.3.0 mdurl==0.1.2 packaging==26.4 pluggy==1.7.0 Pygments==2.21.0 PyYAML==6.0.4
  sortedcontainers==2.4.0 typing_extensions==4.16.0
)

rm -rf "$DEST"
python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$DEST" "${PACKAGES[@]}"

size_kib=$(du -sk "$DEST" | cut -f1)
echo "$DEST: $(ls "$DEST" | wc -l) wheels, $((size_kib / 1024)) MiB"
if (( size_kib > LIMIT_MIB * 1024 )); then
  echo "$DEST is over ${LIMIT_MIB} MiB: it cannot travel with the working tree" >&2
  exit 1
fi
