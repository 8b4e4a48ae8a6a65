"""docs/extending.md builds and runs: its code blocks form a codec, compiled into a copy of
the kernels and held to the codec contract; every module path, class and function that
architecture.md, backend.md, pytorch.md and extending.md cite exists; README's loc_buf
formula is the local update's; docs/results.md stays short and keeps what other pages cite.
"""
import builtins
import glob
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import codec_contract as contract
import slimgc_mx
from slimgc_mx import codecs
from slimgc_mx.codecs import base, registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
#: A fenced block whose first line is a comment naming the file it forms.
FILE_BLOCK = re.compile(r"```(?:python|cython)\n# ([\w./]+)\n(.*?)```", re.S)
CODEC_MODULE = "slimgc_mx.codecs.nearest3"

BUILD = textwrap.dedent("""\
    import numpy
    from Cython.Build import cythonize
    from setuptools import Extension, setup
    ext = Extension("recipe_kernels", ["kernels.pyx"], include_dirs=[numpy.get_include(), "."],
                    extra_compile_args=["-O0", "-fopenmp"], extra_link_args=["-fopenmp"],
                    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])
    setup(name="recipe", script_args=["build_ext", "--inplace", "-q"],
          ext_modules=cythonize([ext], language_level=3, quiet=True, compiler_directives={
              "boundscheck": False, "wraparound": False, "cdivision": True}))
    """)


def recipe_files(text=None):
    """{path: text} of the code blocks of docs/extending.md that name their file."""
    if text is None:
        with open(os.path.join(DOCS, "extending.md"), encoding="utf-8") as f:
            text = f.read()
    return {path: body for path, body in FILE_BLOCK.findall(text)}


def kernels_with_recipe(kernels_pyx, include_block):
    """kernels.pyx with the recipe's include line after the last codec include, the other
    codecs' includes dropped (the driver, decoder and SGD kernel stay)."""
    codec_include = re.compile(r'^include "codec_\w+\.pxi"\n', re.M)
    last = list(codec_include.finditer(kernels_pyx))[-1]
    text = kernels_pyx[:last.end()] + include_block + kernels_pyx[last.end():]
    lines = [line for line in text.splitlines(True)
             if not codec_include.match(line) or line in include_block]
    return "".join(lines)


def test_the_page_names_every_file_of_the_recipe():
    files = recipe_files()
    assert set(files) == {"slimgc_mx/codecs/nearest3.py", "cython_ext/codec_nearest3.pxi",
                          "cython_ext/kernels.pyx"}
    assert files["cython_ext/kernels.pyx"].strip() == 'include "codec_nearest3.pxi"'
    with open(os.path.join(ROOT, "slimgc_mx", "codecs", "__init__.py")) as f:
        assert re.search(r"^from \. import \(", f.read(), re.M), \
            "extending.md tells to add the module to codecs/__init__.py's `from . import (...)`"


