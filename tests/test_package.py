"""Packaging smoke tests: the CUDA sources are found and shipped, the commands start and, without a GPU,
say so plainly (exit 0 for the main job)."""
from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cuflash
from cuflash import _compile

ROOT = Path(__file__).resolve().parents[1]


def run(args, cwd=ROOT, hide_gpu=True, timeout=120):
    """`python args...` in a subprocess; hide_gpu makes CuPy see no device, as on CI."""
    env = dict(os.environ)
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cuda_sources_are_found_with_every_include():
    d = _compile.cuda_dir()
    assert (d / "kernels.cu").is_file()
    names = {p.name for p in d.iterdir()}
    for f in d.iterdir():
        if f.suffix in (".cu", ".cuh"):
            for inc in re.findall(r'#include\s+"([^"]+)"', f.read_text()):
                assert inc in names, f"{f.name} includes {inc}, which is not in {d}"
    assert len(_compile.source_hash()) == 64


def test_pyproject_ships_cuda_sources_and_the_analyzer():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = meta["tool"]["setuptools"]
    assert {"cuflash", "cuflash.cuda", "cuflash.simulator"} <= set(tool["packages"])
    assert tool["package-dir"]["cuflash.cuda"] == "cuda" and tool["package-dir"]["cuflash.simulator"] == "simulator"
    patterns = tool["package-data"]["cuflash.cuda"]
    for f in (ROOT / "cuda").iterdir():
        if f.suffix in (".cu", ".cuh"):
            assert any(fnmatch.fnmatch(f.name, p) for p in patterns), f"cuda/{f.name} would not be in the wheel"
    scripts = meta["project"]["scripts"]
    assert scripts["cuflash"] == "cuflash.__main__:main"
    assert scripts["cuflash-sim"] == "cuflash.simulator.cli:main"
    extras = meta["project"]["optional-dependencies"]
    assert any(r.startswith("cupy-cuda13x") for r in extras["cuda13"])
    assert any(r.startswith("pytest") for r in extras["test"])


def test_console_script_entry_points_import():
    from cuflash.__main__ import main as cuflash_main
    from cuflash.simulator.cli import main as sim_main

    assert callable(cuflash_main) and callable(sim_main)


def test_main_job_without_a_gpu_exits_0_and_points_at_the_analyzer():
    r = run(["-m", "cuflash"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no CUDA GPU" in r.stdout and "cuflash-sim" in r.stdout, r.stdout


def test_the_analyzer_example_printed_without_a_gpu_runs():
    from cuflash.__main__ import SIM_EXAMPLE

    assert SIM_EXAMPLE in run(["-m", "cuflash"]).stdout
    r = run(["-m", "cuflash.simulator", *SIM_EXAMPLE.split()[1:]])
    assert r.returncode == 0 and "fa2" in r.stdout, r.stdout + r.stderr


def test_demo_subcommand_without_a_gpu_exits_0():
    r = run(["-m", "cuflash", "demo", "--seqlen", "1024"])
    assert r.returncode == 0 and "cuflash-sim" in r.stdout, r.stdout + r.stderr


def test_help_lists_the_subcommands():
    r = run(["-m", "cuflash", "--help"])
    assert r.returncode == 0 and "compile" in r.stdout and "demo" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("args,message", [
    (["compile", "--arch", "sm_70"], "invalid choice: 'sm_70'"),
    (["compile", "--jobs", "0"], "0 must be >= 1"),
    (["--batch", "x"], "'x' is not an integer"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_command_lines_are_rejected_clearly(args, message):
    r = run(["-m", "cuflash", *args])
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_benchmark_without_a_gpu_says_so():
    r = run(["-m", "cuflash.bench"])
    assert r.returncode == 1 and "no CUDA GPU" in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("args,message", [
    (["--seqlen", "0"], "seqlen 0"),
    (["--head-dim", "12"], "head dim 12"),
    (["--causal", "maybe"], "invalid choice: 'maybe'"),
])
def test_benchmark_rejects_bad_arguments(args, message):
    r = run(["-m", "cuflash.bench", *args])
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_installed_package_works_outside_the_source_tree(tmp_path):
    """When cuflash is installed (CI installs the wheel into a venv), it finds its CUDA sources and the
    analyzer from any directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import cuflash, cuflash._compile as c, cuflash.simulator; "
            "print(cuflash.__file__); print(c.cuda_dir()); print(len(c.source_hash()))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "No module named 'cuflash'" in r.stderr:
        pytest.skip("cuflash is not installed in this environment (running from the source tree)")
    assert r.returncode == 0, r.stderr
    module_file, cuda, digest = r.stdout.split()
    assert (Path(cuda) / "kernels.cu").is_file() and digest == "64"
    if not Path(module_file).resolve().is_relative_to(ROOT):  # a real (non-editable) install: sources copied
        assert Path(cuda).resolve() == Path(module_file).resolve().parent / "cuda"


def test_version_is_exposed():
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", cuflash.__version__)
