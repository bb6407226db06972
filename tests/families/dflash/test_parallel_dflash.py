"""DFlash draft training under FSDP2 (``DFlashModule.configure_model`` -> ``lit_dllm.parallel.parallelize``) on CPU:
two gloo processes under ``lightning.Trainer`` with ``ModelParallelStrategy`` follow the single-process run step by
step (``tests/multigpu/check_dflash_parallel.py``, the GPU check, on its CPU path)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_two_fsdp2_processes_follow_the_single_process_run():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "tests/multigpu/check_dflash_parallel.py", "--accelerator=cpu", "--steps=3"]
    result = subprocess.run(command, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "PASS" in result.stdout
