"""What every process runs: a bare `python` is the launcher's own interpreter, a Python
script or module runs through slimgc_mx.run (kvstore='slimgc' then means SlimGC without
`import slimgc_mx`), and a missing script is named before any process starts."""
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from typing import List, Optional

from .errors import LaunchError

RUN_MODULE = "slimgc_mx.run"
BARE_PYTHONS = ("python", "python3")
_PYTHON_WORD = re.compile(r"python[0-9.]*$")
# Interpreter options that change nothing about what the job can import.
_SAFE_FLAGS = set("uBbOqvdR")
# Characters that make a shell string more than one plain command.
_SHELL_SPECIAL = set("|&;<>()$`\\*?[]{}~#!\n")


@dataclass
class Prepared:
    """The command every process runs, the Python that runs it (when known), and why the
    launcher left it as given (when it did)."""

    command: List[str]
    interpreter: Optional[str] = None
    as_given: Optional[str] = None


def as_argv(command: List[str]) -> Optional[List[str]]:
    """COMMAND as an argv: several arguments as they are; one shell string only when it is
    a plain command (no operators, expansions or leading VAR=value), else None."""
    if len(command) > 1:
        return list(command)
    if not command or _SHELL_SPECIAL & set(command[0]):
        return None
    try:
        words = shlex.split(command[0])
    except ValueError:
        return None
    if not words or "=" in words[0]:
        return None
    return words


def is_python(word: str) -> bool:
    """True for python, python3, python3.11 or a path ending in one."""
    return bool(_PYTHON_WORD.match(os.path.basename(word)))


def split_python(argv: List[str]):
    """(options, '-m' or the script, module or None, the arguments after) for
    `python [OPTIONS] SCRIPT ARGS` and `python [OPTIONS] -m MODULE ARGS`; None for anything
    else (-c, stdin, options that change what can be imported)."""
    opts, i = [], 1
    while i < len(argv):
        word = argv[i]
        if word == "-m" or (word.startswith("-m") and len(word) > 2):
            module = word[2:] or (argv[i + 1] if i + 1 < len(argv) else None)
            if module is None:
                return None
            return opts, "-m", module, argv[i + (1 if word[2:] else 2):]
        if word in ("-W", "-X"):
            if i + 1 >= len(argv):
                return None
            opts += argv[i:i + 2]
            i += 2
            continue
        if word.startswith(("-W", "-X")) or (
                len(word) > 1 and word[0] == "-" and set(word[1:]) <= _SAFE_FLAGS):
            opts.append(word)
            i += 1
            continue
        if word.startswith("-"):
            return None
        return opts, word, None, argv[i + 1:]
    return None


def same_python(word: str) -> bool:
    """True when `word` (a path or a name on PATH) is the interpreter running the launcher,
    or another name for it in the same bin directory (python3 beside python)."""
    found = shutil.which(word)
    if found is None:
        return False
    mine, theirs = os.path.abspath(sys.executable), os.path.abspath(found)
    return theirs == mine or (os.path.dirname(theirs) == os.path.dirname(mine)
                              and os.path.realpath(theirs) == os.path.realpath(mine))


def _check_script(script: str, cwd: str):
    if not os.path.exists(os.path.join(cwd, script)):
        raise LaunchError(f"no script {script!r} (looked in {cwd}): every process would fail "
                          f"to open it; fix the path in COMMAND")


def _argv(argv: List[str]) -> List[str]:
    """`argv` as a COMMAND: a lone word becomes a quoted shell string (one argument is one)."""
    return argv if len(argv) > 1 else [shlex.quote(argv[0])]


def prepare(command: List[str], launcher: str, cwd: str, as_is: bool = False) -> Prepared:
    """The command to launch, for --launcher `launcher` with working directory `cwd`.

    Local and netns: a bare python/python3 becomes sys.executable, a missing script is a
    LaunchError, and `python [OPTS] SCRIPT|-m MODULE` on this interpreter runs through
    `-m slimgc_mx.run`. ssh: the paths are the hosts', so the command stays as given.
    as_is: keep the command word for word (the script is still checked).
    """
    if not command:
        return Prepared(command)
    argv = as_argv(command)
    if argv is None:
        return Prepared(command, None, "COMMAND is a shell string with operators")
    if not is_python(argv[0]):
        return Prepared(command, None, "COMMAND does not start with python")
    if launcher == "ssh":
        return Prepared(command, argv[0], "ssh: the hosts' Python runs COMMAND")
    if argv[0] in BARE_PYTHONS and not as_is:
        argv = [sys.executable] + argv[1:]
    interpreter = shutil.which(argv[0]) or argv[0]
    parts = split_python(argv)
    if parts is None:
        return Prepared(command if as_is else _argv(argv), interpreter,
                        "COMMAND is not `python SCRIPT` or `python -m MODULE`")
    opts, target, module, rest = parts
    if module is None:
        _check_script(target, cwd)
    elif module == RUN_MODULE:
        if rest and not rest[0].startswith("-"):
            _check_script(rest[0], cwd)
        return Prepared(argv, interpreter)
    if as_is:
        return Prepared(command, interpreter, "--as-is")
    if not same_python(argv[0]):
        return Prepared(_argv(argv), interpreter, f"{argv[0]} is not the launcher's Python")
    run_target = [target] if module is None else ["-m", module]
    return Prepared([argv[0]] + opts + ["-m", RUN_MODULE] + run_target + rest, interpreter)