def test_the_extraction_reads_marked_blocks_only():
    page = ("```python\n# a/b.py\nx = 1\n```\n```python\nnot marked\n```\n"
            "```cython\n# c.pxi\ncdef int y\n```\n")
    assert recipe_files(page) == {"a/b.py": "x = 1\n", "c.pxi": "cdef int y\n"}
    pyx = 'a\ninclude "codec_none.pxi"\ninclude "codec_2bit.pxi"\ninclude "lanes32.pxi"\n'
    assert kernels_with_recipe(pyx, 'include "codec_x.pxi"\n') == (
        'a\ninclude "codec_x.pxi"\ninclude "lanes32.pxi"\n')


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The recipe's codec, registered, its kernel compiled into a copy of the kernels that
    codecs' kernels() returns; all undone afterwards."""
    pytest.importorskip("Cython")
    files = recipe_files()
    tmp = tmp_path_factory.mktemp("recipe")
    src = os.path.join(ROOT, "cython_ext")
    for name in os.listdir(src):
        if name.endswith((".pxi", ".pxd")):
            with open(os.path.join(src, name)) as f, open(tmp / name, "w") as g:
                g.write(f.read())
    (tmp / "codec_nearest3.pxi").write_text(files["cython_ext/codec_nearest3.pxi"])
    with open(os.path.join(src, "kernels.pyx")) as f:
        (tmp / "kernels.pyx").write_text(
            kernels_with_recipe(f.read(), files["cython_ext/kernels.pyx"]))
    (tmp / "build.py").write_text(BUILD)
    done = subprocess.run([sys.executable, "build.py"], cwd=tmp, capture_output=True,
                          text=True)
    assert done.returncode == 0, "the recipe's kernel does not build:\n" + done.stderr[-4000:]
    so = next(p for p in os.listdir(tmp) if p.startswith("recipe_kernels") and
              p.endswith(".so"))
    spec = importlib.util.spec_from_file_location("recipe_kernels", str(tmp / so))
    built = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built)

    py = tmp / "nearest3.py"
    py.write_text(files["slimgc_mx/codecs/nearest3.py"])
    mp = pytest.MonkeyPatch()
    mp.setattr(base, "_kernels", built)
    try:
        spec = importlib.util.spec_from_file_location(CODEC_MODULE, str(py))
        module = importlib.util.module_from_spec(spec)
        sys.modules[CODEC_MODULE] = module
        spec.loader.exec_module(module)
        yield module, built
    finally:
        mp.undo()
        sys.modules.pop(CODEC_MODULE, None)
        registry._CODECS.pop("nearest3", None)
        registry._REFERENCES.pop("nearest3", None)


@pytest.mark.slow
def test_the_recipe_registers(recipe):
    module, built = recipe
    assert "nearest3" in codecs.available()
    c = codecs.create("nearest3")
    assert isinstance(c, module.Nearest3) and c.threshold == 0.5
    assert isinstance(codecs.create("nearest3", reference=True), module.Nearest3Reference)
    assert hasattr(built, "encode_nearest3")


@pytest.mark.slow
def test_levels_are_the_nearest_of_three(recipe):
    c = codecs.create("nearest3", threshold=1.0, num_threads=1)
    g = np.array([0.2, 0.5, -0.5, 0.7, -2.0, -0.49], np.float32)
    r = np.zeros_like(g)
    lanes = c.encode(g, r, 2)
    two = codecs.create("nearest3", threshold=1.0).decode(lanes * 2, g.size, 2)
    np.testing.assert_array_equal(two, 2 * np.array([0, 1, -1, 1, -1, 0], np.float32))
    np.testing.assert_array_equal(r, g - np.array([0, 1, -1, 1, -1, 0], np.float32))


@pytest.mark.parametrize("n_workers", [1, 2, 3, 16])
@pytest.mark.parametrize("size", [1, 7, 4097, 70001])
@pytest.mark.slow
def test_kernel_equals_reference(recipe, n_workers, size):
    contract.check_kernel_equals_reference("nearest3", n_workers, size)


@pytest.mark.slow
def test_the_codec_contract(recipe):
    contract.check_threads_bitwise_equal("nearest3")
    contract.check_sums_in_any_order_decode_alike("nearest3")
    contract.check_error_feedback_identity("nearest3")
    contract.check_workers_agree_in_any_order("nearest3")
    contract.check_state_round_trip("nearest3", {})


@pytest.mark.slow
def test_a_nonfinite_gradient_is_refused_before_anything_is_written(recipe):
    c = codecs.create("nearest3")
    g = np.ones(100, np.float32)
    g[37] = np.nan
    r = np.full(100, 0.25, np.float32)
    with pytest.raises(codecs.NonFiniteGradientError):
        c.encode(g, r, 2)
    assert (r == 0.25).all()


@pytest.mark.slow
def test_the_fused_local_update_is_the_two_passes(recipe):
    _, built = recipe
    n, workers = 150001, 3
    rng = np.random.RandomState(5)
    g, w, m = (rng.randn(n).astype(np.float32) for _ in range(3))
    residual = (0.1 * rng.randn(n)).astype(np.float32)
    lr, wd, rescale, momentum = 0.05, 1e-3, 1.0 / 48, 0.9
    expected = np.empty(n, np.float32)
    built.sgd_step(w, g, m, None, expected, lr, wd, rescale, momentum, -1.0, 1)
    r1, r2 = residual.copy(), residual.copy()
    lanes1 = codecs.create("nearest3", num_threads=1).encode(g, r1, workers)
    out = np.full(n, np.nan, np.float32)
    local = built.LocalSGD(w, m, out, lr, wd, rescale, momentum, -1.0)
    lanes2 = codecs.create("nearest3", num_threads=2).encode(g, r2, workers, local=local)
    np.testing.assert_array_equal(lanes2, lanes1)
    np.testing.assert_array_equal(r2, r1)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.slow
