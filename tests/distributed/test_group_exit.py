import subprocess
import sys

from tests.helpers.harness import REPO, free_port


def test_process_groups_end_before_the_interpreter_exits():
    """A gloo group alive into interpreter finalization can abort a finished rank (SIGABRT): the strategy
    registers its destruction at exit, which also lets go of the default group that
    ``torch.distributed.optim``, imported after ``init_process_group``, keeps as a default argument. A
    handler registered earlier runs later and sees the group gone and no gloo thread left."""
    code = f"""
import atexit, os, torch.distributed as dist
def at_exit():
    names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print("initialized at exit:", dist.is_initialized())
    print("gloo threads at exit:", sum("gloo" in name for name in names))
atexit.register(at_exit)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
import torch.distributed.optim  # binds the default group as a default argument
from lightning_parallel.distributed.group_exit import destroy_process_groups_at_exit
destroy_process_groups_at_exit()
destroy_process_groups_at_exit()  # once per process, however often it is called
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "initialized at exit: False" in done.stdout
    assert "gloo threads at exit: 0" in done.stdout, done.stdout
