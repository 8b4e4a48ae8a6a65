"""env.py is the only reader of the environment: no other module of the package reads a
SLIMGC_* variable, no other module of the library (the package but its experiments,
slimgc_mx/bench/) reads any variable, and the project's own variables are not warned about
as unknown options."""
import ast
import os
import warnings

import numpy as np
import pytest

from slimgc_mx import env
from slimgc_mx.engine import config
from slimgc_mx.bench import datasets

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slimgc_mx")
#: env's names whose value is a SLIMGC_* variable (or the prefix of all of them).
SLIMGC_NAMES = {name for name, value in vars(env).items()
                if isinstance(value, str) and value.startswith(env.OPTION_PREFIX)}


def _headers(stmt):
    """The expressions a statement evaluates itself (not those of the statements it holds)."""
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return [stmt.iter]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return [item.context_expr for item in stmt.items]
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return stmt.decorator_list + stmt.args.defaults + [
            d for d in stmt.args.kw_defaults if d is not None]
    if isinstance(stmt, ast.ClassDef):
        return stmt.decorator_list + stmt.bases
    if isinstance(stmt, (ast.Try, ast.Module)):
        return []
    return [stmt]


def _reads_environ(node):
    """True when `node` reads os.environ or calls os.getenv (a store into it is no read)."""
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                and sub.value.id == "os" and sub.attr in ("environ", "getenv")):
            return True
    return False


def _names_slimgc(node):
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) \
                and sub.value.startswith(env.OPTION_PREFIX):
            return True
        if isinstance(sub, ast.Name) and sub.id in SLIMGC_NAMES:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in SLIMGC_NAMES:
            return True
    return False


def slimgc_reads(source):
    """Line numbers of the statements in `source` that read os.environ (or call os.getenv)
    and name a SLIMGC_* variable; `os.environ[NAME] = value` writes and is not counted."""
    lines = []
    for stmt in ast.walk(ast.parse(source)):
        if not isinstance(stmt, ast.stmt):
            continue
        if isinstance(stmt, ast.Assign) and all(
                isinstance(t, ast.Subscript) and _reads_environ(t.value) for t in stmt.targets):
            continue  # a write for a child process
        for node in _headers(stmt):
            if _reads_environ(node) and _names_slimgc(node):
                lines.append(stmt.lineno)
    return sorted(set(lines))


def test_the_checker_finds_reads_and_spares_writes():
    assert slimgc_reads('import os\nx = os.environ.get("SLIMGC_DATA_DIR")\n') == [2]
    assert slimgc_reads("import os\nx = os.getenv(SSH_VAR)\n") == [2]
    assert slimgc_reads("import os\nif env.LAUNCH_INDEX_VAR in os.environ:\n    pass\n") == [2]
    assert slimgc_reads('import os\nd = {k: v for k, v in os.environ.items()\n'
                        '     if k.startswith("SLIMGC_")}\n') == [2]
    assert slimgc_reads('import os\nos.environ["SLIMGC_TRACE"] = "t.json"\n') == []
    assert slimgc_reads('import os\nx = os.environ.get("HOME")\n') == []


def test_no_module_but_env_reads_a_slimgc_variable():
    found = []
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            path = os.path.join(root, name)
            if not name.endswith(".py") or path == os.path.join(PACKAGE, "env.py"):
                continue
            with open(path, encoding="utf-8") as f:
                lines = slimgc_reads(f.read())
            found += ["%s:%d" % (os.path.relpath(path, PACKAGE), n) for n in lines]
    assert found == [], "read SLIMGC_* through slimgc_mx/env.py instead: %s" % found


#: The experiments: they may read their jobs' own variables (docs/architecture.md).
EXPERIMENTS = os.path.join(PACKAGE, "bench")


def _copies_whole(node, parents):
    """True when os.environ at `node` is copied whole into a child's environment:
    `{**os.environ, ...}` or `dict(os.environ, ...)`."""
    parent = parents.get(node)
    if isinstance(parent, ast.Dict) and None in parent.keys and \
            parent.values[parent.keys.index(None)] is node:
        return True
    return (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name)
            and parent.func.id == "dict" and parent.args[:1] == [node])


