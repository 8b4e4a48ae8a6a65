"""Node runners: how the launcher starts a command with extra environment on one node."""
import os
import shlex
import subprocess
from typing import Dict, List, Optional


def shell_command(command: List[str]) -> str:
    """One argument is a shell string as is; several are an argv, quoted into one."""
    return command[0] if len(command) == 1 else shlex.join(command)


def local_argv(command: List[str]) -> List[str]:
    """The argv that runs `command` here: one argument through /bin/sh, several as they are."""
    return ["/bin/sh", "-c", command[0]] if len(command) == 1 else list(command)


class Runner:
    """How to start a command with extra environment on one node; subclass for new node kinds.

    start() returns a Popen whose process leads its own session (so its whole group can be
    killed), with stdout/stderr as pipes. A runner must make the job on the node end when
    that process is killed.
    """

    def start(self, node: Optional[str], command: List[str], env: Dict[str, str],
              cwd: str) -> subprocess.Popen:
        raise NotImplementedError

    @staticmethod
    def spawn(argv: List[str], env: Optional[Dict[str, str]], cwd: Optional[str],
              stdin=subprocess.DEVNULL) -> subprocess.Popen:
        """Popen in a new session with piped output: the common part of every runner."""
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)


class LocalRunner(Runner):
    """Run on this machine with the launcher's environment plus `env`."""

    def start(self, node, command, env, cwd):
        return self.spawn(local_argv(command), {**os.environ, **env}, cwd)


# Remote side of an ssh task: run the job in its own session and kill that session when
# stdin reaches EOF (the launcher's ssh client died or the launcher closed it), and when
# the job's main process exits (no grandchild outlives it).
# (fd 3 keeps stdin: a background list without job control otherwise reads /dev/null.)
_REMOTE_WATCH = (
    'exec 3<&0; if command -v setsid >/dev/null 2>&1; then setsid sh -c "$1" </dev/null 3<&- & '
    'else sh -c "$1" </dev/null 3<&- & fi; c=$!; '
    '(cat <&3 >/dev/null; kill -TERM -$c || kill -TERM $c; sleep {grace}; kill -KILL -$c) '
    '2>/dev/null & w=$!; exec 3<&-; wait $c; s=$?; kill $w 2>/dev/null; '
    'kill -TERM -$c 2>/dev/null && sleep 1 && kill -KILL -$c 2>/dev/null; exit $s'
)


class SshRunner(Runner):
    """Run on a host through `ssh -o StrictHostKeyChecking=no HOST 'cd DIR && export ... && CMD'`."""

    def __init__(self, ssh: List[str], ports: Dict[str, Optional[int]], kill_grace: float):
        self.ssh = ssh
        self.ports = ports
        self.kill_grace = kill_grace

    def remote_command(self, command, env, cwd) -> str:
        """The string the remote shell runs: cd, export the job's variables, run under the watcher."""
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        watch = _REMOTE_WATCH.replace("{grace}", str(max(1, int(self.kill_grace + 0.5))))
        return (f"cd {shlex.quote(cwd)} && export {exports} && "
                f"exec sh -c {shlex.quote(watch)} slimgc-job {shlex.quote(shell_command(command))}")

    def start(self, node, command, env, cwd):
        argv = list(self.ssh) + ["-o", "StrictHostKeyChecking=no"]
        if self.ports.get(node):
            argv += ["-p", str(self.ports[node])]
        argv += [node, self.remote_command(command, env, cwd)]
        return self.spawn(argv, None, None, stdin=subprocess.PIPE)
