"""Build for slimgc_mx: the Cython kernels in cython_ext/, with OpenMP when the compiler has it."""
import os
import runpy
import sys
import tempfile

# setuptools before distutils: Python 3.12 has no distutils of its own, setuptools provides it.
from setuptools import Extension, find_packages, setup
from distutils.ccompiler import new_compiler
from distutils.errors import CompileError, LinkError

import numpy
from Cython.Build import cythonize


def openmp_flags():
    """Return (compile, link) flags for OpenMP, or empty lists when the compiler lacks it."""
    if os.environ.get("SLIMGC_NO_OPENMP"):
        return [], []
    cc = new_compiler()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() < 1;}\n")
        try:
            objs = cc.compile([src], output_dir=tmp, extra_postargs=["-fopenmp"])
            cc.link_executable(objs, os.path.join(tmp, "omp"), extra_postargs=["-fopenmp"])
        except (CompileError, LinkError):
            print("slimgc_mx: OpenMP not found, kernels build single-threaded", file=sys.stderr)
            return [], []
    return ["-fopenmp"], ["-fopenmp"]


def write_layout():
    """cython_ext/layout.pxd from slimgc_mx/codecs/layout.py (rewritten only when it changes)."""
    here = os.path.dirname(os.path.abspath(__file__))
    text = runpy.run_path(os.path.join(here, "slimgc_mx", "codecs", "layout.py"))["pxd_text"]()
    path = os.path.join(here, "cython_ext", "layout.pxd")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


write_layout()
omp_compile, omp_link = openmp_flags()
extensions = [
    Extension(
        "slimgc_mx._kernels",
        ["cython_ext/kernels.pyx"],
        include_dirs=[numpy.get_include(), "cython_ext"],
        extra_compile_args=["-O3"] + omp_compile,
        extra_link_args=omp_link,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(
    name="slimgc_mx",
    version="0.1.0",
    description="SlimGC gradient-compression KVStore for Apache MXNet 1.9.1",
    license="Apache-2.0",
    python_requires=">=3.8",
    packages=find_packages(include=["slimgc_mx", "slimgc_mx.*"]),
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
    install_requires=["mxnet==1.9.1", "numpy<1.24"],
    entry_points={"console_scripts": ["slimgc-launch=slimgc_mx.launch:main"]},
)
