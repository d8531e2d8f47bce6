# The lean install for the GPU check (python -m pagedserve.loadtest.gpu_check), three ways.
# Run from the repository root (the root is the `pagedserve` package).
#
#   bash loadtest/gpu_check_setup.sh prepare [--tp]
#       HERE, on a machine with pip that reaches PyPI: download into .whl/ the wheels the GPU
#       image lacks (Python 3.12, manylinux x86_64, --no-deps), and check that they and the
#       working tree fit the 64 MiB a device call carries. The list is CARRY below.
#   . loadtest/gpu_check_setup.sh offline
#       On this workplace's GPU machine (no network at all): install the carried wheels into
#       /tmp/pagedserve-site, link the checkout as `pagedserve` under /tmp/pagedserve-path,
#       export PYTHONPATH to both, and check the imports. Sourced, so PYTHONPATH stays set.
#   . loadtest/gpu_check_setup.sh pypi [--tp]
#       On a GPU machine that reaches PyPI only: torch's CUDA wheel pinned and the engine's
#       runtime dependencies (not the test extras, not Ray Serve), then the same link.
#
# What the single-GPU check needs. `from pagedserve import LLM` at tensor_parallel_size 1
# runs the engine in-process (UniProcExecutor): torch, triton, transformers, tokenizers,
# safetensors, numpy, tqdm, and, for loadtest/'s own imports, httpx and prometheus-client.
# The image has all of them (loadtest/gpu_image_packages.txt). The packages the image lacks
# are each needed by one feature only, and imported
# where that feature starts: ray and pyzmq by tensor_parallel_size > 1 (cluster/executors/
# ray_executor.py, zmq_dispatch.py), xgrammar by structured outputs (cluster/engine/
# structured_output.py, worker/sampler.py), gguf by .gguf checkpoints (worker/loading/gguf_loader.py),
# pydantic, fastapi and uvicorn by the HTTP server (cluster/front/), msgspec by nothing.
# `gpu_check --cpu-smoke --image-packages-only` (tests/test_script_smokes.py) runs the whole
# check with every package outside the image unimportable, so a new top-level import of one
# fails in CI, not on the GPU.
#
# TP=2 (--tp) needs ray, pyzmq and ray's dependencies the image lacks (jsonschema and its
# own). ray's cp312 manylinux wheel alone is over 64 MiB, so it cannot be carried: on this
# workplace's machines (one GPU each) the check's TP row says so and is skipped. `pypi --tp`
# installs them on a multi-GPU machine that reaches PyPI.

# Wheels to carry (NAME==VERSION, Python 3.12 manylinux x86_64), beyond the image: gguf, for the
# check's gguf section (pure Python, small; its numpy, pyyaml, requests and tqdm are in the
# image). loadtest/gpu/image.py reads this line: a name here is importable under --image-packages-only.
CARRY="gguf==0.19.0"
TP_CARRY="ray==2.60.0 pyzmq==27.3.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1"
# What `pypi` installs: the image's versions, the combination the GPU rows were measured on.
# PyPI's Linux x86_64 torch wheel is the CUDA build (it pulls the nvidia-* runtime wheels and
# the matching triton).
PYPI_PINS="torch==2.11.0 transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0 huggingface-hub numpy tqdm httpx prometheus-client"
TP_PINS="ray==2.60.0 pyzmq==27.3.0"
CARRY_LIMIT=$((64 * 1024 * 1024))

_ps_link() {
    # `pagedserve` importable without building anything: a directory whose `pagedserve`
    # is this checkout goes first on PYTHONPATH.
    mkdir -p /tmp/pagedserve-path || return 1
    ln -sfn "$PWD" /tmp/pagedserve-path/pagedserve || return 1
    case ":${PYTHONPATH:-}:" in
        *:/tmp/pagedserve-path:*) ;;
        *) export PYTHONPATH="/tmp/pagedserve-path${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
}

_ps_check() {
    # The imports the check makes, and that the single-GPU engine pulls in no ray.
    (cd /tmp && python3 - <<'PY'
import sys
import torch, triton, transformers
from pagedserve import LLM  # noqa: F401  (the engine class: imports the offline path)
import pagedserve.cluster.executors.uniproc  # noqa: F401
import pagedserve.worker.worker  # noqa: F401
assert "ray" not in sys.modules, "the single-GPU engine path imported ray"
cuda = torch.cuda.is_available()
print(f"gpu_check_setup: python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"transformers {transformers.__version__}, CUDA {'yes: ' + torch.cuda.get_device_name() if cuda else 'no'}; "
      f"{torch.cuda.device_count() if cuda else 0} GPU(s)")
PY
    )
}

_ps_main() {
    local mode="${1:-}" tp=""
    [ "${2:-}" = "--tp" ] && tp=1
    if [ ! -f loadtest/gpu_check.py ] || [ ! -f __init__.py ]; then
        echo "gpu_check_setup: run it from the repository root" >&2
        return 2
    fi
    case "$mode" in
    prepare)
        local want="$CARRY${tp:+ $TP_CARRY}" py="${PYTHON:-python3}"
        mkdir -p .whl || return 1
        git check-ignore -q .whl/x.whl || { echo "gpu_check_setup: .whl/ is not git-ignored (.gitignore: /.whl/)" >&2; return 1; }
        # Only what the list names: a stale wheel would travel and install too.
        find .whl -mindepth 1 -maxdepth 1 -type f -name '*.whl' -delete
        if [ -n "${want// /}" ]; then
            # shellcheck disable=SC2086
            "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
                --platform any -d .whl $want || return 1
        fi
        local wheels tree
        wheels=$(find .whl -mindepth 1 -maxdepth 1 -type f -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
        tree=$(git ls-files -co --exclude-standard -z | du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
        ls -l .whl/*.whl 2>/dev/null
        echo "gpu_check_setup: wheels ${wheels} B + working tree ${tree} B of the ${CARRY_LIMIT} B a call carries"
        if [ $((wheels + tree)) -gt "$CARRY_LIMIT" ]; then
            echo "gpu_check_setup: over the carry limit (ray's wheel alone is): removed them; drop a wheel" >&2
            find .whl -mindepth 1 -maxdepth 1 -type f -name '*.whl' -delete
            return 1
        fi
        [ "$wheels" -gt 0 ] && echo "gpu_check_setup: name .whl in the run's carry" || echo "gpu_check_setup: nothing to carry"
        ;;
    offline)
        if ls .whl/*.whl >/dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/pagedserve-site .whl/*.whl || return 1
            export PYTHONPATH="/tmp/pagedserve-site${PYTHONPATH:+:$PYTHONPATH}"
        fi
        _ps_link && _ps_check
        ;;
    pypi)
        # shellcheck disable=SC2086
        python3 -m pip install -q $PYPI_PINS ${tp:+$TP_PINS} || return 1
        _ps_link && _ps_check
        ;;
    *)
        echo "usage: bash loadtest/gpu_check_setup.sh prepare [--tp] | . loadtest/gpu_check_setup.sh offline | . loadtest/gpu_check_setup.sh pypi [--tp]" >&2
        return 2
        ;;
    esac
}

_ps_main "$@"
