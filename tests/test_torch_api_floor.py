"""The package calls only torch.distributed functions that the oldest torch it runs on has.

The GPU machine runs torch 2.11; requirements.txt pins 2.13 for CPU work. A name that only
the newer torch has passes every test here and fails every job there:
`dist.all_gather_single` (torch 2.13's) did exactly that. This scans slimgc_mx/**/*.py
(source text, no torch needed) for `dist.NAME` and `torch.distributed.NAME`, calls and
attributes alike, and checks each NAME against an explicit list.
"""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "slimgc_mx"

# torch.distributed names that exist in torch 2.11, the GPU machine's torch (the floor):
# all_gather_single is torch 2.13's and broke every SlimGC job there. Add a name only
# after checking that torch 2.11 has it.
ALLOWED = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "new_group",
    "get_rank", "get_world_size", "get_backend", "is_initialized",
    "init_process_group", "destroy_process_group", "TCPStore", "PrefixStore",
    "ReduceOp", "group",
})

# Known to be newer than the floor: never used, whatever the list above says.
NEWER_THAN_FLOOR = frozenset({"all_gather_single"})

_TEXT = re.compile(r"(?<![.\w])(?:dist|torch\.distributed)\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)")


def _aliases(tree):
    """Names bound to torch.distributed in a module (`import torch.distributed as dist`,
    `from torch import distributed as dist`); `dist` always counts."""
    names = {"dist"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    names.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name == "distributed":
                    names.add(a.asname or a.name)
    return names


def _is_torch_distributed(node, aliases):
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (isinstance(node, ast.Attribute) and node.attr == "distributed"
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def distributed_names(root):
    """{NAME: ["path:line", ...]} for every `dist.NAME` / `torch.distributed.NAME` under root,
    from the syntax tree, and from the text too (a line the parser never sees, such as one in
    a string passed to exec, still counts)."""
    found = {}
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        rel = path.relative_to(root)
        tree = ast.parse(source, filename=str(path))
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_torch_distributed(node.value, aliases):
                found.setdefault(node.attr, []).append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                for a in node.names:
                    found.setdefault(a.name, []).append(f"{rel}:{node.lineno}")
        for lineno, line in enumerate(source.splitlines(), 1):
            for m in _TEXT.finditer(line):
                where = f"{rel}:{lineno}"
                if where not in found.get(m.group(1), []):
                    found.setdefault(m.group(1), []).append(where)
    # torch.distributed.algorithms... is a submodule import path, not a function.
    found.pop("algorithms", None)
    return found


def test_the_package_uses_only_torch_distributed_names_of_the_floor():
    found = distributed_names(PACKAGE)
    assert found, "the scan found no torch.distributed use at all: is it still scanning?"
    unknown = {name: where for name, where in found.items() if name not in ALLOWED}
    assert not unknown, (
        "torch.distributed names (paths under slimgc_mx/) not on the torch 2.11 list "
        "(the GPU machine's torch): "
        f"{unknown}; check that torch 2.11 has them, then add them to ALLOWED")


def test_no_name_newer_than_the_floor_is_used():
    found = distributed_names(PACKAGE)
    newer = {name: found[name] for name in NEWER_THAN_FLOOR if name in found}
    assert not newer, ("torch 2.13's names (paths under slimgc_mx/), missing on the GPU machine's "
                       f"torch 2.11: {newer}")
    assert not NEWER_THAN_FLOOR & ALLOWED


def test_the_scan_sees_a_newer_name_however_it_is_written(tmp_path):
    (tmp_path / "a.py").write_text("import torch.distributed as dist\n"
                                   "def f(out, t):\n"
                                   "    dist.all_gather_single(out, t)\n")
    (tmp_path / "b.py").write_text("import torch\n"
                                   "def f(out, t):\n"
                                   "    torch.distributed.all_gather_single(\n"
                                   "        out, t)\n")
    (tmp_path / "c.py").write_text("from torch import distributed as tdist\n"
                                   "def f(out, t):\n"
                                   "    return tdist.all_gather_single(out, t)\n")
    (tmp_path / "d.py").write_text("from torch.distributed import all_gather_single\n")
    found = distributed_names(tmp_path)
    assert sorted(found["all_gather_single"]) == ["a.py:3", "b.py:3", "c.py:3", "d.py:1"]


def test_every_allowed_name_exists_in_the_installed_torch():
    # Catches a misspelt entry; that torch 2.11 has each one is the list's claim.
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("this torch is built without torch.distributed")
    assert [name for name in sorted(ALLOWED) if not hasattr(dist, name)] == []