def test_the_ndarray_levels_equal_the_kernel(recipe):
    pytest.importorskip("mxnet")
    import test_device
    rng = np.random.default_rng(2)
    for size in (1, 7, 4097):
        test_device.run_workers("nearest3", size, 2, 3, rng)


# ---------------------------------------------------------------- cited names

#: The pages whose every cited module path, class and function must exist, and the
#: frameworks that must import for their adapters' names to resolve.
PAGES = {"architecture.md": ("mxnet", "torch"), "backend.md": ("mxnet", "torch"),
         "pytorch.md": ("torch",), "extending.md": ("mxnet",)}
#: `a.b`, `a.b.c` or `dir/module.b`, maybe called (`a.b(x, y)`), in backticks: a module's
#: or a class's member.
CITED = re.compile(r"`([A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`")
#: A class alone in backticks, maybe called: `Aggregator`, `SlimGC(...)`.
CITED_CLASS = re.compile(r"`([A-Z]\w*[a-z]\w*)(?:\([^`]*\))?`")
#: A dotted name of the package anywhere: slimgc_mx.engine.config.SlimGCConfig.
PACKAGE_NAME = re.compile(r"\bslimgc_mx(?:\.[A-Za-z_]\w*)+")
#: A dotted name in a plain fenced block (the module tree, the data path).
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
#: A file of the repository anywhere on the page: slimgc_mx/engine/planner.py,
#: mxnet/kvstore.py (from slimgc_mx/), tests/..., scripts/..., cttab.py, codec_<name>.pxi.
FILE_EXT = ("py", "pyx", "pxi", "pxd", "sh", "md")
PATH = re.compile(r"(?<![\w./-])((?:[\w<][\w*<>-]*/)*[\w<][\w*<>-]*\.(?:%s))(?![\w/])"
                  % "|".join(FILE_EXT))
#: A folder in backticks: `slimgc_mx/mxnet/`, `scripts/`.
FOLDER = re.compile(r"`((?:[\w.-]+/)+)`")
#: Where a path the pages give is relative to: the repository, the package, docs/ and
#: cython_ext/; a bare file name may also be in scripts/, tests/ or a package folder.
BASES = ("", "slimgc_mx", "docs", "cython_ext")
BARE_BASES = ("scripts", "tests")
#: Files a build writes (setup.py: the chunk layout), absent from a fresh checkout.
GENERATED = {"cython_ext/layout.pxd"}
#: Names that are not the package's: the frameworks' own API and the instances the pages
#: call (`optimizer.step()`, `scaler.step(...)`), as importable dotted names; `self.` is a
#: codec's own option. Each resolves only where its framework imports.
ALIASES = {"mx": "mxnet", "nd": "mxnet.ndarray", "gluon": "mxnet.gluon",
           "trainer": "mxnet.gluon.Trainer", "Module": "mxnet.module.Module",
           "dist": "torch.distributed",
           "Tensor": "torch.Tensor", "tensor": "torch.Tensor", "model": "torch.nn.Module",
           "scaler": "torch.amp.GradScaler",
           "DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
           "GradScaler": "torch.amp.GradScaler", "Protocol": "typing.Protocol",
           "slimgc": "slimgc_mx.torch",  # pytorch.md: import slimgc_mx.torch as slimgc
           "optimizer": "slimgc_mx.torch.DistributedOptimizer",
           "codec": "slimgc_mx.codecs.base.Codec"}
#: Packages whose dotted names are imported to be checked.
IMPORTABLE = ("slimgc_mx", "torch", "mxnet", "typing")
NOT_CODE = ("self.",)


