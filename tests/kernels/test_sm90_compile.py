"""Kernels compiled for Hopper (sm_90) on the CPU, the way the GPU launcher specialises them.

The interpreter runs a kernel's Python, not its compilation: code that only the compiler rejects
passes every interpreter test and fails on the first GPU call. One such bug reached main: the
launcher turns an int argument equal to 1 (one token at batch-1 decode) into a Python constant,
and `num_tokens.to(...)` then failed to compile. sm90_compile.py compiles the kernels that take
such counts with them set to 1, through Triton's compiler and ptxas, in a process without the
interpreter.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sm90_compile import CASES  # noqa: E402


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(HERE.parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(HERE / "sm90_compile.py")], check=False, capture_output=True, text=True,
                          env=env, timeout=600)
    lines = [ln.split(" ", 1) for ln in proc.stdout.splitlines() if ln.startswith(("OK ", "FAIL "))]
    out = {rest.split(":", 1)[0]: status + " " + rest for status, rest in lines}
    if not out:
        pytest.fail(f"sm90_compile.py printed no result (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_compiles_for_sm90(results, case):
    assert results.get(case, "missing").startswith("OK"), results.get(case, f"{case}: no result")
