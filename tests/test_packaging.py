"""A non-editable install must carry the CUDA sources: build the wheel straight from the checkout
(as `pip install .` does) and through the sdist (as a release does), and look inside them."""

import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted(
    p.relative_to(REPO / "cuda_src").as_posix()
    for p in (REPO / "cuda_src").rglob("*")
    if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".inc")
)
PYTHON_MODULES = sorted(p.relative_to(REPO / "cuflash2").as_posix()
                        for p in (REPO / "cuflash2").rglob("*.py") if "__pycache__" not in p.parts)
# Nothing that a build, a test run or a kernel compile leaves behind may ship.
UNWANTED_DIRS = ("__pycache__", ".pytest_cache", ".benchmarks", "build", "dist")
UNWANTED_SUFFIXES = (".pyc", ".cubin", ".ptx", ".fatbin", ".o", ".so", ".egg-info")


def _is_unwanted(name):
    parts = name.split("/")
    return (any(part in UNWANTED_DIRS or part.endswith(".egg-info") for part in parts)
            or name.endswith(UNWANTED_SUFFIXES))


def _build(outdir, *flags):
    # --no-isolation uses the hatchling of this environment (the test extra): no network needed.
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", *flags, "--outdir",
                             str(outdir), str(REPO)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"build failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """{"direct": wheel built from the checkout (what `pip install .` does),
    "from_sdist": wheel built from the sdist (what PyPI users get), "sdist": the sdist}."""
    pytest.importorskip("build")
    pytest.importorskip("hatchling")
    direct, via_sdist = tmp_path_factory.mktemp("direct"), tmp_path_factory.mktemp("via_sdist")
    _build(direct, "--wheel")
    _build(via_sdist)  # no flag: the sdist, then the wheel from the unpacked sdist
    (sdist,) = via_sdist.glob("cuflash2-*.tar.gz")
    return {"direct": next(direct.glob("cuflash2-*.whl")),
            "from_sdist": next(via_sdist.glob("cuflash2-*.whl")), "sdist": sdist}


@pytest.fixture(scope="module", params=["direct", "from_sdist"])
def wheel_path(request, dists):
    return dists[request.param]


@pytest.fixture(scope="module")
def wheel_names(wheel_path):
    with zipfile.ZipFile(wheel_path) as wheel:
        return wheel.namelist()


def test_repository_has_cuda_sources():
    assert CUDA_SOURCES, "cuda_src/ holds no .cu/.cuh files"


def test_wheel_ships_every_cuda_source_inside_the_package(wheel_names):
    shipped = {name[len("cuflash2/cuda_src/"):] for name in wheel_names
               if name.startswith("cuflash2/cuda_src/")}
    assert set(CUDA_SOURCES) <= shipped
    assert not [name for name in wheel_names if name.startswith("cuda_src/")]


def test_wheel_ships_the_python_modules(wheel_names):
    for module in PYTHON_MODULES + ["__init__.py", "__main__.py", "cli.py", "bench/__init__.py",
                                    "bench/paper_grid.py", "bench/report.py"]:
        assert f"cuflash2/{module}" in wheel_names


def test_wheel_has_no_caches_or_build_outputs(wheel_names):
    unwanted = [name for name in wheel_names if _is_unwanted(name)]
    assert not unwanted
    assert not [n for n in wheel_names if n.startswith("tests/")]


def test_wheel_metadata_lists_the_extras(wheel_path, wheel_names):
    (metadata_name,) = [n for n in wheel_names if n.endswith(".dist-info/METADATA")]
    with zipfile.ZipFile(wheel_path) as wheel:
        metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    assert metadata["Name"] == "cuflash2"
    assert metadata["Requires-Python"] == ">=3.10"
    assert set(metadata.get_all("Provides-Extra")) >= {"cuda12", "cuda13", "test"}
    requires = [Requirement(text) for text in metadata.get_all("Requires-Dist")]

    def needed(name, extra=None):
        environment = {"extra": extra or ""}
        return [str(r) for r in requires
                if r.name == name and (r.marker is None or r.marker.evaluate(environment))
                and (extra is None) == (r.marker is None)]

    assert needed("numpy") and needed("ml-dtypes")
    for extra, cupy, major in (("cuda12", "cupy-cuda12x", "12"), ("cuda13", "cupy-cuda13x", "13")):
        assert needed(cupy, extra)
        (toolkit,) = needed("cuda-toolkit", extra)
        assert {"nvrtc", "cudart"} <= Requirement(toolkit).extras
        assert str(Requirement(toolkit).specifier) == f"=={major}.*"
        (bindings,) = needed("cuda-bindings", extra)
        assert str(Requirement(bindings).specifier) == f"=={major}.*"
    for name in ("pytest", "pytest-benchmark", "cuda-bindings", "cuda-toolkit", "build",
                 "hatchling"):
        assert needed(name, "test"), name
    # Unpinned, so that `.[cuda12,test]` resolves to CUDA 12 and `.[test]` to the newest.
    for name in ("cuda-bindings", "cuda-toolkit"):
        (requirement,) = needed(name, "test")
        assert not Requirement(requirement).specifier, requirement
    # The same extras as cuda12's and cuda13's toolkit: pip resolves `cuda-toolkit[a,b]` as one
    # name per set of extras, and a different set was first resolved to the newest CUDA alone,
    # then backtracked through every CUDA 13 release to meet cuda12's `==12.*`.
    (test_toolkit,) = needed("cuda-toolkit", "test")
    for extra in ("cuda12", "cuda13"):
        (toolkit,) = needed("cuda-toolkit", extra)
        assert Requirement(test_toolkit).extras == Requirement(toolkit).extras


def test_wheel_metadata_license_and_urls(wheel_path, wheel_names):
    (metadata_name,) = [n for n in wheel_names if n.endswith(".dist-info/METADATA")]
    with zipfile.ZipFile(wheel_path) as wheel:
        metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    assert metadata["License-Expression"] == "BSD-3-Clause"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel_names)
    # PEP 639: with a license expression, no License :: classifier.
    classifiers = metadata.get_all("Classifier")
    assert not [c for c in classifiers if c.startswith("License ::")]
    assert "Development Status :: 4 - Beta" in classifiers
    for version in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL"))
    assert {"Homepage", "Source", "Issues", "Documentation"} <= set(urls)


def test_sdist_carries_cuda_sources_and_tests(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {f"cuda_src/{source}" for source in CUDA_SOURCES} <= names
    assert "pyproject.toml" in names and "README.md" in names and "LICENSE" in names
    assert any(name.startswith("tests/") for name in names)
