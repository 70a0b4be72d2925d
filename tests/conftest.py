"""The suite's launches start hundreds of Python processes, each importing hvd_sgp and the test
helpers from this checkout. Where the environment turns bytecode caching off
(PYTHONDONTWRITEBYTECODE, as this project's sandbox does), every one of them compiled those
modules again: 0.16 s of CPU per process, measured. The launched processes may cache them
(in __pycache__/, which git ignores)."""
import os

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
