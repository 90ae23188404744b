"""`conduit gateway` is HTTP only: what its process imports holds no torch, no actors, no GPU code."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import runtime.cli, runtime.logging
runtime.cli.build_parser().parse_args(["gateway", "--worker-urls", "http://127.0.0.1:1"])
import runtime.http.gateway.app
heavy = ("torch", "runtime.actors", "runtime.gpu", "runtime.engine", "transformers")
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith(heavy)))
"""


def test_the_gateway_process_imports_no_torch_and_no_actors():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
