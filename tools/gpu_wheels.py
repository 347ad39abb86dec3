"""The wheels an offline GPU machine needs: epd-trio's requirements that its image lacks.

``tools/gpu_wheels.sh`` downloads what this prints (``name==version``, pinned to
the running environment, one per line) for that machine's Python; without it,
``tools/gpu_check.sh`` stops at its first ``import epd_trio``. The list is the
transitive closure of epd-trio's requirements (and the ``test`` extra), with
markers evaluated for the target Python on Linux, less:

- what the image already holds (``IMAGE``, from the GPU image's package list of
  2026-11-17), and what those need, except the few whose version matters to us
  (``CARRY_ANYWAY``);
- ``LAZY``: imported only to decode video and audio, and ``av`` alone is 36 MB.

Run it with the environment that holds epd-trio installed (``.venv``)::

    .venv/bin/python tools/gpu_wheels.py --python-version 3.12
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import sys
from collections.abc import Iterable, Mapping, Sequence

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT_PACKAGE = "epd-trio"
EXTRAS = ("test",)
# The 'cuda' image of the device machines: python3.12 with these packages (names only).
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split())
# In the image, but in versions we cannot see: our generated gRPC code needs grpcio and protobuf
# this new (pyproject's pins), quart needs werkzeug 3 and hypercorn a recent h11.
CARRY_ANYWAY = frozenset({"grpcio", "protobuf", "werkzeug", "h11"})
LAZY = frozenset({"av", "soundfile", "cffi", "pycparser"})


def canonical(name: str) -> str:
    """PEP 503's normalised name: ``Quart_Trio`` and ``quart-trio`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def target_environment(python_version: str) -> dict[str, str]:
    """Marker values for Linux x86-64 CPython ``python_version`` (e.g. ``"3.12"``)."""
    env = default_environment()
    env.update(python_version=python_version, python_full_version=f"{python_version}.0",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
               os_name="posix", implementation_name="cpython",
               platform_python_implementation="CPython")
    return env


def closure(root: str, extras: Sequence[str], requires: Mapping[str, Sequence[str]],
            environment: Mapping[str, str], provided: frozenset[str] = frozenset()) -> set[str]:
    """Every package ``root`` (with ``extras``) needs, transitively, in ``environment``.

    ``requires`` maps a canonical name to its ``Requires-Dist`` strings; a
    requirement of a package it does not know is kept, and not followed; nor is
    one in ``provided`` (the image installed it with what it needs).
    """
    needed: set[str] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [(canonical(root), tuple(extras))]
    while todo:
        name, wanted = todo.pop()
        for spec in requires.get(name, ()):
            req = Requirement(spec)
            if req.marker is not None and not any(
                    req.marker.evaluate({**environment, "extra": extra}) for extra in ("", *wanted)):
                continue
            dep = canonical(req.name)
            if dep not in needed:
                needed.add(dep)
                if dep not in provided:
                    todo.append((dep, tuple(req.extras)))
    return needed


def to_carry(needed: Iterable[str], image: frozenset[str] = IMAGE) -> list[str]:
    """What the image lacks (or holds in a version too old for us), less the lazy media decoders."""
    return sorted(n for n in needed
                  if (n not in image or n in CARRY_ANYWAY) and n not in LAZY and n != ROOT_PACKAGE)


def installed() -> tuple[dict[str, Sequence[str]], dict[str, str]]:
    """This environment's ``Requires-Dist`` and versions, by canonical name."""
    requires: dict[str, Sequence[str]] = {}
    versions: dict[str, str] = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"])
        requires[name] = dist.requires or []
        versions[name] = dist.version
    return requires, versions


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12)")
    args = p.parse_args(argv)
    requires, versions = installed()
    if ROOT_PACKAGE not in requires:
        print(f"gpu_wheels: {ROOT_PACKAGE} is not installed in {sys.executable}'s environment",
              file=sys.stderr)
        return 1
    env = target_environment(args.python_version)
    carry = to_carry(closure(ROOT_PACKAGE, EXTRAS, requires, env, IMAGE - CARRY_ANYWAY))
    missing = [n for n in carry if n not in versions]
    if missing:
        print(f"gpu_wheels: needed on Python {args.python_version} but not installed here (so no "
              f"version to pin): {', '.join(missing)}", file=sys.stderr)
        return 1
    print("\n".join(f"{name}=={versions[name]}" for name in carry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
