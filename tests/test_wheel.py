"""The wheel command (scripts/build_wheel.sh) on a CPU-only torch: a pure Python wheel, named
for the package version, that installs without build tools and runs the reference path; and the
local version label that a wheel carrying the CUDA extension gets (setup.py dist_version)."""

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import flash_attn

ROOT = Path(__file__).resolve().parent.parent


def _setup_module():
    spec = importlib.util.spec_from_file_location("flash_attn_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: setup() runs under __main__
    return module


def test_local_version_label_only_with_the_extension(monkeypatch):
    setup = _setup_module()
    monkeypatch.setenv("FLASH_ATTN_LOCAL_VERSION", "cu130torch2.11")
    assert setup.dist_version(True) == flash_attn.__version__ + "+cu130torch2.11"
    assert setup.dist_version(False) == flash_attn.__version__
    monkeypatch.setenv("FLASH_ATTN_LOCAL_VERSION", "not a label")
    with pytest.raises(setup.BuildConfigError, match="FLASH_ATTN_LOCAL_VERSION"):
        setup.dist_version(True)
    monkeypatch.delenv("FLASH_ATTN_LOCAL_VERSION")
    assert setup.dist_version(True) == flash_attn.__version__


@pytest.mark.skipif(torch.version.cuda is not None,
                    reason="a CUDA torch builds the extension into the wheel (minutes)")
def test_pure_wheel_builds_installs_and_runs(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheel.sh"), str(tmp_path / "dist")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    wheels = list((tmp_path / "dist").glob("*.whl"))
    assert [w.name for w in wheels] == [f"flash_attn-{flash_attn.__version__}-py3-none-any.whl"]
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "flash_attn/__init__.py" in names and "flash_attn/ops/__init__.py" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert "pure Python" in proc.stdout

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheels[0])], check=True, timeout=120)
    check = (
        "import importlib.metadata as m, torch, flash_attn\n"
        f"assert flash_attn.__file__.startswith({str(site)!r}), flash_attn.__file__\n"
        "assert m.version('flash-attn') == flash_attn.__version__\n"
        "q = torch.randn(1, 8, 2, 16)\n"
        "print(flash_attn.flash_attn_func(q, q, q, causal=True).shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", check], env=dict(os.environ, PYTHONPATH=str(site)),
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch.Size([1, 8, 2, 16])" in out.stdout