def _modules():
    """{short name: [dotted modules]} of the package (a module, or a package's last part),
    the shallowest first: `framework.TorchUpdate` may be torch/framework.py's while
    `framework.MXNetFramework` is mxnet/framework.py's."""
    out = {"kernels": ["slimgc_mx._kernels"]}
    pkg = os.path.dirname(slimgc_mx.__file__)
    found = []
    for root, _, files in os.walk(pkg):
        for name in files:
            if not name.endswith(".py") or name == "__main__.py":
                continue
            rel = os.path.relpath(os.path.join(root, name), os.path.dirname(pkg))[:-3]
            found.append(rel.replace(os.sep, ".").replace(".__init__", ""))
    for dotted in sorted(found, key=lambda d: (d.count("."), d)):
        out.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    return out


def _import(dotted):
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return None


def _classes():
    """{class name: [classes]} of every module of the package that imports here."""
    out = {}
    for dotted in sorted({d for ds in _modules().values() for d in ds}):
        module = _import(dotted)
        for name, obj in vars(module or {}).items():
            if inspect.isclass(obj) and obj.__module__.startswith("slimgc_mx") and \
                    obj not in out.get(name, []):
                out.setdefault(name, []).append(obj)
    return out


def _has(obj, attr):
    """getattr, or an attribute its class declares (a field, a Protocol's annotation) or
    sets on instances (self.attr = ...)."""
    if hasattr(obj, attr):
        return True
    if inspect.isclass(obj):
        for cls in obj.__mro__:
            if attr in getattr(cls, "__dataclass_fields__", {}) or \
                    attr in vars(cls).get("__annotations__", {}):
                return True
            try:
                src = inspect.getsource(cls)
            except (OSError, TypeError):
                continue
            if re.search(r"self\.%s\s*[:=]" % attr, src):
                return True
    return False


def _cython_member(head, attr):
    """True when kernels.pyx or a codec's .pxi defines `cdef struct head` or `cdef class
    head` with a member `attr`."""
    src = os.path.join(ROOT, "cython_ext")
    for name in sorted(os.listdir(src)):
        if not name.endswith((".pyx", ".pxi")):
            continue
        with open(os.path.join(src, name)) as f:
            text = f.read()
        found = re.search(r"^cdef (?:struct|class) %s\b.*?\n((?:[ \t]+.*\n|\n)+)" % head,
                          text, re.M)
        if found and re.search(r"\b%s\b" % attr, found.group(1)):
            return True
    return False


def _walk(obj, parts):
    for part in parts:
        if not _has(obj, part):
            return None
        obj = getattr(obj, part, obj)
    return obj


def _dotted(reference):
    """The object an importable dotted name (slimgc_mx..., torch..., mxnet...) names, or
    None: its longest importable prefix, then attributes."""
    parts = reference.split(".")
    for cut in range(len(parts), 0, -1):
        module = _import(".".join(parts[:cut]))
        if module is not None:
            return _walk(module, parts[cut:])
    return None


def resolve(reference, modules, classes):
    """The object `reference` names, or None: "module.name", "Class.attr",
    "module.Class.attr" with a short module name of the package (any module of that name),
    "dir/module.name" (a file of the package), an importable dotted name, a name of
    ALIASES, a builtin; a member of a Cython struct or cdef class resolves to True."""
    head, *rest = reference.split(".")
    if len(rest) == 1 and _cython_member(head, rest[0]):
        return True
    if head in ALIASES:
        return _dotted(".".join([ALIASES[head]] + rest))
    if head in IMPORTABLE:
        return _dotted(reference)
    if "/" in head:
        path = os.path.join(ROOT, "slimgc_mx", head + ".py")
        if not os.path.exists(path):
            return None
        return _dotted(".".join(["slimgc_mx"] + head.split("/") + rest))
    candidates = list(classes.get(head, []))
    candidates += [m for m in map(_import, modules.get(head, [])) if m is not None]
    if not rest and hasattr(builtins, head):
        return True  # TypeError, None
    for obj in candidates:
        found = _walk(obj, rest)
        if found is not None:
            return found
    return None


def _package_folders():
    pkg = os.path.join(ROOT, "slimgc_mx")
    return [os.path.relpath(root, ROOT) for root, dirs, _ in os.walk(pkg)
            if "__pycache__" not in root]


