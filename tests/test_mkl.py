"""mtrain.cpu.mkl: which hosts get the stub, that it is built once and atomically, that libtorch
binds MKL's vendor check to it when it is loaded before torch, and that matmuls stay exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mtrain.cpu import mkl


@pytest.mark.parametrize("setting", ["0", "off", "False", " no ", "2"])
def test_only_asking_for_it_turns_it_on(setting):
    assert mkl.reason_to_skip("AuthenticAMD", setting, "x86_64", "Linux").startswith("off: MTRAIN_MKL")
    assert mkl.reason_to_skip("AuthenticAMD", None, "x86_64", "Linux").startswith("off: not asked for")
    assert mkl.reason_to_skip("AuthenticAMD", "", "x86_64", "Linux").startswith("off: not asked for")


@pytest.mark.parametrize("setting", ["1", "on", "True", " yes "])
def test_only_amd_cpus_on_linux_x86_64_want_it(setting):
    want = mkl.reason_to_skip
    assert want("AuthenticAMD", setting, "x86_64", "Linux") is None
    assert want("HygonGenuine", setting, "x86_64", "Linux") is None
    assert "GenuineIntel CPU" in want("GenuineIntel", setting, "x86_64", "Linux")
    assert "unknown CPU" in want(None, setting, "x86_64", "Linux")
    assert "Darwin" in want("AuthenticAMD", setting, "x86_64", "Darwin")
    assert "aarch64" in want("AuthenticAMD", setting, "aarch64", "Linux")


def test_the_vendor_is_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert mkl.cpu_vendor(cpuinfo) == "AuthenticAMD"
    cpuinfo.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")
    assert mkl.cpu_vendor(cpuinfo) is None
    assert mkl.cpu_vendor(tmp_path / "missing") is None


def test_too_late_once_torch_is_imported(monkeypatch):
    import torch  # noqa: F401  (this process has it already; the point is that enable() sees it)

    monkeypatch.setattr(mkl, "status", mkl.status)  # put back afterwards
    monkeypatch.setattr(mkl, "_amd", mkl._amd)
    monkeypatch.setattr(mkl, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(mkl, "platform", _Linux())
    monkeypatch.setenv(mkl.ENV, "1")
    assert mkl.enable() == "off: torch was imported before the stub could be loaded"
    assert mkl.note() == "mkl: off: torch was imported before the stub could be loaded"
    monkeypatch.setattr(mkl, "cpu_vendor", lambda: "GenuineIntel")
    mkl.enable()
    assert mkl.note() is None  # nothing to say on a CPU the stub is not for


class _Linux:
    @staticmethod
    def system() -> str:
        return "Linux"

    @staticmethod
    def machine() -> str:
        return "x86_64"


# Runs in a fresh interpreter, where torch is not imported yet, as a CLI command would: enable() on
# a host taken for an AMD one, then torch. Prints what the test checks.
CHILD = textwrap.dedent("""
    import ctypes, json, sys
    from mtrain.cpu import mkl
    mkl.cpu_vendor = lambda: "AuthenticAMD"
    status = mkl.enable()
    out = {"status": status}
    if status.startswith("on:"):
        import torch
        out["global_symbol"] = ctypes.CDLL(None).mkl_serv_intel_cpu_true()  # the first one in the global scope
        torch.manual_seed(0)
        errors = []
        for m, k, n in [(513, 256, 1024), (64, 1024, 256), (300, 256, 8000)]:
            a, b = torch.randn(m, k), torch.randn(k, n)
            exact = a.double() @ b.double()
            errors.append(float(((a @ b).double() - exact).abs().max() / exact.abs().max()))
        out["max_relative_error"] = max(errors)
        out["again"] = mkl.enable()  # torch is imported now: the stub stays loaded, and says so
    print(json.dumps(out))
""")


def _child(tmp_path: Path, **env: str) -> tuple[dict, str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("CC", mkl.ENV)}
    environment["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    environment[mkl.ENV] = "1"  # opt-in
    environment.update(env)
    done = subprocess.run([sys.executable, "-c", CHILD], env=environment, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.skipif(sys.platform != "linux" or mkl.compiler() is None,
                    reason="needs Linux and a C compiler")
def test_the_stub_is_built_once_loaded_first_and_matmuls_stay_exact(tmp_path):
    out, _ = _child(tmp_path)
    stub = mkl.stub_path(tmp_path / "cache" / "mtrain", mkl.compiler())
    assert out["status"].startswith("on:") and str(stub) in out["status"]
    assert out["global_symbol"] == 1
    assert out["again"] == out["status"]
    assert out["max_relative_error"] < 1e-5  # float32 rounding over sums of up to 1024 products
    assert sorted(p.name for p in stub.parent.iterdir()) == sorted([stub.name, stub.with_suffix(".lock").name])
    built = stub.stat().st_mtime_ns
    _child(tmp_path)
    assert stub.stat().st_mtime_ns == built  # the second run loads it as it is


@pytest.mark.skipif(sys.platform != "linux" or mkl.compiler() is None,
                    reason="needs Linux and a C compiler")
def test_libtorch_binds_mkl_vendor_check_to_the_stub(tmp_path):
    import torch

    libtorch = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not libtorch.exists() or b"mkl_serv_intel_cpu_true" not in _dynamic_symbols(libtorch):
        pytest.skip("this torch build has no MKL vendor check to bind")
    _, log = _child(tmp_path, LD_DEBUG="bindings")
    bound = [line.split(" to ", 1)[1] for line in log.splitlines()
             if "`mkl_serv_intel_cpu_true'" in line and "libtorch_cpu.so [0] to " in line]
    assert bound and all("/cache/mtrain/mkl-intel-path-" in target for target in bound)


def _dynamic_symbols(library: Path) -> bytes:
    try:
        return subprocess.run(["nm", "-D", str(library)], capture_output=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("nm is not available")


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux")
def test_a_compiler_that_fails_leaves_mkl_as_it_was(tmp_path):
    out, _ = _child(tmp_path, CC="false")
    assert out["status"] == "off: false could not build it (CalledProcessError)"
    folder = tmp_path / "cache" / "mtrain"
    assert not list(folder.glob("*.so")) and not list(folder.glob("tmp*"))  # nothing half-built left behind
    (note,) = folder.glob("*.failed")
    again, _ = _child(tmp_path, CC="false")  # the failure is remembered, not compiled again
    assert again["status"] == f"off: false could not build it (CalledProcessError) (an earlier build; delete {note} to try again)"


@pytest.mark.skipif(sys.platform != "linux" or mkl.compiler() is None,
                    reason="needs Linux and a C compiler")
def test_a_cache_folder_that_cannot_be_made_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out, _ = _child(tmp_path, XDG_CACHE_HOME=str(blocker))
    assert out["status"].startswith(f"off: cannot write {blocker / 'mtrain'} (")


def test_without_asking_nothing_is_built_or_loaded(tmp_path):
    out, _ = _child(tmp_path, **{mkl.ENV: ""})
    assert out["status"] == f"off: not asked for ({mkl.ENV}=1 turns it on)"
    assert not (tmp_path / "cache").exists()


def test_a_torch_without_mkl_never_reads_on(monkeypatch):
    import torch

    monkeypatch.setattr(mkl, "status", "on: MKL's AVX2/AVX-512 kernels (a test)")
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert not mkl.loaded()
    assert mkl.current().startswith("off: this torch build has no MKL")
