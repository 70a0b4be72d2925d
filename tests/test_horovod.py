"""Horovod itself beside hvd_sgp (built with scripts/install_horovod.sh; not in the default
install, so this skips, saying why, where Horovod is absent)."""
import importlib.util

import pytest

from mpi_launch import run_mpi

HOROVOD = importlib.util.find_spec("horovod") is not None


@pytest.mark.skipif(not HOROVOD, reason="Horovod is not installed (scripts/install_horovod.sh "
                                        "builds it; it is kept out of the default install)")
def test_horovod_script_with_hvd_sgp_optimizer():
    out = run_mpi(2, "horovod_checks.py").stdout
    assert "all horovod checks passed on 2 ranks" in out


def test_top_level_optimizer_dispatches_without_importing_the_other_framework():
    import subprocess
    import sys
    code = ("import sys, torch, hvd_sgp\n"
            "m = torch.nn.Linear(2, 1)\n"
            "opt = hvd_sgp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))\n"
            "import torch.optim\n"
            "assert isinstance(opt, torch.optim.SGD)\n"
            "assert 'tensorflow' not in sys.modules\n"
            "print('dispatch ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "dispatch ok" in out.stdout, out.stderr[-2000:]
    with pytest.raises(TypeError, match="torch.optim.Optimizer or a Keras"):
        import hvd_sgp
        hvd_sgp.DistributedOptimizer(object())