def path_exists(path):
    """True when the file or folder `path` is the repository's: relative to one of BASES, a
    bare file name anywhere in BARE_BASES or the package; `<name>` and `*` match any."""
    pattern = re.sub(r"<\w+>", "*", path)
    bases = list(BASES)
    if "/" not in path.rstrip("/"):
        bases += list(BARE_BASES) + _package_folders()
    for base in bases:
        full = os.path.normpath(os.path.join(ROOT, base, pattern))
        if glob.glob(full) or os.path.relpath(full, ROOT) in GENERATED:
            return True
    return False


def fenced_blocks(text):
    """[(language, body)] of the page's fenced code blocks."""
    blocks, lang, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _tree_paths(block):
    """The files of a module tree: a folder at the left margin (`slimgc_mx/engine/  ...`),
    then its files indented by two (`  planner.py   ...`)."""
    paths, folder = [], None
    for line in block.splitlines():
        top = re.match(r"((?:[\w.-]+/)+)(?:\s|$)", line)
        if top:
            folder = top.group(1)
            paths.append(folder)
            continue
        if line[:1].strip():
            folder = None
        member = re.match(r"  ([\w.-]+\.(?:%s))\s" % "|".join(FILE_EXT), line)
        if member and folder:
            paths.append(folder + member.group(1))
    return paths


def cited(text):
    """{(kind, name)} of what a page cites: ("path", a file or folder), ("name", a dotted
    name or a class) — backticked names, the package's dotted names anywhere, files anywhere,
    and the dotted names and files of its plain fenced blocks (module tree, data path)."""
    text = FILE_BLOCK.sub("", text)  # extending.md's recipe: its own code, built above
    out = {("path", p) for p in PATH.findall(text) + FOLDER.findall(text)}
    names = CITED.findall(text) + CITED_CLASS.findall(text) + PACKAGE_NAME.findall(text)
    for lang, block in fenced_blocks(text):
        if lang == "":
            out.update(("path", p) for p in _tree_paths(block))
            names += DOTTED.findall(block)
    out.update(("name", n) for n in names
               if not n.startswith(NOT_CODE) and n.rsplit(".", 1)[-1] not in FILE_EXT)
    return out


def missing(text):
    """What a page cites that does not exist, sorted."""
    modules, classes = _modules(), _classes()
    found = cited(text)
    return sorted(n for kind, n in found
                  if not (path_exists(n) if kind == "path" else
                          resolve(n, modules, classes) is not None))


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_cited_name_exists(page):
    for framework in PAGES[page]:
        pytest.importorskip(framework)
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        text = f.read()
    found = cited(text)
    assert {kind for kind, _ in found} == {"path", "name"}, \
        "no names found: the patterns no longer match the page"
    assert missing(text) == [], "%s cites names that do not exist" % page


