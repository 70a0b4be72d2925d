"""``python -m hvd_sgp.spare SCRIPT ARGS`` (or ``-m MODULE ARGS``): a warm spare's process,
spawned by the world (hvd_sgp/common/spares.py); MPI starts before the script's imports."""
import sys

from hvd_sgp.common import spares

if __name__ == "__main__":
    spares.run_as_spare(sys.argv[1:])
