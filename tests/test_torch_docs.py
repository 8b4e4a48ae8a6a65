"""docs/pytorch.md's training script, run as the page says (torchrun, two ranks)."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a two-rank job under torchrun

from torch_launch import ROOT, free_port  # noqa: E402


def test_the_pages_script_trains_under_torchrun(tmp_path):
    text = open(os.path.join(ROOT, "docs", "pytorch.md")).read()
    script = re.search(r"```python\n(# train_torch.py\n.*?)```", text, re.S).group(1)
    assert "torchrun --nproc-per-node 2 train_torch.py" in text
    path = tmp_path / "train_torch.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIMGC_")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-port", str(free_port()), str(path)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = float(re.search(r"^loss (\S+)", proc.stdout, re.M).group(1))
    assert loss < 0.5  # trained (about 1.4 at the start)
    assert int(re.search(r"^(\d+) compressed transfers", proc.stdout, re.M).group(1)) > 0