def test_the_name_check_finds_a_missing_name():
    pytest.importorskip("mxnet")
    pytest.importorskip("torch")
    modules, classes = _modules(), _classes()
    assert resolve("Aggregator.push", modules, classes) is not None
    assert resolve("Aggregator.allreduce", modules, classes) is None
    assert resolve("push_plan.Plan.encode", modules, classes) is not None
    assert resolve("nowhere.thing", modules, classes) is None
    assert resolve("EncodeJob.stat_width", modules, classes) is not None
    assert resolve("EncodeJob.no_such_field", modules, classes) is None
    # a short module name is any module of that name: torch/framework.py here
    assert resolve("framework.TorchUpdate", modules, classes) is not None
    assert resolve("framework.MXNetFramework", modules, classes) is not None
    assert resolve("framework.NoSuchUpdate", modules, classes) is None
    assert resolve("Arrays.can_hold", modules, classes) is not None  # a Protocol's member
    assert resolve("torch.optim.SGD", modules, classes) is not None
    assert resolve("torch.optim.NoSuchSGD", modules, classes) is None
    good = ("The engine (`slimgc_mx.engine.config.SlimGCConfig`, slimgc_mx/engine/planner.py,"
            " **mxnet/kvstore.py**, `torch/copies.py`, tests/test_layering.py,"
            " scripts/per_key_cost.py, `cttab.py`, `copies.EventReadiness`, `Planner.plan`,"
            " `Aggregator.push(key, grads, outs)`, `torch/framework.TorchUpdate`,"
            " `mx.kv.create`, `torch.optim.SGD`, `slimgc_mx/mxnet/`, `SlimGC(...)`,"
            " cython_ext/codec_<name>.pxi).\n"
            "```\nslimgc_mx/engine/   the engine\n  planner.py      Planner.plan\n```\n")
    assert missing(good) == []
    bad = ("Gone: slimgc_mx/planner.py, `slimgc_mx.config.SlimGCConfig`, `pipeline.py`,"
           " **mxnet/pipeline.py**, tests/test_nothing.py, `copies.NoSuchReadiness`,"
           " `Planner.replan`, `torch/framework.NoSuchUpdate`, `torch.optim.NoSuchSGD`,"
           " `slimgc_mx/nowhere/`, `NoSuchAggregator`.\n"
           "```\nslimgc_mx/engine/   the engine\n  pipeline.py     pipeline.submit\n"
           "slimgc_mx/        the package\n```\n")
    assert missing(bad) == sorted([
        "slimgc_mx/planner.py", "slimgc_mx.config.SlimGCConfig",
        "pipeline.py", "mxnet/pipeline.py", "tests/test_nothing.py", "copies.NoSuchReadiness",
        "Planner.replan", "torch/framework.NoSuchUpdate", "torch.optim.NoSuchSGD",
        "slimgc_mx/nowhere/", "NoSuchAggregator", "slimgc_mx/engine/pipeline.py",
        "pipeline.submit"])


# ---------------------------------------------------------------- README's local update

def test_readme_loc_buf_formula_is_the_local_sgd_step():
    """README's loc_buf formula, evaluated, equals the local update's SGD kernel: the global
    rule from glo_buf with the momentum read and rescale_grad times N (LocalUpdater)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    formula = re.search(r"loc_buf = ([^,]+),", text).group(1)
    rng = np.random.RandomState(1)
    n, workers = 1000, 4
    glo, g, mom = (rng.randn(n).astype(np.float32) for _ in range(3))
    lr, wd, rescale, mu = 0.1, 1e-2, 1.0 / 32, 0.9
    out = np.empty(n, np.float32)
    base.kernels().sgd_step(glo, g, mom, None, out, lr, wd, rescale * workers, mu, -1.0, 1)
    names = {"glo_buf": glo.astype(np.float64), "g_loc": g.astype(np.float64),
             "mom": mom.astype(np.float64), "mu": mu, "lr": lr, "wd": wd,
             "rescale_grad": rescale, "N": workers}
    readme = eval(formula, {"__builtins__": {}}, names)
    np.testing.assert_allclose(readme, out, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- docs/results.md

def _slug(heading):
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_results_md_is_short_and_keeps_what_others_cite():
    with open(os.path.join(DOCS, "results.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) <= 600, "results.md holds current tables only (history: git)"
    headings = [h.strip() for h in re.findall(r"^#+ (.*)$", text, re.M)]
    cited = []
    for page in [os.path.join(ROOT, "README.md")] + [
            os.path.join(DOCS, n) for n in sorted(os.listdir(DOCS)) if n.endswith(".md")]:
        with open(page, encoding="utf-8") as f:
            other = " ".join(f.read().split())
        cited += [(page, "#", a) for a in re.findall(r"results\.md#([\w-]+)", other)]
        cited += [(page, "", s) for s in re.findall(r'results\.md[,;:]? \(?"([^"]+)"', other)]
        cited += [(page, "", s) for s in re.findall(r"results\.md, (Table \d+)", other)]
    assert any(s == "Not measured" for _, _, s in cited), "the citation pattern finds nothing"
    missing = [(os.path.basename(p), s) for p, kind, s in cited
               if not (any(_slug(h) == s for h in headings) if kind
                       else any(h.startswith(s) for h in headings))]
    assert missing == [], "results.md lost sections other pages cite: %s" % missing
    for image in re.findall(r"\]\((figures/[^)]+)\)", text):
        assert os.path.exists(os.path.join(DOCS, image)), image
