"""Builds and runs the C++ core tests (csrc/tests/test_core.cc) with CMake: the kernels, pack
ranges, planner and reductions checked without Python in between."""

import os
import shutil
import subprocess

import pytest

from _launch import ROOT as REPO
cmake = shutil.which("cmake")


@pytest.mark.skipif(cmake is None or not os.path.exists(os.path.join(REPO, "CMakeLists.txt")),
                    reason="needs cmake and the source checkout")
def test_cpp_core(tmp_path):
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run([cmake, "-S", REPO, "-B", str(tmp_path), *gen, "-DCMAKE_BUILD_TYPE=Release",
                          "-DFASTXFER_BUILD_PYTHON=OFF", "-DFASTXFER_BUILD_CPP_TESTS=ON"],
                         capture_output=True, text=True, timeout=600)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    build = subprocess.run([cmake, "--build", str(tmp_path), "--target", "test_core", "-j", "2"],
                           capture_output=True, text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    run = subprocess.run([os.path.join(str(tmp_path), "test_core")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all C++ core tests passed" in run.stdout


@pytest.mark.skipif(cmake is None or not os.path.exists(os.path.join(REPO, "CMakeLists.txt")),
                    reason="needs cmake and the source checkout")
def test_core_builds_without_jpeglib_when_asked(tmp_path):
    """With FASTXFER_JPEGLIB=OFF the core builds without the decoder (the loader then falls back to
    simplejpeg + Numba): compile the decoder's file the way such a build does."""
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run([cmake, "-S", REPO, "-B", str(tmp_path), *gen, "-DCMAKE_BUILD_TYPE=Release",
                          "-DFASTXFER_BUILD_PYTHON=OFF", "-DFASTXFER_JPEGLIB=OFF"],
                         capture_output=True, text=True, timeout=600)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    assert "ROI JPEG decoder off (FASTXFER_JPEGLIB=OFF)" in " ".join((cfg.stdout + cfg.stderr).split())
    target = "CMakeFiles/fastxfer_core.dir/csrc/data/jpeg.cc.o" if gen else "fastxfer_core"
    build = subprocess.run([cmake, "--build", str(tmp_path), "--target", target], capture_output=True, text=True,
                           timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]


@pytest.mark.skipif(cmake is None or not os.path.exists(os.path.join(REPO, "CMakeLists.txt")),
                    reason="needs cmake and the source checkout")
def test_a_build_without_jpeglib_h_fails_and_names_the_package(tmp_path):
    """No silent fallback: where jpeglib.h cannot be found (here: the folders that hold it hidden from
    CMake's searches), configuring fails with the packages to install and the switch that opts out."""
    hidden = sorted({os.path.dirname(p) for p in ("/usr/include/jpeglib.h", "/usr/local/include/jpeglib.h",
                                                  "/usr/include/x86_64-linux-gnu/jpeglib.h") if os.path.exists(p)})
    cfg = subprocess.run([cmake, "-S", REPO, "-B", str(tmp_path), "-DFASTXFER_BUILD_PYTHON=OFF",
                          f"-DCMAKE_IGNORE_PATH={';'.join(hidden)}"], capture_output=True, text=True, timeout=600)
    out = " ".join((cfg.stdout + cfg.stderr).split())
    assert cfg.returncode != 0, out[-2000:]
    assert "jpeglib.h not found" in out and "libjpeg62-turbo-dev (Debian)" in out, out[-2000:]
    assert "libjpeg-turbo-devel (RHEL, Rocky, Fedora, manylinux)" in out
    assert "-C cmake.define.FASTXFER_JPEGLIB=OFF" in out