def environ_reads(source):
    """Line numbers where `source` reads the environment: any use of os.environ or os.getenv
    but a write (`os.environ[NAME] = value`) and a whole copy for a child process."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "os" and node.attr in ("environ", "getenv")):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store):
            continue
        if not _copies_whole(node, parents):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_environment_check_finds_every_read():
    assert environ_reads('import os\nx = os.environ.get("RANK")\n') == [2]
    assert environ_reads('import os\nif "WORLD_SIZE" not in os.environ:\n    pass\n') == [2]
    assert environ_reads('import os\nx = int(os.environ["RANK"])\n') == [2]
    assert environ_reads('import os\nx = os.getenv("HOME")\n') == [2]
    assert environ_reads('import os\ndef f(e=None):\n    e = os.environ if e is None else e\n'
                         ) == [3]
    assert environ_reads('import os\nos.environ["SLIMGC_TRACE"] = "t.json"\n') == []
    assert environ_reads('import os\nspawn({**os.environ, **extra})\n') == []
    assert environ_reads('import os\nspawn(dict(os.environ, PYTHONPATH="."))\n') == []


def test_no_library_module_but_env_reads_the_environment():
    """torch's rendezvous variables, the launcher's --env NAME and its OMP_NUM_THREADS and
    engine-thread checks go through env.py too; a child's environment may copy it whole."""
    found = []
    for root, _, files in os.walk(PACKAGE):
        if root == EXPERIMENTS or root.startswith(EXPERIMENTS + os.sep):
            continue
        for name in sorted(files):
            path = os.path.join(root, name)
            if not name.endswith(".py") or path == os.path.join(PACKAGE, "env.py"):
                continue
            with open(path, encoding="utf-8") as f:
                lines = environ_reads(f.read())
            found += ["%s:%d" % (os.path.relpath(path, PACKAGE), n) for n in lines]
    assert found == [], "read the environment through slimgc_mx/env.py instead: %s" % found


def test_torch_rendezvous_and_the_launcher_readers():
    job = env.torch_rendezvous({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                                "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "3",
                                "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert job == (1, 2, "h", 29500, True, "3")
    job = env.torch_rendezvous({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h",
                                "MASTER_PORT": "1"})
    assert (job.agent_store, job.attempt) == (False, "0")
    with pytest.raises(RuntimeError, match="variables MASTER_ADDR, MASTER_PORT are not set"):
        env.torch_rendezvous({"RANK": "0", "WORLD_SIZE": "1"})
    assert env.torch_launched({"WORLD_SIZE": "2"}) and not env.torch_launched({})
    assert env.is_set("X", {"X": ""}) and not env.is_set("X", {})
    assert env.value("X", environ={"X": "1"}) == "1" and env.value("X", "d", {}) == "d"


def test_the_project_variables_are_no_unknown_options(monkeypatch):
    monkeypatch.setattr(config, "_WARNED", set())
    environ = {env.DATA_DIR_VAR: "/data", env.VENV_VAR: ".venv", env.PYTHON_VAR: "python3",
               env.NO_OPENMP_VAR: "1", "SLIMGC_THRESHOLD": "0.25"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config.SlimGCConfig.from_sources(environ=environ)
    assert [str(w.message) for w in caught] == []
    assert cfg.threshold == 0.25
    with pytest.warns(UserWarning, match="SLIMGC_DATA_DIRS is not a slimgc option.*"
                                         "did you mean SLIMGC_DATA_DIR"):
        config.SlimGCConfig.from_sources(environ={"SLIMGC_DATA_DIRS": "/data"})


def test_the_readers():
    assert env.data_dir({}) is None and env.data_dir({env.DATA_DIR_VAR: ""}) is None
    assert env.data_dir({env.DATA_DIR_VAR: "/d"}) == "/d"
    assert env.ssh_program({}) == "ssh"
    assert env.ssh_program({env.SSH_VAR: "ssh -p 2222"}) == "ssh -p 2222"
    got = env.project_variables({"SLIMGC_B": "2", "HOME": "/h", "SLIMGC_A": "1"})
    assert list(got.items()) == [("SLIMGC_A", "1"), ("SLIMGC_B", "2")]


def test_mnist1d_is_kept_where_slimgc_data_dir_says(monkeypatch, tmp_path):
    arrays = (np.zeros((4, 40), np.float32), np.arange(4, dtype=np.int32),
              np.ones((2, 40), np.float32), np.arange(2, dtype=np.int32))
    monkeypatch.setattr(datasets, "_mnist1d_arrays", lambda: arrays)
    monkeypatch.setenv(env.DATA_DIR_VAR, str(tmp_path / "cache"))
    got = datasets._mnist1d()
    assert (tmp_path / "cache" / "mnist1d.npz").exists()
    monkeypatch.setattr(datasets, "_mnist1d_arrays", lambda: pytest.fail("not read back"))
    again = datasets._mnist1d()
    for a, b in zip(got, again):
        np.testing.assert_array_equal(a, b)
